#include "hybrid/kernels/ref/Parallel.h"
#include "hybrid/kernels/ref/TiledLayout.h"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>

namespace hybrid::kernels::ref {
namespace {

std::string describe(const TiledLayout &layout, int64_t elementBytes) {
  return "[" + std::to_string(layout.rows) + ", " + std::to_string(layout.cols) + "] tile [" +
         std::to_string(layout.tile.rows) + ", " + std::to_string(layout.tile.cols) + "] of " +
         std::to_string(elementBytes) + "-byte elements";
}

void checkBufferSizes(const char *function, const TiledLayout &layout, int64_t elementBytes,
                      std::span<const std::byte> rowMajor, std::span<const std::byte> tiled) {
  validateTiledLayout(layout, elementBytes);
  const int64_t rowMajorBytes = layout.rows * layout.cols * elementBytes;
  const int64_t tiledBytes = layout.tiledBytes(elementBytes);
  if (static_cast<int64_t>(rowMajor.size()) != rowMajorBytes)
    throw std::invalid_argument(
        std::string(function) + ": row-major buffer has " + std::to_string(rowMajor.size()) +
        " bytes, " + describe(layout, elementBytes) + " needs " + std::to_string(rowMajorBytes));
  if (static_cast<int64_t>(tiled.size()) != tiledBytes)
    throw std::invalid_argument(
        std::string(function) + ": tiled buffer has " + std::to_string(tiled.size()) + " bytes, " +
        describe(layout, elementBytes) + " needs " + std::to_string(tiledBytes));
  // Compare addresses as integers: relational operators on unrelated pointers are unspecified.
  const auto begin = [](std::span<const std::byte> bytes) {
    return reinterpret_cast<std::uintptr_t>(bytes.data());
  };
  if (!rowMajor.empty() && !tiled.empty() && begin(rowMajor) < begin(tiled) + tiled.size() &&
      begin(tiled) < begin(rowMajor) + rowMajor.size())
    throw std::invalid_argument(std::string(function) + ": the two buffers overlap");
}

// Walks the tiled buffer front to back, one tile row (tile.cols elements) at a time, and calls
// visit(tiledElement, rowMajorElement, validCols): the tile row starts at element tiledElement of
// the tiled buffer and holds validCols real elements starting at element rowMajorElement of the
// row-major matrix, then tile.cols - validCols padding elements (validCols is 0 for padding rows).
template <typename Visit> void forEachTileRow(const TiledLayout &layout, Visit &&visit) {
  int64_t tiledElement = 0;
  for (int64_t panel = 0; panel < layout.numPanels(); ++panel)
    for (int64_t kTile = 0; kTile < layout.tilesPerPanel(); ++kTile)
      for (int64_t tileRow = 0; tileRow < layout.tile.rows; ++tileRow) {
        const int64_t row = panel * layout.tile.rows + tileRow;
        const int64_t firstCol = kTile * layout.tile.cols;
        const int64_t validCols =
            row < layout.rows ? std::min(layout.tile.cols, layout.cols - firstCol) : 0;
        visit(tiledElement, row * layout.cols + firstCol, validCols);
        tiledElement += layout.tile.cols;
      }
}

// The fp32 dot product of ref::dot (Math.h), taken apart so that it can be fed one tile row at a
// time: element k goes to lane k mod 8 while k < vectorEnd (K rounded down to a multiple of 8),
// to the tail after, each in increasing k, and finish() combines them exactly as dot() does. Same
// additions in the same order, hence bitwise the same result.
class SplitDot {
public:
  // Adds x[k]·w[k] for k in [firstCol, firstCol + count); x and w point at element firstCol.
  void accumulate(const float *x, const float *w, int64_t firstCol, int64_t count,
                  int64_t vectorEnd) {
    // Work on local copies: x and w may alias the members as far as the compiler knows, which
    // would keep the lanes in memory instead of in a register.
    float lanes[8];
    std::copy(std::begin(lanes_), std::end(lanes_), lanes);
    float tail = tail_;
    const int64_t end = firstCol + count;
    const int64_t lanesEnd = std::min(end, vectorEnd);
    int64_t k = firstCol;
    // Up to the next multiple of 8 (only when tile.cols is not one), then whole groups of 8 in
    // the same form as dot() so that they vectorise the same way, then what is left.
    for (; k < lanesEnd && k % 8 != 0; ++k)
      lanes[k % 8] += x[k - firstCol] * w[k - firstCol];
    for (; k + 8 <= lanesEnd; k += 8)
      for (int lane = 0; lane < 8; ++lane)
        lanes[lane] += x[k - firstCol + lane] * w[k - firstCol + lane];
    for (; k < lanesEnd; ++k)
      lanes[k % 8] += x[k - firstCol] * w[k - firstCol];
    for (; k < end; ++k)
      tail += x[k - firstCol] * w[k - firstCol];
    std::copy(std::begin(lanes), std::end(lanes), lanes_);
    tail_ = tail;
  }

