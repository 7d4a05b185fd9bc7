// MoE (see Moe.h): the router in one block per token (its choices by rank among each warp's
// sorted first k, group scores a warp a group, and by one thread in the reference's order where
// the order decides sums), and the per-(token, expert) SwiGLU on CUDA cores: a warp per output
// row reading the expert's weight row once. Small bf16 steps stream the rows through shared memory
// by cp.async (the streamed form below); the others read them with loads, the token's input in
// shared memory.
#include "../common/activation.cuh"
#include "../common/block_reduce.cuh"
#include "../common/dependent_launch.cuh"
#include "../common/device_setup.cuh"
#include "../common/fp8_quant.cuh"
#include "../common/warp_mma.cuh" // cp.async
#include "../linear/gemv_arithmetic.cuh"
#include "hybrid/kernels/cuda/Moe.h"
#include "moe_combine.cuh"

#include <algorithm>
#include <cmath>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <type_traits>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;

using reduce::warpSum;

// a before b in the router's order: larger value, then lower index.
__device__ inline bool ranksBefore(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

// The larger two of a multiset as the reference's serial scan keeps them: `first` its largest,
// `second` the largest of the rest (a NaN never enters: no comparison with one holds).
struct TopTwo {
  float first = -INFINITY, second = -INFINITY;
  __device__ void add(float v) {
    if (v > first) {
      second = first;
      first = v;
    } else if (v > second) {
      second = v;
    }
  }
  // The top two of both multisets: the larger first, then the larger of the smaller first and
  // both seconds (the values one scan over both keeps).
  __device__ void merge(float otherFirst, float otherSecond) {
    const bool mineFirst = first >= otherFirst;
    const float lowerFirst = mineFirst ? otherFirst : first;
    first = mineFirst ? first : otherFirst;
    second = fmaxf(lowerFirst, fmaxf(second, otherSecond));
  }
};

// Launched as a programmatic dependent of the logits' GEMV: the bias loads while it drains.
__global__ void __launch_bounds__(kThreads) routerKernel(MoeRouterParams p) {
  __shared__ float scores[kMoeMaxExperts], choice[kMoeMaxExperts];
  __shared__ int chosen[kMoeMaxTopK];
  const int t = blockIdx.x, E = p.experts, tid = threadIdx.x;
  const float *logits = p.logits + size_t(t) * E;
  // The correction bias loads with the logits, not a barrier later: a decode token's router is
  // one block and all latency.
  constexpr int kBiasPerThread = kMoeMaxExperts / kThreads;
  float bias[kBiasPerThread];
#pragma unroll
  for (int j = 0; j < kBiasPerThread; ++j) {
    const int e = tid + j * kThreads;
    bias[j] = p.correctionBias && e < E ? p.correctionBias[e] : 0.0f;
  }
  waitForEarlierKernels(); // the logits are the GEMV's
  if (tid < p.topK)        // set by the ranks below (every one, unless a logit is NaN)
    chosen[tid] = -1;
  if (!p.softmax) {
    for (int e = tid; e < E; e += kThreads)
      scores[e] = 1.0f / (1.0f + expf(-logits[e]));
  } else {
    for (int e = tid; e < E; e += kThreads)
      scores[e] = logits[e];
    __syncthreads();
    if (tid == 0) { // the reference's order of the max and the sum
      float largest = scores[0];
      for (int e = 1; e < E; ++e)
        largest = fmaxf(largest, scores[e]);
      float sum = 0.0f;
      for (int e = 0; e < E; ++e)
        sum += scores[e] = expf(scores[e] - largest);
      for (int e = 0; e < E; ++e)
        scores[e] /= sum;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kBiasPerThread; ++j) {
    const int e = tid + j * kThreads;
    if (e < E)
      choice[e] = scores[e] + bias[j];
  }
  __syncthreads();
  if (p.groups > 1) {
    // Each group's score (its top two biased scores, or its top one) by a warp, the best groups
    // kept by one thread, the other groups' experts dropped by all. (One thread scanning every
    // expert took 26 us a DeepSeek-V3.2 layer on the H200.)
    __shared__ float groupScores[64];
    __shared__ bool keep[64];
    const int size = E / p.groups, lane = tid % 32;
    for (int g = tid / 32; g < p.groups; g += kWarps) {
      TopTwo top;
      for (int e = g * size + lane; e < (g + 1) * size; e += 32)
        top.add(choice[e]);
      for (int offset = 16; offset > 0; offset /= 2) {
        const float otherFirst = __shfl_xor_sync(0xffffffffu, top.first, offset);
        const float otherSecond = __shfl_xor_sync(0xffffffffu, top.second, offset);
        top.merge(otherFirst, otherSecond);
      }
      if (lane == 0)
        groupScores[g] = p.correctionBias && size >= 2 ? top.first + top.second : top.first;
    }
    __syncthreads();
    if (tid == 0) {
      for (int g = 0; g < p.groups; ++g)
        keep[g] = false;
      for (int k = 0; k < p.topKGroups; ++k) {
        int best = -1;
        for (int g = 0; g < p.groups; ++g)
          if (!keep[g] && (best < 0 || ranksBefore(groupScores[g], g, groupScores[best], best)))
            best = g;
        keep[best] = true;
      }
    }
    __syncthreads();
    for (int e = tid; e < E; e += kThreads)
      if (!keep[e / size])
        choice[e] = -INFINITY;
  }
  __syncthreads();
  if (E <= kThreads) {
    // The top k by rank, counted among candidates: each warp sorts its 32 experts (a bitonic
    // network, one decision per pair, so even NaN ties leave a permutation) and offers its
    // first k; an expert of the top k has only top-k experts before it, all of them offered,
    // so its rank among the candidates is its rank, and any other candidate's is >= k. The
    // first k then write themselves down. The same choices as ranking all E (a strict total
    // order), in far fewer instructions: ncu counted ~2100 a warp in this one-block kernel,
    // most of them the loop over all E (5.6 -> 3.9 us a Kimi-Linear layer on the H200).
    __shared__ float candidateValue[kThreads];
    __shared__ int candidateIndex[kThreads];
    const int lane = tid % 32, warp = tid / 32, offered = min(p.topK, 32);
    // Past E: last in the order (-inf, an index above every expert's).
    float v = tid < E ? choice[tid] : -INFINITY;
    int index = tid;
#pragma unroll
    for (int size = 2; size <= 32; size *= 2) {
#pragma unroll
      for (int stride = size / 2; stride > 0; stride /= 2) {
        const float otherValue = __shfl_xor_sync(0xffffffffu, v, stride);
        const int otherIndex = __shfl_xor_sync(0xffffffffu, index, stride);
        const bool lower = (lane & stride) == 0, firstFirst = (lane & size) == 0;
        // The pair's decision, the same in both lanes: does the upper element go first?
        const float upperValue = lower ? otherValue : v, lowerValue = lower ? v : otherValue;
        const int upperIndex = lower ? otherIndex : index, lowerIndex = lower ? index : otherIndex;
        const bool exchange = firstFirst ? ranksBefore(upperValue, upperIndex, lowerValue, lowerIndex)
                                         : ranksBefore(lowerValue, lowerIndex, upperValue, upperIndex);
        if (exchange) {
          v = otherValue;
          index = otherIndex;
        }
      }
    }
    if (lane < offered) {
      candidateValue[warp * offered + lane] = v;
      candidateIndex[warp * offered + lane] = index;
    }
    __syncthreads();
    const int candidates = kWarps * offered;
    if (tid < candidates) {
      const float mine = candidateValue[tid];
      const int mineIndex = candidateIndex[tid];
      int rank = 0;
#pragma unroll 8
      for (int j = 0; j < candidates; ++j)
        rank += ranksBefore(candidateValue[j], candidateIndex[j], mine, mineIndex);
      if (rank < p.topK && mineIndex < E)
        chosen[rank] = mineIndex;
    }
    __syncthreads();
    if (tid >= 32)
      return;
  } else {
    // More experts than threads: the top k, one warp-wide argmax per pick (no block barrier
    // between picks). Lane l owns experts l + 32 i, bit i of its `taken` mask. The ranking is a
    // strict total order, so the pick is the one a block-wide argmax makes.
    if (tid >= 32)
      return;
    const int lane = tid;
    uint32_t taken = 0;
    for (int k = 0; k < p.topK; ++k) {
      float best = -INFINITY;
      int index = -1;
      for (int e = lane, i = 0; e < E; e += 32, ++i)
        if (!(taken >> i & 1u) && (index < 0 || ranksBefore(choice[e], e, best, index))) {
          best = choice[e];
          index = e;
        }
      for (int offset = 16; offset > 0; offset /= 2) {
        const float otherValue = __shfl_xor_sync(0xffffffffu, best, offset);
        const int otherIndex = __shfl_xor_sync(0xffffffffu, index, offset);
        if (otherIndex >= 0 && (index < 0 || ranksBefore(otherValue, otherIndex, best, index))) {
          best = otherValue;
          index = otherIndex;
        }
      }
      if (index % 32 == lane)
        taken |= 1u << (index / 32);
      if (lane == 0)
        chosen[k] = index;
    }
  }
  __syncwarp();
  if (tid == 0) { // weights in the choice order, summed in that order
    // A slot no rank took (NaN logits tie with everything) stays -1, an id the experts skip.
    auto scoreOf = [&](int k) { return chosen[k] >= 0 ? scores[chosen[k]] : 0.0f; };
    float sum = 0.0f;
    for (int k = 0; k < p.topK; ++k)
      sum += scoreOf(k);
    for (int k = 0; k < p.topK; ++k) {
      float weight = scoreOf(k);
      if (p.renormalize)
        weight /= sum + 1e-20f;
      weight *= p.routedScalingFactor;
      p.ids[size_t(t) * p.topK + k] = chosen[k];
      p.weights[size_t(t) * p.topK + k] = weight;
    }
  }
}

template <typename T> __device__ inline float2 pairAt(const T *row, int i);
template <> __device__ inline float2 pairAt<__nv_bfloat16>(const __nv_bfloat16 *row, int i) {
  return __bfloat1622float2(reinterpret_cast<const __nv_bfloat162 *>(row)[i]);
}
template <> __device__ inline float2 pairAt<float>(const float *row, int i) {
  return reinterpret_cast<const float2 *>(row)[i];
}

template <> __device__ inline float2 pairAt<uint8_t>(const uint8_t *row, int i) {
  return quant::fp8PairToFloat2(reinterpret_cast<const __nv_fp8x2_storage_t *>(row)[i]);
}

// row . v over `width` values (even), lanes over value pairs. For FP8 rows `scales` holds the
// row's block scales, one per 128 columns: each weight is its code times its block's scale.
// kUnroll > 0 puts that many of a lane's loads in flight together (0: the compiler's choice,
// which `#pragma unroll 1` would forbid); the sum runs in i order either way.
template <typename T, int kUnroll = 0>
__device__ inline float rowDot(const T *row, const float *v, int width, int lane,
                               const float *scales = nullptr) {
  float sum = 0.0f;
  auto add = [&](int i) {
    float2 w = pairAt(row, i);
    if constexpr (sizeof(T) == 1) {
      const float scale = scales[2 * i / 128];
      w.x *= scale;
      w.y *= scale;
    }
    sum = fmaf(w.x, v[2 * i], sum);
    sum = fmaf(w.y, v[2 * i + 1], sum);
  };
  if constexpr (kUnroll > 0) {
#pragma unroll kUnroll
    for (int i = lane; i < width / 2; i += 32)
      add(i);
  } else {
    for (int i = lane; i < width / 2; i += 32)
      add(i);
  }
  return warpSum(sum);
}

// The FP8 GEMM's activation rounding: a 128-value tile's scale by its rule from its largest
// magnitude (quant::fp8TileScale), then each value to the E4M3 code of value / scale and back
// times scale, as ref::quantizeFp8Tiles then dequantizeFp8Tiles.
__device__ inline float fp8TileRounded(float value, float scale) {
  const __half_raw code =
      __nv_cvt_fp8_to_halfraw(quant::floatToE4M3(__fdiv_rn(value, scale)), __NV_E4M3);
  return __half2float(__half(code)) * scale;
}

// FP8 rows of whole 16-byte chunks (DeepSeek-V3.2's 7168 and 2048): lane l loads chunks l,
// l + 32, ... whole (16 codes under one block scale), where a load a 2-byte pair ran the FP8
// experts at 1.2-1.4 TB/s (H200, batch 1). The vector sits in shared memory chunk-interleaved,
// value 16 c + 4 q + r at float4 (4 (c / 32) + q) 32 + c % 32, element r: a warp's float4 reads
// of quarter q of its 32 chunks are 512 adjacent bytes, free of bank conflicts (in natural order
// lanes 64 bytes apart would share banks four ways).
constexpr int kFp8Chunk = 16;
// Whether loadVector interleaves a width's vector (FP8 rows of whole chunks).
template <typename T> __host__ __device__ constexpr bool interleavesVector(int width) {
  return sizeof(T) == 1 && width % kFp8Chunk == 0;
}
__device__ inline int interleavedIndex(int n) {
  const int c = n / kFp8Chunk, q = n % kFp8Chunk / 4, r = n % 4;
  return ((c / 32 * 4 + q) * 32 + c % 32) * 4 + r;
}

// source[0, width) (global) rounded per 128-value tile (fp8TileRounded, the tile's scale from its
// largest magnitude), each value to its place in v (shared; interleavedIndex when interleaved),
// a warp a tile.
__device__ inline void loadRounded(const float *source, float *v, int width,
                                   Fp8ActivationScale rule, bool interleaved) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int first = warp * 128; first < width; first += kWarps * 128) {
    float values[4];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = first + lane + 32 * i;
      values[i] = n < width ? source[n] : 0.0f;
      amax = fmaxf(amax, fabsf(values[i]));
    }
    for (int offset = 16; offset > 0; offset /= 2)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const float scale = quant::fp8TileScale(amax, rule);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = first + lane + 32 * i;
      if (n < width)
        v[interleaved ? interleavedIndex(n) : n] = fp8TileRounded(values[i], scale);
    }
  }
}

