// Token sampling through the runtime on the compiled golden checkpoints: Model::decodeBatchChoose
// against the reference sampler on decodeBatch's logits, and the scheduler giving each seeded
// request the same tokens whatever it is batched with (or preempted by), greedy ones unchanged.
#include "hybrid/kernels/ref/Sampling.h"
#include "hybrid/runtime/Generate.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Sampling.h"
#include "hybrid/runtime/Scheduler.h"
#include "E2eTestSupport.h"

#include <gtest/gtest.h>

#include <map>
#include <numeric>

namespace hybrid {
namespace {

using e2etest::compiledDir;
using e2etest::goldenPrompt;
using e2etest::loadOrDie;

SamplingParams sampled(float temperature, int32_t topK, float topP, uint64_t seed) {
  SamplingParams params;
  params.temperature = temperature;
  params.topK = topK;
  params.topP = topP;
  params.seed = seed;
  return params;
}

// Greedy, and sampling plain, with top-k and with top-p.
const std::vector<SamplingParams> kChoices = {SamplingParams{}, sampled(1.5f, 0, 1.0f, 11),
                                              sampled(1.0f, 8, 1.0f, 12),
                                              sampled(0.8f, 0, 0.9f, 13)};

class DecodeBatchChooseTest : public testing::TestWithParam<std::string> {};

// Rows of different lengths and choices, as the batch shrinks and grows: each row's token is the
// reference sampler's on decodeBatch's logits for that row (same prompts, same fed tokens).
TEST_P(DecodeBatchChooseTest, ChoosesWhatTheReferenceSamplesFromTheLogits) {
  LoadOptions options;
  options.maxSequences = 8;
  auto model = loadOrDie(compiledDir(GetParam()) + "-batch4", options);
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  const std::vector<std::vector<int64_t>> prompts = {prompt,
                                                     {prompt.begin(), prompt.begin() + 7},
                                                     {prompt.rbegin(), prompt.rend() - 11},
                                                     {prompt.begin() + 3, prompt.end()}};
  const auto vocab = static_cast<size_t>(model->vocabSize());
  std::vector<std::unique_ptr<Sequence>> choosing, reference;
  std::vector<int64_t> next;
  for (const auto &tokens : prompts) {
    for (auto *group : {&choosing, &reference}) {
      auto sequence = model->newSequence();
      ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
      ASSERT_TRUE((*sequence)->prefill(tokens).isOk());
      group->push_back(std::move(*sequence));
    }
    next.push_back(tokens.back()); // any token will do: the rows' logits differ by prompt
  }
  int64_t step = 0;
  bool sampledDiffersFromGreedy = false;
  for (size_t members : {4u, 2u, 1u, 3u, 4u, 4u}) {
    std::vector<Sequence *> rows, referenceRows;
    std::vector<int64_t> tokens;
    std::vector<TokenChoice> choices;
    for (size_t i = 0; i < members; ++i) {
      rows.push_back(choosing[i].get());
      referenceRows.push_back(reference[i].get());
      tokens.push_back(next[i]);
      choices.push_back(tokenChoice(kChoices[i], step));
    }
    auto logits = model->decodeBatch(referenceRows, tokens);
    ASSERT_TRUE(logits.isOk()) << logits.status().message();
    auto chosen = model->decodeBatchChoose(rows, tokens, choices);
    ASSERT_TRUE(chosen.isOk()) << chosen.status().message();
    ASSERT_EQ(chosen->size(), members);
    for (size_t i = 0; i < members; ++i) {
      const std::span<const float> row = std::span<const float>(*logits).subspan(i * vocab, vocab);
      const int64_t expected = kernels::ref::sampleToken(row, kChoices[i], choices[i].uniform);
      EXPECT_EQ((*chosen)[i], expected) << "row " << i << " of " << members << ", step " << step;
      const int64_t argmax = std::max_element(row.begin(), row.end()) - row.begin();
      if (samplingIsGreedy(kChoices[i]))
        EXPECT_EQ((*chosen)[i], argmax) << "a greedy row chooses the argmax";
      else
        sampledDiffersFromGreedy = sampledDiffersFromGreedy || (*chosen)[i] != argmax;
      EXPECT_EQ(rows[i]->length(), referenceRows[i]->length());
      next[i] = (*chosen)[i];
    }
    ++step;
  }
  EXPECT_TRUE(sampledDiffersFromGreedy) << "no sampled row ever left the argmax";
}

INSTANTIATE_TEST_SUITE_P(Models, DecodeBatchChooseTest,
                         testing::Values("kimi_linear_tiny", "deepseek_v32_tiny"));

TEST(ModelErrors, BadDecodeBatchChoices) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny") + "-batch4");
  ASSERT_TRUE(model);
  std::vector<std::unique_ptr<Sequence>> sequences;
  for (int i = 0; i < 2; ++i) {
    auto sequence = model->newSequence();
    ASSERT_TRUE(sequence.isOk());
    ASSERT_TRUE((*sequence)->prefill(std::vector<int64_t>{1, 2, 3}).isOk());
    sequences.push_back(std::move(*sequence));
  }
  const std::vector<Sequence *> rows = {sequences[0].get(), sequences[1].get()};
  const std::vector<int64_t> tokens = {4, 5};
  auto refused = [&](const std::vector<TokenChoice> &choices, const std::string &expected) {
    auto result = model->decodeBatchChoose(rows, tokens, choices);
    ASSERT_FALSE(result.isOk());
    EXPECT_EQ(result.status().message(), expected);
  };
  refused({TokenChoice{}}, "decodeBatchChoose: 2 sequences and 1 choices: one choice per sequence");
  refused({TokenChoice{}, TokenChoice{sampled(1.0f, 0, 0.0f, 1), 0.5f}},
          "decodeBatchChoose: row 1: top_p must be in (0, 1], got 0.000000");
  refused({TokenChoice{sampled(-1.0f, 0, 1.0f, 1), 0.5f}, TokenChoice{}},
          "decodeBatchChoose: row 0: temperature must be a finite number >= 0, got -1.000000");
  // Nothing ran.
  for (const auto &sequence : sequences)
    EXPECT_EQ(sequence->length(), 3);
}

// Model::decodeSteps: 6 chained steps of 3 rows (greedy and sampled) give the ids of 6
// decodeBatchChoose calls each fed the last one's ids, and leave the same lengths.
TEST_P(DecodeBatchChooseTest, DecodeStepsChainTheChoices) {
  LoadOptions options;
  options.maxSequences = 6;
  auto model = loadOrDie(compiledDir(GetParam()) + "-batch4", options);
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  const std::vector<std::vector<int64_t>> prompts = {
      prompt, {prompt.begin(), prompt.begin() + 9}, {prompt.rbegin(), prompt.rend() - 5}};
  std::vector<std::unique_ptr<Sequence>> chained, stepped;
  for (const auto &tokens : prompts)
    for (auto *group : {&chained, &stepped}) {
      auto sequence = model->newSequence();
      ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
      ASSERT_TRUE((*sequence)->prefill(tokens).isOk());
      group->push_back(std::move(*sequence));
    }
  constexpr int64_t kSteps = 6;
  const std::vector<int64_t> first = {prompts[0].back(), prompts[1].back(), prompts[2].back()};
  std::vector<TokenChoice> choices;
  for (int64_t step = 0; step < kSteps; ++step)
    for (size_t i = 0; i < prompts.size(); ++i)
      choices.push_back(tokenChoice(kChoices[i], step));
  std::vector<Sequence *> rows, stepRows;
  for (size_t i = 0; i < prompts.size(); ++i) {
    rows.push_back(chained[i].get());
    stepRows.push_back(stepped[i].get());
  }
  auto ids = model->decodeSteps(rows, first, choices, kSteps);
  ASSERT_TRUE(ids.isOk()) << ids.status().message();
  ASSERT_EQ(ids->size(), prompts.size() * kSteps);
  std::vector<int64_t> next = first;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto chosen = model->decodeBatchChoose(
        stepRows, next, std::span<const TokenChoice>(choices).subspan(step * 3, 3));
    ASSERT_TRUE(chosen.isOk()) << chosen.status().message();
    for (size_t i = 0; i < prompts.size(); ++i)
      EXPECT_EQ((*ids)[size_t(step) * prompts.size() + i], (*chosen)[i])
          << "step " << step << ", row " << i;
    next = *chosen;
  }
  for (size_t i = 0; i < prompts.size(); ++i)
    EXPECT_EQ(rows[i]->length(), stepRows[i]->length());
}

