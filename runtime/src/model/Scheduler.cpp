#include "hybrid/runtime/Scheduler.h"

#include "hybrid/runtime/Generate.h"

#include <algorithm>
#include <chrono>
#include <span>

namespace hybrid {

struct Scheduler::Active {
  uint64_t id = 0;
  GenerationRequest request;
  std::vector<int64_t> context; // the prompt, then every generated token
  std::unique_ptr<Sequence> sequence;
  int64_t fed = 0;         // context tokens the sequence has consumed
  int64_t draftLength = 0; // speculative decoding: this request's current draft length
  double acceptedPerPass = -1; // running mean of its accepted drafts per pass (-1: none yet)
  // draftOnlyWhenItPays: steps it declined since its last pass, and how many it declines before
  // it probes again (doubled by each re-probe, reset where drafting pays).
  int64_t declinedSteps = 0;
  int64_t reprobeAfter = SchedulerOptions::kReprobeAfter;
  // Replay drafts: the prompt, then a plain run's generated tokens (empty for other sources).
  std::vector<int64_t> replayReference;

  int64_t generated() const {
    return static_cast<int64_t>(context.size() - request.prompt.size());
  }
};

Scheduler::Scheduler(Model &model, SchedulerOptions options)
    : model_(model), options_(options),
      batchInvariant_(options.batchInvariantModel.value_or(model.batchInvariant())) {
  options_.prefillChunkTokens = std::max<int64_t>(1, options_.prefillChunkTokens);
  if (options_.draftTokens > 0)
    drafts_ = makeDraftSource(model_, options_.draftSource, options_.replay);
}

Scheduler::~Scheduler() = default;

StatusOr<uint64_t> Scheduler::submit(GenerationRequest request,
                                     std::span<const int64_t> replayContinuation) {
  if (!drafts_)
    return drafts_.status();
  const bool replay = options_.draftTokens > 0 && options_.draftSource == DraftSourceKind::Replay;
  if (replay && samplingIsGreedy(request.sampling) && replayContinuation.empty())
    return Status::error("request: no replayContinuation: " +
                         std::string(kReplayNeedsReference));
  if (request.prompt.empty())
    return Status::error("request: the prompt is empty");
  if (request.maxNewTokens < 1)
    return Status::error("request: maxNewTokens = " + std::to_string(request.maxNewTokens) +
                         " must be at least 1");
  if (const std::string problem = samplingParamsProblem(request.sampling); !problem.empty())
    return Status::error("request: " + problem);
  const int64_t vocab = model_.vocabSize();
  for (size_t i = 0; i < request.prompt.size(); ++i)
    if (request.prompt[i] < 0 || request.prompt[i] >= vocab)
      return Status::error("request: token id " + std::to_string(request.prompt[i]) +
                           " at position " + std::to_string(i) + " is outside the vocabulary [0, " +
                           std::to_string(vocab) + ")");
  // The last generated token is never fed back, so the sequence holds at most this many.
  const int64_t longest = static_cast<int64_t>(request.prompt.size()) + request.maxNewTokens - 1;
  const Model::Usage usage = model_.usage();
  if (longest > model_.maxContextTokens())
    return Status::error("request: " + std::to_string(request.prompt.size()) +
                         " prompt tokens + " + std::to_string(request.maxNewTokens) +
                         " new tokens exceed the context of " +
                         std::to_string(model_.maxContextTokens()) + " (maxContextTokens)");
  if (model_.pagesFor(longest) > usage.totalPages)
    return Status::error("request: " + std::to_string(longest) + " tokens need " +
                         std::to_string(model_.pagesFor(longest)) + " KV pages, the cache has " +
                         std::to_string(usage.totalPages));
  auto active = std::make_unique<Active>();
  active->id = nextId_++;
  active->context = request.prompt;
  active->draftLength = options_.draftTokens;
  if (replay) {
    active->replayReference = request.prompt;
    active->replayReference.insert(active->replayReference.end(), replayContinuation.begin(),
                                   replayContinuation.end());
  }
  active->request = std::move(request);
  waiting_.push_back(std::move(active));
  return waiting_.back()->id;
}

// Drafts are verified by argmax, so only greedy requests speculate; sampled ones decode plainly
// (accepting a draft token by argmax would not sample from the distribution asked for).
bool Scheduler::speculates(const Active &active) const {
  return options_.draftTokens > 0 && samplingIsGreedy(active.request.sampling);
}

namespace {

// Running means that follow a drifting cost (batch sizes and contexts change).
double blend(double mean, double sample) { return mean <= 0 ? sample : 0.75 * mean + 0.25 * sample; }

} // namespace

double Scheduler::now() const {
  if (options_.clock)
    return options_.clock();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Scheduler::Drafting Scheduler::drafting(const Active &active) {
  if (!batchInvariant_ && decodingRequests_ > 1)
    return Drafting::Declines; // a pass would change the request's tokens (batchInvariantModel)
  if (!options_.draftOnlyWhenItPays)
    return Drafting::Verifies;
  // The requests due to probe probe together, in one batched pass (past the check above, that
  // is one request where the model is not batch-invariant).
  if (verifyPassSeconds_ <= 0) // nothing timed yet: the probe finds out
    return Drafting::Verifies;
  if (decodeRowSeconds_ > 0) { // else a plain step first, to compare with
    const double expected =
        1 + (active.acceptedPerPass >= 0 ? active.acceptedPerPass : double(active.draftLength));
    if (expected / verifyPassSeconds_ >= 1 / decodeRowSeconds_)
      return Drafting::Verifies;
    // Where a pass accepting every draft would not pay either (a large batch: a decode row
    // costs a fraction of a pass), a probe cannot change the answer; it waits for the batch to
    // shrink. At batch 32 on the H200 probes of one request a step cost 35% of the decode rate.
    if (timedPasses_ >= SchedulerOptions::kTimedPassesBeforeGivingUp &&
        (1.0 + double(options_.draftTokens)) / verifyPassSeconds_ < 1 / decodeRowSeconds_)
      return Drafting::Declines;
  }
  // One bad pass (or a slow one) must not decide for the rest of the request.
  if (active.declinedSteps >= active.reprobeAfter)
    return Drafting::Reprobes;
  return Drafting::Declines;
}

int64_t Scheduler::stepPages(const Active &active) const {
  const int64_t length = active.sequence ? active.sequence->length() : 0;
  const auto contextLength = static_cast<int64_t>(active.context.size());
  const bool prefill = active.fed + 1 < contextLength || active.fed == 0;
  const int64_t tokens = prefill ? std::min(options_.prefillChunkTokens, contextLength - active.fed)
                                 : 1 + (speculates(active) ? active.draftLength : 0);
  return model_.pagesFor(length + tokens) - model_.pagesFor(length);
}

int64_t Scheduler::runningStepPages() const {
  int64_t pages = 0;
  for (const auto &active : running_)
    pages += stepPages(*active);
  return pages;
}

void Scheduler::reserveStepPages() {
  while (running_.size() > 1) {
    if (runningStepPages() <= model_.usage().freePages)
      return;
    // The youngest goes back to the front of the queue, ahead of what was never admitted (a
    // second victim, older, then lands ahead of it).
    std::unique_ptr<Active> victim = std::move(running_.back());
    running_.pop_back();
    preempt(std::move(victim));
  }
}

void Scheduler::preempt(std::unique_ptr<Active> active) {
  active->sequence.reset(); // its pages go back; the request recomputes its context later
  active->fed = 0;
  waiting_.push_front(std::move(active));
  ++stats_.preemptions;
}

bool Scheduler::admit(Active &active) {
  const Model::Usage usage = model_.usage();
  if (usage.sequencesInUse >= usage.maxSequences)
    return false;
  // The pages its context needs now, besides those the running requests' next steps take; with
  // nothing running, admit anyway (it fits alone: submit checked), else a prefix cache holding
  // pages could starve it forever.
  const int64_t needed =
      model_.pagesFor(static_cast<int64_t>(active.context.size())) + runningStepPages();
  if (!running_.empty() && needed > usage.freePages)
    return false;
  auto sequence = model_.newSequence();
  if (!sequence)
    return false;
  active.sequence = std::move(*sequence);
  active.fed = 0;
  if (*drafts_ && speculates(active))
    (*drafts_)->attach(*active.sequence);
  return true;
}

// What a request's step produced: logits (the last row chooses the next token), or the tokens a
// decode or speculative step chose; `mayPreempt` is false for errors that recomputing cannot cure.
struct Scheduler::Outcome {
  StatusOr<std::vector<float>> logits = Status::error("nothing ran");
  std::vector<int64_t> chosen;
  bool mayPreempt = true;
};

// What `active`'s step is, or its error; a prefill chunk and a verification are left to
// prefillGroup / verifyGroup (in `work`), a plain decode step to decodeGroup (`decodes`).
void Scheduler::planOwnStep(Active &active, Outcome &outcome, OwnStep &work, bool &decodes) {
  decodes = false;
  work = {};
  const auto contextLength = static_cast<int64_t>(active.context.size());
  if (active.fed == 0) {
    // The first step restores the longest kept prefix (if the model keeps prefixes).
    StatusOr<int64_t> cached = active.sequence->restorePrefix(active.context);
    if (!cached) {
      outcome.logits = cached.status();
      outcome.mayPreempt = false;
      return;
    }
    stats_.promptTokens += contextLength;
    stats_.cachedPromptTokens += *cached;
    active.fed = *cached;
  }
  if (active.fed + 1 < contextLength || active.fed == 0) {
    // A prefill chunk; one ends where the context's own prefix is kept, to keep it right then.
    const int64_t boundary = active.sequence->prefixBoundary(contextLength);
    int64_t count = std::min(options_.prefillChunkTokens, contextLength - active.fed);
    if (active.fed < boundary)
      count = std::min(count, boundary - active.fed);
    work = {.kind = OwnStep::Prefill, .tokens = count, .draft = {}, .proposeSeconds = 0};
  } else if (const Drafting choice = speculates(active) ? drafting(active) : Drafting::Declines;
             choice != Drafting::Declines) {
    const double start = now();
    const int64_t room = active.request.maxNewTokens - active.generated();
    StatusOr<std::vector<int64_t>> proposed = (*drafts_)->proposeFromReference(
        *active.sequence, active.context, std::min(active.draftLength, room - 1),
        active.replayReference);
    if (!proposed) {
      outcome.logits = proposed.status();
      outcome.mayPreempt = false;
      return;
    }
    if (proposed->empty() && options_.draftOnlyWhenItPays) {
      // Nothing to verify: a pass would be one decode step of its own; the batched one is cheaper.
      ++stats_.declinedDrafts;
      ++active.declinedSteps; // a re-probe that proposed nothing stays due
      decodes = true;
      return;
    }
    active.declinedSteps = 0;
    active.reprobeAfter =
        choice == Drafting::Reprobes
            ? std::min(2 * active.reprobeAfter, SchedulerOptions::kReprobeAfterMax)
            : SchedulerOptions::kReprobeAfter;
    work = {.kind = OwnStep::Verify,
            .tokens = 1 + static_cast<int64_t>(proposed->size()),
            .draft = std::move(*proposed),
            .proposeSeconds = now() - start};
  } else {
    if (speculates(active)) {
      ++stats_.declinedDrafts;
      ++active.declinedSteps;
    }
    decodes = true;
  }
}

// Consecutive runs of `group` (indices into running_) whose steps' rows fit one prefill program
// call together (a step longer than a call runs alone); one index per run when the KV cache may
// not have a page for every row (then a request that finds it full is preempted alone, not its
// whole call).
std::vector<std::vector<size_t>> Scheduler::packCalls(const std::vector<size_t> &group,
                                                      const std::vector<OwnStep> &work) const {
  int64_t newPages = 0;
  for (size_t index : group) {
    const int64_t length = running_[index]->sequence->length();
    newPages += model_.pagesFor(length + work[index].tokens) - model_.pagesFor(length);
  }
  const bool batched = options_.batchPrefillCalls && newPages <= model_.usage().freePages;
  const int64_t budget = model_.maxPrefillTokens();
  std::vector<std::vector<size_t>> calls;
  int64_t rows = 0;
  for (size_t index : group) {
    if (calls.empty() || !batched || rows + work[index].tokens > budget) {
      calls.emplace_back();
      rows = 0;
    }
    calls.back().push_back(index);
    rows += work[index].tokens;
  }
  return calls;
}

// The prefill chunks of `group`, several requests per prefill program call (Model::prefillBatch).
void Scheduler::prefillGroup(const std::vector<size_t> &group, const std::vector<OwnStep> &work,
                             std::vector<Outcome> &outcomes) {
  const auto vocab = static_cast<size_t>(model_.vocabSize());
  for (const std::vector<size_t> &call : packCalls(group, work)) {
    std::vector<PrefillSegment> segments;
    for (size_t index : call) {
      Active &active = *running_[index];
      segments.push_back({.sequence = active.sequence.get(),
                          .tokens = std::span(active.context)
                                        .subspan(static_cast<size_t>(active.fed),
                                                 static_cast<size_t>(work[index].tokens))});
    }
    if (call.size() > 1) {
      ++stats_.prefillBatches;
      stats_.batchedPrefillSegments += static_cast<int64_t>(call.size());
    }
    // Only each segment's last row chooses a token. A request alone prefills as before, in as
    // many program calls as its chunk needs.
    StatusOr<std::vector<float>> logits =
        segments.size() == 1
            ? segments[0].sequence->prefill(segments[0].tokens, nullptr, PrefillLogits::LastRow)
            : model_.prefillBatch(segments, PrefillLogits::LastRow);
    for (size_t i = 0; i < call.size(); ++i) {
      Active &active = *running_[call[i]];
      Outcome &outcome = outcomes[call[i]];
      active.fed += work[call[i]].tokens;
      if (!logits) {
        outcome.logits = logits.status(); // each recomputes (or fails) on its own
        continue;
      }
      outcome.logits = std::vector<float>(logits->begin() + static_cast<std::ptrdiff_t>(i * vocab),
                                          logits->begin() + static_cast<std::ptrdiff_t>((i + 1) * vocab));
      const auto contextLength = static_cast<int64_t>(active.context.size());
      const int64_t boundary = active.sequence->prefixBoundary(contextLength);
      if (active.fed == boundary)
        if (Status kept = active.sequence->keepPrefix(
                std::span(active.context).first(static_cast<size_t>(boundary)));
            !kept)
          outcome.logits = kept;
    }
  }
}

// The verifications of `group`, several requests' drafts per pass (Model::verifyDrafts); each
// request then keeps its accepted tokens and rolls the rest back on its own.
void Scheduler::verifyGroup(const std::vector<size_t> &group, const std::vector<OwnStep> &work,
                            std::vector<Outcome> &outcomes) {
  for (const std::vector<size_t> &call : packCalls(group, work)) {
    std::vector<DraftCheck> checks;
    for (size_t index : call) {
      Active &active = *running_[index];
      checks.push_back({.sequence = active.sequence.get(),
                        .token = active.context.back(),
                        .draft = work[index].draft});
    }
    if (call.size() > 1) {
      ++stats_.verifyBatches;
      stats_.batchedVerifySequences += static_cast<int64_t>(call.size());
    }
    const double start = now();
    // Tokens only: a step's outcome needs its chosen ids, never a verification's logits.
    StatusOr<std::vector<DraftVerification>> verified =
        model_.verifyDrafts(checks, /*keepLogits=*/false);
    // What drafting pays is judged per sequence: its share of the pass, plus drafting it.
    if (verified) {
      double proposing = 0;
      for (size_t index : call)
        proposing += work[index].proposeSeconds;
      verifyPassSeconds_ =
          blend(verifyPassSeconds_, (now() - start + proposing) / double(call.size()));
      ++timedPasses_;
    }
    for (size_t i = 0; i < call.size(); ++i) {
      Active &active = *running_[call[i]];
      Outcome &outcome = outcomes[call[i]];
      active.fed = static_cast<int64_t>(active.context.size());
      if (!verified) {
        outcome.logits = verified.status();
        continue;
      }
      DraftVerification &result = (*verified)[i];
      const auto drafted = static_cast<int64_t>(work[call[i]].draft.size());
      ++stats_.verifySteps;
      stats_.draftedTokens += drafted;
      stats_.acceptedTokens += result.accepted;
      active.draftLength =
          adaptDraftLength(active.draftLength, options_.draftTokens, drafted, result.accepted);
      active.acceptedPerPass = blend(active.acceptedPerPass < 0 ? 0 : active.acceptedPerPass,
                                     double(result.accepted));
      outcome.chosen = result.tokens;
      outcome.logits = std::move(result.logits);
    }
  }
}

// An empty draft without draftOnlyWhenItPays: a pass of one token (Sequence::verifyDraft's decode
// step), as before batched verification.
void Scheduler::verifyAlone(Active &active, Outcome &outcome) {
  StatusOr<DraftVerification> verified = active.sequence->verifyDraft(active.context.back(), {});
  active.fed = static_cast<int64_t>(active.context.size());
  if (!verified) {
    outcome.logits = verified.status();
    return;
  }
  ++stats_.verifySteps;
  active.draftLength = adaptDraftLength(active.draftLength, options_.draftTokens, 0, 0);
  active.acceptedPerPass = blend(active.acceptedPerPass < 0 ? 0 : active.acceptedPerPass, 0.0);
  outcome.chosen = verified->tokens;
  outcome.logits = std::move(verified->logits);
}

// Plain decode steps of `group` (indices into running_), as few Model::decodeBatch calls as the
// plan's decode batch allows; one at a time when the KV cache may not have a page for every
// row (then a row that finds it full is preempted alone, not its whole batch).
void Scheduler::decodeGroup(const std::vector<size_t> &group, std::vector<Outcome> &outcomes,
                            size_t verifying) {
  const auto batchSize = static_cast<size_t>(model_.maxDecodeBatch());
  int64_t newPages = 0;
  for (size_t index : group) {
    const int64_t length = running_[index]->sequence->length();
    newPages += model_.pagesFor(length + 1) - model_.pagesFor(length);
  }
  const bool batched = batchSize > 1 && group.size() > 1 && newPages <= model_.usage().freePages;
  for (size_t first = 0; first < group.size(); first += batched ? batchSize : 1) {
    const size_t count = batched ? std::min(batchSize, group.size() - first) : 1;
    std::vector<Sequence *> sequences;
    std::vector<int64_t> tokens;
    std::vector<TokenChoice> choices;
    for (size_t i = first; i < first + count; ++i) {
      Active &active = *running_[group[i]];
      sequences.push_back(active.sequence.get());
      tokens.push_back(active.context.back());
      choices.push_back(tokenChoice(active.request.sampling, active.generated()));
      active.fed = static_cast<int64_t>(active.context.size());
    }
    if (count > 1) {
      ++stats_.decodeBatches;
      stats_.batchedDecodeRows += static_cast<int64_t>(count);
    }
    const double start = now();
    StatusOr<std::vector<int64_t>> chosen = model_.decodeBatchChoose(sequences, tokens, choices);
    // A decode row's cost as if the requests verifying this step decoded too: a batched step
    // costs about the same for a few rows as for a full batch (it reads the same weights), so
    // its time over the few rows left when most requests verify made every pass look cheap (at
    // batch 128 on the H200, passes at 35% acceptance ran 0.37x plain decoding).
    const size_t rowsIfAllDecoded = std::min(batchSize, count + (first == 0 ? verifying : 0));
    if (chosen)
      decodeRowSeconds_ =
          blend(decodeRowSeconds_, (now() - start) / double(std::max(count, rowsIfAllDecoded)));
    for (size_t i = 0; i < count; ++i) {
      Outcome &outcome = outcomes[group[first + i]];
      if (!chosen) {
        outcome.logits = chosen.status(); // each row recomputes (or fails) on its own
      } else {
        outcome.logits = std::vector<float>(); // the token is chosen already
        outcome.chosen = {(*chosen)[i]};
      }
    }
  }
}

std::vector<TokenEvent> Scheduler::step() {
  reserveStepPages();
  while (!waiting_.empty() && admit(*waiting_.front())) {
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  decodingRequests_ = 0;
  for (const std::unique_ptr<Active> &active : running_)
    decodingRequests_ +=
        active->fed > 0 && active->fed + 1 >= static_cast<int64_t>(active->context.size());

  // Every request's own step first (prefill chunks, speculative steps), then the plain decode
  // steps together; their results are applied in admission order.
  std::vector<Outcome> outcomes(running_.size());
  std::vector<OwnStep> work(running_.size());
  std::vector<size_t> prefills, verifications, decodes;
  for (size_t index = 0; index < running_.size(); ++index) {
    bool decodeStep = false;
    planOwnStep(*running_[index], outcomes[index], work[index], decodeStep);
    if (decodeStep)
      decodes.push_back(index);
    else if (work[index].kind == OwnStep::Prefill)
      prefills.push_back(index);
    else if (work[index].kind == OwnStep::Verify && work[index].draft.empty())
      verifyAlone(*running_[index], outcomes[index]);
    else if (work[index].kind == OwnStep::Verify)
      verifications.push_back(index);
  }
  prefillGroup(prefills, work, outcomes);
  verifyGroup(verifications, work, outcomes);
  decodeGroup(decodes, outcomes, verifications.size());

  std::vector<TokenEvent> events;
  std::vector<std::unique_ptr<Active>> running;
  const size_t runningAtStart = running_.size();
  for (size_t index = 0; index < running_.size(); ++index) {
    std::unique_ptr<Active> &slot = running_[index];
    Active &active = *slot;
    Outcome &outcome = outcomes[index];
    if (!outcome.logits) {
      const std::string message = outcome.logits.status().message();
      // A step that failed part-way left some layers' caches advanced: the sequence restarts.
      // Out of KV pages with others running, it waits for theirs (preemption by recompute).
      if (outcome.mayPreempt && outcome.logits.status().isExhausted() && runningAtStart > 1) {
        preempt(std::move(slot));
        continue;
      }
      events.push_back({active.id, -1, true, message});
      ++stats_.finished;
      continue;
    }
    if (active.fed < static_cast<int64_t>(active.context.size())) {
      running.push_back(std::move(slot)); // more of the prompt next step
      continue;
    }
    // A prefill's last row chooses the next token (decode steps chose theirs, a speculative step
    // several).
    if (outcome.chosen.empty()) {
      const int64_t vocab = model_.vocabSize();
      std::span<const float> last = std::span(*outcome.logits).last(static_cast<size_t>(vocab));
      outcome.chosen.push_back(
          chooseToken(last, tokenChoice(active.request.sampling, active.generated())));
    }
    bool finished = false;
    for (size_t i = 0; i < outcome.chosen.size() && !finished; ++i) {
      const int64_t token = outcome.chosen[i];
      active.context.push_back(token);
      const bool stop = std::find(active.request.stopTokens.begin(),
                                  active.request.stopTokens.end(),
                                  token) != active.request.stopTokens.end();
      finished = stop || active.generated() >= active.request.maxNewTokens;
      events.push_back({active.id, token, finished, {}});
    }
    // The sequence has consumed every context token but the last chosen one.
    active.fed = static_cast<int64_t>(active.context.size()) - 1;
    if (finished) {
      ++stats_.finished;
      continue;
    }
    running.push_back(std::move(slot));
  }
  running_ = std::move(running);
  return events;
}

bool Scheduler::cancel(uint64_t request) {
  auto matches = [request](const std::unique_ptr<Active> &active) { return active->id == request; };
  if (auto found = std::find_if(waiting_.begin(), waiting_.end(), matches);
      found != waiting_.end()) {
    waiting_.erase(found);
    ++stats_.cancelled;
    return true;
  }
  if (auto found = std::find_if(running_.begin(), running_.end(), matches);
      found != running_.end()) {
    running_.erase(found); // frees its sequence
    ++stats_.cancelled;
    return true;
  }
  return false;
}

bool Scheduler::idle() const { return waiting_.empty() && running_.empty(); }

SchedulerStats Scheduler::stats() const {
  SchedulerStats stats = stats_;
  stats.waiting = static_cast<int64_t>(waiting_.size());
  stats.running = static_cast<int64_t>(running_.size());
  return stats;
}

} // namespace hybrid