// row . v for an FP8 row of width / 16 chunks and an interleaved v: each weight its code times
// its block's scale (as rowDot), a lane's chunks in order, each chunk's values in order, with
// fmaf from zero, then warpSum. Rows 16-byte aligned (the archive's pages, and width % 16 == 0).
__device__ inline float fp8ChunkRowDot(const uint8_t *row, const float *v, int width, int lane,
                                       const float *scales) {
  const auto *quarters = reinterpret_cast<const float4 *>(v);
  float sum = 0.0f;
#pragma unroll 4
  for (int c = lane; c < width / kFp8Chunk; c += 32) {
    const uint4 codes = gemv_arithmetic::loadStreaming(row + size_t(c) * kFp8Chunk);
    const float scale = scales[c * kFp8Chunk / 128];
    const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 x = quarters[(c / 32 * 4 + q) * 32 + lane];
      const float2 low = quant::fp8PairToFloat2(words[q] & 0xffffu),
                   high = quant::fp8PairToFloat2(words[q] >> 16);
      sum = fmaf(low.x * scale, x.x, sum);
      sum = fmaf(low.y * scale, x.y, sum);
      sum = fmaf(high.x * scale, x.z, sum);
      sum = fmaf(high.y * scale, x.w, sum);
    }
  }
  return warpSum(sum);
}

