#include "hybrid/kernels/ref/AttnRes.h"

#include "TestUtil.h"

#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <random>
#include <vector>

namespace hybrid::kernels::ref {
namespace {

using testing::maxAbsDiff;
using testing::randomNormal;

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

// MODEL_SPEC 6.2's AR written out in double: K̂ = V / sqrt(mean(V²) + eps), score_m =
// Σ_d K̂[m,d] · norm[d] · proj[d], p = softmax_m(score), out = Σ_m p_m V_m.
std::vector<double> mixInDouble(const std::vector<std::vector<float>> &values, int64_t tokens,
                                int64_t dim, const std::vector<float> &norm,
                                const std::vector<float> &proj, double eps) {
  std::vector<double> out(tokens * dim, 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> scores;
    for (const std::vector<float> &v : values) {
      double squares = 0;
      for (int64_t d = 0; d < dim; ++d)
        squares += double(v[t * dim + d]) * v[t * dim + d];
      const double inverseRms = 1.0 / std::sqrt(squares / dim + eps);
      double score = 0;
      for (int64_t d = 0; d < dim; ++d)
        score += v[t * dim + d] * inverseRms * norm[d] * proj[d];
      scores.push_back(score);
    }
    double denominator = 0;
    for (double score : scores)
      denominator += std::exp(score);
    for (size_t m = 0; m < values.size(); ++m)
      for (int64_t d = 0; d < dim; ++d)
        out[t * dim + d] += std::exp(scores[m]) / denominator * values[m][t * dim + d];
  }
  return out;
}

float maxAbsDiffToDouble(const std::vector<float> &a, const std::vector<double> &b) {
  double worst = a.size() == b.size() ? 0.0 : INFINITY;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - b[i]));
  return static_cast<float>(worst);
}

std::vector<float> mixOf(const std::vector<std::vector<float>> &values, int64_t tokens,
                         int64_t dim, const std::vector<float> &norm,
                         const std::vector<float> &proj, float eps) {
  std::vector<const float *> candidates;
  for (const std::vector<float> &v : values)
    candidates.push_back(v.data());
  std::vector<float> out(tokens * dim);
  attnResMix(candidates, tokens, dim, norm, proj, eps, out);
  return out;
}

TEST(AttnRes, MixEqualsTheSection62EquationsOnRandomTensors) {
  std::mt19937 rng(62);
  const int64_t tokens = 5, dim = 96;
  for (int candidates : {1, 2, 3, 9}) { // 9: Kimi K3's output mix (8 blocks + the partial sum)
    SCOPED_TRACE(candidates);
    std::vector<std::vector<float>> values;
    for (int m = 0; m < candidates; ++m) // blocks of different scales: RMSNorm removes them
      values.push_back(randomNormal(rng, tokens * dim, 0.0f, 0.5f + 2.0f * m));
    const std::vector<float> norm = randomNormal(rng, dim, 1.0f, 0.1f);
    const std::vector<float> proj = randomNormal(rng, dim, 0.0f, 0.3f);
    const std::vector<float> mixed = mixOf(values, tokens, dim, norm, proj, 1e-5f);
    const std::vector<double> expected = mixInDouble(values, tokens, dim, norm, proj, 1e-5);
    EXPECT_LT(maxAbsDiffToDouble(mixed, expected), 1e-5f * (1 + 2 * candidates));
    if (candidates == 1) { // a single candidate is the identity, whatever the weights
      EXPECT_LT(maxAbsDiff(mixed, values[0]), 1e-6f);
    }
  }
}

// A decoder of L layers whose sub-layers are fixed random maps f(x) = tanh(x W), for the
// bookkeeping tests below. Weights per sub-layer: the AR norm and proj (query) vectors.
struct ToyDecoder {
  int64_t tokens = 3, dim = 16, layers = 0;
  float eps = 1e-6f;
  std::vector<std::vector<float>> attnW, mlpW;               // [dim, dim] per layer
  std::vector<std::vector<float>> attnNorm, attnProj, mlpNorm, mlpProj;
  std::vector<float> outNorm, outProj, embedding;

