// Several sequences in one prefill program call (Model::prefillBatch, Model::verifyDrafts) on the
// three golden checkpoints: each sequence's logits, recurrent state and KV cache (checked by the
// decode steps that read it) equal what it gets alone, for random prompt lengths, sequences that
// already hold tokens, and drafts accepted in part, rejected at once and accepted whole. The
// scheduler, which now batches its prefill chunks and verifications, still gives every request
// the tokens of its own greedy run.
#include "hybrid/runtime/Generate.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Scheduler.h"
#include "E2eTestSupport.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>

namespace hybrid {
namespace {

using e2etest::compiledDir;
using e2etest::goldenPrompt;
using e2etest::loadOrDie;

// The state of `a` against `b`, relative to b's largest magnitude (at least 1).
double relativeStateDiff(Sequence &a, Sequence &b) {
  auto state = a.recurrentState(), expected = b.recurrentState();
  EXPECT_TRUE(state.isOk() && expected.isOk());
  if (!state.isOk() || !expected.isOk() || state->size() != expected->size())
    return 1e30;
  double magnitude = 1, worst = 0;
  for (size_t i = 0; i < expected->size(); ++i) {
    magnitude = std::max(magnitude, double(std::abs((*expected)[i])));
    worst = std::max(worst, std::abs(double((*state)[i]) - double((*expected)[i])));
  }
  return worst / magnitude;
}

int64_t argmax(std::span<const float> row) {
  return std::max_element(row.begin(), row.end()) - row.begin();
}

// Decodes `steps` greedy tokens on both sequences from `token`: the logits must be equal, which
// they are only if both KV caches and states are.
void expectSameContinuations(Sequence &batched, Sequence &alone, int64_t token, int steps) {
  for (int step = 0; step < steps; ++step) {
    auto a = batched.decode(token), b = alone.decode(token);
    ASSERT_TRUE(a.isOk() && b.isOk());
    ASSERT_EQ(*a, *b) << "decode step " << step << " after the batched call";
    token = argmax(*a);
  }
}

class BatchedPrefillTest : public testing::TestWithParam<std::string> {};

// Random prompt lengths (1 to 40 tokens) for four sequences, two of which already hold a first
// chunk; the batch's rows are every segment's, its logits those of each sequence's own prefill.
TEST_P(BatchedPrefillTest, SegmentsEqualOneAtATime) {
  LoadOptions options;
  options.maxSequences = 8;
  auto model = loadOrDie(compiledDir(GetParam()), options);
  ASSERT_TRUE(model);
  const int64_t vocab = model->vocabSize();
  std::mt19937_64 random(17);
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(testing::Message() << "round " << round);
    std::vector<std::unique_ptr<Sequence>> batched, alone;
    std::vector<std::vector<int64_t>> chunks;
    for (int i = 0; i < 4; ++i) {
      const int64_t before = i % 2 ? std::uniform_int_distribution<int64_t>(1, 20)(random) : 0;
      const int64_t length = std::uniform_int_distribution<int64_t>(1, 40)(random);
      std::vector<int64_t> first(static_cast<size_t>(before)), chunk(static_cast<size_t>(length));
      for (auto *tokens : {&first, &chunk})
        for (int64_t &token : *tokens)
          token = std::uniform_int_distribution<int64_t>(0, vocab - 1)(random);
      for (auto *group : {&batched, &alone}) {
        auto sequence = model->newSequence();
        ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
        if (!first.empty()) {
          ASSERT_TRUE((*sequence)->prefill(first).isOk());
        }
        group->push_back(std::move(*sequence));
      }
      chunks.push_back(std::move(chunk));
    }
    std::vector<PrefillSegment> segments;
    for (size_t i = 0; i < batched.size(); ++i)
      segments.push_back({.sequence = batched[i].get(), .tokens = chunks[i]});
    auto logits = model->prefillBatch(segments);
    ASSERT_TRUE(logits.isOk()) << logits.status().message();
    size_t row = 0;
    for (size_t i = 0; i < batched.size(); ++i) {
      SCOPED_TRACE(testing::Message() << "sequence " << i << ", " << chunks[i].size() << " tokens");
      auto single = alone[i]->prefill(chunks[i]);
      ASSERT_TRUE(single.isOk()) << single.status().message();
      const std::vector<float> rows(logits->begin() + row * vocab,
                                    logits->begin() + (row + chunks[i].size()) * vocab);
      row += chunks[i].size();
      EXPECT_EQ(rows, *single);
      EXPECT_EQ(batched[i]->length(), alone[i]->length());
      EXPECT_LE(relativeStateDiff(*batched[i], *alone[i]), 1e-6);
      expectSameContinuations(*batched[i], *alone[i], argmax(std::span(*single).last(vocab)), 3);
    }
    EXPECT_EQ(row * vocab, logits->size());
  }
}

// PrefillLogits::LastRow gives each segment's last row, in segment order.
TEST_P(BatchedPrefillTest, LastRowsAreEachSegmentsLastRow) {
  LoadOptions options;
  options.maxSequences = 6;
  auto model = loadOrDie(compiledDir(GetParam()), options);
  ASSERT_TRUE(model);
  const int64_t vocab = model->vocabSize();
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  const std::vector<std::vector<int64_t>> prompts = {
      prompt, {prompt.begin(), prompt.begin() + 1}, {prompt.rbegin(), prompt.rend() - 13}};
  std::vector<std::unique_ptr<Sequence>> all, last;
  std::vector<PrefillSegment> allRows, lastRows;
  for (const auto &tokens : prompts)
    for (auto *group : {&all, &last}) {
      auto sequence = model->newSequence();
      ASSERT_TRUE(sequence.isOk());
      (group == &all ? allRows : lastRows).push_back({.sequence = sequence->get(), .tokens = tokens});
      group->push_back(std::move(*sequence));
    }
  auto every = model->prefillBatch(allRows, PrefillLogits::AllRows);
  auto ends = model->prefillBatch(lastRows, PrefillLogits::LastRow);
  ASSERT_TRUE(every.isOk() && ends.isOk());
  ASSERT_EQ(ends->size(), prompts.size() * size_t(vocab));
  size_t end = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    end += prompts[i].size();
    EXPECT_TRUE(std::equal(ends->begin() + i * vocab, ends->begin() + (i + 1) * vocab,
                           every->begin() + (end - 1) * vocab))
        << "segment " << i;
  }
}

