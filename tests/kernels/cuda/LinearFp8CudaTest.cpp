// The FP8 block-scaled linear layer (DeepSeek-V3.2, MODEL_SPEC §8.1) against the references:
// the activation quantizer bit for bit against ref::quantizeFp8Tiles; the GEMM on integer-valued
// operands with power-of-two scales, where every intermediate is exact, so any layout or
// orientation mistake in the scale tensors shows as a mismatch; the GEMM on realistic data
// against a double-precision product of the same FP8 operands; and the rejected shapes.
// Labelled `gpu`; skipped where no GPU is present.
#include "CudaTestSupport.h"
#include "hybrid/kernels/cuda/Linear.h"
#include "hybrid/kernels/ref/Quant.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace hybrid::kernels {
namespace {

using cuda::Fp8ActivationScale;
constexpr int64_t kBlock = cuda::kFp8BlockSize;

int64_t tilesOf(int64_t in) { return (in + kBlock - 1) / kBlock; }

ref::Fp8ScaleRule refRule(Fp8ActivationScale rule) {
  return rule == Fp8ActivationScale::DeepSeekLinear ? ref::Fp8ScaleRule::DeepSeekLinear
                                                    : ref::Fp8ScaleRule::DeepSeekUe8m0;
}

const char *ruleName(Fp8ActivationScale rule) {
  return rule == Fp8ActivationScale::DeepSeekLinear ? "linear" : "ue8m0";
}

// x [rows, stride]: each (row, tile) N(0, 1) times 10^U(low, high), so the scales differ.
std::vector<float> tiledActivations(int64_t rows, int64_t in, int64_t stride, std::mt19937 &rng,
                                    float low, float high) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(low, high);
  std::vector<float> x(size_t(rows * stride), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < tilesOf(in); ++t) {
      const float magnitude = std::pow(10.0f, exponent(rng));
      for (int64_t k = t * kBlock; k < std::min(in, (t + 1) * kBlock); ++k)
        x[r * stride + k] = magnitude * normal(rng);
    }
  return x;
}

// The device scratch's real rows as two host arrays: codes [rows, in], scales [rows, tiles]
// (transposed back from the scratch's [tiles, paddedRows]).
struct QuantizedRows {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

QuantizedRows readScratch(const std::vector<uint8_t> &scratch, int64_t rows, int64_t in) {
  const int64_t padded = cuda::linearFp8PaddedRows(rows);
  QuantizedRows q{std::vector<uint8_t>(scratch.begin(), scratch.begin() + rows * in),
                  std::vector<float>(size_t(rows * tilesOf(in)))};
  const size_t offset = cuda::linearFp8ScratchScaleOffset(rows, in);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < tilesOf(in); ++t)
      std::memcpy(&q.scales[r * tilesOf(in) + t], &scratch[offset + 4 * (t * padded + r)], 4);
  return q;
}

// The pad rows [rows, paddedRows) must hold zero codes and finite scales, whatever the scratch
// held before (the tests fill it with 0xFF: NaN codes and NaN scales).
int64_t padRowProblems(const std::vector<uint8_t> &scratch, int64_t rows, int64_t in) {
  const int64_t padded = cuda::linearFp8PaddedRows(rows);
  const size_t offset = cuda::linearFp8ScratchScaleOffset(rows, in);
  int64_t count = 0;
  for (int64_t r = rows; r < padded; ++r) {
    for (int64_t k = 0; k < in; ++k)
      if (scratch[r * in + k] != 0 && count++ == 0)
        ADD_FAILURE() << "pad row " << r << " code " << k << ": " << int(scratch[r * in + k]);
    for (int64_t t = 0; t < tilesOf(in); ++t) {
      float scale;
      std::memcpy(&scale, &scratch[offset + 4 * (t * padded + r)], 4);
      if (!std::isfinite(scale) && count++ == 0)
        ADD_FAILURE() << "pad row " << r << " scale " << t << ": " << scale;
    }
  }
  return count;
}

