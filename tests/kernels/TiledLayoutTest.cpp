#include "hybrid/kernels/ref/TiledLayout.h"

#include "TestUtil.h"
#include "hybrid/kernels/ref/Linear.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <gtest/gtest.h>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace hybrid::kernels::ref {
namespace {

using testing::randomNormal;

struct Shape {
  int64_t rows, cols;
};

// The odd shapes of the brief: single element, smaller than any tile, one past / one short of a
// tile, thin.
const std::vector<Shape> kOddShapes = {{1, 1}, {3, 5}, {17, 129}, {64, 64}, {65, 63}, {100, 7}};
const std::vector<TileShape> kTiles = {{1, 1},   {2, 4},   {4, 8},  {7, 3},
                                       {16, 64}, {32, 32}, {64, 64}};
const std::vector<int64_t> kElementSizes = {1, 2, 4};

std::vector<std::byte> randomBytes(std::mt19937 &rng, int64_t count) {
  std::uniform_int_distribution<int> distribution(0, 255);
  std::vector<std::byte> bytes(count);
  for (std::byte &byte : bytes)
    byte = static_cast<std::byte>(distribution(rng));
  return bytes;
}

std::span<const std::byte> asBytes(const std::vector<float> &values) {
  return std::as_bytes(std::span(values));
}

std::vector<uint32_t> bitsOf(const std::vector<float> &values) {
  std::vector<uint32_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    bits[i] = std::bit_cast<uint32_t>(values[i]);
  return bits;
}

std::string describe(const TiledLayout &layout, int64_t elementBytes) {
  return std::to_string(layout.rows) + "x" + std::to_string(layout.cols) + " tile " +
         std::to_string(layout.tile.rows) + "x" + std::to_string(layout.tile.cols) + " " +
         std::to_string(elementBytes) + "B";
}

TEST(TiledLayout, PaddedExtentsAndTiledBytes) {
  const TiledLayout layout{65, 63, {64, 64}};
  EXPECT_EQ(layout.numPanels(), 2);
  EXPECT_EQ(layout.tilesPerPanel(), 1);
  EXPECT_EQ(layout.paddedRows(), 128);
  EXPECT_EQ(layout.paddedCols(), 64);
  EXPECT_EQ(layout.tiledBytes(2), 128 * 64 * 2);
  for (const Shape shape : kOddShapes)
    for (const TileShape tile : kTiles)
      for (const int64_t elementBytes : kElementSizes) {
        const TiledLayout l{shape.rows, shape.cols, tile};
        const int64_t paddedRows = (shape.rows + tile.rows - 1) / tile.rows * tile.rows;
        const int64_t paddedCols = (shape.cols + tile.cols - 1) / tile.cols * tile.cols;
        EXPECT_EQ(l.paddedRows(), paddedRows);
        EXPECT_EQ(l.paddedCols(), paddedCols);
        EXPECT_EQ(l.tiledBytes(elementBytes), paddedRows * paddedCols * elementBytes);
      }
}

TEST(TiledLayout, OffsetOfHandCase) {
  // [3, 5] in [2, 4] tiles: 2 panels of 2 tiles, 8 elements per tile, padded to [4, 8].
  const TiledLayout layout{3, 5, {2, 4}};
  EXPECT_EQ(layout.offsetOf(0, 0), 0);
  EXPECT_EQ(layout.offsetOf(0, 3), 3);
  EXPECT_EQ(layout.offsetOf(1, 0), 4); // second row of the tile
  EXPECT_EQ(layout.offsetOf(0, 4), 8); // next tile along K
  EXPECT_EQ(layout.offsetOf(1, 4), 12);
  EXPECT_EQ(layout.offsetOf(2, 0), 16); // next panel
  EXPECT_EQ(layout.offsetOf(2, 4), 24);
  EXPECT_EQ(layout.offsetOf(3, 7), 31); // last padding element
}

TEST(TiledLayout, PackHandCase) {
  const TiledLayout layout{3, 5, {2, 4}};
  std::vector<std::byte> rowMajor(15);
  for (int i = 0; i < 15; ++i)
    rowMajor[i] = static_cast<std::byte>(i + 1);
  std::vector<std::byte> tiled(layout.tiledBytes(1), std::byte{0xAA});
  packTiled(rowMajor, tiled, layout, 1);
  const std::vector<int> expected = {
      1,  2,  3,  4,  6,  7, 8, 9, // panel 0, K tile 0: rows 0 and 1, cols 0..3
      5,  0,  0,  0,  10, 0, 0, 0, // panel 0, K tile 1: col 4, then padding
      11, 12, 13, 14, 0,  0, 0, 0, // panel 1, K tile 0: row 2, then a padding row
      15, 0,  0,  0,  0,  0, 0, 0, // panel 1, K tile 1
  };
  ASSERT_EQ(tiled.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i)
    EXPECT_EQ(std::to_integer<int>(tiled[i]), expected[i]) << "at " << i;
}

// For every shape, tile and element size: offsetOf is a bijection of the padded extent onto the
// tiled buffer, pack puts every element where offsetOf says, padding is zero, unpack inverts pack.
TEST(TiledLayout, PackAgreesWithOffsetOfAndUnpackInvertsIt) {
  std::mt19937 rng(7);
  for (const Shape shape : kOddShapes)
    for (const TileShape tile : kTiles)
      for (const int64_t elementBytes : kElementSizes) {
        const TiledLayout layout{shape.rows, shape.cols, tile};
        SCOPED_TRACE(describe(layout, elementBytes));
        const int64_t tiledElements = layout.paddedRows() * layout.paddedCols();

        std::vector<int> hits(tiledElements, 0);
        for (int64_t row = 0; row < layout.paddedRows(); ++row)
          for (int64_t col = 0; col < layout.paddedCols(); ++col) {
            const int64_t offset = layout.offsetOf(row, col);
            ASSERT_GE(offset, 0);
            ASSERT_LT(offset, tiledElements);
            ++hits[offset];
          }
        ASSERT_TRUE(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));

        const auto rowMajor = randomBytes(rng, shape.rows * shape.cols * elementBytes);
        std::vector<std::byte> tiled(layout.tiledBytes(elementBytes), std::byte{0xAA});
        packTiled(rowMajor, tiled, layout, elementBytes);

        std::vector<bool> isData(tiledElements, false);
        for (int64_t row = 0; row < shape.rows; ++row)
          for (int64_t col = 0; col < shape.cols; ++col) {
            const int64_t offset = layout.offsetOf(row, col);
            isData[offset] = true;
            for (int64_t b = 0; b < elementBytes; ++b)
              ASSERT_EQ(tiled[offset * elementBytes + b],
                        rowMajor[(row * shape.cols + col) * elementBytes + b])
                  << "element (" << row << ", " << col << ") byte " << b;
          }
        for (int64_t offset = 0; offset < tiledElements; ++offset) {
          if (isData[offset])
            continue;
          for (int64_t b = 0; b < elementBytes; ++b)
            ASSERT_EQ(tiled[offset * elementBytes + b], std::byte{0}) << "padding at " << offset;
        }

        std::vector<std::byte> roundTrip(rowMajor.size(), std::byte{0x55});
        unpackTiled(tiled, roundTrip, layout, elementBytes);
        ASSERT_EQ(roundTrip, rowMajor);
      }
}

