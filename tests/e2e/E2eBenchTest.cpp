// hybrid-bench e2e's library (E2eBench.h) on the compiled golden models, cpu device: the decode
// step's byte count follows the plan (experts by the batch's expected distinct choices, dense
// latent rows with the context, sparse ones capped at the indexer's top-k, KDA states per
// sequence, the embedding by rows), a run yields a row per (batch, context) with consistent
// figures, and the plot is a well-formed PNG.
#include "hybrid/runtime/E2eBench.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Plan.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace hybrid {
namespace {

namespace fb = plan::fb;

std::string compiledDir(const std::string &model) {
  return std::string(HYBRID_E2E_DIR) + "/" + model;
}

std::unique_ptr<Model> load(const std::string &model, int32_t sequences = 4) {
  LoadOptions options;
  options.maxSequences = sequences;
  options.maxContextTokens = 128;
  auto loaded = Model::load(compiledDir(model), options);
  EXPECT_TRUE(loaded) << loaded.status().message();
  return loaded ? std::move(*loaded) : nullptr;
}

const fb::Dispatch *firstDispatch(const fb::Plan &plan, fb::KernelId kernel) {
  if (const fb::Program *decode = findProgram(plan, "decode"))
    for (const fb::Step *step : *decode->steps())
      if (const fb::Dispatch *d = step->op_as_Dispatch(); d && d->kernel() == kernel)
        return d;
  return nullptr;
}

TEST(E2eBench, StepBytesFollowThePlan) {
  auto kimi = load("kimi_linear_tiny");
  auto deepseek = load("deepseek_v32_tiny");
  ASSERT_TRUE(kimi && deepseek);
  using bench::decodeStepBytes;

  // Experts: top_k of them for one token, more for a batch, never more than all of them.
  const fb::Dispatch *moe = firstDispatch(kimi->plan(), fb::KernelId::MoeExperts);
  ASSERT_NE(moe, nullptr);
  const int experts = moe->params_as_MoeParams()->num_experts();
  const int topK = moe->params_as_MoeParams()->top_k();
  const double one = decodeStepBytes(kimi->plan(), 1, 64).experts;
  const double eight = decodeStepBytes(kimi->plan(), 8, 64).experts;
  const double many = decodeStepBytes(kimi->plan(), 100000, 64).experts;
  EXPECT_GT(one, 0.0);
  EXPECT_GT(eight, one);
  EXPECT_LT(eight, 8 * one);
  EXPECT_NEAR(many / one, double(experts) / topK, 1e-6 * experts);

  // Dense latent rows (Kimi's MLA layers) grow with the context; KDA states with the batch only.
  const auto k64 = decodeStepBytes(kimi->plan(), 2, 64), k128 = decodeStepBytes(kimi->plan(), 2, 128);
  EXPECT_GT(k64.kvCache, 0.0);
  EXPECT_NEAR(k128.kvCache, 2 * k64.kvCache, 1e-9 * k128.kvCache);
  EXPECT_GT(k64.recurrentState, 0.0);
  EXPECT_EQ(k64.recurrentState, k128.recurrentState);
  EXPECT_NEAR(decodeStepBytes(kimi->plan(), 4, 64).recurrentState, 2 * k64.recurrentState,
              1e-9 * k64.recurrentState);
  // The weights do not depend on the context; the embedding adds one row per sequence.
  EXPECT_EQ(k64.weights, k128.weights);
  const fb::Dispatch *embed = firstDispatch(kimi->plan(), fb::KernelId::Embed);
  ASSERT_NE(embed, nullptr);
  const fb::Weight *table = kimi->plan().weights()->Get(uint32_t(embed->weights()->Get(0)));
  const double row = double(table->size()) / double(table->shape()->Get(0));
  EXPECT_EQ(row, double(kimi->hiddenSize()) * (table->dtype() == fb::DType::F32 ? 4 : 2));
  EXPECT_NEAR(decodeStepBytes(kimi->plan(), 3, 64).weights - k64.weights, row, 1e-6 * row);

  // DSA (every DeepSeek layer): the sparse attention reads at most top-k latent rows, the
  // indexer every key; no recurrent state.
  const fb::Dispatch *indexer = firstDispatch(deepseek->plan(), fb::KernelId::DsaIndexer);
  ASSERT_NE(indexer, nullptr);
  const int64_t k = indexer->params_as_DsaIndexerParams()->top_k();
  const auto atK = decodeStepBytes(deepseek->plan(), 1, k);
  const auto twiceK = decodeStepBytes(deepseek->plan(), 1, 2 * k);
  const auto fourTimesK = decodeStepBytes(deepseek->plan(), 1, 4 * k);
  EXPECT_GT(twiceK.kvCache, atK.kvCache);             // the index keys
  EXPECT_LT(twiceK.kvCache, 2 * atK.kvCache);         // not the latent rows
  EXPECT_NEAR(fourTimesK.kvCache - twiceK.kvCache, 2 * (twiceK.kvCache - atK.kvCache),
              1e-9 * fourTimesK.kvCache);             // index keys: linear past top-k
  EXPECT_EQ(atK.recurrentState, 0.0);
}

TEST(E2eBench, RunGivesARowPerBatchAndContext) {
  auto model = load("kimi_linear_tiny-batch4", 6);
  ASSERT_TRUE(model);
  bench::E2eOptions options;
  options.batches = {1, 6}; // 6: two calls of the 4-sequence decode program per step
  options.contexts = {8, 32};
  options.decodeSteps = 3;
  std::vector<std::string> lines;
  auto rows = bench::runE2e(*model, options, [&](const std::string &l) { lines.push_back(l); });
  ASSERT_TRUE(rows) << rows.status().message();
  ASSERT_EQ(rows->size(), 4u);
  EXPECT_EQ(lines.size(), 8u); // prefill and decode per row
  for (const bench::E2eRow &r : *rows) {
    EXPECT_GT(r.ttftMs, 0.0);
    EXPECT_GT(r.tpotUs, 0.0);
    EXPECT_NEAR(r.decodeTokensPerSecond, r.batch / (r.tpotUs * 1e-6), 1e-6 * r.decodeTokensPerSecond);
    EXPECT_NEAR(r.floorUs, r.bytes.total() / (options.bandwidthTbPerSecond * 1e12) * 1e6,
                1e-9 * r.floorUs);
    EXPECT_NEAR(r.ratio(), r.tpotUs / r.floorUs, 1e-9 * r.ratio());
  }
  EXPECT_EQ((*rows)[0].batch, 1);
  EXPECT_EQ((*rows)[1].context, 32);
  EXPECT_EQ((*rows)[3].batch, 6);
  // Every sequence of a row is freed before the next: a second run fits in the same model.
  EXPECT_TRUE(bench::runE2e(*model, options, {}));

  // The plot: PNG signature, an 880 x 520 RGB header, the end chunk.
  const std::string path = ::testing::TempDir() + "/e2e-plot.png";
  ASSERT_TRUE(bench::writeE2ePlot(*rows, path));
  std::ifstream file(path, std::ios::binary);
  const std::vector<unsigned char> png((std::istreambuf_iterator<char>(file)), {});
  ASSERT_GT(png.size(), 33u);
  EXPECT_EQ(std::vector<unsigned char>(png.begin(), png.begin() + 8),
            (std::vector<unsigned char>{0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'}));
  EXPECT_EQ(std::string(png.begin() + 12, png.begin() + 16), "IHDR");
  EXPECT_EQ((png[16] << 24 | png[17] << 16 | png[18] << 8 | png[19]), 880);
  EXPECT_EQ((png[20] << 24 | png[21] << 16 | png[22] << 8 | png[23]), 520);
  EXPECT_EQ(std::string(png.end() - 8, png.end() - 4), "IEND");
}

TEST(E2eBench, SharedPromptRowsTakeOneContextOfPages) {
  LoadOptions load;
  load.maxSequences = 6;
  load.maxContextTokens = 256;
  load.kvCacheTokens = 800; // six distinct 200-token prompts need 1200 and more
  bench::E2eOptions options;
  options.batches = {6};
  options.contexts = {200};
  options.decodeSteps = 3;
  {
    auto model = Model::load(compiledDir("kimi_linear_tiny-batch4"), load);
    ASSERT_TRUE(model) << model.status().message();
    EXPECT_FALSE(bench::runE2e(**model, options, {})); // distinct prompts: out of pages
    options.sharedPrompt = true; // without prefix caching there is nothing to restore
    auto refused = bench::runE2e(**model, options, {});
    ASSERT_FALSE(refused);
    EXPECT_NE(refused.status().message().find("prefix caching"), std::string::npos)
        << refused.status().message();
  }
  load.prefixCacheEntries = 1;
  auto model = Model::load(compiledDir("kimi_linear_tiny-batch4"), load);
  ASSERT_TRUE(model) << model.status().message();
  auto rows = bench::runE2e(**model, options, {});
  ASSERT_TRUE(rows) << rows.status().message();
  ASSERT_EQ(rows->size(), 1u);
  const bench::E2eRow &row = rows->front();
  EXPECT_GT(row.ttftMs, 0.0);
  EXPECT_GT(row.tpotUs, 0.0);
  // The prefill rate is the first sequence's (the others restored its prefix).
  EXPECT_NEAR(row.prefillTokensPerSecond, 200 / (row.ttftMs * 1e-3),
              1e-6 * row.prefillTokensPerSecond);
  EXPECT_FALSE(row.ttftReused);
  // A second row of the context restores the kept prompt for every sequence and reports the
  // first row's TTFT.
  options.batches = {6, 2};
  rows = bench::runE2e(**model, options, {});
  ASSERT_TRUE(rows) << rows.status().message();
  ASSERT_EQ(rows->size(), 2u);
  EXPECT_FALSE((*rows)[0].ttftReused);
  EXPECT_TRUE((*rows)[1].ttftReused);
  EXPECT_EQ((*rows)[1].ttftMs, (*rows)[0].ttftMs);
  EXPECT_GT((*rows)[1].tpotUs, 0.0);
}

TEST(E2eBench, BadInputIsAnErrorNamingIt) {
  auto model = load("kimi_linear_tiny");
  ASSERT_TRUE(model);
  bench::E2eOptions options;
  options.batches = {5}; // the model holds 4 sequences
  options.contexts = {8};
  options.decodeSteps = 1;
  auto tooMany = bench::runE2e(*model, options, {});
  ASSERT_FALSE(tooMany);
  EXPECT_NE(tooMany.status().message().find("batch 5"), std::string::npos)
      << tooMany.status().message();
  options.batches = {1};
  options.decodeSteps = 0;
  EXPECT_FALSE(bench::runE2e(*model, options, {}));
  const Status unwritable = bench::writeE2ePlot({bench::E2eRow{1, 8, 0, 0, 0, 0, {}, 0}},
                                                  "/nonexistent-dir/p.png");
  ASSERT_FALSE(unwritable);
  EXPECT_NE(unwritable.message().find("/nonexistent-dir/p.png"), std::string::npos);
  EXPECT_FALSE(bench::writeE2ePlot({}, ::testing::TempDir() + "/empty.png"));
}

} // namespace
} // namespace hybrid
