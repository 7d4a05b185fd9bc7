// MLA pieces around the attention (see Mla.h). Simple CUDA-core kernels: the per-head absorption
// and expansion read kv_b_proj once per block of rows (bandwidth-bound in decode), and the latent
// attention keeps a block's queries and a tile of gathered rows in shared memory with an online
// softmax. The FP8 sparse decode on tensor cores is sparse_mla_decode_sm90.cu.
#include "../common/block_reduce.cuh"
#include "../common/dependent_launch.cuh"
#include "../common/fp8_quant.cuh"
#include "../linear/gemv.cuh"
#include "hybrid/kernels/cuda/Mla.h"

#include <cmath>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <type_traits>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kThreads = 128, kWarpSize = 32;
constexpr int kScaleTile = 128; // latent elements per FP8 row scale

using reduce::warpSum;

// Pair i of a rotated slice by its angle's cosine and sine: the two values it mixes.
__device__ inline void rotatePair(float *x, int i, int pairs, RopePairing pairing, float cosine,
                                  float sine) {
  const int first = pairing == RopePairing::Interleaved ? 2 * i : i;
  const int second = pairing == RopePairing::Interleaved ? 2 * i + 1 : i + pairs;
  const float a = x[first], b = x[second];
  x[first] = a * cosine - b * sine;
  x[second] = b * cosine + a * sine;
}
__device__ inline void ropePair(float *x, int i, int pairs, RopePairing pairing, float angle) {
  rotatePair(x, i, pairs, pairing, cosf(angle), sinf(angle));
}

// Block (row, group of heads): the pairs' cosines and sines once (a row has one position; every
// (head, pair) used to compute its own, 128 heads x 32 pairs in one block a row: 18 us a
// DeepSeek-V3.2 decode launch), threads over the group's (head, pair), then its warps over the
// group's 32-value blocks to round to MXFP8. The launch groups heads only where each head's
// values are whole 32-value blocks holding its rotated slice; else one group holds them all.
// Two heads a group: the indexer query's 64 heads x 128 values are then 32 blocks whose warps
// round one MXFP8 block each, not 8 blocks of four in a row (H200, DeepSeek-V3.2 decode: 4.5 ->
// 3.3 us a launch).
constexpr int kRopeHeadsPerBlock = 2, kRopeMaxPairs = 128;

// The rope block's share of a row's FP8 groups (RopeParams::fp8Width), a warp a group: the
// group's amax, its DeepSeekUe8m0 scale, each value e4m3(x / s) * s (ref::quantizeFp8Tiles and
// dequantizeFp8Tiles: NaNs do not count in the amax and come back NaN).
__device__ void roundFp8Groups(const RopeParams &p, float *row, int firstHead, int heads) {
  const int group = p.fp8Group, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t begin = blockIdx.y == 0 ? 0 : int64_t(firstHead) * p.headStride;
  const int64_t end = blockIdx.y + 1 == gridDim.y
                          ? p.fp8Width
                          : min(p.fp8Width, int64_t(firstHead + heads) * p.headStride);
  for (int64_t g = begin / group + warp; g < end / group; g += kThreads / kWarpSize) {
    float *values = row + g * group;
    float amax = 0.0f;
    for (int i = lane; i < group; i += kWarpSize)
      amax = fmaxf(amax, fabsf(values[i]));
    const float scale = quant::fp8TileScale(reduce::warpMax(amax), quant::Fp8Rule::DeepSeekUe8m0);
    for (int i = lane; i < group; i += kWarpSize) {
      const __half_raw code =
          __nv_cvt_fp8_to_halfraw(quant::floatToE4M3(__fdiv_rn(values[i], scale)), __NV_E4M3);
      values[i] = __half2float(__half(code)) * scale;
    }
  }
}

