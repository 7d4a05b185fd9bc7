// Continuous batching over a Model: requests join and leave between steps,
// prompts are prefilled in chunks mixed with other requests' decode steps, admission waits for a
// free sequence and enough free KV pages, and a request whose step finds the KV cache full is
// preempted: its sequence is freed and it is recomputed (prompt + tokens so far) when readmitted.
// With prefix caching on the model, a request's first step restores its longest kept prefix, and
// its prefill chunks stop at its own block boundary to keep that prefix for later requests.
// With SchedulerOptions::batchPrefillCalls the prefill chunks of a step run together through
// Model::prefillBatch and its verifications through Model::verifyDrafts, as many requests per call
// as the prefill program's rows take (hybrid-compile --prefill-tokens; otherwise one request per
// call); the plain decode steps together through Model::decodeBatch,
// as many per call as the plan's decode program takes (hybrid-compile --decode-batch; one at a
// time with a plan for one). Where the KV cache may lack a page for every row, they run one
// request per call, so that one finding it full is preempted alone.
// Each request chooses its tokens by its own SamplingParams (greedy by default): decode steps
// through Model::decodeBatchChoose, a prefill's last row on the host, the n-th generated token
// with the uniform samplingUniform(seed, n), so a seeded request's tokens do not depend on the
// requests it is batched with. Speculative steps verify drafts greedily, so sampled requests run
// without drafts (plain decode steps) even when SchedulerOptions::draftTokens is set.
#pragma once

