#include "hybrid/kernels/ref/Moe.h"

#include "TestUtil.h"
#include "hybrid/kernels/ref/Linear.h"
#include "hybrid/kernels/ref/Math.h"
#include "hybrid/kernels/ref/Norm.h"

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

// Kimi K3's SiTU (MODEL_SPEC 7.4): 4·tanh(g/4)·σ(g) · 25·tanh(u/25), in double by hand.
TEST(GatedActivation, SituIsTheK3Formula) {
  const GatedActivation situ{GatedActivation::Kind::Situ, 4.0f, 25.0f};
  auto expected = [](double g, double u, double beta, double linearBeta) {
    const double cappedUp = linearBeta > 0 ? linearBeta * std::tanh(u / linearBeta) : u;
    return beta * std::tanh(g / beta) / (1 + std::exp(-g)) * cappedUp;
  };
  for (auto [g, u] : {std::pair{2.0, 30.0}, {-3.0, 0.5}, {0.0, 7.0}, {40.0, -100.0}})
    EXPECT_NEAR(gatedActivation(situ, g, u), expected(g, u, 4, 25), 1e-5 * (1 + std::abs(u)))
        << g << ", " << u;
  // The gate saturates at beta, the linear half at linear_beta.
  EXPECT_NEAR(gatedActivation(situ, 60.0f, 1e4f), 4.0f * 25.0f, 1e-3f);
  // Without linear_beta the linear half is not capped.
  const GatedActivation uncapped{GatedActivation::Kind::Situ, 4.0f, 0.0f};
  EXPECT_NEAR(gatedActivation(uncapped, 2.0f, 30.0f), expected(2, 30, 4, 0), 1e-4);
  // SiLU stays SwiGLU's.
  EXPECT_FLOAT_EQ(gatedActivation({}, 1.5f, 2.0f), silu(1.5f) * 2.0f);
}

TEST(GatedActivation, SituMlpEqualsTheFormulaOnRandomWeights) {
  std::mt19937 rng(74);
  const int64_t tokens = 3, hidden = 16, inner = 24;
  const std::vector<float> x = randomNormal(rng, tokens * hidden, 0.0f, 2.0f);
  const std::vector<float> gate = randomNormal(rng, inner * hidden, 0.0f, 1.0f);
  const std::vector<float> up = randomNormal(rng, inner * hidden, 0.0f, 3.0f);
  const std::vector<float> down = randomNormal(rng, hidden * inner, 0.0f, 0.2f);
  SwiGluWeights weights{gate, up, down, hidden, inner, std::nullopt,
                        {GatedActivation::Kind::Situ, 4.0f, 25.0f}};
  std::vector<float> out(tokens * hidden);
  swiGluMlp(x, tokens, weights, out);
  std::vector<float> expected(tokens * hidden, 0.0f);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < inner; ++j) {
      double g = 0, u = 0;
      for (int64_t i = 0; i < hidden; ++i) {
        g += double(gate[j * hidden + i]) * x[t * hidden + i];
        u += double(up[j * hidden + i]) * x[t * hidden + i];
      }
      const double a = 4 * std::tanh(g / 4) / (1 + std::exp(-g)) * 25 * std::tanh(u / 25);
      for (int64_t o = 0; o < hidden; ++o)
        expected[t * hidden + o] += static_cast<float>(down[o * inner + j] * a);
    }
  EXPECT_LT(maxAbsDiff(out, expected), 1e-4f);
  // The same weights under SiLU give something else: the activation is really applied.
  weights.activation = {};
  std::vector<float> silu(tokens * hidden);
  swiGluMlp(x, tokens, weights, silu);
  EXPECT_GT(maxAbsDiff(silu, expected), 1e-2f);
}