__global__ void __launch_bounds__(kThreads) rope(RopeParams p, int headsPerBlock) {
  waitForEarlierKernels(); // launched as a programmatic dependent
  letDependentsLaunch();
  __shared__ float cosines[kRopeMaxPairs], sines[kRopeMaxPairs];
  const int r = blockIdx.x, pairs = p.dims / 2;
  const int firstHead = int(blockIdx.y) * headsPerBlock;
  const int heads = min(p.heads - firstHead, headsPerBlock);
  float *row = p.x + int64_t(r) * p.rowStride;
  if (pairs > 0) {
    const float position = float(p.positions[r]);
    const bool tabled = pairs <= kRopeMaxPairs; // the same for the whole block
    if (tabled) {
      for (int i = threadIdx.x; i < pairs; i += kThreads) {
        const float angle = position * p.inverseFrequencies[i];
        cosines[i] = cosf(angle);
        sines[i] = sinf(angle);
      }
      __syncthreads();
    }
    for (int item = threadIdx.x; item < heads * pairs; item += kThreads) {
      const int h = firstHead + item / pairs, i = item % pairs;
      float *slice = row + int64_t(h) * p.headStride + p.offset;
      if (tabled)
        rotatePair(slice, i, pairs, p.pairing, cosines[i], sines[i]);
      else
        ropePair(slice, i, pairs, p.pairing, position * p.inverseFrequencies[i]);
    }
  }
  if (p.fp8Width > 0) {
    __syncthreads(); // the rotated values are in place
    roundFp8Groups(p, row, firstHead, heads);
  }
  if (p.mxfp8Width == 0)
    return;
  __syncthreads(); // the rotated values are in place
  // The group's blocks: its heads' values; the last group also any past the heads.
  const int64_t begin = blockIdx.y == 0 ? 0 : int64_t(firstHead) * p.headStride;
  const int64_t end = blockIdx.y + 1 == gridDim.y
                          ? p.mxfp8Width
                          : min(p.mxfp8Width, int64_t(firstHead + heads) * p.headStride);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int64_t block = begin / 32 + warp; block < end / 32; block += kThreads / kWarpSize)
    row[block * 32 + lane] = quant::mxfp8RoundTrip(row[block * 32 + lane]);
}

__global__ void __launch_bounds__(kThreads) latentRows(MlaLatentRowsParams p) {
  waitForEarlierKernels(); // launched as a programmatic dependent
  letDependentsLaunch();
  __shared__ float partial[kThreads / kWarpSize];
  const int r = blockIdx.x, wide = p.latentDim + p.ropeDim;
  const float *in = p.kvA + int64_t(r) * wide;
  float squares = 0.0f;
  for (int i = threadIdx.x; i < p.latentDim; i += kThreads)
    squares += in[i] * in[i];
  const float scale =
      1.0f / sqrtf(reduce::blockSum<kThreads>(squares, partial) / float(p.latentDim) +
                   p.epsilon);
  float *latent = p.latent + int64_t(r) * p.latentDim;
  for (int i = threadIdx.x; i < p.latentDim; i += kThreads)
    latent[i] = p.normWeight[i] * (in[i] * scale); // the reference's order
  float *rope = p.rope + int64_t(r) * p.ropeDim;
  for (int i = threadIdx.x; i < p.ropeDim; i += kThreads)
    rope[i] = in[p.latentDim + i];
  if (!p.inverseFrequencies)
    return;
  __syncthreads();
  const int pairs = p.ropeDim / 2;
  const float position = float(p.positions[r]);
  for (int i = threadIdx.x; i < pairs; i += kThreads)
    ropePair(rope, i, pairs, p.pairing, position * p.inverseFrequencies[i]);
}

__device__ inline float weightAt(const MlaHeadWeights &w, int64_t index) {
  return w.type == WeightType::BF16
             ? __bfloat162float(static_cast<const __nv_bfloat16 *>(w.kvB)[index])
             : static_cast<const float *>(w.kvB)[index];
}

constexpr int kRowsPerBlock = 8;
constexpr int kColumnsPerThread = kMlaMaxLatentDim / kThreads;
constexpr int kMaxNopeDim = 256;

// Block (head, row block, kThreads-column slice): each thread owns latent column c for
// kRowsPerBlock rows, summing over the nope dims in order (as the reference). One block a head
// (every column of it) held 4 warps an SM behind a column's dependent loads (DeepSeek-V3.2's
// fp32 W_UK at batch 1: 60 us a layer); the slices spread a head over the GPU.
__global__ void __launch_bounds__(kThreads)
    absorbQueries(MlaHeadWeights w, int32_t rows, int32_t ropeDim, const float *queries,
                  float *absorbed) {
  waitForEarlierKernels(); // launched as a programmatic dependent
  letDependentsLaunch();
  __shared__ float nope[kRowsPerBlock][kMaxNopeDim];
  const int h = blockIdx.x, firstRow = blockIdx.y * kRowsPerBlock;
  const int count = min(kRowsPerBlock, rows - firstRow), qkDim = w.nopeDim + ropeDim;
  const int wide = w.latentDim + ropeDim;
  for (int item = threadIdx.x; item < count * w.nopeDim; item += kThreads) {
    const int rb = item / w.nopeDim, n = item % w.nopeDim;
    nope[rb][n] = queries[(int64_t(firstRow + rb) * w.heads + h) * qkDim + n];
  }
  __syncthreads();
  const int c = int(blockIdx.z) * kThreads + threadIdx.x;
  float sums[kRowsPerBlock] = {};
  const int64_t uk = int64_t(h) * (w.nopeDim + w.valueDim) * w.latentDim;
  if (c < w.latentDim) {
#pragma unroll 8 // loads in flight together; each row's sum still runs in n order
    for (int n = 0; n < w.nopeDim; ++n) {
      const float weight = weightAt(w, uk + int64_t(n) * w.latentDim + c);
#pragma unroll
      for (int rb = 0; rb < kRowsPerBlock; ++rb)
        sums[rb] += nope[rb][n] * weight;
    }
  }
#pragma unroll
  for (int rb = 0; rb < kRowsPerBlock; ++rb) {
    if (rb >= count)
      break;
    float *target = absorbed + (int64_t(firstRow + rb) * w.heads + h) * wide;
    if (c < w.latentDim)
      target[c] = sums[rb];
    if (blockIdx.z == 0) {
      const float *query = queries + (int64_t(firstRow + rb) * w.heads + h) * qkDim + w.nopeDim;
      for (int i = threadIdx.x; i < ropeDim; i += kThreads)
        target[w.latentDim + i] = query[i];
    }
  }
}

