// The runtime's front door: load a compiled model directory (plan.hyplan + weights.hyw), then run
// sequences through its prefill and decode programs.
//
//   auto model = Model::load("out", {});          // verify plan + archive, allocate pools once
//   auto sequence = (*model)->newSequence();       // a KV-cache page table + a state slot
//   auto logits = (*sequence)->prefill(promptIds); // [T, vocab]
//   auto next = (*sequence)->decode(token);        // [vocab]
//
// Devices: `cpu` runs every kernel through the reference implementations in kernels/ref (fp32
// accumulation, all cores); it is the oracle the `cuda` device is checked against. `cuda` (in
// builds with CUDA) runs the plan's dispatches on the GPU, and those it has no GPU kernel for yet
// on the cpu reference (placementReport says which). A Model runs one step at a time (its arenas
// are shared by its sequences); use one Model per thread.
#pragma once

#include "hybrid/runtime/Sampling.h"
#include "hybrid/runtime/Status.h"
#include "runtime/schema/plan_generated.h"

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace hybrid {
namespace comm {
class Communicator;
}

struct LoadOptions {
  std::string device = "cpu"; // "cpu", or "cuda" for a plan compiled with --device=cuda
  int32_t maxSequences = 4;         // sequences that can be alive at once
  int64_t maxContextTokens = 8192;  // the longest a sequence may grow
  // KV-cache capacity in tokens over all sequences; 0: maxSequences x maxContextTokens (nobody
  // ever waits for pages). Smaller budgets make a scheduler admit by free pages and preempt.
  int64_t kvCacheTokens = 0;
  bool verifyWeightContents = false; // re-hash every archive entry at load
  // cpu device: 0 runs steps in program order; any other value runs them in a random order drawn
  // from this seed that respects the plan's streams and events. Results must not change: this is
  // how tests check that the compiler's stream assignment and memory plan are race free.
  uint64_t scheduleSeed = 0;
  // cuda device: round GEMM inputs to bf16 (faster) instead of splitting them into two bf16
  // halves (about 16 significant bits, what comparisons with the fp32 oracle need).
  bool bf16GemmInputs = false;
  // cuda device: the KDA prefill kernel, "recurrent" (fp32 throughout), "chunked" (bf16 tensor
  // cores with a relative error of 2-3.5e-3 per layer, like fla and FlashKDA; docs/cuda-kernels.md)
  // or "auto" (chunked where compiled, recurrent elsewhere). Comparisons with the fp32 oracle at
  // tight tolerances take "recurrent".
  std::string kdaPrefill = "auto";
  // cuda device: a row's results do not depend on the rows that share its call, so that a
  // sequence's greedy tokens are the same in a batch of 1 or 32, and in a decode step or a
  // speculative verification pass (issue 9; docs/runtime.md): every linear layer on cuBLASLt with
  // one algorithm per shape (no decode-size GEMV), bf16 MoE experts always in the grouped
  // tensor-core form, MLA split counts from a row's positions alone, the fused KDA decode kernel;
  // tuned configurations that change arithmetic are not used. Slower at small batches. Not yet
  // covered: FP8 experts (per token up to 64 pairs, grouped on the host beyond) and the KDA
  // prefill's chunked kernel (calls of more than 16 tokens a sequence; verification passes are
  // shorter). The cpu device is batch-invariant already.
  bool batchInvariant = false;
  // cuda device: replay the decode program's GPU steps as CUDA graphs, one per state slot and run
  // of consecutive GPU steps (the steps on the cpu reference split a program into such runs),
  // captured on a slot's first decode step. Off: every kernel is launched each step.
  bool cudaGraphs = true;
  // cuda device, with cudaGraphs: replay single-sequence prefill calls of up to 16 rows (a
  // speculative verification pass, a short prompt chunk) as CUDA graphs too, one per (program,
  // rows, state slot, whether the KDA replay log is written), captured on such a call's second
  // occurrence; at most 64 are kept. Calls a graph cannot hold run eagerly (docs/runtime.md).
  bool prefillGraphs = true;
  // cuda device: keep the KDA recurrent states in bf16 instead of fp32: half their memory and
  // traffic; the kernels compute in fp32 and round the state once per call (per decode step, per
  // prefill chunk of max_tokens), so the rounding accumulates over a long generation.
  bool kdaBf16State = false;
  // Prefix caching (Sequence::prefillWithPrefixCache): how many prompt prefixes are kept (0: off)
  // and the block they are cut at: a prompt keeps its first floor(length / block) * block tokens.
  // Each kept prefix may hold up to a full context of KV pages, so the KV cache grows by that
  // many sequences' pages. On the cuda device a kept prefix's KDA states are copied from the GPU
  // when kept and back when restored.
  int32_t prefixCacheEntries = 0;
  int64_t prefixCacheBlockTokens = 64;
  // The weight archive is a synthetic one (hybrid-compile --synthetic-weights): its values are
  // generated at load from the seed it records, in place on the GPU for the cuda device and on the
  // host for the cpu device (and for the small weights the cuda device reads on the host). Must be
  // set to load such an archive and only such, so random weights are never served by accident.
  bool syntheticWeights = false;
  // cuda device: where kernel configurations tuned for this GPU are looked up (hybrid-bench tune,
  // docs/autotune.md): "default" (the compilation cache folder, cache::defaultCacheDir(); a
  // folder that cannot be opened there means no tuning), a folder (which must open), or "off".
  // A launch shape with no entry for this GPU, driver and toolkit runs the kernels' defaults.
  std::string tuningCache = "default";
  // A sharded model (hybrid-compile --shard): this rank's end of the group the plans were sharded
  // for, not owned (it must outlive the Model). The Model loads the communicator's rank's plan
  // and archive (plan.rank<r>.hyplan, weights.rank<r>.hyw) and runs its collectives over it; a
  // plan sharded for another world size or rank is refused, naming both. Null: a world of one.
  // Every rank must run the same calls (prefill, decode, ...) in the same order. The cuda device
  // issues the collectives in its streams with a device-buffer communicator (NCCL, one GPU per
  // rank) and stages them through the host with a host one (loopback, TCP; decode then eager).
  comm::Communicator *communicator = nullptr;
};

// The CUDA graphs a cuda-device Model has used so far (Model::cudaGraphCounts); all zero on the
// cpu device.
struct CudaGraphCounts {
  int64_t decodeGraphs = 0;     // decode graphs held (per GPU run and batch size: a plain
                                // step's and a chained one's)
  int64_t decodeCaptures = 0;   // decode graphs captured (again when a step's inputs move)
  int64_t prefillCaptures = 0;  // prefill / verification graphs captured
  int64_t prefillReplays = 0;   // prefill / verification calls run from a graph
  int64_t prefillEvictions = 0; // graphs destroyed to keep at most 64
  int64_t prefillEager = 0;     // prefill / verification calls run kernel by kernel
};

// What loading a synthetic archive generated (Model::weightGeneration): bytes in the stored
// dtypes, and the time it took (the device's includes waiting for the kernels).
struct WeightGeneration {
  uint64_t hostBytes = 0;
  double hostSeconds = 0;
  uint64_t deviceBytes = 0;
  double deviceSeconds = 0;
};

// Where Model::load spent its time (Model::loadTimings): wall-clock seconds (steady_clock) of
// disjoint phases, and of the whole load. Checks and small bookkeeping between the phases are in
// none of them, so the phases sum to at most totalSeconds. A phase that starts device work ends
// where the load already waits for it (the weights' uploads, the synthetic weights' generation);
// no phase adds a synchronization, so work still queued when a phase ends (a cudaMemset of the
// pools) finishes in a later phase or in the first step. The cuda phases stay zero on the cpu
// device.
struct LoadTimings {
  double planSeconds = 0;          // the plan read and verified, the weight archive opened (mmap)
  double verifyWeightsSeconds = 0; // LoadOptions::verifyWeightContents: every entry re-hashed
  double hostPoolsSeconds = 0;     // the host KV cache, recurrent-state pool and program arenas
  // fp32 host copies of weights (a synthetic archive's host generation included): every weight
  // on the cpu device, those of the steps left to the cpu reference on the cuda device.
  double hostWeightsSeconds = 0;
  // cuda device
  double cudaInitSeconds = 0;     // driver and context creation (lazy in CUDA: forced first)
  double weightBufferSeconds = 0; // the one cudaMalloc of the weight archive's size
  double weightsSeconds = 0;      // the uploads, or the synthetic generation and its wait
  double kvPoolsSeconds = 0;      // the device KV pools, their pinned page tables, CP buffers
  // Placement and per-dispatch preparation: the tuning cache, the small weights converted on
  // the host and uploaded, FP8 block scales, MoE and attention setup.
  double kernelSetupSeconds = 0;
  double devicePoolsSeconds = 0; // arenas, recurrent-state mirror, stream scratch (one cudaMalloc)
  double streamsSeconds = 0;     // streams, cuBLASLt handles, events, pinned host buffers
  double totalSeconds = 0;

  struct Phase {
    const char *name;
    double seconds;
  };
  // The phases that ran (non-zero), in load order.
  std::vector<Phase> phases() const;
  // "4.812 s (plan 0.004, host pools 0.120, ..., other 0.002)": the total, then each phase that
  // ran and the rest, in seconds.
  std::string summary() const;
};

// Which logits a prefill returns: every prompt row's, or the last row's only.
enum class PrefillLogits { AllRows, LastRow };

// What Sequence::prefillWithPrefixCache did: how many leading prompt tokens came from the cache,
// and the logits of the rest [tokens - cachedTokens, vocab].
struct CachedPrefill {
  int64_t cachedTokens = 0;
  std::vector<float> logits;
};

// The residual stream after the embedding, after each decoder layer and after the final norm
// (the plan's layer_outputs), for one prefill: layers[i] holds rows x width floats.
struct HiddenStates {
  int64_t rows = 0;
  int64_t width = 0;
  std::vector<std::vector<float>> layers;
};

// Where Model::verifyDrafts (and Sequence::verifyDraft) spent their wall-clock time so far
// (Model::verifyTimings; steady_clock seconds, summed over calls): the state snapshots, the pass
// (the prefill program's launches, the device's work and the logits' copy to the host), choosing
// the accepted tokens from the logits, and the rollbacks (KV truncation, state restore, KDA
// replay; on the cuda device only their launches: the device's share lands in the next pass).
struct VerifyTimings {
  int64_t calls = 0, sequences = 0;
  double snapshotSeconds = 0, passSeconds = 0, chooseSeconds = 0, rollbackSeconds = 0;

  // What was spent between an earlier reading and this one, every field.
  VerifyTimings operator-(const VerifyTimings &earlier) const {
    return {.calls = calls - earlier.calls,
            .sequences = sequences - earlier.sequences,
            .snapshotSeconds = snapshotSeconds - earlier.snapshotSeconds,
            .passSeconds = passSeconds - earlier.passSeconds,
            .chooseSeconds = chooseSeconds - earlier.chooseSeconds,
            .rollbackSeconds = rollbackSeconds - earlier.rollbackSeconds};
  }
};

// What Sequence::verifyDraft decided.
struct DraftVerification {
  int64_t accepted = 0;        // leading draft tokens greedy decoding would also have chosen
  std::vector<int64_t> tokens; // those, then the model's own next token
  std::vector<float> logits;   // [tokens.size(), vocab]: the logits that chose each
};

class Sequence;

// One sequence's tokens in a batched prefill (Model::prefillBatch).
struct PrefillSegment {
  Sequence *sequence = nullptr;
  std::span<const int64_t> tokens;
};

// One sequence's chosen (not yet consumed) token and its draft in a batched verification
// (Model::verifyDrafts).
struct DraftCheck {
  Sequence *sequence = nullptr;
  int64_t token = 0;
  std::span<const int64_t> draft;
};

// The main model's final hidden states (the LM head's input) of consecutive positions, as a
// sequence recorded them (Sequence::recordFinalHidden): rows [count, hidden] from firstPosition.
struct FinalHiddenRows {
  int64_t firstPosition = 0;
  std::vector<float> rows;
};

// What one run of the multi-token-prediction program gave (Sequence::runMtp).
struct MtpOutput {
  std::vector<float> logits; // [rows, vocab]: of the token after each row's token
  std::vector<float> hidden; // [rows, hidden]: the MTP layer's final hidden state per row
};

class Model;

class Sequence {
public:
  ~Sequence();
  Sequence(const Sequence &) = delete;
  Sequence &operator=(const Sequence &) = delete;

  // Tokens consumed so far (the position of the next token).
  int64_t length() const { return length_; }

  // Runs the prompt through the prefill program (in chunks of the plan's max_tokens), appending
  // to the KV cache and recurrent state. Returns logits [tokens.size(), vocab], or with
  // PrefillLogits::LastRow only the last token's [vocab] (what choosing the next token needs;
  // every row is rows x vocab floats to copy: 5.4 GB for 8K tokens of a 163,840-word vocabulary).
  StatusOr<std::vector<float>> prefill(std::span<const int64_t> tokens,
                                       HiddenStates *hidden = nullptr,
                                       PrefillLogits which = PrefillLogits::AllRows);
  // For a fresh sequence: restores the longest kept prefix of `tokens` (at most all but the last
  // token, whose logits always run), prefills the rest, and keeps this prompt's own block-aligned
  // prefix for later prompts. The results equal prefill()'s for the rows that ran. Without prefix
  // caching (LoadOptions::prefixCacheEntries = 0) it is prefill() with cachedTokens = 0.
  StatusOr<CachedPrefill> prefillWithPrefixCache(std::span<const int64_t> tokens);
  // Its two halves, for callers that prefill in their own chunks (the scheduler): restorePrefix
  // gives a fresh sequence the longest kept prefix of `tokens` (all but the last token at most)
  // and returns its length (0: none, or no prefix caching); keepPrefix keeps the sequence's
  // consumed tokens, which must be `tokens` and a whole number of blocks (best effort: nothing is
  // kept when the KV cache has no free page for a partial last page); prefixBoundary is the
  // length a prompt of `tokens` tokens keeps (0 without prefix caching).
  StatusOr<int64_t> restorePrefix(std::span<const int64_t> tokens);
  Status keepPrefix(std::span<const int64_t> tokens);
  int64_t prefixBoundary(int64_t tokens) const;
  // Speculative decoding, greedy: feeds `token` (chosen, not yet consumed) and the draft through
  // the prefill program in one pass, accepts the longest prefix of the draft that greedy
  // decoding would produce, and keeps only `token` and that prefix: the KV tail is truncated,
  // and the recurrent state is restored from a snapshot taken before the pass and rebuilt by
  // replaying the KDA inputs of the kept tokens (no per-token state copies). On the cuda device
  // the snapshot is taken off the GPU and put back, and the GPU's KDA prefill kernels rerun over
  // device copies of the kept tokens' inputs. An empty draft is one decode step.
  StatusOr<DraftVerification> verifyDraft(int64_t token, std::span<const int64_t> draft);
  // A copy of the sequence's recurrent state (every KDA layer's state and conv state), to check
  // that rollbacks leave exactly what a plain run leaves.
  StatusOr<std::vector<float>> recurrentState() const;
  // One token through the decode program; returns logits [vocab].
  StatusOr<std::vector<float>> decode(int64_t token);

  // Multi-token prediction (plans with an `mtp` program, Model::hasMtp; docs/mtp.md).
  // While on, every prefill, decode, decodeBatch and verifyDraft keeps the final hidden state of
  // each token the sequence keeps (a verification pass: only the accepted rows), where the
  // device computed it (the cuda device keeps them on the GPU); takeFinalHidden hands them over
  // in position order and forgets them. recordedPositions says which positions are held.
  void recordFinalHidden(bool on);
  FinalHiddenRows takeFinalHidden();
  struct RecordedPositions {
    int64_t first = 0;
    int64_t count = 0;
  };
  RecordedPositions recordedPositions() const { return {recordedFirst_, recordedRows_}; }
  // Positions the MTP layer's KV cache holds for this sequence.
  int64_t mtpLength() const;
  // Runs the MTP program over rows at positions [mtpLength(), + tokens.size()): row i pairs
  // hidden row i (the main model's final hidden state at that position, or the MTP's own when
  // drafts are chained) with tokens[i], the token at the next position. Appends to the MTP cache.
  StatusOr<MtpOutput> runMtp(std::span<const int64_t> tokens, std::span<const float> hidden);
  // The MTP draft source's steps, with the hidden states left where the device keeps them.
  // draftMtp runs rows at positions [mtpLength(), + tokens.size()), each fed the recorded final
  // hidden state of its position (recordFinalHidden), forgets the recorded rows and returns the
  // greedy token after the last row (the argmax of its logits, lowest id on ties);
  // draftMtpChained runs one row fed the previous MTP row's own final hidden state.
  StatusOr<int64_t> draftMtp(std::span<const int64_t> tokens);
  StatusOr<int64_t> draftMtpChained(int64_t token);
  // Forgets MTP cache positions >= length (chained drafts), or appends zero rows up to length
  // (positions whose main hidden states this sequence never saw: a restored prefix).
  Status setMtpLength(int64_t length);

private:
  friend class Model;
  Sequence(Model &model, int32_t kvSequence, int32_t stateSlot)
      : model_(model), kvSequence_(kvSequence), stateSlot_(stateSlot) {}

  // Records rows [srcRow, + rows) of the final hidden state `program`'s last run left as those
  // of positions [position, + rows), when this sequence records them.
  Status keepFinalHidden(const plan::fb::Program &program, int64_t position, int64_t srcRow,
                         int64_t rows);
  // One MTP step over `tokens` fed rows of hidden-state record `record` from `first`; returns
  // the greedy token after its last row and keeps that row's final hidden state for chaining.
  StatusOr<int64_t> mtpStep(std::span<const int64_t> tokens, int32_t record, int64_t first);
  // Its hidden-state records (Model::Impl): the main model's final hidden states, and the MTP's
  // own last one (chained drafts).
  int32_t mainRecord() const { return 2 * kvSequence_; }
  int32_t chainRecord() const { return 2 * kvSequence_ + 1; }

  Model &model_;
  int32_t kvSequence_;
  int32_t stateSlot_;
  int64_t length_ = 0;
  bool recordFinalHidden_ = false;
  int64_t recordedFirst_ = 0, recordedRows_ = 0; // positions held in mainRecord()
};

class Model {
public:
  static StatusOr<std::unique_ptr<Model>> load(const std::string &dir,
                                               const LoadOptions &options = {});
  ~Model();
  Model(const Model &) = delete;
  Model &operator=(const Model &) = delete;

  const plan::fb::Plan &plan() const;
  int64_t vocabSize() const;
  int64_t hiddenSize() const;
  // Which kernels run on the GPU and which on the cpu reference, a line per program (cuda
  // device); empty on the cpu device.
  std::string placementReport() const;
  // The CUDA graphs used so far (LoadOptions::cudaGraphs, prefillGraphs).
  CudaGraphCounts cudaGraphCounts() const;
  // What was generated at load for a synthetic archive (all zero otherwise).
  const WeightGeneration &weightGeneration() const;
  // Where load spent its time.
  const LoadTimings &loadTimings() const;

  // A fresh sequence (zero state, empty cache); fails when maxSequences are alive.
  StatusOr<std::unique_ptr<Sequence>> newSequence();

  // Batched decode: tokens[i] through the decode program for sequences[i], all in one step (the
  // plan's decode program takes up to maxDecodeBatch() of them: hybrid-compile --decode-batch).
  // Returns logits [sequences.size(), vocab]; row i equals what sequences[i]->decode(tokens[i])
  // gives (exactly on the cpu device: the same arithmetic per row). The sequences must be this
  // model's, distinct and not full; otherwise nothing runs. Like decode(), a failure while
  // running leaves the sequences' caches undefined.
  StatusOr<std::vector<float>> decodeBatch(std::span<Sequence *const> sequences,
                                           std::span<const int64_t> tokens);
  // One decode step for `rows` (as decodeBatch) that returns the token each row chooses instead
  // of its logits: row i's logits through choices[i] (Sampling.h; greedy choices give the argmax,
  // lowest id on ties). Every sampled decode step goes through here so that a device can choose
  // where the logits are (the cuda device chooses on the GPU, so only the ids come back; the
  // cpu device chooses on the host, as does the cuda device while a sequence records hidden
  // states).
  // Choices with bad parameters are refused, naming the row and field, before anything runs.
  StatusOr<std::vector<int64_t>> decodeBatchChoose(std::span<Sequence *const> rows,
                                                   std::span<const int64_t> tokens,
                                                   std::span<const TokenChoice> choices);
  // `steps` decode steps of `rows` (as decodeBatchChoose), each step's tokens the ones the step
  // before chose (the first step's: `tokens`); choices [steps * rows], step-major (each step's
  // own draws). Returns the chosen ids [steps * rows], step-major: the same as that many
  // decodeBatchChoose calls, each fed the last one's ids. The cuda device queues each step
  // before the host has seen the previous one's ids (they stay on the GPU), so the host's share
  // of a step (bookkeeping, uploads, launches) runs while the GPU works; rows that record final
  // hidden states take the step-by-step path. Refused before anything runs as
  // decodeBatchChoose refuses, and when a row lacks room for `steps` more tokens.
  StatusOr<std::vector<int64_t>> decodeSteps(std::span<Sequence *const> rows,
                                             std::span<const int64_t> tokens,
                                             std::span<const TokenChoice> choices, int64_t steps);
  // Sequences one decodeBatch() step takes: the decode program's max_tokens.
  int64_t maxDecodeBatch() const;
  // Batched prefill (varlen): each segment's tokens through the prefill program for its
  // sequence, all segments in one program call. Row-wise kernels (GEMMs, MLP, MoE, norms) run
  // once over every row; each segment keeps its own positions, KV pages, recurrent state slot
  // and conv history. Returns every row's logits in segment order [total tokens, vocab], or with
  // PrefillLogits::LastRow each segment's last row [segments, vocab]. A segment's results equal
  // its sequence's prefill() of the same tokens in one call (the same arithmetic per row on the
  // cpu device). Refused before anything runs: no segments, an empty segment, more tokens in
  // all than the prefill program's rows (maxPrefillTokens: hybrid-compile --prefill-tokens), a
  // sequence that is not this model's, appears twice or would pass maxContextTokens, and a
  // context-parallel plan (its prefill splits one sequence over the ranks). Like prefill(), a
  // failure while running leaves the sequences' caches undefined.
  StatusOr<std::vector<float>> prefillBatch(std::span<const PrefillSegment> segments,
                                            PrefillLogits which = PrefillLogits::AllRows);
  // Speculative verification of several sequences in one pass through the prefill program: each
  // check's token and draft are a segment of prefillBatch, and each sequence then keeps its
  // token and its accepted draft prefix and rolls the rest back on its own (KV tail truncated,
  // recurrent state restored from its snapshot and its kept tokens' KDA inputs replayed), as
  // Sequence::verifyDraft does. Results in check order, each equal to verifyDraft's. Drafts must
  // not be empty (a token alone is a decode step: decodeBatch); the rows (1 + draft per check)
  // must fit maxPrefillTokens. With keepLogits false the results' logits stay empty, and the
  // cuda device chooses each row's greedy token where the logits are, so only the ids come back
  // (a 32-sequence pass of 5 rows each at Kimi's 163,840-word vocabulary: 105 MB not copied to
  // the host and searched there); the tokens are the same.
  StatusOr<std::vector<DraftVerification>> verifyDrafts(std::span<const DraftCheck> checks,
                                                        bool keepLogits = true);
  const VerifyTimings &verifyTimings() const;
  // Rows one prefill program call takes (its max_tokens): the total of a prefillBatch or
  // verifyDrafts call.
  int64_t maxPrefillTokens() const;
  // The plan has a multi-token-prediction program (`mtp`: DeepSeek-V3's MTP layer), the draft
  // source of hybrid-run --draft mtp. On the cuda device it runs on the GPU.
  bool hasMtp() const;
  // Whether a row's results never depend on the rows sharing its call (a decode step alone or in
  // a batch, a verification pass of one sequence or many): the cpu device's always, the cuda
  // device's with LoadOptions::batchInvariant where every layer's kernels take it (not FP8 MoE
  // experts: placementReport says which layers).
  bool batchInvariant() const;

  // The KV cache's pages (a scheduler admits and preempts by them) and the sequences in use.
  struct Usage {
    int64_t pageTokens = 0;
    int64_t totalPages = 0;
    int64_t freePages = 0;
    int32_t sequencesInUse = 0;
    int32_t maxSequences = 0;
    size_t keptPrefixes = 0;
    uint64_t recurrentStateBytes = 0; // one sequence's recurrent state, all layers
    // Sparse attention (DSA layers) since load, summed over layers and query tokens of every
    // step run: the positions the indexer selected (min(top_k, causal positions) per token) and
    // the causal positions it chose them from; selected / context is the attention's density.
    uint64_t sparseSelectedPositions = 0;
    uint64_t sparseContextPositions = 0;
    // The (query, key) pairs this rank's DSA indexers scored since load (a query at position p
    // scores keys 0..p): under context parallelism, this rank's share of the work.
    uint64_t indexerScoredPairs = 0;
  };
  Usage usage() const;
  // KV pages `tokens` positions of one sequence take.
  int64_t pagesFor(int64_t tokens) const;
  // LoadOptions::maxContextTokens.
  int64_t maxContextTokens() const;

  struct Impl;

private:
  friend class Sequence;
  explicit Model(std::unique_ptr<Impl> impl);
  // Refuses a batched prefill-program call (prefillBatch, verifyDrafts) of rows[i] tokens for
  // sequences[i] that cannot run, naming the caller and the sequence.
  Status checkSegments(const char *caller, std::span<Sequence *const> sequences,
                       std::span<const int64_t> rows) const;
  // decodeBatch's step; with `chosen`, the device chooses each row's token by `choices` into it
  // (the cuda device) and no logits are returned. With chainSteps > 0 (the cuda device, rows
  // that record nothing), decodeSteps' chain: that many steps queued one after another, each
  // fed the one before's ids on the device, choices and `chosen` [chainSteps * rows].
  StatusOr<std::vector<float>> decodeRows(std::span<Sequence *const> sequences,
                                          std::span<const int64_t> tokens,
                                          std::span<const TokenChoice> choices, int64_t *chosen,
                                          int64_t chainSteps = 0);
  std::unique_ptr<Impl> impl_;
};

} // namespace hybrid