// Three prompts of the golden checkpoint with a token and a draft each: one accepted in part
// (1), one rejected at once (0), one accepted whole (3); `groups` sequences prefilled per prompt.
struct VerificationCases {
  std::vector<std::vector<std::unique_ptr<Sequence>>> groups;
  std::vector<std::vector<int64_t>> drafts;
  std::vector<int64_t> tokens, expectedAccepted;
  std::vector<DraftCheck> checksOf(size_t group) const {
    std::vector<DraftCheck> checks;
    for (size_t i = 0; i < tokens.size(); ++i)
      checks.push_back(
          {.sequence = groups[group][i].get(), .token = tokens[i], .draft = drafts[i]});
    return checks;
  }
};
VerificationCases verificationCases(Model &model, const std::string &checkpoint, size_t groups) {
  VerificationCases cases;
  cases.groups.resize(groups);
  const std::vector<int64_t> golden = goldenPrompt(checkpoint);
  const std::vector<std::vector<int64_t>> prompts = {
      golden, {golden.begin(), golden.begin() + 11}, {golden.rbegin(), golden.rend() - 5}};
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationOptions greedyOptions;
    greedyOptions.maxNewTokens = 5;
    const std::vector<int64_t> greedy =
        generateGreedy(model, prompts[i], greedyOptions).value().generated;
    const int64_t wrong = (greedy[2] + 1) % model.vocabSize();
    const std::vector<std::vector<int64_t>> drafts = {
        {greedy[1], wrong, greedy[3]}, {wrong, greedy[2]}, {greedy[1], greedy[2], greedy[3]}};
    cases.drafts.push_back(drafts[i]);
    cases.expectedAccepted.push_back(i == 0 ? 1 : i == 1 ? 0 : 3);
    cases.tokens.push_back(greedy[0]);
    for (auto &group : cases.groups) {
      auto sequence = model.newSequence();
      EXPECT_TRUE(sequence.isOk()) << sequence.status().message();
      EXPECT_TRUE((*sequence)->prefill(prompts[i]).isOk());
      group.push_back(std::move(*sequence));
    }
  }
  return cases;
}

