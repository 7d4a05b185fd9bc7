// Sparse MLA decode (see SparseMla.h). One block per (row, 16 G heads); warp w serves head group
// w / (warps / G) and a slice of the tile's positions (scores) and of the latent dimensions (P V).
// The block first resolves every selected position of its split to a cache row (index -> table
// -> page, all at once). Per tile of 64 positions the block computes from a bf16 copy of the rows
// in shared memory (exact dequantization by bit moves): scores on bf16 MMAs over the 576-wide
// keys, the online softmax with the row maxima exchanged between a head group's warps, then P V
// with V the latent part of the same rows read transposed. With 16 heads, producer warps gather
// and convert the next tiles into a second bf16 tile while the MMA warps compute this one; with
// 32 heads the raw FP8 rows of the next tile are in flight (cp.async into a staging area) and
// converted between tiles. 64 heads per block (G = 4) convert each row once for 64 heads
// (FlashMLA's grouping) on warpgroup MMAs. Few rows split the positions over several blocks
// (flash-decoding), merged by a second kernel.
#include "hybrid/kernels/cuda/SparseMla.h"
#include "../common/dependent_launch.cuh"
#include "../common/device_setup.cuh"
#include "../common/dependent_launch.cuh"
#include "../common/warp_mma.cuh"
#include "../common/warpgroup_mma.cuh"
#include "fp8_device.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kScaleTile = 128; // latent elements per fp32 scale (FlashMLA)
constexpr int kMaxPositionsPerBlock = kSparseMlaMaxPositionsPerBlock; // a split's resolved rows
                                                                      // live in shared memory
constexpr int kCombineThreads = 128;
static_assert(kCombineThreads >= kSparseMlaMaxLongSplits, "the combine reads a split's header a thread");
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// G head groups of 16 per block; 8 MMA warps, tiles of 64 positions, one block per SM (the
// queries and the tiles fill shared memory).
// 16 heads (G = 1) specialize warps: 8 producer warps load the rows of tile t + 1 (and t + 2)
// into registers and convert them into one of two bf16 tiles while the 8 MMA warps compute
// tile t, handing the tiles over by named barriers. With 16 heads the MMAs per row are few, so
// the gather and the conversion must not run in series with them (they did, 4.5 us per tile).
// 32 and 64 heads gather by cp.async into a staging area and convert between tiles (their
// accumulators leave no registers for producers at 512 threads).
template <int L, int R, int G> struct Shape {
  static constexpr int kLatent = L;
  static constexpr bool kSpecialized = G == 1;
  static constexpr int kWarps = 8;             // MMA (consumer) warps
  static constexpr int kThreads = 32 * kWarps; // MMA threads
  static constexpr int kProducerWarps = kSpecialized ? kWarps : 0; // four threads a tile row
  static constexpr int kBlockThreads = kThreads + 32 * kProducerWarps;
  static constexpr int kBlocksPerSm = 1;
  // Raw tiles in flight while one computes (cp.async; none with producers): two where shared
  // memory allows.
  static constexpr int kStages = kSpecialized ? 0 : G == 4 ? 1 : 2;
  static constexpr int kRing = kStages > 0 ? kStages : 1; // staging slots (modulo)
  static constexpr int kBuffers = kSpecialized ? 2 : 1; // bf16 tiles
  static constexpr int kTileKeys = 8 * kWarps; // positions per tile
  static constexpr int kMaxTiles = kMaxPositionsPerBlock / kTileKeys;
  static constexpr int kPStride = kTileKeys + 8; // bf16 per softmax-weight row (conflict-free)
  static constexpr int kHeads = 16 * G;
  static constexpr int kSlices = kWarps / G;               // warps per head group
  static constexpr int kKeysPerWarp = kTileKeys / kSlices; // scores
  static constexpr int kScoreTiles = kKeysPerWarp / 8; // softmax
  // The score MMAs: a warp multiplies a 16 x 32 block; a group with more warps than 32-position
  // blocks splits the 576-wide keys into kParts parts, whose sums meet in shared memory.
  static constexpr int kKeyBlocks = kTileKeys / 32;
  static constexpr int kParts = kSlices / kKeyBlocks;
  static_assert(kKeyBlocks * kParts == kSlices, "key blocks times parts");
  static constexpr size_t kScratchBytes = kParts > 1 ? size_t(kWarps) * 16 * 32 * 4 : 0;
  static constexpr int kDimsPerWarp = L / kSlices; // P V
  static constexpr int kValueTiles = kDimsPerWarp / 8;
  static_assert(kDimsPerWarp % 8 == 0 && (kValueTiles == 1 || kValueTiles % 2 == 0),
                "one value tile or pairs");
  static constexpr int kWide = L + R;
  static constexpr int kStride = kWide + 8; // bf16 per shared row
  static constexpr int kScaleTiles = (L + kScaleTile - 1) / kScaleTile;
  static constexpr int kRopeOffset = L + 4 * kScaleTiles;
  static constexpr int kRowBytes = kRopeOffset + 2 * R;
  static constexpr int kCodePieces = L / 16; // 16 codes each
  static constexpr int kRopePieces = R / 8;  // 8 bf16 each
  // 16-byte copies need 16-byte aligned rows and rope parts (DeepSeek-V3.2's 656-byte rows are;
  // the tiny model's 132-byte rows are not: 4-byte copies there).
  static constexpr bool kVector = kRowBytes % 16 == 0 && kRopeOffset % 16 == 0;
  static_assert(kRowBytes % 4 == 0 && kRopeOffset % 4 == 0, "4-byte aligned rows");
  static constexpr size_t kTileBytes = size_t(kTileKeys) * kStride * 2;
  static constexpr size_t kStageOffset = size_t(kHeads) * kStride * 2 + kBuffers * kTileBytes;
  static constexpr size_t kStageBytes = size_t(kTileKeys) * kRowBytes;
  static constexpr size_t kWeightsOffset = kStageOffset + kStages * kStageBytes;
  static constexpr size_t kWeightsBytes = size_t(kHeads) * kPStride * 2;
  // The softmax weights share their space with the score parts (read before the weights are
  // written, a barrier apart), except with producers: there the next tile's parts may be
  // written while a slower warp still reads this tile's weights (no barrier between them).
  static constexpr size_t kScratchOffset = kSpecialized ? kWeightsOffset + kWeightsBytes
                                                        : kWeightsOffset;
  static constexpr size_t kPartsOffset =
      kSpecialized ? kScratchOffset + kScratchBytes
                   : kWeightsOffset + std::max(kWeightsBytes, kScratchBytes);
  static constexpr size_t kRowsOffset = kPartsOffset + 2 * size_t(kSlices) * kHeads * 4;
  static size_t sharedBytes(int tilesPerSplit) {
    return kRowsOffset + size_t(tilesPerSplit) * kTileKeys * 4;
  }
};

