#include "hybrid/kernels/ref/Kda.h"

#include "TestUtil.h"
#include "hybrid/kernels/ref/Math.h"
#include "hybrid/kernels/ref/Norm.h"

#include <gtest/gtest.h>

namespace hybrid::kernels::ref {
namespace {

using testing::maxAbsDiff;
using testing::randomNormal;
using testing::randomUniform;

constexpr int64_t kHeads = 2, kKeyDim = 64, kValueDim = 32; // K ≠ V catches transposed indexing

// Inputs of the KDA core as the layer produces them: q, k l2-normalised, g from the gate, β from σ.
struct KdaInputs {
  int64_t numTokens;
  std::vector<float> q, k, v, g, beta;
};

KdaInputs makeInputs(std::mt19937 &rng, int64_t T, bool lowerBoundGate = false) {
  KdaInputs in{T,
               randomNormal(rng, T * kHeads * kKeyDim),
               randomNormal(rng, T * kHeads * kKeyDim),
               randomNormal(rng, T * kHeads * kValueDim),
               {},
               randomNormal(rng, T * kHeads)};
  l2NormalizeRows(in.q, T * kHeads, kKeyDim);
  l2NormalizeRows(in.k, T * kHeads, kKeyDim);
  // dt_bias spread so that decays range from ~1 (long memory) to strong forgetting.
  const auto f = randomNormal(rng, T * kHeads * kKeyDim);
  const auto aLog = randomUniform(rng, kHeads, -1.0f, 1.0f);
  const auto dtBias = randomUniform(rng, kHeads * kKeyDim, -6.0f, 1.0f);
  in.g.resize(f.size());
  kdaGate(f, aLog, dtBias, in.g, T, kHeads, kKeyDim,
          lowerBoundGate ? std::optional<float>(-5.0f) : std::nullopt);
  kdaBeta(in.beta);
  return in;
}

struct KdaResult {
  std::vector<float> out, state;
};

// segments > 0: the segment scan with that many segments.
KdaResult runKda(const KdaInputs &in, const std::vector<float> &initialState, bool chunked,
                 int64_t segments = 0) {
  KdaResult result{std::vector<float>(in.numTokens * kHeads * kValueDim), initialState};
  KdaParams p;
  p.numTokens = in.numTokens;
  p.numHeads = kHeads;
  p.keyDim = kKeyDim;
  p.valueDim = kValueDim;
  p.q = in.q.data();
  p.k = in.k.data();
  p.v = in.v.data();
  p.g = in.g.data();
  p.beta = in.beta.data();
  p.state = result.state.data();
  p.out = result.out.data();
  if (segments > 0)
    kdaSegmentScan(p, segments);
  else if (chunked)
    kdaChunked(p, 64);
  else
    kdaRecurrent(p);
  return result;
}

class KdaChunkedVsRecurrent : public ::testing::TestWithParam<int64_t> {};

TEST_P(KdaChunkedVsRecurrent, OutputsAndFinalStateAgree) {
  const int64_t T = GetParam();
  std::mt19937 rng(static_cast<unsigned>(T));
  for (bool lowerBoundGate : {false, true}) {
    const KdaInputs in = makeInputs(rng, T, lowerBoundGate);
    const auto initialState = randomNormal(rng, kHeads * kKeyDim * kValueDim, 0.0f, 0.5f);
    const KdaResult recurrent = runKda(in, initialState, /*chunked=*/false);
    const KdaResult chunked = runKda(in, initialState, /*chunked=*/true);
    EXPECT_LE(maxAbsDiff(recurrent.out, chunked.out), 1e-5f) << "T=" << T;
    EXPECT_LE(maxAbsDiff(recurrent.state, chunked.state), 1e-5f) << "T=" << T;
  }
}

INSTANTIATE_TEST_SUITE_P(ChunkBoundaries, KdaChunkedVsRecurrent,
                         ::testing::Values(1, 63, 64, 65, 200));

// The state-passing scan (per-segment summaries, a sequential combine, a rerun) gives the
// recurrence's outputs and final state, for any number of segments, with a nonzero initial state
// and both gate forms.
TEST(KdaSegmentScan, EqualsTheRecurrence) {
  std::mt19937 rng(11);
  for (bool lowerBoundGate : {false, true})
    for (int64_t T : {1, 7, 130}) {
      const KdaInputs in = makeInputs(rng, T, lowerBoundGate);
      const auto initialState = randomNormal(rng, kHeads * kKeyDim * kValueDim, 0.0f, 0.5f);
      const KdaResult recurrent = runKda(in, initialState, /*chunked=*/false);
      for (int64_t segments : {1, 2, 5, 16, 500}) {
        const KdaResult scanned = runKda(in, initialState, false, segments);
        EXPECT_LE(maxAbsDiff(recurrent.out, scanned.out), 1e-5f)
            << "T=" << T << " segments=" << segments;
        EXPECT_LE(maxAbsDiff(recurrent.state, scanned.state), 1e-5f)
            << "T=" << T << " segments=" << segments;
      }
    }
}

TEST(Kda, RecurrenceMatchesDeltaRuleByHand) {
  // One head, K = V = 1: S ← e^g S; S ← S + β k (v − k S); o = scale q S.
  const std::vector<float> q = {1}, k = {1}, v = {2}, g = {std::log(0.5f)}, beta = {0.25f};
  std::vector<float> state = {4}, out(1);
  KdaParams p{1,        1,        1,        1,           3.0f,         q.data(),
              k.data(), v.data(), g.data(), beta.data(), state.data(), out.data()};
  kdaRecurrent(p);
  // decayed 2, prediction error 0, so S stays 2; o = 3 · 2
  EXPECT_FLOAT_EQ(state[0], 2.0f);
  EXPECT_FLOAT_EQ(out[0], 6.0f);
}

TEST(Kda, GateForms) {
  const std::vector<float> f = {0.5f, -30.0f}, aLog = {std::log(2.0f)}, dtBias = {0.5f, 0.0f};
  std::vector<float> g(2);
  kdaGate(f, aLog, dtBias, g, 1, 1, 2);
  EXPECT_FLOAT_EQ(g[0], -2.0f * std::log1p(std::exp(1.0f)));
  EXPECT_NEAR(g[1], -2.0f * std::exp(-30.0f), 1e-18);
  kdaGate(f, aLog, dtBias, g, 1, 1, 2, -5.0f);
  EXPECT_FLOAT_EQ(g[0], -5.0f * sigmoid(2.0f));
  EXPECT_FLOAT_EQ(g[1], -5.0f * sigmoid(-60.0f));
}

TEST(Kda, ShortConvHandCase) {
  // One channel, W = 3: out_t = silu(w0 x_{t−2} + w1 x_{t−1} + w2 x_t), history starts at zero.
  const std::vector<float> x = {1, 2, 3}, w = {100, 10, 1};
  std::vector<float> state(2, 0.0f), out(3);
  shortConvSilu(x, w, state, out, 3, 1, 3);
  EXPECT_FLOAT_EQ(out[0], silu(1));
  EXPECT_FLOAT_EQ(out[1], silu(12));
  EXPECT_FLOAT_EQ(out[2], silu(123));
  EXPECT_EQ(state, (std::vector<float>{2, 3}));
}

TEST(Kda, ShortConvTokenByTokenEqualsWholeSequence) {
  std::mt19937 rng(7);
  const int64_t T = 9, C = 5, W = 4;
  const auto x = randomNormal(rng, T * C);
  const auto w = randomNormal(rng, C * W);
  std::vector<float> wholeState((W - 1) * C, 0.0f), whole(T * C);
  shortConvSilu(x, w, wholeState, whole, T, C, W);
  std::vector<float> state((W - 1) * C, 0.0f), stepped(T * C);
  // Uneven pieces (2 tokens, then 1 at a time) exercise the history shift with T < W − 1.
  shortConvSilu(std::span(x).subspan(0, 2 * C), w, state, std::span(stepped).subspan(0, 2 * C), 2,
                C, W);
  for (int64_t t = 2; t < T; ++t)
    shortConvSilu(std::span(x).subspan(t * C, C), w, state, std::span(stepped).subspan(t * C, C), 1,
                  C, W);
  EXPECT_LE(maxAbsDiff(whole, stepped), 0.0f);
  EXPECT_LE(maxAbsDiff(wholeState, state), 0.0f);
}

// The layer's core from pre-conv projections: conv + SiLU, l2norm, then KDA, with both states
// carried.
struct KdaLayerState {
  std::vector<float> convQ, convK, convV, recurrent;
};

std::vector<float> kdaFromProjections(std::span<const float> qHat, std::span<const float> kHat,
                                      std::span<const float> vHat, std::span<const float> g,
                                      std::span<const float> beta, int64_t T,
                                      const std::vector<float> &w, KdaLayerState &state,
                                      bool decodeStep) {
  const int64_t qkChannels = kHeads * kKeyDim, vChannels = kHeads * kValueDim, W = 4;
  std::vector<float> q(T * qkChannels), k(T * qkChannels), v(T * vChannels);
  shortConvSilu(qHat, std::span(w).subspan(0, qkChannels * W), state.convQ, q, T, qkChannels, W);
  shortConvSilu(kHat, std::span(w).subspan(qkChannels * W, qkChannels * W), state.convK, k, T,
                qkChannels, W);
  shortConvSilu(vHat, std::span(w).subspan(2 * qkChannels * W), state.convV, v, T, vChannels, W);
  l2NormalizeRows(q, T * kHeads, kKeyDim);
  l2NormalizeRows(k, T * kHeads, kKeyDim);
  std::vector<float> out(T * vChannels);
  KdaParams p{T,
              kHeads,
              kKeyDim,
              kValueDim,
              0.0f,
              q.data(),
              k.data(),
              v.data(),
              g.data(),
              beta.data(),
              state.recurrent.data(),
              out.data()};
  if (decodeStep)
    kdaRecurrent(p);
  else
    kdaChunked(p);
  return out;
}

class KdaPrefillThenDecode : public ::testing::TestWithParam<int64_t> {};

TEST_P(KdaPrefillThenDecode, EqualsFullSequence) {
  const int64_t T = GetParam();
  std::mt19937 rng(static_cast<unsigned>(100 + T));
  const int64_t qkChannels = kHeads * kKeyDim, vChannels = kHeads * kValueDim;
  const auto qHat = randomNormal(rng, T * qkChannels);
  const auto kHat = randomNormal(rng, T * qkChannels);
  const auto vHat = randomNormal(rng, T * vChannels);
  const auto convWeights = randomNormal(rng, (2 * qkChannels + vChannels) * 4, 0.0f, 0.5f);
  KdaInputs gates = makeInputs(rng, T); // only g and β are used
  auto freshState = [&] {
    return KdaLayerState{std::vector<float>(3 * qkChannels, 0.0f),
                         std::vector<float>(3 * qkChannels, 0.0f),
                         std::vector<float>(3 * vChannels, 0.0f),
                         std::vector<float>(kHeads * kKeyDim * kValueDim, 0.0f)};
  };

  KdaLayerState fullState = freshState();
  const auto full = kdaFromProjections(qHat, kHat, vHat, gates.g, gates.beta, T, convWeights,
                                       fullState, /*decodeStep=*/false);

  KdaLayerState state = freshState();
  const int64_t P = T - 1;
  auto prefill = kdaFromProjections(
      std::span(qHat).first(P * qkChannels), std::span(kHat).first(P * qkChannels),
      std::span(vHat).first(P * vChannels), std::span(gates.g).first(P * qkChannels),
      std::span(gates.beta).first(P * kHeads), P, convWeights, state, false);
  const auto decoded = kdaFromProjections(
      std::span(qHat).subspan(P * qkChannels), std::span(kHat).subspan(P * qkChannels),
      std::span(vHat).subspan(P * vChannels), std::span(gates.g).subspan(P * qkChannels),
      std::span(gates.beta).subspan(P * kHeads), 1, convWeights, state, true);
  prefill.insert(prefill.end(), decoded.begin(), decoded.end());

  EXPECT_LE(maxAbsDiff(full, prefill), 1e-5f);
  EXPECT_LE(maxAbsDiff(fullState.recurrent, state.recurrent), 1e-5f);
  EXPECT_EQ(fullState.convQ, state.convQ);
  EXPECT_EQ(fullState.convV, state.convV);
}

INSTANTIATE_TEST_SUITE_P(Lengths, KdaPrefillThenDecode, ::testing::Values(2, 40, 65, 130));

} // namespace
} // namespace hybrid::kernels::ref
