// The `cpu` device: executes a program's dispatches with the reference kernels (kernels/ref).
// Internal to the runtime; Model.cpp owns the state it works on.
#pragma once

#include "hybrid/kernels/ref/Mla.h" // RopeLayout
#include "hybrid/kernels/ref/Quant.h"
#include "hybrid/kernels/ref/TiledLayout.h"
#include "hybrid/runtime/Communicator.h"
#include "hybrid/runtime/Memory.h"
#include "hybrid/runtime/Status.h"
#include "runtime/schema/plan_generated.h"

#include <atomic>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace hybrid::cpu {

// How a weight is laid out: its logical [rows, cols] and, for a tiled weight, the tiling the
// GEMM reads directly (the runtime never converts layouts). An FP8 weight (held dequantized)
// also says how the GEMM quantizes the activations it multiplies (MODEL_SPEC 8.1).
struct WeightLayout {
  int64_t rows = 0;
  int64_t cols = 0;
  std::optional<kernels::ref::TiledLayout> tiled;
  std::optional<kernels::ref::Fp8ScaleRule> fp8Activations;
};

// Everything a step may touch: the program's arena, the fp32 weights, the sequence's caches.
// What the KDA layers of one step consumed, per token, so that the recurrent state can be rebuilt
// for a prefix of the step's tokens without re-running the model (speculative decoding's
// rollback: restore the state from before the step, then replay the accepted tokens).
struct KdaReplayLog {
  struct Layer {
    int32_t stateSlot = 0; // KdaParams.state_slot
    int64_t heads = 0, headDim = 0, convKernel = 0;
    std::vector<float> preConv; // [3][T, P]: the q, k, v projections before the conv
    std::vector<float> q, k, v, g, beta; // the recurrence's inputs [T, P] ([T, H] for beta)
  };
  std::vector<Layer> layers;
  int64_t rows = 0;
};

// Rebuilds every logged layer's state and conv state of `slot` for the first `tokens` rows of the
// logged step, from the state the slot holds now (the state before that step).
Status replayKda(RecurrentStatePool &states, int32_t slot, const KdaReplayLog &log, int64_t tokens);

// Consecutive rows of a batched step that belong to one sequence: one row each in a batched
// decode step (Model::decodeBatch), a chunk of a prompt or a token and its draft in a batched
// prefill or verification (Model::prefillBatch, verifyDrafts). The step's rows are the segments'
// rows in order.
struct BatchRow {
  int32_t kvSequence = 0;
  int32_t stateSlot = 0;
  int64_t position = 0; // of the segment's first token in its sequence
  int64_t rows = 1;
  KdaReplayLog *kdaLog = nullptr; // when set, the segment's KDA layers record their inputs
};

// What running per-sequence kernels row by row needs: a one-row arena (the program's offsets, one
// row each) and every row's staged KV rows (per row, per KV slot), kept across the step's
// dispatches as a single sequence's staging is.
struct BatchScratch {
  Arena rowArena;
  std::vector<std::vector<std::vector<float>>> staging;
};

// How a sharded plan's ranks are grouped (plan.fbs CollectiveGroup): world rank r is tensor rank
// r % tensorParallel of context rank r / tensorParallel.
struct ParallelLayout {
  int tensorParallel = 1;
  int contextParallel = 1;
};

// A context-parallel prefill step (docs/parallelism.md): the step's tokens in 2 x size chunks,
// this context rank holding chunks rank and 2 size - 1 - rank.
struct ContextShard {
  int rank = 0, size = 1;    // in the context-parallel group
  int64_t stepRows = 0;      // the step's tokens, every rank's
  std::vector<int64_t> rows; // this rank's rows (offsets in the step), ascending
  int64_t longest = 0;       // the largest rank's row count: gathers pad to it

  static ContextShard of(int rank, int size, int64_t stepRows);
  int64_t chunkBegin(int64_t chunk) const { return stepRows * chunk / (2 * size); }
  // Context rank `r`'s rows, ascending.
  std::vector<int64_t> rowsOf(int r) const;
};