// A block's copy of the vector its rows multiply (x for gate/up, h for down) in shared memory:
// as it is for bf16 and fp32 rows; for FP8 rows rounded per 128-value tile as the FP8 GEMM
// rounds its activations, interleaved for fp8ChunkRowDot when the width is whole chunks.
// Returns whether interleaved (the same for every block of a launch).
template <typename T>
__device__ inline bool loadVector(const float *source, float *v, int width,
                                  Fp8ActivationScale rule) {
  if constexpr (sizeof(T) == 1) {
    const bool interleaved = interleavesVector<T>(width);
    loadRounded(source, v, width, rule, interleaved);
    __syncthreads();
    return interleaved;
  } else {
    for (int i = threadIdx.x; i < width; i += kThreads)
      v[i] = source[i];
    __syncthreads();
    return false;
  }
}

// row . v as loadVector left v: fp8ChunkRowDot when interleaved, else rowDot.
template <typename T, int kUnroll = 0>
__device__ inline float vectorDot(const T *row, const float *v, bool interleaved, int width,
                                  int lane, const float *scales) {
  if constexpr (sizeof(T) == 1)
    if (interleaved)
      return fp8ChunkRowDot(row, v, width, lane, scales);
  return rowDot<T, kUnroll>(row, v, width, lane, scales);
}

// Rows a warp takes: FP8 blocks cover more rows, so that the activation prologue (7168 values
// loaded and rounded per block) runs for fewer of them; a row's sums are the same either way.
// H200, hybrid-bench moe --fp8 at DeepSeek-V3.2's shapes (1 / 8 tokens): 1 row each 176 / 1281
// us, gate/up 2 down 4 131 / 926, gate/up 2 down 8 129 / 885, gate/up 4 down 8 127 / 841.
template <typename T> constexpr int kGateUpRowsPerWarp = sizeof(T) == 1 ? 4 : 1;
template <typename T> constexpr int kDownRowsPerWarp = sizeof(T) == 1 ? 8 : 1;

