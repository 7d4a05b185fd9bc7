#include "hybrid/kernels/ref/Quant.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

namespace hybrid::kernels::ref {
namespace {

constexpr uint32_t kFloatSignMask = 0x80000000u;
constexpr uint32_t kFloatMagnitudeMask = 0x7FFFFFFFu;
constexpr uint32_t kFloatInfinityBits = 0x7F800000u;
constexpr uint32_t kFloatMantissaMask = 0x007FFFFFu;
constexpr int kFloatMantissaBits = 23;
constexpr int kFloatExponentBias = 127;

constexpr int kE4M3ExponentBias = 7;
constexpr int kE4M3MantissaBits = 3;
constexpr int kE4M3MaxExponent = 8;    // 448 = 1.75 · 2^8
constexpr int kE4M3MinExponent = -6;   // smallest normal 2^−6
constexpr int kE4M3SubnormalLog2 = -9; // smallest subnormal 2^−9 = 2^(−6 − 3)

constexpr int kE8M0Bias = 127;
constexpr int kE8M0MinExponent = -127;
constexpr int kE8M0MaxExponent = 127;

// DeepSeek's act_quant: amax is floored at 1e-4 and multiplied by the fp32 reciprocal of 448.
constexpr float kDeepSeekAmaxFloor = 1e-4f;
constexpr float kDeepSeekInverseE4M3Max = 1.0f / kE4M3Max;
// FlashMLA's quantize_k_cache floors the scale (amax / 448) itself at 1e-4.
constexpr float kFlashMlaScaleFloor = 1e-4f;

constexpr int64_t kFloatBytes = 4;
constexpr int64_t kBf16Bytes = 2;

// value / 2^shift rounded to the nearest integer, ties to even.
uint32_t shiftRightRoundingToNearestEven(uint32_t value, int shift) {
  if (shift <= 0)
    return value;
  if (shift >= 32)
    return 0; // callers pass values below 2^31, so the quotient is below one half
  const uint32_t kept = value >> shift;
  const uint32_t remainder = value & ((uint32_t{1} << shift) - 1);
  const uint32_t half = uint32_t{1} << (shift - 1);
  const bool roundUp = remainder > half || (remainder == half && (kept & 1) != 0);
  return kept + (roundUp ? 1 : 0);
}

// floor(log2 value) and ceil(log2 value) for a finite value > 0, exact: frexp does not round. For
// normal values ceilLog2 equals DeepSeek's fast_log2_ceil (the fp32 exponent, plus one when any
// mantissa bit is set).
int floorLog2(float value) {
  int exponent = 0;
  std::frexp(value, &exponent); // value = m · 2^exponent, m in [0.5, 1)
  return exponent - 1;
}

int ceilLog2(float value) {
  int exponent = 0;
  const float mantissa = std::frexp(value, &exponent);
  return mantissa == 0.5f ? exponent - 1 : exponent;
}

// Smallest integer e with amax ≤ 448 · 2^e, for a finite amax > 0, without rounding amax / 448:
// 2^(c−1) < amax ≤ 2^c with c = ceil(log2 amax) puts amax · 2^(9−c) in (256, 512] (an exact
// scaling by a power of two), so one comparison with 448 decides between c − 9 and c − 8.
int smallestExponentFittingE4M3(float amax) {
  const int candidate = ceilLog2(amax) - (kE4M3MaxExponent + 1);
  return std::ldexp(amax, -candidate) <= kE4M3Max ? candidate : candidate + 1;
}

float powerOfTwo(int exponent) { return std::ldexp(1.0f, exponent); }

// Largest |x| over a run of values; NaN values are ignored (std::fmax semantics).
float absoluteMax(const float *values, int64_t count) {
  float amax = 0.0f;
  for (int64_t i = 0; i < count; ++i)
    amax = std::fmax(amax, std::fabs(values[i]));
  return amax;
}

bool allFinite(const float *values, int64_t count) {
  return std::all_of(values, values + count, [](float v) { return std::isfinite(v); });
}

template <typename T> bool hasSize(std::span<T> values, int64_t expected) {
  return expected >= 0 && static_cast<int64_t>(values.size()) == expected;
}

void storeLittleEndian32(uint32_t value, uint8_t *out) {
  for (int byte = 0; byte < 4; ++byte)
    out[byte] = static_cast<uint8_t>(value >> (8 * byte));
}

uint32_t loadLittleEndian32(const uint8_t *in) {
  uint32_t value = 0;
  for (int byte = 0; byte < 4; ++byte)
    value |= uint32_t{in[byte]} << (8 * byte);
  return value;
}

void storeLittleEndian16(uint16_t value, uint8_t *out) {
  out[0] = static_cast<uint8_t>(value);
  out[1] = static_cast<uint8_t>(value >> 8);
}

uint16_t loadLittleEndian16(const uint8_t *in) {
  return static_cast<uint16_t>(in[0] | (in[1] << 8));
}

// One tile of the fp32-scale format: returns s and writes the codes of x / s.
float quantizeTile(const float *x, int64_t count, Fp8ScaleRule rule, uint8_t *codes) {
  const float scale = fp8TileScale(absoluteMax(x, count), rule);
  // floatToE4M3 saturates, which is the clamp to [−448, 448] of the references.
  for (int64_t i = 0; i < count; ++i)
    codes[i] = floatToE4M3(x[i] / scale);
  return scale;
}

void dequantizeTile(const uint8_t *codes, int64_t count, float scale, float *x) {
  for (int64_t i = 0; i < count; ++i)
    x[i] = e4m3ToFloat(codes[i]) * scale;
}

} // namespace

// ---- Scalar formats

uint8_t floatToE4M3(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint8_t>((bits & kFloatSignMask) >> 24);
  const uint32_t magnitude = bits & kFloatMagnitudeMask;
  if (magnitude > kFloatInfinityBits)
    return kE4M3NaNCode;
  if (magnitude >= std::bit_cast<uint32_t>(kE4M3Max))
    return sign | kE4M3MaxCode;

  const int exponent = static_cast<int>(magnitude >> kFloatMantissaBits) - kFloatExponentBias;
  if (exponent >= kE4M3MinExponent) {
    // Normal: re-bias the exponent field (127 → 7) and round away 20 of the 23 mantissa bits. A
    // mantissa carry moves into the exponent field, which is the right result; below 448 it never
    // reaches the NaN pattern.
    const uint32_t rebiased =
        magnitude -
        (static_cast<uint32_t>(kFloatExponentBias - kE4M3ExponentBias) << kFloatMantissaBits);
    return sign | static_cast<uint8_t>(shiftRightRoundingToNearestEven(
                      rebiased, kFloatMantissaBits - kE4M3MantissaBits));
  }
  if ((magnitude >> kFloatMantissaBits) == 0)
    return sign; // fp32 zero or subnormal (< 2^−126): far below half the smallest E4M3 step
  // Subnormal range: count in units of 2^−9. value = significand · 2^(exponent − 23), so
  // value / 2^−9 = significand / 2^(23 − 9 − exponent); 8 units is the smallest normal, whose code
  // is 0x08 as well.
  const uint32_t significand =
      (magnitude & kFloatMantissaMask) | (uint32_t{1} << kFloatMantissaBits);
  const int shift = kFloatMantissaBits + kE4M3SubnormalLog2 - exponent;
  return sign | static_cast<uint8_t>(shiftRightRoundingToNearestEven(significand, shift));
}

float e4m3ToFloat(uint8_t code) {
  if ((code & 0x7F) == kE4M3NaNCode)
    return std::numeric_limits<float>::quiet_NaN();
  const int exponentField = (code >> kE4M3MantissaBits) & 0xF;
  const int mantissa = code & 0x7;
  const float magnitude = exponentField == 0
                              ? std::ldexp(static_cast<float>(mantissa), kE4M3SubnormalLog2)
                              : std::ldexp(static_cast<float>(8 + mantissa),
                                           exponentField - kE4M3ExponentBias - kE4M3MantissaBits);
  return (code & 0x80) != 0 ? -magnitude : magnitude;
}

float e8m0ToFloat(uint8_t code) {
  if (code == kE8M0NaNCode)
    return std::numeric_limits<float>::quiet_NaN();
  return powerOfTwo(static_cast<int>(code) - kE8M0Bias);
}

uint16_t floatToBf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  // Rounding the low half of a NaN away could leave an infinity; force the quiet bit instead.
  if (std::isnan(value))
    return static_cast<uint16_t>((bits >> 16) | 0x0040);
  return static_cast<uint16_t>(shiftRightRoundingToNearestEven(bits & kFloatMagnitudeMask, 16) |
                               ((bits & kFloatSignMask) >> 16));
}

float bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

// ---- MXFP8

uint8_t mxScaleCode(float amax, MxScaleRule rule) {
  if (!std::isfinite(amax))
    return kE8M0NaNCode;
  if (amax == 0.0f)
    return 0;
  const int exponent = rule == MxScaleRule::OcpFloor ? floorLog2(amax) - kE4M3MaxExponent
                                                     : smallestExponentFittingE4M3(amax);
  return static_cast<uint8_t>(std::clamp(exponent, kE8M0MinExponent, kE8M0MaxExponent) + kE8M0Bias);
}

bool quantizeMxfp8(std::span<const float> x, int64_t rows, int64_t cols,
                   std::span<uint8_t> elements, std::span<uint8_t> scales, MxScaleRule rule) {
  if (rows < 0 || cols < 0 || cols % kMxBlockSize != 0 || !hasSize(x, rows * cols) ||
      !hasSize(elements, rows * cols) || !hasSize(scales, rows * (cols / kMxBlockSize)))
    return false;
  const int64_t blocks = rows * (cols / kMxBlockSize);
  for (int64_t block = 0; block < blocks; ++block) {
    const float *in = x.data() + block * kMxBlockSize;
    uint8_t *codes = elements.data() + block * kMxBlockSize;
    if (!allFinite(in, kMxBlockSize)) {
      scales[block] = kE8M0NaNCode;
      std::fill_n(codes, kMxBlockSize, kE4M3NaNCode);
      continue;
    }
    const uint8_t scaleCode = mxScaleCode(absoluteMax(in, kMxBlockSize), rule);
    scales[block] = scaleCode;
    // v / X as an exact power-of-two scaling, then one rounding (saturating) to E4M3.
    const int scaleExponent = static_cast<int>(scaleCode) - kE8M0Bias;
    for (int64_t i = 0; i < kMxBlockSize; ++i)
      codes[i] = floatToE4M3(std::ldexp(in[i], -scaleExponent));
  }
  return true;
}

