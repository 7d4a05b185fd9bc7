// The grouped MoE form on tensor cores (see Moe.h, launchMoeExpertsGrouped): every expert's
// weights are read once per 64 of its tokens, all experts in one launch per projection, and the
// grouping itself happens on the GPU, so no host round trip and CUDA graphs can hold it.
//
//   sort:    one block: (token, slot) pairs counted per expert, experts' row ranges, tiles of
//            kTileRows rows per expert, and each pair's sorted row (tokens ascending within an
//            expert: a warp per expert, ballots over the pairs in order);
//   gate-up: block (tile, 64 intermediate columns): h = silu(x W_gate^T) * (x W_up^T) for the
//            tile's rows, x gathered and rounded to bf16 (hi, and lo = bf16(x - hi) when split)
//            into shared memory, the weight tiles by cp.async two k steps deep (the next step's
//            weights and activations load while this one multiplies), mma.sync m16n8k16;
//   down:    block (tile, 64 hidden columns): y = h W_down^T;
//   combine: out[t] = sum over t's experts in ascending expert order of weight * y[row].
// Blocks past the tile count exit at once; the grid is sized for the most tiles possible.
#include "hybrid/kernels/cuda/Moe.h"
#include "../common/activation.cuh"
#include "../common/device_setup.cuh"
#include "../common/warp_mma.cuh"
#include "moe_combine.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kTileRows = 64, kTileColumns = 64, kTileK = kMoeGroupedTileK;
constexpr int kThreads = 128;           // 4 warps, 2 x 2 over the 64 x 64 output tile
constexpr int kStride = kTileK + 8;     // shared rows 144 bytes apart: ldmatrix conflict-free
constexpr int kSortThreads = 1024;

int64_t alignedBytes(int64_t bytes) { return (bytes + 255) / 256 * 256; }

struct Workspace {
  int32_t *starts;      // [experts + 1]
  int32_t *tileCount;   // [1]
  int32_t *tiles;       // [maxTiles][2]: expert, first sorted row
  int32_t *sortedToken; // [pairs]
  int32_t *pairRow;     // [pairs]: the sorted row of pair t * topK + k, -1 for an invalid id
  float *h;             // [pairs, intermediate]
  float *y;             // [pairs, hidden]
};

int64_t maxTiles(int64_t pairs, int64_t experts) {
  return (pairs + kTileRows - 1) / kTileRows + experts;
}

// The workspace's parts in order at 256-byte boundaries from `base`; `bytes` (when given)
// receives their total. The one statement of the layout, for the size as for the pointers.
Workspace carve(void *base, int64_t pairs, int64_t experts, int64_t hidden, int64_t inner,
                int64_t *bytes = nullptr) {
  const auto origin = reinterpret_cast<uintptr_t>(base);
  Workspace w;
  int64_t offset = 0;
  auto take = [&](int64_t size) {
    const uintptr_t at = origin + uintptr_t(offset);
    offset += alignedBytes(size);
    return at;
  };
  w.starts = reinterpret_cast<int32_t *>(take((experts + 1) * 4));
  w.tileCount = reinterpret_cast<int32_t *>(take(4));
  w.tiles = reinterpret_cast<int32_t *>(take(maxTiles(pairs, experts) * 8));
  w.sortedToken = reinterpret_cast<int32_t *>(take(pairs * 4));
  w.pairRow = reinterpret_cast<int32_t *>(take(pairs * 4));
  w.h = reinterpret_cast<float *>(take(pairs * inner * 4));
  w.y = reinterpret_cast<float *>(take(pairs * hidden * 4));
  if (bytes)
    *bytes = offset;
  return w;
}

