// The kernels' tunable parameters (KernelTuning.h) and the tuner's search (Tuner.h) on the CPU:
// each family's constraint at real shapes, the launch shape buckets the runtime looks up, the
// runtime's table of stored configurations, and the search driven by a synthetic measurement
// (winner, outputs that differ, noise margin, reuse without re-measuring, the budget).
#include "hybrid/kernels/Tuner.h"

#include <gtest/gtest.h>

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
  // 16 heads take tiles of 32: 4096 positions are 128 tiles, at most 64 (2048 positions) a block.
  p.heads = 16;
  p.topK = 4096;
  p.indices = nullptr; // causal
  const ShapeBucket narrow = sparseMlaDecodeShape(p);
  EXPECT_EQ(narrow.at("causal"), 1);
  EXPECT_EQ(rejection(kernel, narrow, {{"splits", 1}}),
            "splits 1 leave 4096 positions a block, at most 2048 fit");
  EXPECT_EQ(rejection(kernel, narrow, {{"splits", 2}}), "(admitted)");
  p.topK = 100; // 4 tiles of 32
  EXPECT_EQ(rejection(kernel, sparseMlaDecodeShape(p), {{"splits", 6}}),
            "splits 6 > the row's 4 tiles of 32 positions");
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
            "unknown tunable kernel 'gemm' (known: dsa-indexer-scores, sparse-mla-decode)");
  EXPECT_EQ(error("sparse-mla-decode", "rows=1,heads=128"),
            "sparse-mla-decode shape: 'rows=1,heads=128' has no 'latent_dim'");
  EXPECT_EQ(error("sparse-mla-decode", "rows=1,tiles=4"), "sparse-mla-decode shape: no dimension 'tiles'");
  EXPECT_EQ(error("sparse-mla-decode", "rows=many"),
            "sparse-mla-decode shape: 'rows=many' is not dimension=integer");
  EXPECT_EQ(error("dsa-indexer-scores",
                  "rows=1,heads=64,head_dim=128,max_keys=8,key_type=7,score_form=3"),
            "dsa-indexer-scores shape: key_type 7 is none of 0 (fp8 per key), 1 (mxfp8), 2 (f32)");
  auto presets = presetRequests("deepseek-v32");
  ASSERT_TRUE(presets.isOk());
  EXPECT_EQ(presets->size(), 15u); // 9 indexer buckets, 6 sparse MLA
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
  EXPECT_EQ(tuned.rejected, 2);
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