template <bool kVector> __device__ inline uint4 load16(const unsigned char *p) {
  if constexpr (kVector)
    return *reinterpret_cast<const uint4 *>(p);
  const auto *words = reinterpret_cast<const uint32_t *>(p);
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Where a block's split of a row's positions ends: splitEnd, or for causal rows just past the
// row's own position (a split past it has nothing to do).
__device__ inline int rowSplitEnd(const SparseMlaDecodeParams &p, int row, int splitEnd) {
  return p.indices ? splitEnd : min(splitEnd, p.positions[row] + 1);
}

// A block's split [begin, end) of a row's positions. Causal rows spread their own positions over
// every split: the grid is sized for a sequence's capacity (a decode graph replays at every
// length), and splits of the capacity's size left a short row's positions to its first few
// blocks (1K positions at an 8K capacity: 4 blocks of 4 tiles instead of 16 of 1, 30 instead
// of 11 us a Kimi-Linear layer on the H200). tilesPerSplit bounds a split (shared memory).
__device__ inline void splitRange(const SparseMlaDecodeParams &p, int row, int split, int splits,
                                  int tilesPerSplit, int tileKeys, int &begin, int &end) {
  int perSplit = tilesPerSplit;
  if (!p.indices) {
    const int rowTiles = (min(p.topK, p.positions[row] + 1) + tileKeys - 1) / tileKeys;
    perSplit = min(tilesPerSplit, max(1, (rowTiles + splits - 1) / splits));
  }
  begin = split * perSplit * tileKeys;
  end = rowSplitEnd(p, row, min(p.topK, begin + perSplit * tileKeys));
}

// A split's positions resolved to cache rows (page * pageTokens + offset; -1: none), `count`
// entries (the split's tiles; past splitEnd -1). Causal rows: the positions themselves.
__device__ inline void resolveCacheRows(const SparseMlaDecodeParams &p, int row, int splitBegin,
                                        int splitEnd, int count, int32_t *cacheRows, int tid,
                                        int threads) {
  const int32_t *table = p.blockTables + size_t(p.sequences[row]) * p.maxPages;
  const int32_t *indices = p.indices ? p.indices + size_t(row) * p.topK : nullptr;
  for (int i = tid; i < count; i += threads) {
    const int at = splitBegin + i;
    const int position = at < splitEnd ? (indices ? indices[at] : at) : -1;
    cacheRows[i] =
        position >= 0 ? table[position / p.pageTokens] * p.pageTokens + position % p.pageTokens : -1;
  }
}

// The same 16 bytes from global memory, read-only (the cache does not change during a launch).
// Kept in L1: rows are not 32-byte aligned, so neighbouring pieces share sectors (the build with
// ld.global.nc.L1::no_allocate and an L2 prefetch of tile t + 2 ran 63.5 -> 65.7 us in ncu at
// batch 64; the prefetch alone changed nothing).
template <bool kVector> __device__ inline uint4 loadGlobal16(const unsigned char *p) {
  if constexpr (kVector)
    return __ldg(reinterpret_cast<const uint4 *>(p));
  const auto *words = reinterpret_cast<const unsigned int *>(p);
  return make_uint4(__ldg(words), __ldg(words + 1), __ldg(words + 2), __ldg(words + 3));
}

// 16 E4M3 codes times their tile scale as 16 bf16 (exact): by bit moves for a power-of-two
// scale, else through f16 and fp32.
__device__ inline void convertCodes16(const uint4 raw, float scale, uint4 (&packed)[2]) {
  if (quadConversionExact(scale)) {
    const __nv_bfloat162 factor = __float2bfloat162_rn(scale * 0x1p120f);
    e4m3QuadToBf16(raw.x, factor, packed[0].x, packed[0].y);
    e4m3QuadToBf16(raw.y, factor, packed[0].z, packed[0].w);
    e4m3QuadToBf16(raw.z, factor, packed[1].x, packed[1].y);
    e4m3QuadToBf16(raw.w, factor, packed[1].z, packed[1].w);
  } else {
    packed[0] = make_uint4(e4m3PairToBf16(uint16_t(raw.x), scale),
                           e4m3PairToBf16(uint16_t(raw.x >> 16), scale),
                           e4m3PairToBf16(uint16_t(raw.y), scale),
                           e4m3PairToBf16(uint16_t(raw.y >> 16), scale));
    packed[1] = make_uint4(e4m3PairToBf16(uint16_t(raw.z), scale),
                           e4m3PairToBf16(uint16_t(raw.z >> 16), scale),
                           e4m3PairToBf16(uint16_t(raw.w), scale),
                           e4m3PairToBf16(uint16_t(raw.w >> 16), scale));
  }
}
// ... from shared memory (`codes`, `kVector`: 16-byte aligned).
template <bool kVector>
__device__ inline void convertCodes16(const unsigned char *codes, float scale, uint4 (&packed)[2]) {
  convertCodes16(load16<kVector>(codes), scale, packed);
}

// Stages one cached row (kRowBytes bytes; `cacheRow` < 0: none) into `to`: this thread's pieces
// `ownPiece`, ownPiece + 4, ... (four threads a row), 16-byte copies where rows are 16-byte
// aligned, else 4-byte ones; then commits the thread's copy group.
template <int kRowBytes, bool kVector>
__device__ inline void stageRow(unsigned char *to, const unsigned char *pool, int32_t cacheRow,
                                int ownPiece) {
  constexpr int kCopyBytes = kVector ? 16 : 4;
  if (cacheRow >= 0) {
    const unsigned char *from = pool + int64_t(cacheRow) * kRowBytes;
#pragma unroll
    for (int piece = ownPiece; piece < kRowBytes / kCopyBytes; piece += 4) {
      if constexpr (kVector)
        mma::copyAsync16(to + piece * 16, from + piece * 16);
      else
        mma::copyAsync4(to + piece * 4, from + piece * 4);
    }
  }
  mma::commitAsyncCopies();
}

// Reductions over the four lanes of a quad (the lanes sharing an accumulator row) of both rows
// a thread holds.
__device__ inline void quadMax(float (&v)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    v[h] = fmaxf(v[h], __shfl_xor_sync(0xffffffffu, v[h], 1));
    v[h] = fmaxf(v[h], __shfl_xor_sync(0xffffffffu, v[h], 2));
  }
}
__device__ inline void quadSum(float (&v)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    v[h] += __shfl_xor_sync(0xffffffffu, v[h], 1);
    v[h] += __shfl_xor_sync(0xffffffffu, v[h], 2);
  }
}

// Named barriers of a block with producer warps.
enum SparseMlaBarrier : int {
  kMmaWarps = 1, // the MMA warps among themselves
  kTileFull = 2, // + buffer: the bf16 tile is written (producers arrive, MMA warps wait)
  kTileFree = 4, // + buffer: the bf16 tile is read (MMA warps arrive, producers wait)
};