// Pairs of absent experts (expertHeld) get no rows and no tiles: an expert-parallel rank
// multiplies only the experts it holds.
__global__ void __launch_bounds__(kSortThreads) sortPairsKernel(MoeExpertsParams p, Workspace w) {
  __shared__ int32_t counts[kMoeMaxExperts + 1];
  const int32_t *ids = p.ids;
  const int32_t pairs = p.tokens * p.topK, topK = p.topK, experts = p.experts;
  for (int e = threadIdx.x; e <= experts; e += kSortThreads)
    counts[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < pairs; i += kSortThreads) {
    const int32_t e = ids[i];
    if (expertHeld(p, e))
      atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) { // starts and tiles, in expert order
    int32_t start = 0, tiles = 0;
    for (int e = 0; e < experts; ++e) {
      const int32_t count = counts[e];
      w.starts[e] = start;
      counts[e] = start;
      for (int32_t row = 0; row < count; row += kTileRows) {
        w.tiles[2 * tiles] = e;
        w.tiles[2 * tiles + 1] = start + row;
        ++tiles;
      }
      start += count;
    }
    w.starts[experts] = start;
    *w.tileCount = tiles;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int e = warp; e < experts; e += kSortThreads / 32) {
    if (p.gate[e] == nullptr) // absent: its pairs get no row (warp-uniform)
      continue;
    int32_t next = counts[e];
    for (int first = 0; first < pairs; first += 32) {
      const int i = first + lane;
      const bool match = i < pairs && ids[i] == e;
      const unsigned ballot = __ballot_sync(0xffffffffu, match);
      if (match) {
        const int32_t row = next + __popc(ballot & ((1u << lane) - 1));
        w.sortedToken[row] = i / topK;
        w.pairRow[i] = row;
      }
      next += __popc(ballot);
    }
  }
  for (int i = threadIdx.x; i < pairs; i += kSortThreads)
    if (!expertHeld(p, ids[i]))
      w.pairRow[i] = -1;
}

// The tile's A operand for k in [k0, k0 + 64): 64 rows of fp32 (gathered through `tokens` when
// given, else rows first.. of `source`), loaded into registers (issued early, stored later).
struct ActivationChunk {
  float4 values[8];
};