// The scratch of runFp8Prequantized: pad rows with zero codes and scale 1.
std::vector<uint8_t> writeScratch(const QuantizedRows &q, int64_t rows, int64_t in, int64_t out) {
  const int64_t padded = cuda::linearFp8PaddedRows(rows);
  std::vector<uint8_t> scratch(cuda::linearFp8ScratchBytes(rows, in, out), 0);
  std::copy(q.codes.begin(), q.codes.end(), scratch.begin());
  const size_t offset = cuda::linearFp8ScratchScaleOffset(rows, in);
  const float one = 1.0f;
  for (int64_t r = 0; r < padded; ++r)
    for (int64_t t = 0; t < tilesOf(in); ++t)
      std::memcpy(&scratch[offset + 4 * (t * padded + r)],
                  r < rows ? &q.scales[r * tilesOf(in) + t] : &one, 4);
  return scratch;
}

// ref::quantizeFp8Tiles on the rows of a strided x.
QuantizedRows referenceQuantization(const std::vector<float> &x, int64_t rows, int64_t in,
                                    int64_t stride, Fp8ActivationScale rule) {
  std::vector<float> packed(size_t(rows * in));
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(x.begin() + r * stride, in, packed.begin() + r * in);
  QuantizedRows q{std::vector<uint8_t>(packed.size()),
                  std::vector<float>(size_t(rows * tilesOf(in)))};
  EXPECT_TRUE(ref::quantizeFp8Tiles(packed, rows, in, kBlock, refRule(rule), q.codes, q.scales));
  return q;
}

// Counts the codes and scales (compared as bits) that differ; reports the first of each.
int64_t mismatches(const QuantizedRows &actual, const QuantizedRows &expected, int64_t in) {
  int64_t count = 0;
  for (size_t i = 0; i < expected.codes.size(); ++i)
    if (actual.codes[i] != expected.codes[i] && count++ == 0)
      ADD_FAILURE() << "code (" << i / in << ", " << i % in << "): " << int(actual.codes[i])
                    << " vs " << int(expected.codes[i]);
  int64_t scaleCount = 0;
  for (size_t i = 0; i < expected.scales.size(); ++i)
    if (std::bit_cast<uint32_t>(actual.scales[i]) != std::bit_cast<uint32_t>(expected.scales[i]) &&
        scaleCount++ == 0)
      ADD_FAILURE() << "scale " << i << ": " << actual.scales[i] << " vs " << expected.scales[i];
  return count + scaleCount;
}

// ---- (a) the activation quantizer

struct QuantShape {
  int64_t rows, in, xPad;
  Fp8ActivationScale rule;
};

void PrintTo(const QuantShape &s, std::ostream *os) {
  *os << s.rows << "x" << s.in << " pad " << s.xPad << " " << ruleName(s.rule);
}

class Fp8ActivationQuantCuda : public testing::TestWithParam<QuantShape> {};

