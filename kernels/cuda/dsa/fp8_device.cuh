// FP8 decoding shared by the DSA kernels: E8M0 scales to fp32, E4M3 code pairs to bf16, exactly.
#pragma once

#include "../common/warp_mma.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace hybrid::kernels::cuda {

// E8M0: 2^(code - 127); 0xFF is NaN (ref::e8m0ToFloat).
__device__ inline float e8m0ToFloat(uint8_t code) {
  if (code == 0xFF)
    return __int_as_float(0x7fc00000);
  return code == 0 ? __int_as_float(0x00400000) : __int_as_float(int(code) << 23);
}

// Two E4M3 codes (the low byte first) times `scale` as a bf16 pair: one hardware conversion to
// f16 (exact), then fp32; exact in bf16 when the products are (codes times a power of two).
__device__ inline uint32_t e4m3PairToBf16(uint16_t pair, float scale) {
  const __half2_raw halves = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
  const float2 values = __half22float2(*reinterpret_cast<const __half2 *>(&halves));
  return mma::packBf16(values.x * scale, values.y * scale);
}

} // namespace hybrid::kernels::cuda