struct StepContext {
  const plan::fb::Program *program = nullptr;
  Arena *arena = nullptr;
  const std::vector<std::vector<float>> *weights = nullptr; // fp32, per plan weight index
  const std::vector<WeightLayout> *weightLayouts = nullptr; // per plan weight index
  PagedKvCache *kvCache = nullptr;
  const plan::fb::CacheSpec *cacheSpec = nullptr; // precision of each KV layer
  RecurrentStatePool *states = nullptr;
  // Rows of the current step being written per KV slot: the indexer stages its keys, the MLA
  // its latents, and the MLA appends the full rows to the cache after attending.
  std::vector<std::vector<float>> *kvStaging = nullptr;
  int32_t kvSequence = 0;
  int32_t stateSlot = 0;
  int64_t rows = 0;         // tokens in this step
  int64_t firstPosition = 0; // position of the step's first token in the sequence
  bool decode = false;
  KdaReplayLog *kdaLog = nullptr; // when set, KDA layers record their per-token inputs
  // A batched step (Model::decodeBatch, prefillBatch, verifyDrafts): the rows are batch's
  // segments in order, and the per-sequence kernels run segment by segment in *batchScratch.
  // Empty: every row is this sequence's.
  std::span<const BatchRow> batch;
  BatchScratch *batchScratch = nullptr;
  // A sharded plan's collectives (AllReduceSum, AllGatherRows) run over this rank's
  // communicator, in the groups `layout` makes of its world.
  comm::Communicator *communicator = nullptr;
  ParallelLayout layout;
  // A context-parallel prefill: which rows of the step this rank holds (null otherwise). Per
  // dispatch, `rows` are those of its first output (plan.fbs ValueRows) and `rowOffsets` their
  // offsets in the step (empty: 0 .. rows - 1).
  const ContextShard *contextShard = nullptr;
  std::span<const int64_t> rowOffsets;
  // When set, the DSA indexer adds the (query, key) pairs it scores (causal ones) here.
  std::atomic<uint64_t> *indexerPairs = nullptr;
};

// Whether a kernel reads or writes a sequence's KV cache or recurrent state, or depends on the
// token's position (KDA, MLA, the DSA indexer's parts): in a batched step it runs row by row.
bool perSequenceKernel(plan::fb::KernelId kernel);

// Runs one dispatch; errors name the kernel and the offending value or weight.
Status runDispatch(const StepContext &context, const plan::fb::Dispatch &dispatch);

// runDispatch for any step: in a batched one (context.batch), row-wise kernels once over all
// rows (the same arithmetic per row as a step of fewer rows) and per-sequence kernels once per
// segment on a copy of its rows in batchScratch->rowArena (which must hold the program's arena),
// with the segment's sequence, state slot, first position, staging (batchScratch->staging: one
// entry per segment, each with one vector per KV slot, cleared at the step's start) and KDA log.
Status runStepDispatch(const StepContext &context, const plan::fb::Dispatch &dispatch);

// A plan's RoPE: which values pair up (None: no rotation), and the inverse frequencies of a
// rotaryDim-long slice (zeros without rotation). The cuda device uses the same frequencies.
kernels::ref::RopeLayout ropeLayout(const plan::fb::Rope *rope);
std::vector<float> ropeFrequencies(const plan::fb::Rope *rope, int64_t rotaryDim);

// Rows of `value` in this step: the step's, or in a context-parallel prefill as its ValueRows say
// (this rank's, its two chunks, every chunk).
int64_t valueRows(const StepContext &context, const plan::fb::Value &value);

// A float view of value `index` for the step's rows (F32 values only).
StatusOr<std::span<float>> floatValue(const StepContext &context, int32_t index);

// A context-parallel prefill's rows of this rank (`width` values each) gathered from every
// context rank into the step's position order (hidden-state dumps); every context rank calls it.
StatusOr<std::vector<float>> gatherContextRows(const StepContext &context,
                                               std::span<const float> rows, int64_t width);

} // namespace hybrid::cpu
