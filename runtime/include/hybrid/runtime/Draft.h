// Draft sources for speculative decoding: where the tokens a verification pass checks come from
// (Sequence::verifyDraft accepts the longest prefix greedy decoding agrees with, so a source only
// changes the speed, never the tokens).
//
//   prompt-lookup  the tokens that followed the latest earlier occurrence of the context's tail;
//                  any model.
//   mtp            the model's own multi-token-prediction layer (DeepSeek-V3's
//                  num_nextn_predict_layers; docs/mtp.md): one MTP step per draft token, the
//                  first from the main model's final hidden state, the next ones chained on the
//                  MTP's own. Needs a plan with an `mtp` program.
//
//   auto source = makeDraftSource(model, DraftSourceKind::Mtp);
//   (*source)->attach(*sequence);                 // before the sequence's first prefill
//   auto draft = (*source)->propose(*sequence, context, 3);
//   auto verified = sequence->verifyDraft(context.back(), *draft);
#pragma once

#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Status.h"

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace hybrid {

enum class DraftSourceKind { PromptLookup, Mtp };

// "prompt-lookup" or "mtp"; anything else is an error listing both.
StatusOr<DraftSourceKind> parseDraftSource(std::string_view name);
std::string_view draftSourceName(DraftSourceKind kind);

class DraftSource {
public:
  virtual ~DraftSource() = default;
  virtual DraftSourceKind kind() const = 0;
  // Prepares a fresh sequence before its first prefill (the MTP source has it keep its final
  // hidden states). One source serves any number of sequences.
  virtual void attach(Sequence &) {}
  // At most maxTokens tokens to follow `context`: the tokens `sequence` consumed, then the token
  // chosen after them (not yet consumed). May be empty (nothing to propose).
  virtual StatusOr<std::vector<int64_t>> propose(Sequence &sequence,
                                                 std::span<const int64_t> context,
                                                 int64_t maxTokens) = 0;
};

// The source of `kind` for `model`; Mtp fails, naming the plan, when it has no `mtp` program.
StatusOr<std::unique_ptr<DraftSource>> makeDraftSource(Model &model, DraftSourceKind kind);

} // namespace hybrid
