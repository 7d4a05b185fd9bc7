// The last step of both MoE forms: each token's experts' outputs, weighted, added in ascending
// expert id (stable in the slot order), from zero: ref::moeExperts' order.
#pragma once

#include "hybrid/kernels/cuda/Moe.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace hybrid::kernels::cuda {

// Whether this launch holds expert `expert`: a valid id whose weights are present (an expert-
// parallel rank's experts held elsewhere have null pointers and add nothing).
__device__ inline bool expertHeld(const MoeExpertsParams &p, int32_t expert) {
  return expert >= 0 && expert < p.experts && p.gate[expert] != nullptr;
}

// A token's slots in ascending expert id (stable). One thread sorts; topK is small.
__device__ inline void sortSlotsByExpert(const int32_t *ids, int topK, int *order) {
  for (int k = 0; k < topK; ++k) {
    int at = k;
    while (at > 0 && ids[order[at - 1]] > ids[k]) {
      order[at] = order[at - 1];
      --at;
    }
    order[at] = k;
  }
}

// Column j of a token's combined output: the sum over its slots in `order` (expert order) of
// weights[slot] * rowAt(slot)[j], unfused multiply then add from zero; a null row (an invalid or
// absent expert) adds nothing. Every combine sums this way, so their outputs agree bit for bit.
template <typename RowAt>
__device__ inline float combinedColumn(const int *order, int topK, const float *weights, int64_t j,
                                       RowAt rowAt) {
  float sum = 0.0f;
  for (int k = 0; k < topK; ++k) {
    const int slot = order[k];
    const float *row = rowAt(slot);
    if (!row)
      continue;
    sum = __fadd_rn(sum, __fmul_rn(weights[slot], row[j]));
  }
  return sum;
}

// Block (token blockIdx.x, columns blockIdx.y * blockDim.x + threadIdx.x): out[token, j] = the
// sum over the token's slots, in expert order, of weights[token, slot] * y[rowOf(token, slot), j];
// a negative row (an invalid or absent expert) adds nothing. Contains a block barrier.
template <typename RowOf>
__device__ inline void combineToken(const MoeExpertsParams &p, const float *y, RowOf rowOf) {
  __shared__ int order[kMoeMaxTopK];
  const int token = blockIdx.x;
  const int32_t *ids = p.ids + int64_t(token) * p.topK;
  if (threadIdx.x == 0)
    sortSlotsByExpert(ids, p.topK, order);
  __syncthreads();
  const int64_t j = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= p.hidden)
    return;
  p.out[int64_t(token) * p.hidden + j] =
      combinedColumn(order, p.topK, p.weights + int64_t(token) * p.topK, j, [&](int slot) {
        const int64_t row = rowOf(token, slot);
        return row < 0 ? static_cast<const float *>(nullptr) : y + row * p.hidden;
      });
}

} // namespace hybrid::kernels::cuda
