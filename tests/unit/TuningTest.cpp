// Kernel tuning results in the cache (Tuning.h): candidates filtered by a kernel's constraint,
// keys that change with every field that can change the best configuration, and results stored,
// found again and refused once the kernel's parameter space no longer admits them.
#include "hybrid/cache/Tuning.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <stdlib.h>

namespace hybrid::cache {
namespace {

namespace fs = std::filesystem;

// A kernel like the sparse MLA decode: splits of the positions and heads per block, the heads
// per block limited by the shape's heads.
TunableKernel sparseMlaLike() {
  TunableKernel kernel;
  kernel.name = "sparse-mla-decode";
  kernel.parameters = {{"splits", {1, 4, 16}, 4}, {"heads_per_block", {16, 32, 64}, 16}};
  kernel.constraint = [](const TuningConfig &config,
                         const ShapeBucket &shape) -> std::optional<std::string> {
    if (config.at("heads_per_block") > shape.at("heads"))
      return "heads_per_block " + std::to_string(config.at("heads_per_block")) + " > heads " +
             std::to_string(shape.at("heads"));
    return std::nullopt;
  };
  return kernel;
}

const TuningDevice kH200{"NVIDIA H200", 132, 13000, "cuda 13.0"};

TEST(Tuning, BucketsRoundUpToPowersOfTwo) {
  EXPECT_EQ(bucketSize(0), 1);
  EXPECT_EQ(bucketSize(1), 1);
  EXPECT_EQ(bucketSize(3), 4);
  EXPECT_EQ(bucketSize(64), 64);
  EXPECT_EQ(bucketSize(65), 128);
  EXPECT_EQ(bucketSize(131072), 131072);
}

TEST(Tuning, CandidatesAreEveryCombinationTheConstraintAdmits) {
  const TunableKernel kernel = sparseMlaLike();
  EXPECT_EQ(kernel.defaults(), (TuningConfig{{"heads_per_block", 16}, {"splits", 4}}));
  const CandidateSet wide = enumerateCandidates(kernel, {{"heads", 128}, {"rows", 1}});
  EXPECT_EQ(wide.valid.size(), 9u);
  EXPECT_TRUE(wide.rejected.empty());
  EXPECT_EQ(wide.valid.front(), (TuningConfig{{"heads_per_block", 16}, {"splits", 1}}));
  EXPECT_EQ(wide.valid.back(), (TuningConfig{{"heads_per_block", 64}, {"splits", 16}}));
  const CandidateSet narrow = enumerateCandidates(kernel, {{"heads", 16}, {"rows", 1}});
  EXPECT_EQ(narrow.valid.size(), 3u); // heads_per_block 16 only
  ASSERT_EQ(narrow.rejected.size(), 6u);
  EXPECT_EQ(narrow.rejected.front().second, "heads_per_block 32 > heads 16");
  for (const TuningConfig &config : narrow.valid)
    EXPECT_EQ(config.at("heads_per_block"), 16);
}

TEST(Tuning, KeysChangeWithEveryFieldThatMatters) {
  const TunableKernel kernel = sparseMlaLike();
  const ShapeBucket shape{{"heads", 128}, {"rows", bucketSize(50)}};
  std::string text;
  const CacheKey key = tuningKey(kernel, shape, kH200, &text);
  EXPECT_EQ(tuningKey(kernel, {{"heads", 128}, {"rows", bucketSize(60)}}, kH200), key)
      << "50 and 60 rows share the 64 bucket";
  EXPECT_NE(text.find("kernel=\"sparse-mla-decode\""), std::string::npos) << text;
  EXPECT_NE(text.find("parameter.splits=\"1,4,16\""), std::string::npos) << text;
  EXPECT_NE(text.find("gpu=\"NVIDIA H200\""), std::string::npos) << text;

  TunableKernel renamed = kernel;
  renamed.name = "sparse-mla-prefill";
  TunableKernel widened = kernel;
  widened.parameters[0].values.push_back(32);
  TunableKernel rewritten = kernel; // the same family, its kernel sources changed
  rewritten.revision = "0123456789abcdef";
  TuningDevice otherGpu = kH200, fewerSms = kH200, otherDriver = kH200, otherCompiler = kH200;
  otherGpu.gpu = "NVIDIA H100 80GB HBM3";
  fewerSms.smCount = 114;
  otherDriver.driverVersion = 12080;
  otherCompiler.compiler = "cuda 12.8";
  for (const CacheKey &other :
       {tuningKey(renamed, shape, kH200), tuningKey(widened, shape, kH200),
        tuningKey(rewritten, shape, kH200),
        tuningKey(kernel, {{"heads", 16}, {"rows", 64}}, kH200),
        tuningKey(kernel, {{"heads", 128}, {"rows", 128}}, kH200),
        tuningKey(kernel, shape, otherGpu), tuningKey(kernel, shape, fewerSms),
        tuningKey(kernel, shape, otherDriver), tuningKey(kernel, shape, otherCompiler)})
    EXPECT_NE(other, key);
}

class TuningStoreTest : public testing::Test {
protected:
  void SetUp() override {
    std::string pattern = (fs::path(testing::TempDir()) / "hybrid_tuning_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << pattern;
    root_ = pattern;
    auto store = CacheStore::open(root_);
    ASSERT_TRUE(store.isOk()) << store.status().message();
    store_.emplace(std::move(store).value());
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }
  std::string root_;
  std::optional<CacheStore> store_;
};

TEST_F(TuningStoreTest, StoredResultsAreFoundAgain) {
  const TunableKernel kernel = sparseMlaLike();
  const CacheKey key = tuningKey(kernel, {{"heads", 128}, {"rows", 64}}, kH200);
  auto miss = lookupTuning(*store_, key, kernel);
  ASSERT_TRUE(miss.isOk()) << miss.status().message();
  EXPECT_FALSE(miss->has_value());

  const TuningResult result{{{"heads_per_block", 32}, {"splits", 16}}, 40.25, 47.5, 9, 1.5};
  ASSERT_TRUE(storeTuning(*store_, key, result).isOk());
  auto hit = lookupTuning(*store_, key, kernel);
  ASSERT_TRUE(hit.isOk()) << hit.status().message();
  ASSERT_TRUE(hit->has_value());
  EXPECT_EQ((*hit)->config, result.config);
  EXPECT_DOUBLE_EQ((*hit)->microseconds, 40.25);
  EXPECT_DOUBLE_EQ((*hit)->defaultMicroseconds, 47.5);
  EXPECT_EQ((*hit)->candidates, 9);
  EXPECT_DOUBLE_EQ((*hit)->tuningSeconds, 1.5);
}

// A stored configuration the kernel's space no longer admits is a miss, removed, with a reason.
TEST_F(TuningStoreTest, ResultsOutsideTheSpaceAreRejected) {
  const TunableKernel kernel = sparseMlaLike();
  const CacheKey key = tuningKey(kernel, {{"heads", 128}, {"rows", 64}}, kH200);
  ASSERT_TRUE(storeTuning(*store_, key, {{{"heads_per_block", 32}, {"splits", 8}}, 1, 2, 3, 4})
                  .isOk());
  std::string why;
  auto rejected = lookupTuning(*store_, key, kernel, &why);
  ASSERT_TRUE(rejected.isOk());
  EXPECT_FALSE(rejected->has_value());
  EXPECT_NE(why.find("splits=8 is not one of its values"), std::string::npos) << why;
  EXPECT_FALSE(fs::exists(store_->pathFor(key)));

  auto decode = [&](const std::string &text) {
    std::vector<std::byte> bytes(text.size());
    std::memcpy(bytes.data(), text.data(), text.size());
    auto result = decodeTuningResult(bytes, kernel);
    return result.isOk() ? std::string("ok") : result.status().message();
  };
  EXPECT_EQ(decode("microseconds=1\nparam.splits=4\nparam.heads_per_block=16\n"), "ok");
  EXPECT_EQ(decode("microseconds=1\nparam.splits=4\n"),
            "tuning result: no value for sparse-mla-decode's parameter 'heads_per_block'");
  EXPECT_EQ(decode("microseconds=1\nparam.tiles=4\n"),
            "tuning result: parameter 'tiles' is not one of sparse-mla-decode's");
  EXPECT_EQ(decode("param.splits=4\nparam.heads_per_block=16\n"), "tuning result: no microseconds");
  EXPECT_EQ(decode("microseconds=fast\n"), "tuning result: microseconds=fast is not a number");
  EXPECT_EQ(decode("garbage\n"), "tuning result: line 'garbage' is not name=value");
}

} // namespace
} // namespace hybrid::cache