#include "hybrid/runtime/Draft.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Sampling.h"
#include "hybrid/runtime/Status.h"

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace hybrid {

struct GenerationRequest {
  std::vector<int64_t> prompt;
  int64_t maxNewTokens = 16;
  std::vector<int64_t> stopTokens; // generating one of these ends the request (it is emitted)
  SamplingParams sampling;         // greedy unless set
};

// What a step did for one request: a generated token, or an error; `finished` on its last event.
struct TokenEvent {
  uint64_t request = 0;
  int64_t token = -1;
  bool finished = false;
  std::string error;
};

struct SchedulerOptions {
  int64_t prefillChunkTokens = 256; // prompt tokens a prefilling request gets per step
  // Several requests' prefill chunks (and verifications) per prefill program call, up to the
  // plan's rows; off: one request per call. Off by default: on the H200 a cuda call of 32
  // segments of 256 rows takes 2.5x a one-sequence call's time per row (hybrid-bench serve, 64 x
  // 512-token prompts: 1358 output tokens/s batched, 1728 one per call; docs/performance.md).
  bool batchPrefillCalls = false;
  // Speculative decoding with drafts of at most this many tokens per decode step (0: off) from
  // `draftSource`; the length adapts per request to its acceptance. Tokens do not change.
  // Greedy requests only: drafts are verified by argmax, so sampled requests decode plainly. A
  // source the model cannot serve (mtp without an `mtp` program) makes submit() refuse.
  int64_t draftTokens = 0;
  DraftSourceKind draftSource = DraftSourceKind::PromptLookup;
  // The replay source's acceptance and seed (benchmark only: hybrid-bench spec; each request
  // then needs its reference run, Scheduler::submit's replayContinuation).
  ReplayOptions replay = {};
  // Speculate only where it pays: a request verifies its drafts (one pass of its own) only while
  // its expected tokens per pass (1 + its running mean of accepted drafts) over the measured
  // seconds of a pass beat a plain decode row's rate (a batched decode step's seconds over its
  // rows); otherwise it joins the batched decode step, i.e. its drafts back off to 0. Before a
  // pass has been timed the requests probe. Off: every greedy request speculates.
  // Acceptance varies along a text and a pass's cost with the batch, so a request that declined
  // kReprobeAfter steps probes again (one pass, which updates its mean and the pass's cost like
  // any other); each probe after which drafting still does not pay doubles the steps it waits
  // next, up to kReprobeAfterMax, and a step where drafting pays resets it. The requests due to
  // probe in a step probe together, in one verification call: a batched pass costs far less a
  // sequence than one alone (Kimi-Linear-48B on the H200: 1.3 ms a sequence in a pass of 32
  // against 7.3 ms alone, where a decode row costs 0.5 ms). So probing costs at most one call
  // per step and, for a request whose drafting never pays, one pass per kReprobeAfterMax of its
  // steps;
  // none while even a pass that accepted all draftTokens would not pay (a large batch), once
  // kTimedPassesBeforeGivingUp passes are timed: the cuda device runs a pass shape's first call
  // eagerly and captures its graph on the second, so the first pass can cost several replays.
  bool draftOnlyWhenItPays = false;
  static constexpr int64_t kReprobeAfter = 8, kReprobeAfterMax = 256,
                           kTimedPassesBeforeGivingUp = 3;
  // On a model that is not batch-invariant (Model::batchInvariant: the cuda device without
  // --batch-invariant) a verification pass gives a row other last bits than the batched decode
  // step it replaces (other kernels for other row counts), and greedy tokens can follow; so there
  // a request speculates only while it is the one request decoding, where pass and decode step
  // take the same decode-size kernels (greedy tokens identical on the golden checkpoints and
  // Kimi-Linear-48B shapes; issue 9), and a larger batch decodes plainly: its tokens are those
  // of decoding without speculation. (A batched pass would pay only on batch-invariant kernels
  // anyway: on the H200 it kept 35% of replayed drafts and ran 0.52x.) Empty: what the model
  // says; tests set it to stand in for such a device on the cpu one.
  std::optional<bool> batchInvariantModel = {};
  // The clock draftOnlyWhenItPays times proposals, passes and decode steps with, in seconds
  // (empty: std::chrono::steady_clock). Tests pass a fake one to make its choices deterministic.
  std::function<double()> clock = {};
};

struct SchedulerStats {
  int64_t waiting = 0;
  int64_t running = 0;
  int64_t finished = 0;
  int64_t preemptions = 0;
  int64_t promptTokens = 0;       // of every admitted request (again after a preemption)
  int64_t cachedPromptTokens = 0; // restored from the prefix cache instead of computed
  int64_t cancelled = 0;
  int64_t verifySteps = 0;    // speculative decoding: verification passes,
  int64_t draftedTokens = 0;  // draft tokens proposed
  int64_t acceptedTokens = 0; // and accepted
  // Decode steps of a speculating request without a pass (draftOnlyWhenItPays): drafting did
  // not pay, or the source proposed nothing (a plain batched step is cheaper than a pass). Its
  // probes are passes (verifySteps).
  int64_t declinedDrafts = 0;
  int64_t decodeBatches = 0;     // Model::decodeBatch calls
  int64_t batchedDecodeRows = 0; // decode steps they ran
  // Prefill program calls that ran several requests (Model::prefillBatch, verifyDrafts) and the
  // requests they ran.
  int64_t prefillBatches = 0;
  int64_t batchedPrefillSegments = 0;
  int64_t verifyBatches = 0;
  int64_t batchedVerifySequences = 0;
};

class Scheduler {
public:
  explicit Scheduler(Model &model, SchedulerOptions options = {});
  ~Scheduler();
  Scheduler(const Scheduler &) = delete;
  Scheduler &operator=(const Scheduler &) = delete;

  // Queues a request; its id names its events. Refuses (with the reason) an empty prompt, a token
  // outside the vocabulary, maxNewTokens < 1, sampling parameters out of range (naming the
  // field), and a prompt plus maxNewTokens past the model's context or past the whole KV cache.
  // `replayContinuation` (benchmark only: the replay draft source, Draft.h) is what a plain
  // greedy run of the same request generated; a greedy request is refused without one when the
  // scheduler drafts from replay, and other sources ignore it.
  StatusOr<uint64_t> submit(GenerationRequest request,
                            std::span<const int64_t> replayContinuation = {});
  // Admits waiting requests in arrival order while a sequence and the pages for their prompt are
  // free, then advances every running request by one prefill chunk or one decode step. Returns
  // this step's events, in the order the requests were admitted.
  std::vector<TokenEvent> step();
  // Drops a waiting or running request (its client went away): its sequence is freed and it
  // produces no more events. False when there is no such request (finished, or never queued).
  bool cancel(uint64_t request);
  // Nothing waiting or running.
  bool idle() const;
  SchedulerStats stats() const;

private:
  struct Active;
  struct Outcome;
  bool speculates(const Active &active) const;
  bool admit(Active &active);
  // KV pages `active`'s next step takes beyond those its sequence holds (an estimate: a prefill
  // chunk, one decode token, or a speculative step's token and drafts).
  int64_t stepPages(const Active &active) const;
  int64_t runningStepPages() const; // stepPages summed over the running requests
  // Before a step: while the running requests' steps need more pages than are free, the
  // youngest gives its pages up (preempted, to recompute later), so the oldest always progresses.
  void reserveStepPages();
  // Back to the front of the queue without its sequence (pages freed), to recompute later.
  void preempt(std::unique_ptr<Active> active);
  // A request's step other than a plain decode: a prefill chunk of `tokens`, or a verification
  // of its last token and `draft` (tokens = 1 + its size).
  struct OwnStep {
    enum Kind { None, Prefill, Verify } kind = None;
    int64_t tokens = 0;
    std::vector<int64_t> draft;
    double proposeSeconds = 0; // what drafting it took
  };
  void planOwnStep(Active &active, Outcome &outcome, OwnStep &work, bool &decodes);
  std::vector<std::vector<size_t>> packCalls(const std::vector<size_t> &group,
                                             const std::vector<OwnStep> &work) const;
  void prefillGroup(const std::vector<size_t> &group, const std::vector<OwnStep> &work,
                    std::vector<Outcome> &outcomes);
  void verifyGroup(const std::vector<size_t> &group, const std::vector<OwnStep> &work,
                   std::vector<Outcome> &outcomes);
  void verifyAlone(Active &active, Outcome &outcome);
  // `verifying`: the requests that verify this step instead (for the decode row's cost).
  void decodeGroup(const std::vector<size_t> &group, std::vector<Outcome> &outcomes,
                   size_t verifying);

  Model &model_;
  SchedulerOptions options_;
  StatusOr<std::unique_ptr<DraftSource>> drafts_ = std::unique_ptr<DraftSource>();
  uint64_t nextId_ = 1;
  // draftOnlyWhenItPays's measurements (0: none yet).
  double verifyPassSeconds_ = 0, decodeRowSeconds_ = 0;
  int64_t timedPasses_ = 0;     // verification calls whose time verifyPassSeconds_ has blended
  bool batchInvariant_ = true;  // the model's (or batchInvariantModel's) answer
  size_t decodingRequests_ = 0; // running requests past their prompts at this step's start
  // Whether a speculating request drafts this step: it verifies (drafting pays, or the initial
  // probe), it probes again after its back-off, or it declines.
  enum class Drafting { Verifies, Reprobes, Declines };
  Drafting drafting(const Active &active);
  double now() const;
  std::deque<std::unique_ptr<Active>> waiting_;
  std::vector<std::unique_ptr<Active>> running_; // in admission order
  SchedulerStats stats_;
};

} // namespace hybrid
