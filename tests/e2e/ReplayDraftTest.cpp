// The replay draft source (benchmark only, Draft.h): hybrid-bench spec drafts, for each request,
// what the plain greedy run generated, with a fraction 1 - acceptance of the draft tokens made
// wrong. On kimi_linear_tiny (the batch-4 plan, as e2e-bench-spec): with every draft right each
// pass yields its whole draft and outputs stay identical, with none right nothing is accepted,
// and generation outside the benchmark refuses it by name. Replay drafts also drive the
// scheduler's draftOnlyWhenItPays through rejections and acceptances (DraftOnlyWhenItPays).
#include "E2eTestSupport.h"

#include "hybrid/runtime/Draft.h"
#include "hybrid/runtime/Generate.h"
#include "hybrid/runtime/Scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <random>

namespace hybrid {
namespace {

using e2etest::compiledDir;
using e2etest::loadOrDie;

// Random prompts: prompt lookup finds nothing to draft in them, replay drafts anyway.
std::vector<std::vector<int64_t>> randomPrompts(int64_t vocab, int64_t count, int64_t length) {
  std::mt19937_64 random(99);
  std::uniform_int_distribution<int64_t> token(0, vocab - 1);
  std::vector<std::vector<int64_t>> prompts(static_cast<size_t>(count));
  for (std::vector<int64_t> &prompt : prompts)
    for (int64_t i = 0; i < length; ++i)
      prompt.push_back(token(random));
  return prompts;
}

SpeculationOptions replayOptions(int64_t maxNewTokens, double acceptance) {
  return {.maxNewTokens = maxNewTokens,
          .draftTokens = 3,
          .draftSource = DraftSourceKind::Replay,
          .draftOnlyWhenItPays = false, // every step drafts: counts independent of timing
          .prefillChunkTokens = 8192,
          .replay = {.acceptance = acceptance, .seed = 7}};
}

TEST(ReplayDrafts, FullAcceptanceYieldsWholeDraftsWithIdenticalOutputs) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny-batch4"));
  ASSERT_TRUE(model);
  for (int64_t batch : {1, 3}) {
    const auto prompts = randomPrompts(model->vocabSize(), batch, 24);
    auto report = benchmarkSpeculation(*model, prompts, replayOptions(12, 1.0));
    ASSERT_TRUE(report.isOk()) << report.status().message();
    EXPECT_TRUE(report->identical) << "batch " << batch;
    EXPECT_EQ(report->generatedTokens, 12 * batch);
    // Per request: the first token from the prefill, then passes of 3 drafts + 1 (4, 4) and a
    // last one with room for 3 (2 drafts + 1), every draft accepted.
    EXPECT_EQ(report->verifySteps, 3 * batch) << "batch " << batch;
    EXPECT_EQ(report->draftedTokens, 8 * batch) << "batch " << batch;
    EXPECT_EQ(report->acceptedTokens, report->draftedTokens) << "batch " << batch;
    const double tokensPerPass = double(report->acceptedTokens + report->verifySteps) /
                                 double(report->verifySteps);
    EXPECT_GT(tokensPerPass, 1.0);
    EXPECT_DOUBLE_EQ(tokensPerPass, 11.0 / 3.0);
    if (batch > 1) { // the scheduler verified several requests' drafts per pass
      EXPECT_LT(report->verifyCalls, report->verifySteps);
    }
    // The model's verification timings over the speculative run alone (the plain one makes no
    // verification calls).
    EXPECT_EQ(report->verify.calls, report->verifyCalls) << "batch " << batch;
    EXPECT_EQ(report->verify.sequences, report->verifySteps) << "batch " << batch;
    EXPECT_GT(report->verify.passSeconds, 0.0) << "batch " << batch;
  }
}

TEST(ReplayDrafts, ZeroAcceptanceAcceptsNothing) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny-batch4"));
  ASSERT_TRUE(model);
  const auto prompts = randomPrompts(model->vocabSize(), 3, 24);
  auto report = benchmarkSpeculation(*model, prompts, replayOptions(8, 0.0));
  ASSERT_TRUE(report.isOk()) << report.status().message();
  EXPECT_TRUE(report->identical);
  EXPECT_GT(report->draftedTokens, 0);
  EXPECT_EQ(report->acceptedTokens, 0);
  // Every pass yields only the model's own token: 7 per request after the prefill's.
  EXPECT_EQ(report->verifySteps, 3 * 7);
}

