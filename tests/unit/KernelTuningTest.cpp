// The kernels' tunable parameters (KernelTuning.h) and the tuner's search (Tuner.h) on the CPU:
// each family's constraint at real shapes, the launch shape buckets the runtime looks up, the
// runtime's table of stored configurations, and the search driven by a synthetic measurement
// (winner, outputs that differ, noise margin, reuse without re-measuring, the budget).
#include "hybrid/kernels/Tuner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <stdlib.h>

namespace hybrid::kernels::tuning {
namespace {

namespace fs = std::filesystem;
namespace kc = hybrid::kernels::cuda;

const cache::TuningDevice kH200{
    .gpu = "NVIDIA H200", .smCount = 132, .driverVersion = 13000, .compiler = "cuda 13.0 sm_90"};

std::vector<int64_t> validValues(const TunableKernel &kernel, const ShapeBucket &shape,
                                 const std::string &parameter) {
  std::vector<int64_t> values;
  for (const TuningConfig &config : cache::enumerateCandidates(kernel, shape).valid)
    values.push_back(config.at(parameter));
  return values;
}

std::string rejection(const TunableKernel &kernel, const ShapeBucket &shape,
                      const TuningConfig &config) {
  for (const auto &[rejected, reason] : cache::enumerateCandidates(kernel, shape).rejected)
    if (rejected == config)
      return reason;
  return "(admitted)";
}

kc::IndexerParams deepSeekIndexer(int32_t rows, int32_t maxKeys) {
  kc::IndexerParams p;
  p.rows = rows;
  p.heads = 64;
  p.headDim = 128;
  p.keyType = kc::IndexKeyType::Mxfp8;
  p.mxfp8Queries = true;
  p.pageTokens = 64;
  p.maxKeys = maxKeys;
  return p;
}

TEST(KernelTuning, IndexerTilesPerBlockFitTheRowAndTheGrid) {
  const TunableKernel &kernel = indexerScoresKernel();
  EXPECT_EQ(kernel.defaults(), (TuningConfig{{"tiles_per_block", 0}}));
  const ShapeBucket shape = indexerScoresShape(deepSeekIndexer(3, 500));
  EXPECT_EQ(shape, (ShapeBucket{{"rows", 4}, {"heads", 64}, {"head_dim", 128}, {"max_keys", 512},
                                {"key_type", 1}, {"score_form", 3}}));
  // 512 keys are 8 tiles of 64: more tiles a block than that is the same launch as 8.
  EXPECT_EQ(validValues(kernel, shape, "tiles_per_block"), (std::vector<int64_t>{0, 1, 2, 4, 8}));
  EXPECT_EQ(rejection(kernel, shape, {{"tiles_per_block", 16}}),
            "tiles_per_block 16 > the row's 8 tiles");
  // 2^23 keys in tiles of two would need 65536 blocks a row.
  const ShapeBucket huge = indexerScoresShape(deepSeekIndexer(1, 1 << 23));
  EXPECT_EQ(rejection(kernel, huge, {{"tiles_per_block", 2}}),
            "tiles_per_block 2 needs 65536 blocks a row, the grid holds 65535");
  EXPECT_EQ(rejection(kernel, huge, {{"tiles_per_block", 4}}), "(admitted)");
  // fp32 keys run on CUDA cores: only the default.
  kc::IndexerParams f32 = deepSeekIndexer(8, 8192);
  f32.keyType = kc::IndexKeyType::F32;
  const ShapeBucket cudaCores = indexerScoresShape(f32);
  EXPECT_EQ(cudaCores.at("score_form"), 0);
  EXPECT_EQ(validValues(kernel, cudaCores, "tiles_per_block"), (std::vector<int64_t>{0}));
  // Which tensor-core kernel runs is part of the bucket: pages of 32 tokens take the bf16 form.
  kc::IndexerParams pages32 = deepSeekIndexer(8, 8192);
  pages32.pageTokens = 32;
  EXPECT_EQ(indexerScoresShape(pages32).at("score_form"), 1);
}

TEST(KernelTuning, SparseMlaSplitsFitTheKernelsBlocks) {
  const TunableKernel &kernel = sparseMlaDecodeKernel();
  static const int32_t indices = 0;
  kc::SparseMlaDecodeParams p;
  p.rows = 5;
  p.heads = 128;
  p.latentDim = 512;
  p.ropeDim = 64;
  p.topK = 2048;
  p.indices = &indices;
  const ShapeBucket shape = sparseMlaDecodeShape(p);
  EXPECT_EQ(shape, (ShapeBucket{{"rows", 8}, {"heads", 128}, {"latent_dim", 512},
                                {"rope_dim", 64}, {"top_k", 2048}, {"causal", 0}}));
  // 2048 positions are 32 tiles of 64; 12 splits of 3 tiles launch as 11, 24 of 2 as 16.
  EXPECT_EQ(validValues(kernel, shape, "splits"),
            (std::vector<int64_t>{0, 1, 2, 3, 4, 6, 8, 16, 32}));
  EXPECT_EQ(rejection(kernel, shape, {{"splits", 12}}), "splits 12 launch as splits 11 (3 tiles each)");
  // 16 heads take tiles of 64 too: 4096 positions are 64 tiles, at most 32 (2048 positions) a block.
  p.heads = 16;
  p.topK = 4096;
  p.indices = nullptr; // causal
  const ShapeBucket narrow = sparseMlaDecodeShape(p);
  EXPECT_EQ(narrow.at("causal"), 1);
  EXPECT_EQ(rejection(kernel, narrow, {{"splits", 1}}),
            "splits 1 leave 4096 positions a block, at most 2048 fit");
  EXPECT_EQ(rejection(kernel, narrow, {{"splits", 2}}), "(admitted)");
  p.topK = 100; // 2 tiles of 64
  EXPECT_EQ(rejection(kernel, sparseMlaDecodeShape(p), {{"splits", 6}}),
            "splits 6 > the row's 2 tiles of 64 positions");
  // A decode step of at most 4 rows may split a row over up to 128 blocks (Kimi's dense layers
  // at 8K positions, batch 1); 5-8 rows up to 32.
  p.rows = 1;
  p.heads = 32;
  p.topK = 8192; // 128 tiles
  EXPECT_EQ(validValues(kernel, sparseMlaDecodeShape(p), "splits"),
            (std::vector<int64_t>{0, 4, 6, 8, 12, 16, 32, 64, 128}));
  p.rows = 8;
  EXPECT_EQ(rejection(kernel, sparseMlaDecodeShape(p), {{"splits", 64}}),
            "splits 64 > the 32 a launch of 8 rows takes");
}

kc::MoeExpertsParams moeStep(int32_t tokens, int32_t topK, int32_t hidden, int32_t intermediate,
                             kc::WeightType type = kc::WeightType::BF16) {
  kc::MoeExpertsParams p;
  p.tokens = tokens;
  p.topK = topK;
  p.experts = 256;
  p.hidden = hidden;
  p.intermediate = intermediate;
  p.type = type;
  return p;
}

// Kimi-Linear-48B's experts: 256 of 2304 x 1024, top 8.
kc::MoeExpertsParams kimiMoe(int32_t tokens) { return moeStep(tokens, 8, 2304, 1024); }

TEST(KernelTuning, MoeThresholdsMeasureEachFormOnceABucket) {
  const TunableKernel &kernel = moeExpertsKernel();
  EXPECT_EQ(kernel.defaults(), (TuningConfig{{"per_token_max_pairs", 0}}));
  const ShapeBucket five = moeExpertsShape(kimiMoe(5));
  EXPECT_EQ(five, (ShapeBucket{{"tokens", 8}, {"top_k", 8}, {"experts", 256}, {"hidden", 2304},
                               {"intermediate", 1024}, {"weight_type", 1}}));
  // One token's 8 pairs run per token by default (at most 64): only a threshold below 8, the
  // largest of them, is worth measuring.
  const ShapeBucket one = moeExpertsShape(kimiMoe(1));
  EXPECT_EQ(validValues(kernel, one, "per_token_max_pairs"), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(rejection(kernel, one, {{"per_token_max_pairs", 2}}),
            "per_token_max_pairs 2 launches as per_token_max_pairs 4 (grouped) at 8..8 pairs");
  EXPECT_EQ(rejection(kernel, one, {{"per_token_max_pairs", 512}}),
            "per_token_max_pairs 512 runs the default's form (per token) at 8..8 pairs");
  // Batches of 5..8 tokens (40..64 pairs): per token by default, grouped below 40.
  EXPECT_EQ(validValues(kernel, five, "per_token_max_pairs"), (std::vector<int64_t>{0, 32}));
  // 9..16 tokens (72..128 pairs) and up are grouped by default: the smallest threshold that runs
  // the whole bucket per token is the other candidate, while one exists (512 pairs at most).
  EXPECT_EQ(validValues(kernel, moeExpertsShape(kimiMoe(16)), "per_token_max_pairs"),
            (std::vector<int64_t>{0, 128}));
  EXPECT_EQ(validValues(kernel, moeExpertsShape(kimiMoe(64)), "per_token_max_pairs"),
            (std::vector<int64_t>{0, 512}));
  EXPECT_EQ(validValues(kernel, moeExpertsShape(kimiMoe(128)), "per_token_max_pairs"),
            (std::vector<int64_t>{0}));
  EXPECT_EQ(rejection(kernel, moeExpertsShape(kimiMoe(16)), {{"per_token_max_pairs", 64}}),
            "per_token_max_pairs 64 runs the default's form (grouped) at 72..128 pairs");
  // Top 6 of 9..16 tokens (54..96 pairs): the default 64 runs both forms; so does 64 as a
  // configuration, which is refused, while 32 (all grouped) and 128 (all per token) are not.
  const ShapeBucket topSix = moeExpertsShape(moeStep(16, 6, 2304, 1024));
  EXPECT_EQ(validValues(kernel, topSix, "per_token_max_pairs"),
            (std::vector<int64_t>{0, 32, 128}));
  EXPECT_EQ(rejection(kernel, topSix, {{"per_token_max_pairs", 64}}),
            "per_token_max_pairs 64 splits the bucket's launches of 54..96 pairs between the forms");
  // DeepSeek-V3.2's experts (7168 x 2048): bf16 ones tune like Kimi's; its FP8 experts have no
  // tensor-core form, so the threshold changes nothing there.
  EXPECT_EQ(validValues(kernel, moeExpertsShape(moeStep(8, 8, 7168, 2048)), "per_token_max_pairs"),
            (std::vector<int64_t>{0, 32}));
  const ShapeBucket fp8 =
      moeExpertsShape(moeStep(64, 8, 7168, 2048, kc::WeightType::Fp8Block));
  EXPECT_EQ(fp8.at("weight_type"), 2);
  EXPECT_EQ(validValues(kernel, fp8, "per_token_max_pairs"), (std::vector<int64_t>{0}));
  EXPECT_EQ(rejection(kernel, fp8, {{"per_token_max_pairs", 512}}),
            "per_token_max_pairs 512: only the per-token form runs here (the grouped form takes "
            "bf16 experts, hidden and intermediate multiples of 64)");
  // Every admitted threshold is one the runtime sized its workspaces for.
  for (int32_t tokens : {1, 2, 8, 16, 32, 64, 128, 1024})
    for (const TuningConfig &config :
         cache::enumerateCandidates(kernel, moeExpertsShape(kimiMoe(tokens))).valid)
      EXPECT_LE(config.at("per_token_max_pairs"), kc::kMoeTunedMaxPairs);
}

TEST(KernelTuning, KdaDecodePathsOtherThanTheDefaults) {
  const TunableKernel &kernel = kdaDecodeKernel();
  EXPECT_EQ(kernel.defaults(), (TuningConfig{{"path", 0}}));
  // Kimi-Linear-48B's KDA layers: 32 heads of 128.
  auto kimi = [](int32_t batch, int32_t headDim = 128) {
    kc::KdaDecodeParams p;
    p.batch = batch;
    p.heads = 32;
    p.headDim = headDim;
    return kdaDecodeShape(p);
  };
  EXPECT_EQ(kimi(5), (ShapeBucket{{"batch", 8}, {"heads", 32}, {"head_dim", 128},
                                  {"state_type", 0}}));
  // Up to 4095 (sequence, head) pairs the default is fused: the split path is the candidate.
  for (int32_t batch : {1, 8, 64}) {
    EXPECT_EQ(validValues(kernel, kimi(batch), "path"), (std::vector<int64_t>{0, 2})) << batch;
  }
  EXPECT_EQ(rejection(kernel, kimi(64), {{"path", 1}}),
            "path 1 (fused) is the default's at 33..64 x 32 (sequence, head) pairs");
  // 65..128 sequences straddle the default's 4096 pairs: both paths; from 129 on it splits.
  EXPECT_EQ(validValues(kernel, kimi(128), "path"), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(validValues(kernel, kimi(256), "path"), (std::vector<int64_t>{0, 1}));
  // head_dim 64 is always fused by default; other head sizes have no decode kernel to choose.
  EXPECT_EQ(validValues(kernel, kimi(256, 64), "path"), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(rejection(kernel, kimi(8, 96), {{"path", 2}}),
            "the decode kernels take head_dim 64 or 128, not 96");
}

TEST(KernelTuning, ConfigurationsSetTheLaunchParams) {
  kc::IndexerParams indexer;
  applyConfig({}, indexer);
  EXPECT_EQ(indexer.tilesPerBlock, 0) << "no configuration: the kernel's default";
  TuningConfig tiles;
  tiles["tiles_per_block"] = 32;
  applyConfig(tiles, indexer);
  EXPECT_EQ(indexer.tilesPerBlock, 32);
  kc::SparseMlaDecodeParams mla;
  applyConfig({}, mla);
  EXPECT_EQ(mla.splits, 0);
  TuningConfig splits;
  splits["splits"] = 6;
  applyConfig(splits, mla);
  EXPECT_EQ(mla.splits, 6);
  kc::MoeExpertsParams moe = kimiMoe(8);
  applyConfig({}, moe);
  EXPECT_EQ(moe.perTokenMaxPairs, 0);
  EXPECT_EQ(kc::moePerTokenMaxPairs(moe), 64) << "0: the default threshold";
  applyConfig({{"per_token_max_pairs", 32}}, moe);
  EXPECT_EQ(moe.perTokenMaxPairs, 32);
  EXPECT_EQ(kc::moePerTokenMaxPairs(moe), 32);
  kc::KdaDecodeParams kda;
  kda.batch = 8;
  kda.heads = 32;
  kda.headDim = 128;
  applyConfig({}, kda);
  EXPECT_EQ(kda.path, kc::KdaDecodePath::Auto);
  EXPECT_FALSE(kc::kdaDecodeUsesSplit(kda.path, kda.batch, kda.heads, kda.headDim));
  applyConfig({{"path", 2}}, kda);
  EXPECT_EQ(kda.path, kc::KdaDecodePath::Split);
  EXPECT_TRUE(kc::kdaDecodeUsesSplit(kda.path, kda.batch, kda.heads, kda.headDim));
}

TEST(KernelTuning, RequestsParseAndBucketAsTheRuntimeDoes) {
  auto request = parseRequest("sparse-mla-decode",
                              "rows=50,heads=128,latent_dim=512,rope_dim=64,top_k=2000,causal=0");
  ASSERT_TRUE(request.isOk()) << request.status().message();
  EXPECT_EQ(request->kernel, &sparseMlaDecodeKernel());
  EXPECT_EQ(request->shape.at("rows"), 64);
  EXPECT_EQ(request->shape.at("top_k"), 2048);
  auto indexer = parseRequest(
      "dsa-indexer-scores", "rows=1,heads=64,head_dim=128,max_keys=100000,key_type=1,score_form=3");
  ASSERT_TRUE(indexer.isOk()) << indexer.status().message();
  EXPECT_EQ(indexer->shape, indexerScoresShape(deepSeekIndexer(1, 100000)));

  auto error = [](std::string_view kernel, std::string_view shape) {
    auto parsed = parseRequest(kernel, shape);
    return parsed.isOk() ? std::string("ok") : parsed.status().message();
  };
  EXPECT_EQ(error("gemm", "rows=1"),
            "unknown tunable kernel 'gemm' (known: dsa-indexer-scores, sparse-mla-decode, "
            "moe-experts, kda-decode)");
  EXPECT_EQ(error("sparse-mla-decode", "rows=1,heads=128"),
            "sparse-mla-decode shape: 'rows=1,heads=128' has no 'latent_dim'");
  EXPECT_EQ(error("sparse-mla-decode", "rows=1,tiles=4"), "sparse-mla-decode shape: no dimension 'tiles'");
  EXPECT_EQ(error("sparse-mla-decode", "rows=many"),
            "sparse-mla-decode shape: 'rows=many' is not dimension=integer");
  EXPECT_EQ(error("dsa-indexer-scores",
                  "rows=1,heads=64,head_dim=128,max_keys=8,key_type=7,score_form=3"),
            "dsa-indexer-scores shape: key_type 7 is none of 0 (fp8 per key), 1 (mxfp8), 2 (f32)");
  auto moe = parseRequest("moe-experts",
                          "tokens=5,top_k=8,experts=256,hidden=2304,intermediate=1024,weight_type=1");
  ASSERT_TRUE(moe.isOk()) << moe.status().message();
  EXPECT_EQ(moe->kernel, &moeExpertsKernel());
  EXPECT_EQ(moe->shape, moeExpertsShape(kimiMoe(5)));
  EXPECT_EQ(error("moe-experts",
                  "tokens=5,top_k=8,experts=256,hidden=2304,intermediate=1024,weight_type=7"),
            "moe-experts shape: weight_type 7 is none of 0 (f32), 1 (bf16), 2 (fp8 with block "
            "scales)");
  auto kda = parseRequest("kda-decode", "batch=40,heads=32,head_dim=128,state_type=1");
  ASSERT_TRUE(kda.isOk()) << kda.status().message();
  EXPECT_EQ(kda->shape, (ShapeBucket{{"batch", 64}, {"heads", 32}, {"head_dim", 128},
                                     {"state_type", 1}}));
  EXPECT_EQ(error("kda-decode", "batch=1,heads=32,head_dim=128,state_type=2"),
            "kda-decode shape: state_type 2 is none of 0 (f32), 1 (bf16)");

  // The presets: each family's buckets at the model's shapes.
  auto count = [](const std::vector<TuneRequest> &requests, std::string_view kernel) {
    return std::count_if(requests.begin(), requests.end(),
                         [&](const TuneRequest &r) { return r.kernel->name == kernel; });
  };
  auto presets = presetRequests("deepseek-v32");
  ASSERT_TRUE(presets.isOk());
  EXPECT_EQ(presets->size(), 20u);
  EXPECT_EQ(count(*presets, kIndexerScores), 9);
  EXPECT_EQ(count(*presets, kSparseMlaDecode), 6);
  EXPECT_EQ(count(*presets, kMoeExperts), 5);
  for (const TuneRequest &request : *presets)
    if (request.kernel == &moeExpertsKernel()) {
      EXPECT_EQ(request.shape.at("hidden"), 7168);
      EXPECT_EQ(request.shape.at("intermediate"), 2048);
      EXPECT_EQ(request.shape.at("experts"), 256);
      EXPECT_EQ(request.shape.at("top_k"), 8);
      EXPECT_EQ(request.shape.at("weight_type"), 1);
    }
  auto kimi = presetRequests("kimi-linear-48b");
  ASSERT_TRUE(kimi.isOk());
  EXPECT_EQ(kimi->size(), 14u);
  EXPECT_EQ(count(*kimi, kSparseMlaDecode), 6);
  EXPECT_EQ(count(*kimi, kMoeExperts), 5);
  EXPECT_EQ(count(*kimi, kKdaDecode), 3);
  std::vector<ShapeBucket> moeShapes, kdaShapes;
  for (const TuneRequest &request : *kimi) {
    if (request.kernel == &moeExpertsKernel())
      moeShapes.push_back(request.shape);
    if (request.kernel == &kdaDecodeKernel())
      kdaShapes.push_back(request.shape);
  }
  EXPECT_EQ(moeShapes.front(), moeExpertsShape(kimiMoe(1)));
  EXPECT_EQ(moeShapes.back(), moeExpertsShape(kimiMoe(64)));
  EXPECT_EQ(kdaShapes.back(), (ShapeBucket{{"batch", 64}, {"heads", 32}, {"head_dim", 128},
                                           {"state_type", 0}}));
  // Every preset bucket has a candidate besides the defaults: none is measured for nothing.
  for (const auto *requests : {&*presets, &*kimi})
    for (const TuneRequest &request : *requests)
      EXPECT_GE(cache::enumerateCandidates(*request.kernel, request.shape).valid.size(), 2u)
          << request.kernel->name << " " << formatShape(request.shape);
  EXPECT_EQ(presetRequests("llama").status().message(),
            "unknown preset 'llama' (known: deepseek-v32, kimi-linear-48b)");
}

class TunerTest : public testing::Test {
protected:
  void SetUp() override {
    std::string pattern = (fs::path(testing::TempDir()) / "hybrid_tuner_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << pattern;
    root_ = pattern;
    auto store = cache::CacheStore::open(root_);
    ASSERT_TRUE(store.isOk()) << store.status().message();
    store_.emplace(std::move(store).value());
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  // A synthetic GPU: splits s takes 100 / (1 + s / 8) us except that 32 splits give another
  // output; every measurement advances a fake clock by one second.
  MeasureFn fakeMeasure() {
    return [this](const TunableKernel &, const ShapeBucket &, const std::vector<TuningConfig> &configs,
                  Clock::time_point deadline) -> StatusOr<std::vector<CandidateTiming>> {
      ++measureCalls_;
      std::vector<CandidateTiming> timings;
      for (const TuningConfig &config : configs) {
        if (now_ >= deadline)
          break;
        now_ += std::chrono::seconds(1);
        const int64_t splits = config.at("splits");
        timings.push_back({.microseconds = 100.0 / (1.0 + double(splits) / 8),
                           .mismatch = splits == 32 ? "relative RMS 0.5" : ""});
      }
      return timings;
    };
  }
  TuneOptions options(double budget) {
    TuneOptions o;
    o.budgetSeconds = budget;
    o.now = [this] { return now_; };
    return o;
  }
  static TuneRequest mlaRequest(int64_t rows) {
    auto request = parseRequest("sparse-mla-decode",
                                "rows=" + std::to_string(rows) +
                                    ",heads=128,latent_dim=512,rope_dim=64,top_k=2048,causal=0");
    EXPECT_TRUE(request.isOk());
    return *request;
  }

  std::string root_;
  std::optional<cache::CacheStore> store_;
  Clock::time_point now_{};
  int measureCalls_ = 0;
};

TEST_F(TunerTest, StoresTheFastestMatchingCandidateAndReusesIt) {
  const std::vector<TuneRequest> requests{mlaRequest(1)};
  const TuneReport first = tune(*store_, kH200, requests, fakeMeasure(), options(600));
  ASSERT_EQ(first.outcomes.size(), 1u);
  const TuneOutcome &tuned = first.outcomes[0];
  EXPECT_EQ(tuned.state, TuneOutcome::State::Tuned) << tuned.note;
  // 32 splits would be fastest but its output differs: 16 wins.
  EXPECT_EQ(tuned.result.config, (TuningConfig{{"splits", 16}}));
  EXPECT_DOUBLE_EQ(tuned.result.microseconds, 100.0 / 3);
  EXPECT_DOUBLE_EQ(tuned.result.defaultMicroseconds, 100.0);
  EXPECT_EQ(tuned.result.candidates, 9); // the defaults and the 8 other admitted splits
  EXPECT_EQ(tuned.rejected, 6); // 12 and 24 launch as others; 48 to 128 exceed the 32 tiles
  EXPECT_EQ(tuned.mismatched, 1);
  EXPECT_DOUBLE_EQ(tuned.result.tuningSeconds, 9.0);
  EXPECT_EQ(first.tuned, 1);
  EXPECT_EQ(measureCalls_, 1);
  const std::string table = formatTuneReport(first, kH200);
  EXPECT_NE(table.find("tuning on NVIDIA H200, 132 SMs, driver 13000, cuda 13.0 sm_90"),
            std::string::npos) << table;
  EXPECT_NE(table.find("splits=16"), std::string::npos) << table;
  EXPECT_NE(table.find("3.000x"), std::string::npos) << table;
  EXPECT_NE(table.find("1 tuned, 0 reused from the cache, 0 left for lack of budget, 0 failed"),
            std::string::npos) << table;

  // The second run (a second compile or load on this GPU) reuses the entry: nothing measured.
  const TuneReport second = tune(*store_, kH200, requests, fakeMeasure(), options(600));
  EXPECT_EQ(second.outcomes[0].state, TuneOutcome::State::Cached);
  EXPECT_EQ(second.outcomes[0].result.config, (TuningConfig{{"splits", 16}}));
  EXPECT_EQ(measureCalls_, 1);
  // --retune measures again; another GPU has no entry.
  TuneOptions retune = options(600);
  retune.retune = true;
  EXPECT_EQ(tune(*store_, kH200, requests, fakeMeasure(), retune).tuned, 1);
  cache::TuningDevice h100 = kH200;
  h100.gpu = "NVIDIA H100 80GB HBM3";
  EXPECT_EQ(tune(*store_, h100, requests, fakeMeasure(), options(600)).tuned, 1);
  EXPECT_EQ(measureCalls_, 3);
}

TEST_F(TunerTest, DefaultsStayWithinTheNoiseMargin) {
  // Every candidate within 1% of the defaults: the defaults are stored as the result.
  MeasureFn flat = [](const TunableKernel &, const ShapeBucket &,
                      const std::vector<TuningConfig> &configs,
                      Clock::time_point) -> StatusOr<std::vector<CandidateTiming>> {
    std::vector<CandidateTiming> timings;
    for (size_t i = 0; i < configs.size(); ++i)
      timings.push_back({.microseconds = i == 0 ? 100.0 : 99.0, .mismatch = ""});
    return timings;
  };
  const TuneReport report = tune(*store_, kH200, {mlaRequest(8)}, flat, options(600));
  EXPECT_EQ(report.outcomes[0].state, TuneOutcome::State::Tuned);
  EXPECT_EQ(report.outcomes[0].result.config, (TuningConfig{{"splits", 0}}));
  EXPECT_DOUBLE_EQ(report.outcomes[0].result.microseconds, 100.0);
}

TEST_F(TunerTest, TheBudgetBoundsTheSearchAndALaterRunResumes) {
  const std::vector<TuneRequest> requests{mlaRequest(1), mlaRequest(8), mlaRequest(64)};
  // 9 candidates a bucket at one fake second each: 12 seconds finish one bucket only.
  const TuneReport first = tune(*store_, kH200, requests, fakeMeasure(), options(12));
  EXPECT_EQ(first.outcomes[0].state, TuneOutcome::State::Tuned);
  EXPECT_EQ(first.outcomes[1].state, TuneOutcome::State::OutOfBudget);
  EXPECT_EQ(first.outcomes[1].note, "budget spent after 3 of 9 candidates; not stored");
  EXPECT_EQ(first.outcomes[2].state, TuneOutcome::State::OutOfBudget);
  EXPECT_EQ(first.outcomes[2].note, "budget spent before it started");
  EXPECT_EQ(first.tuned, 1);
  EXPECT_EQ(first.outOfBudget, 2);
  EXPECT_DOUBLE_EQ(first.seconds, 12.0);
  const TuneReport second = tune(*store_, kH200, requests, fakeMeasure(), options(600));
  EXPECT_EQ(second.cached, 1);
  EXPECT_EQ(second.tuned, 2);
}

TEST_F(TunerTest, ADefaultThatCannotRunFailsTheBucket) {
  MeasureFn broken = [](const TunableKernel &, const ShapeBucket &,
                        const std::vector<TuningConfig> &,
                        Clock::time_point) -> StatusOr<std::vector<CandidateTiming>> {
    return Status::error("the defaults: launch failed: invalid argument");
  };
  const TuneReport report = tune(*store_, kH200, {mlaRequest(1)}, broken, options(600));
  EXPECT_EQ(report.outcomes[0].state, TuneOutcome::State::Failed);
  EXPECT_EQ(report.outcomes[0].note, "the defaults: launch failed: invalid argument");
  EXPECT_EQ(report.failed, 1);
  EXPECT_FALSE(fs::exists(store_->pathFor(
      cache::tuningKey(sparseMlaDecodeKernel(), mlaRequest(1).shape, kH200))));
}

// What the cuda device does at each launch: the stored configuration of its bucket, for this
// GPU only, read once.
TEST_F(TunerTest, TheRuntimeTableFindsStoredConfigurationsForThisGpuOnly) {
  const TuneRequest request = mlaRequest(8);
  const cache::CacheKey key = cache::tuningKey(sparseMlaDecodeKernel(), request.shape, kH200);
  ASSERT_TRUE(cache::storeTuning(*store_, key,
                                 {.config = {{"splits", 6}},
                                  .microseconds = 40,
                                  .defaultMicroseconds = 50,
                                  .candidates = 9,
                                  .tuningSeconds = 2})
                  .isOk());
  auto reopened = cache::CacheStore::open(root_);
  ASSERT_TRUE(reopened.isOk());
  TuningTable table(std::move(*reopened), kH200);
  // A launch of 5 rows is in the 8 bucket.
  static const int32_t indices = 0;
  kc::SparseMlaDecodeParams p;
  p.rows = 5;
  p.heads = 128;
  p.latentDim = 512;
  p.ropeDim = 64;
  p.topK = 2048;
  p.indices = &indices;
  auto config = table.lookup(sparseMlaDecodeKernel(), sparseMlaDecodeShape(p));
  ASSERT_TRUE(config.has_value());
  applyConfig(*config, p);
  EXPECT_EQ(p.splits, 6);
  // Remembered: the entry is not read again.
  fs::remove(store_->pathFor(key));
  EXPECT_EQ(table.lookup(sparseMlaDecodeKernel(), sparseMlaDecodeShape(p)),
            (std::optional<TuningConfig>(TuningConfig{{"splits", 6}})));
  // Another bucket: the defaults.
  p.rows = 64;
  EXPECT_FALSE(table.lookup(sparseMlaDecodeKernel(), sparseMlaDecodeShape(p)).has_value());
  const std::string report = table.report();
  EXPECT_NE(report.find("rows=8,top_k=2048: splits=6 (tuned: 40.00 us against 50.00 us by default)"),
            std::string::npos) << report;
  EXPECT_NE(report.find("rows=64,top_k=2048: defaults: not tuned"), std::string::npos) << report;

  // The same entry is not this GPU's on another driver.
  ASSERT_TRUE(cache::storeTuning(*store_, key,
                                 {.config = {{"splits", 6}},
                                  .microseconds = 40,
                                  .defaultMicroseconds = 50,
                                  .candidates = 9,
                                  .tuningSeconds = 2})
                  .isOk());
  cache::TuningDevice newerDriver = kH200;
  newerDriver.driverVersion = 13010;
  auto store = cache::CacheStore::open(root_);
  ASSERT_TRUE(store.isOk());
  TuningTable other(std::move(*store), newerDriver);
  p.rows = 8;
  EXPECT_FALSE(other.lookup(sparseMlaDecodeKernel(), sparseMlaDecodeShape(p)).has_value());
  // No store: defaults, nothing looked up.
  TuningTable none;
  EXPECT_FALSE(none.enabled());
  EXPECT_FALSE(none.lookup(sparseMlaDecodeKernel(), sparseMlaDecodeShape(p)).has_value());
}

// A stored configuration its bucket's constraint no longer admits is not run.
TEST_F(TunerTest, AStoredConfigurationTheConstraintRefusesRunsTheDefaults) {
  const TuneRequest request = mlaRequest(8);
  const cache::CacheKey key = cache::tuningKey(sparseMlaDecodeKernel(), request.shape, kH200);
  ASSERT_TRUE(cache::storeTuning(*store_, key,
                                 {.config = {{"splits", 12}},
                                  .microseconds = 1,
                                  .defaultMicroseconds = 2,
                                  .candidates = 3,
                                  .tuningSeconds = 1})
                  .isOk());
  auto reopened = cache::CacheStore::open(root_);
  ASSERT_TRUE(reopened.isOk());
  TuningTable table(std::move(*reopened), kH200);
  EXPECT_FALSE(table.lookup(sparseMlaDecodeKernel(), request.shape).has_value());
  EXPECT_NE(table.report().find("defaults: the stored configuration is no longer valid: splits 12 "
                                "launch as splits 11"),
            std::string::npos)
      << table.report();
}

} // namespace
} // namespace hybrid::kernels::tuning
