#include "hybrid/kernels/ref/AttnRes.h"
#include "hybrid/kernels/ref/Math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace hybrid::kernels::ref {

void attnResMix(std::span<const float *const> candidates, int64_t numTokens, int64_t dim,
                std::span<const float> normWeight, std::span<const float> projWeight, float eps,
                std::span<float> out) {
  const int64_t count = static_cast<int64_t>(candidates.size());
  std::vector<float> scores(count), key(dim);
  for (int64_t t = 0; t < numTokens; ++t) {
    float maxScore = -std::numeric_limits<float>::infinity();
    for (int64_t m = 0; m < count; ++m) {
      const float *value = candidates[m] + t * dim;
      const float inverseRms = 1.0f / std::sqrt(dot(value, value, dim) / dim + eps);
      for (int64_t d = 0; d < dim; ++d)
        key[d] = normWeight[d] * (value[d] * inverseRms);
      scores[m] = dot(projWeight.data(), key.data(), dim);
      maxScore = std::max(maxScore, scores[m]);
    }
    float sum = 0.0f;
    for (float &score : scores)
      sum += score = std::exp(score - maxScore);
    float *mixed = out.data() + t * dim;
    std::fill(mixed, mixed + dim, 0.0f);
    for (int64_t m = 0; m < count; ++m) {
      const float weight = scores[m] / sum;
      const float *value = candidates[m] + t * dim;
      for (int64_t d = 0; d < dim; ++d)
        mixed[d] += weight * value[d];
    }
  }
}

} // namespace hybrid::kernels::ref