TEST(ReplayDrafts, PartialAcceptanceKeepsOutputs) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny-batch4"));
  ASSERT_TRUE(model);
  const auto prompts = randomPrompts(model->vocabSize(), 3, 24);
  auto report = benchmarkSpeculation(*model, prompts, replayOptions(24, 0.5));
  ASSERT_TRUE(report.isOk()) << report.status().message();
  EXPECT_TRUE(report->identical);
  EXPECT_GT(report->acceptedTokens, 0);
  EXPECT_LT(report->acceptedTokens, report->draftedTokens);
}

// The source itself: the reference's tokens at the next positions, fewer near its end, none
// past it; at acceptance 0 every token differs from the reference's, the same in every call.
TEST(ReplayDrafts, SourceDraftsTheReferenceRun) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"));
  ASSERT_TRUE(model);
  auto sequence = model->newSequence();
  ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
  const std::vector<int64_t> reference = randomPrompts(model->vocabSize(), 1, 20)[0];
  const std::span<const int64_t> context = std::span(reference).first(12);

  auto right = makeDraftSource(*model, DraftSourceKind::Replay, {.acceptance = 1.0, .seed = 3});
  ASSERT_TRUE(right.isOk()) << right.status().message();
  EXPECT_EQ((*right)->kind(), DraftSourceKind::Replay);
  auto draft = (*right)->proposeFromReference(**sequence, context, 4, reference);
  ASSERT_TRUE(draft.isOk()) << draft.status().message();
  EXPECT_EQ(*draft, std::vector<int64_t>(reference.begin() + 12, reference.begin() + 16));
  auto tail = (*right)->proposeFromReference(**sequence, std::span(reference).first(18), 4,
                                             reference);
  ASSERT_TRUE(tail.isOk());
  EXPECT_EQ(*tail, std::vector<int64_t>(reference.begin() + 18, reference.end()));
  auto past = (*right)->proposeFromReference(**sequence, reference, 4, reference);
  ASSERT_TRUE(past.isOk());
  EXPECT_TRUE(past->empty());

  auto wrong = makeDraftSource(*model, DraftSourceKind::Replay, {.acceptance = 0.0, .seed = 3});
  ASSERT_TRUE(wrong.isOk()) << wrong.status().message();
  auto bad = (*wrong)->proposeFromReference(**sequence, context, 8, reference);
  ASSERT_TRUE(bad.isOk()) << bad.status().message();
  ASSERT_EQ(bad->size(), 8u);
  for (size_t i = 0; i < bad->size(); ++i) {
    EXPECT_NE((*bad)[i], reference[12 + i]) << "draft token " << i;
    EXPECT_GE((*bad)[i], 0);
    EXPECT_LT((*bad)[i], model->vocabSize());
  }
  auto again = (*wrong)->proposeFromReference(**sequence, context, 8, reference);
  ASSERT_TRUE(again.isOk());
  EXPECT_EQ(*again, *bad);

  // Without a reference run there is nothing to replay.
  auto none = (*right)->propose(**sequence, context, 4);
  ASSERT_FALSE(none.isOk());
  EXPECT_NE(none.status().message().find("draft source replay"), std::string::npos)
      << none.status().message();
}

TEST(ReplayDrafts, RefusedOutsideTheBenchmark) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"));
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = randomPrompts(model->vocabSize(), 1, 8)[0];

  GenerationOptions generation;
  generation.maxNewTokens = 4;
  generation.draftTokens = 2;
  generation.draftSource = DraftSourceKind::Replay;
  auto generated = generateGreedy(*model, prompt, generation);
  ASSERT_FALSE(generated.isOk());
  EXPECT_NE(generated.status().message().find("draft source replay"), std::string::npos)
      << generated.status().message();

  SchedulerOptions options;
  options.draftTokens = 2;
  options.draftSource = DraftSourceKind::Replay;
  Scheduler scheduler(*model, options);
  auto refused = scheduler.submit(
      {.prompt = prompt, .maxNewTokens = 4, .stopTokens = {}, .sampling = {}});
  ASSERT_FALSE(refused.isOk());
  EXPECT_NE(refused.status().message().find("no replayContinuation"), std::string::npos)
      << refused.status().message();
  const std::vector<int64_t> continuation = {1, 2, 3, 4};
  EXPECT_TRUE(scheduler
                  .submit({.prompt = prompt, .maxNewTokens = 4, .stopTokens = {}, .sampling = {}},
                          continuation)
                  .isOk());

  for (double acceptance : {-0.1, 1.5}) {
    auto source = makeDraftSource(*model, DraftSourceKind::Replay, {.acceptance = acceptance});
    ASSERT_FALSE(source.isOk());
    EXPECT_NE(source.status().message().find("outside [0, 1]"), std::string::npos)
        << source.status().message();
  }
  EXPECT_EQ(*parseDraftSource("replay"), DraftSourceKind::Replay);
  EXPECT_EQ(draftSourceName(DraftSourceKind::Replay), "replay");
}

