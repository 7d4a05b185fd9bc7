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
//   replay         benchmark only (hybrid-bench spec): the tokens a plain greedy run of the same
//                  request generated at the drafted positions, each replaced by a wrong token
//                  with probability 1 - ReplayOptions::acceptance (seeded, deterministic). It
//                  measures the verification and rollback machinery's upper bound with a draft
//                  that is right as often as asked, not a draft model's quality. It needs each
//                  request's reference run (proposeFromReference; Scheduler::submit's
//                  replayContinuation), so generation (generateGreedy, hybrid-run, hybrid-serve)
//                  refuses it.
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

enum class DraftSourceKind { PromptLookup, Mtp, Replay };

// "prompt-lookup", "mtp" or "replay"; anything else is an error listing them.
StatusOr<DraftSourceKind> parseDraftSource(std::string_view name);
std::string_view draftSourceName(DraftSourceKind kind);

// The replay source's emulated acceptance: each draft token is the reference run's with
// probability `acceptance` (in [0, 1]), else another token, drawn from (seed, the reference run,
// the position), so the same position gets the same choice in every pass and every run.
struct ReplayOptions {
  double acceptance = 1.0;
  uint64_t seed = 0;
};

// Why generation refuses the replay source (the message of generateGreedy, hybrid-run and
// hybrid-serve): it needs a reference run of the same request.
inline constexpr std::string_view kReplayNeedsReference =
    "draft source replay drafts the tokens a plain greedy run of the same request generated, a "
    "benchmark of the verification machinery (hybrid-bench spec --draft-source replay); "
    "generation has no such run: use prompt-lookup or mtp";

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
  // propose() for a request that comes with a reference run: its prompt, then the tokens a
  // plain greedy run of it generated (the Scheduler passes its replayContinuation). Only the
  // replay source reads it, and needs it (its propose() fails with kReplayNeedsReference);
  // the others propose() as without.
  virtual StatusOr<std::vector<int64_t>> proposeFromReference(Sequence &sequence,
                                                              std::span<const int64_t> context,
                                                              int64_t maxTokens,
                                                              std::span<const int64_t> reference) {
    (void)reference;
    return propose(sequence, context, maxTokens);
  }
};

// The source of `kind` for `model`; Mtp fails, naming the plan, when it has no `mtp` program;
// Replay (with `replay`'s acceptance and seed) when the acceptance is outside [0, 1] or the
// vocabulary has no wrong token to draft.
StatusOr<std::unique_ptr<DraftSource>> makeDraftSource(Model &model, DraftSourceKind kind,
                                                       const ReplayOptions &replay = {});

} // namespace hybrid
