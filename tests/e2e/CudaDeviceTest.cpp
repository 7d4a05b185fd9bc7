// The cuda device against itself: decode graphs against plain launches (several sequences
// decoding in turn, a slot reused by a new sequence; fp32 and bf16 KDA states), prefill and
// verification graphs against plain launches (rollbacks included) and under speculation,
// batched decode against single sequences, prefix-cache hits (states copied off and back onto
// the GPU, KV pages shared and copied in the device pools) against full prefills; FP8
// projections and the MTP program (greedy outputs with MTP drafts, its logits) against the cpu
// oracle. Labelled `gpu`; skipped where there is no GPU.
#include "../support/DifferingBits.h"
#include "hybrid/runtime/Draft.h"
#include "hybrid/runtime/Generate.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Sampling.h"
#include "hybrid/runtime/Scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <gtest/gtest.h>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace hybrid {
namespace {

// The build's paths, unless the environment moves them (a copy of the tree on a GPU machine).
std::string directory(const char *variable, const char *built) {
  const char *moved = std::getenv(variable);
  return moved ? moved : built;
}

std::vector<int64_t> goldenPrompt(const std::string &model) {
  auto ids = readInputIds(directory("HYBRID_TEST_DATA_DIR", HYBRID_TEST_DATA_DIR) + "/" + model +
                          "/golden.safetensors");
  EXPECT_TRUE(ids.isOk()) << ids.status().message();
  return ids.isOk() ? *ids : std::vector<int64_t>{};
}

// The cuda plans ctest compiles (tests/e2e/CMakeLists.txt): MODEL-cuda, MODEL-cuda-batch4.
std::string cudaPlan(const std::string &model, const std::string &suffix = "") {
  return directory("HYBRID_E2E_DIR", HYBRID_E2E_DIR) + "/" + model + "-cuda" + suffix;
}

// A load that failed for want of a GPU: the test skips.
bool noGpu(const StatusOr<std::unique_ptr<Model>> &model) {
  return !model.isOk() && model.status().message().find("no CUDA device") != std::string::npos;
}

// Two models loaded in turn, the first on the GPU: false without a GPU (the test skips, the
// second not loaded); a load that fails otherwise is a test failure and leaves its model null.
bool loadTwo(const std::string &firstDir, const LoadOptions &firstOptions,
             const std::string &secondDir, const LoadOptions &secondOptions,
             std::unique_ptr<Model> &first, std::unique_ptr<Model> &second) {
  auto a = Model::load(firstDir, firstOptions);
  if (noGpu(a))
    return false;
  EXPECT_TRUE(a.isOk()) << a.status().message();
  auto b = Model::load(secondDir, secondOptions);
  EXPECT_TRUE(b.isOk()) << b.status().message();
  if (a.isOk())
    first = std::move(*a);
  if (b.isOk())
    second = std::move(*b);
  return true;
}

// One plan loaded twice with a graph switch of LoadOptions on (graphed) and off (plain), for
// tests that hold graph replays to plain launches (loadTwo's results).
struct GraphedAndPlain {
  std::unique_ptr<Model> graphed, plain;
};
bool loadGraphedAndPlain(const std::string &dir, LoadOptions options, bool LoadOptions::*graphs,
                         GraphedAndPlain &models) {
  LoadOptions plain = options;
  options.*graphs = true;
  plain.*graphs = false;
  return loadTwo(dir, options, dir, plain, models.graphed, models.plain);
}

// A checkpoint's cuda plan and its cpu plan, both loaded with `options`, the device set per plan
// (loadTwo's results).
struct GpuAndCpu {
  std::unique_ptr<Model> gpu, cpu;
};
bool loadGpuAndCpu(const std::string &gpuPlan, const std::string &cpuPlan, LoadOptions options,
                   GpuAndCpu &models) {
  LoadOptions cpu = options;
  options.device = "cuda";
  cpu.device = "cpu";
  return loadTwo(gpuPlan, options, cpuPlan, cpu, models.gpu, models.cpu);
}

int64_t argmax(const std::vector<float> &logits, int64_t vocab) {
  const auto last = logits.end() - vocab;
  return std::max_element(last, logits.end()) - last;
}

// Everything one model instance produced, in order: prefill and decode logits of every sequence.
struct Transcript {
  std::vector<std::vector<float>> logits;
};

// Three sequences prefilled, then decoding greedily in turn; then the second is dropped and a new
// sequence (taking its slot) prefills and decodes while the others go on.
Transcript runInterleaved(Model &model, const std::vector<int64_t> &prompt) {
  Transcript transcript;
  const int64_t vocab = model.vocabSize();
  std::vector<std::vector<int64_t>> prompts = {
      prompt, {prompt.rbegin(), prompt.rend()}, {prompt.begin(), prompt.begin() + 9}};
  std::vector<std::unique_ptr<Sequence>> sequences;
  std::vector<int64_t> next;
  auto start = [&](const std::vector<int64_t> &tokens) {
    auto sequence = model.newSequence();
    EXPECT_TRUE(sequence.isOk()) << sequence.status().message();
    if (!sequence.isOk())
      return false;
    auto logits = (*sequence)->prefill(tokens);
    EXPECT_TRUE(logits.isOk()) << logits.status().message();
    if (!logits.isOk())
      return false;
    next.push_back(argmax(*logits, vocab));
    transcript.logits.push_back(std::move(*logits));
    sequences.push_back(std::move(*sequence));
    return true;
  };
  auto decodeRound = [&]() {
    for (size_t i = 0; i < sequences.size(); ++i) {
      if (!sequences[i])
        continue;
      auto logits = sequences[i]->decode(next[i]);
      EXPECT_TRUE(logits.isOk()) << logits.status().message();
      if (!logits.isOk())
        return false;
      next[i] = argmax(*logits, vocab);
      transcript.logits.push_back(std::move(*logits));
    }
    return true;
  };
  for (const auto &tokens : prompts)
    if (!start(tokens))
      return transcript;
  for (int round = 0; round < 4; ++round)
    if (!decodeRound())
      return transcript;
  sequences[1].reset(); // its slot goes to the next sequence, with a fresh state
  if (!start({prompt.begin() + 3, prompt.begin() + 20}))
    return transcript;
  for (int round = 0; round < 4; ++round)
    if (!decodeRound())
      return transcript;
  return transcript;
}

// The token-choice tests' model: the 4-row cuda plan on the GPU, 8 sequences.
StatusOr<std::unique_ptr<Model>> loadForChoosing(const std::string &model) {
  LoadOptions options;
  options.device = "cuda";
  options.maxSequences = 8;
  return Model::load(cudaPlan(model, "-batch4"), options);
}

// Decode rows for the token-choice tests: greedy ones among sampled ones (temperature, top-k,
// top-p; each seeded).
std::vector<SamplingParams> mixedSampling() {
  std::vector<SamplingParams> params(4);
  params[1].temperature = 0.8f;
  params[1].seed = 3;
  params[2].temperature = 1.5f;
  params[2].topK = 20;
  params[2].seed = 4;
  params[3].temperature = 1.0f;
  params[3].topP = 0.9f;
  params[3].seed = 5;
  return params;
}

// Two sets of `count` sequences, the i-th of each prefilled with the prompt's first
// `prefixOf(i)` tokens, for decoding one set one way and the other another.
template <typename PrefixOf>
void prefillTwins(Model &model, const std::vector<int64_t> &prompt, size_t count,
                  PrefixOf prefixOf, std::vector<std::unique_ptr<Sequence>> &first,
                  std::vector<std::unique_ptr<Sequence>> &second) {
  for (size_t i = 0; i < count; ++i)
    for (auto *group : {&first, &second}) {
      auto sequence = model.newSequence();
      ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
      ASSERT_TRUE((*sequence)->prefill(std::span(prompt).first(prefixOf(i))).isOk());
      group->push_back(std::move(*sequence));
    }
}

class CudaDeviceTest : public testing::TestWithParam<std::string> {};

// With fp32 and with bf16 KDA states (LoadOptions::kdaBf16State).
TEST_P(CudaDeviceTest, DecodeGraphsMatchPlainLaunches) {
  const std::string dir = cudaPlan(GetParam());
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  ASSERT_GE(prompt.size(), 20u);
  for (bool bf16States : {false, true}) {
    SCOPED_TRACE(bf16States ? "bf16 KDA states" : "fp32 KDA states");
    LoadOptions options;
    options.device = "cuda";
    options.maxSequences = 3;
    options.kdaBf16State = bf16States;
    GraphedAndPlain models;
    if (!loadGraphedAndPlain(dir, options, &LoadOptions::cudaGraphs, models))
      GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(models.graphed && models.plain);
    Model &graphed = *models.graphed, &plain = *models.plain;

    const Transcript withGraphs = runInterleaved(graphed, prompt);
    const Transcript withLaunches = runInterleaved(plain, prompt);
    ASSERT_EQ(withGraphs.logits.size(), 3u + 4 * 3 + 1 + 4 * 3);
    ASSERT_EQ(withGraphs.logits.size(), withLaunches.logits.size());
    // The same kernels on the same data: exactly the same numbers.
    for (size_t i = 0; i < withGraphs.logits.size(); ++i)
      EXPECT_EQ(withGraphs.logits[i], withLaunches.logits[i]) << "call " << i;
  }
}

// Batched decode on the cuda device (a decode program for 4 sequences): each row matches the
// same sequence decoding alone. Not bit for bit: cuBLASLt may pick another algorithm for 3 rows
// than for 1 (another summation order); the KDA rows and the cpu-reference steps are the same
// arithmetic. Graphs (one per batch size) and plain launches agree exactly.
TEST_P(CudaDeviceTest, BatchedDecodeMatchesSingleSequences) {
  const std::string dir = cudaPlan(GetParam(), "-batch4");
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  std::vector<std::vector<float>> byGraphs;
  for (bool graphs : {true, false}) {
    SCOPED_TRACE(graphs ? "graphs" : "plain launches");
    LoadOptions options;
    options.device = "cuda";
    options.maxSequences = 6;
    options.cudaGraphs = graphs;
    auto model = Model::load(dir, options);
    if (noGpu(model))
      GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(model.isOk()) << model.status().message();
    const int64_t vocab = (*model)->vocabSize();
    const std::vector<std::vector<int64_t>> prompts = {
        prompt, {prompt.begin(), prompt.begin() + 7}, {prompt.rbegin(), prompt.rend() - 11}};
    std::vector<std::unique_ptr<Sequence>> batched, alone;
    std::vector<int64_t> next;
    for (const auto &tokens : prompts)
      for (auto *group : {&batched, &alone}) {
        auto sequence = (*model)->newSequence();
        ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
        auto logits = (*sequence)->prefill(tokens);
        ASSERT_TRUE(logits.isOk()) << logits.status().message();
        if (group == &batched)
          next.push_back(argmax(*logits, vocab));
        group->push_back(std::move(*sequence));
      }
    std::vector<std::vector<float>> transcript;
    for (size_t members : {3u, 2u, 3u, 1u}) {
      std::vector<Sequence *> group;
      std::vector<int64_t> tokens;
      for (size_t i = 0; i < members; ++i) {
        group.push_back(batched[i].get());
        tokens.push_back(next[i]);
      }
      auto logits = (*model)->decodeBatch(group, tokens);
      ASSERT_TRUE(logits.isOk()) << logits.status().message();
      transcript.push_back(*logits);
      for (size_t i = 0; i < members; ++i) {
        auto single = alone[i]->decode(next[i]);
        ASSERT_TRUE(single.isOk()) << single.status().message();
        float worst = 0.0f;
        for (int64_t v = 0; v < vocab; ++v)
          worst = std::max(worst, std::abs((*logits)[i * vocab + v] - (*single)[v]));
        EXPECT_LT(worst, 1e-3f) << "sequence " << i << " in a batch of " << members;
        next[i] = argmax(std::vector<float>(logits->begin() + i * vocab,
                                            logits->begin() + (i + 1) * vocab),
                         vocab);
      }
    }
    if (graphs) {
      byGraphs = transcript;
    } else {
      ASSERT_EQ(byGraphs.size(), transcript.size());
      for (size_t i = 0; i < transcript.size(); ++i)
        EXPECT_EQ(byGraphs[i], transcript[i]) << "step " << i;
    }
  }
}

// Decode steps that choose on the GPU (Model::decodeBatchChoose: only ids come back) choose what
// the host choice (the reference sampler) takes from the same step's downloaded logits: two
// identical sets of sequences, one stepped by decodeBatch + chooseToken, the other by
// decodeBatchChoose, greedy and sampled rows mixed, 8 steps feeding back the chosen ids.
TEST_P(CudaDeviceTest, ChoosingOnTheGpuEqualsTheHostChoice) {
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  auto model = loadForChoosing(GetParam());
  if (noGpu(model))
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(model.isOk()) << model.status().message();
  const auto vocab = static_cast<size_t>((*model)->vocabSize());
  const std::vector<SamplingParams> params = mixedSampling();
  std::vector<std::unique_ptr<Sequence>> host, device;
  prefillTwins(**model, prompt, params.size(), [](size_t i) { return 10 + i; }, host, device);
  if (HasFatalFailure())
    return;
  std::vector<int64_t> hostTokens(params.size(), prompt[0]), deviceTokens = hostTokens;
  for (int step = 0; step < 8; ++step) {
    std::vector<TokenChoice> choices;
    for (const SamplingParams &p : params)
      choices.push_back(tokenChoice(p, step));
    std::vector<Sequence *> hostRows, deviceRows;
    for (size_t i = 0; i < params.size(); ++i) {
      hostRows.push_back(host[i].get());
      deviceRows.push_back(device[i].get());
    }
    auto logits = (*model)->decodeBatch(hostRows, hostTokens);
    ASSERT_TRUE(logits.isOk()) << logits.status().message();
    auto chosen = (*model)->decodeBatchChoose(deviceRows, deviceTokens, choices);
    ASSERT_TRUE(chosen.isOk()) << chosen.status().message();
    for (size_t i = 0; i < params.size(); ++i) {
      hostTokens[i] = chooseToken(std::span<const float>(*logits).subspan(i * vocab, vocab), choices[i]);
      EXPECT_EQ((*chosen)[i], hostTokens[i]) << "step " << step << " row " << i;
    }
    deviceTokens = *chosen;
  }
}

// Chained decode steps (Model::decodeSteps: each step queued before the host has seen the one
// before's ids, which stay on the GPU) give the ids of decodeBatchChoose steps fed back one at a
// time: 4 rows, greedy and sampled, two chains of 12 steps in a row (the second reusing the
// first's buffers and graphs: a chained step's decode graph and a stepped one's live side by
// side, neither captured again).
TEST_P(CudaDeviceTest, ChainedStepsChooseWhatSteppedOnesChoose) {
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  auto model = loadForChoosing(GetParam());
  if (noGpu(model))
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(model.isOk()) << model.status().message();
  const std::vector<SamplingParams> params = mixedSampling();
  std::vector<std::unique_ptr<Sequence>> chained, stepped;
  prefillTwins(**model, prompt, params.size(), [](size_t i) { return 10 + 3 * i; }, chained,
               stepped);
  if (HasFatalFailure())
    return;
  std::vector<Sequence *> chainRows, stepRows;
  for (size_t i = 0; i < params.size(); ++i) {
    chainRows.push_back(chained[i].get());
    stepRows.push_back(stepped[i].get());
  }
  constexpr int64_t kSteps = 12;
  std::vector<int64_t> chainNext(params.size(), prompt[0]), stepNext = chainNext;
  int64_t capturedAfterFirstChain = 0;
  for (int chain = 0; chain < 2; ++chain) {
    std::vector<TokenChoice> choices;
    for (int64_t step = 0; step < kSteps; ++step)
      for (const SamplingParams &p : params)
        choices.push_back(tokenChoice(p, chain * kSteps + step));
    auto ids = (*model)->decodeSteps(chainRows, chainNext, choices, kSteps);
    ASSERT_TRUE(ids.isOk()) << ids.status().message();
    for (int64_t step = 0; step < kSteps; ++step) {
      auto chosen = (*model)->decodeBatchChoose(stepRows, stepNext,
                                                std::span<const TokenChoice>(choices).subspan(
                                                    size_t(step) * params.size(), params.size()));
      ASSERT_TRUE(chosen.isOk()) << chosen.status().message();
      for (size_t i = 0; i < params.size(); ++i)
        EXPECT_EQ((*ids)[size_t(step) * params.size() + i], (*chosen)[i])
            << "chain " << chain << ", step " << step << ", row " << i;
      stepNext = *chosen;
    }
    chainNext.assign(ids->end() - int64_t(params.size()), ids->end());
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_EQ(chainRows[i]->length(), stepRows[i]->length());
    if (chain == 0)
      capturedAfterFirstChain = (*model)->cudaGraphCounts().decodeCaptures;
  }
  EXPECT_GT(capturedAfterFirstChain, 0);
  EXPECT_EQ((*model)->cudaGraphCounts().decodeCaptures, capturedAfterFirstChain);
}

// Prefix caching on the cuda device: a kept prefix's KDA states come off the GPU when kept and
// go back when restored; a hit then continues exactly like a full prefill (recurrent fp32 KDA
// prefill, so only the cached part differs), with fp32 and with bf16 states.
TEST_P(CudaDeviceTest, PrefixCacheHitsMatchAFullPrefill) {
  const std::string dir = cudaPlan(GetParam());
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  ASSERT_EQ(prompt.size(), 40u);
  for (bool bf16States : {false, true}) {
    SCOPED_TRACE(bf16States ? "bf16 KDA states" : "fp32 KDA states");
    LoadOptions options;
    options.device = "cuda";
    options.kdaPrefill = "recurrent";
    options.kdaBf16State = bf16States;
    options.prefixCacheEntries = 2;
    options.prefixCacheBlockTokens = 16;
    auto model = Model::load(dir, options);
    if (noGpu(model))
      GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(model.isOk()) << model.status().message();
    const int64_t vocab = (*model)->vocabSize();
    // The first keeps the prompt's first 32 tokens (its prefill split there); the second
    // restores them and runs the last 8, the same rows the first ran after its split.
    auto first = (*model)->newSequence(), second = (*model)->newSequence();
    ASSERT_TRUE(first.isOk() && second.isOk());
    auto full = (*first)->prefillWithPrefixCache(prompt);
    ASSERT_TRUE(full.isOk()) << full.status().message();
    EXPECT_EQ(full->cachedTokens, 0);
    auto hit = (*second)->prefillWithPrefixCache(prompt);
    ASSERT_TRUE(hit.isOk()) << hit.status().message();
    ASSERT_EQ(hit->cachedTokens, 32);
    const std::vector<float> tail(full->logits.end() - 8 * vocab, full->logits.end());
    EXPECT_EQ(hit->logits, tail);
    int64_t next = argmax(hit->logits, vocab);
    for (int step = 0; step < 3; ++step) {
      auto a = (*first)->decode(next), b = (*second)->decode(next);
      ASSERT_TRUE(a.isOk() && b.isOk());
      EXPECT_EQ(*a, *b) << "decode step " << step;
      next = argmax(*a, vocab);
    }
    auto stateA = (*first)->recurrentState(), stateB = (*second)->recurrentState();
    ASSERT_TRUE(stateA.isOk() && stateB.isOk()) << stateA.status().message();
    EXPECT_EQ(*stateA, *stateB);
  }
}

// Speculative decoding on the cuda device (snapshot off the GPU, a rejection restores it and
// reruns the kept tokens): greedy tokens do not change, and the state after a rejected draft is
// plain decoding's up to the prefill and decode kernels' different fp32 summation orders.
TEST_P(CudaDeviceTest, SpeculativeDecodingKeepsTheGreedyTokens) {
  const std::string dir = cudaPlan(GetParam());
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  LoadOptions options;
  options.device = "cuda";
  options.kdaPrefill = "recurrent";
  auto model = Model::load(dir, options);
  if (noGpu(model))
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(model.isOk()) << model.status().message();
  std::vector<int64_t> repetitive;
  for (int i = 0; i < 5; ++i)
    repetitive.insert(repetitive.end(), prompt.begin(), prompt.begin() + 7);
  for (const auto &tokens : {prompt, repetitive}) {
    GenerationOptions plain;
    plain.maxNewTokens = 10;
    GenerationOptions speculative = plain;
    speculative.draftTokens = 4;
    auto reference = generateGreedy(**model, tokens, plain);
    auto drafted = generateGreedy(**model, tokens, speculative);
    ASSERT_TRUE(reference.isOk() && drafted.isOk()) << drafted.status().message();
    EXPECT_EQ(drafted->generated, reference->generated);
    EXPECT_GT(drafted->verifySteps, 0);
  }
  // A draft that is surely rejected (every token the one greedy decoding did not pick).
  auto a = (*model)->newSequence(), b = (*model)->newSequence();
  ASSERT_TRUE(a.isOk() && b.isOk());
  auto logits = (*a)->prefill(prompt);
  ASSERT_TRUE(logits.isOk() && (*b)->prefill(prompt).isOk());
  const int64_t vocab = (*model)->vocabSize();
  const int64_t next = argmax(*logits, vocab);
  const std::vector<int64_t> draft = {(next + 1) % vocab, (next + 2) % vocab, (next + 3) % vocab};
  auto verified = (*a)->verifyDraft(next, draft);
  ASSERT_TRUE(verified.isOk()) << verified.status().message();
  auto decoded = (*b)->decode(next);
  ASSERT_TRUE(decoded.isOk());
  EXPECT_EQ((*a)->length(), (*b)->length());
  EXPECT_EQ(verified->tokens.back(), argmax(*decoded, vocab));
  auto stateA = (*a)->recurrentState(), stateB = (*b)->recurrentState();
  ASSERT_TRUE(stateA.isOk() && stateB.isOk());
  double difference = 0, magnitude = 0;
  for (size_t i = 0; i < stateA->size(); ++i) {
    difference = std::max(difference, double(std::abs((*stateA)[i] - (*stateB)[i])));
    magnitude = std::max(magnitude, double(std::abs((*stateB)[i])));
  }
  EXPECT_LE(difference, 1e-5 * magnitude);
}

double worstDifference(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
  return worst;
}

// The state of `a` against `b`, relative to b's largest magnitude (at least 1).
double relativeStateDifference(Sequence &a, Sequence &b) {
  auto state = a.recurrentState(), expected = b.recurrentState();
  EXPECT_TRUE(state.isOk() && expected.isOk());
  if (!state.isOk() || !expected.isOk())
    return 1e30;
  double magnitude = 1;
  for (float value : *expected)
    magnitude = std::max(magnitude, double(std::abs(value)));
  return worstDifference(*state, *expected) / magnitude;
}

// Several sequences in one prefill call (Model::prefillBatch: per-segment KDA launches, every
// row's own position and block-table row for MLA / DSA) against each alone on the cuda device
// (GEMMs over more rows sum in another order: 1e-3, the batched decode's bound) and against the
// cpu oracle (2e-3, the goldens' tolerance), then the decode steps that read their caches; and
// several verifications in one pass (Model::verifyDrafts: per-segment rollback and KDA replay)
// against each sequence's own verifyDraft.
// `plan`: a plan name in HYBRID_E2E_DIR compiled for the cpu, with PLAN-cuda beside it. With
// `decodeAgainstCpu` off the decode steps' logits are held to the same sequence decoding alone
// on the cuda device, and to the cpu oracle only by their greedy ids.
void checkBatchedPrefillAndVerification(const std::string &plan, bool decodeAgainstCpu) {
  LoadOptions options;
  options.device = "cuda";
  options.kdaPrefill = "recurrent";
  options.maxSequences = 8;
  auto model = Model::load(cudaPlan(plan), options);
  if (noGpu(model))
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(model.isOk()) << model.status().message();
  LoadOptions cpuOptions;
  cpuOptions.maxSequences = 4;
  auto oracle = Model::load(directory("HYBRID_E2E_DIR", HYBRID_E2E_DIR) + "/" + plan, cpuOptions);
  ASSERT_TRUE(oracle.isOk()) << oracle.status().message();
  const int64_t vocab = (*model)->vocabSize();
  std::mt19937_64 random(29);
  std::vector<std::vector<int64_t>> chunks;
  std::vector<std::unique_ptr<Sequence>> batched, alone, cpu;
  for (int i = 0; i < 4; ++i) {
    // Up to 150 tokens: prompts over several 64-token pages, so that block-table rows matter.
    std::vector<int64_t> chunk(std::uniform_int_distribution<size_t>(1, 150)(random));
    for (int64_t &token : chunk)
      token = std::uniform_int_distribution<int64_t>(0, vocab - 1)(random);
    for (auto *group : {&batched, &alone, &cpu}) {
      auto sequence = group == &cpu ? (*oracle)->newSequence() : (*model)->newSequence();
      ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
      group->push_back(std::move(*sequence));
    }
    chunks.push_back(std::move(chunk));
  }
  std::vector<PrefillSegment> segments;
  for (size_t i = 0; i < chunks.size(); ++i)
    segments.push_back({.sequence = batched[i].get(), .tokens = chunks[i]});
  auto logits = (*model)->prefillBatch(segments);
  ASSERT_TRUE(logits.isOk()) << logits.status().message();
  size_t row = 0;
  std::vector<int64_t> next;
  for (size_t i = 0; i < chunks.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "sequence " << i << ", " << chunks[i].size() << " tokens");
    auto single = alone[i]->prefill(chunks[i]);
    auto reference = cpu[i]->prefill(chunks[i]);
    ASSERT_TRUE(single.isOk() && reference.isOk());
    const std::span<const float> rows(logits->data() + row * vocab, chunks[i].size() * vocab);
    row += chunks[i].size();
    EXPECT_LT(worstDifference(rows, *single), 1e-3);
    EXPECT_LT(worstDifference(rows, *reference), 2e-3);
    EXPECT_LE(relativeStateDifference(*batched[i], *alone[i]), 1e-5);
    next.push_back(argmax(*reference, vocab));
    EXPECT_EQ(argmax(std::vector<float>(rows.end() - vocab, rows.end()), vocab), next.back());
    for (int step = 0; step < 3; ++step) { // the same tokens on all three
      auto a = batched[i]->decode(next.back()), b = cpu[i]->decode(next.back());
      auto c = alone[i]->decode(next.back());
      ASSERT_TRUE(a.isOk() && b.isOk() && c.isOk());
      if (decodeAgainstCpu) {
        EXPECT_LT(worstDifference(*a, *b), 2e-3) << "decode step " << step;
      }
      EXPECT_LT(worstDifference(*a, *c), 1e-3) << "decode step " << step;
      EXPECT_EQ(argmax(*a, vocab), argmax(*b, vocab)) << "decode step " << step;
      next.back() = argmax(*b, vocab);
    }
  }
  // Made-up drafts: each sequence keeps what greedy decoding agrees with and rolls back the rest.
  std::vector<std::vector<int64_t>> drafts;
  std::vector<DraftCheck> checks;
  for (size_t i = 0; i < batched.size(); ++i)
    drafts.push_back({(next[i] + 1) % vocab, next[i], (next[i] + 7) % vocab});
  for (size_t i = 0; i < batched.size(); ++i)
    checks.push_back({.sequence = batched[i].get(), .token = next[i], .draft = drafts[i]});
  auto verified = (*model)->verifyDrafts(checks);
  ASSERT_TRUE(verified.isOk()) << verified.status().message();
  for (size_t i = 0; i < batched.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "verification " << i);
    auto single = alone[i]->verifyDraft(next[i], drafts[i]);
    auto reference = cpu[i]->verifyDraft(next[i], drafts[i]);
    ASSERT_TRUE(single.isOk() && reference.isOk()) << single.status().message();
    EXPECT_EQ((*verified)[i].tokens, single->tokens);
    EXPECT_EQ((*verified)[i].tokens, reference->tokens);
    EXPECT_LT(worstDifference((*verified)[i].logits, single->logits), 1e-3);
    EXPECT_LT(worstDifference((*verified)[i].logits, reference->logits), 2e-3);
    EXPECT_EQ(batched[i]->length(), cpu[i]->length());
    EXPECT_EQ(batched[i]->length(), alone[i]->length());
    // Two batched passes (prefill, verification) and a replay: cuBLASLt picks its GEMM kernels by
    // row count, so each pass sums the projections in another order than the one-sequence calls
    // (measured 1.05e-5 on kimi_linear_tiny, H200); the cpu comparisons above bound the error.
    EXPECT_LE(relativeStateDifference(*batched[i], *alone[i]), 5e-5);
    const int64_t token = reference->tokens.back();
    auto a = batched[i]->decode(token), b = cpu[i]->decode(token);
    ASSERT_TRUE(a.isOk() && b.isOk());
    EXPECT_LT(worstDifference(*a, *b), 2e-3);
  }
}