// bf16 or FP8 W_UK at decode rates. Block (head, row block, 256-column slice): each lane owns 8
// adjacent latent columns (one 16-byte load of bf16 or 8-byte load of E4M3 codes per nope dim;
// a warp reads 512 or 256 contiguous bytes), the 8 warps split the nope dims, and their partial
// sums meet in shared memory, summed over the warps in order. The kernel above gives one block
// per head, too few to stream W_UK. An FP8 weight is its code times its block's scale in fp32,
// the value the cpu reads (DeepSeek-V3.2's kv_b_proj: a quarter of the bytes of the fp32 copy
// the other kernel would read).
constexpr int kAbsorbThreads = 256, kAbsorbWarps = kAbsorbThreads / kWarpSize;
constexpr int kAbsorbColumns = kWarpSize * 8;

// 8 adjacent weights of a row: bf16 (16 bytes) or E4M3 codes (8 bytes; widened with their
// block's scale).
template <WeightType kType> struct EightWeights {
  using Chunk = std::conditional_t<kType == WeightType::BF16, uint4, uint2>;
  using Element = std::conditional_t<kType == WeightType::BF16, __nv_bfloat16, uint8_t>;
  __device__ static Chunk load(const Element *at) { return *reinterpret_cast<const Chunk *>(at); }
  __device__ static void widen(const uint2 &codes, float scale, float (&values)[8]) {
    const uint32_t words[2] = {codes.x, codes.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 pair = quant::fp8PairToFloat2(words[i / 2] >> (16 * (i % 2)));
      values[2 * i] = __fmul_rn(pair.x, scale);
      values[2 * i + 1] = __fmul_rn(pair.y, scale);
    }
  }
};

template <WeightType kType>
__global__ void __launch_bounds__(kAbsorbThreads)
    absorbQueriesColumns(MlaHeadWeights w, int32_t rows, int32_t ropeDim, const float *queries,
                         float *absorbed) {
  using Weights = EightWeights<kType>;
  __shared__ float nope[kRowsPerBlock][kMaxNopeDim];
  __shared__ float partial[kAbsorbWarps][kAbsorbColumns];
  const int h = blockIdx.x, firstRow = blockIdx.y * kRowsPerBlock;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int column = blockIdx.z * kAbsorbColumns + lane * 8;
  const int64_t firstUkRow = int64_t(h) * (w.nopeDim + w.valueDim);
  const auto *uk =
      static_cast<const typename Weights::Element *>(w.kvB) + firstUkRow * w.latentDim + column;
  // Nope dim n's weights: its row of W_UK; FP8 rows' scale by their 128-row block.
  auto rowOf = [&](int n) { return uk + int64_t(n) * w.latentDim; };
  auto scaleOf = [&](int n) {
    if constexpr (kType == WeightType::BF16)
      return 1.0f;
    else
      return __ldg(w.kvBScales + (firstUkRow + n) / 128 * w.kvBScaleStride + column / 128);
  };
  // The first nope dims' W_UK chunks load before the wait: weights, which nothing before this
  // launch writes, in flight while the queries' kernel drains.
  constexpr int kEarly = 4;
  typename Weights::Chunk early[kEarly];
#pragma unroll
  for (int i = 0; i < kEarly; ++i) {
    const int n = warp + i * kAbsorbWarps;
    early[i] =
        column < w.latentDim && n < w.nopeDim ? Weights::load(rowOf(n)) : typename Weights::Chunk{};
  }
  waitForEarlierKernels(); // launched as a programmatic dependent: the queries
  letDependentsLaunch();
  const int count = min(kRowsPerBlock, rows - firstRow), qkDim = w.nopeDim + ropeDim;
  const int wide = w.latentDim + ropeDim;
  for (int item = threadIdx.x; item < kRowsPerBlock * w.nopeDim; item += kAbsorbThreads) {
    const int rb = item / w.nopeDim, n = item % w.nopeDim;
    nope[rb][n] = rb < count ? queries[(int64_t(firstRow + rb) * w.heads + h) * qkDim + n] : 0.0f;
  }
  __syncthreads();
  float sums[kRowsPerBlock][8] = {};
  // Nope dim n's chunk into the sums (in n order: the early ones first).
  auto accumulate = [&](int n, const typename Weights::Chunk &chunk) {
    if constexpr (kType == WeightType::BF16) {
      const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
      for (int rb = 0; rb < kRowsPerBlock; ++rb) {
        const float q = nope[rb][n];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          sums[rb][2 * i] = fmaf(q, __uint_as_float(words[i] << 16), sums[rb][2 * i]);
          sums[rb][2 * i + 1] =
              fmaf(q, __uint_as_float(words[i] & 0xffff0000u), sums[rb][2 * i + 1]);
        }
      }
    } else {
      float values[8];
      Weights::widen(chunk, scaleOf(n), values);
#pragma unroll
      for (int rb = 0; rb < kRowsPerBlock; ++rb) {
        const float q = nope[rb][n];
#pragma unroll
        for (int i = 0; i < 8; ++i)
          sums[rb][i] = fmaf(q, values[i], sums[rb][i]);
      }
    }
  };
  if (column < w.latentDim) {
#pragma unroll
    for (int i = 0; i < kEarly; ++i)
      if (warp + i * kAbsorbWarps < w.nopeDim)
        accumulate(warp + i * kAbsorbWarps, early[i]);
#pragma unroll 4
    for (int n = warp + kEarly * kAbsorbWarps; n < w.nopeDim; n += kAbsorbWarps)
      accumulate(n, Weights::load(rowOf(n)));
  }
