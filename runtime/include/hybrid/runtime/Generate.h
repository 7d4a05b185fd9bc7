// Generation on a loaded Model (greedy, or sampled: GenerationOptions::sampling) and the file
// formats around it: prompt ids in (a list or a
// safetensors file with `input_ids`), results out in the layout of the golden files (`logits`
// [1,T,V] f32, `gen_ids` [1,N] i64, `gen_logits` [N,V] f32, optional `hidden.<i>`), and a
// comparison against a reference file that names the first layer that diverges.
#pragma once

#include "hybrid/runtime/Draft.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Sampling.h"
#include "hybrid/runtime/Status.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace hybrid {

struct GenerationResult {
  int64_t vocabSize = 0;
  std::vector<int64_t> prompt;
  // [T, V]; without GenerationOptions::keepLogits the last row only, [1, V]
  std::vector<float> promptLogits;
  std::vector<int64_t> generated;  // the chosen ids
  // [N, V]: the logits that chose each generated id; empty for sampled generation and without
  // keepLogits (decode steps then return the chosen tokens only: Model::decodeBatchChoose)
  std::vector<float> generatedLogits;
  HiddenStates hidden;             // filled when asked for
  double prefillSeconds = 0;       // time to first token
  double decodeSeconds = 0;        // the remaining N - 1 tokens
  // Speculative decoding (GenerationOptions::draftTokens): verification passes, draft tokens
  // proposed and accepted.
  int64_t verifySteps = 0;
  int64_t draftedTokens = 0;
  int64_t acceptedTokens = 0;
};

struct GenerationOptions {
  int64_t maxNewTokens = 16;
  // true: prefill once, then one decode step per token with the caches (serving);
  // false: every token re-runs the whole sequence from scratch (the golden files' semantics).
  bool useCaches = true;
  bool dumpHidden = false;
  std::vector<int64_t> stopTokens;
  // Speculative decoding: at most this many draft tokens per verification pass (0: off), from
  // `draftSource` (Draft.h). The draft length adapts to the acceptance: one longer after a fully
  // accepted draft, one shorter when less than half was accepted. Greedy outputs do not change.
  int64_t draftTokens = 0;
  // Replay is refused (kReplayNeedsReference): generation has no reference run to replay.
  DraftSourceKind draftSource = DraftSourceKind::PromptLookup;
  // Every prompt row's logits and those of each greedy step (what comparing with a golden file
  // needs). Off: the prompt's last row only, and greedy decode steps choose on the device as
  // sampled ones always do, so no step downloads a vocabulary of logits (at 163,840 entries 0.66
  // MB a step, and 5.4 GB for an 8K prompt's rows). Speculative steps keep their logits either
  // way.
  bool keepLogits = true;
  // How generate() chooses tokens (greedy by default); the n-th generated token's uniform is
  // samplingUniform(seed, n). Drafts are verified greedily, so sampled runs ignore draftTokens.
  SamplingParams sampling;
};

// Speculative against plain greedy decoding on the same prompts (hybrid-bench spec), all of them
// decoding together through a Scheduler (one request per prompt: the batch): both runs must give
// the same tokens. Decode throughput of each (tokens after every request's first, over the steps
// after every prompt was prefilled), the drafts' acceptance, and the memory a rollback keeps per
// sequence: the recurrent state's pre-verification snapshot, the logged KDA inputs of one pass
// (draftTokens + 1 rows, replayed for the accepted prefix), and the KV pages a pass can append
// past the kept tokens (truncated, not copied). With the replay source each request drafts what
// the plain run generated for it (Draft.h), right with probability replay.acceptance: the
// machinery's speedup where a draft is that good, not any draft model's.
struct SpeculationOptions {
  int64_t maxNewTokens = 32;
  int64_t draftTokens = 4;
  DraftSourceKind draftSource = DraftSourceKind::PromptLookup;
  bool draftOnlyWhenItPays = true; // SchedulerOptions::draftOnlyWhenItPays
  int64_t prefillChunkTokens = 8192;
  ReplayOptions replay = {}; // draftSource Replay only
};
struct SpeculationReport {
  int64_t prompts = 0;
  int64_t generatedTokens = 0;
  bool identical = true;
  double plainTokensPerSecond = 0;
  double speculativeTokensPerSecond = 0;
  int64_t verifySteps = 0, draftedTokens = 0, acceptedTokens = 0;
  // Prefill program calls the verifications took (several sequences' drafts per call where they
  // were batched: Model::verifyDrafts).
  int64_t verifyCalls = 0;
  int64_t declinedDrafts = 0; // decode steps that did not draft: speculation did not pay
  uint64_t stateSnapshotBytes = 0, replayLogBytes = 0, kvTailBytes = 0; // per sequence
  uint64_t rollbackBytesPerSequence = 0; // their sum
  VerifyTimings verify; // the speculative run's verification calls (Model::verifyTimings)
};
StatusOr<SpeculationReport> benchmarkSpeculation(Model &model,
                                                 const std::vector<std::vector<int64_t>> &prompts,
                                                 const SpeculationOptions &options);