  float finish() const {
    return ((lanes_[0] + lanes_[4]) + (lanes_[1] + lanes_[5])) +
           ((lanes_[2] + lanes_[6]) + (lanes_[3] + lanes_[7])) + tail_;
  }

private:
  float lanes_[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float tail_ = 0.0f;
};

// Rows of x run one after the other against the same row of a panel, so that row (K weights, spread
// over the panel's tiles) comes from memory once per block and from L1 for the other rows.
constexpr int64_t kRowBlock = 8;

} // namespace

void validateTiledLayout(const TiledLayout &layout, int64_t elementBytes) {
  if (elementBytes != 1 && elementBytes != 2 && elementBytes != 4)
    throw std::invalid_argument("tiled layout: element size must be 1, 2 or 4 bytes, got " +
                                std::to_string(elementBytes));
  if (layout.rows < 0 || layout.cols < 0 || layout.tile.rows < 1 || layout.tile.cols < 1)
    throw std::invalid_argument("tiled layout: bad extents " + describe(layout, elementBytes));
  int64_t bytes = 0;
  if (__builtin_mul_overflow(layout.numPanels(), layout.tile.rows, &bytes) ||
      __builtin_mul_overflow(bytes, layout.tilesPerPanel(), &bytes) ||
      __builtin_mul_overflow(bytes, layout.tile.cols, &bytes) ||
      __builtin_mul_overflow(bytes, elementBytes, &bytes))
    throw std::invalid_argument("tiled layout: size overflows int64 for " +
                                describe(layout, elementBytes));
}

void packTiled(std::span<const std::byte> rowMajor, std::span<std::byte> tiled,
               const TiledLayout &layout, int64_t elementBytes) {
  checkBufferSizes("packTiled", layout, elementBytes, rowMajor, tiled);
  const int64_t tileRowBytes = layout.tile.cols * elementBytes;
  forEachTileRow(layout, [&](int64_t tiledElement, int64_t rowMajorElement, int64_t validCols) {
    std::byte *destination = tiled.data() + tiledElement * elementBytes;
    const int64_t validBytes = validCols * elementBytes;
    if (validBytes > 0)
      std::memcpy(destination, rowMajor.data() + rowMajorElement * elementBytes, validBytes);
    std::memset(destination + validBytes, 0, tileRowBytes - validBytes);
  });
}

void unpackTiled(std::span<const std::byte> tiled, std::span<std::byte> rowMajor,
                 const TiledLayout &layout, int64_t elementBytes) {
  checkBufferSizes("unpackTiled", layout, elementBytes, rowMajor, tiled);
  forEachTileRow(layout, [&](int64_t tiledElement, int64_t rowMajorElement, int64_t validCols) {
    if (validCols > 0)
      std::memcpy(rowMajor.data() + rowMajorElement * elementBytes,
                  tiled.data() + tiledElement * elementBytes, validCols * elementBytes);
  });
}

void linearTiled(std::span<const float> x, std::span<const float> tiledWeight, std::span<float> y,
                 int64_t rows, const TiledLayout &layout) {
  const int64_t outFeatures = layout.rows, inFeatures = layout.cols;
  const int64_t tileRows = layout.tile.rows, tileCols = layout.tile.cols;
  assert(tileRows >= 1 && tileCols >= 1);
  assert(static_cast<int64_t>(x.size()) >= rows * inFeatures);
  assert(static_cast<int64_t>(tiledWeight.size()) >= layout.paddedRows() * layout.paddedCols());
  assert(static_cast<int64_t>(y.size()) >= rows * outFeatures);
  const int64_t vectorEnd = inFeatures - inFeatures % 8; // where dot() switches to its tail
  const int64_t panelElements = tileRows * layout.paddedCols();
  // One N panel is one contiguous stretch of the tiled buffer (tn × paddedCols) that stays in
  // cache while a block of x rows runs against it. Each output walks its row of the panel tile by
  // tile (tile.cols contiguous elements, then a jump of one tile), in increasing k as dot() does.
  parallelFor(
      layout.numPanels(),
      [&](int64_t panelBegin, int64_t panelEnd) {
        for (int64_t panel = panelBegin; panel < panelEnd; ++panel) {
          const float *panelWeight = tiledWeight.data() + panel * panelElements;
          const int64_t firstOut = panel * tileRows;
          const int64_t outCount = std::min(tileRows, outFeatures - firstOut);
          for (int64_t rowBegin = 0; rowBegin < rows; rowBegin += kRowBlock) {
            const int64_t rowEnd = std::min(rows, rowBegin + kRowBlock);
            for (int64_t o = 0; o < outCount; ++o) {
              // Row o of the panel's first tile; the same row of K tile t is t tiles further.
              const float *weightRow = panelWeight + o * tileCols;
              for (int64_t row = rowBegin; row < rowEnd; ++row) {
                const float *xRow = x.data() + row * inFeatures;
                SplitDot sum;
                for (int64_t kTile = 0; kTile < layout.tilesPerPanel(); ++kTile) {
                  const int64_t firstCol = kTile * tileCols;
                  sum.accumulate(xRow + firstCol, weightRow + kTile * layout.tileElements(),
                                 firstCol, std::min(tileCols, inFeatures - firstCol), vectorEnd);
                }
                y[row * outFeatures + firstOut + o] = sum.finish();
              }
            }
          }
        }
      },
      /*minGrain=*/
      std::max<int64_t>(1, 16384 / std::max<int64_t>(1, rows * tileRows * inFeatures)));
}

TileShape defaultTileFor(int64_t rows, int64_t cols, int64_t elementBytes) {
  if (elementBytes != 1 && elementBytes != 2 && elementBytes != 4)
    throw std::invalid_argument("defaultTileFor: element size must be 1, 2 or 4 bytes, got " +
                                std::to_string(elementBytes));
  if (rows < 0 || cols < 0)
    throw std::invalid_argument("defaultTileFor: negative extent [" + std::to_string(rows) + ", " +
                                std::to_string(cols) + "]");
  constexpr int64_t kTileRowBytes = 128; // two cache lines; one 128B-swizzle TMA box row
  constexpr int64_t kMinColBytes = 32;   // two 16-byte TMA granules; one 8-float CPU vector
  constexpr int64_t kRowGranule = 8;     // MMA row granule
  const int64_t fullRows = elementBytes == 4 ? 32 : 64;
  const int64_t fullCols = kTileRowBytes / elementBytes;
  const int64_t colGranule = kMinColBytes / elementBytes;
  // The full tile, or the smallest multiple of the granule that holds a smaller extent.
  const auto fit = [](int64_t extent, int64_t full, int64_t granule) {
    return extent >= full ? full : std::max<int64_t>(1, (extent + granule - 1) / granule) * granule;
  };
  return TileShape{fit(rows, fullRows, kRowGranule), fit(cols, fullCols, colGranule)};
}

} // namespace hybrid::kernels::ref