  ToyDecoder(int64_t numLayers, std::mt19937 &rng) : layers(numLayers) {
    for (int64_t l = 0; l < layers; ++l) {
      attnW.push_back(randomNormal(rng, dim * dim, 0.0f, 0.4f));
      mlpW.push_back(randomNormal(rng, dim * dim, 0.0f, 0.4f));
      attnNorm.push_back(randomNormal(rng, dim, 1.0f, 0.1f));
      attnProj.push_back(randomNormal(rng, dim, 0.0f, 0.5f));
      mlpNorm.push_back(randomNormal(rng, dim, 1.0f, 0.1f));
      mlpProj.push_back(randomNormal(rng, dim, 0.0f, 0.5f));
    }
    outNorm = randomNormal(rng, dim, 1.0f, 0.1f);
    outProj = randomNormal(rng, dim, 0.0f, 0.5f);
    embedding = randomNormal(rng, tokens * dim);
  }

  template <typename T> std::vector<T> apply(const std::vector<float> &w, const std::vector<T> &x) const {
    std::vector<T> y(tokens * dim, T(0));
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < dim; ++j) {
        T sum = 0;
        for (int64_t i = 0; i < dim; ++i)
          sum += x[t * dim + i] * T(w[i * dim + j]);
        y[t * dim + j] = std::tanh(sum);
      }
    return y;
  }
};

std::vector<float> add(std::vector<float> a, const std::vector<float> &b) {
  for (size_t i = 0; i < a.size(); ++i)
    a[i] += b[i];
  return a;
}

// MODEL_SPEC 6.2, Kimi K3 form, with the reference mix: the block bookkeeping the importer
// builds as IR. Records how many candidates each mix saw.
std::vector<float> blockAttnResK3(const ToyDecoder &m, int64_t blockSize,
                                  std::vector<size_t> *attnCandidates = nullptr,
                                  size_t *outputCandidates = nullptr) {
  std::vector<std::vector<float>> blocks;
  std::vector<float> h = m.embedding;
  for (int64_t layer = 0; layer < m.layers; ++layer) {
    std::optional<std::vector<float>> prefix = h;
    auto withPrefix = [&] {
      std::vector<std::vector<float>> list = blocks;
      list.push_back(*prefix);
      return list;
    };
    if (attnCandidates)
      attnCandidates->push_back(blocks.empty() ? 0 : blocks.size() + 1);
    if (!blocks.empty())
      h = mixOf(withPrefix(), m.tokens, m.dim, m.attnNorm[layer], m.attnProj[layer], m.eps);
    if (layer % blockSize == 0) {
      blocks.push_back(*prefix);
      prefix.reset();
    }
    std::vector<float> a = m.apply(m.attnW[layer], h);
    prefix = prefix ? add(*prefix, a) : a;
    h = mixOf(withPrefix(), m.tokens, m.dim, m.mlpNorm[layer], m.mlpProj[layer], m.eps);
    prefix = add(*prefix, m.apply(m.mlpW[layer], h));
    h = *prefix;
  }
  std::vector<std::vector<float>> list = blocks;
  list.push_back(h);
  if (outputCandidates)
    *outputCandidates = list.size();
  return mixOf(list, m.tokens, m.dim, m.outNorm, m.outProj, m.eps);
}

