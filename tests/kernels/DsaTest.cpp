#include "hybrid/kernels/ref/Dsa.h"

#include "TestUtil.h"

#include <gtest/gtest.h>
#include <limits>

namespace hybrid::kernels::ref {
namespace {

TEST(Indexer, ScoresAreWeightedReluOfHeadDotsWithCausalMask) {
  // 2 heads, head dim 4, 2 queries at positions 0 and 1, 2 keys.
  const std::vector<float> q = {1, 0, 0, 0, /*h1*/ 0, 1,  0, 0,  // query 0
                                2, 0, 0, 0, /*h1*/ 0, -1, 0, 0}; // query 1
  const std::vector<float> k = {1, 1, 0, 0, /*key 1*/ 3, 0, 0, 0};
  const std::vector<float> w = {1, 2, /*query 1*/ -1, 4};
  const std::vector<int64_t> positions = {0, 1};
  std::vector<float> scores(4);
  IndexerParams p{2, 2, 2, 4, q.data(), k.data(), w.data(), positions.data(), scores.data()};
  indexerScores(p);
  const float dotScale = 0.5f, headScale = 1.0f / std::sqrt(2.0f); // 4^−1/2, 2^−1/2
  EXPECT_FLOAT_EQ(scores[0], headScale * (1 * dotScale * 1 + 2 * dotScale * 1));
  EXPECT_EQ(scores[1], -std::numeric_limits<float>::infinity()); // future key
  // query 1: head 0 dot = 2 (key 0) and 6 (key 1); head 1 dot = −1 and 0 → ReLU → 0.
  EXPECT_FLOAT_EQ(scores[2], headScale * (-1 * dotScale * 2));
  EXPECT_FLOAT_EQ(scores[3], headScale * (-1 * dotScale * 6));
}

TEST(Indexer, TopKPicksBestCausalPositionsAndPadsWithMinusOne) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> scores = {0.5f, -inf, -inf, -inf,  // one causal position
                                     0.1f, 0.9f, 0.3f, 0.9f}; // tie at 0.9: lower position first
  std::vector<int32_t> indices(6);
  topKIndices(scores, 2, 4, 3, indices);
  EXPECT_EQ(indices, (std::vector<int32_t>{0, -1, -1, 1, 3, 2}));
}

} // namespace
} // namespace hybrid::kernels::ref
