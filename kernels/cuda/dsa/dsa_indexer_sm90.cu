// The DSA lightning indexer (see DsaIndexer.h, docs/dsa-cache-layout.md): a scores kernel into a
// workspace, then a radix select on the scores' order-preserving bit patterns spread over many
// blocks per row (or the fused form: a cluster per row, scores kept on chip). FP8 keys go through
// the tensor cores: an E4M3 code (times an MXFP8 power-of-two block scale) is exact in bf16, so
// q . k is a bf16 mma of q (split into bf16 hi + lo halves, about 16 significant bits; lo is zero
// for MXFP8-quantized queries and skipped) with the keys, in fp32; a per-key fp32 scale
// multiplies the dot product. With MXFP8 queries the warpgroup kernel multiplies in f16 instead
// (the codes widened by the hardware converter, the powers of two moved out of the operands
// exactly; see its section). fp32 keys (the unquantized policy) take the CUDA-core kernel, one
// thread per key.
#include "../common/block_arrival.cuh"
#include "../common/device_setup.cuh"
#include "../common/fp8_quant.cuh"
#include "../common/warp_mma.cuh"
#include "../common/warpgroup_mma.cuh"
#include "fp8_device.cuh"
#include "hybrid/kernels/cuda/DsaIndexer.h"

#include <algorithm>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <map>
#include <mutex>
#include <tuple>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kScoreThreads = 128; // keys per block
constexpr int kMxBlock = 32;

// 32 consecutive values of an fp32 key.
template <int D>
__device__ inline void loadKeyChunk(const unsigned char *page, int slot, int chunk,
                                    float (&k)[kMxBlock]) {
  const float4 *source =
      reinterpret_cast<const float4 *>(page + (size_t(slot) * D + chunk * kMxBlock) * 4);
#pragma unroll
  for (int i = 0; i < kMxBlock / 4; ++i) {
    const float4 v = source[i];
    k[4 * i] = v.x;
    k[4 * i + 1] = v.y;
    k[4 * i + 2] = v.z;
    k[4 * i + 3] = v.w;
  }
}

// fp32 keys (the unquantized policy), one thread per key; FP8 keys take the MMA kernel below.
template <int D>
__global__ void __launch_bounds__(kScoreThreads)
    indexerScoresKernel(IndexerParams p, int64_t pageBytes) {
  extern __shared__ float shared[];
  const int row = blockIdx.x, heads = p.heads;
  const int position = p.positions[row];
  const int firstKey = int(blockIdx.y) * kScoreThreads;
  if (firstKey > position)
    return; // the whole block is past the row's causal limit
  float *qs = shared;             // [heads, D]
  float *weights = qs + heads * D; // [heads]: w * heads^-1/2
  const float *q = p.q + size_t(row) * heads * D;
  for (int i = threadIdx.x; i < heads * D; i += kScoreThreads)
    qs[i] = q[i];
  const float headScale = 1.0f / sqrtf(float(heads)); // the reference's fp32 arithmetic
  for (int j = threadIdx.x; j < heads; j += kScoreThreads)
    weights[j] = p.headWeights[size_t(row) * heads + j] * headScale;
  __syncthreads();

  const int s = firstKey + int(threadIdx.x);
  if (s > position)
    return;
  const int32_t page =
      p.blockTables[size_t(p.sequences[row]) * p.maxPages + s / p.pageTokens];
  const int slot = s % p.pageTokens;
  const unsigned char *base = static_cast<const unsigned char *>(p.keyPages) + page * pageBytes;

  float acc[kIndexerMaxHeads];
#pragma unroll
  for (int j = 0; j < kIndexerMaxHeads; ++j)
    acc[j] = 0.0f;
#pragma unroll 1
  for (int chunk = 0; chunk < D / kMxBlock; ++chunk) {
    float k[kMxBlock];
    loadKeyChunk<D>(base, slot, chunk, k);
#pragma unroll
    for (int j = 0; j < kIndexerMaxHeads; ++j) {
      if (j < heads) {
        // Every thread reads the same q: a shared-memory broadcast.
        const float4 *qv = reinterpret_cast<const float4 *>(qs + j * D + chunk * kMxBlock);
        float sum = acc[j];
#pragma unroll
        for (int i = 0; i < kMxBlock / 4; ++i) {
          const float4 v = qv[i];
          sum = fmaf(v.x, k[4 * i], sum);
          sum = fmaf(v.y, k[4 * i + 1], sum);
          sum = fmaf(v.z, k[4 * i + 2], sum);
          sum = fmaf(v.w, k[4 * i + 3], sum);
        }
        acc[j] = sum;
      }
    }
  }
  const float dotScale = 1.0f / sqrtf(float(D));
  float score = 0.0f;
#pragma unroll
  for (int j = 0; j < kIndexerMaxHeads; ++j)
    if (j < heads)
      score += weights[j] * fmaxf(0.0f, acc[j] * dotScale);
  p.scores[size_t(row) * p.maxKeys + s] = score;
}

constexpr int kMmaThreads = 128;   // 4 warps, 16 keys of a tile each
constexpr int kTileKeys = kIndexerTileKeys;
constexpr int kBlocksPerSm = 4;    // <= 128 registers a thread, 54.5 KB of shared memory a block
constexpr int kMmaMaxHeads = 64;   // 4 m-tiles of 16 heads

// bf16 elements per shared row: rows start 4 words apart modulo 32, so ldmatrix is conflict-free.
template <int D> __host__ __device__ constexpr int mmaStride() { return D + 8; }

template <int D> size_t mmaSharedBytes() {
  return size_t(2 * kMmaMaxHeads + kTileKeys) * mmaStride<D>() * 2 + size_t(kTileKeys) * 4 +
         size_t(kMmaMaxHeads) * 4;
}

// This thread's part of a key tile straight from the pages: 16-byte pieces of codes, and for
// MXFP8 the E8M0 scale of each piece's 32-value block.
template <IndexKeyType Type, int D> struct KeyTileLoad {
  static constexpr int kPieces = kTileKeys * (D / 16) / kMmaThreads;
  uint4 codes[kPieces];
  uint8_t blockScales[kPieces];
  float keyScale = 0.0f; // Fp8PerKey: the scale of key `tid` when < kTileKeys

  __device__ __forceinline__ void load(const IndexerParams &p, const unsigned char *pool,
                                       const int32_t *table, int64_t pageBytes, int tileKey,
                                       int position, int tid) {
    constexpr int kBlocks = D / kMxBlock;
    if (p.pageTokens % kTileKeys == 0) {
      // The tile is 64 consecutive slots of one page: one page lookup, contiguous codes.
      const unsigned char *page = pool + table[tileKey / p.pageTokens] * pageBytes;
      const int firstSlot = tileKey % p.pageTokens;
      const unsigned char *tileCodes = page + size_t(firstSlot) * D;
      const unsigned char *tileScales = page + size_t(p.pageTokens) * D;
#pragma unroll
      for (int i = 0; i < kPieces; ++i) {
        const int c = tid + i * kMmaThreads, k = c / (D / 16), piece = c % (D / 16);
        const bool live = tileKey + k <= position;
        codes[i] = live ? reinterpret_cast<const uint4 *>(tileCodes)[c] : make_uint4(0, 0, 0, 0);
        if constexpr (Type == IndexKeyType::Mxfp8)
          blockScales[i] =
              live ? tileScales[size_t(firstSlot + k) * kBlocks + piece / 2] : uint8_t(0);
      }
      if constexpr (Type == IndexKeyType::Fp8PerKey)
        keyScale = tid < kTileKeys && tileKey + int(tid) <= position
                       ? reinterpret_cast<const float *>(tileScales)[firstSlot + tid]
                       : 0.0f;
      return;
    }
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int c = tid + i * kMmaThreads, k = c / (D / 16), piece = c % (D / 16);
      const int s = tileKey + k;
      codes[i] = make_uint4(0, 0, 0, 0);
      blockScales[i] = 0;
      if (s <= position) {
        const unsigned char *page = pool + table[s / p.pageTokens] * pageBytes;
        const int slot = s % p.pageTokens;
        codes[i] = *reinterpret_cast<const uint4 *>(page + size_t(slot) * D + piece * 16);
        if constexpr (Type == IndexKeyType::Mxfp8)
          blockScales[i] = page[size_t(p.pageTokens) * D + size_t(slot) * kBlocks + piece / 2];
      }
    }
    if constexpr (Type == IndexKeyType::Fp8PerKey) {
      const int s = tileKey + int(tid);
      keyScale = 0.0f;
      if (tid < kTileKeys && s <= position) {
        const unsigned char *page = pool + table[s / p.pageTokens] * pageBytes;
        keyScale = *reinterpret_cast<const float *>(page + size_t(p.pageTokens) * D +
                                                     size_t(s % p.pageTokens) * 4);
      }
    }
  }

  // Into shared memory as bf16: an MXFP8 key's code times its power-of-two block scale is exact
  // in bf16 (for scales above 2^-124); an Fp8PerKey key stays a code, its scale applied to the
  // dot product.
  __device__ __forceinline__ void store(__nv_bfloat16 *keys, float *keyScales, int tid) const {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int c = tid + i * kMmaThreads, k = c / (D / 16), piece = c % (D / 16);
      const float scale = Type == IndexKeyType::Mxfp8 ? e8m0ToFloat(blockScales[i]) : 1.0f;
      const uint32_t words[4] = {codes[i].x, codes[i].y, codes[i].z, codes[i].w};
      uint32_t packed[8];
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          packed[2 * w + h] = e4m3PairToBf16(uint16_t(words[w] >> (16 * h)), scale);
      auto *target = reinterpret_cast<uint4 *>(keys + k * mmaStride<D>() + piece * 16);
      target[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      target[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
    if constexpr (Type == IndexKeyType::Fp8PerKey)
      if (tid < kTileKeys)
        keyScales[tid] = keyScale;
  }
};

// A barrier of the 128 threads of one group (named barrier `id`, 1 or 2; 0 is __syncthreads).
__device__ __forceinline__ void groupSync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(kMmaThreads));
}

// The row's q in shared memory as bf16 hi + lo (four values per load, several loads in flight) and
// its head weights times heads^-1/2, by all `threads` of the block; whether any lo is non-zero.
template <int D>
__device__ __forceinline__ bool stageQuery(const IndexerParams &p, int row, __nv_bfloat16 *qHi,
                                           __nv_bfloat16 *qLo, float *weights, int threads) {
  constexpr int kStride = mmaStride<D>();
  const int heads = p.heads, tid = threadIdx.x;
  const float4 *q = reinterpret_cast<const float4 *>(p.q + size_t(row) * heads * D);
  bool anyLo = false;
  constexpr int kQuads = kMmaMaxHeads * D / 4, kInFlight = 4;
  for (int first = tid; first < kQuads; first += kInFlight * threads) {
    float4 loaded[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = first + u * threads;
      loaded[u] = i < kQuads && i * 4 / D < heads ? q[i] : make_float4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = first + u * threads;
      if (i >= kQuads)
        continue;
      const int j = i * 4 / D, d = i * 4 % D;
      const float values[4] = {loaded[u].x, loaded[u].y, loaded[u].z, loaded[u].w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const __nv_bfloat16 hi = __float2bfloat16_rn(values[c]);
        const __nv_bfloat16 lo = __float2bfloat16_rn(values[c] - __bfloat162float(hi));
        qHi[j * kStride + d + c] = hi;
        qLo[j * kStride + d + c] = lo;
        anyLo |= __bfloat162float(lo) != 0.0f;
      }
    }
  }
  const float headScale = 1.0f / sqrtf(float(heads));
  for (int j = tid; j < kMmaMaxHeads; j += threads)
    weights[j] = j < heads ? p.headWeights[size_t(row) * heads + j] * headScale : 0.0f;
  return __syncthreads_or(anyLo);
}

// The scores of `tiles` key tiles of a row, tile t at firstKey + t * keyStep (those past the row's
// position skipped), by one group of 128 threads (group thread `tid`, named barrier `barrier`)
// with its own key buffer; `next` holds the first tile's keys, loaded. sink(s, score) receives
// the score of each position s <= position.
template <IndexKeyType Type, int D, typename Sink>
__device__ __forceinline__ void scoreTiles(const IndexerParams &p, int64_t pageBytes,
                                           int position, const int32_t *table,
                                           const __nv_bfloat16 *qHi, const __nv_bfloat16 *qLo,
                                           bool useLo, const float *weights,
                                           __nv_bfloat16 *keys, float *keyScales,
                                           KeyTileLoad<Type, D> &next, int firstKey, int keyStep,
                                           int tiles, int tid, int barrier, Sink &&sink) {
  constexpr int kStride = mmaStride<D>();
  const auto *pool = static_cast<const unsigned char *>(p.keyPages);
  const int warp = tid / 32, lane = tid % 32, mTiles = (p.heads + 15) / 16;
  const float dotScale = 1.0f / sqrtf(float(D));
  for (int tile = 0; tile < tiles; ++tile) {
    const int tileKey = firstKey + tile * keyStep;
    if (tileKey > position)
      break;
    groupSync(barrier); // the previous tile's keys are consumed
    next.store(keys, keyScales, tid);
    groupSync(barrier);
    if (tile + 1 < tiles && tileKey + keyStep <= position)
      next.load(p, pool, table, pageBytes, tileKey + keyStep, position, tid); // during the MMAs

    // This warp's 16 keys (two 8-key n-tiles) against every head (m-tiles of 16).
    float acc[4][2][4] = {};
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16) {
      uint32_t b0[2], b1[2];
      mma::loadBPair(b0, b1, keys + warp * 16 * kStride + k0, kStride);
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        if (mt >= mTiles)
          continue;
        uint32_t a[4];
        mma::loadA(a, qHi + mt * 16 * kStride + k0, kStride);
        mma::mma16816(acc[mt][0], a, b0);
        mma::mma16816(acc[mt][1], a, b1);
        if (useLo) {
          mma::loadA(a, qLo + mt * 16 * kStride + k0, kStride);
          mma::mma16816(acc[mt][0], a, b0);
          mma::mma16816(acc[mt][1], a, b1);
        }
      }
    }
    // score[key] = sum over heads of w * ReLU(dot * D^-1/2): this lane's heads, then the 8 lanes
    // that share its key columns.
    float sums[2][2] = {};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float keyScale =
            Type == IndexKeyType::Fp8PerKey ? keyScales[warp * 16 + nt * 8 + mma::accColumn(e)]
                                            : 1.0f;
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
          sums[nt][e & 1] += weights[mt * 16 + mma::accRow(e)] *
                             fmaxf(0.0f, acc[mt][nt][e] * keyScale * dotScale);
      }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int offset = 4; offset < 32; offset *= 2)
          sums[nt][c] += __shfl_xor_sync(0xffffffffu, sums[nt][c], offset);
    if (lane < 4)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int s = tileKey + warp * 16 + nt * 8 + 2 * lane + c;
          if (s <= position)
            sink(s, sums[nt][c]);
        }
  }
}

