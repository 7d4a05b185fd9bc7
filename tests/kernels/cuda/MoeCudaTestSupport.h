// Shared by the MoE kernel tests (MoeCudaTest, MoeExchangeCudaTest).
#pragma once

#include "hybrid/kernels/cuda/Moe.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace hybrid::kernels {

// The experts' fields every experts test sets the same way, from its device buffers.
inline cuda::MoeExpertsParams expertsParams(int tokens, int hidden, int inner, int experts,
                                            int topK, const float *x, const int32_t *ids,
                                            const float *weights, const uint64_t *gate,
                                            const uint64_t *up, const uint64_t *down,
                                            void *workspace) {
  cuda::MoeExpertsParams p;
  p.tokens = tokens;
  p.hidden = hidden;
  p.intermediate = inner;
  p.experts = experts;
  p.topK = topK;
  p.x = x;
  p.ids = ids;
  p.weights = weights;
  p.gate = reinterpret_cast<const void *const *>(gate);
  p.up = reinterpret_cast<const void *const *>(up);
  p.down = reinterpret_cast<const void *const *>(down);
  p.workspace = workspace;
  return p;
}

// cuda::setFp8Experts with the scale-pointer arrays as the tests hold them (device buffers of
// pointers as integers).
inline void setFp8Experts(cuda::MoeExpertsParams &p, const uint64_t *gateScales,
                          const uint64_t *upScales, const uint64_t *downScales) {
  cuda::setFp8Experts(p, reinterpret_cast<const float *const *>(gateScales),
                      reinterpret_cast<const float *const *>(upScales),
                      reinterpret_cast<const float *const *>(downScales));
}

// A step's routing: each token's topK distinct experts in a random order (a shuffle of all the
// experts per token), the k-th of them weighted first + step * k.
struct RandomRouting {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};
inline RandomRouting randomRouting(int tokens, int experts, int topK, float first, float step,
                                   std::mt19937 &rng) {
  RandomRouting r;
  std::vector<int32_t> order(static_cast<size_t>(experts));
  for (int t = 0; t < tokens; ++t) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int k = 0; k < topK; ++k) {
      r.ids.push_back(order[size_t(k)]);
      r.weights.push_back(first + step * float(k));
    }
  }
  return r;
}

} // namespace hybrid::kernels
