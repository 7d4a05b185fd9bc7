// The tiled ("NZ") weight layout (DESIGN.md §1.2, docs/weight-layout.md): the compiler re-tiles
// each GEMM weight once into the blocks the kernels read; the runtime never converts layouts.
//
// A weight W is [N, K] row-major as PyTorch nn.Linear stores it (N = out_features = `rows`,
// K = in_features = `cols`), and y = x · Wᵀ. With tile [tn, tk]:
//   * N is split into panels of tn rows; panel p holds rows [p·tn, (p+1)·tn);
//   * within a panel, tiles follow each other along K: tile (p, t) holds columns [t·tk, (t+1)·tk);
//   * within a tile, its tn rows are stored one after the other, each as tk contiguous elements,
//     so one tile is one contiguous block of tn·tk elements and one panel one contiguous block of
//     tn · paddedCols elements;
//   * edge tiles are zero-padded to the full tile, so the buffer is paddedRows × paddedCols with
//     paddedRows = ceil(N / tn)·tn and paddedCols = ceil(K / tk)·tk.
// Element (row, col) therefore lives at element index
//   ((row / tn) · (paddedCols / tk) + col / tk) · tn·tk + (row % tn) · tk + col % tk.
// This order suits a GEMM that streams rows of x against W: the weights of tn outputs (one N panel)
// are one contiguous block a thread or CTA owns, and it consumes them along K one tile at a time,
// each tile a single contiguous copy (a TMA box, a cp.async run, a few cache lines).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace hybrid::kernels::ref {

// Tile extent in elements: `rows` along N (out features), `cols` along K (in features).
struct TileShape {
  int64_t rows = 0;
  int64_t cols = 0;

  bool operator==(const TileShape &) const = default;
};

// Geometry of one weight [rows, cols] stored tiled with `tile`. Counts are in elements, so one
// layout describes the bf16, fp8 and fp32 buffers of the same matrix alike.
struct TiledLayout {
  int64_t rows = 0; // N, out features
  int64_t cols = 0; // K, in features
  TileShape tile;

  int64_t numPanels() const { return ceilDiv(rows, tile.rows); }
  int64_t tilesPerPanel() const { return ceilDiv(cols, tile.cols); }
  int64_t paddedRows() const { return numPanels() * tile.rows; }
  int64_t paddedCols() const { return tilesPerPanel() * tile.cols; }
  int64_t tileElements() const { return tile.rows * tile.cols; }
  int64_t tiledBytes(int64_t elementBytes) const {
    return paddedRows() * paddedCols() * elementBytes;
  }

  // Element index of (row, col) in the tiled buffer. Defined on the padded extent
  // (0 <= row < paddedRows(), 0 <= col < paddedCols()), so padding positions have offsets too.
  int64_t offsetOf(int64_t row, int64_t col) const {
    const int64_t tileIndex = (row / tile.rows) * tilesPerPanel() + col / tile.cols;
    return tileIndex * tileElements() + (row % tile.rows) * tile.cols + col % tile.cols;
  }

private:
  // Written without a + b - 1 so that it cannot overflow for extents near INT64_MAX.
  static int64_t ceilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }
};

// Throws std::invalid_argument unless rows >= 0, cols >= 0, tile.rows >= 1, tile.cols >= 1,
// elementBytes is 1, 2 or 4, and tiledBytes(elementBytes) fits in int64_t.
void validateTiledLayout(const TiledLayout &layout, int64_t elementBytes);

// Re-tiles a row-major [rows, cols] matrix of elementBytes-byte elements into `tiled`, bytes copied
// as they are (bf16, fp8 and fp32 data are re-tiled without conversion); padding is written as zero
// bytes. Preconditions, checked (std::invalid_argument): validateTiledLayout passes,
// rowMajor.size() == rows·cols·elementBytes, tiled.size() == tiledBytes(elementBytes), and the two
// buffers do not overlap.
void packTiled(std::span<const std::byte> rowMajor, std::span<std::byte> tiled,
               const TiledLayout &layout, int64_t elementBytes);

// Inverse of packTiled: the padding is dropped. Same preconditions, sizes checked the same way.
void unpackTiled(std::span<const std::byte> tiled, std::span<std::byte> rowMajor,
                 const TiledLayout &layout, int64_t elementBytes);

// y[rows, N] = x[rows, K] · Wᵀ, reading W only through its tiled fp32 buffer (layout.rows = N,
// layout.cols = K), fp32 accumulation, parallel over N panels. For every output it sums over K in
// the same order as ref::linear (eight lanes by k mod 8 up to K rounded down to 8, a tail, the same
// final combination), so the result is bitwise equal to linear() on the row-major weight, for any
// tile shape, as long as the compiler does not contract a·b + c into FMAs (the project's default
// x86-64 flags; with -mfma or on AArch64 it may fuse the two loops differently, and they agree to
// ~1e-6 of Σ|x·w|). Preconditions (asserted, like linear): x.size() >= rows·K,
// tiledWeight.size() >= paddedRows·paddedCols, y.size() >= rows·N, y does not alias x.
void linearTiled(std::span<const float> x, std::span<const float> tiledWeight, std::span<float> y,
                 int64_t rows, const TiledLayout &layout);

// The tile the compiler uses for a weight [rows, cols] of elementBytes-byte elements:
//   * 128 bytes of K per tile row (bf16 64 columns, fp8 128, fp32 32): two 64-byte cache lines on
//     a CPU, and the widest TMA box row under 128-byte swizzle on Hopper, so a tile row is one
//     full-width load;
//   * 64 rows of N for bf16 and fp8 (an 8 KiB tile: one wgmma m64 block when W is operand A, as in
//     the swap-AB decode GEMM, and eight n8 steps when it is operand B); 32 rows for fp32 (a 4 KiB
//     tile; fp32 weights only run on the CPU, where 32-output panels leave enough panels to spread
//     even a narrow layer over the thread pool).
// A smaller matrix gets a tile shrunk to hold it, rows to a multiple of 8 and columns to a multiple
// of 32 bytes (whole 16-byte TMA granules, whole 8-float CPU vectors), so small weights are not
// padded many-fold. Throws std::invalid_argument for an elementBytes other than 1, 2 or 4, or
// negative extents.
TileShape defaultTileFor(int64_t rows, int64_t cols, int64_t elementBytes);

} // namespace hybrid::kernels::ref
