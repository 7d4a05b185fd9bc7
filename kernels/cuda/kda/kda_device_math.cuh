// Device helpers shared by the KDA kernels: activations and block reductions.
#pragma once

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda::kda_math {

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ inline float softplus(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }

__device__ inline float warpSum(float value) {
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}
__device__ inline float2 warpSum(float2 value) { return {warpSum(value.x), warpSum(value.y)}; }
__device__ inline void accumulate(float &total, float value) { total += value; }
__device__ inline void accumulate(float2 &total, float2 value) {
  total.x += value.x;
  total.y += value.y;
}

// Sum over the block (a float, or two at once as a float2 to share the barriers); every thread gets
// the total. `scratch` holds one T per warp.
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

} // namespace hybrid::kernels::cuda::kda_math