__device__ inline void loadActivations(ActivationChunk &chunk, const float *source, int64_t width,
                                       const int32_t *tokens, int32_t first, int rows, int k0) {
  const int row = threadIdx.x / 2, half = threadIdx.x % 2;
  if (row < rows) {
    const int64_t sourceRow = tokens ? tokens[first + row] : first + row;
    const float4 *p = reinterpret_cast<const float4 *>(source + sourceRow * width + k0 + half * 32);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      chunk.values[i] = p[i];
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      chunk.values[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// The chunk as bf16 hi (and lo = bf16(x - hi) when split) in shared memory.
__device__ inline void storeActivations(const ActivationChunk &chunk, __nv_bfloat16 (*hi)[kStride],
                                        __nv_bfloat16 (*lo)[kStride], bool split) {
  const int row = threadIdx.x / 2, half = threadIdx.x % 2;
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const float v[8] = {chunk.values[i].x,     chunk.values[i].y,     chunk.values[i].z,
                        chunk.values[i].w,     chunk.values[i + 1].x, chunk.values[i + 1].y,
                        chunk.values[i + 1].z, chunk.values[i + 1].w};
    uint4 high, low;
    uint32_t *h = &high.x, *l = &low.x;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
      h[j] = *reinterpret_cast<const uint32_t *>(&pair);
      l[j] = mma::packBf16(v[2 * j] - __low2float(pair), v[2 * j + 1] - __high2float(pair));
    }
    *reinterpret_cast<uint4 *>(&hi[row][half * 32 + i * 4]) = high;
    if (split)
      *reinterpret_cast<uint4 *>(&lo[row][half * 32 + i * 4]) = low;
  }
}

// 64 weight rows [n0, n0 + 64) of a row-major bf16 matrix with `width` columns, k in
// [k0, k0 + 64), into shared memory by cp.async.
__device__ inline void stageWeights(__nv_bfloat16 (*tile)[kStride], const __nv_bfloat16 *matrix,
                                    int64_t width, int n0, int k0) {
#pragma unroll
  for (int i = 0; i < kTileColumns * kTileK / 8 / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads, row = chunk / 8, column = (chunk % 8) * 8;
    mma::copyAsync16(&tile[row][column], matrix + int64_t(n0 + row) * width + k0 + column);
  }
}

// Shared memory of one block: the activations (hi, lo) once, the weight tiles (one matrix, or
// gate and up) twice, so the next k step's weights stream in while this one multiplies.
template <bool kGateUp> constexpr int kMatrices = kGateUp ? 2 : 1;
template <bool kGateUp> constexpr size_t groupedSharedBytes() {
  return size_t(2 * kTileRows + 2 * kMatrices<kGateUp> * kTileColumns) * kStride * 2;
}

// kGateUp: h = silu(x W_gate^T) * x W_up^T; else y = h W_down^T.
template <bool kGateUp>
__global__ void __launch_bounds__(kThreads)
    groupedProjectionKernel(MoeExpertsParams p, Workspace w, bool split) {
  extern __shared__ __align__(16) unsigned char shared[];
  using Tile = __nv_bfloat16[kStride];
  Tile *aHi = reinterpret_cast<Tile *>(shared);
  Tile *aLo = aHi + kTileRows;
  Tile *weights = aLo + kTileRows; // [stage][matrix][kTileColumns]
  auto weightTile = [&](int stage, int matrix) {
    return weights + (stage * kMatrices<kGateUp> + matrix) * kTileColumns;
  };
  const int tile = blockIdx.x;
  if (tile >= *w.tileCount)
    return;
  const int expert = w.tiles[2 * tile], first = w.tiles[2 * tile + 1];
  const int rows = min(kTileRows, w.starts[expert + 1] - first);
  const int n0 = int(blockIdx.y) * kTileColumns;
  const int64_t depth = kGateUp ? p.hidden : p.intermediate;
  const __nv_bfloat16 *matrices[2] = {
      static_cast<const __nv_bfloat16 *>(kGateUp ? p.gate[expert] : p.down[expert]),
      static_cast<const __nv_bfloat16 *>(kGateUp ? p.up[expert] : nullptr)};
  const float *source = kGateUp ? p.x : w.h;
  const int64_t width = kGateUp ? p.hidden : p.intermediate;
  const int32_t *tokens = kGateUp ? w.sortedToken : nullptr;

  const int warp = threadIdx.x / 32, wm = warp / 2, wn = warp % 2;
  float acc[kMatrices<kGateUp>][2][4][4] = {};
  ActivationChunk chunk;
  for (int m = 0; m < kMatrices<kGateUp>; ++m)
    stageWeights(weightTile(0, m), matrices[m], depth, n0, 0);
  mma::commitAsyncCopies();
  loadActivations(chunk, source, width, tokens, first, rows, 0);
  storeActivations(chunk, aHi, aLo, split);
  const int steps = int(depth / kTileK);
  for (int step = 0; step < steps; ++step) {
    const int stage = step % 2;
    const bool more = step + 1 < steps;
    if (more) { // the next step's weights and activations on their way during this one's MMAs
      for (int m = 0; m < kMatrices<kGateUp>; ++m)
        stageWeights(weightTile(1 - stage, m), matrices[m], depth, n0, (step + 1) * kTileK);
      mma::commitAsyncCopies();
      loadActivations(chunk, source, width, tokens, first, rows, (step + 1) * kTileK);
      mma::waitAsyncCopies<1>(); // this step's weights
    } else {
      mma::waitAsyncCopies<0>();
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      uint32_t hi[2][4], lo[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        mma::loadA(hi[mt], &aHi[wm * 32 + mt * 16][kk], kStride);
        if (split)
          mma::loadA(lo[mt], &aLo[wm * 32 + mt * 16][kk], kStride);
      }
#pragma unroll
      for (int m = 0; m < kMatrices<kGateUp>; ++m) {
        uint32_t b[4][2];
        Tile *tileOfB = weightTile(stage, m);
#pragma unroll
        for (int pair = 0; pair < 2; ++pair)
          mma::loadBPair(b[2 * pair], b[2 * pair + 1], &tileOfB[wn * 32 + pair * 16][kk], kStride);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            mma::mma16816(acc[m][mt][nt], hi[mt], b[nt]);
            if (split)
              mma::mma16816(acc[m][mt][nt], lo[mt], b[nt]);
          }
      }
    }
    __syncthreads(); // every warp is done with this step's activations and weight stage
    if (more)
      storeActivations(chunk, aHi, aLo, split);
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = wm * 32 + mt * 16 + mma::accRow(e);
        const int column = n0 + wn * 32 + nt * 8 + mma::accColumn(e);
        if (row >= rows)
          continue;
        if constexpr (kGateUp) {
          const float g = acc[0][mt][nt][e], u = acc[kMatrices<kGateUp> - 1][mt][nt][e];
          w.h[int64_t(first + row) * p.intermediate + column] = gatedActivationValue(p.activation, g, u);
        } else {
          w.y[int64_t(first + row) * p.hidden + column] = acc[0][mt][nt][e];
        }
      }
}

