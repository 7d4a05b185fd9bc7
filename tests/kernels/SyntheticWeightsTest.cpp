// The host generator of synthetic weights (kernels/ref/synthetic_weights.cc): the distributions it
// promises, a tiled fill equal to the re-tiled row-major fill, a sharded rank's windowed fill
// equal to the whole tensor's slice, FP8 codes inside E4M3's range.
#include "hybrid/kernels/SyntheticWeights.h"
#include "hybrid/kernels/ref/Quant.h"
#include "hybrid/kernels/ref/TiledLayout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <string>
#include <vector>

namespace hybrid::kernels {
namespace {

constexpr double kPerUnit = std::numbers::sqrt3 / 65536.0; // Irwin-Hall sum -> unit deviation

SyntheticFill fillOf(SyntheticKind kind, SyntheticStorage storage, float a, float b, int64_t rows,
                     int64_t cols) {
  SyntheticFill fill;
  fill.kind = kind;
  fill.storage = storage;
  fill.key = 0x5eed;
  fill.a = a;
  fill.b = b;
  fill.rows = rows;
  fill.cols = cols;
  fill.storedElements = rows * cols;
  return fill;
}

std::vector<float> generateF32(const SyntheticFill &fill) {
  std::vector<float> values(static_cast<size_t>(fill.storedElements));
  ref::fillSynthetic(fill, values.data());
  return values;
}

TEST(SyntheticWeights, NormalHasTheAskedMeanAndDeviationAndIsBounded) {
  const double sigma = 0.06;
  const SyntheticFill fill = fillOf(SyntheticKind::Normal, SyntheticStorage::F32,
                                    static_cast<float>(sigma * kPerUnit), 1.0f, 256, 1024);
  const std::vector<float> values = generateF32(fill);
  double sum = 0, squares = 0, largest = 0;
  for (float v : values) {
    sum += v - 1.0;
    squares += (v - 1.0) * (v - 1.0);
    largest = std::max(largest, std::fabs(v - 1.0));
  }
  const double n = static_cast<double>(values.size());
  EXPECT_NEAR(sum / n, 0.0, 0.01 * sigma);
  EXPECT_NEAR(std::sqrt(squares / n), sigma, 0.01 * sigma);
  EXPECT_LE(largest, 3.4642 * sigma + 1e-6);
  EXPECT_GT(largest, 2.5 * sigma); // 262144 draws reach the tails
  // Another key gives other values; the same key the same ones.
  SyntheticFill other = fill;
  other.key += 1;
  EXPECT_NE(generateF32(other), values);
  EXPECT_EQ(generateF32(fill), values);
}

TEST(SyntheticWeights, DecayKindsStayInTheirRanges) {
  const std::vector<float> aLog =
      generateF32(fillOf(SyntheticKind::LogUniform, SyntheticStorage::F32, 1.0f, 16.0f, 1, 4096));
  for (float v : aLog) {
    EXPECT_GE(v, 0.0f);
    EXPECT_LE(v, std::log(16.0f));
  }
  const std::vector<float> dtBias = generateF32(
      fillOf(SyntheticKind::DecayTimeBias, SyntheticStorage::F32, 1e-3f, 1e-1f, 1, 4096));
  for (float v : dtBias) {
    const double dt = std::log1p(std::exp(static_cast<double>(v))); // softplus
    EXPECT_GE(dt, 1e-3 * 0.999);
    EXPECT_LE(dt, 1e-1 * 1.001);
  }
  const std::vector<float> constant =
      generateF32(fillOf(SyntheticKind::Constant, SyntheticStorage::F32, 0.0f, 0.25f, 3, 3));
  EXPECT_TRUE(std::all_of(constant.begin(), constant.end(), [](float v) { return v == 0.25f; }));
}

TEST(SyntheticWeights, TiledFillIsTheRowMajorFillRetiled) {
  // 70 x 100 bf16 in tiles of 16 x 32: padding on both edges.
  SyntheticFill rowMajor = fillOf(SyntheticKind::Normal, SyntheticStorage::BF16,
                                  static_cast<float>(0.06 * kPerUnit), 0.0f, 70, 100);
  std::vector<std::byte> rowBytes(static_cast<size_t>(rowMajor.storedElements) * 2);
  ref::fillSynthetic(rowMajor, rowBytes.data());

  const ref::TiledLayout layout{70, 100, {16, 32}};
  SyntheticFill tiled = rowMajor;
  tiled.tileRows = 16;
  tiled.tileCols = 32;
  tiled.storedElements = layout.paddedRows() * layout.paddedCols();
  std::vector<std::byte> tiledBytes(static_cast<size_t>(tiled.storedElements) * 2);
  ref::fillSynthetic(tiled, tiledBytes.data());

  std::vector<std::byte> expected(tiledBytes.size());
  ref::packTiled(rowBytes, expected, layout, 2);
  EXPECT_EQ(tiledBytes, expected);
}

// A sharded plan's rank generates only its slice of a tensor: a fill whose source window places
// its [rows, cols] in the whole tensor's stream gives the elements the whole tensor has there.
// The windows the weight packer writes: rows (axis 0: consecutive, an offset), columns of a 2-D
// weight or a range along a middle axis (a row stride of the whole run, an offset), and a column
// slice stored in tiles.
TEST(SyntheticWeights, WindowedFillIsTheWholeTensorsSlice) {
  const int64_t dims[3] = {6, 10, 12}; // a [6, 10, 12] tensor
  SyntheticFill whole = fillOf(SyntheticKind::Normal, SyntheticStorage::F32,
                               static_cast<float>(0.06 * kPerUnit), 0.0f, 1, 6 * 10 * 12);
  const std::vector<float> all = generateF32(whole);
  for (int axis = 0; axis < 3; ++axis) {
    int64_t outer = 1, inner = 1;
    for (int d = 0; d < axis; ++d)
      outer *= dims[d];
    for (int d = axis + 1; d < 3; ++d)
      inner *= dims[d];
    const int64_t begin = 1, count = dims[axis] - 3; // neither end of the axis
    SCOPED_TRACE("axis " + std::to_string(axis));
    SyntheticFill slice = whole;
    slice.rows = outer;
    slice.cols = count * inner;
    slice.sourceRowStride = dims[axis] * inner;
    slice.sourceOffset = begin * inner;
    slice.storedElements = slice.rows * slice.cols;
    std::vector<float> expected;
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t i = 0; i < count * inner; ++i)
        expected.push_back(all[static_cast<size_t>((o * dims[axis] + begin) * inner + i)]);
    EXPECT_EQ(generateF32(slice), expected);
  }