template <IndexKeyType Type, int D>
__global__ void __launch_bounds__(kMmaThreads, kBlocksPerSm)
    indexerScoresMmaKernel(IndexerParams p, int64_t pageBytes, int tilesPerBlock) {
  static_assert(Type != IndexKeyType::F32, "fp32 keys take the CUDA-core kernel");
  constexpr int kStride = mmaStride<D>();
  extern __shared__ __align__(16) unsigned char smem[];
  auto *qHi = reinterpret_cast<__nv_bfloat16 *>(smem); // [64 heads, kStride]
  __nv_bfloat16 *qLo = qHi + kMmaMaxHeads * kStride;     // [64 heads, kStride]
  __nv_bfloat16 *keys = qLo + kMmaMaxHeads * kStride;    // [kTileKeys, kStride]
  auto *keyScales = reinterpret_cast<float *>(keys + kTileKeys * kStride); // [kTileKeys]
  float *weights = keyScales + kTileKeys;                                  // [64]: w * heads^-1/2
  const int row = blockIdx.x;
  const int position = p.positions[row];
  const int firstKey = int(blockIdx.y) * kTileKeys * tilesPerBlock;
  if (firstKey > position)
    return;
  const int32_t *table = p.blockTables + size_t(p.sequences[row]) * p.maxPages;
  KeyTileLoad<Type, D> next;
  next.load(p, static_cast<const unsigned char *>(p.keyPages), table, pageBytes, firstKey,
            position, threadIdx.x); // in flight while q is staged
  const bool useLo = stageQuery<D>(p, row, qHi, qLo, weights, kMmaThreads);
  float *scores = p.scores + size_t(row) * p.maxKeys;
  scoreTiles<Type, D>(p, pageBytes, position, table, qHi, qLo, useLo, weights, keys, keyScales,
                      next, firstKey, kTileKeys, tilesPerBlock, threadIdx.x, /*barrier=*/1,
                      [&](int s, float score) { scores[s] = score; });
}

// ---- Scores on the FP8 tensor cores (MXFP8 queries): codes straight from the pages.
//
// When the queries are MXFP8-rounded (the policy's indexer Q), both operands are E4M3 codes with
// power-of-two scales per 32 values, one MX block per m16n8k32 MMA: each block's product comes out
// of the tensor cores in fp32 and is scaled by its query and key block scales before it joins the
// sum (Fp8PerKey keys: block scale 1, the key's scale on the dot product). No conversion of the
// keys, half the MMAs of the bf16 form, and the queries' fragments stay in registers: warp w owns
// heads [16w, 16w + 16) for every key of a tile. Key tiles (codes and scales) stream through a
// three-stage cp.async ring; pages must hold a multiple of 64 tokens.
constexpr int kFp8Stages = 3;

template <int D> __host__ __device__ constexpr int fp8RowBytes() { return D + 16; } // no bank conflicts
template <int D> __host__ __device__ constexpr size_t fp8StageBytes() {
  return size_t(kTileKeys) * fp8RowBytes<D>() + size_t(kTileKeys) * 4;
}
template <int D> size_t fp8SharedBytes() {
  return kFp8Stages * fp8StageBytes<D>() + size_t(kMmaMaxHeads) * fp8RowBytes<D>() +
         size_t(4) * kTileKeys * 4 + size_t(kMmaMaxHeads + kTileKeys) * (D / kMxBlock) * 4;
}

// Key bytes a page stores per token after its codes: the MX block scales or the fp32 key scale.
template <IndexKeyType Type, int D> __host__ __device__ constexpr int keyScaleBytes() {
  return Type == IndexKeyType::Mxfp8 ? D / kMxBlock : 4;
}

// One key tile (64 keys from `slot` of pool page `pageIndex`) into a ring `stage` by cp.async,
// codes at fp8RowBytes a key, then the tile's scales: one committed group, empty for a tile the
// block does not score (`live` false). Pages hold a multiple of 64 tokens. A thread copies the
// same piece of every kKeysPerPass-th key, so its offsets are fixed for the block and a tile
// costs one page address and immediate offsets (the per-piece divisions and 64-bit products
// were a quarter of the warpgroup kernel's instructions).
template <IndexKeyType Type, int D> struct KeyTileCopier {
  static constexpr int kRow = fp8RowBytes<D>(), kScaleBytes = keyScaleBytes<Type, D>();
  static constexpr int kPiecesPerKey = D / 16, kKeysPerPass = kMmaThreads / kPiecesPerKey;
  static constexpr int kPasses = kTileKeys / kKeysPerPass;
  static constexpr int kScalePieces = kTileKeys * kScaleBytes / 16;
  static_assert(kMmaThreads % kPiecesPerKey == 0 && kTileKeys % kKeysPerPass == 0, "even passes");
  static_assert(kScalePieces <= kMmaThreads, "one scale piece a thread at most");
  uint32_t stageOffset, pageOffset; // this thread's first piece in the stage and in the tile's rows
  int tid;
  __device__ explicit KeyTileCopier(int thread)
      : stageOffset(uint32_t(thread / kPiecesPerKey * kRow + thread % kPiecesPerKey * 16)),
        pageOffset(uint32_t(thread / kPiecesPerKey * D + thread % kPiecesPerKey * 16)),
        tid(thread) {}
  __device__ __forceinline__ void issue(const unsigned char *pool, int32_t pageIndex, int slot,
                                        int64_t pageBytes, int pageTokens, bool live,
                                        unsigned char *stage) const {
    if (live) {
      const unsigned char *page = pool + pageIndex * pageBytes;
      const unsigned char *rows = page + size_t(slot) * D + pageOffset;
#pragma unroll
      for (int j = 0; j < kPasses; ++j)
        mma::copyAsync16(stage + stageOffset + j * kKeysPerPass * kRow, rows + j * kKeysPerPass * D);
      if (tid < kScalePieces)
        mma::copyAsync16(stage + kTileKeys * kRow + tid * 16,
                         page + size_t(pageTokens) * D + size_t(slot) * kScaleBytes + tid * 16);
    }
    mma::commitAsyncCopies();
  }
};

// Key tile `tile` of a block (keys firstKey + 64 tile ...) into ring stage tile % kFp8Stages.
template <IndexKeyType Type, int D>
__device__ __forceinline__ void issueKeyTile(const IndexerParams &p, const unsigned char *pool,
                                             const int32_t *table, int64_t pageBytes,
                                             int firstKey, int tile, int tilesPerBlock,
                                             int position, unsigned char *stages, int tid) {
  const int tileKey = firstKey + tile * kTileKeys;
  const bool live = tile < tilesPerBlock && tileKey <= position;
  KeyTileCopier<Type, D>(tid).issue(pool, live ? table[tileKey / p.pageTokens] : 0,
                                    tileKey % p.pageTokens, pageBytes, p.pageTokens, live,
                                    stages + (tile % kFp8Stages) * fp8StageBytes<D>());
}

template <IndexKeyType Type, int D>
__global__ void __launch_bounds__(kMmaThreads, kBlocksPerSm)
    indexerScoresFp8Kernel(IndexerParams p, int64_t pageBytes, int tilesPerBlock) {
  static_assert(Type != IndexKeyType::F32, "fp32 keys take the CUDA-core kernel");
  constexpr int kRow = fp8RowBytes<D>(), kBlocks = D / kMxBlock;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char *stages = smem;                                        // [3][codes, scales]
  unsigned char *qCodes = stages + kFp8Stages * fp8StageBytes<D>();    // [64 heads][kRow]
  auto *partials = reinterpret_cast<float *>(qCodes + kMmaMaxHeads * kRow); // [4 warps][64 keys]
  float *qScales = partials + 4 * kTileKeys;                           // [64 heads][kBlocks]
  float *blockScales = qScales + kMmaMaxHeads * kBlocks; // the tile's key block scales, decoded
  const int row = blockIdx.x, heads = p.heads, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, group = lane / 4, pair = lane % 4;
  const int position = p.positions[row];
  const int firstKey = int(blockIdx.y) * kTileKeys * tilesPerBlock;
  if (firstKey > position)
    return;
  const int32_t *table = p.blockTables + size_t(p.sequences[row]) * p.maxPages;
  const auto *pool = static_cast<const unsigned char *>(p.keyPages);

  auto issue = [&](int tile) {
    issueKeyTile<Type, D>(p, pool, table, pageBytes, firstKey, tile, tilesPerBlock, position,
                          stages, tid);
  };
  issue(0);
  issue(1);

  // The queries as E4M3 codes and E8M0 scales (exact: they are MXFP8-rounded): every load in
  // flight at once, eight lanes per 32-value block (a float4 each); then this warp's A fragments
  // and scales into registers.
  const float4 *q = reinterpret_cast<const float4 *>(p.q + size_t(row) * heads * D);
  constexpr int kQuads = kMmaMaxHeads * D / 4, kPerThread = kQuads / kMmaThreads;
  float4 loaded[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = tid + j * kMmaThreads;
    loaded[j] = i * 4 / D < heads ? q[i] : make_float4(0, 0, 0, 0);
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = tid + j * kMmaThreads, head = i * 4 / D, d = i * 4 % D;
    float amax = fmaxf(fmaxf(fabsf(loaded[j].x), fabsf(loaded[j].y)),
                       fmaxf(fabsf(loaded[j].z), fabsf(loaded[j].w)));
#pragma unroll
    for (int offset = 1; offset < 8; offset *= 2) // the 8 lanes of this 32-value block
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const uint8_t scale = quant::mxScaleCodeRoundUp(amax);
    const int shift = -(int(scale) - 127);
    const uint32_t codes = uint32_t(quant::floatToE4M3(ldexpf(loaded[j].x, shift))) |
                           uint32_t(quant::floatToE4M3(ldexpf(loaded[j].y, shift))) << 8 |
                           uint32_t(quant::floatToE4M3(ldexpf(loaded[j].z, shift))) << 16 |
                           uint32_t(quant::floatToE4M3(ldexpf(loaded[j].w, shift))) << 24;
    *reinterpret_cast<uint32_t *>(qCodes + head * kRow + d) = codes;
    if (d % kMxBlock == 0)
      qScales[head * kBlocks + d / kMxBlock] = e8m0ToFloat(scale);
  }
  const float headScale = 1.0f / sqrtf(float(heads)), dotScale = 1.0f / sqrtf(float(D));
  const int head0 = warp * 16 + group, head1 = head0 + 8;
  const float weight0 = head0 < heads ? p.headWeights[size_t(row) * heads + head0] * headScale : 0.0f;
  const float weight1 = head1 < heads ? p.headWeights[size_t(row) * heads + head1] * headScale : 0.0f;
  __syncthreads();
  uint32_t a[kBlocks][4];
  float scale0[kBlocks], scale1[kBlocks];
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    const unsigned char *base = qCodes + b * kMxBlock + pair * 4;
    a[b][0] = *reinterpret_cast<const uint32_t *>(base + head0 * kRow);
    a[b][1] = *reinterpret_cast<const uint32_t *>(base + head1 * kRow);
    a[b][2] = *reinterpret_cast<const uint32_t *>(base + head0 * kRow + 16);
    a[b][3] = *reinterpret_cast<const uint32_t *>(base + head1 * kRow + 16);
    scale0[b] = qScales[head0 * kBlocks + b];
    scale1[b] = qScales[head1 * kBlocks + b];
  }
  const bool active = warp * 16 < heads;

  for (int tile = 0; tile < tilesPerBlock; ++tile) {
    const int tileKey = firstKey + tile * kTileKeys;
    if (tileKey > position)
      break;
    mma::waitAsyncCopies<1>(); // this tile's group has landed
    __syncthreads();           // for every thread; the stage refilled next was consumed
    issue(tile + 2);
    const unsigned char *codes = stages + (tile % kFp8Stages) * fp8StageBytes<D>();
    const unsigned char *keyScales = codes + kTileKeys * kRow;
    if constexpr (Type == IndexKeyType::Mxfp8) { // decoded once, not by every lane that uses it
      for (int i = tid; i < kTileKeys * kBlocks; i += kMmaThreads)
        blockScales[i] = e8m0ToFloat(keyScales[i]);
      __syncthreads();
    }
    float sums[8][2] = {};
    if (active) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int key0 = n * 8 + 2 * pair; // this lane's two key columns
        float acc[4] = {};
#pragma unroll
        for (int b = 0; b < kBlocks; ++b) {
          const unsigned char *column = codes + (n * 8 + group) * kRow + b * kMxBlock + pair * 4;
          const uint32_t bFragment[2] = {*reinterpret_cast<const uint32_t *>(column),
                                         *reinterpret_cast<const uint32_t *>(column + 16)};
          float product[4];
          mma::mmaE4m3(product, a[b], bFragment);
          float k0 = 1.0f, k1 = 1.0f;
          if constexpr (Type == IndexKeyType::Mxfp8) {
            k0 = blockScales[key0 * kBlocks + b];
            k1 = blockScales[(key0 + 1) * kBlocks + b];
          }
          acc[0] = fmaf(product[0], scale0[b] * k0, acc[0]);
          acc[1] = fmaf(product[1], scale0[b] * k1, acc[1]);
          acc[2] = fmaf(product[2], scale1[b] * k0, acc[2]);
          acc[3] = fmaf(product[3], scale1[b] * k1, acc[3]);
        }
        float key0Scale = 1.0f, key1Scale = 1.0f;
        if constexpr (Type == IndexKeyType::Fp8PerKey) {
          key0Scale = reinterpret_cast<const float *>(keyScales)[key0];
          key1Scale = reinterpret_cast<const float *>(keyScales)[key0 + 1];
        }
        sums[n][0] = weight0 * fmaxf(0.0f, acc[0] * key0Scale * dotScale) +
                     weight1 * fmaxf(0.0f, acc[2] * key0Scale * dotScale);
        sums[n][1] = weight0 * fmaxf(0.0f, acc[1] * key1Scale * dotScale) +
                     weight1 * fmaxf(0.0f, acc[3] * key1Scale * dotScale);
      }
      // Over the 8 lane groups (this warp's 16 heads); lanes 0-3 keep the sums.
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int offset = 4; offset < 32; offset *= 2)
            sums[n][c] += __shfl_xor_sync(0xffffffffu, sums[n][c], offset);
    }
    if (lane < 4)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          partials[warp * kTileKeys + n * 8 + 2 * lane + c] = sums[n][c];
    __syncthreads();
    if (tid < kTileKeys) { // over the warps' heads, in warp order
      const int s = tileKey + tid;
      if (s <= position)
        p.scores[size_t(row) * p.maxKeys + s] = partials[tid] + partials[kTileKeys + tid] +
                                                 partials[2 * kTileKeys + tid] +
                                                 partials[3 * kTileKeys + tid];
    }
  }
  mma::waitAsyncCopies<0>(); // nothing in flight when the block ends
}