// Block (token, 256 columns): the token's experts' outputs, weighted, added in ascending expert
// order from zero (the per-token form's order).
__global__ void __launch_bounds__(256) combineSortedKernel(MoeExpertsParams p, Workspace w) {
  combineToken(p, w.y, [&](int token, int slot) -> int64_t {
    return w.pairRow[int64_t(token) * p.topK + slot];
  });
}

} // namespace

bool moeGroupedSupports(const MoeExpertsParams &p) {
  return moeGroupedShape(p.type, p.hidden, p.intermediate) &&
         gatedActivationValid(p.activation) && p.tokens > 0 &&
         p.topK > 0 && p.topK <= kMoeMaxTopK &&
         p.experts > 0 && p.experts <= kMoeMaxExperts &&
         int64_t(p.tokens) * p.topK <= 0x7fffffff &&
         maxTiles(int64_t(p.tokens) * p.topK, p.experts) <= 0x7fffffff;
}

size_t moeGroupedWorkspaceBytes(int32_t tokens, int32_t topK, int32_t hidden,
                                int32_t intermediate, int32_t experts) {
  if (tokens <= 0 || topK <= 0 || experts <= 0)
    return 0;
  int64_t bytes = 0;
  carve(nullptr, int64_t(tokens) * topK, experts, hidden, intermediate, &bytes);
  return size_t(bytes);
}

int launchMoeExpertsGrouped(const MoeExpertsParams &p, bool splitInputs, void *stream) {
  if (!moeGroupedSupports(p) || !p.x || !p.ids || !p.weights || !p.gate || !p.up || !p.down ||
      !p.out || !p.workspace)
    return cudaErrorInvalidValue;
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t pairs = int64_t(p.tokens) * p.topK;
  const Workspace w = carve(p.workspace, pairs, p.experts, p.hidden, p.intermediate);
  const DeviceSetup setup = deviceSetup([] {
    cudaError_t status = cudaFuncSetAttribute(groupedProjectionKernel<true>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              int(groupedSharedBytes<true>()));
    if (status == cudaSuccess)
      status = cudaFuncSetAttribute(groupedProjectionKernel<false>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(groupedSharedBytes<false>()));
    return status;
  });
  if (setup.status != cudaSuccess)
    return int(setup.status);
  sortPairsKernel<<<1, kSortThreads, 0, s>>>(p, w);
  const unsigned tiles = unsigned(maxTiles(pairs, p.experts));
  groupedProjectionKernel<true><<<dim3(tiles, unsigned(p.intermediate / kTileColumns)), kThreads,
                                  groupedSharedBytes<true>(), s>>>(p, w, splitInputs);
  groupedProjectionKernel<false><<<dim3(tiles, unsigned(p.hidden / kTileColumns)), kThreads,
                                   groupedSharedBytes<false>(), s>>>(p, w, splitInputs);
  combineSortedKernel<<<dim3(unsigned(p.tokens), unsigned((p.hidden + 255) / 256)), 256, 0, s>>>(
      p, w);
  return int(cudaGetLastError());
}

bool moeLaunchesGrouped(const MoeExpertsParams &p) {
  return moeGroupedSupports(p) && int64_t(p.tokens) * p.topK > moePerTokenMaxPairs(p);
}

size_t moeExpertsLaunchWorkspaceBytes(const MoeExpertsParams &p) {
  return moeLaunchesGrouped(p)
             ? moeGroupedWorkspaceBytes(p.tokens, p.topK, p.hidden, p.intermediate, p.experts)
             : moeExpertsWorkspaceBytes(p.tokens, p.topK, p.hidden, p.intermediate);
}

int launchMoeExperts(const MoeExpertsParams &p, bool splitInputs, void *stream) {
  if (p.perTokenMaxPairs < 0 || p.perTokenMaxPairs > kMoeTunedMaxPairs)
    return cudaErrorInvalidValue;
  return moeLaunchesGrouped(p) ? launchMoeExpertsGrouped(p, splitInputs, stream)
                               : launchMoeExpertsPerToken(p, stream);
}

} // namespace hybrid::kernels::cuda