// Three sequences verify their drafts in one pass: one accepted in part, one rejected at once, one
// accepted whole; each result, state (1e-6) and the decode steps after it equal the sequence's
// own verifyDraft.
TEST_P(BatchedPrefillTest, BatchedVerificationEqualsOneAtATime) {
  LoadOptions options;
  options.maxSequences = 8;
  auto model = loadOrDie(compiledDir(GetParam()), options);
  ASSERT_TRUE(model);
  VerificationCases cases = verificationCases(*model, GetParam(), 2);
  auto &batched = cases.groups[0], &alone = cases.groups[1];
  auto verified = model->verifyDrafts(cases.checksOf(0));
  ASSERT_TRUE(verified.isOk()) << verified.status().message();
  ASSERT_EQ(verified->size(), batched.size());
  for (size_t i = 0; i < batched.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "sequence " << i);
    auto single = alone[i]->verifyDraft(cases.tokens[i], cases.drafts[i]);
    ASSERT_TRUE(single.isOk()) << single.status().message();
    const DraftVerification &result = (*verified)[i];
    EXPECT_EQ(result.accepted, cases.expectedAccepted[i]);
    EXPECT_EQ(result.accepted, single->accepted);
    EXPECT_EQ(result.tokens, single->tokens);
    EXPECT_EQ(result.logits, single->logits);
    EXPECT_EQ(batched[i]->length(), alone[i]->length());
    EXPECT_LE(relativeStateDiff(*batched[i], *alone[i]), 1e-6);
    expectSameContinuations(*batched[i], *alone[i], result.tokens.back(), 3);
  }
}

// verifyDrafts without logits (the Scheduler's: the cuda device chooses on the GPU) keeps the
// same tokens and leaves the same states; its results carry no logits. The cpu device is
// batch-invariant (Model::batchInvariant).
TEST_P(BatchedPrefillTest, VerificationWithoutLogitsKeepsTheTokens) {
  LoadOptions options;
  options.maxSequences = 8;
  auto model = loadOrDie(compiledDir(GetParam()), options);
  ASSERT_TRUE(model);
  EXPECT_TRUE(model->batchInvariant());
  VerificationCases cases = verificationCases(*model, GetParam(), 2);
  auto withLogits = model->verifyDrafts(cases.checksOf(0));
  auto tokensOnly = model->verifyDrafts(cases.checksOf(1), /*keepLogits=*/false);
  ASSERT_TRUE(withLogits.isOk() && tokensOnly.isOk());
  for (size_t i = 0; i < cases.tokens.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "sequence " << i);
    EXPECT_EQ((*tokensOnly)[i].accepted, cases.expectedAccepted[i]);
    EXPECT_EQ((*tokensOnly)[i].tokens, (*withLogits)[i].tokens);
    EXPECT_TRUE((*tokensOnly)[i].logits.empty());
    EXPECT_FALSE((*withLogits)[i].logits.empty());
    EXPECT_LE(relativeStateDiff(*cases.groups[1][i], *cases.groups[0][i]), 0.0);
  }
  const VerifyTimings &timings = model->verifyTimings();
  EXPECT_EQ(timings.calls, 2);
  EXPECT_EQ(timings.sequences, 6);
  EXPECT_GT(timings.passSeconds, 0.0);
}

