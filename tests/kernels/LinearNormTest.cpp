#include "TestUtil.h"
#include "hybrid/kernels/ref/Linear.h"
#include "hybrid/kernels/ref/Norm.h"

#include <gtest/gtest.h>

namespace hybrid::kernels::ref {
namespace {

using testing::maxAbsDiff;
using testing::randomNormal;

TEST(Linear, MultipliesByTransposedWeight) {
  // x [2, 3], W [2 out, 3 in]
  const std::vector<float> x = {1, 2, 3, -1, 0, 1};
  const std::vector<float> w = {1, 0, 0, 1, 1, 1};
  std::vector<float> y(4);
  linear(x, w, y, 2, 3, 2);
  EXPECT_EQ(y, (std::vector<float>{1, 6, -1, 0}));
}

TEST(Linear, MatchesNaiveLoopOnLargeShapes) {
  std::mt19937 rng(1);
  const int64_t rows = 7, in = 301, out = 257;
  const auto x = randomNormal(rng, rows * in);
  const auto w = randomNormal(rng, out * in);
  std::vector<float> y(rows * out), expected(rows * out);
  linear(x, w, y, rows, in, out);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < in; ++i)
        acc += double(x[r * in + i]) * w[o * in + i];
      expected[r * out + o] = float(acc);
    }
  EXPECT_LE(maxAbsDiff(y, expected), 2e-4f);
}

TEST(Norm, RmsNormHandCase) {
  // mean(x²) = (9 + 16) / 2 = 12.5
  const std::vector<float> x = {3, 4};
  const std::vector<float> w = {1, 2};
  std::vector<float> y(2);
  rmsNorm(x, w, y, 1, 2, 0.0f);
  const float r = 1.0f / std::sqrt(12.5f);
  EXPECT_FLOAT_EQ(y[0], 3 * r);
  EXPECT_FLOAT_EQ(y[1], 8 * r);
  rmsNorm(x, {}, y, 1, 2, 0.5f); // no weight, eps inside the root
  EXPECT_FLOAT_EQ(y[1], 4 / std::sqrt(13.0f));
}

TEST(Norm, LayerNormWithBias) {
  const std::vector<float> x = {1, 3, 5, 7}; // mean 4, biased variance 5
  const std::vector<float> w = {1, 1, 2, 2};
  const std::vector<float> b = {0, 1, 0, 1};
  std::vector<float> y(4);
  layerNorm(x, w, b, y, 1, 4, 1e-6f);
  const float s = 1.0f / std::sqrt(5.0f + 1e-6f);
  EXPECT_FLOAT_EQ(y[0], -3 * s);
  EXPECT_FLOAT_EQ(y[1], -1 * s + 1);
  EXPECT_FLOAT_EQ(y[2], 2 * s);
  EXPECT_FLOAT_EQ(y[3], 6 * s + 1);
}

TEST(Norm, GatedRmsNormAppliesActivationOfGate) {
  const std::vector<float> x = {3, 4, 0, 2};
  const std::vector<float> gate = {0, 100, -1, 2};
  const std::vector<float> w = {1, 0.5f};
  std::vector<float> sig(4), swish(4);
  gatedRmsNorm(x, gate, w, sig, 2, 2, 0.0f, GateActivation::Sigmoid);
  gatedRmsNorm(x, gate, w, swish, 2, 2, 0.0f, GateActivation::Silu);
  const float r0 = 1.0f / std::sqrt(12.5f), r1 = 1.0f / std::sqrt(2.0f);
  EXPECT_FLOAT_EQ(sig[0], 3 * r0 * 0.5f);
  EXPECT_FLOAT_EQ(sig[1], 0.5f * 4 * r0 * 1.0f);
  EXPECT_FLOAT_EQ(sig[3], 0.5f * 2 * r1 / (1 + std::exp(-2.0f)));
  EXPECT_FLOAT_EQ(swish[3], 0.5f * 2 * r1 * 2 / (1 + std::exp(-2.0f)));
  EXPECT_FLOAT_EQ(swish[0], 0.0f);
}

TEST(Norm, L2NormalizeAddsEpsToSumOfSquares) {
  std::vector<float> x = {3, 4, 0, 0};
  l2NormalizeRows(x, 2, 2, 1e-6f);
  EXPECT_FLOAT_EQ(x[0], 3 / std::sqrt(25 + 1e-6f));
  EXPECT_FLOAT_EQ(x[1], 4 / std::sqrt(25 + 1e-6f));
  EXPECT_EQ(x[2], 0.0f); // zero rows stay finite
}

} // namespace
} // namespace hybrid::kernels::ref