// The producer warps of a 16-head block: thread `producer` serves row producer / 4 of every tile
// and its pieces producer % 4, + 4, ... (as the cp.async staging does). Per tile: the raw pieces
// into registers (16-byte read-only loads; the next tile's are issued before this one converts,
// so two tiles are in flight), then, once the MMA warps have freed the tile's bf16 buffer (tile
// t - 2's), converted (exact) and written, a dead position as zeros, and handed over.
template <int L, int R>
__device__ inline void produceTiles(const SparseMlaDecodeParams &p, const int32_t *cacheRows,
                                    __nv_bfloat16 *kvTiles, int tiles, int producer) {
  using S = Shape<L, R, 1>;
  const auto *pool = static_cast<const unsigned char *>(p.latentPages);
  const int ownRow = producer / 4, ownPiece = producer % 4;
  static_assert(S::kCodePieces % 4 == 0 && S::kRopePieces % 4 == 0, "pieces in fours");
  struct RawRow {
    uint4 codes[S::kCodePieces / 4];
    float scales[S::kScaleTiles];
    uint4 rope[S::kRopePieces / 4];
    bool live;
  };
  auto load = [&](int t, RawRow &raw) {
    const int32_t cacheRow = cacheRows[t * S::kTileKeys + ownRow];
    raw.live = cacheRow >= 0;
    if (!raw.live)
      return;
    const unsigned char *from = pool + int64_t(cacheRow) * S::kRowBytes;
#pragma unroll
    for (int i = 0; i < S::kCodePieces / 4; ++i)
      raw.codes[i] = loadGlobal16<S::kVector>(from + (ownPiece + 4 * i) * 16);
    if constexpr (S::kVector && S::kScaleTiles == 4) {
      const uint4 scales = loadGlobal16<true>(from + L);
      raw.scales[0] = __uint_as_float(scales.x);
      raw.scales[1] = __uint_as_float(scales.y);
      raw.scales[2] = __uint_as_float(scales.z);
      raw.scales[3] = __uint_as_float(scales.w);
    } else {
#pragma unroll
      for (int i = 0; i < S::kScaleTiles; ++i)
        raw.scales[i] = __ldg(reinterpret_cast<const float *>(from + L) + i);
    }
#pragma unroll
    for (int i = 0; i < S::kRopePieces / 4; ++i)
      raw.rope[i] = loadGlobal16<S::kVector>(from + S::kRopeOffset + (ownPiece + 4 * i) * 16);
  };
  auto handOver = [&](const RawRow &raw, int t) {
    const int buffer = t % 2;
    if (t >= 2)
      mma::namedBarrierSync(kTileFree + buffer, S::kBlockThreads);
    __nv_bfloat16 *to = kvTiles + (size_t(buffer) * S::kTileKeys + ownRow) * S::kStride;
#pragma unroll
    for (int i = 0; i < S::kCodePieces / 4; ++i) {
      const int piece = ownPiece + 4 * i;
      uint4 packed[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
      // Pieces 4i..4i+3 lie in one scale tile: a constant register index (not local memory).
      static_assert(kScaleTile % (4 * 16) == 0, "a thread's piece group in one scale tile");
      if (raw.live)
        convertCodes16(raw.codes[i], raw.scales[4 * i * 16 / kScaleTile], packed);
      auto *target = reinterpret_cast<uint4 *>(to + piece * 16);
      target[0] = packed[0];
      target[1] = packed[1];
    }
#pragma unroll
    for (int i = 0; i < S::kRopePieces / 4; ++i)
      *reinterpret_cast<uint4 *>(to + L + (ownPiece + 4 * i) * 8) =
          raw.live ? raw.rope[i] : make_uint4(0, 0, 0, 0);
    mma::namedBarrierArrive(kTileFull + buffer, S::kBlockThreads);
  };
  // Two register sets taken in turn (a copy between them would wait for the loads in flight).
  RawRow even, odd;
  if (tiles > 0)
    load(0, even);
  for (int t = 0; t < tiles; t += 2) {
    if (t + 1 < tiles)
      load(t + 1, odd);
    handOver(even, t);
    if (t + 1 < tiles) {
      if (t + 2 < tiles)
        load(t + 2, even);
      handOver(odd, t + 1);
    }
  }
}

template <int L, int R, int G>
__global__ void __launch_bounds__(Shape<L, R, G>::kBlockThreads, Shape<L, R, G>::kBlocksPerSm)
    sparseMlaDecodeKernel(SparseMlaDecodeParams p, int tilesPerSplit, float *partials) {
  using S = Shape<L, R, G>;
  constexpr int kStride = S::kStride, kHeads = S::kHeads, kSlices = S::kSlices;
  constexpr int kThreads = S::kThreads, kTileKeys = S::kTileKeys, kPStride = S::kPStride;
  extern __shared__ __align__(16) unsigned char smem[];
  auto *qs = reinterpret_cast<__nv_bfloat16 *>(smem);            // [kHeads, kStride]
  __nv_bfloat16 *kvTiles = qs + kHeads * kStride; // [kBuffers][tile positions, kStride]
  unsigned char *stages = smem + S::kStageOffset; // [kStages][tile, kRowBytes] raw rows
  auto *weights = reinterpret_cast<__nv_bfloat16 *>(smem + S::kWeightsOffset); // [kHeads, kPStride]
  auto *scoreParts = reinterpret_cast<float *>(smem + S::kScratchOffset); // [warps][n][e][lane]
  auto *maxParts = reinterpret_cast<float *>(smem + S::kPartsOffset); // [kSlices, kHeads]
  float *sumParts = maxParts + kSlices * kHeads;                       // [kSlices, kHeads]
  auto *cacheRows = reinterpret_cast<int32_t *>(smem + S::kRowsOffset); // [split positions]

  const int row = blockIdx.x, headBase = int(blockIdx.y) * kHeads, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int group = warp / kSlices, slice = warp % kSlices;
  const int splits = int(gridDim.z), split = int(blockIdx.z);
  int splitBegin, splitEnd;
  splitRange(p, row, split, splits, tilesPerSplit, kTileKeys, splitBegin, splitEnd);
  const int tiles = max(0, (splitEnd - splitBegin + kTileKeys - 1) / kTileKeys);

  // Launched as a programmatic dependent. A causal row's cache rows come from the step's
  // positions and block tables, uploaded before its first kernel, so they resolve before the
  // wait, under the kernel before; top-k indices are the indexer's, resolved after it.
  if (!p.indices)
    resolveCacheRows(p, row, splitBegin, splitEnd, tiles * kTileKeys, cacheRows, tid,
                     S::kBlockThreads);
  waitForEarlierKernels(); // the queries (and the step's own latent row)
  letDependentsLaunch();
  if (p.indices)
    resolveCacheRows(p, row, splitBegin, splitEnd, tiles * kTileKeys, cacheRows, tid,
                     S::kBlockThreads);
  // The MMA warps' barrier: their own where producer warps run beside them.
  auto mmaSync = [] {
    if constexpr (S::kSpecialized)
      mma::namedBarrierSync(kMmaWarps, kThreads);
    else
      __syncthreads();
  };
  const auto *pool = static_cast<const unsigned char *>(p.latentPages);
  // Staging and conversion: thread tid serves row tid / 4 of a tile and every fourth piece of it
  // from tid % 4 (no divisions, one row address per tile).
  static_assert(kThreads == 4 * kTileKeys, "four threads per row");
  const int ownRow = tid / 4, ownPiece = tid % 4;
  // The raw row of tile t into the staging area (a dead position copies nothing).
  auto issueTile = [&](int t) {
    if constexpr (S::kStages > 0)
      stageRow<S::kRowBytes, S::kVector>(stages + t % S::kRing * S::kStageBytes +
                                             ownRow * S::kRowBytes,
                                         pool, cacheRows[t * kTileKeys + ownRow], ownPiece);
  };
  __syncthreads(); // the cache rows
  if constexpr (S::kSpecialized) {
    if (warp >= S::kWarps) {
      produceTiles<L, R>(p, cacheRows, kvTiles, tiles, tid - kThreads);
      return;
    }
  } else {
    // Without producers the first tiles' copies go out before the queries load, so that both
    // are in flight together (they were a round trip apart: a block's fixed cost at batch 1).
    if (tiles > 0) {
      issueTile(0);
      if constexpr (S::kStages == 2) {
        if (tiles > 1)
          issueTile(1);
        else
          mma::commitAsyncCopies(); // an empty group: the waits below count kStages - 1
      }
    }
  }
  // The heads' absorbed queries in bf16 (heads past p.heads are zero), a fixed count of loads per
  // thread unrolled so that they are in flight together (a block's fixed cost at small batches).
  static_assert(S::kWide % 4 == 0, "queries in fours");
  constexpr int kQueryVectors = kHeads * S::kWide / 4;
  if (tiles > 0)
#pragma unroll
    for (int k = 0; k < (kQueryVectors + kThreads - 1) / kThreads; ++k) {
      const int i = tid + k * kThreads;
      if (kQueryVectors % kThreads != 0 && i >= kQueryVectors)
        break;
      const int h = i / (S::kWide / 4), d = 4 * (i % (S::kWide / 4));
      const float4 v = headBase + h < p.heads
                           ? *reinterpret_cast<const float4 *>(
                                 p.q + (size_t(row) * p.heads + headBase + h) * S::kWide + d)
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      *reinterpret_cast<uint2 *>(qs + h * kStride + d) =
          make_uint2(mma::packBf16(v.x, v.y), mma::packBf16(v.z, v.w));
    }
  mmaSync(); // the queries

  // The staged row of tile t as bf16 (exact); a dead position as zeros (its weights are zero,
  // and 0 * garbage could be NaN).
  static_assert(S::kCodePieces % 4 == 0 && S::kRopePieces % 4 == 0, "pieces in fours");
  auto convertTile = [&](int t) {
    const bool live = cacheRows[t * kTileKeys + ownRow] >= 0;
    const unsigned char *from = stages + t % S::kRing * S::kStageBytes + ownRow * S::kRowBytes;
    __nv_bfloat16 *to = kvTiles + ownRow * kStride;
#pragma unroll
    for (int piece = ownPiece; piece < S::kCodePieces; piece += 4) {
      uint4 packed[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
      if (live)
        convertCodes16<S::kVector>(
            from + piece * 16, reinterpret_cast<const float *>(from + L)[piece * 16 / kScaleTile],
            packed);
      auto *target = reinterpret_cast<uint4 *>(to + piece * 16);
      target[0] = packed[0];
      target[1] = packed[1];
    }
#pragma unroll
    for (int piece = ownPiece; piece < S::kRopePieces; piece += 4)
      *reinterpret_cast<uint4 *>(to + L + piece * 8) =
          live ? load16<S::kVector>(from + S::kRopeOffset + piece * 16) : make_uint4(0, 0, 0, 0);
  };

  // Per thread: rows r0 = lane / 4 and r0 + 8 of its head group's 16.
  const int r0 = lane / 4, headRow = group * 16;
  // The scores' MMAs: warp `slice` multiplies key block keyBlock of a tile over part `part` of
  // the 576-wide keys. With 16 and 32 heads the part's query fragments stay in registers for
  // every tile instead of an ldmatrix each per tile: with 16 heads (producer warps beside, 128
  // registers) shared memory bounds the form and they were 37 KB of its ~300 KB a tile; with 32
  // heads (a quarter of the dims a warp, 241 registers) 74 KB a tile.
  constexpr int kSteps = S::kWide / 16, kPartSteps = (kSteps + S::kParts - 1) / S::kParts;
  constexpr bool kQueriesHeld = (S::kSpecialized || G == 2) && kSteps % S::kParts == 0;
  const int keyBlock = slice % S::kKeyBlocks, part = slice / S::kKeyBlocks;
  uint32_t heldQueries[kQueriesHeld ? kPartSteps : 1][4];
  if constexpr (kQueriesHeld)
#pragma unroll
    for (int step = 0; step < kPartSteps; ++step)
      mma::loadA(heldQueries[step], qs + headRow * kStride + (part * kPartSteps + step) * 16,
                 kStride);
  float runningMax[2] = {-INFINITY, -INFINITY}, runningSum[2] = {0.0f, 0.0f};
  float o[S::kValueTiles][4] = {};
  const float scoreScale = p.softmaxScale * kLog2e; // exp2 domain

  if constexpr (!S::kSpecialized) {
    if (tiles > 0) {
      mma::waitAsyncCopies<S::kStages - 1>();
      __syncthreads();
      convertTile(0);
      __syncthreads();
    }
  }
  for (int t = 0; t < tiles; ++t) {
    const __nv_bfloat16 *kv = kvTiles + (S::kSpecialized ? t % 2 : 0) * kTileKeys * kStride;
    if constexpr (S::kSpecialized) {
      mma::namedBarrierSync(kTileFull + t % 2, S::kBlockThreads); // the producers wrote it
    } else {
      // The tile kStages ahead into the staging area tile t left (converted before the last
      // barrier); in flight while this tile computes.
      if (t + S::kStages < tiles)
        issueTile(t + S::kStages);
      else
        mma::commitAsyncCopies();
    }
    const int32_t *tileRows = cacheRows + t * kTileKeys;

    // Scores: this warp's 16 x 32 block (its head group, key block) over its part of the
    // 576-wide keys; the fragments of k step s + 1 load while step s multiplies.
    float acc[4][4] = {};
    if constexpr (kQueriesHeld) {
      const __nv_bfloat16 *keys = kv + keyBlock * 32 * kStride + part * kPartSteps * 16;
      uint32_t b[2][4][2];
      auto loadStep = [&](int step, int buffer) {
        mma::loadBPair(b[buffer][0], b[buffer][1], keys + 16 * step, kStride);
        mma::loadBPair(b[buffer][2], b[buffer][3], keys + 16 * kStride + 16 * step, kStride);
      };
      loadStep(0, 0);
#pragma unroll
      for (int step = 0; step < kPartSteps; ++step) {
        if (step + 1 < kPartSteps)
          loadStep(step + 1, (step + 1) % 2);
#pragma unroll
        for (int n = 0; n < 4; ++n)
          mma::mma16816(acc[n], heldQueries[step], b[step % 2][n]);
      }
    } else {
      const __nv_bfloat16 *keys = kv + keyBlock * 32 * kStride + part * kPartSteps * 16;
      const __nv_bfloat16 *queries = qs + headRow * kStride + part * kPartSteps * 16;
      const int steps = min(kPartSteps, kSteps - part * kPartSteps); // the last part may be short
      uint32_t a[2][4], b[2][4][2];
      auto loadStep = [&](int step, int buffer) {
        mma::loadA(a[buffer], queries + 16 * step, kStride);
        mma::loadBPair(b[buffer][0], b[buffer][1], keys + 16 * step, kStride);
        mma::loadBPair(b[buffer][2], b[buffer][3], keys + 16 * kStride + 16 * step, kStride);
      };
      if (steps > 0)
        loadStep(0, 0);
#pragma unroll
      for (int step = 0; step < kPartSteps; ++step) {
        if (kSteps % S::kParts == 0 || step < steps) {
          if (step + 1 < steps)
            loadStep(step + 1, (step + 1) % 2);
#pragma unroll
          for (int n = 0; n < 4; ++n)
            mma::mma16816(acc[n], a[step % 2], b[step % 2][n]);
        }
      }
    }
    // This warp's softmax positions: kKeysPerWarp of them, summed over the parts.
    float blockScores[S::kScoreTiles][4];
    if constexpr (S::kParts == 1) {
      static_assert(S::kScoreTiles == 4, "one part: the warp's own block");
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          blockScores[n][e] = acc[n][e];
    } else {
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          scoreParts[((warp * 4 + n) * 4 + e) * 32 + lane] = acc[n][e];
      mmaSync(); // (0) the parts
      const int keyBlock = slice * S::kKeysPerWarp / 32;
      const int firstTile = slice * S::kKeysPerWarp % 32 / 8;
#pragma unroll
      for (int n = 0; n < S::kScoreTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float sum = 0.0f;
#pragma unroll
          for (int part = 0; part < S::kParts; ++part) {
            const int from = group * kSlices + part * S::kKeyBlocks + keyBlock;
            sum += scoreParts[((from * 4 + firstTile + n) * 4 + e) * 32 + lane];
          }
          blockScores[n][e] = sum;
        }
    }
    // The tile's live positions as a bit mask (two ballots instead of a shared load per score).
    uint64_t liveMask = __ballot_sync(0xffffffffu, tileRows[lane] >= 0);
    if constexpr (kTileKeys == 64)
      liveMask |= uint64_t(__ballot_sync(0xffffffffu, tileRows[32 + lane] >= 0)) << 32;
    float scores[S::kScoreTiles][4];
    float tileMax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < S::kScoreTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = slice * S::kKeysPerWarp + n * 8 + mma::accColumn(e);
        scores[n][e] = (liveMask >> key) & 1 ? blockScores[n][e] * scoreScale : -INFINITY;
        tileMax[e / 2] = fmaxf(tileMax[e / 2], scores[n][e]);
      }
    quadMax(tileMax);
    if (lane % 4 == 0) {
      maxParts[slice * kHeads + headRow + r0] = tileMax[0];
      maxParts[slice * kHeads + headRow + r0 + 8] = tileMax[1];
    }
    mmaSync(); // (1) the slices' maxima

    float factor[2], newMax[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m = runningMax[half];
#pragma unroll
      for (int s = 0; s < kSlices; ++s)
        m = fmaxf(m, maxParts[s * kHeads + headRow + r0 + 8 * half]);
      newMax[half] = m;
      factor[half] = m == -INFINITY ? 1.0f : exp2f(runningMax[half] - m);
      runningMax[half] = m;
    }
    float localSum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < S::kScoreTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int half = e / 2;
        const float w0 = scores[n][e] == -INFINITY ? 0.0f : exp2f(scores[n][e] - newMax[half]);
        const float w1 =
            scores[n][e + 1] == -INFINITY ? 0.0f : exp2f(scores[n][e + 1] - newMax[half]);
        localSum[half] += w0 + w1;
        const int key = slice * S::kKeysPerWarp + n * 8 + mma::accColumn(e);
        *reinterpret_cast<uint32_t *>(weights + (headRow + r0 + 8 * half) * kPStride + key) =
            mma::packBf16(w0, w1);
      }
#pragma unroll
    for (int half = 0; half < 2; ++half)
      runningSum[half] = runningSum[half] * factor[half] + localSum[half];
    // Most tiles leave the maxima as they are: rescale only when one of the warp's changed.
    if (__any_sync(0xffffffffu, factor[0] != 1.0f || factor[1] != 1.0f))
#pragma unroll
      for (int v = 0; v < S::kValueTiles; ++v)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          o[v][e] *= factor[e / 2];
    mmaSync(); // (2) the group's weights

    // O += P V over this warp's latent dimensions.
#pragma unroll
    for (int k0 = 0; k0 < kTileKeys; k0 += 16) {
      uint32_t a[4];
      mma::loadA(a, weights + headRow * kPStride + k0, kPStride);
      const __nv_bfloat16 *values = kv + k0 * kStride + slice * S::kDimsPerWarp;
      if constexpr (S::kValueTiles == 1) {
        uint32_t b[2];
        mma::loadBTrans(b, values, kStride);
        mma::mma16816(o[0], a, b);
      } else {
#pragma unroll
        for (int v = 0; v < S::kValueTiles; v += 2) {
          uint32_t b0[2], b1[2];
          mma::loadBTransPair(b0, b1, values + v * 8, kStride);
          mma::mma16816(o[v], a, b0);
          mma::mma16816(o[v + 1], a, b1);
        }
      }
    }
    if constexpr (S::kSpecialized) {
      if (t + 2 < tiles) // the producers refill this buffer with tile t + 2
        mma::namedBarrierArrive(kTileFree + t % 2, S::kBlockThreads);
    } else if (t + 1 < tiles) {
      mma::waitAsyncCopies<S::kStages - 1>(); // tile t + 1 staged
      __syncthreads(); // (3) this tile consumed, the next one staged
      convertTile(t + 1);
      __syncthreads(); // (4) the next tile converted, the staging area free
    }
  }

  // Each thread summed only its own positions: the row sums over the quad and the slices.
  quadSum(runningSum);
  mmaSync(); // the last tile's maxima are read
  if (lane % 4 == 0) {
    sumParts[slice * kHeads + headRow + r0] = runningSum[0];
    sumParts[slice * kHeads + headRow + r0 + 8] = runningSum[1];
  }
  mmaSync();
  float denominator[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    denominator[half] = 0.0f;
#pragma unroll
    for (int s = 0; s < kSlices; ++s)
      denominator[half] += sumParts[s * kHeads + headRow + r0 + 8 * half];
  }

  // A split's partial: per head its running max (natural log domain) and sum, then the
  // unnormalized output.
  const size_t partialStride = size_t(L) + 2;
  auto partial = [&](int h) {
    return partials + ((size_t(row) * p.heads + headBase + h) * splits + split) * partialStride;
  };
  if (splits > 1 && slice == 0 && lane % 4 == 0)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int h = headRow + r0 + 8 * half;
      if (headBase + h < p.heads) {
        partial(h)[0] = runningMax[half] == -INFINITY ? -INFINITY : runningMax[half] * kLn2;
        partial(h)[1] = denominator[half];
      }
    }
