#include "hybrid/kernels/ref/Mla.h"

#include "TestUtil.h"

#include <algorithm>
#include <gtest/gtest.h>
#include <numeric>

namespace hybrid::kernels::ref {
namespace {

using testing::maxAbsDiff;
using testing::randomNormal;

// ---- RoPE
// ----------------------------------------------------------------------------------------

TEST(Rope, YarnRangeForDeepSeekV32Config) {
  // MODEL_SPEC §3.2: qk_rope_head_dim 64, theta 1e4, factor 40, original 4096, beta 32 / 1.
  const YarnConfig yarn{40.0, 4096, 32.0, 1.0, 1.0, 1.0};
  const YarnRamp ramp = yarnCorrectionRange(64, 10000.0, yarn);
  EXPECT_EQ(ramp.low, 10);
  EXPECT_EQ(ramp.high, 23);

  const auto plain = ropeInverseFrequencies(64, 10000.0);
  const auto scaled = yarnInverseFrequencies(64, 10000.0, yarn);
  ASSERT_EQ(scaled.size(), 32u);
  for (int i = 0; i <= 10; ++i) // ramp 0: high frequencies untouched
    EXPECT_FLOAT_EQ(scaled[i], plain[i]) << i;
  for (int i = 23; i < 32; ++i) // ramp 1: fully interpolated
    EXPECT_FLOAT_EQ(scaled[i], plain[i] / 40.0f) << i;
  const double ramp16 = (16.0 - 10.0) / 13.0;
  EXPECT_NEAR(scaled[16], plain[16] / 40.0 * ramp16 + plain[16] * (1 - ramp16), 1e-9);
  EXPECT_FLOAT_EQ(plain[1], std::pow(10000.0f, -2.0f / 64.0f));

  // Softmax scale 192^−1/2 · m², m = 0.1 ln 40 + 1.
  const double m = yarnMscale(40.0, 1.0);
  EXPECT_NEAR(m, 1.368888, 1e-6);
  EXPECT_NEAR(m * m / std::sqrt(192.0), 0.1352338, 1e-7);
  EXPECT_EQ(yarnMscale(1.0, 1.0), 1.0);
}

TEST(Rope, InterleavedAndHalfSplitRotateDifferentPairs) {
  const std::vector<float> frequencies = {0.5f, 0.25f};
  const int64_t position = 3;
  for (int source = 0; source < 4; ++source) {
    std::vector<float> interleaved(4, 0.0f), halfSplit(4, 0.0f);
    interleaved[source] = halfSplit[source] = 1.0f;
    applyRope(interleaved, position, frequencies, RopeLayout::Interleaved);
    applyRope(halfSplit, position, frequencies, RopeLayout::HalfSplit);

    // Interleaved pairs (0,1), (2,3); half-split pairs (0,2), (1,3).
    const int interleavedPair = source / 2, interleavedPartner = source ^ 1;
    const int halfPair = source % 2, halfPartner = (source + 2) % 4;
    const bool interleavedFirst = source % 2 == 0, halfFirst = source < 2;
    const float a = position * frequencies[interleavedPair];
    const float b = position * frequencies[halfPair];
    EXPECT_FLOAT_EQ(interleaved[source], std::cos(a));
    EXPECT_FLOAT_EQ(interleaved[interleavedPartner], interleavedFirst ? std::sin(a) : -std::sin(a));
    EXPECT_FLOAT_EQ(halfSplit[source], std::cos(b));
    EXPECT_FLOAT_EQ(halfSplit[halfPartner], halfFirst ? std::sin(b) : -std::sin(b));
    for (int other = 0; other < 4; ++other) {
      if (other != source && other != interleavedPartner) {
        EXPECT_EQ(interleaved[other], 0.0f);
      }
      if (other != source && other != halfPartner) {
        EXPECT_EQ(halfSplit[other], 0.0f);
      }
    }
  }
}

TEST(Rope, ScoresDependOnlyOnRelativePosition) {
  std::mt19937 rng(3);
  const auto q = randomNormal(rng, 32), k = randomNormal(rng, 32);
  const auto frequencies = ropeInverseFrequencies(32, 10000.0);
  for (RopeLayout layout : {RopeLayout::Interleaved, RopeLayout::HalfSplit}) {
    auto score = [&](int64_t qPos, int64_t kPos) {
      std::vector<float> a = q, b = k;
      applyRope(a, qPos, frequencies, layout);
      applyRope(b, kPos, frequencies, layout);
      return std::inner_product(a.begin(), a.end(), b.begin(), 0.0);
    };
    EXPECT_NEAR(score(7, 3), score(14, 10), 1e-4);
    EXPECT_NEAR(score(0, 0), std::inner_product(q.begin(), q.end(), k.begin(), 0.0), 1e-4);
  }
  std::vector<float> unchanged = q;
  applyRope(unchanged, 5, frequencies, RopeLayout::None);
  EXPECT_EQ(unchanged, q);
}

// ---- Attention
// -----------------------------------------------------------------------------------

struct MlaProblem {
  int64_t numKeys = 23, numQueries = 9, heads = 3, nope = 16, rope = 8, value = 12, latent = 20;
  std::vector<float> queries, latents, ropeKeys, kvB;
  std::vector<int64_t> positions;

