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

// Inputs an FP8 GEMM represents exactly: per 128-channel tile, E4M3 values times 2^k with the
// tile's amax 256 * 2^k, so the ue8m0 scale is 2^k (256 / 448 rounds up to 1) and x / s an E4M3
// value. The FP8 path must then equal the plain GEMM bit for bit.
TEST(LinearFp8Activations, ExactOnInputsFp8Represents) {
  std::mt19937 rng(3);
  const int64_t rows = 3, in = 300, out = 37; // a short last tile
  std::vector<float> x(rows * in);
  std::uniform_int_distribution<int> code(0, 0x77); // |value| <= 240
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < in; ++c) {
      const int tile = static_cast<int>(c / kFp8TileSize);
      const float scale = std::ldexp(1.0f, tile - 2 + static_cast<int>(r));
      const float value = c % kFp8TileSize == 5 ? 256.0f : e4m3ToFloat(uint8_t(code(rng)));
      x[r * in + c] = (c % 2 ? -value : value) * scale;
    }
  const auto w = testing::randomNormal(rng, out * in);
  std::vector<float> fp8(rows * out), plain(rows * out);
  linearFp8Activations(x, w, fp8, rows, in, out, Fp8ScaleRule::DeepSeekUe8m0);
  linear(x, w, plain, rows, in, out);
  EXPECT_EQ(fp8, plain);
}

// Generic inputs: the GEMM sees x after act_quant's round trip under the chosen scale rule, which
// moves each element by at most half an E4M3 step (1/16 relative) and is not the identity.
TEST(LinearFp8Activations, MultipliesTheQuantizedActivations) {
  std::mt19937 rng(4);
  const int64_t rows = 5, in = 256, out = 64;
  const auto x = randomNormal(rng, rows * in);
  const auto w = randomNormal(rng, out * in);
  for (Fp8ScaleRule rule : {Fp8ScaleRule::DeepSeekLinear, Fp8ScaleRule::DeepSeekUe8m0}) {
    std::vector<uint8_t> codes(rows * in);
    std::vector<float> scales(rows * fp8TileCount(in)), seen(rows * in);
    ASSERT_TRUE(quantizeFp8Tiles(x, rows, in, kFp8TileSize, rule, codes, scales));
    ASSERT_TRUE(dequantizeFp8Tiles(codes, scales, rows, in, kFp8TileSize, seen));
    float moved = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_LE(std::abs(seen[i] - x[i]), std::abs(x[i]) / 16 + 1e-6f) << i;
      moved = std::max(moved, std::abs(seen[i] - x[i]));
    }
    EXPECT_GT(moved, 0.0f);
    std::vector<float> y(rows * out), expected(rows * out);
    linearFp8Activations(x, w, y, rows, in, out, rule);
    linear(seen, w, expected, rows, in, out);
    EXPECT_EQ(y, expected);
  }
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