bool dequantizeMxfp8(std::span<const uint8_t> elements, std::span<const uint8_t> scales,
                     int64_t rows, int64_t cols, std::span<float> x) {
  if (rows < 0 || cols < 0 || cols % kMxBlockSize != 0 || !hasSize(elements, rows * cols) ||
      !hasSize(scales, rows * (cols / kMxBlockSize)) || !hasSize(x, rows * cols))
    return false;
  for (int64_t i = 0; i < rows * cols; ++i)
    x[i] = e4m3ToFloat(elements[i]) * e8m0ToFloat(scales[i / kMxBlockSize]);
  return true;
}

bool roundTripMxfp8(std::span<float> x, int64_t rows, int64_t cols, MxScaleRule rule) {
  std::vector<uint8_t> elements(x.size()), scales(x.size() / kMxBlockSize);
  return quantizeMxfp8(x, rows, cols, elements, scales, rule) &&
         dequantizeMxfp8(elements, scales, rows, cols, x);
}

// ---- FP8 tiles

float fp8TileScale(float amax, Fp8ScaleRule rule) {
  // The reference kernels all end with s = +inf for an infinite amax; keep that (and keep frexp
  // away from infinities).
  if (std::isinf(amax))
    return amax;
  switch (rule) {
  case Fp8ScaleRule::DeepSeekLinear:
    return std::fmax(amax, kDeepSeekAmaxFloor) * kDeepSeekInverseE4M3Max;
  case Fp8ScaleRule::DeepSeekUe8m0:
    return powerOfTwo(ceilLog2(std::fmax(amax, kDeepSeekAmaxFloor) * kDeepSeekInverseE4M3Max));
  case Fp8ScaleRule::FlashMlaPow2:
    return powerOfTwo(ceilLog2(std::fmax(amax / kE4M3Max, kFlashMlaScaleFloor)));
  }
  return std::numeric_limits<float>::quiet_NaN();
}

int64_t fp8TileCount(int64_t cols, int64_t tile) { return (cols + tile - 1) / tile; }

bool quantizeFp8Tiles(std::span<const float> x, int64_t rows, int64_t cols, int64_t tile,
                      Fp8ScaleRule rule, std::span<uint8_t> elements, std::span<float> scales) {
  if (rows < 0 || cols < 0 || tile <= 0 || !hasSize(x, rows * cols) ||
      !hasSize(elements, rows * cols) || !hasSize(scales, rows * fp8TileCount(cols, tile)))
    return false;
  const int64_t tiles = fp8TileCount(cols, tile);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t offset = r * cols + t * tile;
      scales[r * tiles + t] = quantizeTile(x.data() + offset, std::min(tile, cols - t * tile), rule,
                                           elements.data() + offset);
    }
  return true;
}