// Whether every step of `program` runs on the GPU (the placement report's line for it).
bool runsEntirelyOnTheGpu(const Model &model, const std::string &program) {
  const std::string report = model.placementReport();
  const size_t line = report.find("cuda " + program + ": GPU: ");
  if (line == std::string::npos)
    return false;
  const std::string text = report.substr(line, report.find('\n', line) - line);
  return text.find("; cpu reference: none") != std::string::npos;
}

// Everything a prefill-graph script produced, in order.
struct PrefillTranscript {
  std::vector<std::vector<float>> logits; // prefill chunks, verification passes, decode steps
  std::vector<std::vector<int64_t>> verified; // each pass's kept draft tokens and next token
  std::vector<int64_t> lengths;
  std::vector<std::vector<float>> states; // each live sequence's recurrent state at the end
};

// Single-sequence prefill calls of 1 to 16 rows, repeated so that each (rows, slot, logged) key
// runs eagerly, is captured and then replayed: prompts in chunks (5 rows; 16, 16, 8; then the
// same chunks for a new sequence in a freed slot), and verification passes of 2, 4, 9 and 16
// rows whose drafts follow the greedy continuation for a varying number of tokens and then go
// wrong, so that the rollbacks after replayed passes keep 1 to 16 rows (the KDA replay log's
// rows as the replayed pass left them); decode steps between them.
PrefillTranscript runPrefillGraphScript(Model &model, const std::vector<int64_t> &prompt) {
  PrefillTranscript transcript;
  const int64_t vocab = model.vocabSize();
  const std::vector<int64_t> reversed(prompt.rbegin(), prompt.rend());
  // Draft hints: each prompt's greedy continuation (where a sequence leaves it, its drafts are
  // simply rejected).
  GenerationOptions plain;
  plain.maxNewTokens = 64;
  std::vector<std::vector<int64_t>> hints;
  for (const auto *tokens : {&prompt, &reversed}) {
    auto greedy = generateGreedy(model, *tokens, plain);
    EXPECT_TRUE(greedy.isOk()) << greedy.status().message();
    if (!greedy.isOk())
      return transcript;
    hints.push_back(greedy->generated);
  }
  struct Live {
    std::unique_ptr<Sequence> sequence;
    const std::vector<int64_t> *hint = nullptr;
    size_t generated = 0; // tokens fed after the prompt: the hint's next index
    int64_t next = 0;
  };
  auto start = [&](const std::vector<int64_t> &tokens, const std::vector<int64_t> &hint,
                   int64_t chunk) -> std::optional<Live> {
    auto sequence = model.newSequence();
    EXPECT_TRUE(sequence.isOk()) << sequence.status().message();
    if (!sequence.isOk())
      return std::nullopt;
    Live live{std::move(*sequence), &hint};
    for (size_t first = 0; first < tokens.size(); first += static_cast<size_t>(chunk)) {
      const size_t rows = std::min(tokens.size() - first, static_cast<size_t>(chunk));
      auto logits = live.sequence->prefill(std::span(tokens).subspan(first, rows));
      EXPECT_TRUE(logits.isOk()) << logits.status().message();
      if (!logits.isOk())
        return std::nullopt;
      live.next = argmax(*logits, vocab);
      transcript.logits.push_back(std::move(*logits));
    }
    return live;
  };
  // A pass of `draftTokens` drafts of which the first `following` are the hint's.
  auto verify = [&](Live &live, int64_t draftTokens, int64_t following) {
    std::vector<int64_t> draft;
    for (int64_t i = 0; i < draftTokens; ++i) {
      const size_t at = live.generated + 1 + static_cast<size_t>(i);
      const bool follows = i < following && at < live.hint->size();
      draft.push_back(follows ? (*live.hint)[at] : (live.next + 7 + i) % vocab);
    }
    auto result = live.sequence->verifyDraft(live.next, draft);
    EXPECT_TRUE(result.isOk()) << result.status().message();
    if (!result.isOk())
      return false;
    live.generated += static_cast<size_t>(1 + result->accepted);
    live.next = result->tokens.back();
    transcript.verified.push_back(result->tokens);
    transcript.logits.push_back(std::move(result->logits));
    transcript.lengths.push_back(live.sequence->length());
    return true;
  };
  auto decode = [&](Live &live) {
    auto logits = live.sequence->decode(live.next);
    EXPECT_TRUE(logits.isOk()) << logits.status().message();
    if (!logits.isOk())
      return false;
    live.generated += 1;
    live.next = argmax(*logits, vocab);
    transcript.logits.push_back(std::move(*logits));
    return true;
  };
  auto passes = [&](Live &live, int round) {
    for (int64_t draftTokens : {1, 3, 8, 15})
      if (!verify(live, draftTokens, (round * 5 + draftTokens) % (draftTokens + 1)))
        return false;
    return decode(live);
  };

  std::optional<Live> a = start(prompt, hints[0], 5);
  std::optional<Live> b = start(reversed, hints[1], 16);
  if (!a || !b)
    return transcript;
  for (int round = 0; round < 4; ++round)
    if (!passes(*a, round) || !passes(*b, round))
      return transcript;
  b.reset(); // its slot goes to a fresh sequence: the same keys, a zeroed state
  std::optional<Live> c = start(reversed, hints[1], 16);
  if (!c)
    return transcript;
  for (int round = 0; round < 3; ++round)
    if (!passes(*c, round) || !passes(*a, round))
      return transcript;
  for (Live *live : {&*a, &*c}) {
    auto state = live->sequence->recurrentState();
    EXPECT_TRUE(state.isOk()) << state.status().message();
    if (state.isOk())
      transcript.states.push_back(std::move(*state));
    transcript.lengths.push_back(live->sequence->length());
  }
  return transcript;
}

