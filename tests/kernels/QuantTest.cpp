// Reference quantizers (kernels/ref/quant.cc): exhaustive E4M3 checks, E8M0, bf16, MXFP8 with both
// scale rules, DeepSeek/FlashMLA FP8 tiles, the FlashMLA V32 KV row and the indexer key row.
#include "hybrid/kernels/ref/Quant.h"

#include "TestUtil.h"
#include "hybrid/runtime/Safetensors.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <gtest/gtest.h>
#include <limits>
#include <random>
#include <vector>

namespace hybrid::kernels::ref {
namespace {

using testing::randomNormal;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

bool isPowerOfTwo(float value) {
  int exponent = 0;
  return value > 0.0f && std::frexp(value, &exponent) == 0.5f;
}

uint32_t littleEndian32(const uint8_t *bytes) {
  return uint32_t{bytes[0]} | uint32_t{bytes[1]} << 8 | uint32_t{bytes[2]} << 16 |
         uint32_t{bytes[3]} << 24;
}

uint16_t littleEndian16(const uint8_t *bytes) {
  return static_cast<uint16_t>(bytes[0] | bytes[1] << 8);
}

// The 127 non-negative finite E4M3 values by code (0x00 … 0x7E), computed from the format
// definition with doubles.
std::vector<double> e4m3PositiveValues() {
  std::vector<double> values;
  for (int code = 0; code <= 0x7E; ++code) {
    const int exponent = code >> 3, mantissa = code & 7;
    values.push_back(exponent == 0 ? std::ldexp(mantissa, -9)
                                   : std::ldexp(1.0 + mantissa / 8.0, exponent - 7));
  }
  return values;
}

// Independent oracle: nearest value of the table, ties to the even code, saturating at 448.
uint8_t nearestE4M3(float value, const std::vector<double> &table) {
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const double magnitude = std::fabs(static_cast<double>(value));
  if (magnitude >= table.back())
    return sign | 0x7E;
  const auto above = std::lower_bound(table.begin(), table.end(), magnitude);
  const auto upperCode = static_cast<int>(above - table.begin());
  if (*above == magnitude || upperCode == 0)
    return sign | static_cast<uint8_t>(upperCode);
  const int lowerCode = upperCode - 1;
  const double toLower = magnitude - table[lowerCode], toUpper = *above - magnitude;
  const int code = toLower < toUpper   ? lowerCode
                   : toUpper < toLower ? upperCode
                                       : (lowerCode % 2 == 0 ? lowerCode : upperCode);
  return sign | static_cast<uint8_t>(code);
}

// ---- E4M3

TEST(E4M3, DecodesLikeTheFormatTableAndTheSafetensorsReader) {
  const auto table = e4m3PositiveValues();
  for (int code = 0; code < 256; ++code) {
    const auto byte = static_cast<uint8_t>(code);
    const float decoded = e4m3ToFloat(byte);
    if ((code & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(decoded)) << code;
      EXPECT_TRUE(std::isnan(safetensors::f8e4m3ToFloat(byte))) << code;
      continue;
    }
    const double expected = (code & 0x80 ? -1.0 : 1.0) * table[code & 0x7F];
    EXPECT_EQ(static_cast<double>(decoded), expected) << code;
    EXPECT_EQ(std::bit_cast<uint32_t>(decoded),
              std::bit_cast<uint32_t>(safetensors::f8e4m3ToFloat(byte)))
        << code;
  }
  EXPECT_EQ(e4m3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(e4m3ToFloat(0xFE), -448.0f);
  EXPECT_EQ(e4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3ToFloat(0x08), std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::signbit(e4m3ToFloat(0x80)));
}

TEST(E4M3, EveryCodeReencodesToItself) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F)
      continue; // NaN: every NaN encodes to 0x7F
    const auto byte = static_cast<uint8_t>(code);
    EXPECT_EQ(floatToE4M3(e4m3ToFloat(byte)), byte) << code; // includes −0 → 0x80
  }
  EXPECT_EQ(floatToE4M3(kNaN), 0x7F);
  EXPECT_EQ(floatToE4M3(-kNaN), 0x7F);
  EXPECT_EQ(floatToE4M3(e4m3ToFloat(0xFF)), 0x7F);
}