TEST(ModelErrors, BadDecodeSteps) {
  LoadOptions options;
  options.maxContextTokens = 8;
  auto model = loadOrDie(compiledDir("kimi_linear_tiny") + "-batch4", options);
  ASSERT_TRUE(model);
  auto sequence = model->newSequence();
  ASSERT_TRUE(sequence.isOk());
  ASSERT_TRUE((*sequence)->prefill(std::vector<int64_t>{1, 2, 3}).isOk());
  const std::vector<Sequence *> rows = {sequence->get()};
  const std::vector<int64_t> tokens = {4};
  auto refused = [&](const std::vector<TokenChoice> &choices, int64_t steps,
                     const std::string &expected) {
    auto result = model->decodeSteps(rows, tokens, choices, steps);
    ASSERT_FALSE(result.isOk());
    EXPECT_EQ(result.status().message(), expected);
  };
  refused({}, 0, "decodeSteps: 0 steps: at least one");
  refused({TokenChoice{}}, 2,
          "decodeSteps: 1 choices for 2 steps of 1 sequences: one per sequence and step");
  refused({TokenChoice{}, TokenChoice{sampled(1.0f, 0, 0.0f, 1), 0.5f}}, 2,
          "decodeSteps: step 1, row 0: top_p must be in (0, 1], got 0.000000");
  refused(std::vector<TokenChoice>(6), 6,
          "decodeSteps: sequence 0 has room for 5 more tokens, not 6");
  EXPECT_EQ((*sequence)->length(), 3); // nothing ran
  auto five = model->decodeSteps(rows, tokens, std::vector<TokenChoice>(5), 5);
  ASSERT_TRUE(five.isOk()) << five.status().message();
  EXPECT_EQ((*sequence)->length(), 8);
}

