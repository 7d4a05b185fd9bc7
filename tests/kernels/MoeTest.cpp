#include "hybrid/kernels/ref/Moe.h"

#include "TestUtil.h"
#include "hybrid/kernels/ref/Linear.h"
#include "hybrid/kernels/ref/Math.h"

#include <gtest/gtest.h>

namespace hybrid::kernels::ref {
namespace {

using testing::maxAbsDiff;
using testing::randomNormal;

// Router logits whose sigmoid is exactly the given score.
std::vector<float> logitsFor(const std::vector<float> &scores) {
  std::vector<float> logits;
  for (float s : scores)
    logits.push_back(std::log(s / (1 - s)));
  return logits;
}

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routed route(const std::vector<float> &logits, const RouterParams &params) {
  Routed r{std::vector<int32_t>(params.topK), std::vector<float>(params.topK)};
  routeTokens(logits, 1, params, r.ids, r.weights);
  return r;
}

TEST(Router, GroupScoreIsTopTwoSumWithBiasAndMaxWithout) {
  // Group 0 holds the single best expert; group 1 the better pair.
  const auto logits = logitsFor({0.9f, 0.1f, 0.1f, 0.1f, 0.6f, 0.6f, 0.2f, 0.2f});
  RouterParams p;
  p.numExperts = 8;
  p.topK = 2;
  p.numGroups = 2;
  p.topKGroups = 1;
  p.routedScalingFactor = 2.5f;

  // No bias: group score = max → group 0 (0.9 > 0.6); experts 0 and 1 (ties → lower id).
  Routed r = route(logits, p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(r.weights[0], 0.9f * 2.5f, 1e-6);
  EXPECT_NEAR(r.weights[1], 0.1f * 2.5f, 1e-6);

  // Zero bias: group score = sum of the top two → group 1 (1.2 > 1.0).
  const std::vector<float> zeroBias(8, 0.0f);
  p.correctionBias = zeroBias;
  r = route(logits, p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4, 5}));
  EXPECT_NEAR(r.weights[0], 1.25f, 1e-6);
  EXPECT_NEAR(r.weights[1], 1.25f, 1e-6);

  // Two groups kept: plain top-2 over everything.
  p.topKGroups = 2;
  r = route(logits, p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 4}));
  EXPECT_NEAR(r.weights[0], 0.9f / 1.5f * 2.5f, 1e-6);
}

TEST(Router, BiasChoosesButDoesNotWeigh) {
  const auto logits = logitsFor({0.5f, 0.4f, 0.3f, 0.2f});
  const std::vector<float> bias = {0.0f, 0.0f, 0.3f, 0.0f}; // biased: 0.5, 0.4, 0.6, 0.2
  RouterParams p;
  p.numExperts = 4;
  p.topK = 2;
  p.correctionBias = bias;
  Routed r = route(logits, p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 0}));
  EXPECT_NEAR(r.weights[0], 0.3f / 0.8f, 1e-6); // unbiased scores, renormalised
  EXPECT_NEAR(r.weights[1], 0.5f / 0.8f, 1e-6);

  p.weightsFromBiasedScores = true; // the Kimi HF remote-code variant
  r = route(logits, p);
  EXPECT_NEAR(r.weights[0], 0.6f / 1.1f, 1e-6);
  EXPECT_NEAR(r.weights[1], 0.5f / 1.1f, 1e-6);

  p.weightsFromBiasedScores = false;
  p.renormalize = false;
  p.routedScalingFactor = 2.0f;
  r = route(logits, p);
  EXPECT_NEAR(r.weights[0], 0.6f, 1e-6);
  EXPECT_NEAR(r.weights[1], 1.0f, 1e-6);
}

TEST(Router, SoftmaxScoring) {
  const std::vector<float> logits = {std::log(1.0f), std::log(2.0f), std::log(3.0f),
                                     std::log(4.0f)};
  RouterParams p;
  p.numExperts = 4;
  p.topK = 2;
  p.scoring = RouterScoring::Softmax;
  p.renormalize = false;
  Routed r = route(logits, p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 2}));
  EXPECT_NEAR(r.weights[0], 0.4f, 1e-6);
  EXPECT_NEAR(r.weights[1], 0.3f, 1e-6);
}

TEST(Moe, ExpertsCombineWeightedRoutedAndSharedOutputs) {
  std::mt19937 rng(21);
  const int64_t T = 5, d = 16, inner = 8, E = 4, topK = 2;
  std::vector<std::vector<float>> storage;
  auto makeExpert = [&] {
    storage.push_back(randomNormal(rng, inner * d, 0, 0.3f));
    storage.push_back(randomNormal(rng, inner * d, 0, 0.3f));
    storage.push_back(randomNormal(rng, d * inner, 0, 0.3f));
    const size_t n = storage.size();
    return SwiGluWeights{storage[n - 3], storage[n - 2], storage[n - 1], d, inner, std::nullopt};
  };
  storage.reserve(3 * (E + 1));
  std::vector<SwiGluWeights> experts;
  for (int64_t e = 0; e < E; ++e)
    experts.push_back(makeExpert());
  const SwiGluWeights shared = makeExpert();

  const auto x = randomNormal(rng, T * d);
  const std::vector<int32_t> ids = {0, 1, 2, 3, 1, 0, 3, 3, 2, 1};
  const auto weights = randomNormal(rng, T * topK);
  std::vector<float> out(T * d);
  moeExperts(x, T, d, ids, weights, topK, experts, std::span(&shared, 1), out);

  // Token by token, the definition.
  std::vector<float> expected(T * d, 0.0f), y(d);
  for (int64_t t = 0; t < T; ++t) {
    const std::span<const float> xt(x.data() + t * d, d);
    for (int64_t k = 0; k < topK; ++k) {
      swiGluMlp(xt, 1, experts[ids[t * topK + k]], y);
      for (int64_t i = 0; i < d; ++i)
        expected[t * d + i] += weights[t * topK + k] * y[i];
    }
    swiGluMlp(xt, 1, shared, y);
    for (int64_t i = 0; i < d; ++i)
      expected[t * d + i] += y[i];
  }
  EXPECT_LE(maxAbsDiff(out, expected), 1e-5f);

  // And SwiGLU itself: down(silu(gate x) ⊙ up x).
  std::vector<float> gate(inner), up(inner), down(d);
  linear(std::span(x).first(d), shared.gateProj, gate, 1, d, inner);
  linear(std::span(x).first(d), shared.upProj, up, 1, d, inner);
  for (int64_t i = 0; i < inner; ++i)
    gate[i] = silu(gate[i]) * up[i];
  linear(gate, shared.downProj, down, 1, inner, d);
  swiGluMlp(std::span(x).first(d), 1, shared, y);
  EXPECT_LE(maxAbsDiff(y, down), 0.0f);
}

} // namespace
} // namespace hybrid::kernels::ref
