// The DSA lightning indexer (see DsaIndexer.h): a scores kernel and a top-k kernel (one block
// per row, radix select on the scores' order-preserving bit patterns). FP8 keys go through the
// tensor cores: an E4M3 code is exact in bf16, so q . k is a bf16 mma of q (split into bf16
// hi + lo halves, about 16 significant bits; lo is zero for MXFP8-quantized queries and skipped)
// with the codes, summed per 32-value block and scaled by that block's key scale in fp32. fp32
// keys (the unquantized policy) take the CUDA-core kernel, one thread per key.
#include "hybrid/kernels/cuda/DsaIndexer.h"
#include "../common/warp_mma.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kScoreThreads = 128; // keys per block
constexpr int kSelectThreads = 1024;
constexpr int kMxBlock = 32;

__device__ inline float e4m3ToFloat(uint8_t code) {
  __nv_fp8_e4m3 value;
  value.__x = code;
  return float(value);
}

// E8M0: 2^(code - 127); 0xFF is NaN (ref::e8m0ToFloat).
__device__ inline float e8m0ToFloat(uint8_t code) {
  if (code == 0xFF)
    return __int_as_float(0x7fc00000);
  return code == 0 ? __int_as_float(0x00400000) : __int_as_float(int(code) << 23);
}

// 32 consecutive values of a key, dequantized exactly as ref::unpackIndexKeyToken does.
template <IndexKeyType Type, int D>
__device__ inline void loadKeyChunk(const unsigned char *page, int pageTokens, int slot, int chunk,
                                    float keyScale, float (&k)[kMxBlock]) {
  if constexpr (Type == IndexKeyType::F32) {
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
  } else {
    const float scale =
        Type == IndexKeyType::Mxfp8
            ? e8m0ToFloat(page[size_t(pageTokens) * D + size_t(slot) * (D / kMxBlock) + chunk])
            : keyScale;
    const uint4 *source =
        reinterpret_cast<const uint4 *>(page + size_t(slot) * D + chunk * kMxBlock);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint4 v = source[i];
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int b = 0; b < 4; ++b)
          k[16 * i + 4 * w + b] = e4m3ToFloat(uint8_t(words[w] >> (8 * b))) * scale;
    }
  }
}

template <IndexKeyType Type, int D>
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
  float keyScale = 1.0f;
  if constexpr (Type == IndexKeyType::Fp8PerKey)
    keyScale = *reinterpret_cast<const float *>(base + size_t(p.pageTokens) * D + size_t(slot) * 4);

  float acc[kIndexerMaxHeads];
#pragma unroll
  for (int j = 0; j < kIndexerMaxHeads; ++j)
    acc[j] = 0.0f;