// Kimi K3's latent MoE as the plan runs it (Linear down, MoeExperts in the latent width,
// RmsNorm, Linear up, plus the full-width shared expert) against the layer written out in double:
//   y = up · RMSNorm_w( Σ_k w_k · E_k(down · x) ) + Shared(x), experts and shared expert in SiTU.
TEST(LatentMoe, PlanDecompositionEqualsTheK3Layer) {
  std::mt19937 rng(75);
  const int64_t tokens = 4, hidden = 16, latent = 8, inner = 12, numExperts = 4, topK = 2;
  const float eps = 1e-5f;
  const GatedActivation situ{GatedActivation::Kind::Situ, 4.0f, 25.0f};
  const std::vector<float> x = randomNormal(rng, tokens * hidden);
  const std::vector<float> down = randomNormal(rng, latent * hidden, 0.0f, 0.5f);
  const std::vector<float> up = randomNormal(rng, hidden * latent, 0.0f, 0.5f);
  const std::vector<float> normWeight = randomNormal(rng, latent, 1.0f, 0.1f);
  std::vector<std::vector<float>> gates, ups, downs;
  std::vector<SwiGluWeights> experts;
  for (int64_t e = 0; e < numExperts; ++e) {
    gates.push_back(randomNormal(rng, inner * latent, 0.0f, 0.5f));
    ups.push_back(randomNormal(rng, inner * latent, 0.0f, 0.5f));
    downs.push_back(randomNormal(rng, latent * inner, 0.0f, 0.5f));
  }
  for (int64_t e = 0; e < numExperts; ++e)
    experts.push_back({gates[e], ups[e], downs[e], latent, inner, std::nullopt, situ});
  const std::vector<float> sharedGate = randomNormal(rng, inner * hidden, 0.0f, 0.3f);
  const std::vector<float> sharedUp = randomNormal(rng, inner * hidden, 0.0f, 0.3f);
  const std::vector<float> sharedDown = randomNormal(rng, hidden * inner, 0.0f, 0.3f);
  const SwiGluWeights shared{sharedGate, sharedUp, sharedDown, hidden, inner, std::nullopt, situ};
  const std::vector<int32_t> ids = {0, 3, 1, 2, 3, 1, 2, 0};
  const std::vector<float> weights = {0.7f, 0.5f, 1.2f, 0.1f, 0.9f, 0.9f, 0.3f, 2.0f};

  // The plan's steps.
  std::vector<float> latentIn(tokens * latent), latentOut(tokens * latent),
      normed(tokens * latent), routed(tokens * hidden), sharedOut(tokens * hidden);
  linear(x, down, latentIn, tokens, hidden, latent);
  moeExperts(latentIn, tokens, latent, ids, weights, topK, experts, {}, latentOut);
  rmsNorm(latentOut, normWeight, normed, tokens, latent, eps);
  linear(normed, up, routed, tokens, latent, hidden);
  swiGluMlp(x, tokens, shared, sharedOut);

  // The layer in double.
  auto situOf = [](double g, double u) {
    return 4 * std::tanh(g / 4) / (1 + std::exp(-g)) * 25 * std::tanh(u / 25);
  };
  auto gatedMlp = [&](const std::vector<double> &in, int64_t width, const std::vector<float> &g,
                      const std::vector<float> &u, const std::vector<float> &dn) {
    std::vector<double> out(width, 0.0);
    for (int64_t j = 0; j < inner; ++j) {
      double gj = 0, uj = 0;
      for (int64_t i = 0; i < width; ++i) {
        gj += g[j * width + i] * in[i];
        uj += u[j * width + i] * in[i];
      }
      for (int64_t o = 0; o < width; ++o)
        out[o] += dn[o * inner + j] * situOf(gj, uj);
    }
    return out;
  };
  std::vector<float> expected(tokens * hidden);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> xt(x.begin() + t * hidden, x.begin() + (t + 1) * hidden), xl(latent, 0.0);
    for (int64_t l = 0; l < latent; ++l)
      for (int64_t i = 0; i < hidden; ++i)
        xl[l] += down[l * hidden + i] * xt[i];
    std::vector<double> mixed(latent, 0.0);
    for (int64_t k = 0; k < topK; ++k) {
      const int32_t e = ids[t * topK + k];
      const std::vector<double> y = gatedMlp(xl, latent, gates[e], ups[e], downs[e]);
      for (int64_t l = 0; l < latent; ++l)
        mixed[l] += weights[t * topK + k] * y[l];
    }
    double squares = 0;
    for (double v : mixed)
      squares += v * v;
    const double inverseRms = 1 / std::sqrt(squares / latent + eps);
    const std::vector<double> sharedY = gatedMlp(xt, hidden, sharedGate, sharedUp, sharedDown);
    for (int64_t o = 0; o < hidden; ++o) {
      double y = sharedY[o];
      for (int64_t l = 0; l < latent; ++l)
        y += up[o * latent + l] * normWeight[l] * mixed[l] * inverseRms;
      expected[t * hidden + o] = static_cast<float>(y);
    }
  }
  std::vector<float> layer(tokens * hidden);
  for (size_t i = 0; i < layer.size(); ++i)
    layer[i] = routed[i] + sharedOut[i];
  EXPECT_LT(maxAbsDiff(layer, expected), 1e-3f);
}

} // namespace
} // namespace hybrid::kernels::ref