// Larger float -> larger unsigned key.
__device__ inline uint32_t orderKey(float value) {
  const uint32_t bits = __float_as_uint(value);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// ---- Top-k: a radix select spread over many blocks per row, in few launches.
//
// The selection key of a position is its score's order-preserving bits. Three digits of 11, 11
// and 10 bits from the top: a histogram pass over the row's chunks (many blocks, shared-memory
// histograms flushed into the row's global one) whose last block to finish finds the digit where
// the count from the top reaches the keys still wanted; the warpgroup scores kernel makes the
// first digit's histogram itself, as it writes the scores. The result is the k-th largest key T
// and how many of the keys equal to T to take (ref::topKIndices' rule: the lowest positions); a
// write pass then puts each chunk's keys above T and its share of the ties at its offset in
// position order, the offset summed from the counts the chunks before it publish in the same
// launch. (Ten launches before, with a separate digit pass per digit and a count pass: at batch
// 1 the launches, not the bytes, were the select's time.)
constexpr int kHistogramThreads = 256;
constexpr int kChunkKeys = 2048;  // positions per histogram block
constexpr int kMaxDigitBits = 11;
constexpr int kSelectBins = 1 << kMaxDigitBits;
constexpr int kFirstDigitShift = 32 - kMaxDigitBits;

struct SelectState {
  uint32_t prefix;   // the digits chosen so far, in place
  uint32_t mask;
  int remaining;     // keys still to take below the prefix's digits; at the end, ties at T taken
  uint32_t arrivals; // blocks of the current digit's histogram done (the last one chooses)
};

// The select's workspace (indexerSelectWorkspaceBytes, 16-byte aligned): per row the warpgroup
// kernel's queries (f16, each head scaled by a power of two, swizzled; made once per row by the
// reset kernel) and the heads' inverse scales, a state and a histogram; per chunk its published
// counts and its place; the write pass's ticket counter; and each row's gathered candidates (a
// word a key of the capacity).
struct SelectWorkspace {
  unsigned char *queries; // rows x kSelectQueryBytes
  float *headScales;      // rows x kMmaMaxHeads: 2^-shift of each head's queries
  SelectState *states;
  uint32_t *histograms;   // rows x kSelectBins
  uint64_t *chunkCounts;  // rows x chunks: the launch a digit's (kPublished | above T, at T) or
                          // the gathered forms' (above the first digit's bin, candidates)
  uint64_t *places;       // rows x chunks: the gathered forms' place words (packPlace)
  uint32_t *writeTickets; // one word
  uint32_t *candidates;   // candidateRows x maxKeys: each chunk's gathered words (gatherChunk)
};
constexpr uint64_t kPublished = 1ull << 63;
constexpr int kCountBits = 24; // a chunk's count of keys above T (or at T) fits: <= kChunkKeys
constexpr size_t kSelectQueryBytes = size_t(kMmaMaxHeads) * 128 * 2; // the largest head dim

__host__ __device__ inline int selectChunks(int32_t maxKeys) {
  return (maxKeys + kChunkKeys - 1) / kChunkKeys;
}

// The candidates' rows the workspace holds: every row for SelectForm::Gathered; else the rows a
// one-launch grid (at most kOneLaunchMaxBlocks 2048-key chunks) may take, so the workspace for
// `rows` rows also holds that of fewer and the workspace form Auto sizes stays small (a word a
// key for every row would double the scores' workspace).
constexpr int kOneLaunchMaxBlocks = 1024;
__host__ __device__ inline int candidateRows(int rows, int32_t maxKeys, bool everyRow) {
  return everyRow ? rows : min(rows, kOneLaunchMaxBlocks / selectChunks(maxKeys));
}

// Byte offsets of the workspace's parts; the last is the total.
struct SelectLayout {
  size_t headScales, states, histograms, chunkCounts, places, writeTickets, candidates, total;
};
__host__ __device__ inline SelectLayout selectLayout(int rows, int maxKeys,
                                                     bool everyRowsCandidates = false) {
  SelectLayout l;
  l.headScales = size_t(rows) * kSelectQueryBytes;
  l.states = l.headScales + size_t(rows) * kMmaMaxHeads * sizeof(float);
  l.histograms = l.states + size_t(rows) * sizeof(SelectState);
  l.chunkCounts = l.histograms + size_t(rows) * kSelectBins * sizeof(uint32_t);
  l.places = l.chunkCounts + size_t(rows) * selectChunks(maxKeys) * sizeof(uint64_t);
  l.writeTickets = l.places + size_t(rows) * selectChunks(maxKeys) * sizeof(uint64_t);
  l.candidates = l.writeTickets + 16;
  l.total = l.candidates +
            size_t(candidateRows(rows, maxKeys, everyRowsCandidates)) * maxKeys * sizeof(uint32_t);
  return l;
}

inline SelectWorkspace selectWorkspace(void *base, int rows, int maxKeys) {
  auto *bytes = static_cast<unsigned char *>(base);
  const SelectLayout l = selectLayout(rows, maxKeys);
  return SelectWorkspace{bytes,
                         reinterpret_cast<float *>(bytes + l.headScales),
                         reinterpret_cast<SelectState *>(bytes + l.states),
                         reinterpret_cast<uint32_t *>(bytes + l.histograms),
                         reinterpret_cast<uint64_t *>(bytes + l.chunkCounts),
                         reinterpret_cast<uint64_t *>(bytes + l.places),
                         reinterpret_cast<uint32_t *>(bytes + l.writeTickets),
                         reinterpret_cast<uint32_t *>(bytes + l.candidates)};
}

// Exclusive prefix of `value` over the block's kThreads threads in thread order, and the block's
// total (warpSums: one word per warp).
template <int kThreads = kHistogramThreads>
__device__ inline int blockExclusiveScan(int value, int *warpSums, int &total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int lower = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset)
      inclusive += lower;
  }
  __syncthreads(); // warpSums may still be read by a previous scan
  if (lane == 31)
    warpSums[warp] = inclusive;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    before += w < warp ? warpSums[w] : 0;
    total += warpSums[w];
  }
  return before + inclusive - value;
}

// The row's digit at `shift` from its complete histogram (a global one read through L2: other
// blocks' atomics filled it; or this block's own in shared memory): the bin where the count from
// the top reaches the keys still wanted. Each thread holds its own run of bins in registers; a
// suffix sum over threads finds the one whose bins hold the crossing, and it walks them from the
// top. Leaves the histogram zero for the next digit.
template <int kThreads, bool kShared = false>
__device__ void chooseDigit(SelectState &state, uint32_t *histogram, int shift, int bits,
                            uint32_t *warpTotals) {
  constexpr int kWarps = kThreads / 32, kMaxPerThread = kSelectBins / kThreads;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int bins = 1 << bits, perThread = (bins + kThreads - 1) / kThreads;
  const int remaining = state.remaining;
  uint32_t counts[kMaxPerThread], own = 0;
#pragma unroll
  for (int b = 0; b < kMaxPerThread; ++b) {
    const int bin = tid * perThread + b;
    counts[b] =
        b < perThread && bin < bins ? (kShared ? histogram[bin] : __ldcg(histogram + bin)) : 0u;
    own += counts[b];
  }
  uint32_t suffix = own;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const uint32_t higher = __shfl_down_sync(0xffffffffu, suffix, offset);
    if (lane + offset < 32)
      suffix += higher;
  }
  if (lane == 0)
    warpTotals[warp] = suffix;
  __syncthreads();
  for (int w = warp + 1; w < kWarps; ++w)
    suffix += warpTotals[w];
  if (suffix >= uint32_t(remaining) && suffix - own < uint32_t(remaining)) {
    uint32_t above = suffix - own; // keys in the bins above this thread's
    int chosen = 0;
    bool found = false;
#pragma unroll
    for (int b = kMaxPerThread - 1; b >= 0; --b) // from the top (bins past `bins` hold 0)
      if (!found) {
        if (above + counts[b] >= uint32_t(remaining)) {
          chosen = b;
          found = true;
        } else {
          above += counts[b];
        }
      }
    state.prefix |= uint32_t(tid * perThread + chosen) << shift;
    state.mask |= uint32_t(bins - 1) << shift;
    state.remaining = remaining - int(above);
  }
  __syncthreads(); // the histogram is read before it is cleared for the next digit
  for (int b = tid; b < bins; b += kThreads)
    histogram[b] = 0;
  if (tid == 0)
    state.arrivals = 0;
}

// A block's share of a row's digit histogram (`local`, in shared memory) into the row's, then
// the row's last block (of `liveBlocks`, arriveLast) chooses the digit.
template <int kThreads>
__device__ void flushHistogramAndChoose(const uint32_t *local, SelectState &state,
                                        uint32_t *global, unsigned liveBlocks, int shift,
                                        int bits, uint32_t *warpTotals, bool &last) {
  __syncthreads(); // every key of the block counted
  for (int b = threadIdx.x; b < (1 << bits); b += kThreads)
    if (local[b])
      atomicAdd(&global[b], local[b]);
  __syncthreads();
  if (threadIdx.x == 0)
    last = arriveLast(&state.arrivals, liveBlocks);
  __syncthreads();
  if (!last)
    return;
  chooseDigit<kThreads>(state, global, shift, bits, warpTotals);
}

// A warpgroup scores block's walk over its tiles' pages. Tiles are issued in order and never
// straddle a page (pages hold a multiple of 64 tokens), so the page entry and slot advance by
// counting, not dividing; each tile's table entry is loaded a tile before its copies are issued.
struct TilePageWalk {
  const int32_t *table;
  int entry, slot, pageTokens, firstKey, tilesPerBlock, position;
  __device__ TilePageWalk(const IndexerParams &p, int row, int first, int tiles, int last)
      : table(p.blockTables + size_t(p.sequences[row]) * p.maxPages), entry(first / p.pageTokens),
        slot(first % p.pageTokens), pageTokens(p.pageTokens), firstKey(first), tilesPerBlock(tiles),
        position(last) {}
  __device__ bool live(int tile) const {
    return tile < tilesPerBlock && firstKey + tile * kTileKeys <= position;
  }
  // The next tile's (`tile`'s) page, 0 for a dead tile, and its first slot.
  __device__ void lookUp(int tile, int &page, int &pageSlot) {
    page = live(tile) ? __ldg(table + entry) : 0;
    pageSlot = slot;
    slot += kTileKeys;
    if (slot == pageTokens) {
      slot = 0;
      ++entry;
    }
  }
};

// A warpgroup scores block's share of its row's first-digit histogram (kFirstDigitShift, in
// shared memory), kept when the row has more keys than it selects: zeroed here, counted by
// storeWeightedReluSums, added to the row's by flush (whose last block then chooses the digit).
struct FirstDigitCount {
  uint32_t *histogram;
  bool counting;
  __device__ FirstDigitCount(uint32_t *shared, const IndexerParams &p, int position)
      : histogram(shared), counting(position + 1 > p.topK) {
    for (int b = threadIdx.x; b < kSelectBins; b += kMmaThreads)
      histogram[b] = 0;
  }
  __device__ void flush(const SelectWorkspace &select, int row, int position, int tilesPerBlock,
                        uint32_t *warpTotals, bool &last) const {
    if (!counting)
      return;
    const int blockKeys = kTileKeys * tilesPerBlock;
    flushHistogramAndChoose<kMmaThreads>(histogram, select.states[row],
                                         select.histograms + size_t(row) * kSelectBins,
                                         unsigned((position + blockKeys) / blockKeys),
                                         kFirstDigitShift, kMaxDigitBits, warpTotals, last);
  }
};

// This thread's 16 heads' weights of a warpgroup tile (heads 8j + 2t + c at 2j + c): w *
// heads^-1/2 * D^-1/2 times the head's query scale from the reset kernel (the ReLU commutes with
// a positive scale); 0 past the row's heads.
template <int D>
__device__ void warpgroupHeadWeights(const IndexerParams &p, const SelectWorkspace &select, int row,
                                     int t, float (&weights)[16]) {
  const float weightScale = 1.0f / (sqrtf(float(p.heads)) * sqrtf(float(D)));
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int h = 8 * j + 2 * t + c;
      weights[2 * j + c] = h < p.heads ? p.headWeights[size_t(row) * p.heads + h] * weightScale *
                                             select.headScales[size_t(row) * kMmaMaxHeads + h]
                                       : 0.0f;
    }
}

// A warpgroup tile's scores from its m64n64 accumulators (keys x heads: this thread's keys `key`
// and key + 8, heads 8j + 2t + c at acc[4j + 2r + c] for its key r, weights[2j + c]): score[key] =
// the key's scale times the sum over heads of w' * ReLU(dot), this lane's 16 heads, then its
// quad's. Lanes t = 0, 1 of the quad store key + 8t (up to `position`) and, when `histogramming`,
// count it in the block's first-digit histogram.
__device__ __forceinline__ void storeWeightedReluSums(const float (&acc)[32],
                                                      const float (&weights)[16],
                                                      const float (&keyScale)[2], int key,
                                                      int position, bool histogramming,
                                                      float *scores, uint32_t *histogram) {
  // Four independent partial sums a key, so the FMAs do not wait on each other.
  float partial[2][4] = {};
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      partial[e / 2][(j % 2) * 2 + (e & 1)] =
          fmaf(weights[2 * j + (e & 1)], fmaxf(0.0f, acc[4 * j + e]),
               partial[e / 2][(j % 2) * 2 + (e & 1)]);
  float sums[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sums[r] = (partial[r][0] + partial[r][1]) + (partial[r][2] + partial[r][3]);
    sums[r] += __shfl_xor_sync(0xffffffffu, sums[r], 1);
    sums[r] += __shfl_xor_sync(0xffffffffu, sums[r], 2);
  }
  const int t = threadIdx.x % 4;
  if (t < 2) {
    const int s = key + 8 * t;
    if (s <= position) {
      const float score = t == 0 ? sums[0] * keyScale[0] : sums[1] * keyScale[1];
      scores[s] = score;
      if (histogramming)
        atomicAdd(&histogram[orderKey(score) >> kFirstDigitShift], 1u);
    }
  }
}

// ---- Scores on the warpgroup tensor cores (sm_90a wgmma; MXFP8 queries): keys widened in
// registers.
//
// The keys are the A operand of m64n64k16 f16 wgmmas (fp32 accumulate), 64 keys a tile (16 a warp)
// straight from registers: each thread widens its own codes to f16 by the hardware converter (one
// instruction a code pair, exact: every E4M3 value is an f16), so the widened keys never go back
// through shared memory, and the 64 heads' queries are the B operand, swizzled in shared memory
// once per block. A dot product does not care in which order the dimensions are summed, so the k
// order is permuted: lane t of a lane quad holds bytes [t D/4, (t+1) D/4) of its two keys (one
// contiguous run inside one MX block, so one scale) and the queries are stored in the same
// permuted order. The accumulators are keys x heads: a thread holds 16 heads of two keys, so the
// head sum is a sum in registers plus two shuffles. Versus the FP8 mma.sync form: no per-block
// rescaling of every (key, head) product and a quarter of the instructions per key. Key tiles
// stream through the same cp.async ring (issueKeyTile).
//
// f16's range is small, so the powers of two move out of the operands, exactly: an MXFP8 key's
// codes are multiplied (one packed f16 multiply a pair) by 2^(block scale - its reference), the
// reference being the key's largest block scale less 7 (so 448 * 2^7 at most), and the
// reference's power of two multiplies the key's score (the ReLU commutes with a positive scale).
// Exact for every block within 2^22 of the key's largest; a block further below would have its
// smallest codes rounded to f16's subnormals (Fp8PerKey keys are plain codes: no multiply). The
// queries (MXFP8 values) are scaled per head by the power of two that puts the head's largest |q|
// in [2^14, 2^15), the inverse going on the head's weight: exact unless a head's values span more
// than 2^35 or lie below 2^-86. The scores are then those of the unscaled product, rounding
// included. (bf16 needed no scaling but three bit moves a pair besides the multiply: 391 against
// 301 warp instructions a tile, 2.5-5% slower at batch 8-64, docs/performance.md, 2026-11-30.)
constexpr int kWarpgroupBlocksPerSm = 4;

template <int D> __host__ __device__ constexpr uint32_t warpgroupQueryBytes() {
  return uint32_t(kMmaMaxHeads) * D * 2; // 64 heads x D f16, 128-byte swizzled
}
static_assert(warpgroupQueryBytes<128>() == kSelectQueryBytes,
              "the reset kernel lays out a row's queries for the largest head dim");
template <int D> size_t warpgroupSharedBytes() {
  return 1024 + warpgroupQueryBytes<D>() + kFp8Stages * fp8StageBytes<D>() + // + alignment slack
         kSelectBins * sizeof(uint32_t);                                       // the histogram
}

// The permuted k position of dimension `column`: lane quad member t holds dimensions
// [t D/4, (t+1) D/4), four per k step of 16, in the A fragment's columns 2t, 2t + 1, 2t + 8,
// 2t + 9.
template <int D> __device__ __forceinline__ int permutedColumn(int column) {
  const int t = column / (D / 4), within = column % (D / 4), step = within / 4, j = within % 4;
  return 16 * step + 2 * t + (j < 2 ? j : j + 6);
}