// Prefill and verification calls replayed from graphs (LoadOptions::prefillGraphs) against the
// same calls launched kernel by kernel: the same kernels on the same data, so exactly the same
// logits, kept tokens and states, rollbacks after replayed passes included.
TEST_P(CudaDeviceTest, PrefillGraphsMatchPlainLaunches) {
  const std::string dir = cudaPlan(GetParam());
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  ASSERT_GE(prompt.size(), 20u);
  LoadOptions options;
  options.device = "cuda";
  options.maxSequences = 3;
  GraphedAndPlain models;
  if (!loadGraphedAndPlain(dir, options, &LoadOptions::prefillGraphs, models))
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(models.graphed && models.plain);
  Model &graphed = *models.graphed, &plain = *models.plain;

  const PrefillTranscript withGraphs = runPrefillGraphScript(graphed, prompt);
  const PrefillTranscript withLaunches = runPrefillGraphScript(plain, prompt);
  ASSERT_FALSE(withGraphs.logits.empty());
  ASSERT_EQ(withGraphs.logits.size(), withLaunches.logits.size());
  for (size_t i = 0; i < withGraphs.logits.size(); ++i)
    EXPECT_EQ(withGraphs.logits[i], withLaunches.logits[i]) << "call " << i;
  EXPECT_EQ(withGraphs.verified, withLaunches.verified);
  EXPECT_EQ(withGraphs.lengths, withLaunches.lengths);
  ASSERT_EQ(withGraphs.states.size(), 2u);
  EXPECT_EQ(withGraphs.states, withLaunches.states);

  const CudaGraphCounts counts = graphed.cudaGraphCounts();
  EXPECT_EQ(plain.cudaGraphCounts().prefillReplays, 0);
  // A prefill program with steps on the cpu reference cannot be held by a graph (nothing is
  // compared then beyond the eager path); one entirely on the GPU must have replayed passes.
  if (runsEntirelyOnTheGpu(graphed, "prefill")) {
    EXPECT_GT(counts.prefillCaptures, 0);
    EXPECT_GT(counts.prefillReplays, counts.prefillCaptures);
  } else {
    EXPECT_EQ(counts.prefillReplays, 0);
  }
}

