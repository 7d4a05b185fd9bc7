#include "hybrid/runtime/Scheduler.h"

#include "hybrid/runtime/Generate.h"

#include <algorithm>
#include <span>

namespace hybrid {

struct Scheduler::Active {
  uint64_t id = 0;
  GenerationRequest request;
  std::vector<int64_t> context; // the prompt, then every generated token
  std::unique_ptr<Sequence> sequence;
  int64_t fed = 0;         // context tokens the sequence has consumed
  int64_t draftLength = 0; // speculative decoding: this request's current draft length

  int64_t generated() const {
    return static_cast<int64_t>(context.size() - request.prompt.size());
  }
};

Scheduler::Scheduler(Model &model, SchedulerOptions options)
    : model_(model), options_(options) {
  options_.prefillChunkTokens = std::max<int64_t>(1, options_.prefillChunkTokens);
}

Scheduler::~Scheduler() = default;

StatusOr<uint64_t> Scheduler::submit(GenerationRequest request) {
  if (request.prompt.empty())
    return Status::error("request: the prompt is empty");
  if (request.maxNewTokens < 1)
    return Status::error("request: maxNewTokens = " + std::to_string(request.maxNewTokens) +
                         " must be at least 1");
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
  active->request = std::move(request);
  waiting_.push_back(std::move(active));
  return waiting_.back()->id;
}

bool Scheduler::admit(Active &active) {
  const Model::Usage usage = model_.usage();
  if (usage.sequencesInUse >= usage.maxSequences)
    return false;
  // The pages its context needs now; with nothing running, admit anyway (it fits alone: submit
  // checked), else a prefix cache holding pages could starve it forever.
  if (!running_.empty() &&
      model_.pagesFor(static_cast<int64_t>(active.context.size())) > usage.freePages)
    return false;
  auto sequence = model_.newSequence();
  if (!sequence)
    return false;
  active.sequence = std::move(*sequence);
  active.fed = 0;
  return true;
}

// Frees running request `index`'s sequence; it waits again, first in line, and recomputes its
// context when readmitted.
void Scheduler::preempt(size_t index) {
  std::unique_ptr<Active> victim = std::move(running_[index]);
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(index));
  victim->sequence.reset();
  victim->fed = 0;
  waiting_.push_front(std::move(victim));
  ++stats_.preemptions;
}

std::vector<TokenEvent> Scheduler::step() {
  while (!waiting_.empty() && admit(*waiting_.front())) {
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }

  std::vector<TokenEvent> events;
  // A request leaves the running set finished, or failed with an error event.
  auto retire = [&](size_t at) {
    ++stats_.finished;
    running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(at));
  };
  auto fail = [&](size_t at, const std::string &message) {
    events.push_back({running_[at]->id, -1, true, message});
    retire(at);
  };
  for (size_t index = 0; index < running_.size();) {
    Active &active = *running_[index];
    const auto contextLength = static_cast<int64_t>(active.context.size());
    StatusOr<std::vector<float>> logits = Status::error("nothing ran");
    std::vector<int64_t> chosen; // set by a speculative step: the tokens it decided
    if (active.fed == 0) {
      // The first step restores the longest kept prefix (if the model keeps prefixes).
      StatusOr<int64_t> cached = active.sequence->restorePrefix(active.context);
      if (!cached) {
        fail(index, cached.status().message());
        continue;
      }
      stats_.cachedPromptTokens += *cached;
      active.fed = *cached;
    }
    if (active.fed + 1 < contextLength || active.fed == 0) {
      // A prefill chunk; one ends where the context's own prefix is kept, to keep it right then.
      const int64_t boundary = active.sequence->prefixBoundary(contextLength);
      int64_t count = std::min(options_.prefillChunkTokens, contextLength - active.fed);
      if (active.fed < boundary)
        count = std::min(count, boundary - active.fed);
      logits = active.sequence->prefill(std::span(active.context).subspan(
          static_cast<size_t>(active.fed), static_cast<size_t>(count)));
      active.fed += count;
      if (logits && active.fed == boundary)
        if (Status kept = active.sequence->keepPrefix(
                std::span(active.context).first(static_cast<size_t>(boundary)));
            !kept)
          logits = kept;
    } else if (options_.draftTokens > 0) {
      const int64_t room = active.request.maxNewTokens - active.generated();
      const std::vector<int64_t> draft =
          promptLookupDraft(active.context, std::min(active.draftLength, room - 1));
      StatusOr<DraftVerification> verified =
          active.sequence->verifyDraft(active.context.back(), draft);
      if (verified) {
        ++stats_.verifySteps;
        stats_.draftedTokens += static_cast<int64_t>(draft.size());
        stats_.acceptedTokens += verified->accepted;
        active.draftLength =
            adaptDraftLength(active.draftLength, options_.draftTokens,
                             static_cast<int64_t>(draft.size()), verified->accepted);
        chosen = verified->tokens;
        logits = std::move(verified->logits);
      } else {
        logits = verified.status();
      }
      active.fed = contextLength;
    } else {
      logits = active.sequence->decode(active.context.back());
      active.fed = contextLength;
    }

    if (!logits) {
      const std::string message = logits.status().message();
      // A step that failed part-way left some layers' caches advanced: the sequence restarts.
      // Out of KV pages with others running, it waits for theirs (preemption by recompute).
      if (message.find("out of pages") != std::string::npos && running_.size() > 1) {
        preempt(index);
        continue;
      }
      fail(index, message);
      continue;
    }
    if (active.fed < contextLength) {
      ++index; // more of the prompt next step
      continue;
    }
    // The last row's logits choose the next token (a speculative step decided several).
    if (chosen.empty()) {
      const int64_t vocab = model_.vocabSize();
      std::span<const float> last = std::span(*logits).last(static_cast<size_t>(vocab));
      chosen.push_back(std::max_element(last.begin(), last.end()) - last.begin());
    }
    bool finished = false;
    for (size_t i = 0; i < chosen.size() && !finished; ++i) {
      const int64_t token = chosen[i];
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
      retire(index);
      continue;
    }
    ++index;
  }
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
