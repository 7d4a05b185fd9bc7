// Shared by the MoE kernel tests (MoeCudaTest, MoeExchangeCudaTest).
#pragma once

#include "hybrid/kernels/cuda/Moe.h"

#include <cstdint>

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

} // namespace hybrid::kernels