#pragma unroll
  for (int v = 0; v < S::kValueTiles; ++v)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int half = e / 2, h = headRow + r0 + 8 * half;
      if (headBase + h >= p.heads)
        continue;
      const int d = slice * S::kDimsPerWarp + v * 8 + mma::accColumn(e);
      if (splits > 1) {
        *reinterpret_cast<float2 *>(partial(h) + 2 + d) = make_float2(o[v][e], o[v][e + 1]);
      } else {
        const float inverse = denominator[half] > 0.0f ? 1.0f / denominator[half] : 0.0f;
        *reinterpret_cast<float2 *>(p.out + (size_t(row) * p.heads + headBase + h) * L + d) =
            make_float2(o[v][e] * inverse, o[v][e + 1] * inverse);
      }
    }
}

// A warpgroup kernel thread's place: its block's row, heads and split of the positions, its
// warpgroup (positions and latent half) and its accumulator rows r0 and r0 + 8.
struct WgmmaThread {
  int row, headBase, half, r0, q, splits, split, splitBegin, splitEnd, tiles;
  __device__ WgmmaThread(const SparseMlaDecodeParams &p, int tilesPerSplit)
      : row(int(blockIdx.x)), headBase(int(blockIdx.y) * 64), half(int(threadIdx.x) / 128),
        r0(16 * (int(threadIdx.x) / 32 % 4) + int(threadIdx.x) % 32 / 4), q(int(threadIdx.x) % 4),
        splits(int(gridDim.z)), split(int(blockIdx.z)) {
    constexpr int kTileKeys = 64;
    splitRange(p, row, split, splits, tilesPerSplit, kTileKeys, splitBegin, splitEnd);
    tiles = max(0, (splitEnd - splitBegin + kTileKeys - 1) / kTileKeys);
  }
};

// The block's 64 heads' absorbed queries in bf16, 128-byte swizzled (heads past p.heads zero),
// when `any` position is its to attend to.
__device__ __forceinline__ void storeWgmmaQueries(const SparseMlaDecodeParams &p, int row,
                                                  int headBase, bool any, unsigned char *queries) {
  constexpr int kHeads = 64, kWide = 576, kThreads = 256;
  for (int i = int(threadIdx.x); i < (any ? kHeads * kWide / 8 : 0); i += kThreads) {
    const int h = i / (kWide / 8), column = 8 * (i % (kWide / 8));
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (headBase + h < p.heads) {
      const float *from = p.q + (size_t(row) * p.heads + headBase + h) * kWide + column;
      const float4 a = *reinterpret_cast<const float4 *>(from);
      const float4 b = *reinterpret_cast<const float4 *>(from + 4);
      packed = make_uint4(mma::packBf16(a.x, a.y), mma::packBf16(a.z, a.w),
                          mma::packBf16(b.x, b.y), mma::packBf16(b.z, b.w));
    }
    *reinterpret_cast<uint4 *>(queries + wgmma::swizzledOffset(64, h, column)) = packed;
  }
}

// The warpgroup kernels' end: each row's denominator over both warpgroups' positions (sumParts:
// [2][64] in shared memory), then the block's partial (per head its maximum in the natural log
// domain and its sum, then the unnormalized output) or, unsplit, the normalized output.
__device__ __forceinline__ void writeWgmmaOutputs(const SparseMlaDecodeParams &p, float *partials, int row,
                                  int headBase, int split, int splits, int half, int r0, int q,
                                  const float (&runningMax)[2], float (&runningSum)[2],
                                  const float (&o)[4][32], float *sumParts) {
  constexpr int L = 512, kHeads = 64;
  // Row sums: over the quad, then the two warpgroups' positions.
  quadSum(runningSum);
  __syncthreads();
  if (q == 0) {
    sumParts[half * kHeads + r0] = runningSum[0];
    sumParts[half * kHeads + r0 + 8] = runningSum[1];
  }
  __syncthreads();
  float denominator[2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
    denominator[h] = sumParts[r0 + 8 * h] + sumParts[kHeads + r0 + 8 * h];

  const size_t partialStride = size_t(L) + 2;
  auto partial = [&](int h) {
    return partials + ((size_t(row) * p.heads + headBase + h) * splits + split) * partialStride;
  };
  if (splits > 1 && half == 0 && q == 0)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (headBase + r0 + 8 * h < p.heads) {
        partial(r0 + 8 * h)[0] = runningMax[h] == -INFINITY ? -INFINITY : runningMax[h] * kLn2;
        partial(r0 + 8 * h)[1] = denominator[h];
      }
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int head = r0 + 8 * h;
        if (headBase + head >= p.heads)
          continue;
        const int d = 256 * half + 64 * c + 8 * n + 2 * q;
        const float v0 = o[c][4 * n + 2 * h], v1 = o[c][4 * n + 2 * h + 1];
        if (splits > 1) {
          *reinterpret_cast<float2 *>(partial(head) + 2 + d) = make_float2(v0, v1);
        } else {
          const float inverse = denominator[h] > 0.0f ? 1.0f / denominator[h] : 0.0f;
          *reinterpret_cast<float2 *>(p.out + (size_t(row) * p.heads + headBase + head) * L + d) =
              make_float2(v0 * inverse, v1 * inverse);
        }
      }
}