TEST(TiledLayout, EmptyMatricesPackToNothing) {
  for (const Shape shape : std::vector<Shape>{{0, 0}, {0, 5}, {5, 0}}) {
    const TiledLayout layout{shape.rows, shape.cols, {4, 8}};
    EXPECT_EQ(layout.tiledBytes(2), 0);
    std::vector<std::byte> rowMajor, tiled;
    EXPECT_NO_THROW(packTiled(rowMajor, tiled, layout, 2));
    EXPECT_NO_THROW(unpackTiled(tiled, rowMajor, layout, 2));
  }
}

TEST(TiledLayout, RejectsBadLayoutsAndSizes) {
  const TiledLayout layout{3, 5, {2, 4}};
  std::vector<std::byte> rowMajor(15 * 2), tiled(layout.tiledBytes(2));
  EXPECT_NO_THROW(packTiled(rowMajor, tiled, layout, 2));

  std::vector<std::byte> shortRowMajor(15 * 2 - 1), longTiled(tiled.size() + 1);
  EXPECT_THROW(packTiled(shortRowMajor, tiled, layout, 2), std::invalid_argument);
  EXPECT_THROW(packTiled(rowMajor, longTiled, layout, 2), std::invalid_argument);
  EXPECT_THROW(unpackTiled(longTiled, rowMajor, layout, 2), std::invalid_argument);
  EXPECT_THROW(unpackTiled(tiled, shortRowMajor, layout, 2), std::invalid_argument);

  for (const int64_t elementBytes : {0, 3, 8, -1})
    EXPECT_THROW(validateTiledLayout(layout, elementBytes), std::invalid_argument);
  EXPECT_THROW(validateTiledLayout({3, 5, {0, 4}}, 2), std::invalid_argument);
  EXPECT_THROW(validateTiledLayout({3, 5, {2, -4}}, 2), std::invalid_argument);
  EXPECT_THROW(validateTiledLayout({-3, 5, {2, 4}}, 2), std::invalid_argument);
  const int64_t huge = std::numeric_limits<int64_t>::max() / 2;
  EXPECT_THROW(validateTiledLayout({huge, huge, {64, 64}}, 4), std::invalid_argument);
  // 2^61 - 1 four-byte elements fit in int64; padded to a multiple of 3 rows they no longer do.
  const int64_t fitsUnpadded = std::numeric_limits<int64_t>::max() / 4;
  EXPECT_NO_THROW(validateTiledLayout({fitsUnpadded, 1, {1, 1}}, 4));
  EXPECT_THROW(validateTiledLayout({fitsUnpadded, 1, {3, 1}}, 4), std::invalid_argument);

  // In-place packing would overwrite elements before reading them.
  const TiledLayout square{8, 8, {4, 4}};
  std::vector<std::byte> buffer(64);
  EXPECT_THROW(packTiled(buffer, buffer, square, 1), std::invalid_argument);
  EXPECT_THROW(unpackTiled(std::span(buffer).first(64), std::span(buffer).first(64), square, 1),
               std::invalid_argument);
}

