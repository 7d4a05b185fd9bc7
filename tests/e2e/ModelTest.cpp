// The runtime on the compiled golden checkpoints: cached decoding against full forwards, chunked
// prefill, independent sequences, and bad input at run time.
#include "hybrid/runtime/Communicator.h"
#include "hybrid/runtime/Generate.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Safetensors.h"
#include "hybrid/runtime/Scheduler.h"
#include "E2eTestSupport.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <unistd.h>

namespace hybrid {
namespace {

namespace fs = std::filesystem;

using e2etest::compiledDir;
using e2etest::goldenPrompt;
using e2etest::greedyIds;
using e2etest::loadOrDie;
using e2etest::runToIdle;
using e2etest::SchedulerRun;

double maxAbsDiff(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
  return worst;
}

class GoldenModelTest : public testing::TestWithParam<std::string> {};

// Prefill of T-1 tokens followed by one decode step equals the full forward on T tokens.
TEST_P(GoldenModelTest, PrefillThenDecodeEqualsFullForward) {
  auto model = loadOrDie(compiledDir(GetParam()));
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  const size_t V = static_cast<size_t>(model->vocabSize()), T = prompt.size();

  auto full = model->newSequence();
  ASSERT_TRUE(full.isOk());
  auto fullLogits = (*full)->prefill(prompt);
  ASSERT_TRUE(fullLogits.isOk()) << fullLogits.status().message();

  auto split = model->newSequence();
  ASSERT_TRUE(split.isOk());
  auto head = (*split)->prefill(std::span(prompt).first(T - 1));
  ASSERT_TRUE(head.isOk()) << head.status().message();
  auto last = (*split)->decode(prompt.back());
  ASSERT_TRUE(last.isOk()) << last.status().message();
  EXPECT_EQ((*split)->length(), static_cast<int64_t>(T));

  EXPECT_LE(maxAbsDiff(*head, std::span(*fullLogits).first((T - 1) * V)), 1e-5);
  EXPECT_LE(maxAbsDiff(*last, std::span(*fullLogits).last(V)), 1e-4);
}

// A prompt fed in several prefill calls (chunked prefill against the cache) equals one call.
TEST_P(GoldenModelTest, ChunkedPrefillEqualsOneShot) {
  auto model = loadOrDie(compiledDir(GetParam()));
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  auto once = model->newSequence();
  auto oneShot = (*once)->prefill(prompt);
  ASSERT_TRUE(oneShot.isOk()) << oneShot.status().message();

  auto chunked = model->newSequence();
  std::vector<float> pieces;
  for (auto [begin, end] : {std::pair{0, 7}, {7, 30}, {30, 40}}) {
    auto part = (*chunked)->prefill(std::span(prompt).subspan(begin, end - begin));
    ASSERT_TRUE(part.isOk()) << part.status().message();
    pieces.insert(pieces.end(), part->begin(), part->end());
  }
  EXPECT_LE(maxAbsDiff(pieces, *oneShot), 1e-4);
}

// PrefillLogits::LastRow (servers, benchmarks) returns exactly the last row of the full result.
TEST_P(GoldenModelTest, LastRowLogitsAreTheLastRowOfAllRows) {
  auto model = loadOrDie(compiledDir(GetParam()));
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  auto all = (*model->newSequence())->prefill(prompt);
  ASSERT_TRUE(all.isOk()) << all.status().message();
  auto sequence = model->newSequence();
  auto last = (*sequence)->prefill(prompt, nullptr, PrefillLogits::LastRow);
  ASSERT_TRUE(last.isOk()) << last.status().message();
  const auto vocab = static_cast<size_t>(model->vocabSize());
  ASSERT_EQ(last->size(), vocab);
  EXPECT_EQ(*last, std::vector<float>(all->end() - static_cast<std::ptrdiff_t>(vocab), all->end()));
  EXPECT_EQ((*sequence)->length(), static_cast<int64_t>(prompt.size()));
}

// Sequences do not see each other's caches or state.
TEST_P(GoldenModelTest, SequencesAreIndependent) {
  auto model = loadOrDie(compiledDir(GetParam()));
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  auto alone = model->newSequence();
  auto reference = (*alone)->prefill(prompt);
  ASSERT_TRUE(reference.isOk());
  alone->reset();

  auto other = model->newSequence();
  std::vector<int64_t> noise(prompt.rbegin(), prompt.rend());
  ASSERT_TRUE((*other)->prefill(noise).isOk());
  auto again = model->newSequence();
  auto logits = (*again)->prefill(prompt);
  ASSERT_TRUE(logits.isOk());
  EXPECT_EQ(maxAbsDiff(*logits, *reference), 0.0);
}

// Greedy decoding with caches picks the golden ids (the tool-level test compares the logits).
TEST_P(GoldenModelTest, CachedGreedyMatchesGolden) {
  auto model = loadOrDie(compiledDir(GetParam()));
  ASSERT_TRUE(model);
  GenerationOptions options;
  options.maxNewTokens = 12;
  auto result = generateGreedy(*model, goldenPrompt(GetParam()), options);
  ASSERT_TRUE(result.isOk()) << result.status().message();
  auto report = compareWithReference(std::string(HYBRID_TEST_DATA_DIR) + "/" + GetParam() +
                                         "/golden.safetensors",
                                     *result, 2e-3);
  ASSERT_TRUE(report.isOk()) << report.status().message();
  EXPECT_TRUE(report->genIdsMatch);
  EXPECT_EQ(report->comparedGenIds, 12);
  EXPECT_LE(report->maxLogitsDiff, 2e-3);
}

// Without keepLogits greedy decoding chooses on the device (Model::decodeBatchChoose) and keeps
// only the prompt's last row of logits: the same ids as with every row kept.
TEST_P(GoldenModelTest, GreedyWithoutLogitsChoosesTheSameIds) {
  auto model = loadOrDie(compiledDir(GetParam()));
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  GenerationOptions options;
  options.maxNewTokens = 12;
  auto kept = generateGreedy(*model, prompt, options);
  options.keepLogits = false;
  auto chosen = generateGreedy(*model, prompt, options);
  ASSERT_TRUE(kept.isOk() && chosen.isOk());
  EXPECT_EQ(chosen->generated, kept->generated);
  ASSERT_EQ(chosen->promptLogits.size(), static_cast<size_t>(model->vocabSize()));
  EXPECT_EQ(chosen->promptLogits,
            std::vector<float>(kept->promptLogits.end() - model->vocabSize(),
                               kept->promptLogits.end()));
  EXPECT_TRUE(chosen->generatedLogits.empty());
  // A stop token ends both runs at the same place.
  options.stopTokens = {kept->generated[5]};
  auto stopped = generateGreedy(*model, prompt, options);
  ASSERT_TRUE(stopped.isOk());
  const auto stop = std::find(kept->generated.begin(), kept->generated.end(), kept->generated[5]);
  EXPECT_EQ(stopped->generated, std::vector<int64_t>(kept->generated.begin(), stop + 1));
}

// The cpu device runs the steps in random orders that respect the plan's streams and events:
// the logits must not change by a single bit, or the stream assignment or the memory plan races.
TEST_P(GoldenModelTest, RandomStreamInterleavingsGiveIdenticalResults) {
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  GenerationOptions options;
  options.maxNewTokens = 4;
  auto reference = loadOrDie(compiledDir(GetParam()));
  ASSERT_TRUE(reference);
  auto expected = generateGreedy(*reference, prompt, options);
  ASSERT_TRUE(expected.isOk()) << expected.status().message();
  for (uint64_t seed : {1, 2, 3, 4, 5}) {
    LoadOptions shuffled;
    shuffled.scheduleSeed = seed;
    auto model = loadOrDie(compiledDir(GetParam()), shuffled);
    ASSERT_TRUE(model);
    auto result = generateGreedy(*model, prompt, options);
    ASSERT_TRUE(result.isOk()) << result.status().message();
    EXPECT_EQ(maxAbsDiff(result->promptLogits, expected->promptLogits), 0.0) << "seed " << seed;
    EXPECT_EQ(maxAbsDiff(result->generatedLogits, expected->generatedLogits), 0.0)
        << "seed " << seed;
    EXPECT_EQ(result->generated, expected->generated) << "seed " << seed;
  }
}

// Greedy ids and their logits from `sequence`, starting from the prompt's last logits row.
std::pair<std::vector<int64_t>, std::vector<float>> greedyFrom(Sequence &sequence,
                                                               std::span<const float> lastRow,
                                                               int steps) {
  std::vector<int64_t> ids;
  std::vector<float> logits(lastRow.begin(), lastRow.end());
  std::vector<float> row(lastRow.begin(), lastRow.end());
  for (int step = 0; step < steps; ++step) {
    ids.push_back(std::max_element(row.begin(), row.end()) - row.begin());
    auto next = sequence.decode(ids.back());
    EXPECT_TRUE(next.isOk()) << next.status().message();
    if (!next.isOk())
      break;
    row = *next;
    logits.insert(logits.end(), row.begin(), row.end());
  }
  return {ids, logits};
}

// Prefix caching restores the KV rows and the recurrent state of a kept prefix; what runs after
// it equals a full prefill, for a hit that ends mid-page (KV pages hold 64 tokens, the prefixes
// are cut at 16) and for a prompt that only shares part of a kept prefix.
TEST_P(GoldenModelTest, PrefixCacheHitsEqualAFullPrefill) {
  LoadOptions options;
  options.prefixCacheEntries = 4;
  options.prefixCacheBlockTokens = 16;
  auto cached = loadOrDie(compiledDir(GetParam()), options);
  auto plain = loadOrDie(compiledDir(GetParam()));
  ASSERT_TRUE(cached && plain);
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  ASSERT_EQ(prompt.size(), 40u);
  const size_t V = static_cast<size_t>(cached->vocabSize());
  std::vector<int64_t> sharing35(prompt.begin(), prompt.begin() + 35);
  for (int64_t id : {3, 1, 4, 1, 5, 9, 2})
    sharing35.push_back(id);
  const std::vector<int64_t> sharing20(prompt.begin(), prompt.begin() + 20);

  // (prompt, tokens expected from the cache): the first run keeps the prompt's first 32 tokens;
  // the second shares 35 and gets those 32 (its own cut at 32 equals the kept one); the prompt
  // again gets its 32. A prompt keeps one prefix, cut at its last block boundary, so 20 shared
  // tokens find nothing (32 > 19) until a 20-token prompt has kept its own 16.
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> runs = {
      {prompt, 0}, {sharing35, 32}, {prompt, 32}, {sharing20, 0}, {sharing20, 16}};
  for (const auto &[tokens, expectedCached] : runs) {
    SCOPED_TRACE(testing::Message() << tokens.size() << " tokens");
    auto reference = plain->newSequence();
    auto full = (*reference)->prefill(tokens);
    ASSERT_TRUE(full.isOk()) << full.status().message();
    auto sequence = cached->newSequence();
    auto result = (*sequence)->prefillWithPrefixCache(tokens);
    ASSERT_TRUE(result.isOk()) << result.status().message();
    EXPECT_EQ(result->cachedTokens, expectedCached);
    EXPECT_EQ((*sequence)->length(), static_cast<int64_t>(tokens.size()));
    EXPECT_LE(maxAbsDiff(result->logits,
                         std::span(*full).subspan(static_cast<size_t>(result->cachedTokens) * V)),
              1e-5);
    auto [ids, logits] = greedyFrom(**sequence, std::span(result->logits).last(V), 6);
    auto [referenceIds, referenceLogits] =
        greedyFrom(**reference, std::span(*full).last(V), 6);
    EXPECT_EQ(ids, referenceIds);
    EXPECT_LE(maxAbsDiff(logits, referenceLogits), 1e-4);
  }
}

TEST_P(GoldenModelTest, PrefixCacheEvictsTheLeastRecentlyUsed) {
  LoadOptions options;
  options.prefixCacheEntries = 1;
  options.prefixCacheBlockTokens = 16;
  auto model = loadOrDie(compiledDir(GetParam()), options);
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  const std::vector<int64_t> reversed(prompt.rbegin(), prompt.rend());
  auto cachedTokens = [&](const std::vector<int64_t> &tokens) {
    auto sequence = model->newSequence();
    auto result = (*sequence)->prefillWithPrefixCache(tokens);
    EXPECT_TRUE(result.isOk()) << result.status().message();
    return result.isOk() ? result->cachedTokens : -1;
  };
  EXPECT_EQ(cachedTokens(prompt), 0);
  EXPECT_EQ(cachedTokens(prompt), 32);
  EXPECT_EQ(cachedTokens(reversed), 0); // keeps its own 32, dropping the prompt's
  EXPECT_EQ(cachedTokens(prompt), 0);

  // Without prefix caching the call is a plain prefill; a used sequence is refused.
  auto plain = loadOrDie(compiledDir(GetParam()));
  auto sequence = plain->newSequence();
  auto result = (*sequence)->prefillWithPrefixCache(prompt);
  ASSERT_TRUE(result.isOk());
  EXPECT_EQ(result->cachedTokens, 0);
  EXPECT_EQ(result->logits.size(), prompt.size() * static_cast<size_t>(plain->vocabSize()));
  EXPECT_EQ((*sequence)->prefillWithPrefixCache(prompt).status().message(),
            "prefillWithPrefixCache starts a sequence; this one already holds 40 tokens");
}

// Speculative decoding with prompt-lookup drafts gives the greedy tokens of plain decoding, on the
// golden prompt and on a repetitive one (where drafts get accepted).
TEST_P(GoldenModelTest, SpeculativeDecodingKeepsTheGreedyTokens) {
  auto model = loadOrDie(compiledDir(GetParam()));
  ASSERT_TRUE(model);
  const std::vector<int64_t> golden = goldenPrompt(GetParam());
  std::vector<int64_t> repetitive;
  for (int i = 0; i < 4; ++i)
    repetitive.insert(repetitive.end(), golden.begin(), golden.begin() + 9);
  for (const auto &prompt : {golden, repetitive}) {
    GenerationOptions plain;
    plain.maxNewTokens = 24;
    auto reference = generateGreedy(*model, prompt, plain);
    ASSERT_TRUE(reference.isOk()) << reference.status().message();
    GenerationOptions speculative = plain;
    speculative.draftTokens = 4;
    auto result = generateGreedy(*model, prompt, speculative);
    ASSERT_TRUE(result.isOk()) << result.status().message();
    EXPECT_EQ(result->generated, reference->generated);
    EXPECT_LE(maxAbsDiff(result->generatedLogits, reference->generatedLogits), 1e-4);
    EXPECT_GT(result->draftedTokens, 0);
    EXPECT_LE(result->acceptedTokens, result->draftedTokens);
    // Each pass gives its accepted draft tokens and one of its own (the last may be cut short).
    EXPECT_GE(result->verifySteps + result->acceptedTokens, 23);
  }
}

// A rollback leaves the recurrent state and the cache as plain decoding of the kept tokens does,
// to 1e-6 of the state's magnitude: a draft accepted in part, rejected at once, and accepted
// whole. (The last case has no rollback: the differences, about 5e-7 relative, are those of the
// prefill program against the decode program, not of the replay.)
TEST_P(GoldenModelTest, RollbackStateEqualsPlainDecoding) {
  auto model = loadOrDie(compiledDir(GetParam()));
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  GenerationOptions options;
  options.maxNewTokens = 4;
  const std::vector<int64_t> greedy = generateGreedy(*model, prompt, options).value().generated;
  const int64_t wrong = (greedy[2] + 1) % model->vocabSize();
  // (draft after greedy[0], tokens plain decoding must consume to match)
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> cases = {
      {{greedy[1], wrong, greedy[3]}, 2}, // accepts greedy[1]: keeps greedy[0], greedy[1]
      {{wrong, greedy[2]}, 1},            // rejects at once: keeps greedy[0]
      {{greedy[1], greedy[2]}, 3}};       // accepts all
  for (const auto &[draft, kept] : cases) {
    SCOPED_TRACE(testing::Message() << "kept " << kept);
    auto speculative = model->newSequence();
    ASSERT_TRUE((*speculative)->prefill(prompt).isOk());
    auto verified = (*speculative)->verifyDraft(greedy[0], draft);
    ASSERT_TRUE(verified.isOk()) << verified.status().message();
    EXPECT_EQ(verified->accepted, kept - 1);
    EXPECT_EQ(verified->tokens.back(), greedy[static_cast<size_t>(kept)]);

    auto plain = model->newSequence();
    ASSERT_TRUE((*plain)->prefill(prompt).isOk());
    for (int64_t i = 0; i < kept; ++i)
      ASSERT_TRUE((*plain)->decode(greedy[static_cast<size_t>(i)]).isOk());
    EXPECT_EQ((*speculative)->length(), (*plain)->length());
    auto state = (*speculative)->recurrentState(), expected = (*plain)->recurrentState();
    ASSERT_TRUE(state.isOk() && expected.isOk());
    double magnitude = 0;
    for (float value : *expected)
      magnitude = std::max(magnitude, double(std::abs(value)));
    EXPECT_LE(maxAbsDiff(*state, *expected), 1e-6 * std::max(magnitude, 1.0));
    // The next step agrees too (the KV tail was truncated).
    auto next = (*speculative)->decode(greedy[static_cast<size_t>(kept)]);
    auto expectedNext = (*plain)->decode(greedy[static_cast<size_t>(kept)]);
    ASSERT_TRUE(next.isOk() && expectedNext.isOk());
    EXPECT_LE(maxAbsDiff(*next, *expectedNext), 1e-4);
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, GoldenModelTest,
                         testing::Values("kimi_linear_tiny", "deepseek_v32_tiny",
                                         "kimi_attnres_tiny"));

// Precision policies on DeepSeek-V3.2: the default puts the indexer's query and key through MXFP8
// and the sparse-attention latent cache through FP8 tiles; fp8-indexer takes DeepSeek's own
// indexer FP8 (one scale a query head and a key) instead. The drift against the full-precision
// reference is measured and printed (docs/quantization.md records it); it must be real (the
// quantizers ran) and finite.
class QuantizedPolicy : public testing::TestWithParam<std::string> {};

TEST_P(QuantizedPolicy, DeepseekDriftIsMeasured) {
  const std::string golden =
      std::string(HYBRID_TEST_DATA_DIR) + "/deepseek_v32_tiny/golden.safetensors";
  GenerationOptions options;
  options.maxNewTokens = 12;
  auto quantized = loadOrDie(compiledDir("deepseek_v32_tiny-" + GetParam()));
  auto reference = loadOrDie(compiledDir("deepseek_v32_tiny"));
  ASSERT_TRUE(quantized && reference);
  auto result = generateGreedy(*quantized, goldenPrompt("deepseek_v32_tiny"), options);
  auto exact = generateGreedy(*reference, goldenPrompt("deepseek_v32_tiny"), options);
  ASSERT_TRUE(result.isOk()) << result.status().message();
  ASSERT_TRUE(exact.isOk()) << exact.status().message();
  auto report = compareWithReference(golden, *result, 2e-3);
  ASSERT_TRUE(report.isOk()) << report.status().message();
  for (float value : result->promptLogits)
    ASSERT_TRUE(std::isfinite(value));
  EXPECT_GT(report->maxLogitsDiff, 1e-4) << "the quantizers did not change anything";
  size_t agreeing = 0;
  while (agreeing < result->generated.size() &&
         result->generated[agreeing] == exact->generated[agreeing])
    ++agreeing;
  std::printf("%s quantization policy, deepseek_v32_tiny: prompt logits max abs drift %.4g, "
              "greedy ids %s (first %zu of %zu agree)\n",
              GetParam().c_str(), report->maxLogitsDiff,
              report->genIdsMatch ? "identical" : "different", agreeing, result->generated.size());
}

INSTANTIATE_TEST_SUITE_P(Policies, QuantizedPolicy, testing::Values("quantized", "fp8-indexer"),
                         [](const testing::TestParamInfo<std::string> &info) {
                           return info.param == "quantized" ? std::string("Default")
                                                            : std::string("Fp8Indexer");
                         });

// Synthetic weights (hybrid-compile --synthetic-weights=5 on a tiny preset's config.json alone):
// generated at load, finite logits, and the same greedy ids and logits on every load.
class SyntheticWeightsTest : public testing::TestWithParam<std::string> {};

TEST_P(SyntheticWeightsTest, FiniteLogitsAndTheSameIdsOnEveryLoad) {
  const std::string dir = compiledDir("synthetic-" + GetParam() + "-cpu");
  LoadOptions options;
  options.syntheticWeights = true;
  const std::vector<int64_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  GenerationOptions generation;
  generation.maxNewTokens = 8;
  std::vector<GenerationResult> runs;
  for (int load = 0; load < 2; ++load) {
    auto model = loadOrDie(dir, options);
    ASSERT_TRUE(model);
    EXPECT_GT(model->weightGeneration().hostBytes, 0u);
    EXPECT_EQ(model->weightGeneration().deviceBytes, 0u);
    auto result = generateGreedy(*model, prompt, generation);
    ASSERT_TRUE(result.isOk()) << result.status().message();
    runs.push_back(std::move(*result));
  }
  const GenerationResult &first = runs[0];
  ASSERT_EQ(first.promptLogits.size(), prompt.size() * static_cast<size_t>(first.vocabSize));
  double spread = 0;
  for (float logit : first.promptLogits) {
    ASSERT_TRUE(std::isfinite(logit));
    spread = std::max(spread, std::abs(double(logit) - first.promptLogits[0]));
  }
  EXPECT_GT(spread, 1e-3); // the weights are not degenerate
  ASSERT_EQ(first.generated.size(), 8u);
  for (int64_t id : first.generated) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, first.vocabSize);
  }
  EXPECT_EQ(runs[1].generated, first.generated);
  EXPECT_EQ(runs[1].promptLogits, first.promptLogits); // bit for bit
}

TEST_P(SyntheticWeightsTest, LoadsOnlyWhenAskedFor) {
  auto refused = Model::load(compiledDir("synthetic-" + GetParam() + "-cpu"));
  ASSERT_FALSE(refused.isOk());
  EXPECT_NE(refused.status().message().find("holds synthetic weights"), std::string::npos)
      << refused.status().message();
  LoadOptions options;
  options.syntheticWeights = true;
  auto real = Model::load(compiledDir("kimi_linear_tiny"), options);
  ASSERT_FALSE(real.isOk());
  EXPECT_NE(real.status().message().find("holds real weights"), std::string::npos)
      << real.status().message();
}

INSTANTIATE_TEST_SUITE_P(TinyPresets, SyntheticWeightsTest,
                         testing::Values("kimi-linear-tiny", "deepseek-v32-tiny",
                                         "kimi-attnres-tiny"),
                         [](const auto &info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// Model::loadTimings on the cpu device: the host phases are timed, the phases are disjoint (they
// sum to at most the total), summary() names each one that ran, the cuda phases stay zero, and
// weight verification is a phase only when asked for.
TEST(LoadTimingsTest, CpuLoadFillsItsPhases) {
  for (bool verify : {false, true}) {
    SCOPED_TRACE(verify ? "verifyWeightContents" : "plain load");
    LoadOptions options;
    options.verifyWeightContents = verify;
    auto model = loadOrDie(compiledDir("kimi_linear_tiny"), options);
    ASSERT_TRUE(model);
    const LoadTimings &t = model->loadTimings();
    const double fields[] = {t.planSeconds,        t.verifyWeightsSeconds, t.hostPoolsSeconds,
                             t.hostWeightsSeconds, t.cudaInitSeconds,      t.weightBufferSeconds,
                             t.weightsSeconds,     t.kvPoolsSeconds,       t.kernelSetupSeconds,
                             t.devicePoolsSeconds, t.streamsSeconds};
    double sum = 0;
    for (double seconds : fields) {
      EXPECT_GE(seconds, 0);
      sum += seconds;
    }
    EXPECT_GT(t.totalSeconds, 0);
    EXPECT_LE(sum, t.totalSeconds + 1e-9);
    EXPECT_GT(t.planSeconds, 0);
    EXPECT_GT(t.hostPoolsSeconds, 0);
    EXPECT_GT(t.hostWeightsSeconds, 0); // every weight converted to fp32
    EXPECT_EQ(t.verifyWeightsSeconds > 0, verify);
    for (double cuda :
         {t.cudaInitSeconds, t.weightBufferSeconds, t.weightsSeconds, t.kvPoolsSeconds,
          t.kernelSetupSeconds, t.devicePoolsSeconds, t.streamsSeconds})
      EXPECT_EQ(cuda, 0);
    double phased = 0;
    const std::string summary = t.summary();
    for (const LoadTimings::Phase &phase : t.phases()) {
      EXPECT_GT(phase.seconds, 0) << phase.name;
      EXPECT_NE(summary.find(std::string(phase.name) + " "), std::string::npos) << summary;
      phased += phase.seconds;
    }
    EXPECT_DOUBLE_EQ(phased, sum);
    EXPECT_EQ(t.phases().size(), verify ? 4u : 3u);
    EXPECT_NE(summary.find(" s ("), std::string::npos) << summary;
    EXPECT_NE(summary.find(", other "), std::string::npos) << summary;
    std::printf("kimi_linear_tiny cpu load: %s\n", summary.c_str());
  }
}

TEST(ModelErrors, TokenOutsideVocabulary) {
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"));
  ASSERT_TRUE(model);
  auto sequence = model->newSequence();
  const int64_t bad[] = {1, 2, 100000};
  auto logits = (*sequence)->prefill(bad);
  ASSERT_FALSE(logits.isOk());
  EXPECT_NE(logits.status().message().find("token id 100000 at position 2 is outside the "
                                           "vocabulary [0, 256)"),
            std::string::npos)
      << logits.status().message();
}

TEST(ModelErrors, ContextFull) {
  LoadOptions options;
  options.maxContextTokens = 16;
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"), options);
  ASSERT_TRUE(model);
  auto sequence = model->newSequence();
  std::vector<int64_t> prompt(20, 3);
  auto logits = (*sequence)->prefill(prompt);
  ASSERT_FALSE(logits.isOk());
  EXPECT_NE(logits.status().message().find("past maxContextTokens = 16"), std::string::npos);
}

TEST(ModelErrors, TooManySequences) {
  LoadOptions options;
  options.maxSequences = 1;
  auto model = loadOrDie(compiledDir("deepseek_v32_tiny"), options);
  ASSERT_TRUE(model);
  auto first = model->newSequence();
  ASSERT_TRUE(first.isOk());
  auto second = model->newSequence();
  ASSERT_FALSE(second.isOk());
  EXPECT_NE(second.status().message().find("all 1 sequences are in use"), std::string::npos);
}

// Damaged or foreign plans and archives are refused at load, never run.
class DamagedModelTest : public testing::Test {
protected:
  void SetUp() override {
    dir_ = fs::path(testing::TempDir()) / ("hybrid-damaged-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::copy(compiledDir("kimi_linear_tiny"), dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void flipByte(const std::string &file, std::streamoff offset) {
    std::fstream stream(dir_ / file, std::ios::in | std::ios::out | std::ios::binary);
    stream.seekg(offset);
    char byte = 0;
    stream.read(&byte, 1);
    byte ^= 0x5a;
    stream.seekp(offset);
    stream.write(&byte, 1);
  }
  std::string loadError() {
    auto model = Model::load(dir_.string());
    EXPECT_FALSE(model.isOk());
    return model.isOk() ? std::string() : model.status().message();
  }
  fs::path dir_;
};

TEST_F(DamagedModelTest, TruncatedPlan) {
  fs::resize_file(dir_ / "plan.hyplan", 100);
  EXPECT_NE(loadError().find("plan.hyplan"), std::string::npos);
}

TEST_F(DamagedModelTest, CorruptedPlanIdentifier) {
  flipByte("plan.hyplan", 5);
  EXPECT_NE(loadError().find("plan.hyplan"), std::string::npos);
}

TEST_F(DamagedModelTest, CorruptedArchiveHeader) {
  flipByte("weights.hyw", 20);
  EXPECT_NE(loadError().find("weights.hyw"), std::string::npos);
}

TEST_F(DamagedModelTest, TruncatedArchive) {
  fs::resize_file(dir_ / "weights.hyw", fs::file_size(dir_ / "weights.hyw") / 2);
  EXPECT_NE(loadError().find("weights.hyw"), std::string::npos);
}

TEST_F(DamagedModelTest, MissingArchive) {
  fs::remove(dir_ / "weights.hyw");
  EXPECT_NE(loadError().find("weights.hyw"), std::string::npos);
}

TEST_F(DamagedModelTest, CorruptedWeightDataCaughtByVerification) {
  // Flip a byte inside the first entry's data (the first page holds the header).
  flipByte("weights.hyw", 4096 + 10);
  LoadOptions verify;
  verify.verifyWeightContents = true;
  auto model = Model::load(dir_.string(), verify);
  ASSERT_FALSE(model.isOk());
  EXPECT_NE(model.status().message().find("weights.hyw"), std::string::npos)
      << model.status().message();
}

// Prompts of different lengths built from the golden prompt.
std::vector<std::vector<int64_t>> schedulerPrompts(const std::vector<int64_t> &prompt) {
  std::vector<std::vector<int64_t>> prompts = {prompt,
                                               {prompt.rbegin(), prompt.rend()},
                                               {prompt.begin(), prompt.begin() + 9},
                                               {prompt.begin() + 5, prompt.end()},
                                               {prompt.begin(), prompt.begin() + 1}};
  std::vector<int64_t> doubled = prompt;
  doubled.insert(doubled.end(), prompt.begin(), prompt.end());
  prompts.push_back(doubled);
  return prompts;
}

// Requests of different lengths, prefilled in 16-token chunks between the others' decode steps,
// more of them than sequences: each gets exactly the tokens of a greedy run on its own. With a
// plan for batched decode, the decode steps of a step run together (and still give them).
void expectInterleavedRequestsMatchGreedyRuns(const std::string &plan, bool batched) {
  LoadOptions options;
  options.maxSequences = 3;
  auto model = loadOrDie(compiledDir(plan), options);
  ASSERT_TRUE(model);
  Scheduler scheduler(*model, SchedulerOptions{16});
  const auto prompts = schedulerPrompts(goldenPrompt("kimi_linear_tiny"));
  std::map<uint64_t, std::pair<std::vector<int64_t>, int64_t>> submitted;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t count = 3 + static_cast<int64_t>(i);
    auto id = scheduler.submit({prompts[i], count, {}, {}});
    ASSERT_TRUE(id.isOk()) << id.status().message();
    submitted[*id] = {prompts[i], count};
  }
  EXPECT_EQ(scheduler.stats().waiting, 6);
  const SchedulerRun run = runToIdle(scheduler);
  EXPECT_TRUE(run.errors.empty());
  for (const auto &[id, request] : submitted)
    EXPECT_EQ(run.tokens.at(id), greedyIds(*model, request.first, request.second))
        << "request " << id;
  EXPECT_EQ(scheduler.stats().finished, 6);
  EXPECT_EQ(scheduler.stats().preemptions, 0);
  if (batched) {
    EXPECT_GT(scheduler.stats().decodeBatches, 0);
    EXPECT_GE(scheduler.stats().batchedDecodeRows, 2 * scheduler.stats().decodeBatches);
  } else {
    EXPECT_EQ(scheduler.stats().decodeBatches, 0);
  }
}

TEST(Scheduler, InterleavedRequestsMatchIndependentGreedyRuns) {
  expectInterleavedRequestsMatchGreedyRuns("kimi_linear_tiny", false);
}

TEST(Scheduler, BatchedDecodeStepsMatchIndependentGreedyRuns) {
  expectInterleavedRequestsMatchGreedyRuns("kimi_linear_tiny-batch4", true);
}

// A KV cache of two 64-token pages for three requests that each grow past one page: admission
// waits for pages, the request that runs out mid-decode is preempted and recomputed, and every
// request still gets its independent greedy tokens.
// With a batched-decode plan too: a step whose rows may not all get a page decodes them one by
// one, so only the row that finds the cache full is preempted.
void expectPreemptionByRecompute(const std::string &plan) {
  LoadOptions options;
  options.maxSequences = 3;
  options.kvCacheTokens = 128;
  auto model = loadOrDie(compiledDir(plan), options);
  ASSERT_TRUE(model);
  ASSERT_EQ(model->usage().totalPages, 2);
  const std::vector<int64_t> prompt = goldenPrompt("kimi_linear_tiny");
  const std::vector<std::vector<int64_t>> prompts = {
      prompt, {prompt.rbegin(), prompt.rend()}, {prompt.begin() + 3, prompt.end()}};
  Scheduler scheduler(*model);
  std::map<uint64_t, std::vector<int64_t>> promptOf;
  for (const auto &tokens : prompts) {
    auto id = scheduler.submit({tokens, 30, {}, {}});
    ASSERT_TRUE(id.isOk()) << id.status().message();
    promptOf[*id] = tokens;
  }
  const SchedulerRun run = runToIdle(scheduler);
  EXPECT_TRUE(run.errors.empty()) << run.errors.begin()->second;
  EXPECT_GT(scheduler.stats().preemptions, 0);
  for (const auto &[id, tokens] : promptOf)
    EXPECT_EQ(run.tokens.at(id), greedyIds(*model, tokens, 30)) << "request " << id;
}

TEST(Scheduler, PreemptsAndRecomputesWhenTheKvCacheIsFull) {
  expectPreemptionByRecompute("kimi_linear_tiny");
}

TEST(Scheduler, PreemptsWithBatchedDecodeToo) {
  expectPreemptionByRecompute("kimi_linear_tiny-batch4");
}

// More requests than pages, prefilled in 16-token chunks: admission must leave the pages that
// running prompts have yet to take, or a newly admitted prompt takes them, the older one runs out
// mid-prefill and is preempted, and the two keep preempting each other (seen: 226 preemptions
// in 400 steps, none finished). Every request finishes with its independent greedy tokens.
TEST(Scheduler, ChunkedPrefillsDoNotPreemptEachOtherForever) {
  LoadOptions options;
  options.maxSequences = 3;
  options.kvCacheTokens = 128;
  auto model = loadOrDie(compiledDir("kimi_linear_tiny-batch4"), options);
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt("kimi_linear_tiny");
  Scheduler scheduler(*model, SchedulerOptions{16});
  std::map<uint64_t, std::vector<int64_t>> promptOf;
  for (int i = 0; i < 5; ++i) {
    std::vector<int64_t> tokens(prompt.begin() + i, prompt.begin() + i + 30);
    auto id = scheduler.submit({tokens, 50, {}, {}});
    ASSERT_TRUE(id.isOk()) << id.status().message();
    promptOf[*id] = tokens;
  }
  const SchedulerRun run = runToIdle(scheduler, 600);
  EXPECT_TRUE(run.errors.empty());
  EXPECT_EQ(scheduler.stats().finished, 5);
  for (const auto &[id, tokens] : promptOf)
    EXPECT_EQ(run.tokens.at(id), greedyIds(*model, tokens, 50)) << "request " << id;
}

// Speculative decode steps inside the scheduler (prompt-lookup drafts) keep every request's greedy
// tokens; a repetitive prompt gets drafts.
TEST(Scheduler, SpeculativeStepsKeepTheGreedyTokens) {
  LoadOptions options;
  options.maxSequences = 2;
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"), options);
  ASSERT_TRUE(model);
  SchedulerOptions speculative;
  speculative.prefillChunkTokens = 16;
  speculative.draftTokens = 4;
  Scheduler scheduler(*model, speculative);
  auto prompts = schedulerPrompts(goldenPrompt("kimi_linear_tiny"));
  std::vector<int64_t> repetitive;
  for (int i = 0; i < 5; ++i)
    repetitive.insert(repetitive.end(), prompts[0].begin(), prompts[0].begin() + 7);
  prompts.push_back(repetitive);
  std::map<uint64_t, std::vector<int64_t>> promptOf;
  for (const auto &tokens : prompts)
    promptOf[scheduler.submit({tokens, 10, {}, {}}).value()] = tokens;
  const SchedulerRun run = runToIdle(scheduler);
  EXPECT_TRUE(run.errors.empty());
  for (const auto &[id, tokens] : promptOf)
    EXPECT_EQ(run.tokens.at(id), greedyIds(*model, tokens, 10)) << "request " << id;
  EXPECT_GT(scheduler.stats().draftedTokens, 0);
  EXPECT_LE(scheduler.stats().acceptedTokens, scheduler.stats().draftedTokens);
}

TEST(Scheduler, StopTokensAndPrefixCache) {
  LoadOptions options;
  options.prefixCacheEntries = 2;
  options.prefixCacheBlockTokens = 16;
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"), options);
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt("kimi_linear_tiny");
  const std::vector<int64_t> expected = greedyIds(*model, prompt, 5);
  ASSERT_EQ(expected.size(), 5u);
  Scheduler scheduler(*model, SchedulerOptions{64});
  const uint64_t first = scheduler.submit({prompt, 5, {}, {}}).value();
  SchedulerRun run = runToIdle(scheduler);
  EXPECT_EQ(run.tokens.at(first), expected);
  // The same prompt again restores 32 tokens from the prefix cache; a stop token ends it early.
  const uint64_t second = scheduler.submit({prompt, 5, {expected[1]}, {}}).value();
  run = runToIdle(scheduler);
  EXPECT_EQ(run.tokens.at(second), std::vector<int64_t>(expected.begin(), expected.begin() + 2));
  EXPECT_EQ(scheduler.stats().cachedPromptTokens, 32);
}

// Prompts prefilled in chunks smaller than the prefix block still keep and reuse prefixes: a
// chunk stops at the block boundary to keep it.
TEST(Scheduler, ChunkedPromptsKeepAndReusePrefixes) {
  LoadOptions options;
  options.prefixCacheEntries = 2;
  options.prefixCacheBlockTokens = 16;
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"), options);
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt("kimi_linear_tiny");
  std::vector<int64_t> longer = prompt;
  longer.insert(longer.end(), prompt.begin(), prompt.begin() + 10);
  Scheduler scheduler(*model, SchedulerOptions{6});
  for (const auto &tokens : {prompt, longer, prompt}) {
    const uint64_t id = scheduler.submit({tokens, 4, {}, {}}).value();
    const SchedulerRun run = runToIdle(scheduler);
    EXPECT_EQ(run.tokens.at(id), greedyIds(*model, tokens, 4));
  }
  // The prompt kept 32 tokens; the longer prompt reused them (and kept 48); the prompt again
  // reused its 32.
  EXPECT_EQ(scheduler.stats().cachedPromptTokens, 64);
  EXPECT_EQ(model->usage().keptPrefixes, 2u);
}

TEST(Scheduler, CancelledRequestsStopAndFreeTheirSequence) {
  LoadOptions options;
  options.maxSequences = 1;
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"), options);
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = goldenPrompt("kimi_linear_tiny");
  Scheduler scheduler(*model);
  const uint64_t running = scheduler.submit({prompt, 50, {}, {}}).value();
  const uint64_t waiting = scheduler.submit({prompt, 3, {}, {}}).value();
  ASSERT_EQ(scheduler.step().size(), 1u); // the first request's first token
  EXPECT_EQ(scheduler.stats().running, 1);
  EXPECT_EQ(scheduler.stats().waiting, 1);
  EXPECT_TRUE(scheduler.cancel(running));
  EXPECT_FALSE(scheduler.cancel(running)) << "already gone";
  EXPECT_EQ(model->usage().sequencesInUse, 0) << "its sequence is free";
  const SchedulerRun run = runToIdle(scheduler);
  EXPECT_EQ(run.tokens.count(running), 0u);
  EXPECT_EQ(run.tokens.at(waiting), greedyIds(*model, prompt, 3));
  EXPECT_TRUE(scheduler.cancel(scheduler.submit({prompt, 3, {}, {}}).value())) << "while waiting";
  EXPECT_TRUE(scheduler.idle());
  EXPECT_EQ(scheduler.stats().cancelled, 2);
}

TEST(PromptLookup, DraftsWhatFollowedTheLatestEarlierOccurrence) {
  const std::vector<int64_t> context = {1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3};
  // The tail 1 2 3 occurred at 4 (latest) and 0: the draft follows the one at 4.
  EXPECT_EQ(promptLookupDraft(context, 3), (std::vector<int64_t>{7, 8, 5}));
  EXPECT_EQ(promptLookupDraft(context, 10), (std::vector<int64_t>{7, 8, 5, 1, 2, 3}));
  // Shorter n-grams when the longer tail never occurred; nothing when even one token is new.
  EXPECT_EQ(promptLookupDraft(std::vector<int64_t>{4, 5, 6, 4, 8, 4}, 2),
            (std::vector<int64_t>{8, 4}));
  EXPECT_TRUE(promptLookupDraft(std::vector<int64_t>{1, 2, 3}, 4).empty());
  EXPECT_TRUE(promptLookupDraft(context, 0).empty());
  EXPECT_TRUE(promptLookupDraft(std::vector<int64_t>{}, 4).empty());
}

TEST(PromptLookup, DraftLengthFollowsTheAcceptance) {
  EXPECT_EQ(adaptDraftLength(3, 4, 3, 3), 4); // all accepted: longer
  EXPECT_EQ(adaptDraftLength(4, 4, 4, 4), 4); // ... up to the maximum
  EXPECT_EQ(adaptDraftLength(3, 4, 3, 1), 2); // under half: shorter
  EXPECT_EQ(adaptDraftLength(1, 4, 1, 0), 1); // ... down to 1
  EXPECT_EQ(adaptDraftLength(3, 4, 4, 2), 3); // half: unchanged
  EXPECT_EQ(adaptDraftLength(3, 4, 0, 0), 3); // nothing drafted: unchanged
}

TEST(Scheduler, RefusesBadRequests) {
  LoadOptions options;
  options.maxContextTokens = 100;
  options.kvCacheTokens = 64;
  auto model = loadOrDie(compiledDir("kimi_linear_tiny"), options);
  ASSERT_TRUE(model);
  Scheduler scheduler(*model);
  EXPECT_EQ(scheduler.submit({{}, 4, {}, {}}).status().message(), "request: the prompt is empty");
  EXPECT_EQ(scheduler.submit({{1, 2}, 0, {}, {}}).status().message(),
            "request: maxNewTokens = 0 must be at least 1");
  EXPECT_EQ(scheduler.submit({{1, 256}, 4, {}, {}}).status().message(),
            "request: token id 256 at position 1 is outside the vocabulary [0, 256)");
  EXPECT_EQ(scheduler.submit({std::vector<int64_t>(90, 1), 20, {}, {}}).status().message(),
            "request: 90 prompt tokens + 20 new tokens exceed the context of 100 "
            "(maxContextTokens)");
  EXPECT_EQ(scheduler.submit({std::vector<int64_t>(60, 1), 20, {}, {}}).status().message(),
            "request: 79 tokens need 2 KV pages, the cache has 1");
  EXPECT_TRUE(scheduler.idle());
}

TEST(ModelErrors, BadPrefixCacheOptions) {
  LoadOptions options;
  options.prefixCacheEntries = -1;
  auto model = Model::load(compiledDir("kimi_linear_tiny"), options);
  ASSERT_FALSE(model.isOk());
  EXPECT_EQ(model.status().message(), "prefixCacheEntries (-1) must not be negative and "
                                      "prefixCacheBlockTokens (64) must be positive");
}

// Batched decode (a decode program for 4 sequences): sequences of different lengths decoding
// together give exactly the logits each gets decoding alone, as the batch shrinks and grows.
class DecodeBatchTest : public testing::TestWithParam<std::string> {};

TEST_P(DecodeBatchTest, RowsEqualSingleSequenceDecodes) {
  LoadOptions options;
  options.maxSequences = 6;
  auto model = loadOrDie(compiledDir(GetParam()) + "-batch4", options);
  ASSERT_TRUE(model);
  EXPECT_EQ(model->maxDecodeBatch(), 4);
  const std::vector<int64_t> prompt = goldenPrompt(GetParam());
  const std::vector<std::vector<int64_t>> prompts = {
      prompt, {prompt.begin(), prompt.begin() + 7}, {prompt.rbegin(), prompt.rend() - 11}};
  const int64_t vocab = model->vocabSize();
  // batched[i] and alone[i] see the same prompt and the same tokens.
  std::vector<std::unique_ptr<Sequence>> batched, alone;
  std::vector<int64_t> next;
  for (const auto &tokens : prompts) {
    for (auto *group : {&batched, &alone}) {
      auto sequence = model->newSequence();
      ASSERT_TRUE(sequence.isOk()) << sequence.status().message();
      auto logits = (*sequence)->prefill(tokens);
      ASSERT_TRUE(logits.isOk()) << logits.status().message();
      if (group == &batched)
        next.push_back(std::max_element(logits->end() - vocab, logits->end()) -
                       (logits->end() - vocab));
      group->push_back(std::move(*sequence));
    }
  }
  for (size_t members : {3u, 2u, 3u, 1u, 3u}) { // the batch shrinks and grows
    std::vector<Sequence *> group;
    std::vector<int64_t> tokens;
    for (size_t i = 0; i < members; ++i) {
      group.push_back(batched[i].get());
      tokens.push_back(next[i]);
    }
    auto logits = model->decodeBatch(group, tokens);
    ASSERT_TRUE(logits.isOk()) << logits.status().message();
    ASSERT_EQ(logits->size(), members * size_t(vocab));
    for (size_t i = 0; i < members; ++i) {
      auto single = alone[i]->decode(next[i]);
      ASSERT_TRUE(single.isOk()) << single.status().message();
      const std::vector<float> row(logits->begin() + i * vocab, logits->begin() + (i + 1) * vocab);
      EXPECT_EQ(row, *single) << "sequence " << i << " in a batch of " << members;
      EXPECT_EQ(batched[i]->length(), alone[i]->length());
      next[i] = std::max_element(row.begin(), row.end()) - row.begin();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, DecodeBatchTest,
                         testing::Values("kimi_linear_tiny", "deepseek_v32_tiny",
                                         "kimi_attnres_tiny"));

TEST(ModelErrors, BadDecodeBatches) {
  LoadOptions options;
  options.maxSequences = 6;
  auto model = loadOrDie(compiledDir("kimi_linear_tiny") + "-batch4", options);
  auto other = loadOrDie(compiledDir("kimi_linear_tiny") + "-batch4");
  ASSERT_TRUE(model && other);
  std::vector<std::unique_ptr<Sequence>> sequences;
  for (int i = 0; i < 5; ++i) {
    auto sequence = model->newSequence();
    ASSERT_TRUE(sequence.isOk());
    ASSERT_TRUE((*sequence)->prefill(std::vector<int64_t>{1, 2, 3}).isOk());
    sequences.push_back(std::move(*sequence));
  }
  auto stranger = other->newSequence();
  ASSERT_TRUE(stranger.isOk());
  auto refused = [&](std::vector<Sequence *> group, std::vector<int64_t> tokens,
                     const std::string &expected) {
    auto result = model->decodeBatch(group, tokens);
    ASSERT_FALSE(result.isOk());
    EXPECT_NE(result.status().message().find(expected), std::string::npos)
        << result.status().message();
  };
  Sequence *a = sequences[0].get(), *b = sequences[1].get();
  refused({}, {}, "at least one");
  refused({a, b}, {1}, "one token per sequence");
  refused({a, b, sequences[2].get(), sequences[3].get(), sequences[4].get()}, {1, 1, 1, 1, 1},
          "at most 4 (hybrid-compile --decode-batch)");
  refused({a, a}, {1, 2}, "sequences 0 and 1 are the same sequence");
  refused({a, stranger->get()}, {1, 2}, "sequence 1 is not one of this model's");
  // Nothing ran: every sequence is where it was.
  for (const auto &sequence : sequences)
    EXPECT_EQ(sequence->length(), 3);
  // The single-sequence plan takes one sequence per step.
  auto plain = loadOrDie(compiledDir("kimi_linear_tiny"));
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->maxDecodeBatch(), 1);
}

TEST(ModelErrors, Bf16StatesAreACudaOption) {
  LoadOptions options;
  options.kdaBf16State = true;
  auto model = Model::load(compiledDir("kimi_linear_tiny"), options);
  ASSERT_FALSE(model.isOk());
  EXPECT_NE(model.status().message().find("kdaBf16State"), std::string::npos);
}

TEST(ModelErrors, UnknownDevice) {
  LoadOptions options;
  options.device = "tpu";
  auto model = Model::load(compiledDir("kimi_linear_tiny"), options);
  ASSERT_FALSE(model.isOk());
  EXPECT_NE(model.status().message().find("device 'tpu'"), std::string::npos);
}

} // namespace
} // namespace hybrid

namespace hybrid {
namespace {

// Model::Usage's sparse-attention counters: per DSA layer and query token, min(top_k, position + 1)
// positions selected out of position + 1 (deepseek_v32_tiny: every layer is DSA); none without
// DSA layers (kimi_linear_tiny).
TEST(ModelUsage, CountsSparseAttentionSelections) {
  auto deepseek = loadOrDie(compiledDir("deepseek_v32_tiny"));
  ASSERT_TRUE(deepseek);
  int64_t layers = 0, topK = 0;
  for (const plan::fb::Program *program : *deepseek->plan().programs())
    if (program->name()->str() == "decode")
      for (const plan::fb::Step *step : *program->steps())
        if (const plan::fb::Dispatch *d = step->op_as_Dispatch();
            d && d->kernel() == plan::fb::KernelId::DsaIndexer) {
          ++layers;
          topK = d->params_as_DsaIndexerParams()->top_k();
        }
  ASSERT_GT(layers, 0);
  ASSERT_GT(topK, 0);
  const std::vector<int64_t> prompt = goldenPrompt("deepseek_v32_tiny");
  auto sequence = deepseek->newSequence();
  ASSERT_TRUE(sequence);
  ASSERT_TRUE((*sequence)->prefill(prompt));
  ASSERT_TRUE((*sequence)->decode(prompt[0]));
  uint64_t selected = 0, context = 0;
  for (int64_t position = 0; position <= int64_t(prompt.size()); ++position) { // + the decode
    selected += uint64_t(layers * std::min(topK, position + 1));
    context += uint64_t(layers * (position + 1));
  }
  EXPECT_EQ(deepseek->usage().sparseSelectedPositions, selected);
  EXPECT_EQ(deepseek->usage().sparseContextPositions, context);
  EXPECT_LT(selected, context); // the 40-token prompt is longer than top_k

  auto kimi = loadOrDie(compiledDir("kimi_linear_tiny"));
  ASSERT_TRUE(kimi);
  auto other = kimi->newSequence();
  ASSERT_TRUE(other);
  ASSERT_TRUE((*other)->prefill(goldenPrompt("kimi_linear_tiny")));
  EXPECT_EQ(kimi->usage().sparseSelectedPositions, 0u);
  EXPECT_EQ(kimi->usage().sparseContextPositions, 0u);
}

} // namespace
} // namespace hybrid

namespace hybrid {
namespace {

// A communicator whose collectives take device buffers (as NCCL's do), refusing every call: the
// cpu reference must not hand it host memory.
class DeviceBufferCommunicator final : public comm::Communicator {
public:
  int rank() const override { return 0; }
  int worldSize() const override { return 2; }
  std::string backend() const override { return "nccl"; }
  bool deviceBuffers() const override { return true; }
  Status allReduceSum(float *, size_t, void *) override { return called("allReduceSum"); }
  Status allGather(const float *, float *, size_t, void *) override {
    return called("allGather");
  }
  Status reduceScatterSum(const float *, float *, size_t, void *) override {
    return called("reduceScatterSum");
  }
  Status allToAll(const float *, float *, size_t, void *) override { return called("allToAll"); }
  Status barrier() override { return called("barrier"); }

private:
  static Status called(const std::string &what) {
    return Status::error("the test communicator was called: " + what);
  }
};

TEST(ShardedCpu, RefusesADeviceBufferCommunicator) {
  DeviceBufferCommunicator nccl;
  LoadOptions options;
  options.communicator = &nccl;
  auto model = Model::load(compiledDir("kimi_linear_tiny-tp2"), options);
  ASSERT_FALSE(model.isOk());
  EXPECT_EQ(model.status().message(),
            "the nccl communicator takes device buffers (the cuda device's); the cpu device "
            "needs a host one (loopback, tcp)");
}

} // namespace
} // namespace hybrid