// 64 heads per block on warpgroup MMAs (sm_90a wgmma), DeepSeek-V3.2's 512 + 64 rows. Two
// warpgroups; per tile of 64 positions warpgroup w multiplies the 64 heads' scores for positions
// 32w..32w+31 (Q and the tile straight from shared memory, 128-byte swizzled), the two share
// their row maxima and softmax weights through shared memory, then warpgroup w adds P V for
// latent dimensions 256w..256w+255 (V: the same tile read N-major). Gather, conversion, splits
// and partials as in sparseMlaDecodeKernel.
struct WgmmaShape {
  static constexpr int kLatent = 512, kWide = 576;
  static constexpr int kThreads = 256, kHeads = 64, kTileKeys = 64;
  static constexpr int kBlockThreads = kThreads; // no producer warps
  static constexpr int kBlocksPerSm = 1, kMaxTiles = kMaxPositionsPerBlock / kTileKeys;
  static constexpr int kRowBytes = 656, kRopeOffset = 528;
  static constexpr int kCodePieces = 32, kRopePieces = 8;
  static constexpr uint32_t kMatrixBytes = 64 * kWide * 2; // 64 rows, swizzled
  static constexpr uint32_t kQueryOffset = 0, kTileOffset = kMatrixBytes;
  static constexpr uint32_t kWeightsOffset = 2 * kMatrixBytes;     // P: 64 x 64 bf16
  static constexpr uint32_t kStageOffset = kWeightsOffset + 64 * 64 * 2;
  static constexpr uint32_t kPartsOffset = kStageOffset + kTileKeys * kRowBytes;
  static constexpr uint32_t kRowsOffset = kPartsOffset + 2 * 2 * kHeads * 4;
  static size_t sharedBytes(int tilesPerSplit) {
    return 1024 + kRowsOffset + size_t(tilesPerSplit) * kTileKeys * 4; // + alignment slack
  }
};

__global__ void __launch_bounds__(WgmmaShape::kThreads, 1)
    sparseMlaWgmmaKernel(SparseMlaDecodeParams p, int tilesPerSplit, float *partials) {
  waitForEarlierKernels(); // launched as a programmatic dependent
  letDependentsLaunch();
  using S = WgmmaShape;
  constexpr int L = S::kLatent, kTileKeys = S::kTileKeys, kThreads = S::kThreads;
  extern __shared__ __align__(16) unsigned char rawShared[];
  // The swizzled operands need 1024-byte aligned chunks.
  unsigned char *smem = rawShared + ((1024 - mma::sharedAddress(rawShared) % 1024) % 1024);
  const uint32_t base = mma::sharedAddress(smem);
  unsigned char *queries = smem + S::kQueryOffset, *tile = smem + S::kTileOffset;
  unsigned char *weights = smem + S::kWeightsOffset, *stage = smem + S::kStageOffset;
  auto *maxParts = reinterpret_cast<float *>(smem + S::kPartsOffset); // [2][64]
  float *sumParts = maxParts + 2 * S::kHeads;                         // [2][64]
  auto *cacheRows = reinterpret_cast<int32_t *>(smem + S::kRowsOffset);

  const WgmmaThread at(p, tilesPerSplit);
  const int row = at.row, headBase = at.headBase, tid = threadIdx.x, lane = tid % 32;
  const int half = at.half, r0 = at.r0, q = at.q, splits = at.splits, split = at.split;
  const int splitBegin = at.splitBegin, splitEnd = at.splitEnd, tiles = at.tiles;

  resolveCacheRows(p, row, splitBegin, splitEnd, tiles * kTileKeys, cacheRows, tid, kThreads);
  storeWgmmaQueries(p, row, headBase, tiles > 0, queries);
  wgmma::sharedWritesToAsyncProxy();
  __syncthreads();

  const auto *pool = static_cast<const unsigned char *>(p.latentPages);
  const int ownRow = tid / 4, ownPiece = tid % 4; // staging and conversion: four threads a row
  auto issueTile = [&](int t) {
    stageRow<S::kRowBytes, true>(stage + ownRow * S::kRowBytes, pool,
                                 cacheRows[t * kTileKeys + ownRow], ownPiece);
  };
  auto convertTile = [&](int t) {
    const bool live = cacheRows[t * kTileKeys + ownRow] >= 0;
    const unsigned char *from = stage + ownRow * S::kRowBytes;
#pragma unroll
    for (int piece = ownPiece; piece < S::kCodePieces; piece += 4) {
      uint4 packed[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
      if (live)
        convertCodes16<true>(from + piece * 16, reinterpret_cast<const float *>(from + L)[piece / 8],
                       packed);
      *reinterpret_cast<uint4 *>(tile + wgmma::swizzledOffset(64, ownRow, 16 * piece)) = packed[0];
      *reinterpret_cast<uint4 *>(tile + wgmma::swizzledOffset(64, ownRow, 16 * piece + 8)) =
          packed[1];
    }
#pragma unroll
    for (int piece = ownPiece; piece < S::kRopePieces; piece += 4)
      *reinterpret_cast<uint4 *>(tile + wgmma::swizzledOffset(64, ownRow, L + 8 * piece)) =
          live ? *reinterpret_cast<const uint4 *>(from + S::kRopeOffset + piece * 16)
               : make_uint4(0, 0, 0, 0);
    wgmma::sharedWritesToAsyncProxy();
  };

  float runningMax[2] = {-INFINITY, -INFINITY}, runningSum[2] = {0.0f, 0.0f};
  float o[4][32] = {}; // latent dimensions 256 half + 64 c + 8 n + 2 q (+1), rows r0 / r0 + 8
  const float scoreScale = p.softmaxScale * kLog2e;

  if (tiles > 0) {
    issueTile(0);
    mma::waitAsyncCopies<0>();
    __syncthreads();
    convertTile(0);
    __syncthreads();
  }
  // Descriptors of the operands' first k step; later steps add their byte offsets / 16.
  const uint64_t queryDescriptor = wgmma::descriptor(base + S::kQueryOffset);
  const uint64_t keyDescriptor = wgmma::descriptor(base + S::kTileOffset + 32 * 128 * half);
  const uint64_t weightDescriptor = wgmma::descriptor(base + S::kWeightsOffset);
  const uint64_t valueDescriptor = wgmma::descriptor(base + S::kTileOffset + 4 * half * 64 * 128);
  for (int t = 0; t < tiles; ++t) {
    if (t + 1 < tiles)
      issueTile(t + 1); // in flight while this tile computes
    else
      mma::commitAsyncCopies();
    const int32_t *tileRows = cacheRows + t * kTileKeys;

    // Scores of the 64 heads for this warpgroup's 32 positions: 36 k steps of 16.
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i)
      s[i] = 0.0f;
    wgmma::fence();
#pragma unroll
    for (int step = 0; step < S::kWide / 16; ++step) {
      const uint32_t offset = (step / 4 * 64 * 128 + step % 4 * 32) / 16;
      wgmma::mma64x32(s, queryDescriptor + offset, keyDescriptor + offset);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fenceOperands(s);

    uint64_t liveMask = __ballot_sync(0xffffffffu, tileRows[lane] >= 0) |
                        uint64_t(__ballot_sync(0xffffffffu, tileRows[32 + lane] >= 0)) << 32;
    float tileMax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = 32 * half + 8 * n + 2 * q + (e & 1);
        float &v = s[4 * n + e];
        v = (liveMask >> key) & 1 ? v * scoreScale : -INFINITY;
        tileMax[e / 2] = fmaxf(tileMax[e / 2], v);
      }
    quadMax(tileMax);
    if (q == 0) {
      maxParts[half * S::kHeads + r0] = tileMax[0];
      maxParts[half * S::kHeads + r0 + 8] = tileMax[1];
    }
    __syncthreads(); // (1) both halves' maxima

    float factor[2], newMax[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m = fmaxf(runningMax[h], fmaxf(maxParts[r0 + 8 * h],
                                                 maxParts[S::kHeads + r0 + 8 * h]));
      newMax[h] = m;
      factor[h] = m == -INFINITY ? 1.0f : exp2f(runningMax[h] - m);
      runningMax[h] = m;
    }
    float localSum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int h = e / 2;
        const float w0 = s[4 * n + e] == -INFINITY ? 0.0f : exp2f(s[4 * n + e] - newMax[h]);
        const float w1 =
            s[4 * n + e + 1] == -INFINITY ? 0.0f : exp2f(s[4 * n + e + 1] - newMax[h]);
        localSum[h] += w0 + w1;
        *reinterpret_cast<uint32_t *>(
            weights + wgmma::swizzledOffset(64, r0 + 8 * h, 32 * half + 8 * n + 2 * q)) =
            mma::packBf16(w0, w1);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h)
      runningSum[h] = runningSum[h] * factor[h] + localSum[h];
    if (__any_sync(0xffffffffu, factor[0] != 1.0f || factor[1] != 1.0f))
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int i = 0; i < 32; ++i)
          o[c][i] *= factor[(i % 4) / 2];
    wgmma::sharedWritesToAsyncProxy();
    __syncthreads(); // (2) the weights of all 64 positions

    // O += P V: 4 k steps of 16 positions, 4 chunks of 64 latent dimensions.
    wgmma::fence();
#pragma unroll
    for (int step = 0; step < kTileKeys / 16; ++step)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        wgmma::mma64x64Transposed(o[c], weightDescriptor + 32 * step / 16,
                                  valueDescriptor + (c * 64 * 128 + 16 * 128 * step) / 16);
    wgmma::commit();
    wgmma::wait<0>();