// The Attention-Residuals README pseudocode (MODEL_SPEC 6.2), in double: block_size counts
// sub-layers (2 per decoder layer), layer_number is 0-based, blocks start empty and the partial
// sum starts as the embedding.
std::vector<double> blockAttnResReadme(const ToyDecoder &m, int64_t subLayerBlockSize) {
  auto toDouble = [](const std::vector<float> &v) { return std::vector<double>(v.begin(), v.end()); };
  auto mix = [&](const std::vector<std::vector<double>> &values, const std::vector<float> &norm,
                 const std::vector<float> &proj) {
    std::vector<double> out(m.tokens * m.dim, 0.0);
    for (int64_t t = 0; t < m.tokens; ++t) {
      std::vector<double> scores;
      for (const std::vector<double> &v : values) {
        double squares = 0, score = 0;
        for (int64_t d = 0; d < m.dim; ++d)
          squares += v[t * m.dim + d] * v[t * m.dim + d];
        const double inverseRms = 1.0 / std::sqrt(squares / m.dim + m.eps);
        for (int64_t d = 0; d < m.dim; ++d)
          score += v[t * m.dim + d] * inverseRms * norm[d] * proj[d];
        scores.push_back(score);
      }
      double denominator = 0;
      for (double score : scores)
        denominator += std::exp(score);
      for (size_t k = 0; k < values.size(); ++k)
        for (int64_t d = 0; d < m.dim; ++d)
          out[t * m.dim + d] += std::exp(scores[k]) / denominator * values[k][t * m.dim + d];
    }
    return out;
  };
  auto plus = [](std::vector<double> a, const std::vector<double> &b) {
    for (size_t i = 0; i < a.size(); ++i)
      a[i] += b[i];
    return a;
  };
  std::vector<std::vector<double>> blocks;
  std::optional<std::vector<double>> partial = toDouble(m.embedding);
  for (int64_t n = 0; n < m.layers; ++n) {
    std::vector<std::vector<double>> list = blocks;
    list.push_back(*partial);
    std::vector<double> h = mix(list, m.attnNorm[n], m.attnProj[n]);
    if (n % (subLayerBlockSize / 2) == 0) {
      blocks.push_back(*partial);
      partial.reset();
    }
    std::vector<double> a = m.apply<double>(m.attnW[n], h);
    partial = partial ? plus(*partial, a) : a;
    list = blocks;
    list.push_back(*partial);
    h = mix(list, m.mlpNorm[n], m.mlpProj[n]);
    partial = plus(*partial, m.apply<double>(m.mlpW[n], h));
  }
  std::vector<std::vector<double>> list = blocks;
  list.push_back(*partial);
  return mix(list, m.outNorm, m.outProj);
}

TEST(BlockAttnRes, K3FormEqualsTheReadmePseudocodeAcrossBlockBoundaries) {
  std::mt19937 rng(63);
  for (int64_t layers : {1, 2, 3, 5, 7, 9})
    for (int64_t blockSize : {1, 2, 3, 4, 12}) {
      SCOPED_TRACE("L=" + std::to_string(layers) + " S=" + std::to_string(blockSize));
      const ToyDecoder decoder(layers, rng);
      const std::vector<float> k3 = blockAttnResK3(decoder, blockSize);
      const std::vector<double> readme = blockAttnResReadme(decoder, 2 * blockSize);
      EXPECT_LT(maxAbsDiffToDouble(k3, readme), 2e-5f);
    }
}

TEST(BlockAttnRes, CandidateCountsFollowTheBlocks) {
  std::mt19937 rng(64);
  // MODEL_SPEC 6.3: the attention-side mix of layer l sees ceil(l / S) completed blocks plus the
  // partial sum (layer 0: no mix); the output mix ceil(L / S) blocks plus the last partial sum.
  for (auto [layers, blockSize] : {std::pair<int64_t, int64_t>{7, 3}, {4, 2}, {6, 6}, {5, 1}}) {
    SCOPED_TRACE("L=" + std::to_string(layers) + " S=" + std::to_string(blockSize));
    const ToyDecoder decoder(layers, rng);
    std::vector<size_t> attnCandidates;
    size_t outputCandidates = 0;
    blockAttnResK3(decoder, blockSize, &attnCandidates, &outputCandidates);
    for (int64_t l = 0; l < layers; ++l) {
      const size_t blocks = static_cast<size_t>((l + blockSize - 1) / blockSize);
      EXPECT_EQ(attnCandidates[l], l == 0 ? 0 : blocks + 1) << "layer " << l;
    }
    EXPECT_EQ(outputCandidates, static_cast<size_t>((layers + blockSize - 1) / blockSize) + 1);
  }
  // Kimi K3: 93 layers in blocks of 12 -> pushes at 0, 12, ..., 84 -> 9 output candidates.
  EXPECT_EQ((93 + 12 - 1) / 12 + 1, 9);
}