#pragma unroll
  for (int rb = 0; rb < kRowsPerBlock; ++rb) { // unrolled: sums stays in registers
    if (rb >= count) // the same for the whole block
      break;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      partial[warp][lane * 8 + i] = sums[rb][i];
    __syncthreads();
    const int c = blockIdx.z * kAbsorbColumns + threadIdx.x;
    float *target = absorbed + (int64_t(firstRow + rb) * w.heads + h) * wide;
    if (c < w.latentDim) {
      float total = 0.0f;
#pragma unroll
      for (int k = 0; k < kAbsorbWarps; ++k)
        total += partial[k][threadIdx.x];
      target[c] = total;
    }
    if (blockIdx.z == 0) {
      const float *query = queries + (int64_t(firstRow + rb) * w.heads + h) * qkDim + w.nopeDim;
      for (int i = threadIdx.x; i < ropeDim; i += kAbsorbThreads)
        target[w.latentDim + i] = query[i];
    }
    __syncthreads();
  }
}

// Block (head, row block, slice of kExpandValues values): a warp per output value, its lanes
// along the W_UV row. One block per head held 8 warps an SM with a value's 16 dependent loads
// after another (DeepSeek-V3.2's fp32 W_UV at batch 1: 113 us a layer); the slices spread a
// head's values over the GPU, each summed as before.
constexpr int kExpandValues = 2 * (kThreads / kWarpSize);

__global__ void __launch_bounds__(kThreads)
    expandOutputs(MlaHeadWeights w, int32_t rows, const float *latentOut, float *out) {
  waitForEarlierKernels(); // launched as a programmatic dependent
  letDependentsLaunch();
  __shared__ float latent[kRowsPerBlock][kMlaMaxLatentDim];
  const int h = blockIdx.x, firstRow = blockIdx.y * kRowsPerBlock;
  const int count = min(kRowsPerBlock, rows - firstRow);
  for (int item = threadIdx.x; item < count * w.latentDim; item += kThreads) {
    const int rb = item / w.latentDim, l = item % w.latentDim;
    latent[rb][l] = latentOut[(int64_t(firstRow + rb) * w.heads + h) * w.latentDim + l];
  }
  __syncthreads();
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int lastValue = min(w.valueDim, int(blockIdx.z + 1) * kExpandValues);
  for (int v = int(blockIdx.z) * kExpandValues + warp; v < lastValue; v += kThreads / kWarpSize) {
    const int64_t uv = (int64_t(h) * (w.nopeDim + w.valueDim) + w.nopeDim + v) * w.latentDim;
    float sums[kRowsPerBlock] = {};
#pragma unroll 8 // loads in flight together; each row's sum still runs in l order
    for (int l = lane; l < w.latentDim; l += kWarpSize) {
      const float weight = weightAt(w, uv + l);
#pragma unroll
      for (int rb = 0; rb < kRowsPerBlock; ++rb)
        sums[rb] += weight * latent[rb][l];
    }
#pragma unroll
    for (int rb = 0; rb < kRowsPerBlock; ++rb) {
      const float total = warpSum(sums[rb]);
      if (lane == 0 && rb < count)
        out[int64_t(firstRow + rb) * w.heads * w.valueDim + int64_t(h) * w.valueDim + v] = total;
    }
  }
}

