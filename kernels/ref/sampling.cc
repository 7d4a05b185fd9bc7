// Token choice (see Sampling.h): the straightforward serial form of the definition.
#include "hybrid/kernels/ref/Sampling.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

namespace hybrid::kernels::ref {

std::string samplingParamsProblem(const SamplingParams &p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f)
    return "temperature must be a finite number >= 0, got " + std::to_string(p.temperature);
  if (p.topK < 0)
    return "top_k must be >= 0, got " + std::to_string(p.topK);
  if (!(p.topP > 0.0f && p.topP <= 1.0f))
    return "top_p must be in (0, 1], got " + std::to_string(p.topP);
  return {};
}

bool samplingIsGreedy(const SamplingParams &p) { return p.temperature <= 0.0f || p.topK == 1; }

float samplingUniform(uint64_t seed, uint64_t counter) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (counter + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return float(z >> 40) * (1.0f / 16777216.0f);
}

int64_t sampleToken(std::span<const float> logits, const SamplingParams &p, float uniform) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  int64_t best = -1;
  for (int64_t i = 0; i < vocab; ++i)
    if (!std::isnan(logits[size_t(i)]) && (best < 0 || logits[size_t(i)] > logits[size_t(best)]))
      best = i;
  if (best < 0 || samplingIsGreedy(p) || std::isinf(logits[size_t(best)]))
    return best < 0 ? 0 : best;

  std::vector<float> scaled(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i)
    scaled[size_t(i)] = std::isnan(logits[size_t(i)]) ? -INFINITY : logits[size_t(i)] / p.temperature;
  const float m = scaled[size_t(best)];
  float threshold = -INFINITY;
  if (p.topK > 0 && p.topK < vocab) {
    std::vector<float> sorted = scaled;
    std::nth_element(sorted.begin(), sorted.begin() + (p.topK - 1), sorted.end(), std::greater<>());
    threshold = sorted[size_t(p.topK - 1)];
  }
  std::vector<float> w(static_cast<size_t>(vocab), 0.0f);
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i)
    if (scaled[size_t(i)] >= threshold && scaled[size_t(i)] > -INFINITY) {
      w[size_t(i)] = std::exp(scaled[size_t(i)] - m);
      total += w[size_t(i)];
    }
  float tau = 0.0f;
  if (p.topP < 1.0f) {
    std::vector<float> sorted;
    for (float v : w)
      if (v > 0.0f)
        sorted.push_back(v);
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    const double mass = double(p.topP) * total;
    // Sums over {w >= tau} include every tie of tau: advance past equal values before testing.
    double sum = 0.0;
    for (size_t j = 0; j < sorted.size();) {
      size_t k = j;
      while (k < sorted.size() && sorted[k] == sorted[j])
        sum += sorted[k++];
      if (sum >= mass) {
        tau = sorted[j];
        break;
      }
      j = k;
    }
  }
  double kept = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < vocab; ++i)
    if (w[size_t(i)] > 0.0f && w[size_t(i)] >= tau) {
      kept += w[size_t(i)];
      last = i;
    }
  const double target = double(uniform) * kept;
  double running = 0.0;
  for (int64_t i = 0; i < vocab; ++i)
    if (w[size_t(i)] > 0.0f && w[size_t(i)] >= tau) {
      running += w[size_t(i)];
      if (running > target)
        return i;
    }
  return last;
}

} // namespace hybrid::kernels::ref