TEST(FullAttnRes, EachSubLayerMixesEveryEarlierOutput) {
  // MODEL_SPEC 6.1: h_l = Σ_{i<l} α_{i→l} v_i, v_0 = embedding, v_i = f_i(h_i), α from
  // φ(w_l, k_i) = exp(w_lᵀ RMSNorm(k_i)) with k_i = v_i; no residual add. The reference mix
  // over all earlier outputs against the equations in double, over 8 sub-layers.
  std::mt19937 rng(61);
  const ToyDecoder m(4, rng); // 4 layers = 8 sub-layers (attention, MLP alternating)
  std::vector<std::vector<float>> outputs = {m.embedding};
  std::vector<std::vector<double>> outputsInDouble = {
      std::vector<double>(m.embedding.begin(), m.embedding.end())};
  for (int64_t sub = 0; sub < 2 * m.layers; ++sub) {
    const int64_t layer = sub / 2;
    const bool attention = sub % 2 == 0;
    const std::vector<float> &norm = attention ? m.attnNorm[layer] : m.mlpNorm[layer];
    const std::vector<float> &query = attention ? m.attnProj[layer] : m.mlpProj[layer];
    const std::vector<float> &w = attention ? m.attnW[layer] : m.mlpW[layer];
    const std::vector<float> h = mixOf(outputs, m.tokens, m.dim, norm, query, m.eps);
    // α_{i→l} = φ(q, k_i) / Σ_j φ(q, k_j), q = norm ⊙ query (the RMSNorm weight folded in).
    std::vector<double> expected(m.tokens * m.dim, 0.0);
    for (int64_t t = 0; t < m.tokens; ++t) {
      std::vector<double> phi;
      double total = 0;
      for (const std::vector<double> &v : outputsInDouble) {
        double squares = 0, dot = 0;
        for (int64_t d = 0; d < m.dim; ++d)
          squares += v[t * m.dim + d] * v[t * m.dim + d];
        for (int64_t d = 0; d < m.dim; ++d)
          dot += double(norm[d]) * query[d] * v[t * m.dim + d] / std::sqrt(squares / m.dim + m.eps);
        phi.push_back(std::exp(dot));
        total += phi.back();
      }
      for (size_t i = 0; i < outputsInDouble.size(); ++i)
        for (int64_t d = 0; d < m.dim; ++d)
          expected[t * m.dim + d] += phi[i] / total * outputsInDouble[i][t * m.dim + d];
    }
    EXPECT_LT(maxAbsDiffToDouble(h, expected), 2e-5f) << "sub-layer " << sub;
    outputs.push_back(m.apply(w, h));
    outputsInDouble.push_back(m.apply<double>(w, expected));
  }
  // A zero query weighs every earlier output equally (the paper's zero initialisation).
  const std::vector<float> zero(m.dim, 0.0f), ones(m.dim, 1.0f);
  const std::vector<float> uniform = mixOf(outputs, m.tokens, m.dim, ones, zero, m.eps);
  std::vector<float> mean(m.tokens * m.dim, 0.0f);
  for (const std::vector<float> &v : outputs)
    for (size_t i = 0; i < mean.size(); ++i)
      mean[i] += v[i] / outputs.size();
  EXPECT_LT(maxAbsDiff(uniform, mean), 1e-6f);
}

} // namespace
} // namespace hybrid::kernels::ref