// expandOutputs over FP8 W_UV: a warp per output value; lane i holds latent columns 4 (i + 32 j)
// .. + 3 (a 4-byte word of codes; a warp's load is 128 adjacent bytes, and column block j's one
// scale is the warp's), so that its float4 reads of the latent rows in shared memory are
// adjacent across lanes: no bank conflicts (16 adjacent columns a lane read 16-way conflicted,
// 39 us a layer at batch 1 against 22 for the fp32 copy). A warp takes kExpandFp8ValuesPerWarp
// values, every code of them loaded before the wait (weights, nothing earlier writes them), and
// 8 blocks fit an SM (64 registers, 40 bytes spilled): DeepSeek-V3.2's 128 heads x 8 slices are
// one wave. H200, its 6 layers' expansion a step at batch 1 / 8: one value a warp at a time
// 76 / 161 us; 4 values a warp 64 / 124 (96 registers), 62 / 113 (64: kept); 8 values 68 / 125.
// Rows past the call's are skipped, not summed as zeros. A row's sums run in the same order at
// any row count.
constexpr int kExpandFp8Words = kMlaMaxLatentDim / (4 * kWarpSize);
constexpr int kExpandFp8ValuesPerWarp = 4;
constexpr int kExpandFp8Values = kExpandFp8ValuesPerWarp * (kThreads / kWarpSize);

__global__ void __launch_bounds__(kThreads, 8)
    expandOutputsFp8(MlaHeadWeights w, int32_t rows, const float *latentOut, float *out) {
  __shared__ __align__(16) float latent[kRowsPerBlock][kMlaMaxLatentDim];
  const int h = blockIdx.x, firstRow = blockIdx.y * kRowsPerBlock;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  // The warp's values: first + k * warps, k < kExpandFp8ValuesPerWarp, below lastValue.
  const int lastValue = min(w.valueDim, int(blockIdx.z + 1) * kExpandFp8Values);
  const int firstValue = int(blockIdx.z) * kExpandFp8Values + warp;
  constexpr int kValueStep = kThreads / kWarpSize;
  auto rowOf = [&](int v) { return int64_t(h) * (w.nopeDim + w.valueDim) + w.nopeDim + v; };
  uint32_t codes[kExpandFp8ValuesPerWarp][kExpandFp8Words] = {};
#pragma unroll
  for (int k = 0; k < kExpandFp8ValuesPerWarp; ++k) {
    const int v = firstValue + k * kValueStep;
    if (v >= lastValue)
      break;
    const auto *row = reinterpret_cast<const uint32_t *>(static_cast<const unsigned char *>(w.kvB) +
                                                         rowOf(v) * w.latentDim);
#pragma unroll
    for (int j = 0; j < kExpandFp8Words; ++j)
      if (4 * (lane + kWarpSize * j) < w.latentDim)
        codes[k][j] = __ldg(row + lane + kWarpSize * j);
  }
  waitForEarlierKernels(); // launched as a programmatic dependent
  letDependentsLaunch();
  const int count = min(kRowsPerBlock, rows - firstRow);
  for (int item = threadIdx.x; item < count * w.latentDim; item += kThreads) {
    const int rb = item / w.latentDim, l = item % w.latentDim;
    latent[rb][l] = latentOut[(int64_t(firstRow + rb) * w.heads + h) * w.latentDim + l];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kExpandFp8ValuesPerWarp; ++k) {
    const int v = firstValue + k * kValueStep;
    if (v >= lastValue)
      break;
    const float *scales = w.kvBScales + rowOf(v) / 128 * w.kvBScaleStride;
    float sums[kRowsPerBlock] = {};
#pragma unroll
    for (int j = 0; j < kExpandFp8Words; ++j) {
      const int l = 4 * (lane + kWarpSize * j); // column block j: 128 columns a j
      if (l >= w.latentDim)
        break;
      const float scale = __ldg(scales + j);
      const float2 low = quant::fp8PairToFloat2(codes[k][j]);
      const float2 high = quant::fp8PairToFloat2(codes[k][j] >> 16);
      const float weights[4] = {__fmul_rn(low.x, scale), __fmul_rn(low.y, scale),
                                __fmul_rn(high.x, scale), __fmul_rn(high.y, scale)};
#pragma unroll
      for (int rb = 0; rb < kRowsPerBlock; ++rb)
        if (rb < count) {
          const float4 x = *reinterpret_cast<const float4 *>(&latent[rb][l]);
          sums[rb] = fmaf(weights[0], x.x, sums[rb]);
          sums[rb] = fmaf(weights[1], x.y, sums[rb]);
          sums[rb] = fmaf(weights[2], x.z, sums[rb]);
          sums[rb] = fmaf(weights[3], x.w, sums[rb]);
        }
    }
#pragma unroll
    for (int rb = 0; rb < kRowsPerBlock; ++rb) {
      const float total = warpSum(sums[rb]);
      if (lane == 0 && rb < count)
        out[int64_t(firstRow + rb) * w.heads * w.valueDim + int64_t(h) * w.valueDim + v] = total;
    }
  }
}