// Block (token-slot, kWarps kGateUpRowsPerWarp rows of the intermediate; warp w takes rows w,
// w + kWarps, ... of them): h = silu(gate x) * up x.
template <typename T>
__global__ void __launch_bounds__(kThreads) gateUpKernel(MoeExpertsParams p, float *h) {
  extern __shared__ float x[];
  waitForEarlierKernels(); // the router's ids, x
  letDependentsLaunch();
  const int slot = blockIdx.x, token = slot / p.topK;
  const int expert = p.ids[slot];
  if (!expertHeld(p, expert)) // the whole block: an invalid or absent expert adds nothing
    return;
  const bool interleaved =
      loadVector<T>(p.x + size_t(token) * p.hidden, x, p.hidden, p.activationScale);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kRows = kGateUpRowsPerWarp<T>;
#pragma unroll 1 // a row at a time: the registers (and so the blocks an SM) of one row
  for (int i = 0; i < kRows; ++i) {
    const int row = (int(blockIdx.y) * kRows + i) * kWarps + warp;
    if (row >= p.intermediate)
      return;
    const T *gate = static_cast<const T *>(p.gate[expert]) + size_t(row) * p.hidden;
    const T *up = static_cast<const T *>(p.up[expert]) + size_t(row) * p.hidden;
    const float *gateScales = nullptr, *upScales = nullptr;
    if constexpr (sizeof(T) == 1) {
      gateScales = p.gateScales[expert] + size_t(row / 128) * p.gateScaleStride;
      upScales = p.upScales[expert] + size_t(row / 128) * p.gateScaleStride;
    }
    // FP8 rows not of whole chunks: 2-byte loads, unrolled by 8 to keep several in flight
    // (7168 wide: 241 -> 163 us a layer at batch 1, H200); bf16 rows measured slower unrolled.
    constexpr int kUnroll = sizeof(T) == 1 ? 8 : 0;
    const float g = vectorDot<T, kUnroll>(gate, x, interleaved, p.hidden, lane, gateScales);
    const float u = vectorDot<T, kUnroll>(up, x, interleaved, p.hidden, lane, upScales);
    if (lane == 0)
      h[size_t(slot) * p.intermediate + row] = gatedActivationValue(p.activation, g, u);
  }
}

// Block (token-slot, kWarps kDownRowsPerWarp rows of the output, taken as gate/up's): y = down h.
template <typename T>
__global__ void __launch_bounds__(kThreads) downKernel(MoeExpertsParams p, const float *h,
                                                       float *y) {
  extern __shared__ float hs[];
  waitForEarlierKernels();
  letDependentsLaunch();
  const int slot = blockIdx.x, expert = p.ids[slot];
  if (!expertHeld(p, expert)) // the whole block; gateUpKernel wrote no h for it
    return;
  const bool interleaved =
      loadVector<T>(h + size_t(slot) * p.intermediate, hs, p.intermediate, p.activationScale);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kRows = kDownRowsPerWarp<T>;
#pragma unroll 1
  for (int i = 0; i < kRows; ++i) {
    const int row = (int(blockIdx.y) * kRows + i) * kWarps + warp;
    if (row >= p.hidden)
      return;
    const T *down = static_cast<const T *>(p.down[expert]) + size_t(row) * p.intermediate;
    const float *scales = nullptr;
    if constexpr (sizeof(T) == 1)
      scales = p.downScales[expert] + size_t(row / 128) * p.downScaleStride;
    const float v = vectorDot(down, hs, interleaved, p.intermediate, lane, scales);
    if (lane == 0)
      y[size_t(slot) * p.hidden + row] = v;
  }
}

// Block (token, kThreads columns): its experts' weighted outputs added in ascending expert
// order, from zero. Column blocks spread a decode token over many SMs.
__global__ void __launch_bounds__(kThreads) combineKernel(MoeExpertsParams p, const float *y) {
  waitForEarlierKernels();
  letDependentsLaunch();
  combineToken(p, y, [&](int token, int slot) -> int64_t {
    const int32_t expert = p.ids[int64_t(token) * p.topK + slot];
    return expertHeld(p, expert) ? int64_t(token) * p.topK + slot : -1;
  });
}

__global__ void gatherRowsKernel(const float *x, int64_t width, const int32_t *rows, int32_t count,
                                 float *out) {
  const int64_t total = int64_t(count) * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = x[int64_t(rows[i / width]) * width + i % width];
}

__global__ void scatterAddRowsKernel(const float *in, int64_t width, const int32_t *rows,
                                     const float *scales, int32_t count, float *out) {
  const int64_t total = int64_t(count) * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width;
    float &target = out[int64_t(rows[r]) * width + i % width];
    target = __fadd_rn(target, __fmul_rn(scales[r], in[i]));
  }
}

// The streamed form (bf16 experts, steps of up to kStreamedMaxPairs pairs): a block per SM,
// each of its 8 warps with its own ring of shared-memory buffers that it fills with whole weight
// rows by cp.async, and the token's vector in registers. gate/up and down are one dependent
// launch each, sized so that a down block fits on an SM beside a gate/up block: down's blocks
// start while gate/up streams and copy their first rows before they wait for h, so the stream
// does not drain at the boundary; the combine runs in down's blocks (a block owns a range of
// output columns for every pair), one launch less. Every dot product is rowDot's (lane l adds
// pairs l, l + 32, ... with fmaf from zero, then warpSum) and the combine is combinedColumn, so
// the outputs are the scalar kernels' bits. Measured on the H200 (docs/performance.md, session
// 14): bulk copies by the TMA engine, one per row, were 2x slower than the scalar kernels; with
// cp.async the warps' fmaf chains, not the bytes, bound the time, hence two rows a unit.
constexpr int kStreamWarps = 8, kStreamThreads = kStreamWarps * 32;
// Units in flight a warp: a gate/up unit is two rows of `hidden` bf16, a down unit two rows of
// `intermediate`; the rings of both launches fit an SM together (228 KB, 1 KB reserved each).
constexpr int kGateUpDepth = 2, kDownDepth = 2;
constexpr size_t kGateUpRingBytes = 148 * 1024, kDownRingBytes = 64 * 1024;