bool dequantizeFp8Tiles(std::span<const uint8_t> elements, std::span<const float> scales,
                        int64_t rows, int64_t cols, int64_t tile, std::span<float> x) {
  if (rows < 0 || cols < 0 || tile <= 0 || !hasSize(elements, rows * cols) ||
      !hasSize(scales, rows * fp8TileCount(cols, tile)) || !hasSize(x, rows * cols))
    return false;
  const int64_t tiles = fp8TileCount(cols, tile);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t offset = r * cols + t * tile;
      dequantizeTile(elements.data() + offset, std::min(tile, cols - t * tile),
                     scales[r * tiles + t], x.data() + offset);
    }
  return true;
}

bool roundTripFp8Tiles(std::span<float> x, int64_t rows, int64_t cols, int64_t tile,
                       Fp8ScaleRule rule) {
  if (rows < 0 || cols < 0 || tile <= 0)
    return false;
  std::vector<uint8_t> elements(x.size());
  std::vector<float> scales(static_cast<size_t>(rows * fp8TileCount(cols, tile)));
  return quantizeFp8Tiles(x, rows, cols, tile, rule, elements, scales) &&
         dequantizeFp8Tiles(elements, scales, rows, cols, tile, x);
}

// ---- FlashMLA KV row

int64_t kvRowBytes(int64_t latentDim, int64_t ropeDim, int64_t tile) {
  return latentDim + kFloatBytes * fp8TileCount(latentDim, tile) + kBf16Bytes * ropeDim;
}

bool packFp8KvRow(std::span<const float> latent, std::span<const float> rope,
                  std::span<uint8_t> row, int64_t tile) {
  const auto latentDim = static_cast<int64_t>(latent.size());
  const auto ropeDim = static_cast<int64_t>(rope.size());
  if (tile <= 0 || !hasSize(row, kvRowBytes(latentDim, ropeDim, tile)))
    return false;
  const int64_t tiles = fp8TileCount(latentDim, tile);
  uint8_t *scaleBytes = row.data() + latentDim;
  uint8_t *ropeBytes = scaleBytes + kFloatBytes * tiles;
  for (int64_t t = 0; t < tiles; ++t) {
    const float scale = quantizeTile(latent.data() + t * tile, std::min(tile, latentDim - t * tile),
                                     Fp8ScaleRule::FlashMlaPow2, row.data() + t * tile);
    storeLittleEndian32(std::bit_cast<uint32_t>(scale), scaleBytes + kFloatBytes * t);
  }
  for (int64_t i = 0; i < ropeDim; ++i)
    storeLittleEndian16(floatToBf16(rope[i]), ropeBytes + kBf16Bytes * i);
  return true;
}

bool unpackFp8KvRow(std::span<const uint8_t> row, std::span<float> latent, std::span<float> rope,
                    int64_t tile) {
  const auto latentDim = static_cast<int64_t>(latent.size());
  const auto ropeDim = static_cast<int64_t>(rope.size());
  if (tile <= 0 || !hasSize(row, kvRowBytes(latentDim, ropeDim, tile)))
    return false;
  const int64_t tiles = fp8TileCount(latentDim, tile);
  const uint8_t *scaleBytes = row.data() + latentDim;
  const uint8_t *ropeBytes = scaleBytes + kFloatBytes * tiles;
  for (int64_t t = 0; t < tiles; ++t) {
    const auto scale = std::bit_cast<float>(loadLittleEndian32(scaleBytes + kFloatBytes * t));
    dequantizeTile(row.data() + t * tile, std::min(tile, latentDim - t * tile), scale,
                   latent.data() + t * tile);
  }
  for (int64_t i = 0; i < ropeDim; ++i)
    rope[i] = bf16ToFloat(loadLittleEndian16(ropeBytes + kBf16Bytes * i));
  return true;
}

// ---- Indexer key

int64_t indexKeyBytes(int64_t dim) { return dim + kFloatBytes; }

bool packFp8IndexKey(std::span<const float> key, std::span<uint8_t> out, Fp8ScaleRule rule) {
  const auto dim = static_cast<int64_t>(key.size());
  if (!hasSize(out, indexKeyBytes(dim)))
    return false;
  const float scale = quantizeTile(key.data(), dim, rule, out.data());
  storeLittleEndian32(std::bit_cast<uint32_t>(scale), out.data() + dim);
  return true;
}

bool unpackFp8IndexKey(std::span<const uint8_t> in, std::span<float> key) {
  const auto dim = static_cast<int64_t>(key.size());
  if (!hasSize(in, indexKeyBytes(dim)))
    return false;
  const auto scale = std::bit_cast<float>(loadLittleEndian32(in.data() + dim));
  dequantizeTile(in.data(), dim, scale, key.data());
  return true;
}

} // namespace hybrid::kernels::ref
