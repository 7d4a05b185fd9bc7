// Small helpers shared by the reference-kernel tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace hybrid::kernels::ref::testing {

inline std::vector<float> randomNormal(std::mt19937 &rng, size_t count, float mean = 0.0f,
                                       float stddev = 1.0f) {
  std::normal_distribution<float> distribution(mean, stddev);
  std::vector<float> values(count);
  for (float &value : values)
    value = distribution(rng);
  return values;
}

inline std::vector<float> randomUniform(std::mt19937 &rng, size_t count, float low, float high) {
  std::uniform_real_distribution<float> distribution(low, high);
  std::vector<float> values(count);
  for (float &value : values)
    value = distribution(rng);
  return values;
}

inline float maxAbsDiff(std::span<const float> a, std::span<const float> b) {
  float worst = a.size() == b.size() ? 0.0f : INFINITY;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

} // namespace hybrid::kernels::ref::testing