  explicit MlaProblem(std::mt19937 &rng)
      : queries(randomNormal(rng, numQueries * heads * (nope + rope))),
        latents(randomNormal(rng, numKeys * latent)), ropeKeys(randomNormal(rng, numKeys * rope)),
        kvB(randomNormal(rng, heads * (nope + value) * latent, 0.0f, 0.3f)) {
    for (int64_t t = 0; t < numQueries; ++t) // queries are the last tokens of the sequence
      positions.push_back(numKeys - numQueries + t);
  }

  MlaAttentionParams params(std::vector<float> &out) const {
    out.assign(numQueries * heads * value, 0.0f);
    MlaAttentionParams p;
    p.numQueries = numQueries;
    p.numKeys = numKeys;
    p.numHeads = heads;
    p.nopeDim = nope;
    p.ropeDim = rope;
    p.valueDim = value;
    p.latentDim = latent;
    p.softmaxScale = 1.0f / std::sqrt(float(nope + rope));
    p.queries = queries.data();
    p.queryPositions = positions.data();
    p.latents = latents.data();
    p.ropeKeys = ropeKeys.data();
    p.kvBProj = kvB.data();
    p.out = out.data();
    return p;
  }

  // Independent double-precision MHA with an explicit mask (true = attend): the −inf-mask
  // reference.
  std::vector<float> maskedReference(const std::vector<std::vector<bool>> &allowed) const {
    std::vector<float> out(numQueries * heads * value, 0.0f);
    const int64_t kvDim = nope + value;
    for (int64_t t = 0; t < numQueries; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        std::vector<double> logits(numKeys, -INFINITY);
        for (int64_t s = 0; s < numKeys; ++s) {
          if (!allowed[t][s])
            continue;
          double score = 0;
          for (int64_t d = 0; d < nope; ++d) {
            double kNope = 0;
            for (int64_t c = 0; c < latent; ++c)
              kNope += double(kvB[(h * kvDim + d) * latent + c]) * latents[s * latent + c];
            score += queries[(t * heads + h) * (nope + rope) + d] * kNope;
          }
          for (int64_t d = 0; d < rope; ++d)
            score += double(queries[(t * heads + h) * (nope + rope) + nope + d]) *
                     ropeKeys[s * rope + d];
          logits[s] = score / std::sqrt(double(nope + rope));
        }
        const double maxLogit = *std::max_element(logits.begin(), logits.end());
        double sum = 0;
        for (double &l : logits)
          sum += l = std::exp(l - maxLogit);
        for (int64_t s = 0; s < numKeys; ++s)
          for (int64_t d = 0; d < value; ++d) {
            double v = 0;
            for (int64_t c = 0; c < latent; ++c)
              v += double(kvB[(h * kvDim + nope + d) * latent + c]) * latents[s * latent + c];
            out[(t * heads + h) * value + d] += float(logits[s] / sum * v);
          }
      }
    return out;
  }
};

TEST(MlaAttention, DenseCausalMatchesMaskedReference) {
  std::mt19937 rng(11);
  const MlaProblem problem(rng);
  std::vector<std::vector<bool>> causal(problem.numQueries, std::vector<bool>(problem.numKeys));
  for (int64_t t = 0; t < problem.numQueries; ++t)
    for (int64_t s = 0; s < problem.numKeys; ++s)
      causal[t][s] = s <= problem.positions[t];
  std::vector<float> dense;
  mlaAttention(problem.params(dense));
  EXPECT_LE(maxAbsDiff(dense, problem.maskedReference(causal)), 1e-5f);
}

TEST(MlaAttention, SparseWithAllCausalPositionsEqualsDense) {
  std::mt19937 rng(12);
  const MlaProblem problem(rng);
  // Every causal position, shuffled, padded with −1 to a fixed width.
  const int64_t topK = problem.numKeys + 4;
  std::vector<int32_t> indices(problem.numQueries * topK, -1);
  for (int64_t t = 0; t < problem.numQueries; ++t) {
    std::vector<int32_t> row(problem.positions[t] + 1);
    std::iota(row.begin(), row.end(), 0);
    std::shuffle(row.begin(), row.end(), rng);
    std::copy(row.begin(), row.end(), indices.begin() + t * topK + 2); // −1s first, too
  }
  std::vector<float> dense, sparse;
  mlaAttention(problem.params(dense));
  MlaAttentionParams p = problem.params(sparse);
  p.sparseIndices = indices.data();
  p.topK = topK;
  mlaAttention(p);
  EXPECT_LE(maxAbsDiff(dense, sparse), 1e-6f);
}

TEST(MlaAttention, SparseSubsetEqualsDenseWithInfMask) {
  std::mt19937 rng(13);
  const MlaProblem problem(rng);
  const int64_t topK = 5;
  std::vector<int32_t> indices(problem.numQueries * topK, -1);
  std::vector<std::vector<bool>> allowed(problem.numQueries,
                                         std::vector<bool>(problem.numKeys, false));
  for (int64_t t = 0; t < problem.numQueries; ++t) {
    std::vector<int32_t> causal(problem.positions[t] + 1);
    std::iota(causal.begin(), causal.end(), 0);
    std::shuffle(causal.begin(), causal.end(), rng);
    const int64_t kept = t == 0 ? 1 : std::min<int64_t>(topK - (t % 2), causal.size());
    for (int64_t j = 0; j < kept; ++j) { // odd rows keep a −1 slot at the end
      indices[t * topK + j] = causal[j];
      allowed[t][causal[j]] = true;
    }
  }
  std::vector<float> sparse;
  MlaAttentionParams p = problem.params(sparse);
  p.sparseIndices = indices.data();
  p.topK = topK;
  mlaAttention(p);
  EXPECT_LE(maxAbsDiff(sparse, problem.maskedReference(allowed)), 1e-5f);
}

TEST(MlaAttention, QueryWithoutKeysOutputsZero) {
  std::mt19937 rng(14);
  const MlaProblem problem(rng);
  std::vector<int32_t> indices(problem.numQueries, -1);
  std::vector<float> out;
  MlaAttentionParams p = problem.params(out);
  p.sparseIndices = indices.data();
  p.topK = 1;
  mlaAttention(p);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.0f; }));
}