// SchedulerOptions::draftOnlyWhenItPays with re-probing. A clock that advances one second per
// reading makes its choices deterministic: every interval the scheduler times (a proposal, a
// pass, a decode call) lasts one second, so a request's pass costs 2 (its proposal and the pass)
// and a decode row 1 / the call's rows; a request alone drafts while it accepts at least one draft
// per pass on average.
std::function<double()> tickingClock() {
  auto ticks = std::make_shared<double>(0);
  return [ticks] { return ++*ticks; };
}

SchedulerOptions payingOptions() {
  SchedulerOptions options;
  options.prefillChunkTokens = 8192;
  options.draftTokens = 3;
  options.draftSource = DraftSourceKind::Replay;
  options.replay = {.acceptance = 1.0, .seed = 7}; // drafts are the continuation given
  options.draftOnlyWhenItPays = true;
  options.clock = tickingClock();
  return options;
}

// The greedy continuation with its first `wrong` tokens replaced: replay drafts from it are
// rejected there and accepted after.
std::vector<int64_t> wrongAtFirst(std::vector<int64_t> reference, size_t wrong, int64_t vocab) {
  for (size_t i = 0; i < std::min(wrong, reference.size()); ++i)
    reference[i] = (reference[i] + 1) % vocab;
  return reference;
}

// One request alone stepped to the end: its tokens, and the declined steps before each pass.
struct SteppedRun {
  std::vector<int64_t> tokens;
  std::vector<int64_t> declinedBeforePass;
};
SteppedRun stepAlone(Scheduler &scheduler) {
  SteppedRun run;
  SchedulerStats before = scheduler.stats();
  int64_t declined = 0;
  for (int steps = 0; !scheduler.idle() && steps < 5000; ++steps) {
    for (const TokenEvent &event : scheduler.step()) {
      EXPECT_TRUE(event.error.empty()) << event.error;
      run.tokens.push_back(event.token);
    }
    const SchedulerStats after = scheduler.stats();
    declined += after.declinedDrafts - before.declinedDrafts;
    if (after.verifySteps > before.verifySteps) {
      EXPECT_EQ(after.verifySteps, before.verifySteps + 1);
      run.declinedBeforePass.push_back(declined);
      declined = 0;
    }
    before = after;
  }
  EXPECT_TRUE(scheduler.idle());
  return run;
}

