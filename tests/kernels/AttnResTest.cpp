#include "hybrid/kernels/ref/AttnRes.h"

#include "TestUtil.h"

#include <gtest/gtest.h>

namespace hybrid::kernels::ref {
namespace {

TEST(AttnRes, ZeroQueryAveragesCandidates) {
  const std::vector<float> a = {1, 2, 3, 4}, b = {3, 0, -1, 8}; // 2 tokens, dim 2
  const std::vector<float> norm = {1, 1}, proj = {0, 0};
  const float *candidates[] = {a.data(), b.data()};
  std::vector<float> out(4);
  attnResMix(candidates, 2, 2, norm, proj, 1e-6f, out);
  EXPECT_EQ(out, (std::vector<float>{2, 1, 1, 6}));
}

TEST(AttnRes, SoftmaxOverRmsNormalisedKeys) {
  // One token, dim 2. RMSNorm makes the keys scale-free: a = (3, 4) → (3, 4)/sqrt(12.5).
  const std::vector<float> a = {3, 4}, b = {-6, 0};
  const std::vector<float> norm = {2, 1}, proj = {1, 0.5f};
  const float *candidates[] = {a.data(), b.data()};
  std::vector<float> out(2);
  attnResMix(candidates, 1, 2, norm, proj, 0.0f, out);
  const float scoreA = (2 * 3 + 0.5f * 4) / std::sqrt(12.5f);
  const float scoreB = (2 * -6) / std::sqrt(18.0f);
  const float pA = 1 / (1 + std::exp(scoreB - scoreA));
  EXPECT_NEAR(out[0], pA * 3 + (1 - pA) * -6, 1e-5);
  EXPECT_NEAR(out[1], pA * 4, 1e-5);
}

} // namespace
} // namespace hybrid::kernels::ref
