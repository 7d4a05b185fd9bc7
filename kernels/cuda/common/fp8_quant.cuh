// Device versions of the reference quantizers (kernels/ref/Quant.h), bit for bit: E4M3 and bf16
// rounding on the bits, the FP8 tile-scale rules and the MXFP8 RoundUp scale, with the same fp32
// operations as the reference so that a GPU-written cache or activation equals the cpu's.
#pragma once

#include "hybrid/kernels/cuda/Linear.h" // Fp8ActivationScale

#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

namespace hybrid::kernels::cuda::quant {

constexpr float kE4M3Max = 448.0f;
constexpr float kInverseE4M3Max = 1.0f / kE4M3Max; // DeepSeek multiplies by this fp32 value
constexpr float kDeepSeekAmaxFloor = 1e-4f;
constexpr float kFlashMlaScaleFloor = 1e-4f;
constexpr int kE4M3MaxExponent = 8; // 448 = 1.75 * 2^8

// value / 2^shift rounded to nearest, ties to even (0 < shift < 32).
__device__ inline uint32_t shiftRightRoundingToNearestEven(uint32_t value, int shift) {
  const uint32_t kept = value >> shift;
  const uint32_t remainder = value & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((remainder > half || (remainder == half && (kept & 1))) ? 1 : 0);
}

// ref::floatToE4M3 on the bits (saturating, NaN of either sign -> 0x7F, one rounding for
// subnormals), so the result does not depend on the hardware conversion's NaN/sign conventions.
__device__ inline uint8_t floatToE4M3(float value) {
  const uint32_t bits = __float_as_uint(value);
  const auto sign = uint8_t((bits & 0x80000000u) >> 24);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u)
    return 0x7F;
  if (magnitude >= __float_as_uint(kE4M3Max))
    return sign | 0x7E;
  const int exponent = int(magnitude >> 23) - 127;
  if (exponent >= -6) // normal E4M3: re-bias 127 -> 7, drop 20 mantissa bits
    return sign | uint8_t(shiftRightRoundingToNearestEven(magnitude - (120u << 23), 20));
  if ((magnitude >> 23) == 0)
    return sign; // fp32 zero or subnormal: far below half the smallest E4M3 step
  // E4M3 subnormals count units of 2^-9: significand * 2^(exponent - 23) / 2^-9.
  const int shift = 23 - 9 - exponent; // >= 21 here
  if (shift >= 32)
    return sign;
  const uint32_t significand = (magnitude & 0x007FFFFFu) | (1u << 23);
  return sign | uint8_t(shiftRightRoundingToNearestEven(significand, shift));
}

// ref::floatToBf16: round to nearest even; a NaN keeps its top bits with the quiet bit set.
__device__ inline uint16_t floatToBf16(float value) {
  const uint32_t bits = __float_as_uint(value);
  if (isnan(value))
    return uint16_t((bits >> 16) | 0x0040);
  return uint16_t(shiftRightRoundingToNearestEven(bits & 0x7FFFFFFFu, 16) |
                  ((bits & 0x80000000u) >> 16));
}

// ceil(log2 value) for a finite value > 0 (frexp, as the reference).
__device__ inline int ceilLog2(float value) {
  int exponent = 0;
  const float mantissa = frexpf(value, &exponent);
  return mantissa == 0.5f ? exponent - 1 : exponent;
}

enum class Fp8Rule { DeepSeekLinear, DeepSeekUe8m0, FlashMlaPow2 }; // ref::Fp8ScaleRule

// ref::fp8TileScale.
__device__ inline float fp8TileScale(float amax, Fp8Rule rule) {
  if (isinf(amax))
    return amax;
  switch (rule) {
  case Fp8Rule::DeepSeekLinear:
    return __fmul_rn(fmaxf(amax, kDeepSeekAmaxFloor), kInverseE4M3Max);
  case Fp8Rule::DeepSeekUe8m0:
    return ldexpf(1.0f, ceilLog2(__fmul_rn(fmaxf(amax, kDeepSeekAmaxFloor), kInverseE4M3Max)));
  case Fp8Rule::FlashMlaPow2:
    return ldexpf(1.0f, ceilLog2(fmaxf(__fdiv_rn(amax, kE4M3Max), kFlashMlaScaleFloor)));
  }
  return __int_as_float(0x7fc00000);
}

// ref::fp8TileScale for the FP8 GEMM's activation rules (Linear.h's Fp8ActivationScale).
__device__ inline float fp8TileScale(float amax, Fp8ActivationScale rule) {
  return fp8TileScale(amax, rule == Fp8ActivationScale::DeepSeekLinear ? Fp8Rule::DeepSeekLinear
                                                                       : Fp8Rule::DeepSeekUe8m0);
}

// ref::mxScaleCode with the RoundUp rule: the smallest e with amax <= 448 * 2^e, as E8M0.
__device__ inline uint8_t mxScaleCodeRoundUp(float amax) {
  if (!isfinite(amax))
    return 0xFF;
  if (amax == 0.0f)
    return 0;
  const int candidate = ceilLog2(amax) - (kE4M3MaxExponent + 1);
  const int exponent = ldexpf(amax, -candidate) <= kE4M3Max ? candidate : candidate + 1;
  return uint8_t(min(max(exponent, -127), 127) + 127);
}

// Two E4M3 codes (the low byte first) as floats, exactly (E4M3 fits in f16).
__device__ inline float2 fp8PairToFloat2(uint32_t pair) {
  const __half2_raw halves =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2 *>(&halves));
}

// Warp-collective: lane i's value of a 32-value block replaced by what its MXFP8 encoding
// (RoundUp scale) decodes to, as ref::quantizeMxfp8 then dequantizeMxfp8; a block with a
// non-finite value becomes NaNs. Every lane of the warp must call it.
__device__ inline float mxfp8RoundTrip(float value) {
  if (!__all_sync(0xffffffffu, isfinite(value)))
    return __int_as_float(0x7fc00000);
  float amax = fabsf(value);
  for (int offset = 16; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const int exponent = int(mxScaleCodeRoundUp(amax)) - 127; // finite: never the NaN code
  const uint8_t code = floatToE4M3(ldexpf(value, -exponent));
  const __half_raw decoded = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
  return ldexpf(__half2float(__half(decoded)), exponent); // exact: a power-of-two scale
}

} // namespace hybrid::kernels::cuda::quant
