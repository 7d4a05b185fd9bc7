#include "hybrid/kernels/ref/Moe.h"

#include "hybrid/kernels/ref/Linear.h"
#include "hybrid/kernels/ref/Math.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace hybrid::kernels::ref {
namespace {

// Indices of the `count` largest values, best first; ties go to the lower index.
std::vector<int64_t> largest(const std::vector<float> &values, int64_t count) {
  std::vector<int64_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return values[a] > values[b]; });
  order.resize(std::min<int64_t>(count, static_cast<int64_t>(order.size())));
  return order;
}

} // namespace

void routeTokens(std::span<const float> routerLogits, int64_t numTokens, const RouterParams &p,
                 std::span<int32_t> expertIds, std::span<float> expertWeights) {
  const int64_t E = p.numExperts;
  assert(E % p.numGroups == 0);
  const int64_t groupSize = E / p.numGroups;
  const bool hasBias = !p.correctionBias.empty();
  const float minusInf = -std::numeric_limits<float>::infinity();
  std::vector<float> scores(E), choice(E), groupScores(p.numGroups);
  for (int64_t t = 0; t < numTokens; ++t) {
    const float *logits = routerLogits.data() + t * E;
    if (p.scoring == RouterScoring::Sigmoid) {
      for (int64_t e = 0; e < E; ++e)
        scores[e] = sigmoid(logits[e]);
    } else {
      const float maxLogit = *std::max_element(logits, logits + E);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e)
        sum += scores[e] = std::exp(logits[e] - maxLogit);
      for (float &score : scores)
        score /= sum;
    }
    // The correction bias steers the choice only.
    for (int64_t e = 0; e < E; ++e)
      choice[e] = scores[e] + (hasBias ? p.correctionBias[e] : 0.0f);

    if (p.numGroups > 1) {
      for (int64_t group = 0; group < p.numGroups; ++group) {
        std::vector<float> members(choice.begin() + group * groupSize,
                                   choice.begin() + (group + 1) * groupSize);
        std::sort(members.begin(), members.end(), std::greater<float>());
        groupScores[group] = hasBias && groupSize >= 2 ? members[0] + members[1] : members[0];
      }
      std::vector<bool> keepGroup(p.numGroups, false);
      for (int64_t group : largest(groupScores, p.topKGroups))
        keepGroup[group] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keepGroup[e / groupSize])
          choice[e] = minusInf;
    }

    const std::vector<int64_t> chosen = largest(choice, p.topK);
    assert(static_cast<int64_t>(chosen.size()) == p.topK);
    float sum = 0.0f;
    for (int64_t k = 0; k < p.topK; ++k) {
      const int64_t expert = chosen[k];
      const float weight = p.weightsFromBiasedScores ? choice[expert] : scores[expert];
      expertIds[t * p.topK + k] = static_cast<int32_t>(expert);
      expertWeights[t * p.topK + k] = weight;
      sum += weight;
    }
    for (int64_t k = 0; k < p.topK; ++k) {
      float &weight = expertWeights[t * p.topK + k];
      if (p.renormalize)
        weight /= sum + 1e-20f;
      weight *= p.routedScalingFactor;
    }
  }
}

float gatedActivation(const GatedActivation &activation, float gate, float up) {
  if (activation.kind == GatedActivation::Kind::Silu)
    return silu(gate) * up;
  const float beta = activation.beta, linearBeta = activation.linearBeta;
  const float cappedUp = linearBeta > 0.0f ? linearBeta * std::tanh(up / linearBeta) : up;
  return beta * std::tanh(gate / beta) * sigmoid(gate) * cappedUp;
}

void swiGluMlp(std::span<const float> x, int64_t numTokens, const SwiGluWeights &w,
               std::span<float> out) {
  const int64_t hidden = w.hiddenSize, inner = w.intermediateSize;
  std::vector<float> gate(numTokens * inner), up(numTokens * inner);
  auto project = [&](std::span<const float> in, std::span<const float> weight,
                     std::span<float> result, int64_t inFeatures, int64_t outFeatures) {
    if (w.fp8Activations)
      linearFp8Activations(in, weight, result, numTokens, inFeatures, outFeatures,
                           *w.fp8Activations);
    else
      linear(in, weight, result, numTokens, inFeatures, outFeatures);
  };
  project(x, w.gateProj, gate, hidden, inner);
  project(x, w.upProj, up, hidden, inner);
  for (size_t i = 0; i < gate.size(); ++i)
    gate[i] = gatedActivation(w.activation, gate[i], up[i]);
  project(gate, w.downProj, out, inner, hidden);
}

void moeExperts(std::span<const float> x, int64_t numTokens, int64_t hiddenSize,
                std::span<const int32_t> expertIds, std::span<const float> expertWeights,
                int64_t topK, std::span<const SwiGluWeights> experts,
                std::span<const SwiGluWeights> sharedExperts, std::span<float> out) {
  std::fill(out.begin(), out.begin() + numTokens * hiddenSize, 0.0f);
  // Expert by expert: gather its tokens, run it once on all of them, scatter-add the weighted rows.
  std::vector<int64_t> tokens;
  std::vector<float> weights, gathered, result;
  for (int64_t e = 0; e < static_cast<int64_t>(experts.size()); ++e) {
    tokens.clear();
    weights.clear();
    for (int64_t t = 0; t < numTokens; ++t)
      for (int64_t k = 0; k < topK; ++k)
        if (expertIds[t * topK + k] == e) {
          tokens.push_back(t);
          weights.push_back(expertWeights[t * topK + k]);
        }
    if (tokens.empty())
      continue;
    const int64_t rows = static_cast<int64_t>(tokens.size());
    gathered.resize(rows * hiddenSize);
    result.resize(rows * hiddenSize);
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(x.data() + tokens[r] * hiddenSize, hiddenSize, gathered.data() + r * hiddenSize);
    swiGluMlp(gathered, rows, experts[e], result);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < hiddenSize; ++d)
        out[tokens[r] * hiddenSize + d] += weights[r] * result[r * hiddenSize + d];
  }
  result.resize(numTokens * hiddenSize);
  for (const SwiGluWeights &shared : sharedExperts) {
    swiGluMlp(x, numTokens, shared, result);
    for (int64_t i = 0; i < numTokens * hiddenSize; ++i)
      out[i] += result[i];
  }
}

} // namespace hybrid::kernels::ref
