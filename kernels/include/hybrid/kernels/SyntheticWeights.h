// Synthetic weights: seeded pseudo-random values generated where a weight lives (host memory for
// the cpu device, device memory for cuda) instead of read from a checkpoint, so a full-size model
// runs from its config.json alone (hybrid-compile --synthetic-weights, docs/runtime.md).
//
// Every stored element is a function of (key, logical element index) only -- splitmix64 in
// counter form -- so any element is computed on its own, by any thread, in any order. The value
// functions below use integer arithmetic and one correctly rounded fmaf for the Normal and Constant
// kinds, so the host (kernels/ref/synthetic_weights.cc) and the CUDA kernel
// (kernels/cuda/synth/) produce the same bits; the two small-tensor kinds (LogUniform,
// DecayTimeBias) go through double log/exp and agree to the last bit of a double before their
// rounding to fp32. Storage rounding (bf16, E4M3) is ref::floatToBf16 / ref::floatToE4M3 and their
// bit-exact device twins.
//
// CUDA-free: compiled by the host compiler as plain C++, and by nvcc for both sides.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define HYBRID_HOST_DEVICE __host__ __device__
#else
#define HYBRID_HOST_DEVICE
#endif

namespace hybrid::kernels {

// How an element's value is drawn (a and b are the fill's two parameters).
enum class SyntheticKind : uint8_t {
  // fmaf(a, X, b) with X the centred sum of four uniform 16-bit draws (Irwin-Hall, integer in
  // [-131070, 131070], standard deviation 65536 / sqrt(3)): about normal, bounded at 3.46 sigma.
  // a = sigma * sqrt(3) / 65536 gives N(b, sigma^2). Also E4M3 codes of a block-scaled weight.
  Normal = 0,
  Constant = 1,      // b (FP8 block scales)
  LogUniform = 2,    // log(U(a, b)), 0 < a < b (KDA A_log: a = 1, b = 16, fla's init)
  DecayTimeBias = 3, // softplus^-1(dt), dt log-uniform in [a, b], at least 1e-4 (KDA dt_bias)
};
inline constexpr uint8_t kSyntheticKindCount = 4;

// The element type the values are stored in.
enum class SyntheticStorage : uint8_t { F32 = 0, BF16 = 1, F8E4M3 = 2 };

// One weight to generate. The logical tensor is a row-major [rows, cols] matrix (a vector or any
// other rank flattened to rows = 1); stored either row-major or tiled (kernels/ref/TiledLayout.h)
// with zero padding to whole tiles (tileRows, tileCols >= 1; both 0 means row-major).
struct SyntheticFill {
  SyntheticKind kind = SyntheticKind::Normal;
  SyntheticStorage storage = SyntheticStorage::F32;
  uint64_t key = 0; // the tensor's stream
  float a = 0.0f;
  float b = 0.0f;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t tileRows = 0;
  int64_t tileCols = 0;
  int64_t storedElements = 0; // rows * cols, or the padded extent when tiled
  // Where the logical matrix lies in the seeded tensor: element (r, c) is element
  // r * sourceRowStride + sourceOffset + c of the tensor's stream, so one rank's slice of a sharded
  // plan (rows, columns or a range along another axis) draws the very values the unsharded
  // tensor holds there. sourceRowStride 0 means cols (the whole tensor, or a slice of its rows).
  int64_t sourceRowStride = 0;
  int64_t sourceOffset = 0;
};

// splitmix64 (Steele, Lea, Flood 2014) in counter form: output n of the stream keyed `key`.
HYBRID_HOST_DEVICE inline uint64_t splitMix64At(uint64_t key, uint64_t position) {
  uint64_t z = key + (position + 1) * 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The index in the seeded tensor's stream of stored element `stored`, or -1 for tile padding,
// computed in the integer type `Index`: int64_t always holds it; uint32_t where
// syntheticIndexFits32, which the device takes because it emulates 64-bit division in about a
// hundred instructions (a tiled weight divides four times per element).
template <typename Index>
HYBRID_HOST_DEVICE inline int64_t syntheticLogicalIndexIn(const SyntheticFill &fill, Index stored) {
  const Index cols = Index(fill.cols), offset = Index(fill.sourceOffset);
  const Index stride = fill.sourceRowStride == 0 ? cols : Index(fill.sourceRowStride);
  if (fill.tileRows == 0) {
    if (stride == cols) // rows consecutive in the source: no division
      return int64_t(stored + offset);
    return int64_t((stored / cols) * stride + offset + stored % cols);
  }
  const Index tileRows = Index(fill.tileRows), tileCols = Index(fill.tileCols);
  const Index tileElements = tileRows * tileCols;
  const Index tilesPerPanel = (cols + tileCols - 1) / tileCols;
  const Index tile = stored / tileElements, within = stored % tileElements;
  const Index row = (tile / tilesPerPanel) * tileRows + within / tileCols;
  const Index col = (tile % tilesPerPanel) * tileCols + within % tileCols;
  return row < Index(fill.rows) && col < cols ? int64_t(row * stride + offset + col) : -1;
}

HYBRID_HOST_DEVICE inline int64_t syntheticLogicalIndex(const SyntheticFill &fill, int64_t stored) {
  return syntheticLogicalIndexIn<int64_t>(fill, stored);
}

// Whether every quantity of syntheticLogicalIndexIn<uint32_t> stays below 2^32 for `fill`: the
// stored extent and the largest source index (padded rows included, before the padding test).
HYBRID_HOST_DEVICE inline bool syntheticIndexFits32(const SyntheticFill &fill) {
  const int64_t stride = fill.sourceRowStride == 0 ? fill.cols : fill.sourceRowStride;
  const int64_t paddedRows =
      fill.tileRows == 0 ? fill.rows : (fill.rows + fill.tileRows - 1) / fill.tileRows * fill.tileRows;
  const int64_t paddedCols =
      fill.tileCols == 0 ? fill.cols : (fill.cols + fill.tileCols - 1) / fill.tileCols * fill.tileCols;
  constexpr int64_t kLimit = int64_t(1) << 32;
  return fill.storedElements < kLimit && fill.rows >= 0 && fill.cols >= 0 && stride >= 0 &&
         fill.sourceOffset >= 0 && paddedRows * (stride > paddedCols ? stride : paddedCols) +
                                           fill.sourceOffset + paddedCols < kLimit;
}

// The fp32 value of logical element `element` (before rounding to the storage type).
HYBRID_HOST_DEVICE inline float syntheticValue(const SyntheticFill &fill, int64_t element) {
  const uint64_t bits = splitMix64At(fill.key, static_cast<uint64_t>(element));
  switch (fill.kind) {
  case SyntheticKind::Normal: {
    const int32_t sum = static_cast<int32_t>((bits & 0xffff) + ((bits >> 16) & 0xffff) +
                                             ((bits >> 32) & 0xffff) + (bits >> 48));
    return fmaf(fill.a, static_cast<float>(sum - 131070), fill.b);
  }
  case SyntheticKind::Constant:
    return fill.b;
  case SyntheticKind::LogUniform:
  case SyntheticKind::DecayTimeBias: {
    const double u = (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; // (0, 1)
    const double lo = fill.a, hi = fill.b;
    if (fill.kind == SyntheticKind::LogUniform)
      return static_cast<float>(log(lo + (hi - lo) * u));
    double dt = exp(log(lo) + (log(hi) - log(lo)) * u);
    dt = dt > 1e-4 ? dt : 1e-4;
    return static_cast<float>(dt + log(-expm1(-dt)));
  }
  }
  return 0.0f;
}

// Bytes per stored element.
HYBRID_HOST_DEVICE inline int64_t syntheticStorageBytes(SyntheticStorage storage) {
  return storage == SyntheticStorage::F32 ? 4 : storage == SyntheticStorage::BF16 ? 2 : 1;
}

namespace ref {
// Writes every stored element of `fill` into `out` (storedElements * element bytes), on the
// thread pool of ref::parallelFor. The caller has checked the fill (WeightArchive::open does).
void fillSynthetic(const SyntheticFill &fill, void *out);
} // namespace ref

} // namespace hybrid::kernels
