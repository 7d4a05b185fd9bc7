// The end-to-end benchmark behind `hybrid-bench e2e` (issue 7): a compiled model's prefill (time
// to first token) and decode (time per output token) at given batch sizes and contexts, each
// decode row with its floor: the bytes one step must move (the decode program's weights, the
// experts a batch of that size activates on average, the KV rows and recurrent states it reads
// and writes) over a bandwidth. Runs on either device; full-size shapes come from a plan compiled
// with --synthetic-weights.
#pragma once

#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Status.h"
#include "runtime/schema/plan_generated.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace hybrid::bench {

// What one decode step of `batch` sequences, each `context` positions long, must move.
struct DecodeStepBytes {
  double weights = 0;        // every weight the decode program reads (the embedding: its rows)
  double experts = 0;        // routed experts: the expected distinct ones of batch x top_k picks
  double kvCache = 0;        // latent rows (all, or the indexer's top-k) and index keys read
  double recurrentState = 0; // KDA states and conv states, read and written
  double total() const { return weights + experts + kvCache + recurrentState; }
};

// From the plan alone. `latentRowBytes` is what one cached token of a latent-cache layer takes
// in the executing device's layout (for the cuda device FP8 tiles where the plan says Fp8Tiles);
// uniformly random expert choices: E (1 - (1 - k / E)^batch) distinct experts.
DecodeStepBytes decodeStepBytes(const plan::fb::Plan &plan, int64_t batch, int64_t context);

struct E2eOptions {
  std::vector<int64_t> batches = {1, 8, 64};
  std::vector<int64_t> contexts = {1024, 8192, 131072};
  int32_t decodeSteps = 32;   // timed decode steps per row (after 2 untimed ones)
  double bandwidthTbPerSecond = 4.28; // the floor's bandwidth (H200 device copy, measured)
  uint64_t seed = 1;          // prompt token ids
  // Every sequence of a row gets the same prompt, one per context: the first prefills it (the
  // row's TTFT), the others restore its KV pages (shared until written) and recurrent states
  // from the prefix cache and prefill only the tokens past its last 64-token block; a later row
  // of the same context restores it for every sequence and reports the TTFT measured first
  // (E2eRow::ttftReused). A row of batch B at context C then costs at most one prefill of C
  // tokens instead of B (128K rows in minutes), and its KV pages take one context's memory. The
  // decode steps still read every sequence's C positions (the floor counts them per sequence),
  // but rows reading the same pages at once may hit L2 where distinct prompts would not: TPOT
  // can only be optimistic by that much. Needs a model loaded with
  // LoadOptions::prefixCacheEntries >= the distinct contexts (1 to prefill every row's own).
  bool sharedPrompt = false;
  // The timed decode steps as one Model::decodeSteps chain per call (each step fed the ids the
  // one before chose, the host's share of a step hidden behind the GPU's work) instead of a
  // decodeBatchChoose call a step fed random ids.
  bool chainedDecode = false;
  // Called with true before and false after one extra, untimed decode step of each row (a
  // profiler's collection range around one step), with the row's batch and context; may be
  // empty.
  std::function<void(bool start, int64_t batch, int64_t context)> aroundProfiledStep;
};

struct E2eRow {
  int64_t batch = 0, context = 0;
  double ttftMs = 0;          // the first sequence's prefill of `context` tokens
  bool ttftReused = false;    // shared prompt: ttftMs is an earlier row's of the same prompt
  double prefillTokensPerSecond = 0; // all `batch` prefills (shared prompt: the first one's)
  double tpotUs = 0;          // mean decode step of the batch
  double decodeTokensPerSecond = 0;
  DecodeStepBytes bytes;
  double floorUs = 0;         // bytes.total() at the bandwidth
  double ratio() const { return floorUs > 0 ? tpotUs / floorUs : 0; }
};

// Loads nothing: runs the rows on `model` (loaded for at least max(batches) sequences of
// max(contexts) + decodeSteps + 2 tokens), one row after another, freeing each row's sequences.
// `progress` (may be empty) hears a line per phase.
StatusOr<std::vector<E2eRow>> runE2e(Model &model, const E2eOptions &options,
                                     const std::function<void(const std::string &)> &progress);

// The TPOT of each batch against context, and its floor dashed, as a PNG (log2 context axis).
Status writeE2ePlot(const std::vector<E2eRow> &rows, const std::string &path);

} // namespace hybrid::bench
