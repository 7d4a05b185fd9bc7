// Sparse MLA decode (see SparseMla.h). One block per (row, 16 heads), 4 warps. Per tile of 32
// selected positions: the block gathers the rows from their pages into shared memory as bf16
// (exact), each warp computes the 16 x 8 scores of its 8 positions (bf16 MMAs over the 576-wide
// keys), 16 threads run the online softmax of the 16 heads, and each warp adds P V for its
// quarter of the latent dimensions (V = the latent part of the same rows, read transposed).
// Few rows split the positions over several blocks (flash-decoding), merged by a second kernel.
#include "hybrid/kernels/cuda/SparseMla.h"
#include "../common/device_setup.cuh"
#include "../common/warp_mma.cuh"
#include "fp8_device.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kThreads = 128, kWarps = 4;
constexpr int kHeadsPerBlock = 16;
constexpr int kTileKeys = 32;       // positions per tile: 8 per warp for the scores
constexpr int kScaleTile = 128;     // latent elements per fp32 scale (FlashMLA)
constexpr int kPStride = kTileKeys + 8; // bf16 per softmax-weight row (conflict-free ldmatrix)
constexpr int kMaxSplits = 32;

template <int L, int R> struct Shape {
  static constexpr int kWide = L + R;
  static constexpr int kStride = kWide + 8; // bf16 per shared row
  static constexpr int kScaleTiles = (L + kScaleTile - 1) / kScaleTile;
  static constexpr int kRopeOffset = L + 4 * kScaleTiles;
  static constexpr int kRowBytes = kRopeOffset + 2 * R;
  static constexpr int kCodePieces = L / 16;  // 16 codes each
  static constexpr int kRopePieces = R / 8;   // 8 bf16 each
  static constexpr int kPieces = kCodePieces + kRopePieces;
  // 16-byte loads need 16-byte aligned rows and rope parts (DeepSeek-V3.2's 656-byte rows are;
  // the tiny model's 132-byte rows are not: 4-byte loads there).
  static constexpr bool kVectorLoads = kRowBytes % 16 == 0 && kRopeOffset % 16 == 0;
  static constexpr int kDimsPerWarp = L / kWarps;
  static constexpr int kValueTiles = kDimsPerWarp / 8;
  static size_t sharedBytes() {
    return size_t(kHeadsPerBlock + kTileKeys) * kStride * 2 +
           size_t(kHeadsPerBlock) * kTileKeys * 4 + size_t(kHeadsPerBlock) * kPStride * 2 +
           size_t(kHeadsPerBlock) * 4 * 2 + size_t(kTileKeys) * (4 + sizeof(void *));
  }
};

template <bool kVector> __device__ inline uint4 load16(const unsigned char *p) {
  if constexpr (kVector)
    return *reinterpret_cast<const uint4 *>(p);
  const auto *words = reinterpret_cast<const uint32_t *>(p);
  return make_uint4(words[0], words[1], words[2], words[3]);
}

