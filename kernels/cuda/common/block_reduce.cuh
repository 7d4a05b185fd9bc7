// Warp and block sums shared by the kernel families: every lane (thread) gets the total, and a
// block's warp totals are added in warp order from zero, so a sum has the same bits every run.
#pragma once

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda::reduce {

__device__ inline float warpSum(float value) {
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}
__device__ inline float2 warpSum(float2 value) { return {warpSum(value.x), warpSum(value.y)}; }
// The warp's largest value (fmaxf: a NaN lane does not count).
__device__ inline float warpMax(float value) {
  for (int offset = 16; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}
__device__ inline void accumulate(float &total, float value) { total += value; }
__device__ inline void accumulate(float2 &total, float2 value) {
  total.x += value.x;
  total.y += value.y;
}

// Sum over a block of kThreads threads (a float, or two at once as a float2 to share the
// barriers). `scratch` holds one T per warp. Contains block barriers: call from every thread.
template <int kThreads, typename T> __device__ inline T blockSum(T value, T *scratch) {
  constexpr int kWarps = kThreads / 32;
  value = warpSum(value);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads(); // scratch may still be read by a previous reduction
  if (lane == 0)
    scratch[warp] = value;
  __syncthreads();
  T total{};
#pragma unroll
  for (int w = 0; w < kWarps; ++w)
    accumulate(total, scratch[w]);
  return total;
}

} // namespace hybrid::kernels::cuda::reduce