// Each request's tokens, running the scheduler until it is idle; a request's error fails the test.
std::map<uint64_t, std::vector<int64_t>> runToIdle(Scheduler &scheduler) {
  const e2etest::SchedulerRun run = e2etest::runToIdle(scheduler);
  for (const auto &[request, error] : run.errors)
    ADD_FAILURE() << "request " << request << ": " << error;
  return run.tokens;
}

// `request` in a scheduler of its own.
std::vector<int64_t> alone(Model &model, const GenerationRequest &request,
                           SchedulerOptions options = {}) {
  Scheduler scheduler(model, options);
  auto id = scheduler.submit(request);
  EXPECT_TRUE(id.isOk()) << id.status().message();
  return id.isOk() ? runToIdle(scheduler)[*id] : std::vector<int64_t>{};
}

// Mixed greedy and seeded sampled requests, more than the sequences, interleaving 16-token
// prefill chunks with batched decode steps (and, with a small KV cache, preemptions): each
// request gets the tokens it gets alone; greedy ones those of a greedy run.
void expectTokensIndependentOfTheBatch(LoadOptions load, size_t requests, int64_t maxNewTokens,
                                       int64_t prefillChunkTokens, bool expectPreemptions) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny-batch4"), load);
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt("kimi_linear_tiny");
  std::vector<std::vector<int64_t>> prompts = {
      prompt, {prompt.rbegin(), prompt.rend()}, {prompt.begin() + 3, prompt.end()},
      {prompt.begin(), prompt.begin() + 9}, {prompt.begin(), prompt.begin() + 1}};
  prompts.resize(requests);
  Scheduler scheduler(*model, SchedulerOptions{prefillChunkTokens});
  std::map<uint64_t, GenerationRequest> submitted;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest request{prompts[i], maxNewTokens, {}, {}};
    request.sampling = kChoices[i % kChoices.size()];
    auto id = scheduler.submit(request);
    ASSERT_TRUE(id.isOk()) << id.status().message();
    submitted[*id] = request;
  }
  const auto together = runToIdle(scheduler);
  EXPECT_GT(scheduler.stats().decodeBatches, 0);
  EXPECT_EQ(scheduler.stats().preemptions > 0, expectPreemptions);
  bool sampledDiffersFromGreedy = false;
  for (const auto &[id, request] : submitted) {
    ASSERT_EQ(together.count(id), 1u) << "request " << id;
    EXPECT_EQ(together.at(id), alone(*model, request)) << "request " << id;
    GenerationOptions greedy;
    greedy.maxNewTokens = maxNewTokens;
    auto expected = generateGreedy(*model, request.prompt, greedy);
    ASSERT_TRUE(expected.isOk()) << expected.status().message();
    if (samplingIsGreedy(request.sampling))
      EXPECT_EQ(together.at(id), expected->generated) << "request " << id;
    else
      sampledDiffersFromGreedy = sampledDiffersFromGreedy || together.at(id) != expected->generated;
  }
  EXPECT_TRUE(sampledDiffersFromGreedy) << "every sampled request gave the greedy tokens";
}

