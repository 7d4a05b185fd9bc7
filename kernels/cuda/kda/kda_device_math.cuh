// Device helpers shared by the KDA kernels: activations and block reductions.
#pragma once

#include "hybrid/kernels/cuda/KdaDecode.h"
#include "../common/block_reduce.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace hybrid::kernels::cuda::kda_math {

// The recurrent state in either storage type (KdaStateType), computed in fp32.
__device__ inline float loadState(const float *at) { return *at; }
__device__ inline float loadState(const __nv_bfloat16 *at) { return __bfloat162float(*at); }
__device__ inline void storeState(float *at, float value) { *at = value; }
__device__ inline void storeState(__nv_bfloat16 *at, float value) {
  *at = __float2bfloat16(value);
}

// Calls launch(StateTag<State>{}) with State the C++ type of `type`'s state elements (a tag, as
// the kernels are C++17: no template lambdas).
template <typename T> struct StateTag {
  using type = T;
};
template <typename Launch> int withStateType(KdaStateType type, Launch &&launch) {
  switch (type) {
  case KdaStateType::F32:
    return launch(StateTag<float>{});
  case KdaStateType::BF16:
    return launch(StateTag<__nv_bfloat16>{});
  }
  return cudaErrorInvalidValue;
}

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ inline float softplus(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }

// Approximate forms for kernels whose other rounding is far larger (the chunked prefill's bf16
// operands): the hardware exp2 / log2 with denormals flushed to zero (ex2.approx.ftz: one
// instruction, where __expf without -ftz adds a denormal rescue around it) and a reciprocal
// instead of an IEEE division. Relative error ~1e-7; results below 1e-38 become 0.
__device__ inline float fastExp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
__device__ inline float fastLog(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y * 0.6931471805599453f;
}
__device__ inline float fastSigmoid(float x) { return __fdividef(1.0f, 1.0f + fastExp(-x)); }
// log(1 + e^x) = max(x, 0) + log(1 + e^-|x|): no branch, no overflow.
__device__ inline float fastSoftplus(float x) {
  return fmaxf(x, 0.0f) + fastLog(1.0f + fastExp(-fabsf(x)));
}

// The forget gate of one key channel as a log decay g <= 0, from f + dt_bias and
// scaleA = exp(A_log[head]): softplus form or Kimi K3's lower-bound form.
__device__ inline float forgetLogDecay(float shiftedForget, float scaleA,
                                       const KdaLayerWeights &w) {
  return w.lowerBoundGate ? w.lowerBound * sigmoid(scaleA * shiftedForget)
                          : -scaleA * softplus(shiftedForget);
}
// The same with the approximate forms and the gate kind known at compile time.
template <bool kLowerBound>
__device__ inline float fastForgetLogDecay(float shiftedForget, float scaleA, float lowerBound) {
  if constexpr (kLowerBound)
    return lowerBound * fastSigmoid(scaleA * shiftedForget);
  else
    return -scaleA * fastSoftplus(shiftedForget);
}
// The same gate as the decay factor exp(g).
__device__ inline float forgetDecay(float shiftedForget, float scaleA, const KdaLayerWeights &w) {
  return __expf(forgetLogDecay(shiftedForget, scaleA, w));
}

using reduce::accumulate; // warp and block sums: common/block_reduce.cuh
using reduce::blockSum;
using reduce::warpSum;

// One token's delta rule on one value column of a head's state, the column's rows split over
// kGroups threads (rows [firstRow, firstRow + kRows) in `s`, in registers):
//   S <- diag(decay) S;  u = beta (v - S^T k);  S += k u^T;  o = S^T q.
// query/key/decay are the head's K values (shared memory); `value` is needed in group 0 only.
// `partial` [kGroups][kColumns] and `update` [kColumns] are shared scratch. With kStoreState the
// updated rows are stored to `stateColumn` (stride `rowStride`) as soon as they are final. Returns
// o for the column in group 0 (0 elsewhere). Contains block barriers: call from every thread.
template <int kRows, int kGroups, int kColumns, bool kStoreState, typename State>
__device__ inline float deltaRuleColumn(float (&s)[kRows], const float *query, const float *key,
                                        const float *decay, float beta, float value, int firstRow,
                                        int group, int column, float (*partial)[kColumns],
                                        float *update, State *stateColumn, int rowStride) {
  float predicted = 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    s[r] *= decay[firstRow + r];
    predicted += s[r] * key[firstRow + r];
  }
  partial[group][column] = predicted;
  __syncthreads();
  if (group == 0) {
    float total = 0.0f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g)
      total += partial[g][column];
    update[column] = beta * (value - total);
  }
  __syncthreads();
  const float u = update[column];
  float o = 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    s[r] += key[firstRow + r] * u;
    o += s[r] * query[firstRow + r];
    if constexpr (kStoreState)
      storeState(stateColumn + size_t(r) * rowStride, s[r]);
  }
  partial[group][column] = o; // every group read `partial` for the prediction before the sync above
  __syncthreads();
  if (group != 0)
    return 0.0f;
  o = 0.0f;
#pragma unroll
  for (int g = 0; g < kGroups; ++g)
    o += partial[g][column];
  return o;
}

} // namespace hybrid::kernels::cuda::kda_math