constexpr int kHeadsPerBlock = 8, kKeysPerTile = 8, kMaxRopeDim = 64;
constexpr int kMaxWide = kMlaMaxLatentDim + kMaxRopeDim;

// One value of a cached row, dequantized: the latent code times its tile's scale, or the bf16
// rope key (FP8 rows); the fp32 value (F32 rows).
__device__ inline float cachedValue(const unsigned char *row, LatentCacheType type, int latentDim,
                                    int e) {
  if (type == LatentCacheType::F32)
    return reinterpret_cast<const float *>(row)[e];
  const int tiles = (latentDim + kScaleTile - 1) / kScaleTile;
  if (e < latentDim) {
    const __half_raw code = __nv_cvt_fp8_to_halfraw(row[e], __NV_E4M3);
    return __half2float(__half(code)) * reinterpret_cast<const float *>(row + latentDim)[e / kScaleTile];
  }
  const uint16_t bits = reinterpret_cast<const uint16_t *>(row + latentDim + 4 * tiles)[e - latentDim];
  return __uint_as_float(uint32_t(bits) << 16);
}

// Block (row, head group): the group's queries and a tile of gathered rows in shared memory;
// a warp per (head, key) score; each thread accumulates latent columns of every head.
__global__ void __launch_bounds__(kThreads) latentAttention(LatentAttentionParams p, int64_t rowBytes) {
  waitForEarlierKernels(); // launched as a programmatic dependent
  letDependentsLaunch();
  __shared__ float q[kHeadsPerBlock][kMaxWide];
  __shared__ float rows[kKeysPerTile][kMaxWide];
  __shared__ float weights[kHeadsPerBlock][kKeysPerTile];
  __shared__ float rescale[kHeadsPerBlock];
  __shared__ int keys[kKeysPerTile];
  const int r = blockIdx.x, firstHead = blockIdx.y * kHeadsPerBlock;
  const int heads = min(kHeadsPerBlock, p.heads - firstHead);
  const int wide = p.latentDim + p.ropeDim;
  for (int item = threadIdx.x; item < kHeadsPerBlock * wide; item += kThreads) {
    const int h = item / wide, e = item % wide;
    q[h][e] = h < heads ? p.q[(int64_t(r) * p.heads + firstHead + h) * wide + e] : 0.0f;
  }
  const int candidates = p.indices ? p.topK : p.positions[r] + 1;
  const int32_t *table = p.blockTables + int64_t(p.sequences[r]) * p.maxPages;
  const int64_t pageBytes = int64_t(p.pageTokens) * rowBytes;
  const unsigned char *pages = static_cast<const unsigned char *>(p.latentPages);
  float running[kHeadsPerBlock], total[kHeadsPerBlock]; // per head: max logit, sum of weights
  float sums[kHeadsPerBlock][kColumnsPerThread] = {};
#pragma unroll
  for (int h = 0; h < kHeadsPerBlock; ++h) {
    running[h] = -INFINITY;
    total[h] = 0.0f;
  }
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int first = 0; first < candidates; first += kKeysPerTile) {
    __syncthreads(); // the previous tile is consumed
    if (threadIdx.x < kKeysPerTile) {
      const int j = first + threadIdx.x;
      keys[threadIdx.x] = j >= candidates ? -1 : p.indices ? p.indices[int64_t(r) * p.topK + j] : j;
    }
    __syncthreads();
    for (int item = threadIdx.x; item < kKeysPerTile * wide; item += kThreads) {
      const int k = item / wide, e = item % wide, position = keys[k];
      if (position < 0)
        continue;
      const unsigned char *row = pages + int64_t(table[position / p.pageTokens]) * pageBytes +
                                 int64_t(position % p.pageTokens) * rowBytes;
      rows[k][e] = cachedValue(row, p.cacheType, p.latentDim, e);
    }
    __syncthreads();
    for (int pair = warp; pair < kHeadsPerBlock * kKeysPerTile; pair += kThreads / kWarpSize) {
      const int h = pair / kKeysPerTile, k = pair % kKeysPerTile;
      float dot = 0.0f;
      if (keys[k] >= 0)
        for (int e = lane; e < wide; e += kWarpSize)
          dot += q[h][e] * rows[k][e];
      dot = warpSum(dot);
      if (lane == 0)
        weights[h][k] = keys[k] >= 0 ? dot * p.softmaxScale : -INFINITY;
    }
    __syncthreads();
    if (threadIdx.x < kHeadsPerBlock) { // online softmax, one thread per head
      const int h = threadIdx.x;
      float best = running[h];
      for (int k = 0; k < kKeysPerTile; ++k)
        best = fmaxf(best, weights[h][k]);
      const float alpha = best == -INFINITY ? 1.0f : expf(running[h] - best);
      float added = 0.0f;
      for (int k = 0; k < kKeysPerTile; ++k) {
        const float weight = weights[h][k] == -INFINITY ? 0.0f : expf(weights[h][k] - best);
        weights[h][k] = weight;
        added += weight;
      }
      rescale[h] = alpha;
      running[h] = best;
      total[h] = total[h] * alpha + added;
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < kHeadsPerBlock; ++h) {
      const float alpha = rescale[h];
#pragma unroll
      for (int c = 0; c < kColumnsPerThread; ++c) {
        const int e = threadIdx.x + c * kThreads;
        if (e >= p.latentDim)
          continue;
        float sum = sums[h][c] * alpha;
        for (int k = 0; k < kKeysPerTile; ++k)
          if (keys[k] >= 0)
            sum += weights[h][k] * rows[k][e];
        sums[h][c] = sum;
      }
    }
  }
  __syncthreads();
  __shared__ float totals[kHeadsPerBlock];
  if (threadIdx.x < kHeadsPerBlock)
    totals[threadIdx.x] = total[threadIdx.x];
  __syncthreads();