// Speculative decoding with verification passes replayed from graphs keeps the greedy tokens
// of the same model without them, and of plain decoding.
TEST_P(CudaDeviceTest, SpeculationWithPrefillGraphsKeepsTheGreedyTokens) {
  const std::string dir = cudaPlan(GetParam());
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  LoadOptions options;
  options.device = "cuda";
  options.kdaPrefill = "recurrent"; // as SpeculativeDecodingKeepsTheGreedyTokens
  GraphedAndPlain models;
  if (!loadGraphedAndPlain(dir, options, &LoadOptions::prefillGraphs, models))
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(models.graphed && models.plain);
  Model &graphed = *models.graphed, &plain = *models.plain;
  std::vector<int64_t> repetitive;
  for (int i = 0; i < 6; ++i)
    repetitive.insert(repetitive.end(), prompt.begin(), prompt.begin() + 7);
  int64_t verifySteps = 0;
  for (const auto &tokens : {prompt, repetitive}) {
    GenerationOptions greedy;
    greedy.maxNewTokens = 32;
    GenerationOptions speculative = greedy;
    speculative.draftTokens = 4;
    auto reference = generateGreedy(graphed, tokens, greedy);
    ASSERT_TRUE(reference.isOk()) << reference.status().message();
    for (int repeat = 0; repeat < 2; ++repeat) { // the second time the graphs exist already
      auto withGraphs = generateGreedy(graphed, tokens, speculative);
      auto withoutGraphs = generateGreedy(plain, tokens, speculative);
      ASSERT_TRUE(withGraphs.isOk()) << withGraphs.status().message();
      ASSERT_TRUE(withoutGraphs.isOk()) << withoutGraphs.status().message();
      EXPECT_EQ(withGraphs->generated, withoutGraphs->generated);
      EXPECT_EQ(withGraphs->generated, reference->generated);
      EXPECT_EQ(withGraphs->verifySteps, withoutGraphs->verifySteps);
      EXPECT_EQ(withGraphs->acceptedTokens, withoutGraphs->acceptedTokens);
      verifySteps += withGraphs->verifySteps;
    }
  }
  EXPECT_GT(verifySteps, 0);
  if (runsEntirelyOnTheGpu(graphed, "prefill")) {
    EXPECT_GT(graphed.cudaGraphCounts().prefillReplays, 0);
  }
}

