// The decode GEMV's arithmetic (linear_gemv_sm90.cu), for kernels that compute some of its
// outputs themselves and must give its bits (the fused KDA decode's low-rank gates) or sum as it
// does (the FP8 decode GEMV). Internal to the kernels library.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace hybrid::kernels::cuda::gemv_arithmetic {

// The operands' 16-byte alignment the GEMVs' vector loads need.
inline bool aligned16(const void *pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

// 16 bytes of a stream read once: not kept in L1.
__device__ __forceinline__ uint4 loadStreaming(const void *pointer) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(pointer));
  return v;
}

// Eight consecutive inputs from `at` (16-byte aligned) as the dot products read them: fp32, or
// rounded to bf16 when the GEMM's inputs are.
__device__ __forceinline__ void inputChunk(const float *at, bool roundToBf16, float (&values)[8]) {
  const float4 *row = reinterpret_cast<const float4 *>(at);
  const float4 low = __ldg(row), high = __ldg(row + 1);
  const float loaded[8] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
#pragma unroll
  for (int i = 0; i < 8; ++i)
    values[i] = roundToBf16 ? __bfloat162float(__float2bfloat16(loaded[i])) : loaded[i];
}

// sum + x[0..7] . w, the 8 bf16 of `packed` (element 2i in the low half of word i), in k order.
__device__ __forceinline__ float dot8(const uint4 &packed, const float (&x)[8], float sum) {
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    sum = fmaf(x[2 * i], __uint_as_float(words[i] << 16), sum);
    sum = fmaf(x[2 * i + 1], __uint_as_float(words[i] & 0xffff0000u), sum);
  }
  return sum;
}

// An output's partial sums of a block's warps added in warp order from zero, stored to (or, with
// `accumulate`, added to) `target`.
template <int kWarps, int kColumns>
__device__ __forceinline__ void storeWarpsTotal(const float (&partial)[kWarps][kColumns],
                                                int column, bool accumulate, float &target) {
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w)
    total += partial[w][column];
  target = accumulate ? target + total : total;
}

} // namespace hybrid::kernels::cuda::gemv_arithmetic