// What a batched call cannot run is refused before anything runs, naming the sequence or limit.
TEST_P(BatchedPrefillTest, RefusesWhatItCannotRun) {
  LoadOptions options;
  options.maxSequences = 4;
  options.maxContextTokens = 64;
  auto model = loadOrDie(compiledDir(GetParam()), options);
  auto other = loadOrDie(compiledDir(GetParam()));
  ASSERT_TRUE(model && other);
  auto a = model->newSequence(), b = model->newSequence(), stranger = other->newSequence();
  ASSERT_TRUE(a.isOk() && b.isOk() && stranger.isOk());
  const std::vector<int64_t> three = {1, 2, 3}, none, long70(70, 1);
  const std::vector<int64_t> tooMany(static_cast<size_t>(model->maxPrefillTokens()) + 1, 1);
  auto refused = [&](std::vector<PrefillSegment> segments, const std::string &expected) {
    auto result = model->prefillBatch(segments);
    ASSERT_FALSE(result.isOk());
    EXPECT_NE(result.status().message().find(expected), std::string::npos)
        << result.status().message();
  };
  Sequence *x = a->get(), *y = b->get();
  refused({}, "prefillBatch: no sequences");
  refused({{.sequence = x, .tokens = three}, {.sequence = x, .tokens = three}},
          "sequences 0 and 1 are the same sequence");
  refused({{.sequence = x, .tokens = three}, {.sequence = stranger->get(), .tokens = three}},
          "sequence 1 is not one of this model's");
  refused({{.sequence = x, .tokens = three}, {.sequence = y, .tokens = none}},
          "sequence 1 has no tokens");
  refused({{.sequence = x, .tokens = three}, {.sequence = y, .tokens = long70}},
          "sequence 1 would grow to 70 tokens, past maxContextTokens = 64");
  // The program's rows (other's context is long enough to hold them).
  auto otherSecond = other->newSequence();
  ASSERT_TRUE(otherSecond.isOk());
  const std::vector<PrefillSegment> overBudget = {{.sequence = stranger->get(), .tokens = tooMany},
                                                  {.sequence = otherSecond->get(), .tokens = three}};
  auto result = other->prefillBatch(overBudget);
  ASSERT_FALSE(result.isOk());
  EXPECT_NE(result.status().message().find(
                std::to_string(tooMany.size() + 3) + " rows of 2 sequences, the prefill program "
                "takes at most " + std::to_string(other->maxPrefillTokens()) +
                " per call (hybrid-compile --prefill-tokens)"),
            std::string::npos)
      << result.status().message();
  EXPECT_EQ(stranger->get()->length(), 0);
  const DraftCheck empty{.sequence = x, .token = 1, .draft = none};
  auto verified = model->verifyDrafts(std::span(&empty, 1));
  ASSERT_FALSE(verified.isOk());
  EXPECT_NE(verified.status().message().find("check 0 has an empty draft"), std::string::npos)
      << verified.status().message();
  EXPECT_EQ(x->length(), 0);
  EXPECT_EQ(y->length(), 0);
}

// Requests prefilled and speculating together: their prefill chunks share program calls, their
// drafts are verified several per pass, and each still gets its own greedy run's tokens.
TEST_P(BatchedPrefillTest, SchedulerBatchesPrefillsAndVerifications) {
  LoadOptions options;
  options.maxSequences = 8;
  auto model = loadOrDie(compiledDir(GetParam()), options);
  ASSERT_TRUE(model);
  const std::vector<int64_t> golden = goldenPrompt(GetParam());
  std::vector<int64_t> repetitive;
  for (int i = 0; i < 4; ++i)
    repetitive.insert(repetitive.end(), golden.begin(), golden.begin() + 9);
  // Random weights rarely continue a pattern: enough repetitive requests that several draft at once.
  std::vector<std::vector<int64_t>> prompts = {golden, {golden.begin(), golden.begin() + 1},
                                               {golden.rbegin(), golden.rend()}};
  for (size_t shift : {0, 2, 3, 5, 7})
    prompts.emplace_back(repetitive.begin() + static_cast<std::ptrdiff_t>(shift), repetitive.end());
  SchedulerOptions schedulerOptions;
  schedulerOptions.prefillChunkTokens = 16;
  schedulerOptions.draftTokens = 4;
  schedulerOptions.batchPrefillCalls = true;
  Scheduler scheduler(*model, schedulerOptions);
  const auto promptOf = e2etest::submitGreedy(scheduler, prompts, 20);
  const e2etest::SchedulerRun run = e2etest::runToIdle(scheduler, 500);
  EXPECT_TRUE(run.errors.empty());
  for (const auto &[id, prompt] : promptOf)
    EXPECT_EQ(run.tokens.at(id), e2etest::greedyIds(*model, prompt, 20)) << "request " << id;
  const SchedulerStats stats = scheduler.stats();
  EXPECT_GT(stats.prefillBatches, 0);
  EXPECT_GE(stats.batchedPrefillSegments, 2 * stats.prefillBatches);
  EXPECT_GT(stats.verifyBatches, 0);
  EXPECT_GE(stats.batchedVerifySequences, 2 * stats.verifyBatches);
  EXPECT_LE(stats.acceptedTokens, stats.draftedTokens);
  std::printf("prefill calls of several requests %lld (%lld requests), verification passes of "
              "several %lld (%lld sequences), drafted %lld, accepted %lld\n",
              (long long)stats.prefillBatches, (long long)stats.batchedPrefillSegments,
              (long long)stats.verifyBatches, (long long)stats.batchedVerifySequences,
              (long long)stats.draftedTokens, (long long)stats.acceptedTokens);
}

INSTANTIATE_TEST_SUITE_P(Golden, BatchedPrefillTest,
                         testing::Values("kimi_linear_tiny", "deepseek_v32_tiny",
                                         "kimi_attnres_tiny"));

} // namespace
} // namespace hybrid