#pragma unroll
    for (int c = 0; c < 4; ++c)
      wgmma::fenceOperands(o[c]);

    if (t + 1 < tiles) {
      mma::waitAsyncCopies<0>();
      __syncthreads(); // (3) this tile consumed, the next one staged
      convertTile(t + 1);
      __syncthreads(); // (4) the next tile converted, the staging area free
    }
  }

  writeWgmmaOutputs(p, partials, row, headBase, split, splits, half, r0, q, runningMax, runningSum,
                    o, sumParts);
}

// The splits' partials of one (row, head) merged: out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
// Block z of gridDim.z merges latent dimensions z * kCombineThreads + tid, then every
// gridDim.z * kCombineThreads further. Launched as a dependent of the split kernel (it may start
// while that one drains): it waits for the partials.
// The same in 32-position halves (SparseMlaDecodeParams::halfTiles): two
// warpgroups walk the split's 64-position tiles (the unit of the splits and resolved rows) as
// 32-position halves in two bf16 buffers: per half, warpgroup w multiplies the 64 heads' scores
// for positions 16w..16w+15 (Q and the half straight from shared memory, 128-byte swizzled), the
// two share their row maxima and softmax weights through shared memory, then warpgroup w adds
// P V for latent dimensions 256w..256w+255 (V: the same half read N-major). Both MMAs run
// asynchronously while the same threads convert the next half into the other buffer (its first
// pieces under the scores, the rest under P V), and each thread converts exactly the bytes it
// gathered itself (a row's 656 bytes by eight threads: four 16-code pieces, one rope piece, the
// row's four scales read into registers), so no barrier stands between a half's copies and its
// conversion. (In sparseMlaWgmmaKernel's single 64-position bf16 tile, all the shared memory
// beside the queries holds, the conversion and the gather's wait run in series with the MMAs:
// 177 us at batch 64 x 128 heads, of which the MMAs and softmax alone took 93;
// docs/performance.md, session 24.) Splits and partials as in sparseMlaDecodeKernel.
struct WgmmaHalvesShape {
  static constexpr int kLatent = 512, kWide = 576;
  static constexpr int kThreads = 256, kHeads = 64, kTileKeys = 64;
  static constexpr int kHalfKeys = 32;           // positions a bf16 buffer holds
  static constexpr int kBlockThreads = kThreads; // no producer warps
  static constexpr int kBlocksPerSm = 1, kMaxTiles = kMaxPositionsPerBlock / kTileKeys;
  static constexpr int kRowBytes = 656, kScalesOffset = 512, kRopeOffset = 528;
  static constexpr int kThreadsPerRow = kThreads / kHalfKeys; // 8: a code piece of each scale tile
  static constexpr uint32_t kQueryBytes = 64 * kWide * 2;     // 64 rows, swizzled
  static constexpr uint32_t kHalfBytes = kHalfKeys * kWide * 2; // 32 rows, swizzled
  static constexpr uint32_t kQueryOffset = 0, kHalvesOffset = kQueryBytes;
  static constexpr uint32_t kWeightsOffset = kHalvesOffset + 2 * kHalfBytes; // P: 64 x 32 bf16
  static constexpr uint32_t kStageOffset = kWeightsOffset + 64 * 128;        // (64-column rows)
  static constexpr uint32_t kPartsOffset = kStageOffset + 2 * kHalfKeys * kRowBytes;
  static constexpr uint32_t kRowsOffset = kPartsOffset + 2 * 2 * kHeads * 4;
  static size_t sharedBytes(int tilesPerSplit) {
    return 1024 + kRowsOffset + size_t(tilesPerSplit) * kTileKeys * 4; // + alignment slack
  }
};

__global__ void __launch_bounds__(WgmmaHalvesShape::kThreads, 1)
    sparseMlaWgmmaHalvesKernel(SparseMlaDecodeParams p, int tilesPerSplit, float *partials) {
  waitForEarlierKernels(); // launched as a programmatic dependent
  letDependentsLaunch();
  using S = WgmmaHalvesShape;
  constexpr int L = S::kLatent, kHalfKeys = S::kHalfKeys, kThreads = S::kThreads;
  extern __shared__ __align__(16) unsigned char rawShared[];
  // The swizzled operands need 1024-byte aligned chunks.
  unsigned char *smem = rawShared + ((1024 - mma::sharedAddress(rawShared) % 1024) % 1024);
  const uint32_t base = mma::sharedAddress(smem);
  unsigned char *queries = smem + S::kQueryOffset, *halves = smem + S::kHalvesOffset;
  unsigned char *weights = smem + S::kWeightsOffset, *stages = smem + S::kStageOffset;
  auto *maxParts = reinterpret_cast<float *>(smem + S::kPartsOffset); // [2][64]
  float *sumParts = maxParts + 2 * S::kHeads;                         // [2][64]
  auto *cacheRows = reinterpret_cast<int32_t *>(smem + S::kRowsOffset);

  const WgmmaThread at(p, tilesPerSplit);
  const int row = at.row, headBase = at.headBase, tid = threadIdx.x, lane = tid % 32;
  const int half = at.half, r0 = at.r0, q = at.q, splits = at.splits, split = at.split;
  const int splitBegin = at.splitBegin, splitEnd = at.splitEnd, tiles = at.tiles;
  const int steps = 2 * tiles; // 32-position halves

  resolveCacheRows(p, row, splitBegin, splitEnd, tiles * S::kTileKeys, cacheRows, tid, kThreads);
  __syncthreads(); // the cache rows

  // This thread's share of a half's rows: row ownRow, code pieces ownPiece + 8k (16 codes each,
  // one of each 128-code scale tile), rope piece ownPiece (8 bf16).
  const auto *pool = static_cast<const unsigned char *>(p.latentPages);
  const int ownRow = tid / S::kThreadsPerRow, ownPiece = tid % S::kThreadsPerRow;
  static_assert(S::kThreadsPerRow == 8 && L / 16 == 4 * 8 &&
                    S::kRopeOffset - S::kScalesOffset == 16,
                "four code pieces, one rope piece a thread; the scales one 16-byte piece");
  float4 evenScales, oddScales; // the row's scales of the half in each staging slot
  // Half `h`'s copies into staging slot h % 2 (one committed group, empty for a dead row) and
  // its scales into registers.
  auto gather = [&](int h) {
    const int32_t cacheRow = h < steps ? cacheRows[h * kHalfKeys + ownRow] : -1;
    unsigned char *to = stages + (h % 2) * kHalfKeys * S::kRowBytes + ownRow * S::kRowBytes;
    if (cacheRow >= 0) {
      const unsigned char *from = pool + int64_t(cacheRow) * S::kRowBytes;
#pragma unroll
      for (int k = 0; k < 4; ++k)
        mma::copyAsync16(to + (ownPiece + 8 * k) * 16, from + (ownPiece + 8 * k) * 16);
      mma::copyAsync16(to + S::kRopeOffset + ownPiece * 16, from + S::kRopeOffset + ownPiece * 16);
      const float4 rowScales = __ldg(reinterpret_cast<const float4 *>(from + S::kScalesOffset));
      if (h % 2)
        oddScales = rowScales;
      else
        evenScales = rowScales;
    }
    mma::commitAsyncCopies();
  };
  // Code pieces k of [firstPiece, lastPiece) of half `h` (staged, this thread's copies landed)
  // into bf16 buffer h % 2, and the rope piece with the last; a dead row as zeros (its weights
  // are zero, and 0 * garbage could be NaN).
  auto convert = [&](int h, int firstPiece, int lastPiece) {
    const bool live = cacheRows[h * kHalfKeys + ownRow] >= 0;
    const unsigned char *from = stages + (h % 2) * kHalfKeys * S::kRowBytes + ownRow * S::kRowBytes;
    unsigned char *to = halves + (h % 2) * S::kHalfBytes;
    const float4 scale = h % 2 ? oddScales : evenScales;
#pragma unroll
    for (int k = firstPiece; k < lastPiece; ++k) {
      const int piece = ownPiece + 8 * k;
      uint4 packed[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
      if (live)
        convertCodes16<true>(from + piece * 16,
                             k == 0   ? scale.x
                             : k == 1 ? scale.y
                             : k == 2 ? scale.z
                                      : scale.w,
                             packed);
      *reinterpret_cast<uint4 *>(to + wgmma::swizzledOffset(kHalfKeys, ownRow, 16 * piece)) =
          packed[0];
      *reinterpret_cast<uint4 *>(to + wgmma::swizzledOffset(kHalfKeys, ownRow, 16 * piece + 8)) =
          packed[1];
    }
    if (lastPiece == 4)
      *reinterpret_cast<uint4 *>(to + wgmma::swizzledOffset(kHalfKeys, ownRow, L + 8 * ownPiece)) =
          live ? *reinterpret_cast<const uint4 *>(from + S::kRopeOffset + ownPiece * 16)
               : make_uint4(0, 0, 0, 0);
    wgmma::sharedWritesToAsyncProxy();
  };

  // The first two halves' copies, then the queries under them.
  if (steps > 0) {
    gather(0);
    gather(1);
  }
  storeWgmmaQueries(p, row, headBase, steps > 0, queries);
  wgmma::sharedWritesToAsyncProxy();
  if (steps > 0) {
    mma::waitAsyncCopies<1>(); // half 0's copies (half 1's may still fly)
    convert(0, 0, 4);
  }

  float runningMax[2] = {-INFINITY, -INFINITY}, runningSum[2] = {0.0f, 0.0f};
  float o[4][32] = {}; // latent dimensions 256 half + 64 c + 8 n + 2 q (+1), rows r0 / r0 + 8
  const float scoreScale = p.softmaxScale * kLog2e;
  // Descriptors of the operands' first k step; later steps add their byte offsets / 16.
  const uint64_t queryDescriptor = wgmma::descriptor(base + S::kQueryOffset);
  const uint64_t weightDescriptor = wgmma::descriptor(base + S::kWeightsOffset);
  for (int h = 0; h < steps; ++h) {
    __syncthreads(); // (1) half h converted by every thread; both warpgroups done with h - 1
    const uint32_t buffer = base + S::kHalvesOffset + (h % 2) * S::kHalfBytes;
    // Scores of the 64 heads for this warpgroup's 16 positions: 36 k steps of 16.
    float s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      s[i] = 0.0f;
    {
      const uint64_t keyDescriptor = wgmma::descriptor(buffer + 16 * 128 * half);
      wgmma::fence();
#pragma unroll
      for (int step = 0; step < S::kWide / 16; ++step)
        wgmma::mma64x16(s, queryDescriptor + (step / 4 * 64 * 128 + step % 4 * 32) / 16,
                        keyDescriptor + (step / 4 * kHalfKeys * 128 + step % 4 * 32) / 16);
      wgmma::commit();
    }
    // Under the scores: half h + 1's first pieces, then half h + 2's copies into the slot half h
    // left (this thread converted its own bytes of it already).
    if (h + 1 < steps) {
      mma::waitAsyncCopies<0>();
      convert(h + 1, 0, 2);
    }
    if (h + 2 < steps)
      gather(h + 2);
    wgmma::wait<0>();
    wgmma::fenceOperands(s);

    const uint32_t liveMask = __ballot_sync(0xffffffffu, cacheRows[h * kHalfKeys + lane] >= 0);
    float tileMax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = 16 * half + 8 * n + 2 * q + (e & 1);
        float &v = s[4 * n + e];
        v = (liveMask >> key) & 1 ? v * scoreScale : -INFINITY;
        tileMax[e / 2] = fmaxf(tileMax[e / 2], v);
      }
    quadMax(tileMax);
    if (q == 0) {
      maxParts[half * S::kHeads + r0] = tileMax[0];
      maxParts[half * S::kHeads + r0 + 8] = tileMax[1];
    }
    __syncthreads(); // (2) both halves' maxima

    float factor[2], newMax[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m =
          fmaxf(runningMax[i], fmaxf(maxParts[r0 + 8 * i], maxParts[S::kHeads + r0 + 8 * i]));
      newMax[i] = m;
      factor[i] = m == -INFINITY ? 1.0f : exp2f(runningMax[i] - m);
      runningMax[i] = m;
    }
    float localSum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int i = e / 2;
        const float w0 = s[4 * n + e] == -INFINITY ? 0.0f : exp2f(s[4 * n + e] - newMax[i]);
        const float w1 = s[4 * n + e + 1] == -INFINITY ? 0.0f : exp2f(s[4 * n + e + 1] - newMax[i]);
        localSum[i] += w0 + w1;
        *reinterpret_cast<uint32_t *>(
            weights + wgmma::swizzledOffset(64, r0 + 8 * i, 16 * half + 8 * n + 2 * q)) =
            mma::packBf16(w0, w1);
      }
#pragma unroll
    for (int i = 0; i < 2; ++i)
      runningSum[i] = runningSum[i] * factor[i] + localSum[i];
    if (__any_sync(0xffffffffu, factor[0] != 1.0f || factor[1] != 1.0f))
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int i = 0; i < 32; ++i)
          o[c][i] *= factor[(i % 4) / 2];
    wgmma::sharedWritesToAsyncProxy();
    __syncthreads(); // (3) the weights of all 32 positions; the maxima read

    // O += P V: 2 k steps of 16 positions, 4 chunks of 64 latent dimensions.
    wgmma::fence();