// The absorbed MQA form (§3.3) is the same attention: absorb the queries through W_UK, attend over
// the 576-wide latent keys, expand the latent outputs through W_UV; dense causal and sparse.
TEST(LatentAttention, AbsorbedFormEqualsTheMhaForm) {
  std::mt19937 rng(15);
  const MlaProblem problem(rng);
  const int64_t topK = 6;
  std::vector<int32_t> indices(problem.numQueries * topK, -1);
  for (int64_t t = 0; t < problem.numQueries; ++t) {
    std::vector<int32_t> causal(problem.positions[t] + 1);
    std::iota(causal.begin(), causal.end(), 0);
    std::shuffle(causal.begin(), causal.end(), rng);
    for (int64_t j = 0; j < std::min<int64_t>(topK - 1, causal.size()); ++j)
      indices[t * topK + j] = causal[j];
  }
  for (bool sparse : {false, true}) {
    SCOPED_TRACE(sparse ? "sparse" : "dense");
    std::vector<float> mha;
    MlaAttentionParams p = problem.params(mha);
    if (sparse) {
      p.sparseIndices = indices.data();
      p.topK = topK;
    }
    mlaAttention(p);

    const int64_t wide = problem.latent + problem.rope;
    std::vector<float> absorbed(problem.numQueries * problem.heads * wide);
    absorbMlaQueries(p, absorbed.data());
    std::vector<float> latentOut(problem.numQueries * problem.heads * problem.latent, -1.0f);
    LatentAttentionParams l;
    l.numQueries = problem.numQueries;
    l.numKeys = problem.numKeys;
    l.numHeads = problem.heads;
    l.latentDim = problem.latent;
    l.ropeDim = problem.rope;
    l.softmaxScale = p.softmaxScale;
    l.queries = absorbed.data();
    l.queryPositions = problem.positions.data();
    l.latents = problem.latents.data();
    l.ropeKeys = problem.ropeKeys.data();
    l.sparseIndices = p.sparseIndices;
    l.topK = p.topK;
    l.out = latentOut.data();
    latentAttention(l);
    std::vector<float> expanded(mha.size(), -1.0f);
    expandLatentOutputs(p, latentOut.data(), expanded.data());
    float largest = 0;
    for (float v : mha)
      largest = std::max(largest, std::abs(v));
    EXPECT_LE(maxAbsDiff(expanded, mha), 1e-5f * std::max(1.0f, largest));
  }
}

TEST(LatentAttention, QueryWithoutKeysOutputsZero) {
  const std::vector<float> query(2 * 6, 1.0f), latents(3 * 4, 1.0f), rope(3 * 2, 1.0f);
  const std::vector<int32_t> indices = {-1, -1};
  std::vector<float> out(2 * 4, 7.0f);
  LatentAttentionParams l;
  l.numQueries = 1;
  l.numKeys = 3;
  l.numHeads = 2;
  l.latentDim = 4;
  l.ropeDim = 2;
  l.softmaxScale = 0.5f;
  l.queries = query.data();
  l.latents = latents.data();
  l.ropeKeys = rope.data();
  l.sparseIndices = indices.data();
  l.topK = 2;
  l.out = out.data();
  latentAttention(l);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.0f; }));
}

} // namespace
} // namespace hybrid::kernels::ref