// The first pass (the probe) and the re-probe after 8 declined steps accept nothing (the first 12
// drafted tokens are wrong); the re-probe after 16 more accepts its draft, and from then on the
// request speculates on every step. Before re-probing existed the probe decided for good: 1 pass
// and 38 declined steps. Tokens: the prefill's, then 6 passes of 1 + 0, 0, 1, 2, 3, 3 accepted
// drafts (draft lengths 3, 2, 1 after the rejections, then 1, 2, 3, 3 as they are accepted) and 24
// plain decode steps: 1 + 15 + 24 = 40.
TEST(DraftOnlyWhenItPays, ReprobesAfterABackOffAndSpeculatesOnceDraftsAreAccepted) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"));
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = randomPrompts(model->vocabSize(), 1, 24)[0];
  const int64_t newTokens = 40;
  const std::vector<int64_t> reference = e2etest::greedyIds(*model, prompt, newTokens);
  ASSERT_EQ(static_cast<int64_t>(reference.size()), newTokens);

  Scheduler scheduler(*model, payingOptions());
  auto id = scheduler.submit(
      {.prompt = prompt, .maxNewTokens = newTokens, .stopTokens = {}, .sampling = {}},
      wrongAtFirst(reference, 12, model->vocabSize()));
  ASSERT_TRUE(id.isOk()) << id.status().message();
  const SteppedRun run = stepAlone(scheduler);
  EXPECT_EQ(run.tokens, reference);
  EXPECT_EQ(run.declinedBeforePass, (std::vector<int64_t>{0, 8, 16, 0, 0, 0}));
  const SchedulerStats stats = scheduler.stats();
  EXPECT_EQ(stats.verifySteps, 6);
  EXPECT_EQ(stats.declinedDrafts, 24);
  EXPECT_EQ(stats.draftedTokens, 3 + 2 + 1 + 2 + 3 + 3);
  EXPECT_EQ(stats.acceptedTokens, 0 + 0 + 1 + 2 + 3 + 3);
  EXPECT_EQ(stats.verifySteps + stats.acceptedTokens + stats.declinedDrafts, newTokens - 1);
}

// Drafts that are never accepted: after the first probe the request re-probes after 8 declined
// steps, then 16, 32, ... doubling up to 256 (kReprobeAfterMax), and stays there: 7 re-probes in
// 800 tokens, each one pass of 1 token, and the tokens are the plain greedy ones.
TEST(DraftOnlyWhenItPays, ReprobeBackOffDoublesUpToItsCap) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"));
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = randomPrompts(model->vocabSize(), 1, 24)[0];
  const int64_t newTokens = 800;
  ASSERT_GE(model->maxContextTokens(), 24 + newTokens);
  const std::vector<int64_t> reference = e2etest::greedyIds(*model, prompt, newTokens);
  ASSERT_EQ(static_cast<int64_t>(reference.size()), newTokens);
  EXPECT_EQ(SchedulerOptions::kReprobeAfter, 8);
  EXPECT_EQ(SchedulerOptions::kReprobeAfterMax, 256);

  Scheduler scheduler(*model, payingOptions());
  auto id = scheduler.submit(
      {.prompt = prompt, .maxNewTokens = newTokens, .stopTokens = {}, .sampling = {}},
      wrongAtFirst(reference, reference.size(), model->vocabSize()));
  ASSERT_TRUE(id.isOk()) << id.status().message();
  const SteppedRun run = stepAlone(scheduler);
  EXPECT_EQ(run.tokens, reference);
  EXPECT_EQ(run.declinedBeforePass, (std::vector<int64_t>{0, 8, 16, 32, 64, 128, 256, 256}));
  const SchedulerStats stats = scheduler.stats();
  EXPECT_EQ(stats.verifySteps, 8);
  EXPECT_EQ(stats.acceptedTokens, 0);
  EXPECT_EQ(stats.draftedTokens, 3 + 2 + 6 * 1); // the draft length shrinks to 1 and stays
  // 760 before the last re-probe, 31 after it.
  EXPECT_EQ(stats.declinedDrafts, newTokens - 1 - 8);
}

// Submits each prompt with the replay continuation `wrong` of its greedy ids (the first `wrong`
// replaced), runs the scheduler to idle and checks every request's tokens are its greedy ids.
void runBatchAgainstGreedy(Scheduler &scheduler, Model &model,
                           const std::vector<std::vector<int64_t>> &prompts, int64_t newTokens,
                           size_t wrong) {
  std::map<uint64_t, std::vector<int64_t>> expected;
  for (const std::vector<int64_t> &prompt : prompts) {
    std::vector<int64_t> reference = e2etest::greedyIds(model, prompt, newTokens);
    auto id = scheduler.submit(
        {.prompt = prompt, .maxNewTokens = newTokens, .stopTokens = {}, .sampling = {}},
        wrongAtFirst(reference, wrong, model.vocabSize()));
    ASSERT_TRUE(id.isOk()) << id.status().message();
    expected[*id] = std::move(reference);
  }
  const e2etest::SchedulerRun run = e2etest::runToIdle(scheduler);
  EXPECT_TRUE(run.errors.empty());
  EXPECT_EQ(run.tokens, expected);
}