// Shared bytes of the two launches' rings (down's followed by its pairs' expert orders).
__host__ __device__ inline size_t gateUpRingBytes(int hidden) {
  return size_t(kStreamWarps) * kGateUpDepth * 4 * hidden;
}
__host__ __device__ inline size_t downRingBytes(int intermediate) {
  return size_t(kStreamWarps) * kDownDepth * 4 * intermediate;
}

// A warp's ring: unit j of the warp's sequence lands in buffer j % kDepth. Every lane copies
// 16-byte chunks lane, lane + 32, ... of a unit and commits one group per unit (an empty one
// past the warp's last unit), so waiting for all but the newest kDepth - 1 groups and a warp
// barrier make unit j readable by the whole warp.
template <int kDepth> struct WarpRing {
  unsigned char *buffers;
  unsigned unitBytes;

  __device__ WarpRing(unsigned char *shared, unsigned unitBytes)
      : buffers(shared + size_t(threadIdx.x / 32) * kDepth * unitBytes), unitBytes(unitBytes) {}
  __device__ unsigned char *buffer(int j) const { return buffers + size_t(j % kDepth) * unitBytes; }
  // `bytes` of `source` to offset `at` of unit j's buffer (this lane's chunks).
  __device__ void copy(int j, unsigned at, const unsigned char *source, unsigned bytes) const {
    unsigned char *destination = buffer(j) + at;
    for (unsigned chunk = threadIdx.x % 32; chunk < bytes / 16; chunk += 32)
      mma::copyAsync16(destination + 16 * chunk, source + 16 * chunk);
  }
  __device__ void wait() const {
    mma::waitAsyncCopies<kDepth - 1>();
    __syncwarp();
  }
};

// The expert of the pair a warp works on and its matrices, looked up again only when the pair
// changes: the id and pointer loads are dependent round trips that would otherwise delay every
// row's copy (a warp's units run through few pairs).
struct PairLookup {
  int slot = -1;
  bool held = false;
  const unsigned char *first = nullptr, *second = nullptr; // gate and up, or down

  // `early`: before the launch's wait, the ids read from L2 (written two launches back).
  __device__ void at(const MoeExpertsParams &p, int pair, bool down, bool early) {
    if (pair == slot)
      return;
    slot = pair;
    const int expert = early ? __ldcg(p.ids + pair) : p.ids[pair];
    held = expertHeld(p, expert);
    if (held) {
      first = static_cast<const unsigned char *>(down ? p.down[expert] : p.gate[expert]);
      second = down ? nullptr : static_cast<const unsigned char *>(p.up[expert]);
    }
  }
};

// Lane `lane`'s pairs of a vector of 64 kPairs floats (pairs lane, lane + 32, ...) in
// registers: a warp's rows all dot the same token's vector, which then costs no load per row.
template <int kPairs> struct LanePairs {
  float2 values[kPairs];

  __device__ void load(const float *vector, int lane) {
    const auto *pairs = reinterpret_cast<const float2 *>(vector);
#pragma unroll
    for (int k = 0; k < kPairs; ++k)
      values[k] = pairs[lane + 32 * k];
  }
  // rowDot's sums over bf16 rows in shared memory (before the warp sums), two rows at once so
  // that their fmaf chains overlap.
  __device__ float2 dot2(const __nv_bfloat162 *first, const __nv_bfloat162 *second,
                         int lane) const {
    float a = 0.0f, b = 0.0f;
#pragma unroll
    for (int k = 0; k < kPairs; ++k) {
      const float2 wa = __bfloat1622float2(first[lane + 32 * k]),
                   wb = __bfloat1622float2(second[lane + 32 * k]);
      a = fmaf(wa.x, values[k].x, a);
      b = fmaf(wb.x, values[k].x, b);
      a = fmaf(wa.y, values[k].y, a);
      b = fmaf(wb.y, values[k].y, b);
    }
    return {a, b};
  }
  __device__ float dot(const __nv_bfloat162 *row, int lane) const {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kPairs; ++k) {
      const float2 w = __bfloat1622float2(row[lane + 32 * k]);
      sum = fmaf(w.x, values[k].x, sum);
      sum = fmaf(w.y, values[k].y, sum);
    }
    return sum;
  }
};

// A warp's place in its run of units, (pair, row) advanced one unit at a time: no division
// per unit (64-bit divisions were most of a unit's instructions).
struct UnitCursor {
  int pair, row;
  int rows; // rows a pair
  __device__ UnitCursor(int64_t unit, int rows)
      : pair(int(unit / rows)), row(int(unit % rows)), rows(rows) {}
  __device__ void next() {
    if (++row == rows) {
      row = 0;
      ++pair;
    }
  }
};

// The units [first, last) of a block split into kStreamWarps contiguous runs: a warp's units
// then share their token (gate/up) or pair (down) and its vector in registers.
struct WarpRun {
  int64_t first, last;
  __device__ WarpRun(int64_t blockFirst, int64_t blockLast) {
    const int64_t n = blockLast - blockFirst, warp = threadIdx.x / 32;
    first = blockFirst + n * warp / kStreamWarps;
    last = blockFirst + n * (warp + 1) / kStreamWarps;
  }
  __device__ int count() const { return int(last - first); }
};