TEST_P(Fp8ActivationQuantCuda, BitIdenticalToReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const QuantShape s = GetParam();
  const int64_t stride = s.in + s.xPad, tiles = tilesOf(s.in);
  std::mt19937 rng(int(s.rows * 977 + s.in * 13 + s.xPad));
  // Magnitudes from 1e-7 (E4M3 subnormal codes and the 1e-4 amax floor) to 1e3.
  std::vector<float> x = tiledActivations(s.rows, s.in, stride, rng, -7.0f, 3.0f);
  // Special tiles: an all-zero tile (with -0), a NaN (ignored by amax, code 0x7F), an infinity
  // (scale +inf), the saturation edge and tiny fp32 values.
  for (int64_t k = 0; k < std::min(kBlock, s.in); ++k)
    x[k] = k % 2 ? -0.0f : 0.0f;
  if (s.rows > 1) {
    const int64_t last = (tiles - 1) * kBlock;
    x[stride + last] = std::numeric_limits<float>::quiet_NaN();
    if (last + 1 < s.in)
      x[stride + last + 1] = 1e30f;
  }
  if (s.rows > 2)
    x[2 * stride + s.in - 1] = -std::numeric_limits<float>::infinity();
  if (s.rows > 3) {
    x[3 * stride] = 448.0f;
    x[3 * stride + 1] = -464.0f; // between 448 and the NaN pattern's 480
    x[3 * stride + 2] = 1e-40f;  // an fp32 subnormal
  }

  DeviceBuffer<float> dX(x);
  // out = 0: the quantizer needs only the codes and scales.
  DeviceBuffer<uint8_t> scratch(
      std::vector<uint8_t>(cuda::linearFp8ScratchBytes(s.rows, s.in, 0), 0xFF));
  const int code = cuda::quantizeFp8Activations(dX.data, s.xPad ? stride : 0, s.rows, s.in, s.rule,
                                                scratch.data, nullptr);
  ASSERT_EQ(code, 0) << cuda::linearErrorText(code);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> result = scratch.download();
  const QuantizedRows actual = readScratch(result, s.rows, s.in);
  EXPECT_EQ(mismatches(actual, referenceQuantization(x, s.rows, s.in, stride, s.rule), s.in), 0);
  EXPECT_EQ(padRowProblems(result, s.rows, s.in), 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8ActivationQuantCuda,
                         testing::Values(QuantShape{5, 384, 0, Fp8ActivationScale::DeepSeekLinear},
                                         QuantShape{5, 384, 0, Fp8ActivationScale::DeepSeekUe8m0},
                                         QuantShape{4, 200, 7, Fp8ActivationScale::DeepSeekLinear},
                                         QuantShape{4, 200, 7, Fp8ActivationScale::DeepSeekUe8m0},
                                         QuantShape{1, 96, 0, Fp8ActivationScale::DeepSeekLinear},
                                         QuantShape{130, 1024, 3,
                                                    Fp8ActivationScale::DeepSeekUe8m0}),
                         [](const testing::TestParamInfo<QuantShape> &info) {
                           const QuantShape &s = info.param;
                           return std::to_string(s.rows) + "x" + std::to_string(s.in) +
                                  (s.xPad ? "_strided_" : "_") + ruleName(s.rule);
                         });

// ---- FP8 weights and the GEMM reference

struct Fp8Weight {
  std::vector<uint8_t> codes; // [out, stride]; the columns past `in` hold NaN codes
  std::vector<float> scales;  // [ceil(out/128), linearFp8WeightScaleStride(in)], zero padding
};

Fp8Weight makeWeight(int64_t out, int64_t in, int64_t stride) {
  const int64_t scaleStride = cuda::linearFp8WeightScaleStride(in);
  return {std::vector<uint8_t>(size_t(out * stride), ref::kE4M3NaNCode),
          std::vector<float>(size_t(tilesOf(out) * scaleStride), 0.0f)};
}

float &weightScale(Fp8Weight &w, int64_t in, int64_t n, int64_t k) {
  return w.scales[(n / kBlock) * cuda::linearFp8WeightScaleStride(in) + k / kBlock];
}

// y[r, n] = sum_k (e4m3(x)[r, k] s_x[r, k/128]) (e4m3(W)[n, k] s_W[n/128, k/128]), each operand
// dequantized exactly (an E4M3 value times an fp32 scale fits a double) and summed in double.
std::vector<double> referenceProduct(const QuantizedRows &x, Fp8Weight &w, int64_t rows, int64_t in,
                                     int64_t out, int64_t weightStride) {
  std::vector<double> xValues(size_t(rows * in)), wValues(size_t(out * in));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < in; ++k)
      xValues[r * in + k] =
          double(ref::e4m3ToFloat(x.codes[r * in + k])) * x.scales[r * tilesOf(in) + k / kBlock];
  for (int64_t n = 0; n < out; ++n)
    for (int64_t k = 0; k < in; ++k)
      wValues[n * in + k] =
          double(ref::e4m3ToFloat(w.codes[n * weightStride + k])) * weightScale(w, in, n, k);
  std::vector<double> y(size_t(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < out; ++n) {
      double sum = 0;
      for (int64_t k = 0; k < in; ++k)
        sum += xValues[r * in + k] * wValues[n * in + k];
      y[r * out + n] = sum;
    }
  return y;
}

struct GemmShape {
  int64_t rows, in, out, xPad, weightPad, yPad;
  bool accumulate;
  Fp8ActivationScale rule = Fp8ActivationScale::DeepSeekLinear;
};

void PrintTo(const GemmShape &s, std::ostream *os) {
  *os << s.rows << "x" << s.in << "x" << s.out << " pads " << s.xPad << "/" << s.weightPad << "/"
      << s.yPad << (s.accumulate ? " accumulate " : " ") << ruleName(s.rule);
}

// The message of a failed GEMM call: the shape, and for the open question whether cuBLASLt's
// block-scaled FP8 kernels take a short last k block, a pointer to it.
std::string gemmFailure(const GemmShape &s, int code) {
  std::string text = std::to_string(s.rows) + "x" + std::to_string(s.in) + "x" +
                     std::to_string(s.out) + ": " + cuda::linearErrorText(code);
  if (code == 1000 + 15 && s.in % kBlock != 0)
    text += " (in % 128 = " + std::to_string(s.in % kBlock) +
            ": cuBLASLt may not support a partial last 128-wide k block)";
  return text;
}

std::string gemmName(const testing::TestParamInfo<GemmShape> &info) {
  const GemmShape &s = info.param;
  std::string name = std::to_string(s.rows) + "x" + std::to_string(s.in) + "x" +
                     std::to_string(s.out) + "_" + ruleName(s.rule);
  name += s.xPad || s.weightPad || s.yPad ? "_strided" : "";
  name += s.accumulate ? "_accumulate" : "";
  return name;
}

struct Buffers {
  Buffers(const std::vector<float> &x, const Fp8Weight &w, const std::vector<float> &y,
          const std::vector<uint8_t> &scratch)
      : x(x), weight(w.codes), weightScale(w.scales), y(y), scratch(scratch) {}
  DeviceBuffer<float> x;
  DeviceBuffer<uint8_t> weight;
  DeviceBuffer<float> weightScale;
  DeviceBuffer<float> y;
  DeviceBuffer<uint8_t> scratch;
};

cuda::LinearFp8Params paramsFor(const GemmShape &s, Buffers &b) {
  cuda::LinearFp8Params p;
  p.rows = s.rows;
  p.in = s.in;
  p.out = s.out;
  p.x = b.x.data;
  p.xStride = s.in + s.xPad;
  p.weight = b.weight.data;
  p.weightStride = s.in + s.weightPad;
  p.weightScale = b.weightScale.data;
  p.y = b.y.data;
  p.yStride = s.out + s.yPad;
  p.accumulate = s.accumulate;
  p.activationScale = s.rule;
  p.scratch = b.scratch.data;
  return p;
}

// Rows [rows, yStride] -> the product columns only.
std::vector<float> columns(const std::vector<float> &y, int64_t rows, int64_t out, int64_t stride) {
  std::vector<float> packed(size_t(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(y.begin() + r * stride, out, packed.begin() + r * out);
  return packed;
}

// The columns of y past `out` keep their values.
int64_t paddingChanges(const std::vector<float> &actual, const std::vector<float> &before,
                       int64_t rows, int64_t out, int64_t stride) {
  int64_t count = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = out; n < stride; ++n)
      count += std::bit_cast<uint32_t>(actual[r * stride + n]) !=
               std::bit_cast<uint32_t>(before[r * stride + n]);
  return count;
}

// ---- (b) exact GEMM: integer codes in [-4, 4], power-of-two scales

class LinearFp8ExactCuda : public testing::TestWithParam<GemmShape> {};

// Every product is an integer up to 16, a 128-product block sum stays below 2^11, the scales are
// 2^-3..2^0 and y's old values multiples of 2^-6: all partial sums fit an fp32 (and the FP8 tensor
// cores' ~14-bit accumulation) exactly, in any order. The result must equal the reference bit for
// bit; a scale read from the wrong place changes it by a power of two.
TEST_P(LinearFp8ExactCuda, MatchesReferenceExactly) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const GemmShape s = GetParam();
  const int64_t weightStride = s.in + s.weightPad, yStride = s.out + s.yPad;
  std::mt19937 rng(int(s.rows * 31 + s.in * 3 + s.out));
  std::uniform_int_distribution<int> value(-4, 4), exponent(-3, 0), old(-64, 64);
  QuantizedRows x{std::vector<uint8_t>(size_t(s.rows * s.in)),
                  std::vector<float>(size_t(s.rows * tilesOf(s.in)))};
  for (uint8_t &c : x.codes)
    c = ref::floatToE4M3(float(value(rng)));
  for (float &scale : x.scales)
    scale = std::ldexp(1.0f, exponent(rng));
  Fp8Weight w = makeWeight(s.out, s.in, weightStride);
  for (int64_t n = 0; n < s.out; ++n)
    for (int64_t k = 0; k < s.in; ++k)
      w.codes[n * weightStride + k] = ref::floatToE4M3(float(value(rng)));
  for (int64_t nb = 0; nb < tilesOf(s.out); ++nb)
    for (int64_t kb = 0; kb < tilesOf(s.in); ++kb)
      weightScale(w, s.in, nb * kBlock, kb * kBlock) = std::ldexp(1.0f, exponent(rng));
  std::vector<float> y(size_t(s.rows * yStride));
  for (float &v : y)
    v = std::ldexp(float(old(rng)), -6);

  const std::vector<double> product = referenceProduct(x, w, s.rows, s.in, s.out, weightStride);
  std::vector<float> expected(size_t(s.rows * s.out));
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t n = 0; n < s.out; ++n)
      expected[r * s.out + n] =
          float(product[r * s.out + n] + (s.accumulate ? double(y[r * yStride + n]) : 0.0));

  Buffers b({0.0f}, w, y, writeScratch(x, s.rows, s.in, s.out));
  cuda::LinearContext context;
  ASSERT_EQ(context.init(), 0);
  const cuda::LinearFp8Params p = paramsFor(s, b);
  const int code = context.runFp8Prequantized(p, nullptr);
  ASSERT_EQ(code, 0) << gemmFailure(s, code);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> result = b.y.download();
  const std::vector<float> actual = columns(result, s.rows, s.out, yStride);
  int64_t differing = 0;
  for (size_t i = 0; i < expected.size(); ++i)
    if (actual[i] != expected[i] && differing++ == 0)
      ADD_FAILURE() << "y(" << i / s.out << ", " << i % s.out << ") = " << actual[i]
                    << ", expected " << expected[i];
  EXPECT_EQ(differing, 0) << "relative RMS error " << relativeRms(actual, expected);
  EXPECT_EQ(paddingChanges(result, y, s.rows, s.out, yStride), 0);
}