TEST(TiledLayout, DefaultTiles) {
  // Large weights: 128 bytes of K per tile row.
  EXPECT_EQ(defaultTileFor(4096, 7168, 2), (TileShape{64, 64}));
  EXPECT_EQ(defaultTileFor(4096, 7168, 1), (TileShape{64, 128}));
  EXPECT_EQ(defaultTileFor(4096, 7168, 4), (TileShape{32, 32}));
  for (const int64_t elementBytes : kElementSizes)
    EXPECT_EQ(defaultTileFor(1 << 20, 1 << 20, elementBytes).cols * elementBytes, 128);
  // Small weights: shrunk to 8-row and 32-byte granules.
  EXPECT_EQ(defaultTileFor(3, 5, 2), (TileShape{8, 16}));
  EXPECT_EQ(defaultTileFor(100, 7, 4), (TileShape{32, 8}));
  EXPECT_EQ(defaultTileFor(17, 40, 1), (TileShape{24, 64}));
  EXPECT_EQ(defaultTileFor(0, 0, 4), (TileShape{8, 8}));
  EXPECT_THROW(defaultTileFor(8, 8, 3), std::invalid_argument);
  EXPECT_THROW(defaultTileFor(-1, 8, 2), std::invalid_argument);
}

// Where the target has FMA, the compiler may fuse a·b + c in one of the two kernels and not in the
// other (GCC contracts by default), so only the summation order is the same, not the roundings.
#if defined(__FP_FAST_FMAF) || defined(__FMA__) || defined(__ARM_FEATURE_FMA) ||                   \
    defined(__aarch64__)