// Block: a contiguous share of the (pair, intermediate row) units, a contiguous run of it a
// warp: a unit is gate and up row `row` of the pair's expert, h = act(gate x, up x).
template <int kPairs>
__global__ void __launch_bounds__(kStreamThreads)
    gateUpStreamedKernel(MoeExpertsParams p, float *h) {
  extern __shared__ __align__(128) unsigned char shared[];
  const int lane = threadIdx.x % 32;
  const unsigned rowBytes = unsigned(p.hidden) * 2u;
  const WarpRing<kGateUpDepth> ring(shared, 2u * rowBytes);
  waitForEarlierKernels(); // the router's ids, x
  letDependentsLaunch();
  const int64_t units = int64_t(p.tokens) * p.topK * p.intermediate;
  const WarpRun run(units * blockIdx.x / gridDim.x, units * (blockIdx.x + 1) / gridDim.x);
  const int count = run.count();
  UnitCursor next(run.first, p.intermediate); // the unit copied next
  PairLookup issued;
  auto issue = [&](int j) {
    if (j < count) {
      issued.at(p, next.pair, false, false);
      if (issued.held) {
        const size_t offset = size_t(next.row) * rowBytes;
        ring.copy(j, 0, issued.first + offset, rowBytes);
        ring.copy(j, rowBytes, issued.second + offset, rowBytes);
      }
      next.next();
    }
    mma::commitAsyncCopies();
  };
  for (int j = 0; j < kGateUpDepth; ++j)
    issue(j);
  LanePairs<kPairs> x;
  int token = -1;
  PairLookup pair;
  UnitCursor at(run.first, p.intermediate);
  for (int j = 0; j < count; ++j, at.next()) {
    pair.at(p, at.pair, false, false);
    if (at.pair / p.topK != token) {
      token = at.pair / p.topK;
      x.load(p.x + size_t(token) * p.hidden, lane);
    }
    ring.wait();
    if (pair.held) {
      const auto *gate = reinterpret_cast<const __nv_bfloat162 *>(ring.buffer(j));
      const float2 gu = x.dot2(gate, gate + p.hidden / 2, lane);
      const float g = warpSum(gu.x), u = warpSum(gu.y);
      if (lane == 0)
        h[size_t(at.pair) * p.intermediate + at.row] = gatedActivationValue(p.activation, g, u);
    }
    __syncwarp(); // the buffer is read before it is refilled
    issue(j + kGateUpDepth);
  }
}

// Block: output columns [first, last) of every pair (units pair-major, a contiguous run of them
// a warp: row `column` of the pair's down matrix dotted with its h), then those columns of
// every token combined. The first rows are copied before the wait: they are weights, and the
// ids they need were written before gate/up (which only lets this launch start once its own
// wait for them has passed), read from L2.
template <int kPairs>
__global__ void __launch_bounds__(kStreamThreads)
    downStreamedKernel(MoeExpertsParams p, const float *h, float *y) {
  extern __shared__ __align__(128) unsigned char shared[];
  const int lane = threadIdx.x % 32;
  const unsigned rowBytes = unsigned(p.intermediate) * 2u;
  const WarpRing<kDownDepth> ring(shared, 2 * rowBytes);
  int *order = reinterpret_cast<int *>(shared + downRingBytes(p.intermediate));
  const int slots = p.tokens * p.topK;
  const int first = int(int64_t(p.hidden) * blockIdx.x / gridDim.x),
            last = int(int64_t(p.hidden) * (blockIdx.x + 1) / gridDim.x), columns = last - first;
  // A unit: columns first + 2 row and the next one (when in the block) of a pair, two rows
  // whose sums' fmaf chains overlap.
  const int columnPairs = (columns + 1) / 2;
  const WarpRun run(0, int64_t(slots) * columnPairs);
  const int count = run.count();
  UnitCursor next(run.first, columnPairs); // the unit copied next
  PairLookup issued;
  auto issue = [&](int j, bool early) {
    if (j < count) {
      issued.at(p, next.pair, true, early);
      const int column = 2 * next.row;
      if (issued.held)
        ring.copy(j, 0, issued.first + size_t(first + column) * rowBytes,
                  (column + 1 < columns ? 2 : 1) * rowBytes);
      next.next();
    }
    mma::commitAsyncCopies();
  };
  for (int j = 0; j < kDownDepth; ++j)
    issue(j, true);
  waitForEarlierKernels(); // h
  letDependentsLaunch();
  for (int t = threadIdx.x; t < p.tokens; t += kStreamThreads)
    sortSlotsByExpert(p.ids + int64_t(t) * p.topK, p.topK, order + t * p.topK);
  LanePairs<kPairs> v;
  int loaded = -1;
  PairLookup pair;
  UnitCursor at(run.first, columnPairs);
  for (int j = 0; j < count; ++j, at.next()) {
    pair.at(p, at.pair, true, false);
    ring.wait();
    if (pair.held) {
      if (at.pair != loaded) {
        loaded = at.pair;
        v.load(h + size_t(at.pair) * p.intermediate, lane);
      }
      const auto *rows = reinterpret_cast<const __nv_bfloat162 *>(ring.buffer(j));
      const int column = 2 * at.row;
      if (column + 1 < columns) {
        const float2 sums = v.dot2(rows, rows + p.intermediate / 2, lane);
        const float a = warpSum(sums.x), b = warpSum(sums.y);
        if (lane == 0) {
          y[size_t(at.pair) * p.hidden + first + column] = a;
          y[size_t(at.pair) * p.hidden + first + column + 1] = b;
        }
      } else {
        const float a = warpSum(v.dot(rows, lane));
        if (lane == 0)
          y[size_t(at.pair) * p.hidden + first + column] = a;
      }
    }
    __syncwarp();
    issue(j + kDownDepth, false);
  }
  __syncthreads(); // y's columns of the block and the orders
  for (int i = threadIdx.x; i < p.tokens * columns; i += kStreamThreads) {
    const int token = i / columns, column = first + i % columns;
    const int32_t *ids = p.ids + int64_t(token) * p.topK;
    p.out[int64_t(token) * p.hidden + column] = combinedColumn(
        order + token * p.topK, p.topK, p.weights + int64_t(token) * p.topK, column, [&](int slot) {
          return expertHeld(p, ids[slot]) ? y + (int64_t(token) * p.topK + slot) * p.hidden
                                          : static_cast<const float *>(nullptr);
        });
  }
}