TEST_P(CudaDeviceTest, BatchedPrefillAndVerificationMatchSingleSequencesAndTheCpu) {
  checkBatchedPrefillAndVerification(GetParam(), /*decodeAgainstCpu=*/true);
}

// Kimi's full-attention layers with FP8 pages (the policy's dense_attention_kv_cache:
// fp8_tiles) run on the tensor-core MLA kernel in causal mode, not the CUDA-core one the plans
// above take: several sequences of several rows each in one call. Decode logits are compared
// with the cpu by greedy id only: one of these twelve steps (sequence 3, 11 tokens, step 0)
// differs from the cpu by 1.24 in logits on the H200 with the same id, the batched and the
// single-sequence cuda runs agreeing within 1e-6 and the prefill of the same 12 tokens on the
// GPU giving the same row: a near-tie the GPU's summation order resolves otherwise (an E4M3
// code or an MoE expert choice one side of its boundary); the cpu itself agrees with its full
// forwards to 2e-6.
TEST(CudaDenseFp8Cache, BatchedPrefillAndVerificationMatchSingleSequencesAndTheCpu) {
  checkBatchedPrefillAndVerification("kimi_linear_tiny-fp8kv", /*decodeAgainstCpu=*/false);
}

// LoadOptions::batchInvariant (issue 9): a row's logits have the same bits in a decode step of
// three sequences, in a decode step alone, and in one verification pass over the three
// sequences' drafts (the tokens the decode steps chose, so all accepted); after the pass
// (rollback, KDA replay) states and KV rows are the decode steps' too, so the next steps agree
// bit for bit. What keeps greedy tokens the same with and without speculation at any batch.
void checkBatchInvariantVerification(const std::string &planDir) {
  LoadOptions options;
  options.device = "cuda";
  options.batchInvariant = true;
  options.maxSequences = 8;
  auto model = Model::load(planDir, options);
  if (noGpu(model))
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(model.isOk()) << model.status().message();
  const int64_t vocab = (*model)->vocabSize();
  const auto rowOf = [vocab](const std::vector<float> &logits, size_t row) {
    return std::span<const float>(logits).subspan(row * size_t(vocab), size_t(vocab));
  };
  std::mt19937_64 random(31);
  std::vector<std::vector<int64_t>> prompts;
  for (size_t length : {size_t(70), size_t(9), size_t(23)}) { // one prompt over two pages
    std::vector<int64_t> prompt(length);
    for (int64_t &token : prompt)
      token = std::uniform_int_distribution<int64_t>(0, vocab - 1)(random);
    prompts.push_back(std::move(prompt));
  }
  std::vector<std::unique_ptr<Sequence>> decoded, verified;
  std::unique_ptr<Sequence> alone; // the first prompt, decoding by itself
  std::vector<int64_t> next;
  for (const std::vector<int64_t> &prompt : prompts)
    for (auto *group : {&decoded, &verified}) {
      auto sequence = (*model)->newSequence();
      ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
      auto logits = (*sequence)->prefill(prompt);
      ASSERT_TRUE(logits.isOk()) << logits.status().message();
      if (group == &decoded)
        next.push_back(argmax(*logits, vocab));
      group->push_back(std::move(*sequence));
    }
  {
    auto sequence = (*model)->newSequence();
    ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
    ASSERT_TRUE((*sequence)->prefill(prompts[0]).isOk());
    alone = std::move(*sequence);
  }
  constexpr int kSteps = 4;
  const size_t count = prompts.size();
  std::vector<std::vector<int64_t>> fed(count);
  std::vector<std::vector<std::vector<float>>> stepLogits(count);
  for (int step = 0; step < kSteps; ++step) {
    std::vector<Sequence *> group;
    for (const auto &sequence : decoded)
      group.push_back(sequence.get());
    auto logits = (*model)->decodeBatch(group, next);
    ASSERT_TRUE(logits.isOk()) << logits.status().message();
    auto single = alone->decode(next[0]);
    ASSERT_TRUE(single.isOk()) << single.status().message();
    EXPECT_EQ(differingBits(rowOf(*logits, 0), *single), 0u)
        << "step " << step << ": sequence 0 in a batch of " << count << " and alone";
    for (size_t i = 0; i < count; ++i) {
      fed[i].push_back(next[i]);
      const std::span<const float> row = rowOf(*logits, i);
      stepLogits[i].emplace_back(row.begin(), row.end());
      next[i] = argmax(stepLogits[i].back(), vocab);
    }
  }
  std::vector<DraftCheck> checks;
  for (size_t i = 0; i < count; ++i)
    checks.push_back({.sequence = verified[i].get(),
                      .token = fed[i][0],
                      .draft = std::span<const int64_t>(fed[i]).subspan(1)});
  auto pass = (*model)->verifyDrafts(checks);
  ASSERT_TRUE(pass.isOk()) << pass.status().message();
  for (size_t i = 0; i < count; ++i) {
    SCOPED_TRACE(testing::Message() << "sequence " << i);
    const DraftVerification &result = (*pass)[i];
    EXPECT_EQ(result.accepted, kSteps - 1);
    ASSERT_EQ(result.tokens.size(), size_t(kSteps));
    EXPECT_EQ(result.tokens.back(), next[i]);
    for (int step = 0; step < kSteps; ++step)
      EXPECT_EQ(differingBits(rowOf(result.logits, size_t(step)), stepLogits[i][size_t(step)]), 0u)
          << "pass row " << step << " against decode step " << step;
    EXPECT_EQ(verified[i]->length(), decoded[i]->length());
    auto state = verified[i]->recurrentState(), expected = decoded[i]->recurrentState();
    ASSERT_TRUE(state.isOk() && expected.isOk());
    EXPECT_EQ(differingBits(*state, *expected), 0u) << "recurrent state after the pass";
  }
  for (auto *group : {&decoded, &verified}) { // the pass's KV rows are the decode steps' rows
    std::vector<Sequence *> members;
    for (const auto &sequence : *group)
      members.push_back(sequence.get());
    auto logits = (*model)->decodeBatch(members, next);
    ASSERT_TRUE(logits.isOk()) << logits.status().message();
    stepLogits.push_back({*logits});
  }
  EXPECT_EQ(differingBits(stepLogits[count][0], stepLogits[count + 1][0]), 0u)
      << "the decode step after the pass";
}