#pragma unroll
    for (int step = 0; step < kHalfKeys / 16; ++step)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        wgmma::mma64x64Transposed(
            o[c], weightDescriptor + 32 * step / 16,
            wgmma::descriptor(buffer + (4 * half + c) * kHalfKeys * 128 + 16 * 128 * step));
    wgmma::commit();
    // Under P V: the rest of half h + 1.
    if (h + 1 < steps)
      convert(h + 1, 2, 4);
    wgmma::wait<0>();
#pragma unroll
    for (int c = 0; c < 4; ++c)
      wgmma::fenceOperands(o[c]);
  }
  mma::waitAsyncCopies<0>(); // nothing in flight when the block ends

  writeWgmmaOutputs(p, partials, row, headBase, split, splits, half, r0, q, runningMax, runningSum,
                    o, sumParts);
}

template <int L>
__global__ void __launch_bounds__(kCombineThreads)
    sparseMlaCombineKernel(SparseMlaDecodeParams p, int splits, const float *partials) {
  waitForEarlierKernels(); // launched as a programmatic dependent
  letDependentsLaunch();
  // The splits' maxima and sums are read once, in parallel, and their factors exp(max - largest)
  // shared: each thread used to walk every split's header itself, one dependent load at a time
  // (9.5 us for 17 splits at batch 1). The sums run in split order as before: the same bits.
  // Only the splits that saw a position are merged, listed once in split order: a short causal
  // row under a long capacity leaves most of its splits empty (a 1K row at an 8K capacity: 16
  // of 128), and every loop below used to walk them all. Skipping an empty split adds nothing,
  // as its test did: the same sums in the same order, the same bits.
  __shared__ float factors[kSparseMlaMaxLongSplits], maxima[kSparseMlaMaxLongSplits],
      sums[kSparseMlaMaxLongSplits];
  __shared__ int live[kSparseMlaMaxLongSplits], warpLive[kCombineThreads / 32];
  __shared__ float sharedDenominator, sharedLargest;
  const size_t item = size_t(blockIdx.x) * p.heads + blockIdx.y; // (row, head)
  const float *first = partials + item * splits * (size_t(L) + 2);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  float maximum = -INFINITY, headerSum = 0.0f;
  if (tid < splits) {
    maximum = first[tid * (L + 2)];
    headerSum = first[tid * (L + 2) + 1];
  }
  const bool isLive = tid < splits && maximum != -INFINITY;
  const unsigned liveLanes = __ballot_sync(0xffffffffu, isLive);
  if (lane == 0)
    warpLive[warp] = __popc(liveLanes);
  __syncthreads();
  int at = __popc(liveLanes & ((1u << lane) - 1u)), count = 0;
  for (int w = 0; w < kCombineThreads / 32; ++w) {
    at += w < warp ? warpLive[w] : 0;
    count += warpLive[w];
  }
  if (isLive) {
    live[at] = tid;
    maxima[at] = maximum;
    sums[at] = headerSum;
  }
  __syncthreads();
  // The largest maximum by warp 0 (fmaxf: any order gives it), the factors one a thread, then
  // the denominator in split order by one thread: the bits of one thread doing all three, whose
  // serial exp a split stood in front of every value (9.6 us a merge of 65 splits, batch 1).
  if (tid < 32) {
    float largest = -INFINITY;
    for (int s = tid; s < count; s += 32)
      largest = fmaxf(largest, maxima[s]);
    for (int offset = 16; offset > 0; offset /= 2)
      largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
    if (tid == 0)
      sharedLargest = largest;
  }
  __syncthreads();
  if (tid < count)
    factors[tid] = expf(maxima[tid] - sharedLargest);
  __syncthreads();
  if (tid == 0) {
    float denominator = 0.0f;
    for (int s = 0; s < count; ++s)
      denominator += factors[s] * sums[s];
    sharedDenominator = denominator;
  }
  __syncthreads();
  const float denominator = sharedDenominator;
  // kBatch splits' values loaded together, then summed in split order (the loads used to wait
  // on the branch of each split, a few in flight per thread: 21 us for 32 splits at batch 1
  // under ncu, the split kernel 11).
  constexpr int kBatch = 16;
  for (int d = int(blockIdx.z) * kCombineThreads + tid; d < L;
       d += int(gridDim.z) * kCombineThreads) {
    float sum = 0.0f;
    for (int s0 = 0; s0 < count; s0 += kBatch) {
      float values[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        values[j] = s0 + j < count ? first[live[s0 + j] * (L + 2) + 2 + d] : 0.0f;
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (s0 + j < count)
          sum += factors[s0 + j] * values[j];
    }
    p.out[item * L + d] = denominator > 0.0f ? sum / denominator : 0.0f;
  }
}

// The merge's blocks a (row, head): one per kCombineThreads latent dimensions while one wave of
// them (kCombineBlocksPerSm an SM, by threads) holds every pair, else one (see launchShape).
constexpr int kCombineBlocksPerSm = 2048 / kCombineThreads;
template <int L> int combineChunks(int64_t pairs, int sms) {
  constexpr int kChunks = (L + kCombineThreads - 1) / kCombineThreads;
  return pairs * kChunks <= int64_t(sms) * kCombineBlocksPerSm ? kChunks : 1;
}

// Splits of the positions over blocks (flash-decoding): the count that finishes soonest, of
// those the fewest, by a model in microseconds fitted to the H200 split sweeps of
// docs/performance.md (2026-12-01, sessions 19-20: 32 heads over 1K-64K positions at 1-8 rows,
// 128 and 16 heads over top-k 2048 at 1-8 rows; each of the 16 sweeps' picks within 3% of its
// best measured count, 64K's 114 splits by interpolation, where the tile-count model before it
// missed by up to 31%). Batch 1 takes many splits, 128 heads at 64 rows none:
// - the split kernel: waves of blocks times a block's tiles and its fixed cost (the queries
//   read, the partials or the output written), both by the block's heads (16 heads per block:
//   2.2 + 3.5 us a tile + a block; 32: 4.8 + 4.9; 64 on warpgroups: 5.6 + 9.1). Without the
//   fixed cost 128 rows of 128 heads took 32 splits of one tile and ran 13x slower than unsplit.
// - the merge, when split: its launch (4.6 us); the partials (514 floats a row, head and split)
//   written and read back (1.3 ns each); and the partials over the SMs that run the merge's
//   blocks, 37 ns each: those blocks launch while the split kernel runs, one a (row, head,
//   chunk), and gather on the SMs its last wave leaves free, up to kCombineBlocksPerSm an SM
//   (the sweeps fit that; not profiled). So one row of 32 heads at 8K positions took 128 splits
//   of a tile (4 SMs free: 38.1 us against 23.5 at 64 of two), 128 heads at 2 rows 32 splits
//   (34.8 against 31.0 at 16), 16 heads at 4 rows 32 (18.1 against 13.7 at 16), and at 32K one
//   row 128 (52.8 against 43.6 at 103). A term per partial alone, without the free SMs, moved
//   128 heads at 1 row to 16 splits (28.9 us against 26.1 at 32).
template <typename S> int splitCount(const SparseMlaDecodeParams &p, int sms, int maxSplits) {
  constexpr double kTileUs = S::kHeads == 64 ? 5.6 : S::kHeads == 32 ? 4.8 : 2.2;
  constexpr double kBlockUs = S::kHeads == 64 ? 9.1 : S::kHeads == 32 ? 4.9 : 3.5;
  constexpr double kMergeUs = 4.6, kPartialUs = 0.0013, kPartialPerMergeSmUs = 0.037;
  const int tiles = (p.topK + S::kTileKeys - 1) / S::kTileKeys;
  const int64_t blocks = int64_t(p.rows) * ((p.heads + S::kHeads - 1) / S::kHeads);
  const int64_t slots = int64_t(sms) * S::kBlocksPerSm; // one block an SM
  const int64_t pairs = int64_t(p.rows) * p.heads;
  const int64_t mergeBlocks = pairs * combineChunks<S::kLatent>(pairs, sms);
  int best = 0;
  double bestTime = 0;
  for (int splits = (tiles + S::kMaxTiles - 1) / S::kMaxTiles; splits <= std::min(tiles, maxSplits);
       ++splits) {
    const int64_t perSplit = (tiles + splits - 1) / splits;
    const int64_t used = (tiles + perSplit - 1) / perSplit;
    const int64_t waves = (blocks * used + slots - 1) / slots;
    double time = double(waves) * (double(perSplit) * kTileUs + kBlockUs);
    if (used > 1) {
      const int64_t freeSms = waves * slots - blocks * used; // in the last wave
      const int64_t mergeSms =
          std::max(freeSms, (mergeBlocks + kCombineBlocksPerSm - 1) / kCombineBlocksPerSm);
      const double partials = double(pairs * used);
      time += kMergeUs + kPartialUs * partials + kPartialPerMergeSmUs * partials / double(mergeSms);
    }
    if (best == 0 || time < bestTime) {
      best = splits;
      bestTime = time;
    }
  }
  return best; // 0: more positions than maxSplits blocks hold
}

// DeepSeek-V3.2's rows with 64 heads per block run on warpgroup MMAs (same tiles, splits and
// partials as the warp-MMA kernel).
template <int L, int R, int G> constexpr bool kOnWarpgroups = L == 512 && R == 64 && G == 4;

template <int L, int R, int G> int launchShape(const SparseMlaDecodeParams &p, cudaStream_t stream) {
  // The launched kernel's shape; the warp-MMA kernel is not instantiated where wgmma runs.
  using S = std::conditional_t<kOnWarpgroups<L, R, G>, WgmmaShape, Shape<L, R, G>>;
  // The warpgroup form in halves: the same tiles, splits and partials, its own shared memory.
  const bool halves = kOnWarpgroups<L, R, G> && p.halfTiles;
  static_assert(WgmmaHalvesShape::kTileKeys == WgmmaShape::kTileKeys &&
                    WgmmaHalvesShape::kMaxTiles == WgmmaShape::kMaxTiles &&
                    WgmmaHalvesShape::kBlockThreads == WgmmaShape::kBlockThreads &&
                    WgmmaHalvesShape::kBlocksPerSm == WgmmaShape::kBlocksPerSm,
                "the halves form splits as the tile form does");
  auto sharedBytes = [halves](int tilesPerSplit) {
    return halves ? WgmmaHalvesShape::sharedBytes(tilesPerSplit) : S::sharedBytes(tilesPerSplit);
  };
  const DeviceSetup setup = deviceSetup([] {
    if constexpr (kOnWarpgroups<L, R, G>) {
      const cudaError_t status =
          cudaFuncSetAttribute(sparseMlaWgmmaKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(WgmmaShape::sharedBytes(WgmmaShape::kMaxTiles)));
      return status != cudaSuccess ? status
                                   : cudaFuncSetAttribute(
                                         sparseMlaWgmmaHalvesKernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(WgmmaHalvesShape::sharedBytes(WgmmaShape::kMaxTiles)));
    } else {
      return cudaFuncSetAttribute(sparseMlaDecodeKernel<L, R, G>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  int(S::sharedBytes(S::kMaxTiles)));
    }
  });
  if (setup.status != cudaSuccess)
    return int(setup.status);
  const int tiles = (p.topK + S::kTileKeys - 1) / S::kTileKeys;
  static_assert(S::kTileKeys == sparseMlaTileKeys(S::kHeads),
                "the header's tile size is the launched kernel's");
  SparseMlaDecodeParams oneRow = p;
  oneRow.rows = 1;
  // Row-invariant splits must fit any rows' partials: the cap of many rows.
  const int maxSplits =
      sparseMlaMaxSplitsForRows(p.topK, p.rowInvariantSplits ? kSparseMlaFewRows + 1 : p.rows);
  const int splits = p.splits > 0 ? p.splits
                                  : splitCount<S>(p.rowInvariantSplits ? oneRow : p,
                                                  setup.multiprocessors, maxSplits);
  if (splits == 0)
    return cudaErrorInvalidValue; // top-k past sparseMlaMaxCausalPositions()
  const int tilesPerSplit = (tiles + splits - 1) / splits;
  if (splits > maxSplits || tilesPerSplit > S::kMaxTiles)
    return cudaErrorInvalidValue; // a configured split count outside the kernel's range
  const int used = (tiles + tilesPerSplit - 1) / tilesPerSplit; // no empty split
  const dim3 grid(unsigned(p.rows), unsigned((p.heads + S::kHeads - 1) / S::kHeads), unsigned(used));
  auto *partials = static_cast<float *>(p.workspace);
  // Both kernels launch as programmatic dependents (the launch overlaps the drain before).
  DependentLaunch attention(grid, dim3(S::kBlockThreads), stream);
  attention.config.dynamicSmemBytes = sharedBytes(tilesPerSplit);
  cudaError_t status;
  if constexpr (kOnWarpgroups<L, R, G>)
    status = cudaLaunchKernelEx(&attention.config,
                                halves ? sparseMlaWgmmaHalvesKernel : sparseMlaWgmmaKernel, p,
                                tilesPerSplit, partials);
  else
    status = cudaLaunchKernelEx(&attention.config, sparseMlaDecodeKernel<L, R, G>, p,
                                tilesPerSplit, partials);
  if (status == cudaSuccess && used > 1) {
    // A dependent launch: its blocks take the SMs the split kernel leaves idle and wait there,
    // instead of a launch after it (batch 1: two short kernels in series). A block per
    // kCombineThreads latent dimensions while one wave of merge blocks holds them all, else a
    // block per (row, head): with four times the blocks in two waves, 128 heads batch 8 ran 8%
    // slower than with the old merge.
    const int chunks = combineChunks<L>(int64_t(p.rows) * p.heads, setup.multiprocessors);
    DependentLaunch merge(dim3(unsigned(p.rows), unsigned(p.heads), unsigned(chunks)),
                          dim3(kCombineThreads), stream);
    status = cudaLaunchKernelEx(&merge.config, sparseMlaCombineKernel<L>, p, used,
                                static_cast<const float *>(partials));
  }
  return int(status != cudaSuccess ? status : cudaGetLastError());
}

// 64 heads per block when there are that many (each row converted once for all of them), else
// the smallest group that holds the heads.
template <int L, int R> int launchHeads(const SparseMlaDecodeParams &p, cudaStream_t stream) {
  if (p.heads > 32)
    return launchShape<L, R, 4>(p, stream);
  if (p.heads > 16)
    return launchShape<L, R, 2>(p, stream);
  return launchShape<L, R, 1>(p, stream);
}

} // namespace