template <IndexKeyType Type, int D>
__global__ void __launch_bounds__(kMmaThreads, kWarpgroupBlocksPerSm)
    indexerScoresWarpgroupKernel(IndexerParams p, int64_t pageBytes, int tilesPerBlock,
                                 SelectWorkspace select) {
  static_assert(Type != IndexKeyType::F32, "fp32 keys take the CUDA-core kernel");
  constexpr int kRow = fp8RowBytes<D>(), kSteps = D / 16, kRun = D / 4; // kRun bytes a lane
  extern __shared__ __align__(16) unsigned char rawShared[];
  // The swizzled queries need 1024-byte aligned chunks.
  unsigned char *smem = rawShared + ((1024 - mma::sharedAddress(rawShared) % 1024) % 1024);
  unsigned char *queries = smem;                                 // [64 heads][D] bf16, swizzled
  unsigned char *stages = smem + warpgroupQueryBytes<D>();       // [3][codes, scales]
  auto *histogram = reinterpret_cast<uint32_t *>(stages + kFp8Stages * fp8StageBytes<D>());
  __shared__ uint32_t warpTotals[kMmaThreads / 32];
  __shared__ bool last;
  const int row = blockIdx.x, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, t = lane % 4;
  const int key0 = 16 * warp + lane / 4; // this thread's keys key0 and key0 + 8 of a tile
  const int position = p.positions[row];
  const int firstKey = int(blockIdx.y) * kTileKeys * tilesPerBlock;
  if (firstKey > position)
    return;
  const auto *pool = static_cast<const unsigned char *>(p.keyPages);
  TilePageWalk walk(p, row, firstKey, tilesPerBlock, position);
  auto live = [&](int tile) { return walk.live(tile); };
  auto lookUp = [&](int tile, int &page, int &pageSlot) { walk.lookUp(tile, page, pageSlot); };
  // The row's queries, prepared by the reset kernel, land with the first tile.
  const unsigned char *rowQueries = select.queries + size_t(row) * kSelectQueryBytes;
  for (int c = tid; c < int(warpgroupQueryBytes<D>() / 16); c += kMmaThreads)
    mma::copyAsync16(queries + 16 * c, rowQueries + 16 * c);
  const KeyTileCopier<Type, D> copier(tid);
  auto issue = [&](int tile, int page, int pageSlot) {
    copier.issue(pool, page, pageSlot, pageBytes, p.pageTokens, live(tile),
                 stages + (tile % kFp8Stages) * fp8StageBytes<D>());
  };
  int page, pageSlot;
  lookUp(0, page, pageSlot);
  issue(0, page, pageSlot);
  lookUp(1, page, pageSlot);
  issue(1, page, pageSlot);
  lookUp(2, page, pageSlot); // the next tile issued

  // The first digit's histogram of the top-k (kFirstDigitShift), when the row has more keys than
  // it selects.
  const FirstDigitCount firstDigit(histogram, p, position);
  float weights[16];
  warpgroupHeadWeights<D>(p, select, row, t, weights);
  const uint64_t queryDescriptor = wgmma::descriptor(mma::sharedAddress(queries));
  float *scores = p.scores + size_t(row) * p.maxKeys;

  // The tile's keys landed for every thread (and the queries, the first time round: made visible
  // to the wgmmas' async proxy); the stage refilled next was consumed.
  auto arrive = [&](int tile) {
    mma::waitAsyncCopies<1>();
    if (tile == 0)
      wgmma::sharedWritesToAsyncProxy();
    __syncthreads();
    issue(tile + 2, page, pageSlot);
    lookUp(tile + 3, page, pageSlot);
  };
  // This lane's run of each of its two keys (the codes of every k step), the factor of its block
  // and the keys' scales.
  struct TileCodes {
    uint32_t words[2][kSteps];
    uint32_t factor[2]; // MXFP8: 2^(block scale code - the key's reference) as an f16 pair
  };
  auto load = [&](int tile, TileCodes &c, float (&keyScale)[2]) {
    const unsigned char *codes = stages + (tile % kFp8Stages) * fp8StageBytes<D>();
    const unsigned char *keyScales = codes + kTileKeys * kRow;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key0 + 8 * r;
#pragma unroll
      for (int v = 0; v < kRun / 16; ++v) {
        const uint4 piece = *reinterpret_cast<const uint4 *>(codes + key * kRow + t * kRun + 16 * v);
        c.words[r][4 * v] = piece.x;
        c.words[r][4 * v + 1] = piece.y;
        c.words[r][4 * v + 2] = piece.z;
        c.words[r][4 * v + 3] = piece.w;
      }
      if constexpr (Type == IndexKeyType::Mxfp8) {
        // The key's reference: its largest block scale code (over the lane quad) less 7, at least
        // 1 (a normal float); 0xFF (NaN) makes the key's scale NaN, as e8m0ToFloat would.
        const uint32_t code = keyScales[key * (D / kMxBlock) + t * kRun / kMxBlock];
        uint32_t top = max(code, __shfl_xor_sync(0xffffffffu, code, 1));
        top = max(top, __shfl_xor_sync(0xffffffffu, top, 2));
        const int reference = int(max(top, 8u)) - 7;
        keyScale[r] =
            top == 0xFFu ? __uint_as_float(0x7fc00000u) : __int_as_float(reference << 23);
        c.factor[r] = f16PowerOfTwoPair(int(code) - reference);
      } else {
        keyScale[r] = reinterpret_cast<const float *>(keyScales)[key];
      }
    }
  };
  // The k steps [first, last) widened into their A fragments (fragment registers: row key0, then
  // key0 + 8).
  auto widen = [&](const TileCodes &c, uint32_t (&a)[kSteps][4], int first, int last) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int s = first; s < last; ++s) {
        e4m3QuadToF16(c.words[r][s], a[s][r], a[s][2 + r]);
        if constexpr (Type == IndexKeyType::Mxfp8) {
          a[s][r] = f16PairProduct(a[s][r], c.factor[r]);
          a[s][2 + r] = f16PairProduct(a[s][2 + r], c.factor[r]);
        }
      }
  };
  // The wgmmas of k steps [first, last), one commit group; the A registers they read stay
  // untouched until the wait.
  auto multiply = [&](const uint32_t(&a)[kSteps][4], float(&acc)[32], int first, int last) {
    wgmma::fence();
#pragma unroll
    for (int s = first; s < last; ++s)
      wgmma::mma64x64RegisterAF16(acc, a[s], queryDescriptor + (s / 4 * 64 * 128 + s % 4 * 32) / 16,
                                  /*accumulate=*/s > 0);
    wgmma::commit();
    wgmma::fenceOperands(acc);
  };
  auto finish = [&](int tile, float (&acc)[32], const float (&keyScale)[2]) {
    wgmma::fenceOperands(acc);
    storeWeightedReluSums(acc, weights, keyScale, firstKey + tile * kTileKeys + key0, position,
                          firstDigit.counting, scores, histogram);
  };

  // One tile in flight a warpgroup: carrying a second tile's fragments and accumulators (to
  // widen it during the first's MMAs) takes 156 registers, 3 blocks an SM, and measured 22% slower
  // on the H200 (batch 64 x 128K) than 4 blocks of this form.
  // Within a tile, the second half of the k steps is widened while the first half's wgmmas run
  // (their A registers are the first half's, so nothing they read changes).
  for (int tile = 0; live(tile); ++tile) {
    uint32_t a[kSteps][4];
    float acc[32], keyScale[2];
    TileCodes codes;
    arrive(tile);
    load(tile, codes, keyScale);
    widen(codes, a, 0, kSteps / 2);
    multiply(a, acc, 0, kSteps / 2);
    widen(codes, a, kSteps / 2, kSteps);
    multiply(a, acc, kSteps / 2, kSteps);
    wgmma::wait<0>();
    finish(tile, acc, keyScale);
  }
  mma::waitAsyncCopies<0>(); // nothing in flight when the block ends
  firstDigit.flush(select, row, position, tilesPerBlock, warpTotals, last);
}

// ---- Scores on FP8 warpgroup MMAs: Fp8PerKey keys against queries that are E4M3 codes times one
// power of two a head (DeepSeek-V3.2's own FP8 indexer, MODEL_SPEC 4.3; IndexerParams::
// fp8HeadQueries), head dim 128.
//
// Both operands are E4M3 in shared memory, K-major and 128-byte swizzled: the keys' tile as it
// lands (each 16-byte piece of a key's 128-byte row copied to its swizzled place), the queries
// prepared once a row by the reset kernel (codes = q / 2^e, e the smallest power with the head's
// largest |q| <= 448 * 2^e, exact for any such q; 2^e on the head's weight). A tile is four
// m64n64k32 wgmmas with nothing converted in registers: against the f16 kernel no widening (64 of
// its ~300 warp instructions a tile) and half the tensor-core time, and 44 KB of shared memory a
// block (no padded rows, 8 KB queries), so five blocks an SM. The key's fp32 scale multiplies
// its score, as the reference's k_s[s]. Precision: the products of two E4M3 codes are exact, but
// Hopper's FP8 MMAs add them with about 13 mantissa bits, and a head's four k steps chain in the
// accumulator (as DeepGEMM's fp8_mqa_logits): a score is off by up to ~2^-11 of the sum of its
// products' magnitudes (measured ~1e-4 relative), where the f16 kernel's sums are exact fp32 ones
// (ScoreKernel::Warpgroup keeps that for these queries too).
constexpr int kFp8WarpgroupBlocksPerSm = 5;
constexpr uint32_t kFp8KeyTileBytes = uint32_t(kTileKeys) * 128; // 64 keys x 128 codes, swizzled
constexpr uint32_t kFp8WarpgroupStageBytes = kFp8KeyTileBytes + 1024; // + the keys' scales
constexpr uint32_t kFp8QueryBytes = uint32_t(kMmaMaxHeads) * 128;     // 64 heads x 128 codes
size_t fp8WarpgroupSharedBytes() {
  return 1024 + kFp8QueryBytes + kFp8Stages * kFp8WarpgroupStageBytes + // + alignment slack
         kSelectBins * sizeof(uint32_t);                                // the histogram
}

// Byte `column` of row `row` in a 128-byte swizzled K-major operand of 128-byte rows (the 16-byte
// unit u of row r at u ^ (r % 8), as warpgroup_mma.cuh's layout).
__host__ __device__ constexpr uint32_t swizzledByte(int row, int column) {
  return uint32_t(row * 128 + (((column / 16) ^ (row % 8)) * 16) + column % 16);
}

// One key tile's copies: thread `tid` copies piece tid % 8 of keys tid / 8 + 16 j (j < 4) to
// their swizzled places (the same unit index for all four: 16 j leaves the key's row % 8), and
// threads below 16 the tile's 64 fp32 scales; one committed group, empty for a dead tile.
struct SwizzledKeyTileCopier {
  uint32_t stageOffset, pageOffset;
  int tid;
  __device__ explicit SwizzledKeyTileCopier(int thread)
      : stageOffset(swizzledByte(thread / 8, thread % 8 * 16)),
        pageOffset(uint32_t(thread / 8 * 128 + thread % 8 * 16)), tid(thread) {}
  __device__ __forceinline__ void issue(const unsigned char *pool, int32_t pageIndex, int slot,
                                        int64_t pageBytes, int pageTokens, bool live,
                                        unsigned char *stage) const {
    if (live) {
      const unsigned char *page = pool + pageIndex * pageBytes;
      const unsigned char *rows = page + size_t(slot) * 128 + pageOffset;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        mma::copyAsync16(stage + stageOffset + j * 16 * 128, rows + j * 16 * 128);
      if (tid < kTileKeys * 4 / 16)
        mma::copyAsync16(stage + kFp8KeyTileBytes + tid * 16,
                         page + size_t(pageTokens) * 128 + size_t(slot) * 4 + tid * 16);
    }
    mma::commitAsyncCopies();
  }
};
static_assert(kMmaThreads == 128 && kTileKeys == 64, "8 pieces x 16 keys a pass, 4 passes");

__global__ void __launch_bounds__(kMmaThreads, kFp8WarpgroupBlocksPerSm)
    indexerScoresFp8WarpgroupKernel(IndexerParams p, int64_t pageBytes, int tilesPerBlock,
                                    SelectWorkspace select) {
  constexpr int D = 128;
  extern __shared__ __align__(16) unsigned char rawShared[];
  // wgmma's swizzled operands need 1024-byte aligned 8-row groups.
  unsigned char *smem = rawShared + ((1024 - mma::sharedAddress(rawShared) % 1024) % 1024);
  unsigned char *queries = smem;                 // [64 heads][128] E4M3, swizzled
  unsigned char *stages = smem + kFp8QueryBytes; // [3][keys' codes (swizzled), scales]
  auto *histogram = reinterpret_cast<uint32_t *>(stages + kFp8Stages * kFp8WarpgroupStageBytes);
  __shared__ uint32_t warpTotals[kMmaThreads / 32];
  __shared__ bool last;
  const int row = blockIdx.x, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, t = lane % 4;
  const int key0 = 16 * warp + lane / 4; // this thread's keys key0 and key0 + 8 of a tile
  const int position = p.positions[row];
  const int firstKey = int(blockIdx.y) * kTileKeys * tilesPerBlock;
  if (firstKey > position)
    return;
  const auto *pool = static_cast<const unsigned char *>(p.keyPages);
  TilePageWalk walk(p, row, firstKey, tilesPerBlock, position);
  auto live = [&](int tile) { return walk.live(tile); };
  auto lookUp = [&](int tile, int &page, int &pageSlot) { walk.lookUp(tile, page, pageSlot); };
  const unsigned char *rowQueries = select.queries + size_t(row) * kSelectQueryBytes;
  for (int c = tid; c < int(kFp8QueryBytes / 16); c += kMmaThreads)
    mma::copyAsync16(queries + 16 * c, rowQueries + 16 * c);
  const SwizzledKeyTileCopier copier(tid);
  auto issue = [&](int tile, int page, int pageSlot) {
    copier.issue(pool, page, pageSlot, pageBytes, p.pageTokens, live(tile),
                 stages + (tile % kFp8Stages) * kFp8WarpgroupStageBytes);
  };
  int page, pageSlot;
  lookUp(0, page, pageSlot);
  issue(0, page, pageSlot);
  lookUp(1, page, pageSlot);
  issue(1, page, pageSlot);
  lookUp(2, page, pageSlot);

  const FirstDigitCount firstDigit(histogram, p, position);
  float weights[16];
  warpgroupHeadWeights<D>(p, select, row, t, weights);
  const uint64_t queryDescriptor = wgmma::descriptor(mma::sharedAddress(queries));
  float *scores = p.scores + size_t(row) * p.maxKeys;

  for (int tile = 0; live(tile); ++tile) {
    // The tile's copies (and the queries, the first time round) landed for every thread and are
    // visible to the wgmmas' async proxy; the stage refilled next was consumed.
    mma::waitAsyncCopies<1>();
    wgmma::sharedWritesToAsyncProxy();
    __syncthreads();
    issue(tile + 2, page, pageSlot);
    lookUp(tile + 3, page, pageSlot);
    const unsigned char *stage = stages + (tile % kFp8Stages) * kFp8WarpgroupStageBytes;
    const auto *keyScales = reinterpret_cast<const float *>(stage + kFp8KeyTileBytes);
    const float keyScale[2] = {keyScales[key0], keyScales[key0 + 8]};
    const uint64_t keyDescriptor = wgmma::descriptor(mma::sharedAddress(stage));
    float acc[32];
    wgmma::fence();
#pragma unroll
    for (int s = 0; s < D / 32; ++s) // k steps of 32 codes: 32 bytes along the swizzled rows
      wgmma::mma64x64E4M3(acc, keyDescriptor + 2 * s, queryDescriptor + 2 * s,
                          /*accumulate=*/s > 0);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fenceOperands(acc);
    storeWeightedReluSums(acc, weights, keyScale, firstKey + tile * kTileKeys + key0, position,
                          firstDigit.counting, scores, histogram);
  }
  mma::waitAsyncCopies<0>(); // nothing in flight when the block ends
  firstDigit.flush(select, row, position, tilesPerBlock, warpTotals, last);
}