// LanePairs' sizes: a width of exactly 64 kPairs floats, kPairs a multiple of 4 up to 48.
constexpr int kStreamMaxPairs = 48;
int lanePairs(int width) {
  return width % 256 == 0 && width / 64 <= kStreamMaxPairs ? width / 64 : 0;
}

// The pairs up to which a step streams: its 8 warps an SM are too few to hide the fmaf chains
// of more (H200, Kimi-Linear-48B's experts, 8 layers a graph: 35.9 / 61.0 / 111.5 / 209.1 us at
// 1 / 2 / 4 / 8 tokens' top 8, the scalar kernels 38.6 / 63.1 / 112.7 / 197.7). Both forms
// give the same bits, so the choice keeps a token's outputs whatever the step holds.
constexpr int64_t kStreamedMaxPairs = 16;

// Whether the streamed form takes these experts: bf16 rows that fit the rings, widths of whole
// LanePairs (every matrix 16-byte aligned, as the weight archive's pages are), small steps.
bool streamedShape(const MoeExpertsParams &p) {
  return p.type == WeightType::BF16 && lanePairs(p.hidden) > 0 && lanePairs(p.intermediate) > 0 &&
         gateUpRingBytes(p.hidden) <= kGateUpRingBytes &&
         downRingBytes(p.intermediate) <= kDownRingBytes &&
         int64_t(p.tokens) * p.topK <= kStreamedMaxPairs;
}

// One launch of a streamed kernel at the SM's largest shared-memory split (set once per device
// and kernel), so a down block finds room beside a gate/up block without the SM being
// reconfigured.
template <auto kernel, typename... Args>
cudaError_t launchStreamedKernel(size_t maxShared, unsigned blocks, size_t sharedBytes,
                                 cudaStream_t stream, const MoeExpertsParams &p, Args... args) {
  const DeviceSetup setup = deviceSetup([maxShared] {
    cudaError_t status =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(maxShared));
    return status != cudaSuccess
               ? status
               : cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      int(cudaSharedmemCarveoutMaxShared));
  });
  if (setup.status != cudaSuccess)
    return setup.status;
  DependentLaunch launch(dim3(std::min<unsigned>(blocks, unsigned(setup.multiprocessors))),
                         dim3(kStreamThreads), stream);
  launch.config.dynamicSmemBytes = sharedBytes;
  return cudaLaunchKernelEx(&launch.config, kernel, p, args...);
}

// kernel<kPairs> for the width's LanePairs (4, 8, ..., kStreamMaxPairs).
template <int kPairs = 4, typename Launch> cudaError_t withLanePairs(int pairs, Launch launch) {
  if constexpr (kPairs > kStreamMaxPairs)
    return cudaErrorInvalidValue;
  else
    return pairs == kPairs ? launch(std::integral_constant<int, kPairs>{})
                           : withLanePairs<kPairs + 4>(pairs, launch);
}

int launchStreamed(const MoeExpertsParams &p, cudaStream_t stream) {
  auto *h = static_cast<float *>(p.workspace);
  float *y = h + size_t(p.tokens) * p.topK * p.intermediate;
  const int64_t slots = int64_t(p.tokens) * p.topK;
  const unsigned gateUpBlocks = unsigned(std::min<int64_t>(slots * p.intermediate, 1 << 20));
  cudaError_t status = withLanePairs(lanePairs(p.hidden), [&](auto pairs) {
    return launchStreamedKernel<gateUpStreamedKernel<decltype(pairs)::value>>(
        kGateUpRingBytes, gateUpBlocks, gateUpRingBytes(p.hidden), stream, p, h);
  });
  if (status != cudaSuccess)
    return int(status);
  status = withLanePairs(lanePairs(p.intermediate), [&](auto pairs) {
    return launchStreamedKernel<downStreamedKernel<decltype(pairs)::value>>(
        kDownRingBytes + kStreamedMaxPairs * sizeof(int), unsigned(p.hidden),
        downRingBytes(p.intermediate) + size_t(slots) * sizeof(int), stream, p,
        static_cast<const float *>(h), y);
  });
  return int(status != cudaSuccess ? status : cudaGetLastError());
}

unsigned gridFor(int64_t n) {
  return unsigned(std::min<int64_t>(std::max<int64_t>(1, (n + kThreads - 1) / kThreads), 8192));
}

// The floats of a block's vector in shared memory (loadVector): for FP8 rows of whole chunks,
// whole interleaved groups of 32 chunks (a width of 384 places values up to 479).
template <typename T> size_t vectorFloats(int width) {
  constexpr int kGroup = 32 * kFp8Chunk; // kMoeMaxHidden is whole groups
  return interleavesVector<T>(width) ? size_t((width + kGroup - 1) / kGroup) * kGroup
                                     : size_t(width);
}