TEST(E4M3, MidpointsRoundToTheEvenCode) {
  for (int code = 0; code < 0x7E; ++code) {
    const float lower = e4m3ToFloat(static_cast<uint8_t>(code));
    const float upper = e4m3ToFloat(static_cast<uint8_t>(code + 1));
    const float midpoint = (lower + upper) / 2; // exact: E4M3 values need 4 significant bits
    ASSERT_EQ(static_cast<double>(midpoint), (double(lower) + double(upper)) / 2);
    const int even = code % 2 == 0 ? code : code + 1;
    for (uint8_t sign : {uint8_t{0x00}, uint8_t{0x80}}) {
      const float s = sign ? -1.0f : 1.0f;
      EXPECT_EQ(floatToE4M3(s * midpoint), sign | even) << code;
      EXPECT_EQ(floatToE4M3(s * std::nextafter(midpoint, 0.0f)), sign | code) << code;
      EXPECT_EQ(floatToE4M3(s * std::nextafter(midpoint, kInf)), sign | (code + 1)) << code;
    }
  }
}

TEST(E4M3, SaturatesAtTheLargestFiniteValue) {
  // 464 is the midpoint to 480, the value the NaN pattern would have had.
  for (float value : {448.0f, std::nextafter(448.0f, kInf), 460.0f, 464.0f, 479.0f, 480.0f, 1.0e6f,
                      std::numeric_limits<float>::max(), kInf}) {
    EXPECT_EQ(floatToE4M3(value), 0x7E) << value;
    EXPECT_EQ(floatToE4M3(-value), 0xFE) << value;
  }
  EXPECT_EQ(floatToE4M3(std::nextafter(432.0f, 0.0f)), 0x7D); // just below 432: 416 (0x7D)
  EXPECT_EQ(floatToE4M3(432.0f), 0x7E);                       // tie 416 | 448 → even 0x7E
}