__global__ void __launch_bounds__(kHistogramThreads)
    selectHistogramKernel(IndexerParams p, SelectWorkspace w, int shift, int bits) {
  __shared__ uint32_t histogram[kSelectBins];
  __shared__ uint32_t warpTotals[kHistogramThreads / 32];
  __shared__ bool last;
  const int row = blockIdx.x, n = p.positions[row] + 1;
  const int begin = int(blockIdx.y) * kChunkKeys;
  if (n <= p.topK || begin >= n)
    return;
  const int end = min(n, begin + kChunkKeys), bins = 1 << bits;
  for (int b = threadIdx.x; b < bins; b += kHistogramThreads)
    histogram[b] = 0;
  const SelectState state = w.states[row];
  __syncthreads();
  const float *scores = p.scores + size_t(row) * p.maxKeys;
  constexpr int kInFlight = 8; // loads issued before the first is used
  for (int first = begin + int(threadIdx.x); first < end;
       first += kInFlight * kHistogramThreads) {
    uint32_t keys[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = first + u * kHistogramThreads;
      keys[u] = i < end ? orderKey(scores[i]) : 0u;
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (first + u * kHistogramThreads < end && (keys[u] & state.mask) == state.prefix)
        atomicAdd(&histogram[(keys[u] >> shift) & (bins - 1)], 1u);
  }
  flushHistogramAndChoose<kHistogramThreads>(histogram, w.states[row],
                                             w.histograms + size_t(row) * kSelectBins,
                                             unsigned(selectChunks(n)), shift, bits, warpTotals,
                                             last);
}

// This thread's run [first, last) of a chunk into the output: its keys above T (`greater`, bit j
// for position first + j) and the lowest of its ties at T (`equal`) that the chunk's share
// (chunkTies) leaves it after the threads before it (equalBefore ties, greaterBefore keys above
// T), from the chunk's offset.
__device__ inline void writeThreadRun(int32_t *out, int first, int last, unsigned greater,
                                      unsigned equal, int greaterBefore, int equalBefore,
                                      int chunkOffset, int chunkTies) {
  const int tiesMine = min(max(chunkTies - equalBefore, 0), __popc(equal));
  unsigned taken = greater;
  for (unsigned left = equal, i = 0; i < unsigned(tiesMine); ++i) {
    taken |= left & (0u - left);
    left &= left - 1;
  }
  // Ties taken by the threads before this one: min(chunkTies, their ties).
  int slot = chunkOffset + greaterBefore + min(chunkTies, equalBefore);
  for (int i = first; i < last; ++i)
    if (taken >> (i - first) & 1u)
      out[slot++] = i;
}

// A chunk's part of the top k in ascending position order: its keys above T (`greater`, bit j for
// position first + j of this thread's run) and its share of the ties at T (`equal`; those the
// lower chunks leave over, lowest positions first) at its offset, in order within the chunk
// (block scans), so the output is the same every run whatever order the blocks ran in. The
// chunk publishes its counts, then sums those of the chunks before it, which must have started
// (or will start: they never wait on this one).
__device__ void writeChunk(const IndexerParams &p, const SelectWorkspace &w, int row, int chunk,
                           int chunks, int first, int last, unsigned greater, unsigned equal,
                           int remaining, int *warpSums) {
  int greaterTotal = 0, equalTotal = 0;
  const int greaterBefore = blockExclusiveScan(__popc(greater), warpSums, greaterTotal);
  const int equalBefore = blockExclusiveScan(__popc(equal), warpSums, equalTotal);
  uint64_t *counts = w.chunkCounts + size_t(row) * chunks;
  if (threadIdx.x == 0)
    atomicExch(reinterpret_cast<unsigned long long *>(counts + chunk),
               kPublished | uint64_t(greaterTotal) << kCountBits | uint64_t(equalTotal));
  // The counts of the chunks before this one (each thread some of them, then a block sum).
  int greaterPrior = 0, equalPrior = 0;
  for (int c = int(threadIdx.x); c < chunk; c += kHistogramThreads) {
    uint64_t word;
    while (!((word = atomicAdd(reinterpret_cast<unsigned long long *>(counts + c), 0ull)) &
             kPublished))
      __nanosleep(64);
    greaterPrior += int(word >> kCountBits & ((1u << kCountBits) - 1));
    equalPrior += int(word & ((1u << kCountBits) - 1));
  }
  int sum = 0;
  blockExclusiveScan(greaterPrior, warpSums, sum);
  greaterPrior = sum;
  blockExclusiveScan(equalPrior, warpSums, sum);
  equalPrior = sum;
  // Ties go to the lowest positions: the chunks before took min(remaining, their ties).
  const int chunkOffset = greaterPrior + min(remaining, equalPrior);
  const int chunkTies = max(remaining - equalPrior, 0); // ties this chunk may still take
  writeThreadRun(p.indices + size_t(row) * p.topK, first, last, greater, equal, greaterBefore,
                 equalBefore, chunkOffset, chunkTies);
}

// Rows of n <= k keys: every causal position, then -1s (by the row's first chunk).
__device__ inline void writeWholeRow(const IndexerParams &p, int row, int n) {
  int32_t *out = p.indices + size_t(row) * p.topK;
  for (int i = threadIdx.x; i < p.topK; i += blockDim.x)
    out[i] = i < n ? i : -1;
}

constexpr int kChunkRun = kChunkKeys / kHistogramThreads; // a thread's consecutive positions

// The top k of each row in ascending position order (writeChunk), a block a chunk. Blocks take
// their chunk from a ticket counter, so every chunk waited on has already started (no deadlock
// however many blocks the GPU holds at once).
__global__ void __launch_bounds__(kHistogramThreads)
    selectWriteKernel(IndexerParams p, SelectWorkspace w, int chunks) {
  __shared__ int warpSums[kHistogramThreads / 32];
  __shared__ int ticket;
  if (threadIdx.x == 0)
    ticket = int(atomicAdd(w.writeTickets, 1u));
  __syncthreads();
  const int row = ticket % p.rows, chunk = ticket / p.rows;
  const int n = p.positions[row] + 1;
  if (n <= p.topK) {
    if (chunk == 0)
      writeWholeRow(p, row, n);
    return;
  }
  const int begin = chunk * kChunkKeys;
  if (begin >= n)
    return;
  const SelectState state = w.states[row];
  const uint32_t threshold = state.prefix;
  const float *scores = p.scores + size_t(row) * p.maxKeys;
  const int first = begin + int(threadIdx.x) * kChunkRun, last = min(n, first + kChunkRun);
  unsigned greater = 0, equal = 0; // bit j: key first + j above T / at T
  for (int i = first; i < last; ++i) {
    const uint32_t key = orderKey(scores[i]);
    greater |= unsigned(key > threshold) << (i - first);
    equal |= unsigned(key == threshold) << (i - first);
  }
  writeChunk(p, w, row, chunk, chunks, first, last, greater, equal, state.remaining, warpSums);
}

// ---- The select after the first digit from the chunks' gathered candidates. Each 2048-key chunk
// (a block, its keys in registers) counts its keys above the first digit's bin and gathers, into
// its own 2048 words of the row's, its candidates (the keys in that bin: about 1% of hybrid-bench's
// rows at batch 1, more where the scores crowd one bin) from the front and the positions of its
// keys above the bin from the back (gatherChunk); one block then ranks the row's candidates in
// shared memory (rankRow): both remaining digits, T and the ties, then each chunk's place in the
// output, one word a chunk; each chunk writes its part from its keys above T and its share of the
// ties. Two forms:
// - one cooperative launch where every row's chunks fit on the GPU at once: the row's last chunk
//   to arrive ranks, the others wait for their word and write from the keys in their registers;
// - three launches otherwise (gather, rank, write): the write builds its chunk's keys above T
//   from the gathered lists, so the scores are read once, not three times as by the launch a
//   digit (two histogram passes and the write).

// A chunk's word in the workspace's places: from rankRow, T, where its keys start in the output
// and how many of its ties at T it may take (before its own count caps them).
constexpr uint64_t kPlaceReady = 1ull << 63;
__device__ inline uint64_t packPlace(uint32_t threshold, int offset, int ties) {
  return kPlaceReady | uint64_t(uint32_t(offset)) << 47 | uint64_t(uint32_t(ties)) << 32 |
         threshold;
}
static_assert(kIndexerMaxTopK < (1 << 15), "a place's offset and ties take 15 bits each");

// A gathered candidate in one word: its key's bits below the first digit (the digit is the row's
// prefix) over its position in the chunk.
constexpr int kChunkPositionBits = 11;
static_assert(kChunkKeys == 1 << kChunkPositionBits && kFirstDigitShift + kChunkPositionBits == 32,
              "a candidate's key bits and position fill one word");
__device__ inline uint32_t packCandidate(uint32_t key, int positionInChunk) {
  return key << kChunkPositionBits | uint32_t(positionInChunk);
}
__device__ inline uint2 unpackCandidate(uint32_t word, uint32_t prefix, int chunkBegin) {
  return make_uint2(prefix | word >> kChunkPositionBits,
                    uint32_t(chunkBegin) + (word & (kChunkKeys - 1u)));
}

// The chunk's scores (those up to the capacity; the row's length cuts them below): eight a
// thread, as two 16-byte loads where the rows are 16-byte aligned.
__device__ inline void loadChunkRun(const float *scores, int first, int maxKeys,
                                    float (&values)[kChunkRun]) {
  static_assert(kChunkRun == 8, "two 16-byte loads a thread");
  if (maxKeys % 4 == 0 && first + kChunkRun <= maxKeys) {
    const float4 low = *reinterpret_cast<const float4 *>(scores + first);
    const float4 high = *reinterpret_cast<const float4 *>(scores + first + 4);
    values[0] = low.x, values[1] = low.y, values[2] = low.z, values[3] = low.w;
    values[4] = high.x, values[5] = high.y, values[6] = high.z, values[7] = high.w;
  } else {
#pragma unroll
    for (int u = 0; u < kChunkRun; ++u)
      values[u] = first + u < maxKeys ? scores[first + u] : 0.0f;
  }
}

// This thread's run [first, last) of the chunk at `begin` (keys in registers) into the chunk's
// gathered words (the positions above the bin only with kAbovePositions: the one-launch form
// writes from its registers) and its count word (keys above the bin << 32 | candidates).
template <bool kAbovePositions>
__device__ void gatherChunk(const uint32_t (&keys)[kChunkRun], int first, int last, int begin,
                            uint32_t prefix, uint32_t mask, uint32_t *gathered, uint64_t *countWord,
                            int *warpSums) {
  unsigned candidate = 0, above = 0;
#pragma unroll
  for (int u = 0; u < kChunkRun; ++u) {
    const bool live = first + u < last;
    candidate |= unsigned(live && (keys[u] & mask) == prefix) << u;
    above |= unsigned(live && (keys[u] & mask) > prefix) << u;
  }
  // Both counts in one scan: each is at most kChunkKeys.
  static_assert(kChunkKeys < (1 << 16), "two counts a word");
  int totals = 0;
  const int before = blockExclusiveScan(__popc(candidate) | __popc(above) << 16, warpSums, totals);
  int slot = before & 0xFFFF, aboveSlot = kChunkKeys - 1 - (before >> 16);
#pragma unroll
  for (int u = 0; u < kChunkRun; ++u) {
    if (candidate >> u & 1u)
      gathered[slot++] = packCandidate(keys[u], first + u - begin);
    if (kAbovePositions && (above >> u & 1u))
      gathered[aboveSlot--] = uint32_t(first + u - begin);
  }
  if (threadIdx.x == 0)
    *countWord = uint64_t(uint32_t(totals >> 16)) << 32 | uint32_t(totals & 0xFFFF);
}

constexpr int kAutoOneLaunchBlocksPerSm = 4; // see launchSelect
constexpr int kRankMaxChunks = 1024;    // a row's chunks rankRow takes: 2M keys
constexpr int kSharedCandidates = 4096; // a row's candidates rankRow ranks in shared memory

// A candidate rankRow holds in shared memory: its key's bits below the first digit over its chunk.
constexpr int kChunkIndexBits = 10;
static_assert(kRankMaxChunks == 1 << kChunkIndexBits && kFirstDigitShift + kChunkIndexBits <= 32,
              "a held candidate's key bits and chunk fit one word");

struct RankShared {
  uint32_t histogram[kSelectBins]; // the digits' histogram, then the chunks' counts above / at T
  int chunkStarts[kRankMaxChunks + 1]; // the row's candidates, chunk by chunk
  uint32_t held[kSharedCandidates];    // held candidates, row order
  uint32_t warpTotals[kHistogramThreads / 32];
  int warpSums[kHistogramThreads / 32];
  SelectState digits;
};
static_assert(2 * kRankMaxChunks <= kSelectBins, "the chunk counts reuse the histogram");

// One block ranks row `row`'s gathered candidates (its `liveChunks` chunks' counts and words
// complete and visible): both remaining digits give T and the ties taken, then each chunk's
// place goes to the workspace's places.
__device__ void rankRow(const SelectWorkspace &w, int row, int chunks, int liveChunks,
                        int32_t maxKeys, const SelectState &firstDigit, RankShared &s) {
  constexpr int kMaxChunksPerThread = kRankMaxChunks / kHistogramThreads;
  constexpr int kWarps = kHistogramThreads / 32;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid == 0)
    s.digits = firstDigit;
  const uint64_t *counts = w.chunkCounts + size_t(row) * chunks;
  const uint32_t *gathered = w.candidates + size_t(row) * maxKeys;
  // The chunks' counts: this thread's run of chunks, then scans over threads.
  const int perThread = (liveChunks + kHistogramThreads - 1) / kHistogramThreads;
  int aboveBin[kMaxChunksPerThread], candidates[kMaxChunksPerThread], candidateSum = 0;
#pragma unroll
  for (int j = 0; j < kMaxChunksPerThread; ++j) {
    const int c = tid * perThread + j;
    const uint64_t word = j < perThread && c < liveChunks ? __ldcg(counts + c) : 0ull;
    aboveBin[j] = int(word >> 32);
    candidates[j] = int(word & 0xFFFFFFFFu);
    candidateSum += candidates[j];
  }
  int count = 0;
  int start = blockExclusiveScan(candidateSum, s.warpSums, count);
#pragma unroll
  for (int j = 0; j < kMaxChunksPerThread; ++j)
    if (j < perThread && tid * perThread + j < liveChunks) {
      s.chunkStarts[tid * perThread + j] = start;
      start += candidates[j];
    }
  if (tid == 0)
    s.chunkStarts[liveChunks] = count;
  __syncthreads();
  const uint32_t prefix = firstDigit.prefix;
  const bool inShared = count <= kSharedCandidates;
  // visit(key, chunk) for each of the row's candidates: from shared memory, or (more than it
  // holds) from each chunk's gathered words, a warp a chunk. Plain loops, not unrolled: the
  // block runs this once, so its time went to fetching instructions (an unrolled form with a
  // search for each candidate's chunk took ~9 us at 1344 candidates).
  auto forEachCandidate = [&](auto &&visit) {
    if (inShared) {
      for (int i = tid; i < count; i += kHistogramThreads) {
        const uint32_t word = s.held[i];
        visit(prefix | word >> kChunkIndexBits, int(word & (kRankMaxChunks - 1u)));
      }
      return;
    }
    for (int c = warp; c < liveChunks; c += kWarps) {
      const int chunkCount = s.chunkStarts[c + 1] - s.chunkStarts[c];
      for (int i = lane; i < chunkCount; i += 32)
        visit(prefix | __ldcg(gathered + size_t(c) * kChunkKeys + i) >> kChunkPositionBits, c);
    }
  };
  if (inShared)
    for (int c = warp; c < liveChunks; c += kWarps) {
      const int first = s.chunkStarts[c], chunkCount = s.chunkStarts[c + 1] - first;
      for (int i = lane; i < chunkCount; i += 32) {
        const uint32_t keyBits =
            __ldcg(gathered + size_t(c) * kChunkKeys + i) >> kChunkPositionBits;
        s.held[first + i] = keyBits << kChunkIndexBits | uint32_t(c);
      }
    }
  for (int top = kFirstDigitShift; top > 0;) {
    const int bits = min(kMaxDigitBits, top), shift = top - bits;
    for (int b = tid; b < (1 << bits); b += kHistogramThreads)
      s.histogram[b] = 0;
    __syncthreads(); // and the held candidates are in
    const uint32_t digitPrefix = s.digits.prefix, digitMask = s.digits.mask;
    forEachCandidate([&](uint32_t key, int) {
      if ((key & digitMask) == digitPrefix)
        atomicAdd(&s.histogram[(key >> shift) & ((1u << bits) - 1)], 1u);
    });
    __syncthreads();
    chooseDigit<kHistogramThreads, /*kShared=*/true>(s.digits, s.histogram, shift, bits,
                                                     s.warpTotals);
    __syncthreads(); // the state's new digit is read by every thread
    top = shift;
  }
  const uint32_t threshold = s.digits.prefix;
  const int remaining = s.digits.remaining; // ties at T taken over the row
  // Each chunk's keys above T (those above the bin, and its candidates above T) and at T.
  uint32_t *aboveT = s.histogram, *atT = s.histogram + kRankMaxChunks;
  for (int c = tid; c < liveChunks; c += kHistogramThreads)
    aboveT[c] = atT[c] = 0;
  __syncthreads();
  forEachCandidate([&](uint32_t key, int chunk) {
    if (key >= threshold)
      atomicAdd(&(key > threshold ? aboveT : atT)[chunk], 1u);
  });
  __syncthreads();
  int greater[kMaxChunksPerThread], equal[kMaxChunksPerThread], greaterSum = 0, equalSum = 0;
#pragma unroll
  for (int j = 0; j < kMaxChunksPerThread; ++j) {
    const int c = tid * perThread + j;
    const bool mine = j < perThread && c < liveChunks;
    greater[j] = mine ? aboveBin[j] + int(aboveT[c]) : 0;
    equal[j] = mine ? int(atT[c]) : 0;
    greaterSum += greater[j];
    equalSum += equal[j];
  }
  int unused = 0;
  int greaterPrior = blockExclusiveScan(greaterSum, s.warpSums, unused);
  int equalPrior = blockExclusiveScan(equalSum, s.warpSums, unused);
  uint64_t *places = w.places + size_t(row) * chunks;
#pragma unroll
  for (int j = 0; j < kMaxChunksPerThread; ++j) {
    const int c = tid * perThread + j;
    if (j < perThread && c < liveChunks) {
      // Ties go to the lowest positions: the chunks before took min(remaining, their ties).
      // The word carries all a chunk needs: no fence before it.
      __stcg(places + c, packPlace(threshold, greaterPrior + min(remaining, equalPrior),
                                   max(remaining - equalPrior, 0)));
      greaterPrior += greater[j];
      equalPrior += equal[j];
    }
  }
}