#pragma unroll
  for (int h = 0; h < kHeadsPerBlock; ++h) {
    if (h >= heads)
      break;
    float *target = p.out + (int64_t(r) * p.heads + firstHead + h) * p.latentDim;
#pragma unroll
    for (int c = 0; c < kColumnsPerThread; ++c) {
      const int e = threadIdx.x + c * kThreads;
      if (e < p.latentDim)
        target[e] = totals[h] > 0.0f ? sums[h][c] / totals[h] : 0.0f;
    }
  }
}

bool validWeights(const MlaHeadWeights &w) {
  return w.heads > 0 && w.nopeDim > 0 && w.nopeDim <= kMaxNopeDim && w.valueDim > 0 &&
         w.latentDim > 0 && w.latentDim <= kMlaMaxLatentDim && w.kvB &&
         (w.type != WeightType::Fp8Block ||
          (w.kvBScales && w.kvBScaleStride >= (w.latentDim + 127) / 128 && w.latentDim % 16 == 0 &&
           reinterpret_cast<uintptr_t>(w.kvB) % 16 == 0));
}

// A launch's status, then any error it left.
int launched(cudaError_t status) { return int(status != cudaSuccess ? status : cudaGetLastError()); }

unsigned rowBlocks(int32_t rows) { return unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock); }

} // namespace

int launchRope(const RopeParams &p, void *stream) {
  const bool fp8Fits =
      p.fp8Width == 0 || (p.mxfp8Width == 0 && p.fp8Group > 0 && p.fp8Group % 32 == 0 &&
                          p.fp8Width % p.fp8Group == 0 && p.fp8Width <= p.rowStride &&
                          (p.heads == 1 || (p.headStride > 0 && p.headStride % p.fp8Group == 0)));
  if (p.rows < 0 || p.heads <= 0 || p.dims < 0 || p.dims % 2 != 0 || p.mxfp8Width < 0 ||
      p.mxfp8Width % 32 != 0 || p.mxfp8Width > p.rowStride || p.fp8Width < 0 || !fp8Fits ||
      (p.rows > 0 && p.dims > 0 && (!p.x || !p.positions || !p.inverseFrequencies)) ||
      (p.rows > 0 && (p.mxfp8Width > 0 || p.fp8Width > 0) && !p.x))
    return cudaErrorInvalidValue;
  if (p.rows == 0 || (p.dims == 0 && p.mxfp8Width == 0 && p.fp8Width == 0))
    return 0;
  // Heads in groups where each head's rotated slice and MXFP8 blocks or FP8 groups stay within
  // its own values.
  const bool grouped = p.headStride > 0 && p.offset + p.dims <= p.headStride &&
                       (p.mxfp8Width == 0 || p.headStride % 32 == 0) &&
                       (p.fp8Width == 0 || p.headStride % p.fp8Group == 0);
  const int headsPerBlock = grouped ? kRopeHeadsPerBlock : p.heads;
  DependentLaunch launch(
      dim3(unsigned(p.rows), unsigned((p.heads + headsPerBlock - 1) / headsPerBlock)),
      dim3(kThreads), static_cast<cudaStream_t>(stream));
  return launched(cudaLaunchKernelEx(&launch.config, rope, p, headsPerBlock));
}