int32_t sparseMlaMaxCausalPositions() { return kSparseMlaMaxLongSplits * kMaxPositionsPerBlock; }

int64_t sparseMlaRowBytes(int32_t latentDim, int32_t ropeDim) {
  return int64_t(latentDim) + 4 * ((latentDim + kScaleTile - 1) / kScaleTile) + 2 * int64_t(ropeDim);
}

int64_t latentRowBytes(LatentCacheType type, int32_t latentDim, int32_t ropeDim) {
  return type == LatentCacheType::F32 ? 4 * (int64_t(latentDim) + ropeDim)
                                      : sparseMlaRowBytes(latentDim, ropeDim);
}

size_t sparseMlaWorkspaceBytes(int32_t rows, int32_t heads, int32_t latentDim, int32_t topK) {
  // Every row count up to `rows` fits: a few rows split further than many.
  const int64_t fewRows = std::min<int64_t>(rows, kSparseMlaFewRows);
  const int64_t partials =
      std::max<int64_t>(fewRows * sparseMlaMaxSplitsForRows(topK, int32_t(fewRows)),
                        int64_t(rows) * sparseMlaMaxSplits(topK));
  return rows > 0 && heads > 0 && latentDim > 0 && topK > 0
             ? size_t(partials) * heads * (size_t(latentDim) + 2) * sizeof(float)
             : 0;
}

int launchSparseMlaDecode(const SparseMlaDecodeParams &p, void *stream) {
  if (p.rows <= 0 || p.heads <= 0 || p.topK <= 0 || !p.q || !(p.indices || p.positions) ||
      !p.sequences || !p.workspace ||
      !p.latentPages || p.pageTokens <= 0 || !p.blockTables || p.maxPages <= 0 || !p.out ||
      !std::isfinite(p.softmaxScale) || reinterpret_cast<uintptr_t>(p.q) % 16 != 0 ||
      (p.heads + 15) / 16 > 65535 || p.splits < 0)
    return cudaErrorInvalidValue;
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.latentDim == 512 && p.ropeDim == 64)
    return launchHeads<512, 64>(p, s);
  if (p.latentDim == 64 && p.ropeDim == 32)
    return launchHeads<64, 32>(p, s);
  return cudaErrorInvalidValue;
}

} // namespace hybrid::kernels::cuda