// A chunk's part of the output from its place word: this thread's keys above T (`greater`) and
// at T (`equal`), bit j for position first + j.
__device__ inline void writeFromPlace(const IndexerParams &p, int row, uint64_t place, int first,
                                      int last, unsigned greater, unsigned equal, int *warpSums) {
  const int offset = int(place >> 47 & 0x7FFFu), chunkTies = int(place >> 32 & 0x7FFFu);
  int unused = 0; // both counts in one scan: each is at most kChunkKeys
  const int before = blockExclusiveScan(__popc(greater) | __popc(equal) << 16, warpSums, unused);
  writeThreadRun(p.indices + size_t(row) * p.topK, first, last, greater, equal, before & 0xFFFF,
                 before >> 16, offset, chunkTies);
}

// A block a chunk of every row: gathers. kOneLaunch (every block resident): the row's last chunk
// to arrive ranks, the others wait for their chunk's place, then each writes from the keys in its
// registers; otherwise selectRankKernel and selectGatheredWriteKernel follow (a rank in the
// gather's last block measured slower at batch 64 x 128K: 44 us against 40, its shared memory
// costing the gather's occupancy).
template <bool kOneLaunch>
__global__ void __launch_bounds__(kHistogramThreads)
    selectGatherKernel(IndexerParams p, SelectWorkspace w) {
  __shared__ int warpSums[kHistogramThreads / 32];
  const int row = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y, tid = threadIdx.x;
  const int begin = chunk * kChunkKeys;
  const int first = begin + tid * kChunkRun;
  // The chunk's scores, the first digit and the row's length load together (a dependent round
  // trip less).
  float values[kChunkRun];
  loadChunkRun(p.scores + size_t(row) * p.maxKeys, first, p.maxKeys, values);
  SelectState &state = w.states[row];
  const SelectState firstDigit = state; // the first digit's bin and the keys still wanted
  const int n = p.positions[row] + 1;
  if (n <= p.topK) {
    if (kOneLaunch && chunk == 0)
      writeWholeRow(p, row, n);
    return;
  }
  if (begin >= n)
    return;
  const int liveChunks = (n + kChunkKeys - 1) / kChunkKeys;
  const int last = min(n, first + kChunkRun);
  uint32_t keys[kChunkRun];
#pragma unroll
  for (int u = 0; u < kChunkRun; ++u)
    keys[u] = first + u < last ? orderKey(values[u]) : 0u;
  gatherChunk<!kOneLaunch>(keys, first, last, begin, firstDigit.prefix, firstDigit.mask,
                           w.candidates + size_t(row) * p.maxKeys + begin,
                           w.chunkCounts + size_t(row) * chunks + chunk, warpSums);
  if constexpr (kOneLaunch) {
    __shared__ RankShared rank;
    __shared__ bool lastToArrive;
    __shared__ uint64_t place;
    __syncthreads();
    if (tid == 0)
      lastToArrive = arriveLast(&state.arrivals, unsigned(liveChunks));
    __syncthreads();
    if (lastToArrive) // every chunk's candidates and counts are in
      rankRow(w, row, chunks, liveChunks, p.maxKeys, firstDigit, rank);
    if (tid == 0) {
      uint64_t word;
      while (!((word = __ldcv(w.places + size_t(row) * chunks + chunk)) & kPlaceReady))
        __nanosleep(20);
      place = word;
    }
    __syncthreads();
    const uint32_t threshold = uint32_t(place);
    unsigned greater = 0, equal = 0;
#pragma unroll
    for (int u = 0; u < kChunkRun; ++u) {
      greater |= unsigned(first + u < last && keys[u] > threshold) << u;
      equal |= unsigned(first + u < last && keys[u] == threshold) << u;
    }
    writeFromPlace(p, row, place, first, last, greater, equal, rank.warpSums);
  }
}

// The three-launch form's rank: a block a row.
__global__ void __launch_bounds__(kHistogramThreads)
    selectRankKernel(IndexerParams p, SelectWorkspace w, int chunks) {
  __shared__ RankShared rank;
  const int row = blockIdx.x, n = p.positions[row] + 1;
  if (n <= p.topK)
    return;
  rankRow(w, row, chunks, (n + kChunkKeys - 1) / kChunkKeys, p.maxKeys, w.states[row], rank);
}

// The three-launch form's write: a block a chunk, its keys above T and at T from its gathered
// words (the positions above the bin, the candidates compared with T) through a byte a position
// in shared memory.
__global__ void __launch_bounds__(kHistogramThreads)
    selectGatheredWriteKernel(IndexerParams p, SelectWorkspace w) {
  constexpr uint8_t kGreater = 1, kEqual = 2;
  __shared__ __align__(16) uint8_t marks[kChunkKeys];
  __shared__ int warpSums[kHistogramThreads / 32];
  const int row = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y, tid = threadIdx.x;
  const int begin = chunk * kChunkKeys, first = begin + tid * kChunkRun;
  // The chunk's words and the row's length load together (a dependent round trip less).
  const uint64_t counts = w.chunkCounts[size_t(row) * chunks + chunk];
  const uint64_t place = w.places[size_t(row) * chunks + chunk];
  const uint32_t prefix = w.states[row].prefix, threshold = uint32_t(place);
  const int n = p.positions[row] + 1;
  if (n <= p.topK) {
    if (chunk == 0)
      writeWholeRow(p, row, n);
    return;
  }
  if (begin >= n)
    return;
  const int above = int(counts >> 32), candidates = int(counts & 0xFFFFFFFFu);
  const uint32_t *gathered = w.candidates + size_t(row) * p.maxKeys + begin;
  reinterpret_cast<uint2 *>(marks)[tid] = make_uint2(0u, 0u); // kChunkRun bytes a thread
  __syncthreads();
  for (int i = tid; i < above; i += kHistogramThreads)
    marks[gathered[kChunkKeys - 1 - i]] = kGreater;
  for (int i = tid; i < candidates; i += kHistogramThreads) {
    const uint2 c = unpackCandidate(gathered[i], prefix, 0);
    if (c.x >= threshold)
      marks[c.y] = c.x > threshold ? kGreater : kEqual;
  }
  __syncthreads();
  const uint2 mine = reinterpret_cast<const uint2 *>(marks)[tid];
  unsigned greater = 0, equal = 0;
#pragma unroll
  for (int u = 0; u < kChunkRun; ++u) {
    const unsigned mark = (u < 4 ? mine.x >> (8 * u) : mine.y >> (8 * (u - 4))) & 0xFFu;
    greater |= unsigned(mark == kGreater) << u;
    equal |= unsigned(mark == kEqual) << u;
  }
  writeFromPlace(p, row, place, first, min(n, first + kChunkRun), greater, equal, warpSums);
}

// How the reset kernel lays out a row's queries for the warpgroup scores kernels.
enum class QueryLayout { None, F16, E4M3 };

// Fresh states, zero histograms, unpublished counts and places and the ticket counter (the digit
// passes leave the histograms zero again behind them, but a failed launch may not have); with a
// query layout, also each row's queries once per row instead of once per block of the scores
// kernel: F16, each head scaled by a power of two (its inverse in headScales) at the f16
// warpgroup kernel's permuted, swizzled places; E4M3, each head's codes over its power of two
// (in headScales) in the FP8 warpgroup kernel's swizzled rows.
template <int D, QueryLayout Queries>
__global__ void selectResetKernel(IndexerParams p, SelectWorkspace w, int chunks) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int rows = p.rows;
  if (i < size_t(rows))
    w.states[i] = SelectState{.prefix = 0u, .mask = 0u, .remaining = p.topK, .arrivals = 0u};
  if (i < size_t(rows) * kSelectBins)
    w.histograms[i] = 0;
  if (i < size_t(rows) * chunks)
    w.chunkCounts[i] = w.places[i] = 0;
  if (i == 0)
    *w.writeTickets = 0;
  if constexpr (Queries != QueryLayout::None) {
    static_assert(Queries != QueryLayout::E4M3 || D == 128, "E4M3: the FP8 warpgroup kernel's dim");
    constexpr int kRowFloat4s = kMmaMaxHeads * D / 4;
    if (i < size_t(rows) * kRowFloat4s) {
      const int row = int(i / kRowFloat4s), within = int(i % kRowFloat4s);
      const int h = within / (D / 4), column = 4 * (within % (D / 4));
      const float4 v = h < p.heads ? reinterpret_cast<const float4 *>(
                                         p.q + (size_t(row) * p.heads + h) * D)[column / 4]
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      // The head's largest |q|: its D / 4 lanes are one warp or half of one (whole warps take
      // this branch: a row's items are a multiple of 32).
      float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
      for (int offset = 1; offset < D / 4; offset *= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      unsigned char *queries = w.queries + size_t(row) * kSelectQueryBytes;
      float *headScale = w.headScales + size_t(row) * kMmaMaxHeads + h;
      if constexpr (Queries == QueryLayout::E4M3) {
        // The smallest power of two 2^e with amax <= 448 * 2^e: for queries that are E4M3 codes
        // times any one power of two, q / 2^e are E4M3 codes again, exactly.
        const uint8_t scale = quant::mxScaleCodeRoundUp(amax);
        const int shift = 127 - int(scale);
        const uint32_t codes = uint32_t(quant::floatToE4M3(ldexpf(v.x, shift))) |
                               uint32_t(quant::floatToE4M3(ldexpf(v.y, shift))) << 8 |
                               uint32_t(quant::floatToE4M3(ldexpf(v.z, shift))) << 16 |
                               uint32_t(quant::floatToE4M3(ldexpf(v.w, shift))) << 24;
        *reinterpret_cast<uint32_t *>(queries + swizzledByte(h, column)) = codes;
        if (column == 0)
          *headScale = e8m0ToFloat(scale);
      } else {
        // amax scaled to [2^14, 2^15): f16 then holds every MXFP8 value of the head exactly
        // unless they span more than 2^35 (or lie below 2^-86); the head's weight takes the
        // inverse.
        const int exponent = int(__float_as_uint(amax) >> 23) - 127;
        const int shift = amax == 0.0f ? 0 : min(14 - exponent, 100);
        const float up = __uint_as_float(uint32_t(127 + shift) << 23);
        *reinterpret_cast<uint32_t *>(
            queries + wgmma::swizzledOffset(64, h, permutedColumn<D>(column))) =
            mma::packF16(v.x * up, v.y * up);
        *reinterpret_cast<uint32_t *>(
            queries + wgmma::swizzledOffset(64, h, permutedColumn<D>(column + 2))) =
            mma::packF16(v.z * up, v.w * up);
        if (column == 0)
          *headScale = __uint_as_float(uint32_t(127 - shift) << 23);
      }
    }
  }
}

// The select's first launch, before the scores: resets its workspace and, for the warpgroup
// scores kernel (`queries`), prepares its queries.
template <int D>
int launchSelectReset(const IndexerParams &p, QueryLayout queries, cudaStream_t stream) {
  const SelectWorkspace w = selectWorkspace(p.selectWorkspace, p.rows, p.maxKeys);
  const int chunks = selectChunks(p.maxKeys);
  size_t items = std::max(size_t(p.rows) * kSelectBins, size_t(p.rows) * chunks);
  if (queries != QueryLayout::None)
    items = std::max(items, size_t(p.rows) * kMmaMaxHeads * D / 4);
  const unsigned blocks = unsigned((items + 255) / 256);
  switch (queries) {
  case QueryLayout::None:
    selectResetKernel<D, QueryLayout::None><<<blocks, 256, 0, stream>>>(p, w, chunks);
    break;
  case QueryLayout::F16:
    selectResetKernel<D, QueryLayout::F16><<<blocks, 256, 0, stream>>>(p, w, chunks);
    break;
  case QueryLayout::E4M3:
    if constexpr (D != 128)
      return int(cudaErrorInvalidValue); // the FP8 warpgroup kernel's head dim only
    else
      selectResetKernel<D, QueryLayout::E4M3><<<blocks, 256, 0, stream>>>(p, w, chunks);
    break;
  }
  return int(cudaGetLastError());
}

