// FP8 decoding shared by the DSA kernels: E8M0 scales to fp32, E4M3 code pairs to bf16 or f16,
// exactly.
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

// Four E4M3 codes (the low byte first) times a power-of-two `scale` <= 2^7 as two bf16 pairs, by
// bit moves: each code goes to a 16-bit lane over a byte of its sign (prmt's sign replication),
// four bits up, masked: sign, exponent and mantissa then sit in a bf16's fields and read as the
// value times 2^-120 (E4M3 subnormals land on bf16 subnormals with the same factor); one packed
// bf16 multiply by 2^120 * scale restores it exactly. Four instructions per pair instead of six
// for the f16 -> fp32 -> bf16 route; e4m3PairToBf16 is the general form.
__device__ inline uint32_t e4m3PairFields(uint32_t codes, uint32_t selector) {
  uint32_t lanes;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(lanes) : "r"(codes), "r"(selector));
  return (lanes << 4) & 0x87F087F0u;
}
__device__ inline void e4m3QuadToBf16(uint32_t codes, __nv_bfloat162 factor, uint32_t &low,
                                      uint32_t &high) {
  // Selector nibbles 8 + i: the sign of byte i replicated.
  const uint32_t fields[2] = {e4m3PairFields(codes, 0x9180u), e4m3PairFields(codes, 0xB3A2u)};
  const __nv_bfloat162 a = __hmul2(*reinterpret_cast<const __nv_bfloat162 *>(&fields[0]), factor);
  const __nv_bfloat162 b = __hmul2(*reinterpret_cast<const __nv_bfloat162 *>(&fields[1]), factor);
  low = *reinterpret_cast<const uint32_t *>(&a);
  high = *reinterpret_cast<const uint32_t *>(&b);
}

// Whether e4m3QuadToBf16 is exact for `scale`: a power of two no larger than 2^7 (2^120 * scale
// must be a finite bf16).
__device__ inline bool quadConversionExact(float scale) {
  return scale > 0.0f && scale <= 128.0f && (__float_as_uint(scale) & 0x007FFFFFu) == 0;
}

// Four E4M3 codes (the low byte first) as two f16 pairs, low = codes 0, 1 and high = codes 2, 3, by
// the hardware converter: one instruction a pair (the high half read in place), exact (every E4M3
// value is an f16).
__device__ inline void e4m3QuadToF16(uint32_t codes, uint32_t &low, uint32_t &high) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
      "cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(low), "=r"(high)
      : "r"(codes));
}

// 2^e (e <= 15) as an f16 pair: f16's subnormals below 2^-14, 0 below 2^-25.
__device__ inline uint32_t f16PowerOfTwoPair(int e) {
  const float value = __int_as_float((max(e, -126) + 127) << 23);
  return mma::packF16(value, value);
}

// An f16 pair times an f16 pair (IEEE round to nearest; exact for a power-of-two factor whose
// products are f16 values).
__device__ inline uint32_t f16PairProduct(uint32_t pair, uint32_t factor) {
  uint32_t product;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(product) : "r"(pair), "r"(factor));
  return product;
}

} // namespace hybrid::kernels::cuda