// Several requests with the real clock: which steps draft follows the timings, the tokens do not;
// every token after a request's first comes from a pass (1 + its accepted drafts) or a declined
// step.
TEST(DraftOnlyWhenItPays, ReprobingKeepsTheTokensOfABatch) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny-batch4"));
  ASSERT_TRUE(model);
  const auto prompts = randomPrompts(model->vocabSize(), 3, 24);
  const int64_t newTokens = 48;
  SchedulerOptions options = payingOptions();
  options.clock = {};
  Scheduler scheduler(*model, options);
  runBatchAgainstGreedy(scheduler, *model, prompts, newTokens, 16);
  const SchedulerStats stats = scheduler.stats();
  EXPECT_GE(stats.verifySteps, 1);
  EXPECT_EQ(stats.verifySteps + stats.acceptedTokens + stats.declinedDrafts,
            static_cast<int64_t>(prompts.size()) * (newTokens - 1));
}

// A batch where a decode row costs a third of a tick or less (3-4 rows per call) and a pass of one
// draft 2 ticks: even a pass accepting its whole draft (2 tokens per 2 ticks) loses to the batched
// rows, so once three passes are timed (a GPU's first pass of a shape runs eagerly, its second
// captures a graph) no request probes again, however long it declines (re-probing every 8+ steps
// cost 35% of the decode rate at batch 32 on the H200). Every request probes in the first step
// (without batchPrefillCalls, a pass each): four timed passes, then none.
TEST(DraftOnlyWhenItPays, NoReprobeWhereEvenAFullyAcceptedPassWouldNotPay) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny-batch4"));
  ASSERT_TRUE(model);
  const auto prompts = randomPrompts(model->vocabSize(), 4, 24);
  const int64_t newTokens = 40;
  SchedulerOptions options = payingOptions();
  options.draftTokens = 1;
  Scheduler scheduler(*model, options);
  runBatchAgainstGreedy(scheduler, *model, prompts, newTokens, 0); // every draft accepted
  const SchedulerStats stats = scheduler.stats();
  EXPECT_GE(static_cast<int64_t>(prompts.size()), SchedulerOptions::kTimedPassesBeforeGivingUp);
  EXPECT_EQ(stats.verifySteps, static_cast<int64_t>(prompts.size())); // the first probes only
  EXPECT_EQ(stats.acceptedTokens, static_cast<int64_t>(prompts.size()));
  EXPECT_EQ(stats.verifySteps + stats.acceptedTokens + stats.declinedDrafts,
            static_cast<int64_t>(prompts.size()) * (newTokens - 1));
}

// SchedulerOptions::batchInvariantModel: on a model whose kernels are not batch-invariant a
// request speculates only while it is the one request decoding. Three requests decoding together
// never draft (their tokens are plain decoding's), a request alone does; on a batch-invariant
// model (the cpu device's own answer) the three draft too. Every draft is accepted (replay).
TEST(SpeculationWithoutBatchInvariance, OnlyARequestDecodingAloneSpeculates) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny-batch4"));
  ASSERT_TRUE(model);
  EXPECT_TRUE(model->batchInvariant()); // the cpu device
  const auto prompts = randomPrompts(model->vocabSize(), 3, 24);
  const int64_t newTokens = 16;
  for (const bool invariant : {false, true})
    for (const size_t requests : {size_t(3), size_t(1)}) {
      SCOPED_TRACE(testing::Message() << (invariant ? "batch-invariant" : "not batch-invariant")
                                      << ", " << requests << " requests");
      SchedulerOptions options = payingOptions();
      options.draftOnlyWhenItPays = false; // every step that may draft does
      options.batchInvariantModel = invariant;
      Scheduler scheduler(*model, options);
      runBatchAgainstGreedy(scheduler, *model,
                            {prompts.begin(), prompts.begin() + std::ptrdiff_t(requests)},
                            newTokens, 0);
      const SchedulerStats stats = scheduler.stats();
      if (!invariant && requests > 1) {
        EXPECT_EQ(stats.verifySteps, 0);
        EXPECT_EQ(stats.declinedDrafts, static_cast<int64_t>(requests) * (newTokens - 1));
      } else {
        EXPECT_GT(stats.verifySteps, 0);
        EXPECT_EQ(stats.acceptedTokens, stats.draftedTokens);
      }
    }
}

} // namespace
} // namespace hybrid