// The select after the scores on `stream`. After a first digit (the warpgroup scores), Auto: from
// the chunks' gathered candidates in one cooperative launch where every row's chunks fit on the
// GPU at once (at most kAutoOneLaunchBlocksPerSm blocks an SM); otherwise (and as
// SelectForm::Passes) the digits from the top of the 32-bit keys, a launch each, then the write.
// SelectForm::Gathered: the gathered candidates in three launches, which Auto leaves: at batch 64
// and 32K-128K keys 1-2% faster than the passes alone, but DeepSeek-V3.2 (6 layers, batch 8,
// 160K capacity) stepped 20 us slower on it at 1K keys, its rank a longer chain than the
// passes' histograms of a few live chunks (docs/performance.md, 2026-12-02, session 22).
int launchSelectCluster(const IndexerParams &p, bool firstDigitChosen, cudaStream_t stream);

int launchSelect(const IndexerParams &p, bool firstDigitChosen, cudaStream_t stream) {
  using Form = IndexerParams::SelectForm;
  if (p.selectForm == Form::Cluster)
    return launchSelectCluster(p, firstDigitChosen, stream);
  const SelectWorkspace w = selectWorkspace(p.selectWorkspace, p.rows, p.maxKeys);
  const int chunkCount = selectChunks(p.maxKeys);
  const dim3 chunks(unsigned(p.rows), unsigned(chunkCount));
  const bool gathered =
      firstDigitChosen && p.selectForm != Form::Passes && chunkCount <= kRankMaxChunks;
  if (gathered && p.selectForm != Form::Gathered) {
    const DeviceSetup setup = deviceSetup([] { return cudaSuccess; });
    static const int finishPerSm =
        residentBlocksPerSm(selectGatherKernel</*kOneLaunch=*/true>, kHistogramThreads);
    const int64_t blocks = int64_t(p.rows) * chunkCount;
    const bool fits = setup.status == cudaSuccess && blocks <= kOneLaunchMaxBlocks &&
                      blocks <= int64_t(finishPerSm) * setup.multiprocessors;
    if (p.selectForm == Form::OneLaunch && !fits)
      return int(cudaErrorCooperativeLaunchTooLarge);
    // Auto: a cooperative grid starts only when all its blocks have room, and in a model other
    // streams' kernels hold some: DeepSeek-V3.2 (6 layers) at batch 8 and 32K keys of a 160K
    // capacity (640 blocks, 5 an SM) stepped 130 us slower on it than on the passes.
    if (p.selectForm == Form::OneLaunch ||
        (fits && blocks <= int64_t(kAutoOneLaunchBlocksPerSm) * setup.multiprocessors)) {
      cudaLaunchConfig_t config = {};
      config.gridDim = chunks;
      config.blockDim = dim3(kHistogramThreads);
      config.stream = stream;
      cudaLaunchAttribute cooperative[1];
      cooperative[0].id = cudaLaunchAttributeCooperative;
      cooperative[0].val.cooperative = 1;
      config.attrs = cooperative;
      config.numAttrs = 1;
      return int(cudaLaunchKernelEx(&config, selectGatherKernel</*kOneLaunch=*/true>, p, w));
    }
  }
  if (gathered && p.selectForm == Form::Gathered) {
    selectGatherKernel</*kOneLaunch=*/false><<<chunks, kHistogramThreads, 0, stream>>>(p, w);
    selectRankKernel<<<unsigned(p.rows), kHistogramThreads, 0, stream>>>(p, w, chunkCount);
    selectGatheredWriteKernel<<<chunks, kHistogramThreads, 0, stream>>>(p, w);
    return int(cudaGetLastError());
  }
  for (int top = firstDigitChosen ? kFirstDigitShift : 32; top > 0;) {
    const int bits = std::min(kMaxDigitBits, top), shift = top - bits;
    selectHistogramKernel<<<chunks, kHistogramThreads, 0, stream>>>(p, w, shift, bits);
    top = shift;
  }
  selectWriteKernel<<<unsigned(p.rows) * unsigned(chunkCount), kHistogramThreads, 0, stream>>>(
      p, w, chunkCount);
  return int(cudaGetLastError());
}

// ---- The fused indexer: scores and top-k in one launch, the scores never leaving the chip.
//
// A cluster of blocks per row, block r scoring the keys [r * slice, (r + 1) * slice) into its
// shared memory as order-preserving 32-bit keys (two groups of four warps on alternate tiles).
// The top k: a radix select over the cluster (four 8-bit digits), each block histogramming its
// own keys and summing every block's histogram through distributed shared memory; then each
// block writes, at its offset in position order, its keys above the threshold and the ties at it
// that the lower positions leave over, so the output is ascending without a sort.
constexpr int kFusedThreads = 2 * kMmaThreads;
constexpr int kFusedMaxCluster = 16;
constexpr int kFusedSliceTarget = 2048; // keys per block the cluster size aims at
constexpr int kDigitBins = 256;
static_assert(kFusedThreads == kDigitBins, "one thread per histogram bin");
// clusterTopK's words: scan partials (8), digit and cluster counts (8), per-warp counts (2 x 8).
constexpr int kSelectWords = 16 + 2 * (kFusedThreads / 32);

// The top k of a row spread over a cluster (every block of which calls this: cluster barriers
// inside; kFusedThreads threads): block `rank` holds the order-preserving keys of positions
// [sliceBegin, sliceBegin + localCount) in shared memory. A radix select over the cluster (four
// 8-bit digits), each block histogramming its own keys and summing every block's histogram
// through distributed shared memory, the digit's bin found by a suffix scan over the threads (a
// bin each); then each block writes, at its offset in position order, its keys above the
// threshold and the ties at it that the lower positions leave over, so the output is ascending
// without a sort. Scratch: histograms [2][256], words [kSelectWords].
__device__ void
clusterTopK(const cooperative_groups::cluster_group &cluster, const uint32_t *sliceKeys32,
            int localCount, int sliceBegin, int k, int32_t *out, uint32_t *histograms, int *words,
            SelectState known = {.prefix = 0u, .mask = 0u, .remaining = 0, .arrivals = 0u},
            int knownBits = 0) {
  const int tid = threadIdx.x, rank = int(cluster.block_rank()), blocks = int(cluster.num_blocks());
  // The k-th largest key over the cluster, digit by digit: `remaining` of the keys equal to it
  // are taken (the lowest positions), with every larger key. The top `knownBits` may be known
  // already (the warpgroup scores' first digit): a first digit of 8 bits puts nearly every score
  // in a few bins, whose shared atomics then serialize.
  uint32_t prefix = known.prefix, mask = known.mask;
  int remaining = knownBits > 0 ? known.remaining : k;
  for (int top = 32 - knownBits, pass = 0; top > 0; ++pass) {
    const int bits = min(8, top), shift = top - bits;
    top = shift;
    uint32_t *histogram = histograms + (pass & 1) * kDigitBins; // pass p-2's readers are done
    histogram[tid] = 0;
    __syncthreads();
    // Plain shared atomics: aggregating equal bins across a warp (__match_any_sync) measured
    // 10-15% slower here.
    for (int i = tid; i < localCount; i += kFusedThreads) {
      const uint32_t key = sliceKeys32[i];
      if ((key & mask) == prefix)
        atomicAdd(&histogram[(key >> shift) & ((1u << bits) - 1u)], 1u);
    }
    cluster.sync(); // every block's histogram is complete
    // Thread t holds bin 255 - t: its exclusive scan counts the keys in the bins above.
    const int bin = kDigitBins - 1 - tid;
    // Every block's count of the bin, loaded at once (a remote shared load is a round trip of
    // hundreds of cycles), then summed.
    uint32_t counts[kFusedMaxCluster];
#pragma unroll
    for (int r = 0; r < kFusedMaxCluster; ++r)
      counts[r] = r < blocks ? cluster.map_shared_rank(histogram, r)[bin] : 0u;
    uint32_t total = 0;
#pragma unroll
    for (int r = 0; r < kFusedMaxCluster; ++r)
      total += counts[r];
    int all = 0;
    const int above = blockExclusiveScan<kFusedThreads>(int(total), words, all);
    if (above < remaining && (above + int(total) >= remaining || bin == 0)) {
      words[8] = bin;
      words[9] = above;
    }
    __syncthreads();
    prefix |= uint32_t(words[8]) << shift;
    mask |= ((1u << bits) - 1u) << shift;
    remaining -= words[9]; // rewritten only after the next digit's barriers
  }
  const uint32_t threshold = prefix;

  // Each warp's contiguous segment of the slice, read 32 consecutive keys at a time (lane i the
  // i-th: no bank conflicts, where a thread's own contiguous run had 32-way ones at 8K keys a
  // block); its keys above the threshold and at it by ballots.
  constexpr int kWarps = kFusedThreads / 32;
  const int warp = tid / 32, lane = tid % 32;
  const int segment = (localCount + 32 * kWarps - 1) / (32 * kWarps) * 32;
  const int segmentBegin = min(localCount, warp * segment);
  const int segmentEnd = min(localCount, segmentBegin + segment);
  int greater = 0, equal = 0; // the warp's (every lane holds them)
  for (int base = segmentBegin; base < segmentEnd; base += 32) {
    const bool inside = base + lane < segmentEnd;
    const uint32_t key = inside ? sliceKeys32[base + lane] : 0u;
    greater += __popc(__ballot_sync(0xffffffffu, inside && key > threshold));
    equal += __popc(__ballot_sync(0xffffffffu, inside && key == threshold));
  }
  int *warpGreater = words + 16, *warpEqual = words + 16 + kWarps; // words has 16 + 2 kWarps
  if (lane == 0) {
    warpGreater[warp] = greater;
    warpEqual[warp] = equal;
  }
  __syncthreads();
  int greaterBefore = 0, equalBefore = 0, blockGreater = 0, blockEqual = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    greaterBefore += w < warp ? warpGreater[w] : 0;
    equalBefore += w < warp ? warpEqual[w] : 0;
    blockGreater += warpGreater[w];
    blockEqual += warpEqual[w];
  }
  if (tid == 0) {
    words[10] = blockGreater;
    words[11] = blockEqual;
  }
  cluster.sync(); // every block's counts are published
  if (tid < 32) { // the ties and the outputs of the blocks before this one: lane r reads block r's
    const int r = tid;
    int g = 0, e = 0;
    if (r < rank) {
      const int *counts = cluster.map_shared_rank(words, r);
      g = counts[10];
      e = counts[11];
    }
    int tiesBefore = e; // inclusive, then exclusive: the ties of the blocks before block r
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int lower = __shfl_up_sync(0xffffffffu, tiesBefore, offset);
      if (r >= offset)
        tiesBefore += lower;
    }
    tiesBefore -= e;
    int written = g + min(max(remaining - tiesBefore, 0), e), ties = e;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      written += __shfl_xor_sync(0xffffffffu, written, offset);
      ties += __shfl_xor_sync(0xffffffffu, ties, offset);
    }
    if (r == 0) {
      words[12] = ties;
      words[13] = written;
    }
  }
  cluster.sync(); // no block leaves while another reads its counts
  // The ties this block takes, and this warp's: the lower positions' first.
  const int tiesHere = min(max(remaining - words[12], 0), blockEqual);
  const int tiesWarp = min(max(tiesHere - equalBefore, 0), equal);
  int slot = words[13] + greaterBefore + min(equalBefore, tiesHere);
  int tiesSeen = 0;
  const uint32_t lanesBelow = (1u << lane) - 1u;
  for (int base = segmentBegin; base < segmentEnd; base += 32) {
    const bool inside = base + lane < segmentEnd;
    const uint32_t key = inside ? sliceKeys32[base + lane] : 0u;
    const uint32_t ties = __ballot_sync(0xffffffffu, inside && key == threshold);
    const bool taken =
        (inside && key > threshold) ||
        (inside && key == threshold && tiesSeen + __popc(ties & lanesBelow) < tiesWarp);
    const uint32_t takenLanes = __ballot_sync(0xffffffffu, taken);
    if (taken)
      out[slot + __popc(takenLanes & lanesBelow)] = sliceBegin + base + lane;
    slot += __popc(takenLanes);
    tiesSeen += __popc(ties);
  }
}

// Shared memory besides the slice's keys: q hi/lo, two key tiles and their scales, the weights,
// two histograms and scan / broadcast words.
template <int D> constexpr size_t fusedFixedSharedBytes() {
  return size_t(2 * kMmaMaxHeads + 2 * kTileKeys) * mmaStride<D>() * 2 + 2 * kTileKeys * 4 +
         kMmaMaxHeads * 4 + 2 * kDigitBins * 4 + kSelectWords * 4;
}

template <IndexKeyType Type, int D>
__global__ void __launch_bounds__(kFusedThreads)
    indexerFusedKernel(IndexerParams p, int64_t pageBytes, int sliceKeys) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  constexpr int kStride = mmaStride<D>();
  extern __shared__ __align__(16) unsigned char smem[];
  auto *qHi = reinterpret_cast<__nv_bfloat16 *>(smem);     // [64 heads, kStride]
  __nv_bfloat16 *qLo = qHi + kMmaMaxHeads * kStride;         // [64 heads, kStride]
  __nv_bfloat16 *keyTiles = qLo + kMmaMaxHeads * kStride;    // [2 groups][kTileKeys, kStride]
  auto *keyScales = reinterpret_cast<float *>(keyTiles + 2 * kTileKeys * kStride); // [2][64]
  float *weights = keyScales + 2 * kTileKeys;                                      // [64]
  auto *histograms = reinterpret_cast<uint32_t *>(weights + kMmaMaxHeads);       // [2][256]
  int *words = reinterpret_cast<int *>(histograms + 2 * kDigitBins);             // [kSelectWords]
  uint32_t *sliceKeys32 = reinterpret_cast<uint32_t *>(words + kSelectWords);    // [sliceKeys]

  const int row = blockIdx.y, rank = int(cluster.block_rank());
  const int blocks = int(cluster.num_blocks()), tid = threadIdx.x, k = p.topK;
  const int position = p.positions[row], n = position + 1;
  int32_t *out = p.indices + size_t(row) * k;
  if (n <= k) { // every causal position, then -1s; the whole cluster leaves here
    if (rank == 0)
      for (int i = tid; i < k; i += kFusedThreads)
        out[i] = i < n ? i : -1;
    return;
  }
  const int sliceBegin = rank * sliceKeys;
  const int localCount = max(0, min(n - sliceBegin, sliceKeys));
  const int group = tid / kMmaThreads, groupTid = tid % kMmaThreads;
  const int32_t *table = p.blockTables + size_t(p.sequences[row]) * p.maxPages;
  KeyTileLoad<Type, D> next;
  const int firstKey = sliceBegin + group * kTileKeys;
  if (localCount > group * kTileKeys) // in flight while q is staged
    next.load(p, static_cast<const unsigned char *>(p.keyPages), table, pageBytes, firstKey,
              position, groupTid);
  const bool useLo = stageQuery<D>(p, row, qHi, qLo, weights, kFusedThreads);
  const int groupTiles = (sliceKeys / kTileKeys + 1 - group) / 2;
  scoreTiles<Type, D>(p, pageBytes, position, table, qHi, qLo, useLo, weights,
                      keyTiles + group * kTileKeys * kStride, keyScales + group * kTileKeys, next,
                      firstKey, 2 * kTileKeys, groupTiles, groupTid, /*barrier=*/1 + group,
                      [&](int s, float score) { sliceKeys32[s - sliceBegin] = orderKey(score); });
  __syncthreads();

  clusterTopK(cluster, sliceKeys32, localCount, sliceBegin, k, out, histograms, words);
}

