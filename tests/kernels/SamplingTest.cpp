// The reference token choice (Sampling.h) on hand-checkable distributions: greedy ties, the
// inverse-CDF walk in id order, top-k and top-p sets (ties included), temperature's effect on
// the empirical frequencies, NaN / infinity logits, and the parameter checks.
#include "hybrid/kernels/ref/Sampling.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

namespace hybrid::kernels::ref {
namespace {

SamplingParams sampling(float temperature, int32_t topK = 0, float topP = 1.0f) {
  SamplingParams p;
  p.temperature = temperature;
  p.topK = topK;
  p.topP = topP;
  return p;
}

// The ids chosen over a sweep of uniform numbers in [0, 1).
std::set<int64_t> support(const std::vector<float> &logits, const SamplingParams &p) {
  std::set<int64_t> chosen;
  for (int i = 0; i < 1000; ++i)
    chosen.insert(sampleToken(logits, p, float(i) / 1000.0f));
  return chosen;
}

TEST(Sampling, GreedyTakesTheLowestIdAmongTies) {
  const std::vector<float> logits = {1.0f, 3.0f, -2.0f, 3.0f};
  EXPECT_EQ(sampleToken(logits, sampling(0.0f), 0.9f), 1);
  EXPECT_EQ(sampleToken(logits, sampling(0.7f, 1), 0.9f), 1); // top_k = 1 is greedy too
  EXPECT_TRUE(samplingIsGreedy(sampling(0.0f)));
  EXPECT_FALSE(samplingIsGreedy(sampling(1.0f, 2)));
}

TEST(Sampling, InverseCdfWalksTheIdsInOrder) {
  // Probabilities 0.5, 0.25, 0.25 at temperature 1.
  const std::vector<float> logits = {std::log(2.0f), 0.0f, 0.0f};
  const SamplingParams p = sampling(1.0f);
  EXPECT_EQ(sampleToken(logits, p, 0.0f), 0);
  EXPECT_EQ(sampleToken(logits, p, 0.49f), 0);
  EXPECT_EQ(sampleToken(logits, p, 0.51f), 1);
  EXPECT_EQ(sampleToken(logits, p, 0.74f), 1);
  EXPECT_EQ(sampleToken(logits, p, 0.76f), 2);
  EXPECT_EQ(sampleToken(logits, p, 0.9999f), 2);
}

TEST(Sampling, TopKKeepsTheLargestAndTheirTies) {
  const std::vector<float> logits = {0.5f, 2.0f, 1.0f, 1.0f, -1.0f, 3.0f};
  EXPECT_EQ(support(logits, sampling(1.0f, 2)), (std::set<int64_t>{1, 5}));
  // The 3rd largest is 1.0, held by ids 2 and 3: both stay.
  EXPECT_EQ(support(logits, sampling(1.0f, 3)), (std::set<int64_t>{1, 2, 3, 5}));
  EXPECT_EQ(support(logits, sampling(1.0f, 6)).size(), 6u); // k = vocab: everything
}

TEST(Sampling, TopPKeepsTheSmallestMassReachingP) {
  // Probabilities 0.5, 0.3, 0.2 (ids 2, 0, 1).
  const std::vector<float> logits = {std::log(0.3f), std::log(0.2f), std::log(0.5f)};
  EXPECT_EQ(support(logits, sampling(1.0f, 0, 0.45f)), (std::set<int64_t>{2}));
  EXPECT_EQ(support(logits, sampling(1.0f, 0, 0.55f)), (std::set<int64_t>{0, 2}));
  EXPECT_EQ(support(logits, sampling(1.0f, 0, 0.79f)), (std::set<int64_t>{0, 2}));
  EXPECT_EQ(support(logits, sampling(1.0f, 0, 0.81f)), (std::set<int64_t>{0, 1, 2}));
  // Ties at the boundary all stay: four equal tokens, p = 0.3 needs two, keeps four.
  EXPECT_EQ(support({1.0f, 1.0f, 1.0f, 1.0f}, sampling(1.0f, 0, 0.3f)).size(), 4u);
  // top-k first, then top-p within it: k = 2 leaves 0.5 / 0.3 (renormalised 0.625 / 0.375).
  EXPECT_EQ(support(logits, sampling(1.0f, 2, 0.6f)), (std::set<int64_t>{2}));
  EXPECT_EQ(support(logits, sampling(1.0f, 2, 0.7f)), (std::set<int64_t>{0, 2}));
}

TEST(Sampling, TemperatureSharpensAndFlattens) {
  const std::vector<float> logits = {1.0f, 0.0f};
  // P(0) = 1 / (1 + e^(-1/T)): T = 0.25 -> 0.982, T = 1 -> 0.731, T = 4 -> 0.562.
  for (auto [temperature, expected] : {std::pair{0.25f, 0.982f}, {1.0f, 0.731f}, {4.0f, 0.562f}}) {
    int zeros = 0;
    const int draws = 20000;
    for (int i = 0; i < draws; ++i)
      zeros += sampleToken(logits, sampling(temperature), samplingUniform(7, uint64_t(i))) == 0;
    EXPECT_NEAR(double(zeros) / draws, expected, 0.01) << "temperature " << temperature;
  }
}

TEST(Sampling, UniformNumbersAreReproducibleAndSpread) {
  EXPECT_EQ(samplingUniform(42, 3), samplingUniform(42, 3));
  EXPECT_NE(samplingUniform(42, 3), samplingUniform(42, 4));
  EXPECT_NE(samplingUniform(42, 3), samplingUniform(43, 3));
  // Mean and the lowest decile over 100,000 counters (standard errors 0.0009 and 0.0009).
  double sum = 0;
  int lowest = 0;
  const int count = 100000;
  for (uint64_t i = 0; i < uint64_t(count); ++i) {
    const float u = samplingUniform(1, i);
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
    lowest += u < 0.1f;
  }
  EXPECT_NEAR(sum / count, 0.5, 0.005);
  EXPECT_NEAR(double(lowest) / count, 0.1, 0.005);
}

TEST(Sampling, NaNIsNeverChosenAndInfinityAlways) {
  const std::vector<float> withNaN = {NAN, 0.0f, 1.0f, NAN};
  EXPECT_EQ(sampleToken(withNaN, sampling(0.0f), 0.5f), 2);
  EXPECT_EQ(support(withNaN, sampling(1.0f)), (std::set<int64_t>{1, 2}));
  const std::vector<float> withInfinity = {0.0f, INFINITY, 5.0f, INFINITY};
  EXPECT_EQ(sampleToken(withInfinity, sampling(1.0f), 0.9f), 1);
}

TEST(Sampling, ParameterProblemsNameTheField) {
  EXPECT_EQ(samplingParamsProblem(sampling(0.8f, 40, 0.95f)), "");
  EXPECT_NE(samplingParamsProblem(sampling(-1.0f)).find("temperature"), std::string::npos);
  EXPECT_NE(samplingParamsProblem(sampling(NAN)).find("temperature"), std::string::npos);
  EXPECT_NE(samplingParamsProblem(sampling(1.0f, -2)).find("top_k"), std::string::npos);
  EXPECT_NE(samplingParamsProblem(sampling(1.0f, 0, 0.0f)).find("top_p"), std::string::npos);
  EXPECT_NE(samplingParamsProblem(sampling(1.0f, 0, 1.5f)).find("top_p"), std::string::npos);
}

} // namespace
} // namespace hybrid::kernels::ref