TEST_P(CudaDeviceTest, BatchInvariantVerificationGivesTheDecodeStepsBits) {
  checkBatchInvariantVerification(cudaPlan(GetParam(), "-batch4"));
}

TEST(CudaDenseFp8Cache, BatchInvariantVerificationGivesTheDecodeStepsBits) {
  checkBatchInvariantVerification(cudaPlan("kimi_linear_tiny-fp8kv"));
}

// The Kimi models' MLA layers and every DeepSeek layer keep their KV rows in the device pools:
// interleaved sequences, batches, prefix hits and speculative rollbacks share, copy and truncate
// pages there.
INSTANTIATE_TEST_SUITE_P(Models, CudaDeviceTest,
                         testing::Values("kimi_linear_tiny", "kimi_attnres_tiny",
                                         "deepseek_v32_tiny"));

// Largest |a - b| over two equally long vectors (the cuda-vs-cpu logit tolerance's measure,
// hybrid-run --compare-with).
double maxAbsDifference(const std::vector<float> &a, const std::vector<float> &b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
  return worst;
}

// The multi-token-prediction program on the GPU (docs/mtp.md), on the synthetic DeepSeek-V3.2
// with an MTP layer (tests/e2e/CMakeLists.txt: synth-mtp-cpu and synth-mtp-cuda, unquantized).
class CudaDeviceMtp : public testing::Test {
protected:
  void SetUp() override {
    const std::string base = directory("HYBRID_E2E_DIR", HYBRID_E2E_DIR) + "/synth-mtp";
    LoadOptions options;
    options.prefixCacheEntries = 2;
    options.prefixCacheBlockTokens = 16;
    GpuAndCpu models;
    if (!loadGpuAndCpu(base + "-cuda", base + "-cpu", options, models))
      GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(models.gpu && models.cpu);
    gpu_ = std::move(models.gpu);
    cpu_ = std::move(models.cpu);
    ASSERT_TRUE(gpu_->hasMtp());
  }

  // The golden prompt, and random ones of 1 to 100 tokens (past the mtp program's 64 rows).
  std::vector<std::vector<int64_t>> prompts() const {
    std::vector<std::vector<int64_t>> all = {goldenPrompt("deepseek_v32_tiny")};
    std::mt19937 random(99);
    for (int64_t length : {1, 7, 23, 100}) {
      std::vector<int64_t> prompt(static_cast<size_t>(length));
      for (int64_t &token : prompt)
        token = std::uniform_int_distribution<int64_t>(0, gpu_->vocabSize() - 1)(random);
      all.push_back(prompt);
    }
    return all;
  }

  std::unique_ptr<Model> gpu_, cpu_;
};

// Every step of the mtp program has a GPU kernel now (the two-input eh_proj included).
TEST_F(CudaDeviceMtp, RunsEntirelyOnTheGpu) {
  const std::string report = gpu_->placementReport();
  const size_t line = report.find("cuda mtp: GPU: ");
  ASSERT_NE(line, std::string::npos) << report;
  const std::string mtp = report.substr(line, report.find('\n', line) - line);
  EXPECT_NE(mtp.find("; cpu reference: none"), std::string::npos) << mtp;
}

// Greedy outputs with MTP drafts (the hidden states kept on the GPU, decode steps in graphs)
// equal plain decoding on the GPU and the cpu oracle's.
TEST_F(CudaDeviceMtp, SpeculationKeepsTheGreedyTokens) {
  int64_t verifySteps = 0;
  for (const std::vector<int64_t> &prompt : prompts()) {
    SCOPED_TRACE("prompt of " + std::to_string(prompt.size()) + " tokens");
    GenerationOptions plain;
    plain.maxNewTokens = 12;
    auto oracle = generateGreedy(*cpu_, prompt, plain);
    auto reference = generateGreedy(*gpu_, prompt, plain);
    ASSERT_TRUE(oracle.isOk() && reference.isOk()) << reference.status().message();
    EXPECT_EQ(reference->generated, oracle->generated);
    GenerationOptions speculative = plain;
    speculative.draftTokens = 3;
    speculative.draftSource = DraftSourceKind::Mtp;
    auto drafted = generateGreedy(*gpu_, prompt, speculative);
    ASSERT_TRUE(drafted.isOk()) << drafted.status().message();
    EXPECT_EQ(drafted->generated, reference->generated);
    EXPECT_EQ(static_cast<int64_t>(drafted->generated.size()),
              1 + drafted->verifySteps + drafted->acceptedTokens);
    verifySteps += drafted->verifySteps;
  }
  EXPECT_GT(verifySteps, 0);
}