template <int D> int fusedSliceKeys(int maxKeys, int &blocks) {
  blocks = std::clamp((maxKeys + kFusedSliceTarget - 1) / kFusedSliceTarget, 1, kFusedMaxCluster);
  const int perBlock = (maxKeys + blocks - 1) / blocks;
  return (perBlock + kTileKeys - 1) / kTileKeys * kTileKeys;
}

// The opt-in shared memory of a block on this device (227 KB on H100/H200).
int maxSharedPerBlock() {
  static std::mutex mutex;
  static std::map<int, int> bytes;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess)
    return 0;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = bytes.find(device);
  if (found != bytes.end())
    return found->second;
  int value = 0;
  if (cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return 0;
  bytes.emplace(device, value);
  return value;
}

template <IndexKeyType Type, int D> int launchFused(const IndexerParams &p, cudaStream_t stream) {
  int blocks = 1;
  const int slice = fusedSliceKeys<D>(p.maxKeys, blocks);
  const size_t shared = fusedFixedSharedBytes<D>() + size_t(slice) * 4;
  const int limit = maxSharedPerBlock();
  const DeviceSetup setup = deviceSetup([limit] {
    cudaError_t status = cudaFuncSetAttribute(indexerFusedKernel<Type, D>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
    if (status == cudaSuccess)
      status = cudaFuncSetAttribute(indexerFusedKernel<Type, D>,
                                    cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    return status;
  });
  if (setup.status != cudaSuccess)
    return int(setup.status);
  if (shared > size_t(limit))
    return cudaErrorInvalidValue;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(blocks), unsigned(p.rows));
  config.blockDim = dim3(kFusedThreads);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = unsigned(blocks);
  cluster[0].val.clusterDim.y = 1;
  cluster[0].val.clusterDim.z = 1;
  config.attrs = cluster;
  config.numAttrs = 1;
  return int(cudaLaunchKernelEx(&config, indexerFusedKernel<Type, D>, p,
                                indexerPageBytes(Type, p.pageTokens, D), slice));
}

// The select as one launch after the unfused scores (SelectForm::Cluster): the fused form's
// cluster top-k, block r of a row's cluster loading its slice of the row's scores from the
// workspace (just written: L2) as order-preserving keys. Four 8-bit digits with cluster barriers
// and distributed shared memory instead of the other forms' global atomics and arrivals; from the
// warpgroup scores' first digit when they chose one (else from the top).
size_t selectClusterSharedBytes(int sliceKeys) {
  return 2 * kDigitBins * sizeof(uint32_t) + kSelectWords * sizeof(int) + size_t(sliceKeys) * 4;
}

__global__ void __launch_bounds__(kFusedThreads)
    selectClusterKernel(IndexerParams p, SelectWorkspace w, bool firstDigitChosen, int sliceKeys) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(16) unsigned char smem[];
  auto *histograms = reinterpret_cast<uint32_t *>(smem);               // [2][256]
  int *words = reinterpret_cast<int *>(histograms + 2 * kDigitBins);   // [kSelectWords]
  uint32_t *keys = reinterpret_cast<uint32_t *>(words + kSelectWords); // [sliceKeys]
  const int row = blockIdx.y, rank = int(cluster.block_rank()), tid = threadIdx.x;
  const int n = p.positions[row] + 1;
  if (n <= p.topK) { // every causal position, then -1s; the whole cluster leaves here
    if (rank == 0)
      writeWholeRow(p, row, n);
    return;
  }
  const int sliceBegin = rank * sliceKeys;
  const int localCount = max(0, min(n - sliceBegin, sliceKeys));
  const float *scores = p.scores + size_t(row) * p.maxKeys + sliceBegin;
#pragma unroll 8
  for (int i = tid; i < localCount; i += kFusedThreads)
    keys[i] = orderKey(__ldcg(scores + i));
  __syncthreads();
  clusterTopK(cluster, keys, localCount, sliceBegin, p.topK, p.indices + size_t(row) * p.topK,
              histograms, words, w.states[row], firstDigitChosen ? kMaxDigitBits : 0);
}

int launchSelectCluster(const IndexerParams &p, bool firstDigitChosen, cudaStream_t stream) {
  int blocks = 1;
  const int slice = fusedSliceKeys<128>(p.maxKeys, blocks);
  const size_t shared = selectClusterSharedBytes(slice);
  const int limit = maxSharedPerBlock();
  const DeviceSetup setup = deviceSetup([limit] {
    cudaError_t status = cudaFuncSetAttribute(selectClusterKernel,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
    if (status == cudaSuccess)
      status = cudaFuncSetAttribute(selectClusterKernel,
                                    cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    return status;
  });
  if (setup.status != cudaSuccess)
    return int(setup.status);
  if (shared > size_t(limit))
    return cudaErrorInvalidValue; // over ~900K keys a row
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(blocks), unsigned(p.rows));
  config.blockDim = dim3(kFusedThreads);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = unsigned(blocks);
  cluster[0].val.clusterDim.y = 1;
  cluster[0].val.clusterDim.z = 1;
  config.attrs = cluster;
  config.numAttrs = 1;
  return int(cudaLaunchKernelEx(&config, selectClusterKernel, p,
                                selectWorkspace(p.selectWorkspace, p.rows, p.maxKeys),
                                firstDigitChosen, slice));
}

template <int D> int launchFp32Scores(const IndexerParams &p, cudaStream_t stream) {
  const dim3 grid(unsigned(p.rows), unsigned((p.maxKeys + kScoreThreads - 1) / kScoreThreads));
  const size_t shared = size_t(p.heads) * (D + 1) * sizeof(float);
  indexerScoresKernel<D><<<grid, kScoreThreads, shared, stream>>>(
      p, indexerPageBytes(IndexKeyType::F32, p.pageTokens, D));
  return int(cudaGetLastError());
}

// As many key tiles per block as keep about one wave of blocks on the GPU: each block stages its
// row's queries once, so fewer, longer blocks when there are many rows. (Two waves until the
// tuner's winners on the H200 showed one wave's tile counts at 7 of 9 indexer buckets.)
int tilesPerBlock(const IndexerParams &p, int multiprocessors, int blocksPerSm) {
  const int tiles = (p.maxKeys + kTileKeys - 1) / kTileKeys;
  const int wantedBlocks = std::max(1, blocksPerSm * multiprocessors / p.rows);
  return std::max(1, (tiles + wantedBlocks - 1) / wantedBlocks);
}

// One of the tensor-core score kernels (`kernel`, with `shared` bytes of shared memory) over
// rows x tile groups.
template <int kBlocksAnSm = kBlocksPerSm, typename Kernel, typename... Extra>
int launchScoreTiles(Kernel kernel, size_t shared, const IndexerParams &p, int64_t pageBytes,
                     const DeviceSetup &setup, cudaStream_t stream, Extra... extra) {
  if (setup.status != cudaSuccess)
    return int(setup.status);
  const int tiles = (p.maxKeys + kTileKeys - 1) / kTileKeys;
  const int perBlock = p.tilesPerBlock > 0 ? std::min<int>(p.tilesPerBlock, tiles)
                                           : tilesPerBlock(p, setup.multiprocessors, kBlocksAnSm);
  if ((tiles + perBlock - 1) / perBlock > 65535)
    return cudaErrorInvalidValue; // a configured tilesPerBlock too small for the grid
  const dim3 grid(unsigned(p.rows), unsigned((tiles + perBlock - 1) / perBlock));
  kernel<<<grid, kMmaThreads, shared, stream>>>(p, pageBytes, perBlock, extra...);
  return int(cudaGetLastError());
}

template <IndexKeyType Type, int D>
int launchMmaScores(const IndexerParams &p, cudaStream_t stream) {
  const size_t shared = mmaSharedBytes<D>();
  const DeviceSetup setup = deviceSetup([shared] {
    return cudaFuncSetAttribute(indexerScoresMmaKernel<Type, D>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  });
  return launchScoreTiles(indexerScoresMmaKernel<Type, D>, shared, p,
                          indexerPageBytes(Type, p.pageTokens, D), setup, stream);
}

template <IndexKeyType Type, int D>
int launchFp8Scores(const IndexerParams &p, cudaStream_t stream) {
  const size_t shared = fp8SharedBytes<D>();
  const DeviceSetup setup = deviceSetup([shared] {
    return cudaFuncSetAttribute(indexerScoresFp8Kernel<Type, D>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  });
  return launchScoreTiles(indexerScoresFp8Kernel<Type, D>, shared, p,
                          indexerPageBytes(Type, p.pageTokens, D), setup, stream);
}

template <IndexKeyType Type, int D>
int launchWarpgroupScores(const IndexerParams &p, cudaStream_t stream) {
  const size_t shared = warpgroupSharedBytes<D>();
  const DeviceSetup setup = deviceSetup([shared] {
    return cudaFuncSetAttribute(indexerScoresWarpgroupKernel<Type, D>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  });
  return launchScoreTiles(indexerScoresWarpgroupKernel<Type, D>, shared, p,
                          indexerPageBytes(Type, p.pageTokens, D), setup, stream,
                          selectWorkspace(p.selectWorkspace, p.rows, p.maxKeys));
}

int launchFp8WarpgroupScores(const IndexerParams &p, cudaStream_t stream) {
  const size_t shared = fp8WarpgroupSharedBytes();
  const DeviceSetup setup = deviceSetup([shared] {
    return cudaFuncSetAttribute(indexerScoresFp8WarpgroupKernel,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  });
  return launchScoreTiles<kFp8WarpgroupBlocksPerSm>(
      indexerScoresFp8WarpgroupKernel, shared, p,
      indexerPageBytes(IndexKeyType::Fp8PerKey, p.pageTokens, 128), setup, stream,
      selectWorkspace(p.selectWorkspace, p.rows, p.maxKeys));
}

// Whether the scores take the FP8 warpgroup kernel (Fp8PerKey keys, per-head FP8 queries).
bool scoresOnFp8Warpgroups(const IndexerParams &p) {
  using Kind = IndexerParams::ScoreKernel;
  return p.keyType == IndexKeyType::Fp8PerKey && p.fp8HeadQueries && p.headDim == 128 &&
         p.pageTokens % kTileKeys == 0 &&
         (p.scoreKernel == Kind::Auto || p.scoreKernel == Kind::Fp8Warpgroup);
}

// Whether the scores take one of the warpgroup kernels, which also prepare the top-k's first
// digit.
bool scoresOnWarpgroups(const IndexerParams &p) {
  using Kind = IndexerParams::ScoreKernel;
  return scoresOnFp8Warpgroups(p) ||
         (p.keyType != IndexKeyType::F32 && (p.mxfp8Queries || p.fp8HeadQueries) &&
          p.pageTokens % kTileKeys == 0 &&
          (p.scoreKernel == Kind::Auto || p.scoreKernel == Kind::Warpgroup));
}

template <IndexKeyType Type> int launchMmaScoresOf(const IndexerParams &p, cudaStream_t stream) {
  using Kind = IndexerParams::ScoreKernel;
  const bool mxfp8Tiles = (p.mxfp8Queries || p.fp8HeadQueries) && p.pageTokens % kTileKeys == 0;
  if constexpr (Type == IndexKeyType::Fp8PerKey)
    if (scoresOnFp8Warpgroups(p))
      return launchFp8WarpgroupScores(p, stream);
  if (scoresOnWarpgroups(p))
    return p.headDim == 128 ? launchWarpgroupScores<Type, 128>(p, stream)
                            : launchWarpgroupScores<Type, 64>(p, stream);
  if (p.scoreKernel == Kind::Fp8 && mxfp8Tiles)
    return p.headDim == 128 ? launchFp8Scores<Type, 128>(p, stream)
                            : launchFp8Scores<Type, 64>(p, stream);
  return p.headDim == 128 ? launchMmaScores<Type, 128>(p, stream)
                          : launchMmaScores<Type, 64>(p, stream);
}

} // namespace

int64_t indexerPageBytes(IndexKeyType type, int32_t pageTokens, int32_t headDim) {
  const int64_t codes = type == IndexKeyType::F32 ? 4 * int64_t(headDim) : headDim;
  const int64_t scales = type == IndexKeyType::Fp8PerKey ? 4
                         : type == IndexKeyType::Mxfp8   ? headDim / kMxBlock
                                                         : 0;
  return int64_t(pageTokens) * (codes + scales);
}

size_t indexerSelectWorkspaceBytes(int32_t rows, int32_t maxKeys, IndexerParams::SelectForm form) {
  if (rows <= 0 || maxKeys <= 0)
    return 0;
  return selectLayout(rows, maxKeys, form == IndexerParams::SelectForm::Gathered).total;
}

bool indexerFusedSupported(IndexKeyType type, int32_t headDim, int32_t maxKeys) {
  if (type == IndexKeyType::F32 || (headDim != 64 && headDim != 128) || maxKeys <= 0)
    return false;
  int blocks = 1;
  const int slice = headDim == 128 ? fusedSliceKeys<128>(maxKeys, blocks)
                                   : fusedSliceKeys<64>(maxKeys, blocks);
  const size_t fixed =
      headDim == 128 ? fusedFixedSharedBytes<128>() : fusedFixedSharedBytes<64>();
  return fixed + size_t(slice) * 4 <= size_t(maxSharedPerBlock());
}

int launchIndexerTopK(const IndexerParams &p, void *stream) {
  const bool fused = !p.scores;
  if (p.rows <= 0 || p.rows > 65535 || p.heads <= 0 || p.heads > kIndexerMaxHeads ||
      (p.headDim != 64 && p.headDim != 128) || !p.q || !p.headWeights || !p.positions ||
      !p.sequences || !p.keyPages || p.pageTokens <= 0 || !p.blockTables || p.maxPages <= 0 ||
      p.maxKeys <= 0 || p.topK <= 0 || p.topK > kIndexerMaxTopK || !p.indices ||
      (!fused && !p.selectWorkspace) ||
      (fused && !indexerFusedSupported(p.keyType, p.headDim, p.maxKeys)) ||
      (p.maxKeys + kScoreThreads - 1) / kScoreThreads > 65535 || p.tilesPerBlock < 0)
    return cudaErrorInvalidValue;
  const auto s = static_cast<cudaStream_t>(stream);
  if (fused)
    return p.keyType == IndexKeyType::Mxfp8
               ? (p.headDim == 128 ? launchFused<IndexKeyType::Mxfp8, 128>(p, s)
                                   : launchFused<IndexKeyType::Mxfp8, 64>(p, s))
               : (p.headDim == 128 ? launchFused<IndexKeyType::Fp8PerKey, 128>(p, s)
                                   : launchFused<IndexKeyType::Fp8PerKey, 64>(p, s));
  const bool warpgroup = scoresOnWarpgroups(p);
  const QueryLayout queries = scoresOnFp8Warpgroups(p) ? QueryLayout::E4M3
                              : warpgroup              ? QueryLayout::F16
                                                       : QueryLayout::None;
  int status = p.headDim == 128 ? launchSelectReset<128>(p, queries, s)
                                : launchSelectReset<64>(p, queries, s);
  if (status != 0)
    return status;
  status = p.keyType == IndexKeyType::F32
               ? (p.headDim == 128 ? launchFp32Scores<128>(p, s) : launchFp32Scores<64>(p, s))
           : p.keyType == IndexKeyType::Mxfp8 ? launchMmaScoresOf<IndexKeyType::Mxfp8>(p, s)
                                              : launchMmaScoresOf<IndexKeyType::Fp8PerKey>(p, s);
  if (status != 0)
    return status;
  return launchSelect(p, /*firstDigitChosen=*/warpgroup, s);
}

} // namespace hybrid::kernels::cuda
