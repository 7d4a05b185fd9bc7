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

} // namespace

StatusOr<DraftSourceKind> parseDraftSource(std::string_view name) {
  if (name == "prompt-lookup")
    return DraftSourceKind::PromptLookup;
  if (name == "mtp")
    return DraftSourceKind::Mtp;
  return Status::error("draft source '" + std::string(name) +
                       "' is not one of prompt-lookup, mtp");
}

std::string_view draftSourceName(DraftSourceKind kind) {
  return kind == DraftSourceKind::Mtp ? "mtp" : "prompt-lookup";
}

StatusOr<std::unique_ptr<DraftSource>> makeDraftSource(Model &model, DraftSourceKind kind) {
  if (kind == DraftSourceKind::PromptLookup)
    return std::unique_ptr<DraftSource>(std::make_unique<PromptLookupSource>());
  if (!model.hasMtp())
    return Status::error("draft source mtp: the plan has no 'mtp' program (the checkpoint has no "
                         "multi-token-prediction layer: num_nextn_predict_layers = 0)");
  return std::unique_ptr<DraftSource>(std::make_unique<MtpSource>());
}

} // namespace hybrid
