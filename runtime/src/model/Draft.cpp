#include "hybrid/runtime/Draft.h"

#include "hybrid/runtime/Generate.h" // promptLookupDraft

#include <algorithm>
#include <string>

namespace hybrid {
namespace {

class PromptLookupSource final : public DraftSource {
public:
  DraftSourceKind kind() const override { return DraftSourceKind::PromptLookup; }
  StatusOr<std::vector<int64_t>> propose(Sequence &, std::span<const int64_t> context,
                                         int64_t maxTokens) override {
    return promptLookupDraft(context, maxTokens);
  }
};

// MTP row j pairs the main model's final hidden state h_j with token t_{j+1} and predicts
// t_{j+2}, at position j of the MTP layer's own KV cache. The row of the sequence's last position
// needs the token chosen after it, so rows run here, when that token is known: first every
// position the sequence consumed since the last call (their hidden states recorded by the
// sequence, on the device that computed them), the last of them giving the first draft token;
// then one chained row per further draft token, fed the MTP's own hidden state in place of the
// main model's (the rows are dropped again: verification decides which positions stay).
class MtpSource final : public DraftSource {
public:
  DraftSourceKind kind() const override { return DraftSourceKind::Mtp; }
  void attach(Sequence &sequence) override { sequence.recordFinalHidden(true); }

  StatusOr<std::vector<int64_t>> propose(Sequence &sequence, std::span<const int64_t> context,
                                         int64_t maxTokens) override {
    const auto consumed = static_cast<int64_t>(context.size()) - 1;
    if (consumed != sequence.length())
      return Status::error("MTP drafts: the context holds " + std::to_string(context.size()) +
                           " tokens, the sequence consumed " +
                           std::to_string(sequence.length()) + " (the context is those and the "
                                                               "chosen next token)");
    if (maxTokens <= 0)
      return std::vector<int64_t>(); // the recorded hidden states wait for the next call
    const Sequence::RecordedPositions recorded = sequence.recordedPositions();
    if (recorded.count == 0 || recorded.first + recorded.count != consumed)
      return Status::error("MTP drafts need the final hidden state of every position the "
                           "sequence consumed (attach the source before its first prefill); "
                           "recorded positions [" +
                           std::to_string(recorded.first) + ", " +
                           std::to_string(recorded.first + recorded.count) + ") of " +
                           std::to_string(consumed));
    // Positions the MTP cache lacks and no hidden state was recorded for (a restored prefix)
    // get zero rows; recorded positions it already holds are not run again.
    if (sequence.mtpLength() < recorded.first)
      HYBRID_RETURN_IF_ERROR(sequence.setMtpLength(recorded.first));
    const int64_t first = sequence.mtpLength();
    if (first >= consumed)
      return Status::error("MTP drafts: the MTP cache already holds position " +
                           std::to_string(consumed - 1) + " of " + std::to_string(consumed));
    HYBRID_ASSIGN_OR_RETURN(int64_t token,
                            sequence.draftMtp(context.subspan(static_cast<size_t>(first) + 1,
                                                              static_cast<size_t>(consumed - first))));
    std::vector<int64_t> draft = {token};
    while (static_cast<int64_t>(draft.size()) < maxTokens) {
      HYBRID_ASSIGN_OR_RETURN(token, sequence.draftMtpChained(draft.back()));
      draft.push_back(token);
    }
    HYBRID_RETURN_IF_ERROR(sequence.setMtpLength(consumed));
    return draft;
  }
};

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Replay (benchmark only): the reference run's tokens at the drafted positions, each kept with
// probability `acceptance` and otherwise replaced by a different token. The choice at a
// position is a function of (seed, the reference run, the position), so a position drafted
// again in a later pass gets the same token, and every run the same drafts.
class ReplaySource final : public DraftSource {
public:
  ReplaySource(int64_t vocabSize, const ReplayOptions &options)
      : vocabSize_(vocabSize), options_(options) {}
  DraftSourceKind kind() const override { return DraftSourceKind::Replay; }