constexpr bool kMayContractToFma = true;
#else
constexpr bool kMayContractToFma = false;
#endif

// Without FMA contraction (the project's default x86-64 flags) linearTiled must be bitwise equal to
// linear(); with it, within 1e-6 of Σ_k |x_k · w_k| (the scale of a dot product's rounding error).
void expectSameAsLinear(const std::vector<float> &x, const std::vector<float> &weight,
                        const std::vector<float> &expected, const std::vector<float> &actual,
                        int64_t rows, int64_t inFeatures, int64_t outFeatures) {
  if (!kMayContractToFma) {
    ASSERT_EQ(bitsOf(actual), bitsOf(expected));
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < outFeatures; ++o) {
      float scale = 0.0f;
      for (int64_t k = 0; k < inFeatures; ++k)
        scale += std::abs(x[r * inFeatures + k] * weight[o * inFeatures + k]);
      ASSERT_LE(std::abs(actual[r * outFeatures + o] - expected[r * outFeatures + o]),
                1e-6f * scale)
          << "output (" << r << ", " << o << ")";
    }
}

// linearTiled sums over K in linear()'s order, so the outputs are bitwise equal, whatever the tile
// (including tiles narrower than, or not a multiple of, the eight accumulation lanes).
TEST(TiledLayout, LinearTiledEqualsLinearBitwise) {
  std::mt19937 rng(11);
  std::vector<Shape> shapes = kOddShapes;
  shapes.push_back({257, 301});
  shapes.push_back({5, 0}); // K = 0: every output is +0
  for (const Shape shape : shapes) {
    std::vector<TileShape> tiles = kTiles;
    tiles.push_back(defaultTileFor(shape.rows, shape.cols, 4));
    tiles.push_back({16, 12});
    const auto weight = randomNormal(rng, shape.rows * shape.cols);
    for (const TileShape tile : tiles) {
      const TiledLayout layout{shape.rows, shape.cols, tile};
      std::vector<float> tiledWeight(layout.paddedRows() * layout.paddedCols());
      packTiled(asBytes(weight), std::as_writable_bytes(std::span(tiledWeight)), layout, 4);
      for (const int64_t rows : {1, 2, 7, 9, 17}) {
        SCOPED_TRACE(describe(layout, 4) + " rows " + std::to_string(rows));
        const auto x = randomNormal(rng, rows * shape.cols);
        std::vector<float> expected(rows * shape.rows), actual(rows * shape.rows, NAN);
        linear(x, weight, expected, rows, shape.cols, shape.rows);
        linearTiled(x, tiledWeight, actual, rows, layout);
        ASSERT_NO_FATAL_FAILURE(
            expectSameAsLinear(x, weight, expected, actual, rows, shape.cols, shape.rows));
      }
    }
  }
}

TEST(TiledLayout, LinearTiledHandCase) {
  // x [2, 3], W [2 out, 3 in] as in Linear.MultipliesByTransposedWeight, in [1, 2] tiles.
  const std::vector<float> x = {1, 2, 3, -1, 0, 1};
  const std::vector<float> w = {1, 0, 0, 1, 1, 1};
  const TiledLayout layout{2, 3, {1, 2}};
  std::vector<float> tiledWeight(layout.paddedRows() * layout.paddedCols());
  packTiled(asBytes(w), std::as_writable_bytes(std::span(tiledWeight)), layout, 4);
  EXPECT_EQ(tiledWeight, (std::vector<float>{1, 0, 0, 0, 1, 1, 1, 0}));
  std::vector<float> y(4);
  linearTiled(x, tiledWeight, y, 2, layout);
  EXPECT_EQ(y, (std::vector<float>{1, 6, -1, 0}));
}

} // namespace
} // namespace hybrid::kernels::ref