int launchMlaLatentRows(const MlaLatentRowsParams &p, void *stream) {
  if (p.rows <= 0 || p.latentDim <= 0 || p.ropeDim < 0 || p.ropeDim % 2 != 0 || !p.kvA ||
      !p.normWeight || !p.latent || (p.ropeDim > 0 && !p.rope) ||
      (p.inverseFrequencies && !p.positions))
    return cudaErrorInvalidValue;
  DependentLaunch launch(dim3(unsigned(p.rows)), dim3(kThreads), static_cast<cudaStream_t>(stream));
  return launched(cudaLaunchKernelEx(&launch.config, latentRows, p));
}

int launchMlaAbsorbQueries(const MlaHeadWeights &w, int32_t rows, int32_t ropeDim,
                           const float *queries, float *absorbed, void *stream) {
  if (!validWeights(w) || rows <= 0 || ropeDim < 0 || !queries || !absorbed)
    return cudaErrorInvalidValue;
  if (w.type == WeightType::Fp8Block || (w.type == WeightType::BF16 && w.latentDim % 8 == 0 &&
                                         reinterpret_cast<uintptr_t>(w.kvB) % 16 == 0)) {
    const unsigned slices = unsigned((w.latentDim + kAbsorbColumns - 1) / kAbsorbColumns);
    DependentLaunch launch(dim3(unsigned(w.heads), rowBlocks(rows), slices), dim3(kAbsorbThreads),
                           static_cast<cudaStream_t>(stream));
    return launched(cudaLaunchKernelEx(&launch.config,
                                       w.type == WeightType::BF16
                                           ? absorbQueriesColumns<WeightType::BF16>
                                           : absorbQueriesColumns<WeightType::Fp8Block>,
                                       w, rows, ropeDim, queries, absorbed));
  }
  DependentLaunch launch(dim3(unsigned(w.heads), rowBlocks(rows),
                              unsigned((w.latentDim + kThreads - 1) / kThreads)),
                         dim3(kThreads), static_cast<cudaStream_t>(stream));
  return launched(
      cudaLaunchKernelEx(&launch.config, absorbQueries, w, rows, ropeDim, queries, absorbed));
}

int launchMlaExpandOutputs(const MlaHeadWeights &w, int32_t rows, const float *latentOut,
                           float *out, void *stream, bool rowInvariant) {
  if (!validWeights(w) || rows <= 0 || !latentOut || !out)
    return cudaErrorInvalidValue;
  if (w.type == WeightType::BF16 && rows <= kGemvMaxRows && !rowInvariant) {
    // Decode: head h is the linear layer W_UV_h over latentOut[:, h], one batched launch.
    GemvParams gemv;
    gemv.rows = rows;
    gemv.in = w.latentDim;
    gemv.out = w.valueDim;
    gemv.x = latentOut;
    gemv.xStride = int64_t(w.heads) * w.latentDim;
    gemv.weight = static_cast<const __nv_bfloat16 *>(w.kvB) + int64_t(w.nopeDim) * w.latentDim;
    gemv.weightStride = w.latentDim;
    gemv.y = out;
    gemv.yStride = int64_t(w.heads) * w.valueDim;
    gemv.batch = w.heads;
    gemv.xBatchStride = w.latentDim;
    gemv.weightBatchStride = int64_t(w.nopeDim + w.valueDim) * w.latentDim;
    gemv.yBatchStride = w.valueDim;
    if (gemvSupports(gemv))
      return launchGemv(gemv, static_cast<cudaStream_t>(stream));
  }
  const bool fp8 = w.type == WeightType::Fp8Block;
  const int values = fp8 ? kExpandFp8Values : kExpandValues;
  DependentLaunch launch(dim3(unsigned(w.heads), rowBlocks(rows),
                              unsigned((w.valueDim + values - 1) / values)),
                         dim3(kThreads), static_cast<cudaStream_t>(stream));
  return launched(cudaLaunchKernelEx(&launch.config, fp8 ? expandOutputsFp8 : expandOutputs, w,
                                     rows, latentOut, out));
}

int launchLatentAttention(const LatentAttentionParams &p, void *stream) {
  if (p.rows <= 0 || p.heads <= 0 || p.latentDim <= 0 || p.latentDim > kMlaMaxLatentDim ||
      p.latentDim % 4 != 0 || p.ropeDim < 0 || p.ropeDim > kMaxRopeDim || !p.q ||
      (p.indices ? p.topK <= 0 : !p.positions) || !p.sequences || !p.latentPages ||
      p.pageTokens <= 0 || !p.blockTables || p.maxPages <= 0 || !p.out)
    return cudaErrorInvalidValue;
  const dim3 grid(unsigned(p.rows), unsigned((p.heads + kHeadsPerBlock - 1) / kHeadsPerBlock));
  DependentLaunch launch(grid, dim3(kThreads), static_cast<cudaStream_t>(stream));
  return launched(cudaLaunchKernelEx(&launch.config, latentAttention, p,
                                     latentRowBytes(p.cacheType, p.latentDim, p.ropeDim)));
}

} // namespace hybrid::kernels::cuda