// Batched decode throughput (hybrid-bench decode-batch): `batch` sequences prefilled with
// `prompt`, one warm-up step (it captures the cuda device's graphs), then `steps` steps of
// Model::decodeBatch, each row fed its own greedy token; tokens/s over the timed steps.
struct BatchDecodeReport {
  int64_t batch = 0, steps = 0;
  double stepMilliseconds = 0;
  double tokensPerSecond = 0;
};
StatusOr<BatchDecodeReport> benchmarkBatchedDecode(Model &model, std::span<const int64_t> prompt,
                                                   int64_t batch, int64_t steps);

// The next draft length after a verification pass: one longer (up to `maximum`) when the whole
// draft was accepted, one shorter (down to 1) when less than half was; unchanged otherwise or
// when nothing was drafted.
int64_t adaptDraftLength(int64_t current, int64_t maximum, int64_t drafted, int64_t accepted);

// Prompt-lookup drafting: the tokens that followed the most recent earlier occurrence of the
// context's last n tokens (n from maxNgram down to 1), at most maxTokens of them; empty when the
// tail never occurred before.
std::vector<int64_t> promptLookupDraft(std::span<const int64_t> context, int64_t maxTokens,
                                       int64_t maxNgram = 3);

// Greedy generation (options.sampling is not read): the golden comparisons' path.
StatusOr<GenerationResult> generateGreedy(Model &model, std::span<const int64_t> prompt,
                                          const GenerationOptions &options);
// Generation with options.sampling: greedy parameters are generateGreedy exactly; sampled ones
// choose the first token from the prompt's last row and every later one through
// Model::decodeBatchChoose (or, without caches, from a full forward's last row), without drafts.
// Parameters out of range are refused naming the field.
StatusOr<GenerationResult> generate(Model &model, std::span<const int64_t> prompt,
                                    const GenerationOptions &options);

// "1,2,3" or a safetensors file holding an integer tensor `input_ids` ([T] or [1, T]).
StatusOr<std::vector<int64_t>> readInputIds(const std::string &spec);

// Writes logits / gen_ids / gen_logits (and hidden.<i>, hidden.final) like golden.safetensors;
// gen_logits only when the result has them (not for sampled generation).
Status writeGeneration(const std::string &path, const GenerationResult &result);

struct ComparisonReport {
  double maxLogitsDiff = 0;       // prompt logits
  bool genIdsMatch = false;
  int64_t comparedGenIds = 0;
  std::string firstDivergingHidden; // empty: all compared hidden states within tolerance
  double firstDivergingDiff = 0;
  std::vector<std::string> lines;   // a readable report
  bool passed = false;
};

// Compares with a reference file in the golden layout: prompt logits within `tolerance` max abs
// difference, identical gen_ids on the common prefix, and hidden states layer by layer (when both
// sides have them). Reference files follow one of two conventions for the last hidden entry: HF's
// (hidden.<num_layers> is after the final norm) or one entry per layer plus one after the norm.
StatusOr<ComparisonReport> compareWithReference(const std::string &referencePath,
                                                const GenerationResult &result, double tolerance);

} // namespace hybrid