// MTP drafts with the mtp program's one-row calls and the verification passes replayed from
// graphs (the hidden input comes from a device record into the program's fixed slot) against
// the same model launching them kernel by kernel: the same tokens and acceptance.
TEST_F(CudaDeviceMtp, PrefillGraphsKeepTheGreedyTokens) {
  LoadOptions options;
  options.device = "cuda";
  options.prefixCacheEntries = 2;
  options.prefixCacheBlockTokens = 16;
  options.prefillGraphs = false;
  auto plain =
      Model::load(directory("HYBRID_E2E_DIR", HYBRID_E2E_DIR) + "/synth-mtp-cuda", options);
  ASSERT_TRUE(plain.isOk()) << plain.status().message();
  for (const std::vector<int64_t> &prompt : prompts()) {
    SCOPED_TRACE("prompt of " + std::to_string(prompt.size()) + " tokens");
    GenerationOptions speculative;
    speculative.maxNewTokens = 12;
    speculative.draftTokens = 3;
    speculative.draftSource = DraftSourceKind::Mtp;
    auto withGraphs = generateGreedy(*gpu_, prompt, speculative);
    auto withoutGraphs = generateGreedy(**plain, prompt, speculative);
    ASSERT_TRUE(withGraphs.isOk()) << withGraphs.status().message();
    ASSERT_TRUE(withoutGraphs.isOk()) << withoutGraphs.status().message();
    EXPECT_EQ(withGraphs->generated, withoutGraphs->generated);
    EXPECT_EQ(withGraphs->verifySteps, withoutGraphs->verifySteps);
    EXPECT_EQ(withGraphs->acceptedTokens, withoutGraphs->acceptedTokens);
  }
  EXPECT_EQ((*plain)->cudaGraphCounts().prefillReplays, 0);
  if (runsEntirelyOnTheGpu(*gpu_, "prefill")) {
    EXPECT_GT(gpu_->cudaGraphCounts().prefillReplays, 0);
  }
}

// The scheduler's batched, choosing decode steps record hidden states on the GPU too; with
// prefix caching a kept prefix gets zero MTP rows in the device pools for positions the MTP has
// not run (Sequence::setMtpLength).
TEST_F(CudaDeviceMtp, SchedulerWithPrefixCacheKeepsTheGreedyTokens) {
  SchedulerOptions options;
  options.draftTokens = 2;
  options.draftSource = DraftSourceKind::Mtp;
  options.prefillChunkTokens = 16;
  // Speculate in batches too, as on batch-invariant kernels: this checkpoint's logits are far
  // from ties, so passes of several sequences keep the greedy tokens (what is checked here is
  // the MTP records and prefix caching under batched speculation, not batch invariance).
  options.batchInvariantModel = true;
  Scheduler scheduler(*gpu_, options);
  std::vector<std::vector<int64_t>> requests = prompts();
  requests.push_back(requests[0]); // the same prompt again: a prefix-cache hit
  std::map<uint64_t, size_t> requestOf;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto id = scheduler.submit({requests[i], 8, {}, {}});
    ASSERT_TRUE(id.isOk()) << id.status().message();
    requestOf[*id] = i;
  }
  std::vector<std::vector<int64_t>> tokens(requests.size());
  while (!scheduler.idle())
    for (const TokenEvent &event : scheduler.step()) {
      ASSERT_TRUE(event.error.empty()) << event.error;
      tokens[requestOf[event.request]].push_back(event.token);
    }
  for (size_t i = 0; i < requests.size(); ++i) {
    GenerationOptions plain;
    plain.maxNewTokens = 8;
    auto oracle = generateGreedy(*cpu_, requests[i], plain);
    ASSERT_TRUE(oracle.isOk()) << oracle.status().message();
    EXPECT_EQ(tokens[i], oracle->generated) << "request " << i;
  }
  EXPECT_GT(scheduler.stats().verifySteps, 0);
}

// The main model's recorded final hidden states, the MTP logits and the MTP's own hidden states
// (what chained drafts are fed) on the same inputs are the cpu oracle's within the tolerance of
// the other cuda-vs-cpu comparisons (2e-3, --quantization=none), over 100 rows (two mtp runs);
// the drafts the MTP source proposes from the GPU's records are the cpu's.
TEST_F(CudaDeviceMtp, MtpLogitsMatchTheCpuOracle) {
  const std::vector<int64_t> prompt = prompts().back();
  const auto T = static_cast<int64_t>(prompt.size());
  const int64_t vocab = gpu_->vocabSize();
  std::vector<int64_t> following(prompt.begin() + 1, prompt.end());
  following.push_back(7);
  FinalHiddenRows recorded[2];
  MtpOutput outputs[2];
  std::vector<int64_t> drafts[2];
  Model *models[2] = {cpu_.get(), gpu_.get()};
  for (int m = 0; m < 2; ++m) {
    SCOPED_TRACE(m == 0 ? "cpu" : "cuda");
    auto sequence = models[m]->newSequence();
    ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
    (*sequence)->recordFinalHidden(true);
    auto logits = (*sequence)->prefill(prompt);
    ASSERT_TRUE(logits.isOk()) << logits.status().message();
    recorded[m] = (*sequence)->takeFinalHidden();
    ASSERT_EQ(recorded[m].firstPosition, 0);
    ASSERT_EQ(static_cast<int64_t>(recorded[m].rows.size()), T * models[m]->hiddenSize());
    // Both devices' MTP over the cpu's hidden rows: the MTP alone is compared.
    auto mtp = (*sequence)->runMtp(following, recorded[0].rows);
    ASSERT_TRUE(mtp.isOk()) << mtp.status().message();
    outputs[m] = std::move(*mtp);
    EXPECT_EQ((*sequence)->mtpLength(), T);

    auto fresh = models[m]->newSequence();
    auto source = makeDraftSource(*models[m], DraftSourceKind::Mtp);
    ASSERT_TRUE(fresh.isOk() && source.isOk());
    (*source)->attach(**fresh);
    ASSERT_TRUE((*fresh)->prefill(prompt).isOk());
    std::vector<int64_t> context = prompt;
    context.push_back(argmax(*logits, vocab));
    auto draft = (*source)->propose(**fresh, context, 3);
    ASSERT_TRUE(draft.isOk()) << draft.status().message();
    drafts[m] = *draft;
    EXPECT_EQ((*fresh)->mtpLength(), T); // chained rows are dropped, real ones stay
  }
  const double hidden = maxAbsDifference(recorded[0].rows, recorded[1].rows);
  const double logits = maxAbsDifference(outputs[0].logits, outputs[1].logits);
  const double mtpHidden = maxAbsDifference(outputs[0].hidden, outputs[1].hidden);
  std::printf("max |cuda - cpu|: final hidden %.3g, MTP logits %.3g, MTP hidden %.3g\n", hidden,
              logits, mtpHidden);
  EXPECT_LE(hidden, 2e-3);
  EXPECT_LE(logits, 2e-3);
  EXPECT_LE(mtpHidden, 2e-3);
  EXPECT_EQ(drafts[1], drafts[0]);
}

// Relative RMS error of each row of `actual` against `expected` ([rows, width]), sorted.
std::vector<double> sortedRowErrors(const std::vector<float> &expected,
                                    const std::vector<float> &actual, int64_t width) {
  std::vector<double> errors;
  for (size_t row = 0; row + width <= expected.size(); row += width) {
    double difference = 0, magnitude = 0;
    for (int64_t i = 0; i < width; ++i) {
      const double e = expected[row + i], a = actual[row + i];
      difference += (a - e) * (a - e);
      magnitude += e * e;
    }
    errors.push_back(std::sqrt(difference / std::max(magnitude, 1e-30)));
  }
  std::sort(errors.begin(), errors.end());
  return errors;
}