TEST(Scheduler, SeededSamplingGivesTheSameTokensWhateverTheBatch) {
  LoadOptions load;
  load.maxSequences = 3;
  expectTokensIndependentOfTheBatch(load, 5, 6, 16, false);
}

// A KV cache of two 64-token pages: preempted requests recompute their context and resume at
// their own token count, so a sampled request still draws the same numbers.
TEST(Scheduler, SeededSamplingSurvivesPreemption) {
  LoadOptions load;
  load.maxSequences = 3;
  load.kvCacheTokens = 128;
  expectTokensIndependentOfTheBatch(load, 3, 30, 256, true);
}

// With speculation on, a sampled request decodes without drafts (drafts are verified by argmax)
// and gets its tokens from a scheduler without speculation; a greedy one still speculates.
TEST(Scheduler, SampledRequestsRunWithoutDrafts) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"));
  ASSERT_TRUE(model);
  // Every id of the vocabulary once: any token the model chooses occurred before, so prompt
  // lookup always has a draft for a request that speculates.
  std::vector<int64_t> repetitive(static_cast<size_t>(model->vocabSize()));
  std::iota(repetitive.begin(), repetitive.end(), 0);
  SchedulerOptions speculative;
  speculative.draftTokens = 4;
  GenerationRequest request{repetitive, 10, {}, {}};
  request.sampling = kChoices[1];
  Scheduler scheduler(*model, speculative);
  auto id = scheduler.submit(request);
  ASSERT_TRUE(id.isOk()) << id.status().message();
  EXPECT_EQ(runToIdle(scheduler)[*id], alone(*model, request));
  EXPECT_EQ(scheduler.stats().verifySteps, 0);
  EXPECT_EQ(scheduler.stats().draftedTokens, 0);
  GenerationRequest greedy{repetitive, 10, {}, {}};
  auto greedyId = scheduler.submit(greedy);
  ASSERT_TRUE(greedyId.isOk());
  runToIdle(scheduler);
  EXPECT_GT(scheduler.stats().draftedTokens, 0);
}

TEST(Scheduler, RefusesBadSamplingParameters) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"));
  ASSERT_TRUE(model);
  Scheduler scheduler(*model);
  auto refused = [&](const SamplingParams &params) {
    GenerationRequest request{{1, 2, 3}, 4, {}, {}};
    request.sampling = params;
    auto id = scheduler.submit(request);
    return id.isOk() ? std::string("ok") : id.status().message();
  };
  EXPECT_EQ(refused(sampled(1.0f, -3, 1.0f, 0)), "request: top_k must be >= 0, got -3");
  EXPECT_EQ(refused(sampled(1.0f, 0, 1.5f, 0)), "request: top_p must be in (0, 1], got 1.500000");
  EXPECT_EQ(refused(sampled(-0.5f, 0, 1.0f, 0)),
            "request: temperature must be a finite number >= 0, got -0.500000");
  EXPECT_TRUE(scheduler.idle());
}

// generate(): greedy parameters are generateGreedy; sampled ones give the same tokens with the
// caches (decodeBatchChoose) and without them (full forwards), and the scheduler's.
TEST(Generate, SampledWithAndWithoutCachesAgree) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"));
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt("kimi_linear_tiny");
  GenerationOptions options;
  options.maxNewTokens = 8;
  auto greedy = generate(*model, prompt, options);
  auto reference = generateGreedy(*model, prompt, options);
  ASSERT_TRUE(greedy.isOk() && reference.isOk());
  EXPECT_EQ(greedy->generated, reference->generated);
  EXPECT_EQ(greedy->generatedLogits, reference->generatedLogits);
  options.sampling = kChoices[1];
  auto cached = generate(*model, prompt, options);
  ASSERT_TRUE(cached.isOk()) << cached.status().message();
  EXPECT_EQ(cached->generated.size(), 8u);
  EXPECT_TRUE(cached->generatedLogits.empty());
  options.useCaches = false;
  auto fullForwards = generate(*model, prompt, options);
  ASSERT_TRUE(fullForwards.isOk()) << fullForwards.status().message();
  EXPECT_EQ(fullForwards->generated, cached->generated);
  GenerationRequest request{prompt, 8, {}, {}};
  request.sampling = kChoices[1];
  EXPECT_EQ(alone(*model, request), cached->generated);
  options.sampling.topP = 2.0f;
  auto refused = generate(*model, prompt, options);
  ASSERT_FALSE(refused.isOk());
  EXPECT_EQ(refused.status().message(), "sampling: top_p must be in (0, 1], got 2.000000");
}

} // namespace
} // namespace hybrid