// ceil(in/128) % 4 != 0 with several rows of weight blocks checks the padded weight-scale rows;
// rows of 1, 3, 4, 7, 17 and 130 the padding of the GEMM to 16-row multiples (the activation
// scales' leading dimension, the product copied into y, accumulating or not); in of 320 and 96 a
// short last k block; NaN codes past `in` in padded weight rows that nothing past `in` is read.
INSTANTIATE_TEST_SUITE_P(Shapes, LinearFp8ExactCuda,
                         testing::Values(GemmShape{7, 320, 200, 0, 16, 0, false},
                                         GemmShape{1, 640, 136, 0, 16, 4, false},
                                         GemmShape{130, 256, 260, 0, 0, 0, true},
                                         GemmShape{4, 512, 384, 0, 0, 8, true},
                                         GemmShape{3, 96, 96, 0, 0, 0, false},
                                         GemmShape{4, 384, 256, 0, 0, 0, false},
                                         GemmShape{17, 256, 132, 0, 16, 4, true},
                                         // the decode kernel (<= 8 rows, in % 128 == 0): a
                                         // partial last block of 16 outputs, strides, adding
                                         GemmShape{8, 1024, 264, 0, 16, 4, true}),
                         gemmName);

// ---- (b) the fused path on realistic data

class LinearFp8Cuda : public testing::TestWithParam<GemmShape> {};