// The hidden states of a prefill of `prompt` by the cpu oracle and by the cuda device.
void prefillBoth(Model &cpu, Model &gpu, const std::vector<int64_t> &prompt,
                 HiddenStates &expected, HiddenStates &actual) {
  for (auto [model, hidden] : {std::pair{&cpu, &expected}, {&gpu, &actual}}) {
    auto sequence = model->newSequence();
    ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
    auto logits = (*sequence)->prefill(prompt, hidden);
    ASSERT_TRUE(logits.isOk()) << logits.status().message();
  }
}

// DeepSeek-V3.2 with FP8 weights (synthetic, tests/e2e/CMakeLists.txt): the cuda device's FP8
// GEMMs (cuBLASLt, block-scaled, on activations quantized bit-exactly like the cpu's) against the
// cpu oracle (the same quantization, exact fp32 sums). Hopper's FP8 tensor cores accumulate with
// fewer bits within each 128-wide block (about 1e-4 relative per GEMM, LinearFp8CudaTest), and a
// re-quantized activation near an E4M3 rounding boundary can land one step away. With only the
// MLP's three FP8 GEMMs on the GPU the first layer's rows differed by a median 2.9e-4 (H200); with
// the whole layer there since 2026-11-30 (q_a, q_b, kv_a, the indexer's wq_b and wk, o_proj: each
// GEMM's accumulation error moves the next quantized activation, whose flipped E4M3 steps are 6-12%
// of an element) they differ by a median 1.5e-2, worst 6.7e-2 (rows whose indexer top-k picks
// another position). A wrong activation scale rule or scale layout moves the median row by about
// 1e-1. Later layers are not compared: this random model's router has near-ties that such
// differences flip (whole experts change for a token).
TEST(CudaDeviceFp8, FirstLayerMatchesTheCpuOracle) {
  const std::string base = directory("HYBRID_E2E_DIR", HYBRID_E2E_DIR) + "/synth-dsv32-fp8";
  std::vector<int64_t> prompt;
  for (int64_t i = 0; i < 100; ++i)
    prompt.push_back((i * 53 + 7) % 256);
  GpuAndCpu models;
  if (!loadGpuAndCpu(base + "-cuda", base + "-cpu", LoadOptions{}, models))
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(models.gpu && models.cpu);
  Model &gpu = *models.gpu, &cpu = *models.cpu;
  // Layer 0 (FP8 MLA with the indexer, dense FP8 MLP) runs on the GPU ("cuda prefill: GPU: ...;").
  const std::string report = gpu.placementReport();
  const std::string onGpu = report.substr(0, report.find(';'));
  EXPECT_NE(onGpu.find("mlp x"), std::string::npos) << report;
  EXPECT_NE(onGpu.find("sparse_mla_prefill x"), std::string::npos) << report;

  HiddenStates expected, actual;
  prefillBoth(cpu, gpu, prompt, expected, actual);
  ASSERT_GE(expected.layers.size(), 2u);
  ASSERT_EQ(actual.layers.size(), expected.layers.size());
  EXPECT_EQ(actual.layers[0], expected.layers[0]); // the embedding
  const std::vector<double> errors =
      sortedRowErrors(expected.layers[1], actual.layers[1], expected.width);
  ASSERT_EQ(errors.size(), prompt.size());
  std::printf("first layer: row relative RMS error median %.3g, worst %.3g\n",
              errors[errors.size() / 2], errors.back());
  EXPECT_LE(errors[errors.size() / 2], 3e-2); // a third of a wrong rule's
  EXPECT_LE(errors.back(), 1.5e-1);
}

// The quantized policies on the GPU: FP8 latent pages read by the tensor-core sparse MLA (bf16
// queries and softmax weights, FlashMLA's precision) and the indexer's queries and keys in MXFP8
// (the default) or DeepSeek's own FP8 (one scale a query head and a key: fp8-indexer), against
// the cpu oracle's simulation of the same rounding. Each layer's rows are compared; the errors
// are printed for docs/performance.md.
class CudaDeviceQuantizedCache : public testing::TestWithParam<std::string> {};

TEST_P(CudaDeviceQuantizedCache, LayersMatchTheCpuOracle) {
  const std::string base =
      directory("HYBRID_E2E_DIR", HYBRID_E2E_DIR) + "/deepseek_v32_tiny-" + GetParam();
  const std::vector<int64_t> prompt = goldenPrompt("deepseek_v32_tiny");
  GpuAndCpu models;
  if (!loadGpuAndCpu(base + "-cuda", base, LoadOptions{}, models))
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(models.gpu && models.cpu);
  Model &gpu = *models.gpu, &cpu = *models.cpu;
  const std::string report = gpu.placementReport();
  EXPECT_NE(report.substr(0, report.find(';')).find("sparse_mla_prefill x"), std::string::npos)
      << report;

  HiddenStates expected, actual;
  prefillBoth(cpu, gpu, prompt, expected, actual);
  ASSERT_EQ(actual.layers.size(), expected.layers.size());
  for (size_t layer = 1; layer < expected.layers.size(); ++layer) {
    const std::vector<double> errors =
        sortedRowErrors(expected.layers[layer], actual.layers[layer], expected.width);
    ASSERT_EQ(errors.size(), prompt.size());
    std::printf("layer %zu: row relative RMS error median %.3g, worst %.3g\n", layer - 1,
                errors[errors.size() / 2], errors.back());
    if (layer == 1) {
      EXPECT_LE(errors[errors.size() / 2], 2e-3);
      EXPECT_LE(errors.back(), 1e-2);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, CudaDeviceQuantizedCache,
                         testing::Values("quantized", "fp8-indexer"),
                         [](const testing::TestParamInfo<std::string> &info) {
                           return info.param == "quantized" ? std::string("Default")
                                                            : std::string("Fp8Indexer");
                         });

// An indexer top-k (128) above the KV cache's capacity (a 48-token context): every key is
// selected, and the DSA layers still run on the GPU (they fell back to the cpu reference, 1000x
// slower, whenever a context limit was below DeepSeek-V3.2's 2048). Prefill and greedy decode
// logits against the cpu plan of the same checkpoint.
TEST(CudaTopKAboveCapacity, RunsOnTheGpuAndMatchesTheCpu) {
  const std::string base =
      directory("HYBRID_E2E_DIR", HYBRID_E2E_DIR) + "/deepseek_v32_tiny-topk128";
  LoadOptions options;
  options.maxContextTokens = 48;
  GpuAndCpu models;
  if (!loadGpuAndCpu(base + "-cuda", base, options, models))
    GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(models.gpu && models.cpu);
  Model &gpu = *models.gpu, &cpu = *models.cpu;
  EXPECT_TRUE(runsEntirelyOnTheGpu(gpu, "prefill")) << gpu.placementReport();
  EXPECT_TRUE(runsEntirelyOnTheGpu(gpu, "decode")) << gpu.placementReport();

  const std::vector<int64_t> prompt = goldenPrompt("deepseek_v32_tiny"); // 40 tokens
  auto onGpu = gpu.newSequence();
  auto onCpu = cpu.newSequence();
  ASSERT_TRUE(onGpu.isOk() && onCpu.isOk());
  auto a = (*onGpu)->prefill(prompt), b = (*onCpu)->prefill(prompt);
  ASSERT_TRUE(a.isOk()) << a.status().message();
  ASSERT_TRUE(b.isOk()) << b.status().message();
  EXPECT_LT(worstDifference(*a, *b), 2e-3);
  const int64_t vocab = gpu.vocabSize();
  for (int step = 0; step < 6; ++step) { // to 46 of the 48 tokens
    const int64_t token = argmax(*b, vocab);
    EXPECT_EQ(argmax(*a, vocab), token) << "step " << step;
    a = (*onGpu)->decode(token);
    b = (*onCpu)->decode(token);
    ASSERT_TRUE(a.isOk()) << a.status().message();
    ASSERT_TRUE(b.isOk()) << b.status().message();
    EXPECT_LT(worstDifference(*a, *b), 2e-3) << "step " << step;
  }
}

} // namespace
} // namespace hybrid