  // Columns [40, 90) of a 70 x 100 bf16 matrix, stored in 16 x 32 tiles.
  SyntheticFill matrix = fillOf(SyntheticKind::Normal, SyntheticStorage::BF16,
                                static_cast<float>(0.06 * kPerUnit), 0.0f, 70, 100);
  std::vector<uint16_t> matrixBits(static_cast<size_t>(matrix.storedElements));
  ref::fillSynthetic(matrix, matrixBits.data());
  std::vector<std::byte> columns(70 * 50 * 2);
  for (int64_t r = 0; r < 70; ++r)
    std::memcpy(columns.data() + r * 50 * 2, matrixBits.data() + r * 100 + 40, 50 * 2);
  const ref::TiledLayout layout{70, 50, {16, 32}};
  SyntheticFill tiled = matrix;
  tiled.cols = 50;
  tiled.tileRows = 16;
  tiled.tileCols = 32;
  tiled.sourceRowStride = 100;
  tiled.sourceOffset = 40;
  tiled.storedElements = layout.paddedRows() * layout.paddedCols();
  std::vector<std::byte> tiledBytes(static_cast<size_t>(tiled.storedElements) * 2);
  ref::fillSynthetic(tiled, tiledBytes.data());
  std::vector<std::byte> expected(tiledBytes.size());
  ref::packTiled(columns, expected, layout, 2);
  EXPECT_EQ(tiledBytes, expected);
}

// The device's 32-bit index path (syntheticLogicalIndexIn<uint32_t>, taken where
// syntheticIndexFits32) gives every stored element the 64-bit path's source index; fills past
// 2^32 are refused it.
TEST(SyntheticWeights, NarrowIndexPathEqualsTheWideOne) {
  SyntheticFill rowMajor = fillOf(SyntheticKind::Normal, SyntheticStorage::BF16, 1.0f, 0.0f, 70, 100);
  SyntheticFill window = rowMajor; // columns [40, 90) of a 100-wide tensor
  window.cols = 50;
  window.sourceRowStride = 100;
  window.sourceOffset = 40;
  window.storedElements = 70 * 50;
  SyntheticFill tiled = rowMajor; // 16 x 32 tiles, padding on both edges
  tiled.tileRows = 16;
  tiled.tileCols = 32;
  tiled.storedElements = 80 * 128;
  SyntheticFill tiledWindow = window;
  tiledWindow.tileRows = 16;
  tiledWindow.tileCols = 32;
  tiledWindow.storedElements = 80 * 64;
  SyntheticFill rowsSlice = rowMajor; // rows [10, 80) of a taller tensor
  rowsSlice.sourceOffset = 10 * 100;
  for (const SyntheticFill &fill : {rowMajor, window, tiled, tiledWindow, rowsSlice}) {
    ASSERT_TRUE(syntheticIndexFits32(fill));
    for (int64_t stored = 0; stored < fill.storedElements; ++stored)
      ASSERT_EQ(syntheticLogicalIndexIn<uint32_t>(fill, uint32_t(stored)),
                syntheticLogicalIndex(fill, stored))
          << "stored element " << stored << " of a " << fill.rows << " x " << fill.cols
          << " fill (tiles " << fill.tileRows << " x " << fill.tileCols << ")";
  }
  // Kimi-Linear-48B's lm_head, tiled: 163840 x 2304 fits; a 70000 x 70000 matrix, or a window
  // whose source index passes 2^32, does not.
  SyntheticFill head = fillOf(SyntheticKind::Normal, SyntheticStorage::BF16, 1.0f, 0.0f, 163840, 2304);
  head.tileRows = 64;
  head.tileCols = 64;
  EXPECT_TRUE(syntheticIndexFits32(head));
  EXPECT_EQ(syntheticLogicalIndexIn<uint32_t>(head, uint32_t(head.storedElements - 1)),
            syntheticLogicalIndex(head, head.storedElements - 1));
  SyntheticFill huge = fillOf(SyntheticKind::Normal, SyntheticStorage::BF16, 1.0f, 0.0f, 70000, 70000);
  EXPECT_FALSE(syntheticIndexFits32(huge));
  SyntheticFill farWindow = rowMajor;
  farWindow.sourceOffset = int64_t(1) << 32;
  EXPECT_FALSE(syntheticIndexFits32(farWindow));
}

TEST(SyntheticWeights, Fp8CodesUseTheRangeWithoutSaturating) {
  // The compiler's FP8 parameters: codes of N(0, 1) * 128 (synth::syntheticValuesFor).
  const SyntheticFill fill = fillOf(SyntheticKind::Normal, SyntheticStorage::F8E4M3,
                                    static_cast<float>(128.0 * kPerUnit), 0.0f, 128, 2048);
  std::vector<uint8_t> codes(static_cast<size_t>(fill.storedElements));
  ref::fillSynthetic(fill, codes.data());
  double squares = 0, largest = 0;
  for (uint8_t code : codes) {
    ASSERT_NE(code & 0x7f, 0x7f) << "NaN code";
    const double value = ref::e4m3ToFloat(code);
    squares += value * value;
    largest = std::max(largest, std::fabs(value));
  }
  EXPECT_NEAR(std::sqrt(squares / codes.size()), 128.0, 4.0);
  EXPECT_LE(largest, 448.0);
  EXPECT_GT(largest, 300.0);
}

} // namespace
} // namespace hybrid::kernels