template <int L, int R>
__global__ void __launch_bounds__(kThreads)
    sparseMlaDecodeKernel(SparseMlaDecodeParams p, int tilesPerSplit, float *partials) {
  using S = Shape<L, R>;
  constexpr int kStride = S::kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  auto *qs = reinterpret_cast<__nv_bfloat16 *>(smem);               // [16 heads, kStride]
  __nv_bfloat16 *ks = qs + kHeadsPerBlock * kStride;                 // [32 positions, kStride]
  auto *scores = reinterpret_cast<float *>(ks + kTileKeys * kStride); // [16, 32]
  auto *weights = reinterpret_cast<__nv_bfloat16 *>(scores + kHeadsPerBlock * kTileKeys); // [16, kPStride]
  auto *rescale = reinterpret_cast<float *>(weights + kHeadsPerBlock * kPStride); // [16]
  float *denominators = rescale + kHeadsPerBlock;                                 // [16]
  auto *live = reinterpret_cast<int *>(denominators + kHeadsPerBlock);           // [32]
  auto *rows = reinterpret_cast<const unsigned char **>(live + kTileKeys);       // [32]

  const int row = blockIdx.x, headBase = int(blockIdx.y) * kHeadsPerBlock, tid = threadIdx.x;
  const int warp = tid / 32;
  // The 16 heads' absorbed queries in bf16 (heads past p.heads are zero).
  for (int i = tid; i < kHeadsPerBlock * S::kWide; i += kThreads) {
    const int h = i / S::kWide, d = i % S::kWide;
    const float v = headBase + h < p.heads
                        ? p.q[(size_t(row) * p.heads + headBase + h) * S::kWide + d]
                        : 0.0f;
    qs[h * kStride + d] = __float2bfloat16_rn(v);
  }
  static_assert(kHeadsPerBlock * 8 == kThreads, "8 lanes per head in the softmax");
  const int head = tid / 8, part = tid % 8;         // the softmax's head and positions
  float runningMax = -INFINITY, runningSum = 0.0f; // head `head`'s softmax state
  float o[S::kValueTiles][4] = {};
  const int32_t *table = p.blockTables + size_t(p.sequences[row]) * p.maxPages;
  const int32_t *indices = p.indices + size_t(row) * p.topK;
  const auto *pool = static_cast<const unsigned char *>(p.latentPages);
  const int64_t pageBytes = int64_t(p.pageTokens) * S::kRowBytes;

  // This block's split of the positions (flash-decoding): partial results when there are several.
  const int splits = int(gridDim.z), split = int(blockIdx.z);
  const int splitBegin = split * tilesPerSplit * kTileKeys;
  const int splitEnd = min(p.topK, splitBegin + tilesPerSplit * kTileKeys);
  for (int first = splitBegin; first < splitEnd; first += kTileKeys) {
    __syncthreads(); // the previous tile's rows and weights are consumed
    // Gather: the 32 rows' addresses first (one index -> table -> page chain per row, all rows
    // at once), then every 16-byte piece of them loaded before any is converted.
    if (tid < kTileKeys) {
      const int position = first + tid < splitEnd ? indices[first + tid] : -1;
      live[tid] = position >= 0;
      rows[tid] = position >= 0 ? pool + table[position / p.pageTokens] * pageBytes +
                                      size_t(position % p.pageTokens) * S::kRowBytes
                                : nullptr;
    }
    __syncthreads();
    constexpr int kPerThread = kTileKeys * S::kPieces / kThreads;
    uint4 raw[kPerThread];
    float scales[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int c = tid + i * kThreads, k = c / S::kPieces, piece = c % S::kPieces;
      const unsigned char *rowBytes = rows[k];
      raw[i] = make_uint4(0, 0, 0, 0);
      scales[i] = 0.0f;
      if (rowBytes) {
        if (piece < S::kCodePieces) {
          raw[i] = load16<S::kVectorLoads>(rowBytes + piece * 16);
          scales[i] = reinterpret_cast<const float *>(rowBytes + L)[piece * 16 / kScaleTile];
        } else {
          raw[i] = load16<S::kVectorLoads>(rowBytes + S::kRopeOffset +
                                           (piece - S::kCodePieces) * 16);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int c = tid + i * kThreads, k = c / S::kPieces, piece = c % S::kPieces;
      if (piece < S::kCodePieces) {
        const uint32_t words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
        uint32_t packed[8];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          packed[2 * w] = e4m3PairToBf16(uint16_t(words[w]), scales[i]);
          packed[2 * w + 1] = e4m3PairToBf16(uint16_t(words[w] >> 16), scales[i]);
        }
        auto *target = reinterpret_cast<uint4 *>(ks + k * kStride + piece * 16);
        target[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        target[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
      } else {
        *reinterpret_cast<uint4 *>(ks + k * kStride + L + (piece - S::kCodePieces) * 8) = raw[i];
      }
    }
    __syncthreads();

    // Scores: this warp's 8 positions against the 16 heads.
    // Two accumulators (even and odd k steps): half the dependent MMA chain.
    static_assert(S::kWide % 32 == 0, "k steps in pairs");
    float acc[2][4] = {};
#pragma unroll 2
    for (int k0 = 0; k0 < S::kWide; k0 += 32) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t a[4], b[2];
        mma::loadA(a, qs + k0 + 16 * half, kStride);
        mma::loadB(b, ks + warp * 8 * kStride + k0 + 16 * half, kStride);
        mma::mma16816(acc[half], a, b);
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e)
      scores[mma::accRow(e) * kTileKeys + warp * 8 + mma::accColumn(e)] =
          (acc[0][e] + acc[1][e]) * p.softmaxScale;
    __syncthreads();

    // Online softmax: 8 lanes per head, 4 positions per lane; every lane of a head keeps the
    // head's running max and sum.
    {
      float values[kTileKeys / 8];
      float tileMax = -INFINITY;
#pragma unroll
      for (int j = 0; j < kTileKeys / 8; ++j) {
        const int k = part * (kTileKeys / 8) + j;
        values[j] = live[k] ? scores[head * kTileKeys + k] : -INFINITY;
        tileMax = fmaxf(tileMax, values[j]);
      }
#pragma unroll
      for (int offset = 1; offset < 8; offset *= 2)
        tileMax = fmaxf(tileMax, __shfl_xor_sync(0xffffffffu, tileMax, offset));
      const float newMax = fmaxf(runningMax, tileMax);
      const float factor = newMax == -INFINITY ? 1.0f : expf(runningMax - newMax);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kTileKeys / 8; ++j) {
        const float w = values[j] == -INFINITY ? 0.0f : expf(values[j] - newMax);
        sum += w;
        weights[head * kPStride + part * (kTileKeys / 8) + j] = __float2bfloat16_rn(w);
      }
#pragma unroll
      for (int offset = 1; offset < 8; offset *= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      runningSum = runningSum * factor + sum;
      runningMax = newMax;
      if (part == 0)
        rescale[head] = factor;
    }
    __syncthreads();

    // O = O * rescale + P V over this warp's latent dimensions.
#pragma unroll
    for (int t = 0; t < S::kValueTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        o[t][e] *= rescale[mma::accRow(e)];
#pragma unroll
    for (int k0 = 0; k0 < kTileKeys; k0 += 16) {
      uint32_t a[4];
      mma::loadA(a, weights + k0, kPStride);
#pragma unroll
      for (int t = 0; t < S::kValueTiles; ++t) {
        uint32_t b[2];
        mma::loadBTrans(b, ks + k0 * kStride + warp * S::kDimsPerWarp + t * 8, kStride);
        mma::mma16816(o[t], a, b);
      }
    }
  }

  if (part == 0)
    denominators[head] = runningSum;
  // A split's partial: per head its running max and sum, then the unnormalized output.
  const size_t partialStride = size_t(L) + 2;
  auto partial = [&](int h) {
    return partials + ((size_t(row) * p.heads + headBase + h) * splits + split) * partialStride;
  };
  if (splits > 1 && part == 0 && headBase + head < p.heads) {
    partial(head)[0] = runningMax;
    partial(head)[1] = runningSum;
  }
  __syncthreads();
#pragma unroll
  for (int t = 0; t < S::kValueTiles; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = mma::accRow(e);
      if (headBase + h >= p.heads)
        continue;
      const int d = warp * S::kDimsPerWarp + t * 8 + mma::accColumn(e);
      if (splits > 1) {
        partial(h)[2 + d] = o[t][e];
      } else {
        const float sum = denominators[h];
        p.out[(size_t(row) * p.heads + headBase + h) * L + d] = sum > 0.0f ? o[t][e] / sum : 0.0f;
      }
    }
}

// The splits' partials of one (row, head) merged: out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
template <int L>
__global__ void __launch_bounds__(kThreads)
    sparseMlaCombineKernel(SparseMlaDecodeParams p, int splits, const float *partials) {
  const size_t item = size_t(blockIdx.x) * p.heads + blockIdx.y; // (row, head)
  const float *first = partials + item * splits * (size_t(L) + 2);
  float largest = -INFINITY;
  for (int s = 0; s < splits; ++s)
    largest = fmaxf(largest, first[s * (L + 2)]);
  float denominator = 0.0f;
  for (int s = 0; s < splits; ++s)
    if (first[s * (L + 2)] != -INFINITY)
      denominator += expf(first[s * (L + 2)] - largest) * first[s * (L + 2) + 1];
  for (int d = threadIdx.x; d < L; d += kThreads) {
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s)
      if (first[s * (L + 2)] != -INFINITY)
        sum += expf(first[s * (L + 2)] - largest) * first[s * (L + 2) + 2 + d];
    p.out[item * L + d] = denominator > 0.0f ? sum / denominator : 0.0f;
  }
}

// Splits of the positions so that about two waves of blocks run: batch 1 needs many, batch 64
// none.
int splitCount(const SparseMlaDecodeParams &p, int sms) {
  const int tiles = (p.topK + kTileKeys - 1) / kTileKeys;
  const int blocks = p.rows * ((p.heads + kHeadsPerBlock - 1) / kHeadsPerBlock);
  return std::max(1, std::min({tiles, kMaxSplits, (4 * sms + blocks - 1) / blocks}));
}

template <int L, int R> int launchShape(const SparseMlaDecodeParams &p, cudaStream_t stream) {
  const size_t shared = Shape<L, R>::sharedBytes();
  const DeviceSetup setup = deviceSetup([shared] {
    return cudaFuncSetAttribute(sparseMlaDecodeKernel<L, R>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  });
  if (setup.status != cudaSuccess)
    return int(setup.status);
  const int splits = splitCount(p, setup.multiprocessors);
  const int tiles = (p.topK + kTileKeys - 1) / kTileKeys;
  const int tilesPerSplit = (tiles + splits - 1) / splits;
  const int used = (tiles + tilesPerSplit - 1) / tilesPerSplit; // no empty split
  const dim3 grid(unsigned(p.rows), unsigned((p.heads + kHeadsPerBlock - 1) / kHeadsPerBlock),
                  unsigned(used));
  auto *partials = static_cast<float *>(p.workspace);
  sparseMlaDecodeKernel<L, R><<<grid, kThreads, shared, stream>>>(p, tilesPerSplit, partials);
  if (used > 1)
    sparseMlaCombineKernel<L><<<dim3(unsigned(p.rows), unsigned(p.heads)), kThreads, 0, stream>>>(
        p, used, partials);
  return int(cudaGetLastError());
}

} // namespace

int64_t sparseMlaRowBytes(int32_t latentDim, int32_t ropeDim) {
  return int64_t(latentDim) + 4 * ((latentDim + kScaleTile - 1) / kScaleTile) + 2 * int64_t(ropeDim);
}

int64_t latentRowBytes(LatentCacheType type, int32_t latentDim, int32_t ropeDim) {
  return type == LatentCacheType::F32 ? 4 * (int64_t(latentDim) + ropeDim)
                                      : sparseMlaRowBytes(latentDim, ropeDim);
}

size_t sparseMlaWorkspaceBytes(int32_t rows, int32_t heads, int32_t latentDim) {
  return rows > 0 && heads > 0 && latentDim > 0
             ? size_t(rows) * heads * kMaxSplits * (size_t(latentDim) + 2) * sizeof(float)
             : 0;
}

int launchSparseMlaDecode(const SparseMlaDecodeParams &p, void *stream) {
  if (p.rows <= 0 || p.heads <= 0 || p.topK <= 0 || !p.q || !p.indices || !p.sequences || !p.workspace ||
      !p.latentPages || p.pageTokens <= 0 || !p.blockTables || p.maxPages <= 0 || !p.out ||
      !std::isfinite(p.softmaxScale) || (p.heads + kHeadsPerBlock - 1) / kHeadsPerBlock > 65535)
    return cudaErrorInvalidValue;
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.latentDim == 512 && p.ropeDim == 64)
    return launchShape<512, 64>(p, s);
  if (p.latentDim == 64 && p.ropeDim == 32)
    return launchShape<64, 32>(p, s);
  return cudaErrorInvalidValue;
}

} // namespace hybrid::kernels::cuda
