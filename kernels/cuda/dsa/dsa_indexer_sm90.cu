// The DSA lightning indexer (see DsaIndexer.h): a scores kernel (one thread per key, the row's
// query heads in shared memory) and a top-k kernel (one block per row, radix select on the
// scores' order-preserving bit patterns).
#include "hybrid/kernels/cuda/DsaIndexer.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

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
    for (int i = tid; i < n; i += kSelectThreads) {
      const uint32_t key = orderKey(scores[i]);
      if ((key & mask) == prefix)
        atomicAdd(&histogram[(key >> shift) & 0xFFu], 1u);
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

template <IndexKeyType Type> int launchScoresOf(const IndexerParams &p, cudaStream_t stream) {
  return p.headDim == 128 ? launchScores<Type, 128>(p, stream) : launchScores<Type, 64>(p, stream);
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