template <typename T> int launchPerToken(const MoeExpertsParams &p, cudaStream_t stream) {
  static_assert(kMoeMaxHidden % (32 * kFp8Chunk) == 0, "vectorFloats stays within the limit");
  const DeviceSetup setup = deviceSetup([] {
    const int limit = kMoeMaxHidden * int(sizeof(float));
    cudaError_t status = cudaFuncSetAttribute(gateUpKernel<T>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
    if (status == cudaSuccess)
      status = cudaFuncSetAttribute(downKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    limit);
    return status;
  });
  if (setup.status != cudaSuccess)
    return int(setup.status);
  auto *h = static_cast<float *>(p.workspace);
  float *y = h + size_t(p.tokens) * p.topK * p.intermediate;
  // Each a programmatic dependent of the kernel before: three launches of a decode step's
  // latency-bound MoE layer overlap their predecessors' drain.
  const unsigned slots = unsigned(p.tokens * p.topK);
  constexpr int kGateUpBlockRows = kWarps * kGateUpRowsPerWarp<T>,
                kDownBlockRows = kWarps * kDownRowsPerWarp<T>;
  DependentLaunch gateUp(
      dim3(slots, unsigned((p.intermediate + kGateUpBlockRows - 1) / kGateUpBlockRows)),
      dim3(kThreads), stream);
  gateUp.config.dynamicSmemBytes = vectorFloats<T>(p.hidden) * sizeof(float);
  cudaError_t status = cudaLaunchKernelEx(&gateUp.config, gateUpKernel<T>, p, h);
  if (status != cudaSuccess)
    return int(status);
  DependentLaunch down(dim3(slots, unsigned((p.hidden + kDownBlockRows - 1) / kDownBlockRows)),
                       dim3(kThreads), stream);
  down.config.dynamicSmemBytes = vectorFloats<T>(p.intermediate) * sizeof(float);
  status = cudaLaunchKernelEx(&down.config, downKernel<T>, p, static_cast<const float *>(h), y);
  if (status != cudaSuccess)
    return int(status);
  DependentLaunch combine(
      dim3(unsigned(p.tokens), unsigned((p.hidden + kThreads - 1) / kThreads)), dim3(kThreads),
      stream);
  status = cudaLaunchKernelEx(&combine.config, combineKernel, p, static_cast<const float *>(y));
  return int(status != cudaSuccess ? status : cudaGetLastError());
}

} // namespace

int launchMoeRouter(const MoeRouterParams &p, void *stream) {
  if (p.tokens <= 0 || p.experts <= 0 || p.experts > kMoeMaxExperts || p.topK <= 0 ||
      p.topK > kMoeMaxTopK || p.topK > p.experts || p.groups <= 0 || p.groups > 64 ||
      p.experts % p.groups != 0 || p.topKGroups <= 0 || p.topKGroups > p.groups || !p.logits ||
      !p.ids || !p.weights)
    return cudaErrorInvalidValue;
  DependentLaunch launch(dim3(unsigned(p.tokens)), dim3(kThreads),
                         static_cast<cudaStream_t>(stream));
  const cudaError_t status = cudaLaunchKernelEx(&launch.config, routerKernel, p);
  return int(status != cudaSuccess ? status : cudaGetLastError());
}

void setFp8Experts(MoeExpertsParams &p, const float *const *gateScales,
                   const float *const *upScales, const float *const *downScales) {
  p.type = WeightType::Fp8Block;
  p.gateScales = gateScales;
  p.upScales = upScales;
  p.downScales = downScales;
  p.gateScaleStride = int32_t(linearFp8WeightScaleStride(p.hidden));
  p.downScaleStride = int32_t(linearFp8WeightScaleStride(p.intermediate));
}

size_t moeExpertsWorkspaceBytes(int32_t tokens, int32_t topK, int32_t hidden,
                                int32_t intermediate) {
  return tokens > 0 && topK > 0
             ? size_t(tokens) * topK * (size_t(hidden) + size_t(intermediate)) * sizeof(float)
             : 0;
}

int launchMoeExpertsPerToken(const MoeExpertsParams &p, void *stream) {
  if (p.tokens <= 0 || p.hidden <= 0 || p.hidden > kMoeMaxHidden || p.hidden % 2 != 0 ||
      p.intermediate <= 0 || p.intermediate > kMoeMaxHidden || p.intermediate % 2 != 0 ||
      p.experts <= 0 || p.topK <= 0 || p.topK > kMoeMaxTopK || !p.x || !p.ids || !p.weights ||
      !p.gate || !p.up || !p.down || !p.out || !p.workspace || !gatedActivationValid(p.activation))
    return cudaErrorInvalidValue;
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.type == WeightType::Fp8Block) {
    if (!p.gateScales || !p.upScales || !p.downScales || p.gateScaleStride <= 0 ||
        p.downScaleStride <= 0)
      return cudaErrorInvalidValue;
    return launchPerToken<uint8_t>(p, s);
  }
  if (streamedShape(p))
    return launchStreamed(p, s);
  return p.type == WeightType::BF16 ? launchPerToken<__nv_bfloat16>(p, s)
                                    : launchPerToken<float>(p, s);
}

int launchGatherRows(const float *x, int64_t width, const int32_t *rows, int32_t count, float *out,
                     void *stream) {
  if (width <= 0 || count < 0 || (count > 0 && (!x || !rows || !out)))
    return cudaErrorInvalidValue;
  if (count == 0)
    return 0;
  gatherRowsKernel<<<gridFor(int64_t(count) * width), kThreads, 0,
                     static_cast<cudaStream_t>(stream)>>>(x, width, rows, count, out);
  return int(cudaGetLastError());
}

int launchScatterAddRows(const float *in, int64_t width, const int32_t *rows, const float *scales,
                         int32_t count, float *out, void *stream) {
  if (width <= 0 || count < 0 || (count > 0 && (!in || !rows || !scales || !out)))
    return cudaErrorInvalidValue;
  if (count == 0)
    return 0;
  scatterAddRowsKernel<<<gridFor(int64_t(count) * width), kThreads, 0,
                         static_cast<cudaStream_t>(stream)>>>(in, width, rows, scales, count, out);
  return int(cudaGetLastError());
}

} // namespace hybrid::kernels::cuda