#pragma unroll 1
  for (int chunk = 0; chunk < D / kMxBlock; ++chunk) {
    float k[kMxBlock];
    loadKeyChunk<Type, D>(base, p.pageTokens, slot, chunk, keyScale, k);
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
constexpr int kTileKeys = 64;
constexpr int kBlocksPerSm = 3;    // what 156 registers a thread leave room for
constexpr int kMmaMaxHeads = 64;   // 4 m-tiles of 16 heads

template <int D> __host__ __device__ constexpr int mmaStride() { return D + 8; } // bf16 per row: conflict-free ldmatrix

template <int D> size_t mmaSharedBytes() {
  return size_t(2 * kMmaMaxHeads + kTileKeys) * mmaStride<D>() * 2 +
         size_t(kTileKeys) * (D / kMxBlock) * 4 + size_t(kMmaMaxHeads) * 4;
}

template <IndexKeyType Type, int D>
__global__ void __launch_bounds__(kMmaThreads)
    indexerScoresMmaKernel(IndexerParams p, int64_t pageBytes, int tilesPerBlock) {
  static_assert(Type != IndexKeyType::F32, "fp32 keys take the CUDA-core kernel");
  constexpr int kStride = mmaStride<D>(), kBlocks = D / kMxBlock;
  extern __shared__ __align__(16) unsigned char smem[];
  auto *qHi = reinterpret_cast<__nv_bfloat16 *>(smem); // [64 heads, kStride]
  __nv_bfloat16 *qLo = qHi + kMmaMaxHeads * kStride;     // [64 heads, kStride]
  __nv_bfloat16 *keys = qLo + kMmaMaxHeads * kStride;    // [kTileKeys, kStride]: codes as bf16
  auto *scales = reinterpret_cast<float *>(keys + kTileKeys * kStride); // [kTileKeys, kBlocks]
  float *weights = scales + kTileKeys * kBlocks;                      // [64]: w * heads^-1/2
  const int row = blockIdx.x, heads = p.heads, tid = threadIdx.x;
  const int position = p.positions[row];
  const int firstKey = int(blockIdx.y) * kTileKeys * tilesPerBlock;
  if (firstKey > position)
    return;
  // q as bf16 hi + lo, four values per load and several loads in flight.
  const float4 *q = reinterpret_cast<const float4 *>(p.q + size_t(row) * heads * D);
  bool anyLo = false;
  constexpr int kQuads = kMmaMaxHeads * D / 4, kInFlight = 4;
  for (int first = tid; first < kQuads; first += kInFlight * kMmaThreads) {
    float4 loaded[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = first + u * kMmaThreads;
      loaded[u] = i < kQuads && i * 4 / D < heads ? q[i] : make_float4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = first + u * kMmaThreads;
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
  for (int j = tid; j < kMmaMaxHeads; j += kMmaThreads)
    weights[j] = j < heads ? p.headWeights[size_t(row) * heads + j] * headScale : 0.0f;
  const bool useLo = __syncthreads_or(anyLo);
  const int warp = tid / 32, lane = tid % 32, mTiles = (heads + 15) / 16;
  const float dotScale = 1.0f / sqrtf(float(D));
  const int32_t *table = p.blockTables + size_t(p.sequences[row]) * p.maxPages;
  const auto *pool = static_cast<const unsigned char *>(p.keyPages);

  // A tile's raw key bytes and scales, loaded into registers one tile ahead so that the loads
  // of tile t + 1 are in flight while tile t is multiplied.
  constexpr int kChunks = kTileKeys * (D / 16) / kMmaThreads;
  constexpr int kScaleSlots = (kTileKeys * kBlocks + kMmaThreads - 1) / kMmaThreads;
  uint4 raw[kChunks];
  float rawScales[kScaleSlots];
  auto loadTile = [&](int tileKey) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = tid + i * kMmaThreads, k = c / (D / 16), part = c % (D / 16);
      const int s = tileKey + k;
      raw[i] = make_uint4(0, 0, 0, 0);
      if (s <= position) {
        const unsigned char *page = pool + table[s / p.pageTokens] * pageBytes;
        raw[i] = *reinterpret_cast<const uint4 *>(page + size_t(s % p.pageTokens) * D + part * 16);
      }
    }
#pragma unroll
    for (int i = 0; i < kScaleSlots; ++i) {
      const int c = tid + i * kMmaThreads, k = c / kBlocks, block = c % kBlocks;
      const int s = tileKey + k;
      rawScales[i] = 0.0f;
      if (c < kTileKeys * kBlocks && s <= position) {
        const unsigned char *page = pool + table[s / p.pageTokens] * pageBytes;
        const int slot = s % p.pageTokens;
        rawScales[i] =
            Type == IndexKeyType::Mxfp8
                ? e8m0ToFloat(page[size_t(p.pageTokens) * D + size_t(slot) * kBlocks + block])
                : *reinterpret_cast<const float *>(page + size_t(p.pageTokens) * D +
                                                   size_t(slot) * 4);
      }
    }
  };
  loadTile(firstKey);
  for (int tile = 0; tile < tilesPerBlock; ++tile) {
    const int tileKey = firstKey + tile * kTileKeys;
    if (tileKey > position)
      break;
    __syncthreads(); // the previous tile's keys are consumed
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = tid + i * kMmaThreads, k = c / (D / 16), part = c % (D / 16);
      const uint32_t words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
      uint32_t packed[8];
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          packed[2 * w + h] = mma::packBf16(e4m3ToFloat(uint8_t(words[w] >> (16 * h))),
                                            e4m3ToFloat(uint8_t(words[w] >> (16 * h + 8))));
      auto *target = reinterpret_cast<uint4 *>(keys + k * kStride + part * 16);
      target[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      target[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
#pragma unroll
    for (int i = 0; i < kScaleSlots; ++i)
      if (tid + i * kMmaThreads < kTileKeys * kBlocks)
        scales[tid + i * kMmaThreads] = rawScales[i];
    __syncthreads();
    if (tile + 1 < tilesPerBlock && tileKey + kTileKeys <= position)
      loadTile(tileKey + kTileKeys);

    // This warp's 16 keys (two 8-key n-tiles) against every head (m-tiles of 16).
    float acc[4][2][4] = {};
#pragma unroll
    for (int block = 0; block < kBlocks; ++block) {
      float part[4][2][4] = {};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int k0 = block * kMxBlock + half * 16;
        uint32_t b0[2], b1[2];
        mma::loadBPair(b0, b1, keys + warp * 16 * kStride + k0, kStride);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          if (mt >= mTiles)
            continue;
          uint32_t a[4];
          mma::loadA(a, qHi + mt * 16 * kStride + k0, kStride);
          mma::mma16816(part[mt][0], a, b0);
          mma::mma16816(part[mt][1], a, b1);
          if (useLo) {
            mma::loadA(a, qLo + mt * 16 * kStride + k0, kStride);
            mma::mma16816(part[mt][0], a, b0);
            mma::mma16816(part[mt][1], a, b1);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float scale = scales[(warp * 16 + nt * 8 + mma::accColumn(e)) * kBlocks + block];
#pragma unroll
          for (int mt = 0; mt < 4; ++mt)
            acc[mt][nt][e] = fmaf(part[mt][nt][e], scale, acc[mt][nt][e]);
        }
    }
    // score[key] = sum over heads of w * ReLU(dot * D^-1/2): this lane's heads, then the 8 lanes
    // that share its key columns.
    float sums[2][2] = {};
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sums[nt][e & 1] +=
              weights[mt * 16 + mma::accRow(e)] * fmaxf(0.0f, acc[mt][nt][e] * dotScale);
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
            p.scores[size_t(row) * p.maxKeys + s] = sums[nt][c];
        }
  }
}

// Larger float -> larger unsigned key.
__device__ inline uint32_t orderKey(float value) {
  const uint32_t bits = __float_as_uint(value);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Radix select, 8 bits per pass from the top: after four passes `prefix` is the k-th largest
// key and `remaining` how many keys equal to it belong to the top k (the lowest positions).
__global__ void __launch_bounds__(kSelectThreads) indexerTopKKernel(IndexerParams p) {
  __shared__ uint32_t histogram[256];
  __shared__ int chosenBin, countAbove, greaterSlots;
  __shared__ int warpTies[kSelectThreads / 32];
  const int row = blockIdx.x, tid = threadIdx.x, k = p.topK;
  const int n = p.positions[row] + 1;
  const float *scores = p.scores + size_t(row) * p.maxKeys;
  int32_t *out = p.indices + size_t(row) * k;
  if (n <= k) { // every causal position
    for (int i = tid; i < k; i += kSelectThreads)
      out[i] = i < n ? i : -1;
    return;
  }
  uint32_t prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kSelectThreads)
      histogram[i] = 0;
    __syncthreads();
    constexpr int kInFlight = 8; // loads issued before the first is used: latency, not bandwidth
    for (int first = tid; first < n; first += kInFlight * kSelectThreads) {
      uint32_t keys[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int i = first + u * kSelectThreads;
        keys[u] = i < n ? orderKey(scores[i]) : 0u;
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (first + u * kSelectThreads < n && (keys[u] & mask) == prefix)
          atomicAdd(&histogram[(keys[u] >> shift) & 0xFFu], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      int above = 0, bin = 255;
      for (; bin > 0; --bin) {
        if (above + int(histogram[bin]) >= remaining)
          break;
        above += int(histogram[bin]);
      }
      chosenBin = bin;
      countAbove = above;
    }
    __syncthreads();
    prefix |= uint32_t(chosenBin) << shift;
    mask |= 0xFFu << shift;
    remaining -= countAbove;
    __syncthreads(); // chosenBin and countAbove are read before the next pass rewrites them
  }

  if (tid == 0)
    greaterSlots = 0;
  __syncthreads();
  const int greater = k - remaining;
  const int lane = tid % 32, warp = tid / 32;
  int tiesBefore = 0; // ties in earlier chunks (the same in every thread)
  for (int chunk = 0; chunk < n; chunk += kSelectThreads) {
    const int i = chunk + tid;
    const uint32_t key = i < n ? orderKey(scores[i]) : 0u;
    const bool above = i < n && key > prefix, tie = i < n && key == prefix;
    if (above)
      out[atomicAdd(&greaterSlots, 1)] = i;
    const unsigned ballot = __ballot_sync(0xffffffffu, tie);
    if (lane == 0)
      warpTies[warp] = __popc(ballot);
    __syncthreads();
    int rank = tiesBefore + __popc(ballot & ((1u << lane) - 1u)), total = 0;
    for (int w = 0; w < kSelectThreads / 32; ++w) {
      rank += w < warp ? warpTies[w] : 0;
      total += warpTies[w];
    }
    if (tie && rank < remaining)
      out[greater + rank] = i;
    tiesBefore += total;
    __syncthreads(); // warpTies is rewritten by the next chunk
  }
}

template <IndexKeyType Type, int D> int launchScores(const IndexerParams &p, cudaStream_t stream) {
  const dim3 grid(unsigned(p.rows), unsigned((p.maxKeys + kScoreThreads - 1) / kScoreThreads));
  const size_t shared = size_t(p.heads) * (D + 1) * sizeof(float);
  indexerScoresKernel<Type, D><<<grid, kScoreThreads, shared, stream>>>(
      p, indexerPageBytes(Type, p.pageTokens, D));
  return int(cudaGetLastError());
}

template <IndexKeyType Type, int D>
int launchMmaScores(const IndexerParams &p, cudaStream_t stream) {
  // As many key tiles per block as keep about two waves of blocks on the GPU: each block
  // converts its row's q once, so fewer, longer blocks when there are many rows.
  int device = 0, sms = 132;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int tiles = (p.maxKeys + kTileKeys - 1) / kTileKeys;
  const int wantedBlocks = std::max(1, 2 * kBlocksPerSm * sms / p.rows);
  const int tilesPerBlock = std::max(1, (tiles + wantedBlocks - 1) / wantedBlocks);
  const dim3 grid(unsigned(p.rows), unsigned((tiles + tilesPerBlock - 1) / tilesPerBlock));
  const size_t shared = mmaSharedBytes<D>();
  const cudaError_t attribute = cudaFuncSetAttribute(
      indexerScoresMmaKernel<Type, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  if (attribute != cudaSuccess)
    return int(attribute);
  indexerScoresMmaKernel<Type, D><<<grid, kMmaThreads, shared, stream>>>(
      p, indexerPageBytes(Type, p.pageTokens, D), tilesPerBlock);
  return int(cudaGetLastError());
}

template <IndexKeyType Type> int launchScoresOf(const IndexerParams &p, cudaStream_t stream) {
  if constexpr (Type == IndexKeyType::F32)
    return p.headDim == 128 ? launchScores<Type, 128>(p, stream)
                            : launchScores<Type, 64>(p, stream);
  else
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

int launchIndexerTopK(const IndexerParams &p, void *stream) {
  if (p.rows <= 0 || p.heads <= 0 || p.heads > kIndexerMaxHeads ||
      (p.headDim != 64 && p.headDim != 128) || !p.q || !p.headWeights || !p.positions ||
      !p.sequences || !p.keyPages || p.pageTokens <= 0 || !p.blockTables || p.maxPages <= 0 ||
      !p.scores || p.maxKeys <= 0 || p.topK <= 0 || p.topK > p.maxKeys || !p.indices ||
      (p.maxKeys + kScoreThreads - 1) / kScoreThreads > 65535)
    return cudaErrorInvalidValue;
  const auto s = static_cast<cudaStream_t>(stream);
  int status = p.keyType == IndexKeyType::F32     ? launchScoresOf<IndexKeyType::F32>(p, s)
               : p.keyType == IndexKeyType::Mxfp8 ? launchScoresOf<IndexKeyType::Mxfp8>(p, s)
                                                  : launchScoresOf<IndexKeyType::Fp8PerKey>(p, s);
  if (status != 0)
    return status;
  indexerTopKKernel<<<unsigned(p.rows), kSelectThreads, 0, s>>>(p);
  return int(cudaGetLastError());
}

} // namespace hybrid::kernels::cuda
