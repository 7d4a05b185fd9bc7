#include "hybrid/kernels/ref/Dsa.h"

#include "hybrid/kernels/ref/Math.h"
#include "hybrid/kernels/ref/Parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace hybrid::kernels::ref {

void indexerScores(const IndexerParams &p) {
  const float dotScale = 1.0f / std::sqrt(static_cast<float>(p.headDim));
  const float headScale = 1.0f / std::sqrt(static_cast<float>(p.numHeads));
  parallelFor(p.numQueries, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float *row = p.scores + t * p.numKeys;
      for (int64_t s = 0; s < p.numKeys; ++s) {
        if (s > p.queryPositions[t]) {
          row[s] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const float *key = p.keys + s * p.headDim;
        float score = 0.0f;
        for (int64_t j = 0; j < p.numHeads; ++j) {
          const float *query = p.queries + (t * p.numHeads + j) * p.headDim;
          const float relu = std::max(0.0f, dot(query, key, p.headDim) * dotScale);
          score += p.headWeights[t * p.numHeads + j] * headScale * relu;
        }
        row[s] = score;
      }
    }
  });
}

void topKIndices(std::span<const float> scores, int64_t numQueries, int64_t numKeys, int64_t topK,
                 std::span<int32_t> indices) {
  std::vector<std::pair<float, int32_t>> candidates;
  for (int64_t t = 0; t < numQueries; ++t) {
    candidates.clear();
    for (int64_t s = 0; s < numKeys; ++s) {
      const float score = scores[t * numKeys + s];
      if (std::isfinite(score))
        candidates.emplace_back(score, static_cast<int32_t>(s));
    }
    const int64_t kept = std::min<int64_t>(topK, static_cast<int64_t>(candidates.size()));
    std::partial_sort(candidates.begin(), candidates.begin() + kept, candidates.end(),
                      [](const auto &a, const auto &b) {
                        return a.first != b.first ? a.first > b.first : a.second < b.second;
                      });
    for (int64_t j = 0; j < topK; ++j)
      indices[t * topK + j] = j < kept ? candidates[j].second : -1;
  }
}

} // namespace hybrid::kernels::ref