TEST(E4M3, HandCheckedValues) {
  EXPECT_EQ(floatToE4M3(1.0f), 0x38);
  EXPECT_EQ(floatToE4M3(-2.0f), 0xC0);
  EXPECT_EQ(floatToE4M3(1.5f), 0x3C);
  EXPECT_EQ(floatToE4M3(240.0f), 0x77); // 1.875 · 2^7
  EXPECT_EQ(floatToE4M3(0.3f), 0x2A);   // 0.3 → 0.3125 = 1.25 · 2^−2
  EXPECT_EQ(floatToE4M3(std::ldexp(7.0f, -9)), 0x07);
  EXPECT_EQ(floatToE4M3(std::ldexp(7.5f, -9)), 0x08);  // tie between 0x07 and 0x08 → even
  EXPECT_EQ(floatToE4M3(std::ldexp(1.0f, -10)), 0x00); // tie between 0 and 2^−9 → 0
  EXPECT_EQ(floatToE4M3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(floatToE4M3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(floatToE4M3(-std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(floatToE4M3(0.0f), 0x00);
  EXPECT_EQ(floatToE4M3(-0.0f), 0x80);
}

TEST(E4M3, MatchesTheNearestValueOracleOnASweepOfFloats) {
  const auto table = e4m3PositiveValues();
  // Every 1021st fp32 bit pattern from 0 to just past 480, both signs, plus random magnitudes.
  int64_t checked = 0;
  for (uint32_t bits = 0; bits < 0x43F10000u; bits += 1021) {
    const float value = std::bit_cast<float>(bits);
    ASSERT_EQ(floatToE4M3(value), nearestE4M3(value, table)) << value;
    ASSERT_EQ(floatToE4M3(-value), nearestE4M3(-value, table)) << -value;
    ++checked;
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> logMagnitude(-14.0f, 10.0f);
  for (int i = 0; i < 200000; ++i) {
    const float value = std::exp2(logMagnitude(rng)) * (i % 2 ? -1.0f : 1.0f);
    ASSERT_EQ(floatToE4M3(value), nearestE4M3(value, table)) << value;
  }
  EXPECT_GT(checked, 1000000);
}

// ---- E8M0 and bf16

TEST(E8M0, DecodesPowersOfTwoWithBias127) {
  EXPECT_EQ(e8m0ToFloat(127), 1.0f);
  EXPECT_EQ(e8m0ToFloat(128), 2.0f);
  EXPECT_EQ(e8m0ToFloat(120), 1.0f / 128);
  EXPECT_EQ(e8m0ToFloat(254), std::ldexp(1.0f, 127));
  EXPECT_EQ(e8m0ToFloat(0), std::ldexp(1.0f, -127)); // an fp32 subnormal, still exact
  EXPECT_GT(e8m0ToFloat(0), 0.0f);
  EXPECT_TRUE(std::isnan(e8m0ToFloat(0xFF)));
  for (int code = 0; code < 255; ++code)
    EXPECT_TRUE(isPowerOfTwo(e8m0ToFloat(static_cast<uint8_t>(code)))) << code;
}

TEST(Bf16, RoundsToNearestEvenLikeTheSafetensorsWriter) {
  EXPECT_EQ(floatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(floatToBf16(-2.5f), 0xC020);
  EXPECT_EQ(floatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);       // tie → even (down)
  EXPECT_EQ(floatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);   // tie → even (up)
  EXPECT_EQ(floatToBf16(std::numeric_limits<float>::max()), 0x7F80); // past the range: inf
  EXPECT_TRUE(std::isnan(bf16ToFloat(floatToBf16(kNaN))));
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> anyBits;
  for (int i = 0; i < 100000; ++i) {
    const float value = std::bit_cast<float>(anyBits(rng));
    if (std::isnan(value))
      continue;
    ASSERT_EQ(floatToBf16(value), safetensors::floatToBf16(value)) << value;
    ASSERT_EQ(std::bit_cast<uint32_t>(bf16ToFloat(floatToBf16(value))),
              std::bit_cast<uint32_t>(safetensors::bf16ToFloat(floatToBf16(value))));
  }
}

// ---- MXFP8

std::vector<float> blockOf32(std::vector<float> head) {
  head.resize(kMxBlockSize, 0.0f);
  return head;
}

TEST(Mxfp8, HandCaseBothRulesAgreeWhenAmaxIs448TimesAPowerOfTwo) {
  // amax = 896 = 448 · 2: OcpFloor 2^(9 − 8) = 2, RoundUp 2^ceil(log2 2) = 2.
  const auto x = blockOf32({1, 2, 3, 896, -0.5f});
  for (MxScaleRule rule : {MxScaleRule::OcpFloor, MxScaleRule::RoundUp}) {
    std::vector<uint8_t> codes(32), scales(1);
    ASSERT_TRUE(quantizeMxfp8(x, 1, 32, codes, scales, rule));
    EXPECT_EQ(scales[0], 128); // 2^(128 − 127)
    // 1/2, 1, 3/2, 448, −1/4
    EXPECT_EQ(codes[0], 0x30);
    EXPECT_EQ(codes[1], 0x38);
    EXPECT_EQ(codes[2], 0x3C);
    EXPECT_EQ(codes[3], 0x7E);
    EXPECT_EQ(codes[4], 0xA8);
    EXPECT_EQ(codes[5], 0x00);
    std::vector<float> back(32);
    ASSERT_TRUE(dequantizeMxfp8(codes, scales, 1, 32, back));
    EXPECT_EQ(back, x); // every value is exactly representable
  }
}

TEST(Mxfp8, OcpFloorSaturatesWhereRoundUpDoesNot) {
  // amax = 960 = 1.875 · 2^9 (mantissa above 1.75): OcpFloor X = 2, 960 / 2 = 480 saturates to
  // 448; RoundUp X = 2^ceil(log2(960/448)) = 4 and 960 / 4 = 240 is exact.
  const auto x = blockOf32({960, -960, 3, 0.25f});
  std::vector<uint8_t> codes(32), scales(1);
  std::vector<float> back(32);

  ASSERT_TRUE(quantizeMxfp8(x, 1, 32, codes, scales, MxScaleRule::OcpFloor));
  EXPECT_EQ(e8m0ToFloat(scales[0]), 2.0f);
  EXPECT_EQ(codes[0], 0x7E);
  EXPECT_EQ(codes[1], 0xFE);
  ASSERT_TRUE(dequantizeMxfp8(codes, scales, 1, 32, back));
  EXPECT_EQ(back[0], 896.0f);
  EXPECT_EQ(back[1], -896.0f);
  EXPECT_EQ(back[2], 3.0f);
  EXPECT_EQ(back[3], 0.25f);

  ASSERT_TRUE(quantizeMxfp8(x, 1, 32, codes, scales, MxScaleRule::RoundUp));
  EXPECT_EQ(e8m0ToFloat(scales[0]), 4.0f);
  EXPECT_EQ(codes[0], 0x77); // 240
  ASSERT_TRUE(dequantizeMxfp8(codes, scales, 1, 32, back));
  EXPECT_EQ(back[0], 960.0f);
  EXPECT_EQ(back[1], -960.0f);
  EXPECT_EQ(back[2], 3.0f);
  EXPECT_EQ(back[3], 0.25f);
}

TEST(Mxfp8, ScaleCodesFollowTheirDefinitions) {
  EXPECT_EQ(mxScaleCode(1.0f, MxScaleRule::OcpFloor), 127 - 8);
  EXPECT_EQ(mxScaleCode(1.0f, MxScaleRule::RoundUp), 127 - 8); // 448 · 2^−8 = 1.75 ≥ 1
  EXPECT_EQ(mxScaleCode(1.8f, MxScaleRule::RoundUp), 127 - 7); // 1.75 < 1.8 ≤ 3.5
  EXPECT_EQ(mxScaleCode(448.0f, MxScaleRule::RoundUp), 127);   // exactly fits at X = 1
  EXPECT_EQ(mxScaleCode(std::nextafter(448.0f, kInf), MxScaleRule::RoundUp), 128);
  EXPECT_EQ(mxScaleCode(511.0f, MxScaleRule::OcpFloor), 127);
  EXPECT_EQ(mxScaleCode(512.0f, MxScaleRule::OcpFloor), 128);
  EXPECT_EQ(mxScaleCode(0.0f, MxScaleRule::OcpFloor), 0);
  EXPECT_EQ(mxScaleCode(0.0f, MxScaleRule::RoundUp), 0);
  EXPECT_EQ(mxScaleCode(kNaN, MxScaleRule::RoundUp), 0xFF);
  EXPECT_EQ(mxScaleCode(kInf, MxScaleRule::OcpFloor), 0xFF);
  // Clamped to E8M0's 2^−127: the block is still represented (2^−125 · 2^127 = 4).
  EXPECT_EQ(mxScaleCode(std::ldexp(1.0f, -125), MxScaleRule::OcpFloor), 0);
  EXPECT_EQ(mxScaleCode(std::numeric_limits<float>::max(), MxScaleRule::RoundUp), 127 + 120);
  EXPECT_EQ(mxScaleCode(std::numeric_limits<float>::max(), MxScaleRule::OcpFloor), 127 + 119);
}

TEST(Mxfp8, RoundTripErrorBoundsAndScaleProperties) {
  std::mt19937 rng(11);
  const int64_t rows = 6, cols = 256;
  auto x = randomNormal(rng, rows * cols);
  std::uniform_int_distribution<int> blockExponent(-30, 30);
  for (int64_t block = 0; block < rows * cols / kMxBlockSize; ++block) {
    const int exponent = blockExponent(rng); // each block at its own magnitude
    for (int64_t i = 0; i < kMxBlockSize; ++i)
      x[block * kMxBlockSize + i] = std::ldexp(x[block * kMxBlockSize + i], exponent);
  }
  for (MxScaleRule rule : {MxScaleRule::OcpFloor, MxScaleRule::RoundUp}) {
    std::vector<uint8_t> codes(rows * cols), scales(rows * cols / kMxBlockSize);
    std::vector<float> back(rows * cols);
    ASSERT_TRUE(quantizeMxfp8(x, rows, cols, codes, scales, rule));
    ASSERT_TRUE(dequantizeMxfp8(codes, scales, rows, cols, back));
    int64_t saturated = 0;
    for (int64_t block = 0; block < rows * cols / kMxBlockSize; ++block) {
      const float scale = e8m0ToFloat(scales[block]);
      ASSERT_TRUE(isPowerOfTwo(scale));
      float amax = 0.0f;
      for (int64_t i = 0; i < kMxBlockSize; ++i)
        amax = std::max(amax, std::fabs(x[block * kMxBlockSize + i]));
      if (rule == MxScaleRule::RoundUp) { // smallest X with amax ≤ 448 X
        EXPECT_LE(amax, 448.0f * scale);
        EXPECT_GT(amax, 224.0f * scale);
      } else { // X = 2^floor(log2 amax) / 2^8
        EXPECT_GE(amax, 256.0f * scale);
        EXPECT_LT(amax, 512.0f * scale);
      }
      for (int64_t i = 0; i < kMxBlockSize; ++i) {
        const int64_t at = block * kMxBlockSize + i;
        const float v = x[at];
        if (std::fabs(v) > 448.0f * scale) { // only possible with OcpFloor
          EXPECT_EQ(rule, MxScaleRule::OcpFloor);
          EXPECT_EQ(back[at], std::copysign(448.0f * scale, v));
          ++saturated;
        } else if (std::fabs(v) >= std::ldexp(scale, -6)) { // E4M3 normal range
          EXPECT_LE(std::fabs(back[at] - v), std::ldexp(std::fabs(v), -4)) << at;
        } else { // subnormal range: half the 2^−9 step
          EXPECT_LE(std::fabs(back[at] - v), std::ldexp(scale, -10)) << at;
        }
        EXPECT_EQ(std::signbit(back[at]), std::signbit(v));
      }
    }
    if (rule == MxScaleRule::RoundUp) {
      EXPECT_EQ(saturated, 0);
    }
  }
}

TEST(Mxfp8, ZerosNegationAndNonFiniteBlocks) {
  std::mt19937 rng(5);
  const int64_t cols = 96; // three blocks: zeros, random, random with a NaN
  auto x = randomNormal(rng, cols);
  std::fill_n(x.begin(), 32, 0.0f);
  std::vector<float> negated(cols);
  std::transform(x.begin(), x.end(), negated.begin(), [](float v) { return -v; });
  x[70] = kNaN;
  negated[70] = kNaN;

  std::vector<uint8_t> codes(cols), scales(3), negatedCodes(cols), negatedScales(3);
  ASSERT_TRUE(quantizeMxfp8(x, 1, cols, codes, scales, MxScaleRule::RoundUp));
  ASSERT_TRUE(quantizeMxfp8(negated, 1, cols, negatedCodes, negatedScales, MxScaleRule::RoundUp));
  EXPECT_EQ(scales[0], 0); // zero block: smallest scale, zero codes
  for (int64_t i = 0; i < 32; ++i)
    EXPECT_EQ(codes[i], 0x00);
  EXPECT_EQ(scales[2], 0xFF);
  for (int64_t i = 64; i < 96; ++i)
    EXPECT_EQ(codes[i], 0x7F);
  EXPECT_EQ(negatedScales, scales);
  for (int64_t i = 0; i < 64; ++i) // sign-magnitude: negation flips only the sign bit (0 ↔ −0 too)
    EXPECT_EQ(negatedCodes[i], codes[i] ^ 0x80) << i;

  std::vector<float> back(cols);
  ASSERT_TRUE(dequantizeMxfp8(codes, scales, 1, cols, back));
  for (int64_t i = 0; i < 32; ++i)
    EXPECT_EQ(back[i], 0.0f);
  for (int64_t i = 64; i < 96; ++i)
    EXPECT_TRUE(std::isnan(back[i]));
}

TEST(Mxfp8, RejectsShapesTheFormatCannotHold) {
  std::vector<float> x(48, 1.0f);
  std::vector<uint8_t> codes(48, 0xAA), scales(2, 0xAA);
  EXPECT_FALSE(quantizeMxfp8(x, 1, 48, codes, scales, MxScaleRule::RoundUp)); // 48 % 32 != 0
  EXPECT_EQ(codes, std::vector<uint8_t>(48, 0xAA));                           // nothing written
  std::vector<uint8_t> oneScale(1);
  std::vector<float> x32(32), out32(32);
  std::vector<uint8_t> codes32(32), twoScales(2);
  EXPECT_FALSE(quantizeMxfp8(x32, 1, 32, codes32, twoScales, MxScaleRule::RoundUp));
  EXPECT_FALSE(quantizeMxfp8(x, 1, 32, codes32, oneScale, MxScaleRule::RoundUp));
  EXPECT_FALSE(dequantizeMxfp8(codes32, twoScales, 1, 32, out32));
  EXPECT_TRUE(dequantizeMxfp8(codes32, oneScale, 1, 32, out32));
}

// ---- FP8 tiles with fp32 scales

TEST(Fp8Tiles, HandCaseWithPowerOfTwoScales) {
  // amax 896: DeepSeekUe8m0 2^ceil(log2(896 · (1/448))) = 2, FlashMlaPow2 2^ceil(log2 2) = 2.
  const std::vector<float> x = {1, 2, 3, 896};
  for (Fp8ScaleRule rule : {Fp8ScaleRule::DeepSeekUe8m0, Fp8ScaleRule::FlashMlaPow2}) {
    std::vector<uint8_t> codes(4);
    std::vector<float> scales(1), back(4);
    ASSERT_TRUE(quantizeFp8Tiles(x, 1, 4, kFp8TileSize, rule, codes, scales));
    EXPECT_EQ(scales[0], 2.0f);
    EXPECT_EQ(codes, (std::vector<uint8_t>{0x30, 0x38, 0x3C, 0x7E}));
    ASSERT_TRUE(dequantizeFp8Tiles(codes, scales, 1, 4, kFp8TileSize, back));
    EXPECT_EQ(back, x);
  }
}

TEST(Fp8Tiles, ScaleRulesAndTheirFloors) {
  // DeepSeekLinear multiplies by the fp32 reciprocal of 448, as the reference kernel does.
  for (float amax : {1.0f, 3.7f, 896.0f, 1234.5f})
    EXPECT_EQ(fp8TileScale(amax, Fp8ScaleRule::DeepSeekLinear), amax * (1.0f / 448.0f));
  EXPECT_EQ(fp8TileScale(0.0f, Fp8ScaleRule::DeepSeekLinear), 1e-4f * (1.0f / 448.0f));
  // 1e-4 / 448 ≈ 2.23e−7 → 2^−22; FlashMLA floors the scale itself: 1e-4 → 2^−13.
  EXPECT_EQ(fp8TileScale(0.0f, Fp8ScaleRule::DeepSeekUe8m0), std::ldexp(1.0f, -22));
  EXPECT_EQ(fp8TileScale(0.0f, Fp8ScaleRule::FlashMlaPow2), std::ldexp(1.0f, -13));
  EXPECT_EQ(fp8TileScale(0.01f, Fp8ScaleRule::DeepSeekUe8m0), std::ldexp(1.0f, -15));
  EXPECT_EQ(fp8TileScale(0.01f, Fp8ScaleRule::FlashMlaPow2), std::ldexp(1.0f, -13));
  // Exactly 448 · 2^k keeps 2^k; anything above moves to 2^(k+1).
  EXPECT_EQ(fp8TileScale(448.0f * 8, Fp8ScaleRule::FlashMlaPow2), 8.0f);
  EXPECT_EQ(fp8TileScale(std::nextafter(448.0f * 8, kInf), Fp8ScaleRule::FlashMlaPow2), 16.0f);
  EXPECT_EQ(fp8TileScale(448.0f / 4, Fp8ScaleRule::DeepSeekUe8m0), 0.25f);
  EXPECT_EQ(fp8TileScale(kInf, Fp8ScaleRule::FlashMlaPow2), kInf);
}

TEST(Fp8Tiles, RoundTripWithAPartialLastTile) {
  std::mt19937 rng(13);
  const int64_t rows = 4, cols = 300, tile = 128; // tiles of 128, 128, 44
  auto x = randomNormal(rng, rows * cols, 0.0f, 3.0f);
  x[1 * cols + 290] = 0.0f;
  x[2 * cols + 5] = -0.0f;
  ASSERT_EQ(fp8TileCount(cols, tile), 3);
  for (Fp8ScaleRule rule :
       {Fp8ScaleRule::DeepSeekLinear, Fp8ScaleRule::DeepSeekUe8m0, Fp8ScaleRule::FlashMlaPow2}) {
    std::vector<uint8_t> codes(rows * cols);
    std::vector<float> scales(rows * 3), back(rows * cols);
    ASSERT_TRUE(quantizeFp8Tiles(x, rows, cols, tile, rule, codes, scales));
    ASSERT_TRUE(dequantizeFp8Tiles(codes, scales, rows, cols, tile, back));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < 3; ++t) {
        const int64_t begin = r * cols + t * tile, end = r * cols + std::min(cols, (t + 1) * tile);
        float amax = 0.0f;
        for (int64_t i = begin; i < end; ++i)
          amax = std::max(amax, std::fabs(x[i]));
        const float scale = scales[r * 3 + t];
        EXPECT_EQ(scale, fp8TileScale(amax, rule)); // the tile's own amax, partial tile included
        if (rule != Fp8ScaleRule::DeepSeekLinear) {
          EXPECT_TRUE(isPowerOfTwo(scale));
        }
        for (int64_t i = begin; i < end; ++i) {
          EXPECT_EQ(codes[i], floatToE4M3(x[i] / scale));
          EXPECT_EQ(back[i], e4m3ToFloat(codes[i]) * scale);
          EXPECT_EQ(std::signbit(back[i]), std::signbit(x[i]));
          // Relative 2^−4 in E4M3's normal range; a scale rounded below amax/448 can saturate
          // the largest element by at most a few fp32 ulps.
          const float bound = std::fabs(x[i]) >= std::ldexp(scale, -6)
                                  ? std::ldexp(std::fabs(x[i]), -4)
                                  : std::ldexp(scale, -10);
          EXPECT_LE(std::fabs(back[i] - x[i]), bound * 1.0001f) << i;
        }
      }
  }
}

TEST(Fp8Tiles, RejectsBadShapes) {
  std::vector<float> x(10), scales(1), back(10);
  std::vector<uint8_t> codes(10);
  EXPECT_FALSE(quantizeFp8Tiles(x, 1, 10, 0, Fp8ScaleRule::FlashMlaPow2, codes, scales));
  EXPECT_FALSE(quantizeFp8Tiles(x, 1, 10, 4, Fp8ScaleRule::FlashMlaPow2, codes, scales));
  EXPECT_FALSE(quantizeFp8Tiles(x, 2, 10, 128, Fp8ScaleRule::FlashMlaPow2, codes, scales));
  EXPECT_TRUE(quantizeFp8Tiles(x, 1, 10, 128, Fp8ScaleRule::FlashMlaPow2, codes, scales));
  EXPECT_FALSE(dequantizeFp8Tiles(codes, scales, 1, 10, 8, back));
  EXPECT_TRUE(dequantizeFp8Tiles(codes, scales, 1, 10, 16, back));
}

// The in-place round trips are the two calls they stand for; a shape the encoder refuses leaves
// the values untouched.
TEST(RoundTrip, InPlaceIsQuantizeThenDequantize) {
  std::mt19937 rng(17);
  const int64_t rows = 3, cols = 128;
  const auto x = randomNormal(rng, rows * cols, 0.0f, 2.0f);
  std::vector<uint8_t> codes(rows * cols), mxScales(rows * cols / 32);
  std::vector<float> fp8Scales(rows), expected(rows * cols);
  ASSERT_TRUE(quantizeMxfp8(x, rows, cols, codes, mxScales, MxScaleRule::RoundUp));
  ASSERT_TRUE(dequantizeMxfp8(codes, mxScales, rows, cols, expected));
  std::vector<float> got = x;
  ASSERT_TRUE(roundTripMxfp8(got, rows, cols, MxScaleRule::RoundUp));
  EXPECT_EQ(got, expected);
  ASSERT_TRUE(quantizeFp8Tiles(x, rows, cols, cols, Fp8ScaleRule::DeepSeekUe8m0, codes, fp8Scales));
  ASSERT_TRUE(dequantizeFp8Tiles(codes, fp8Scales, rows, cols, cols, expected));
  got = x;
  ASSERT_TRUE(roundTripFp8Tiles(got, rows, cols, cols, Fp8ScaleRule::DeepSeekUe8m0));
  EXPECT_EQ(got, expected);
  got = x;
  EXPECT_FALSE(roundTripMxfp8(got, rows * 4, 96, MxScaleRule::RoundUp)); // 384 values, not 4 x 96
  EXPECT_FALSE(roundTripFp8Tiles(got, rows, cols, 0, Fp8ScaleRule::DeepSeekUe8m0));
  EXPECT_EQ(got, x);
}

// ---- FlashMLA V32 FP8 KV row

TEST(Fp8KvRow, DeepSeekV32LayoutIs656BytesWithScalesThenBf16Rope) {
  ASSERT_EQ(kvRowBytes(512, 64), 656);
  std::mt19937 rng(17);
  // Tile t has amax exactly 448 · 2^(t − 2) → scale 2^(t − 2).
  auto latent = randomNormal(rng, 512, 0.0f, 0.1f);
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < 128; ++i)
      latent[t * 128 + i] = std::ldexp(std::clamp(latent[t * 128 + i], -1.0f, 1.0f), t - 2);
    latent[t * 128 + 7 * t] = -448.0f * std::ldexp(1.0f, t - 2);
  }
  auto rope = randomNormal(rng, 64);
  rope[0] = 1.0f;
  rope[1] = -2.5f;
  rope[2] = 1.0f + 3 * std::ldexp(1.0f, -8); // bf16 tie → 0x3F82

  std::vector<uint8_t> row(656, 0xEE);
  ASSERT_TRUE(packFp8KvRow(latent, rope, row));
  for (int t = 0; t < 4; ++t) {
    const float scale = std::ldexp(1.0f, t - 2);
    EXPECT_EQ(littleEndian32(&row[512 + 4 * t]), std::bit_cast<uint32_t>(scale)) << t;
    for (int i = 0; i < 128; ++i)
      ASSERT_EQ(row[t * 128 + i], floatToE4M3(latent[t * 128 + i] / scale)) << t << " " << i;
    EXPECT_EQ(row[t * 128 + 7 * t], 0xFE);
  }
  EXPECT_EQ(row[512], 0x00); // 0.25f = 0x3E800000, little-endian
  EXPECT_EQ(row[515], 0x3E);
  EXPECT_EQ(row[528], 0x80); // rope[0] = 1.0 → bf16 0x3F80
  EXPECT_EQ(row[529], 0x3F);
  EXPECT_EQ(littleEndian16(&row[530]), 0xC020);
  EXPECT_EQ(littleEndian16(&row[532]), 0x3F82);
  for (int i = 0; i < 64; ++i)
    EXPECT_EQ(littleEndian16(&row[528 + 2 * i]), floatToBf16(rope[i])) << i;

  std::vector<float> latentBack(512), ropeBack(64);
  ASSERT_TRUE(unpackFp8KvRow(row, latentBack, ropeBack));
  for (int i = 0; i < 512; ++i) {
    EXPECT_EQ(latentBack[i], e4m3ToFloat(row[i]) * std::ldexp(1.0f, i / 128 - 2));
    const float scale = std::ldexp(1.0f, i / 128 - 2);
    const float bound = std::fabs(latent[i]) >= std::ldexp(scale, -6)
                            ? std::ldexp(std::fabs(latent[i]), -4)
                            : std::ldexp(scale, -10);
    EXPECT_LE(std::fabs(latentBack[i] - latent[i]), bound) << i;
  }
  for (int i = 0; i < 64; ++i)
    EXPECT_EQ(ropeBack[i], bf16ToFloat(floatToBf16(rope[i])));
}

TEST(Fp8KvRow, TinyModelRowIs132Bytes) {
  ASSERT_EQ(kvRowBytes(64, 32), 64 + 4 + 64); // one (short) tile of 64 latent values
  std::mt19937 rng(19);
  const auto latent = randomNormal(rng, 64);
  const auto rope = randomNormal(rng, 32);
  std::vector<uint8_t> row(132);
  ASSERT_TRUE(packFp8KvRow(latent, rope, row));
  float amax = 0.0f;
  for (float v : latent)
    amax = std::max(amax, std::fabs(v));
  const float scale = fp8TileScale(amax, Fp8ScaleRule::FlashMlaPow2);
  EXPECT_EQ(littleEndian32(&row[64]), std::bit_cast<uint32_t>(scale));
  EXPECT_EQ(littleEndian16(&row[68]), floatToBf16(rope[0]));
  EXPECT_EQ(littleEndian16(&row[130]), floatToBf16(rope[31]));

  std::vector<float> latentBack(64), ropeBack(32);
  ASSERT_TRUE(unpackFp8KvRow(row, latentBack, ropeBack));
  for (int i = 0; i < 64; ++i)
    EXPECT_EQ(latentBack[i], e4m3ToFloat(floatToE4M3(latent[i] / scale)) * scale);
  EXPECT_LE(testing::maxAbsDiff(latentBack, latent), amax / 16);

  std::vector<uint8_t> wrongSize(131);
  EXPECT_FALSE(packFp8KvRow(latent, rope, wrongSize));
  EXPECT_FALSE(unpackFp8KvRow(wrongSize, latentBack, ropeBack));
  EXPECT_FALSE(packFp8KvRow(latent, rope, row, 0));
}

// ---- Indexer key row

TEST(Fp8IndexKey, DeepSeekV32KeyIs132Bytes) {
  ASSERT_EQ(indexKeyBytes(128), 132);
  ASSERT_EQ(indexKeyBytes(64), 68);
  std::mt19937 rng(23);
  auto key = randomNormal(rng, 128);
  key[9] = 5.0f; // amax 5 → 2^ceil(log2(5 · (1/448))) = 2^−6
  std::vector<uint8_t> row(132);
  ASSERT_TRUE(packFp8IndexKey(key, row));
  const float scale = std::ldexp(1.0f, -6);
  EXPECT_EQ(littleEndian32(&row[128]), std::bit_cast<uint32_t>(scale));
  for (int i = 0; i < 128; ++i)
    EXPECT_EQ(row[i], floatToE4M3(key[i] / scale)) << i;
  std::vector<float> back(128);
  ASSERT_TRUE(unpackFp8IndexKey(row, back));
  for (int i = 0; i < 128; ++i)
    EXPECT_EQ(back[i], e4m3ToFloat(row[i]) * scale);
  EXPECT_EQ(back[9], 5.0f);

  // The linear rule stores amax · (1/448) and maps the amax element to ±448.
  ASSERT_TRUE(packFp8IndexKey(key, row, Fp8ScaleRule::DeepSeekLinear));
  EXPECT_EQ(littleEndian32(&row[128]), std::bit_cast<uint32_t>(5.0f * (1.0f / 448.0f)));
  EXPECT_EQ(row[9], 0x7E);

  std::vector<float> tinyKey(64, 0.5f), tinyBack(64);
  std::vector<uint8_t> tinyRow(68);
  ASSERT_TRUE(packFp8IndexKey(tinyKey, tinyRow));
  ASSERT_TRUE(unpackFp8IndexKey(tinyRow, tinyBack));
  EXPECT_EQ(tinyBack, tinyKey);
  EXPECT_FALSE(packFp8IndexKey(tinyKey, row));
  EXPECT_FALSE(unpackFp8IndexKey(row, tinyBack));
}

} // namespace
} // namespace hybrid::kernels::ref