  StatusOr<std::vector<int64_t>> propose(Sequence &, std::span<const int64_t>, int64_t) override {
    return Status::error(std::string(kReplayNeedsReference));
  }

  StatusOr<std::vector<int64_t>> proposeFromReference(Sequence &, std::span<const int64_t> context,
                                                      int64_t maxTokens,
                                                      std::span<const int64_t> reference) override {
    if (reference.empty())
      return Status::error(std::string(kReplayNeedsReference));
    // Past the reference run's end (a request longer than the run it was given) there is
    // nothing to replay.
    const auto from = static_cast<int64_t>(context.size());
    const int64_t count =
        std::clamp<int64_t>(static_cast<int64_t>(reference.size()) - from, 0, maxTokens);
    uint64_t run = splitmix64(options_.seed);
    for (int64_t token : reference)
      run = splitmix64(run ^ static_cast<uint64_t>(token));
    std::vector<int64_t> draft;
    draft.reserve(static_cast<size_t>(count));
    for (int64_t position = from; position < from + count; ++position) {
      const int64_t right = reference[static_cast<size_t>(position)];
      const uint64_t bits = splitmix64(run ^ splitmix64(static_cast<uint64_t>(position)));
      // The top 53 bits as a uniform in [0, 1): below `acceptance` keeps the reference token
      // (always at 1, never at 0).
      const double uniform = static_cast<double>(bits >> 11) * 0x1.0p-53;
      if (uniform < options_.acceptance) {
        draft.push_back(right);
        continue;
      }
      // Any other token of the vocabulary, from the draw's low bits.
      const auto offset = 1 + static_cast<int64_t>(splitmix64(bits) %
                                                   static_cast<uint64_t>(vocabSize_ - 1));
      draft.push_back((right + offset) % vocabSize_);
    }
    return draft;
  }

private:
  int64_t vocabSize_;
  ReplayOptions options_;
};

} // namespace

StatusOr<DraftSourceKind> parseDraftSource(std::string_view name) {
  if (name == "prompt-lookup")
    return DraftSourceKind::PromptLookup;
  if (name == "mtp")
    return DraftSourceKind::Mtp;
  if (name == "replay")
    return DraftSourceKind::Replay;
  return Status::error("draft source '" + std::string(name) +
                       "' is not one of prompt-lookup, mtp, replay");
}

std::string_view draftSourceName(DraftSourceKind kind) {
  switch (kind) {
  case DraftSourceKind::Mtp:
    return "mtp";
  case DraftSourceKind::Replay:
    return "replay";
  case DraftSourceKind::PromptLookup:
    break;
  }
  return "prompt-lookup";
}

StatusOr<std::unique_ptr<DraftSource>> makeDraftSource(Model &model, DraftSourceKind kind,
                                                       const ReplayOptions &replay) {
  if (kind == DraftSourceKind::PromptLookup)
    return std::unique_ptr<DraftSource>(std::make_unique<PromptLookupSource>());
  if (kind == DraftSourceKind::Replay) {
    if (!(replay.acceptance >= 0 && replay.acceptance <= 1))
      return Status::error("draft source replay: acceptance " + std::to_string(replay.acceptance) +
                           " is outside [0, 1]");
    if (model.vocabSize() < 2)
      return Status::error("draft source replay: a vocabulary of " +
                           std::to_string(model.vocabSize()) + " has no wrong token to draft");
    return std::unique_ptr<DraftSource>(std::make_unique<ReplaySource>(model.vocabSize(), replay));
  }
  if (!model.hasMtp())
    return Status::error("draft source mtp: the plan has no 'mtp' program (the checkpoint has no "
                         "multi-token-prediction layer: num_nextn_predict_layers = 0)");
  return std::unique_ptr<DraftSource>(std::make_unique<MtpSource>());
}

} // namespace hybrid