// Error budget: the reference multiplies the very FP8 operands the GPU multiplies, so only the
// accumulation differs. cuBLASLt promotes to fp32 after every 128-wide k block (2^-24 per add),
// but inside a block the sm_90 FP8 tensor cores keep about 14 bits (DeepSeek-V3 report, §3.3.2):
// addends aligned to the largest and truncated. A model of that (13 to 14 kept bits, this data)
// gives a relative RMS error of 1.3e-4 to 5e-5; an exact fp32 accumulation would give ~1e-7.
// The bound is about twice the 13-bit model; wrong scales or layouts give errors of order one.
constexpr double kFp8AccumulationBound = 3e-4;

TEST_P(LinearFp8Cuda, MatchesReferenceOnSameFp8Operands) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const GemmShape s = GetParam();
  const int64_t xStride = s.in + s.xPad, weightStride = s.in + s.weightPad;
  const int64_t yStride = s.out + s.yPad;
  std::mt19937 rng(int(s.rows * 131 + s.in * 7 + s.out));
  std::vector<float> x = tiledActivations(s.rows, s.in, xStride, rng, -2.0f, 2.0f);
  // A checkpoint-like weight: N(0, 1) quantized per 128x128 block with s = amax/448 times
  // 2^U(-2, 2), so the block scales differ.
  Fp8Weight w = makeWeight(s.out, s.in, weightStride);
  {
    std::vector<float> dense = random(size_t(s.out * s.in), rng, 1.0f);
    std::uniform_real_distribution<float> spread(-2.0f, 2.0f);
    for (int64_t nb = 0; nb < tilesOf(s.out); ++nb)
      for (int64_t kb = 0; kb < tilesOf(s.in); ++kb) {
        float amax = 0;
        for (int64_t n = nb * kBlock; n < std::min(s.out, (nb + 1) * kBlock); ++n)
          for (int64_t k = kb * kBlock; k < std::min(s.in, (kb + 1) * kBlock); ++k)
            amax = std::max(amax, std::fabs(dense[n * s.in + k]));
        const float scale = amax / ref::kE4M3Max * std::exp2(spread(rng));
        weightScale(w, s.in, nb * kBlock, kb * kBlock) = scale;
        for (int64_t n = nb * kBlock; n < std::min(s.out, (nb + 1) * kBlock); ++n)
          for (int64_t k = kb * kBlock; k < std::min(s.in, (kb + 1) * kBlock); ++k)
            w.codes[n * weightStride + k] = ref::floatToE4M3(dense[n * s.in + k] / scale);
      }
  }
  std::vector<float> y = random(size_t(s.rows * yStride), rng, 1.0f);

  // 0xFF: NaN codes and scales, so the pad rows and the product must be written, not inherited.
  Buffers b(x, w, y, std::vector<uint8_t>(cuda::linearFp8ScratchBytes(s.rows, s.in, s.out), 0xFF));
  cuda::LinearContext context;
  ASSERT_EQ(context.init(), 0);
  const cuda::LinearFp8Params p = paramsFor(s, b);
  for (int call = 0; call < 2; ++call) { // the second call reuses the cached algorithm
    if (call == 1) {
      ASSERT_EQ(cudaMemcpy(b.y.data, y.data(), y.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    }
    const int code = context.runFp8(p, nullptr);
    ASSERT_EQ(code, 0) << gemmFailure(s, code) << ", call " << call;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // The GEMM's operands: the quantized x must be the reference's, bit for bit.
    const std::vector<uint8_t> scratch = b.scratch.download();
    const QuantizedRows quantized = readScratch(scratch, s.rows, s.in);
    ASSERT_EQ(mismatches(quantized, referenceQuantization(x, s.rows, s.in, xStride, s.rule), s.in),
              0);
    EXPECT_EQ(padRowProblems(scratch, s.rows, s.in), 0);
    const std::vector<double> product =
        referenceProduct(quantized, w, s.rows, s.in, s.out, weightStride);
    std::vector<float> expected(size_t(s.rows * s.out));
    for (int64_t r = 0; r < s.rows; ++r)
      for (int64_t n = 0; n < s.out; ++n)
        expected[r * s.out + n] =
            float(product[r * s.out + n] + (s.accumulate ? double(y[r * yStride + n]) : 0.0));
    const std::vector<float> result = b.y.download();
    const double error = relativeRms(columns(result, s.rows, s.out, yStride), expected);
    std::printf("[   info   ] %s call %d: relative RMS error %.3g\n", gemmName({s, 0}).c_str(),
                call, error);
    EXPECT_LT(error, kFp8AccumulationBound) << "call " << call;
    EXPECT_EQ(paddingChanges(result, y, s.rows, s.out, yStride), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LinearFp8Cuda,
    testing::Values(GemmShape{1, 1024, 256, 0, 0, 0, false}, GemmShape{7, 320, 200, 3, 16, 4, true},
                    GemmShape{64, 768, 520, 0, 0, 0, false, Fp8ActivationScale::DeepSeekUe8m0},
                    GemmShape{3, 96, 96, 0, 0, 0, false},
                    GemmShape{130, 512, 384, 5, 0, 8, true, Fp8ActivationScale::DeepSeekUe8m0},
                    GemmShape{16, 7168, 576, 0, 0, 0, false},
                    // The tiny FP8 DeepSeek's MLA and indexer projections (40 prompt rows):
                    // q_a / kv_a, q_b, wq_b, wk, o_proj.
                    GemmShape{40, 256, 96, 0, 0, 0, false, Fp8ActivationScale::DeepSeekUe8m0},
                    GemmShape{40, 96, 192, 0, 0, 0, false, Fp8ActivationScale::DeepSeekUe8m0},
                    GemmShape{40, 96, 256, 0, 0, 0, false, Fp8ActivationScale::DeepSeekUe8m0},
                    GemmShape{40, 256, 64, 0, 0, 0, false, Fp8ActivationScale::DeepSeekUe8m0},
                    GemmShape{40, 128, 256, 0, 0, 0, false, Fp8ActivationScale::DeepSeekUe8m0},
                    // The decode kernel at DeepSeek-V3.2's widths, each of its forms: q_a and
                    // kv_a (8 warps, 8 stages), 1536 -> 3072 (8 warps, 2 stages), the shared
                    // expert's down (4 warps).
                    GemmShape{5, 7168, 1536, 0, 0, 0, true},
                    GemmShape{8, 7168, 576, 0, 0, 0, false, Fp8ActivationScale::DeepSeekUe8m0},
                    GemmShape{2, 1536, 3072, 4, 16, 0, false},
                    GemmShape{3, 2048, 7168, 0, 0, 0, true}),
    gemmName);

// The decode kernel (rows <= 8): a row's outputs have the same bits whatever rows share the
// call, as a decode step and a speculation pass of the same token must; in each of its forms
// (8 warps, 2 or 8 stages; 4 warps).
class LinearFp8DecodeRows : public testing::TestWithParam<std::pair<int64_t, int64_t>> {};

TEST_P(LinearFp8DecodeRows, GiveTheSameBitsWhateverTheRowsOfTheCall) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const auto [in, out] = GetParam();
  std::mt19937 rng(41);
  const std::vector<float> x = tiledActivations(8, in, in, rng, -2.0f, 2.0f);
  Fp8Weight w = makeWeight(out, in, in);
  for (uint8_t &code : w.codes)
    code = ref::floatToE4M3(std::normal_distribution<float>(0.0f, 1.0f)(rng));
  for (float &scale : w.scales)
    scale = std::exp2(std::uniform_real_distribution<float>(-8.0f, -4.0f)(rng));
  std::vector<float> firstRow[2];
  for (const int64_t rows : {int64_t(8), int64_t(1)}) {
    const GemmShape s{rows, in, out, 0, 0, 0, false};
    Buffers b(x, w, std::vector<float>(size_t(8 * out)),
              std::vector<uint8_t>(cuda::linearFp8ScratchBytes(rows, in, out)));
    cuda::LinearContext context;
    ASSERT_EQ(context.init(), 0);
    const int code = context.runFp8(paramsFor(s, b), nullptr);
    ASSERT_EQ(code, 0) << gemmFailure(s, code);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    firstRow[rows == 1] = b.y.download();
    firstRow[rows == 1].resize(size_t(out));
  }
  EXPECT_EQ(differingBits(firstRow[1], firstRow[0]), 0u);
}

INSTANTIATE_TEST_SUITE_P(Forms, LinearFp8DecodeRows,
                         testing::Values(std::pair<int64_t, int64_t>{1536, 528},
                                         std::pair<int64_t, int64_t>{7168, 576},
                                         std::pair<int64_t, int64_t>{2048, 7168}));

// ---- (c) rejected problems

// Host arithmetic only: the scratch a caller plans once covers every row count up to its
// maximum, although 64 rows need less than 63 (no product part).
TEST(LinearFp8Scratch, MaxCoversEveryRowCount) {
  for (int64_t maxRows : {1, 15, 16, 17, 64, 130})
    for (int64_t in : {128, 300})
      for (int64_t out : {4, 512}) {
        size_t largest = 0;
        for (int64_t rows = 1; rows <= maxRows; ++rows)
          largest = std::max(largest, cuda::linearFp8ScratchBytes(rows, in, out));
        EXPECT_EQ(cuda::linearFp8MaxScratchBytes(maxRows, in, out), largest)
            << maxRows << " rows, " << in << " -> " << out;
      }
  EXPECT_LT(cuda::linearFp8ScratchBytes(64, 256, 256), cuda::linearFp8ScratchBytes(36, 256, 256));
}

TEST(LinearFp8CudaErrors, RejectsUnsupportedShapesWithoutTouchingY) {
  cuda::LinearContext context;
  cuda::LinearFp8Params p;
  EXPECT_EQ(context.runFp8(p, nullptr), int(cudaErrorInvalidValue)) << "not initialized";
  EXPECT_EQ(cuda::quantizeFp8Activations(nullptr, 0, 1, 128, Fp8ActivationScale::DeepSeekLinear,
                                         nullptr, nullptr),
            int(cudaErrorInvalidValue));
  EXPECT_EQ(cuda::linearFp8ScratchBytes(0, 128, 128), 0u);
  EXPECT_EQ(cuda::linearFp8PaddedRows(1), 16);
  EXPECT_EQ(cuda::linearFp8PaddedRows(16), 16);
  EXPECT_EQ(cuda::linearFp8PaddedRows(17), 32);
  // Codes [16, 256], scales [2, 16] at 4096, then (rows padded) the fp32 [16, 128] product at
  // 4352; with rows = 16 there is no product part.
  EXPECT_EQ(cuda::linearFp8ScratchScaleOffset(2, 256), 4096u);
  EXPECT_EQ(cuda::linearFp8ScratchBytes(2, 256, 128), 4352u + 16 * 128 * 4);
  EXPECT_EQ(cuda::linearFp8ScratchBytes(16, 256, 128), 4096u + 2 * 16 * 4);
  EXPECT_EQ(cuda::linearFp8WeightScaleStride(7168), 56);
  EXPECT_EQ(cuda::linearFp8WeightScaleStride(320), 4);
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(context.init(), 0);
  // A valid problem first, so each failure below is caused by its one change (rows = 2: the
  // padded path, where y is not a cuBLASLt operand, yet y's conditions below still apply).
  const GemmShape s{2, 256, 128, 0, 0, 0, false};
  std::mt19937 rng(5);
  Fp8Weight w = makeWeight(s.out, s.in, s.in);
  for (uint8_t &c : w.codes)
    c = ref::floatToE4M3(float(int(rng() % 9) - 4));
  for (float &scale : w.scales)
    scale = 1.0f;
  Buffers b(random(size_t(s.rows * s.in), rng, 1.0f), w, std::vector<float>(s.rows * s.out, 0.0f),
            std::vector<uint8_t>(cuda::linearFp8ScratchBytes(s.rows, s.in, s.out)));
  const cuda::LinearFp8Params valid = paramsFor(s, b);
  {
    const int code = context.runFp8(valid, nullptr);
    ASSERT_EQ(code, 0) << gemmFailure(s, code);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> before = b.y.download();
  const std::vector<uint8_t> scratchBefore = b.scratch.download();

  constexpr int kNotSupported = 1000 + 15; // CUBLAS_STATUS_NOT_SUPPORTED
  auto expectCode = [&](const char *what, int expected, auto change) {
    cuda::LinearFp8Params p = valid;
    change(p);
    const int code = context.runFp8(p, nullptr);
    EXPECT_EQ(code, expected) << what << ": " << cuda::linearErrorText(code);
    EXPECT_NE(code, 0) << what;
  };
  expectCode("in % 16", kNotSupported, [](auto &p) { p.in = 248; });
  expectCode("out % 4", kNotSupported, [](auto &p) { p.out = 126; });
  expectCode("weight stride % 16", kNotSupported, [](auto &p) { p.weightStride = 264 - 4; });
  expectCode("y stride % 4", kNotSupported, [](auto &p) { p.yStride = 130; });
  expectCode("misaligned weight", kNotSupported,
             [](auto &p) { p.weight = static_cast<const uint8_t *>(p.weight) + 16 + 8; });
  expectCode("misaligned y", kNotSupported, [](auto &p) { p.y += 1; });
  expectCode("no rows", int(cudaErrorInvalidValue), [](auto &p) { p.rows = 0; });
  expectCode("x stride < in", int(cudaErrorInvalidValue), [](auto &p) { p.xStride = 128; });
  expectCode("no scratch", int(cudaErrorInvalidValue), [](auto &p) { p.scratch = nullptr; });
  expectCode("no weight scales", int(cudaErrorInvalidValue),
             [](auto &p) { p.weightScale = nullptr; });
  expectCode("unknown rule", int(cudaErrorInvalidValue),
             [](auto &p) { p.activationScale = Fp8ActivationScale(7); });
  EXPECT_EQ(context.runFp8Prequantized(
                [&] {
                  cuda::LinearFp8Params p = valid;
                  p.x = nullptr; // not read here
                  p.out = 6;
                  return p;
                }(),
                nullptr),
            kNotSupported);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> after = b.y.download();
  EXPECT_EQ(std::memcmp(after.data(), before.data(), after.size() * 4), 0) << "y was written";
  EXPECT_TRUE(b.scratch.download() == scratchBefore) << "scratch was written: launched anyway";
}

} // namespace
} // namespace hybrid::kernels
