// The decode-size linear layer (see gemv.cuh). A block of 8 warps computes 4 outputs for every
// row: its threads stride over the 16-byte chunks of the 4 weight rows (8 bf16 each), so each
// weight byte is loaded once, coalesced, with L1 allocation off (the activations, reread by
// every block, stay in L1), and every chunk is multiplied by all rows' activations. 4 outputs
// per block keep the activation reads at rows / 2 times the weight bytes, within L1 bandwidth
// up to 8 rows, and give even a 2304-wide output 576 blocks to fill the GPU.
//
// Launched as a programmatic dependent (PDL): a block starts while the kernel before it drains,
// loads its first two chunks of weights (constants, nothing earlier writes them), and only then
// waits for the earlier kernel's writes (griddepcontrol.wait) before reading x. In a decode step
// of some 300 such layers this hides most of each launch's latency behind the previous kernel.
//
// A launch runs a group of problems (one, or a layer's projections of one input): grid.x is
// the concatenation of the problems' blocks, and a block runs the same code on its problem as
// a launch of that problem alone would.
//
// The narrow form (in <= 256: at most one chunk a thread) gives each warp 4 outputs: lane l holds
// chunk l, as thread l of the block form does (whose other warps add zeros), and the warp's
// shuffle tree is the block form's warp 0 tree, so the sums are the same.
//
// The tensor-core form (calls of kGemvTensorCoreMinRows to 8 rows; in > 256 and a multiple of
// 32: every wide layer of the models) gives a block 16 outputs and multiplies with mma.sync
// m16n8k16 (bf16, fp32 accumulation), the rows as the MMA's 8 columns: the scalar block form
// spends ~2 fp32 instructions a weight per row (the bf16 widening and the fma), so 8 rows ran
// 4.3x longer than 1 row for the same bytes (H200, Kimi-Linear-48B's decode step).
// Its 8 warps take every 8th 32-wide k chunk; lane (g, t) loads 16 bytes (k 8t..8t+7) of
// weight rows g and g + 8 and of x's row g, and uses them as the fragments of two MMAs whose
// logical k 2t, 2t + 1, 2t + 8, 2t + 9 stand for 8t..8t+3 and 8t+4..8t+7: A and B permute k
// alike, so each product meets its partner. fp32 x enters as three bf16 terms (hi, mid, lo: x
// to 2^-24), or as bf16(x) alone with roundInputToBf16. A column's sums never see another column,
// and the blocking does not depend on `rows`: a row's bits are the same at 6, 7 or 8 rows. How
// many chunks a warp keeps in flight depends on the shape (gemvDeepStages).
#include "../common/device_setup.cuh"
#include "../common/block_reduce.cuh"
#include "../common/dependent_launch.cuh"
#include "../common/warp_mma.cuh"
#include "gemv.cuh"
#include "gemv_arithmetic.cuh"

#include <algorithm>
#include <cuda_bf16.h>

namespace hybrid::kernels::cuda {
namespace {
using namespace gemv_arithmetic;

constexpr int kThreads = 256, kWarps = kThreads / 32, kOutputsPerBlock = 4;
constexpr int kNarrowOutputsPerWarp = 4, kNarrowOutputsPerBlock = kWarps * kNarrowOutputsPerWarp;
static_assert(kGemvNarrowMaxIn / 8 <= 32, "a narrow row is at most one chunk a lane");

// Every row's chunk c of x times each output's weight chunk, into sums[row][output]: the one
// multiply of both forms, so the narrow form's sums are the block form's bits.
template <int MaxRows, int kOutputs>
__device__ __forceinline__ void multiplyChunk(const GemvParams &p, const float *x, int64_t c,
                                              const uint4 (&weights)[kOutputs],
                                              float (&sums)[MaxRows][kOutputs]) {
#pragma unroll
  for (int r = 0; r < MaxRows; ++r) {
    if (r < p.rows) {
      float values[8];
      inputChunk(x + r * p.xStride + c * 8, p.roundInputToBf16, values);
#pragma unroll
      for (int o = 0; o < kOutputs; ++o)
        sums[r][o] = dot8(weights[o], values, sums[r][o]);
    }
  }
}

// The tensor-core form: 16 outputs a block, k in chunks of 32, two stages of `Stages` chunks'
// weights in flight a warp (one stage computes while the other loads): 2 chunks a stage, or
// kMmaDeepStage for few blocks over a wide input (gemvDeepStages).
constexpr int kMmaOutputs = 16, kMmaChunk = 32, kMmaStage = 2, kMmaDeepStage = 8;
__host__ __device__ inline bool onTensorCores(const GemvParams &p) {
  return p.in > kGemvNarrowMaxIn && p.in % kMmaChunk == 0 &&
         (p.form == GemvForm::Auto ? p.rows >= kGemvTensorCoreMinRows
                                   : p.form == GemvForm::TensorCores);
}

int64_t blocksOf(const GemvParams &p) {
  const int outputs = onTensorCores(p) ? kMmaOutputs : kOutputsPerBlock;
  return (p.out + outputs - 1) / outputs;
}
int64_t narrowBlocksOf(const GemvParams &p) {
  return (p.out + kNarrowOutputsPerBlock - 1) / kNarrowOutputsPerBlock;
}

// The launch's problems; member m owns blocks [firstBlock[m], firstBlock[m + 1]) of grid.x.
struct GemvGroup {
  GemvParams members[kGemvMaxGroup];
  int32_t firstBlock[kGemvMaxGroup + 1] = {};
  int32_t count = 0;
};

// Block `block` (of blocksOf(p)) of problem p, batch entry `problem`.
template <int MaxRows>
__device__ __forceinline__ void gemvBlock(const GemvParams &p, int64_t block, int64_t problem) {
  __shared__ float partial[kWarps][MaxRows * kOutputsPerBlock];
  const float *x = p.x + problem * p.xBatchStride;
  const auto *weight =
      static_cast<const __nv_bfloat16 *>(p.weight) + problem * p.weightBatchStride;
  float *y = p.y + problem * p.yBatchStride;
  const int64_t firstOut = block * kOutputsPerBlock;
  const int outputs = int(min(int64_t(kOutputsPerBlock), p.out - firstOut));
  // Rows past the last output load the last one again (valid memory, products dropped).
  const __nv_bfloat16 *weightRows[kOutputsPerBlock];
#pragma unroll
  for (int o = 0; o < kOutputsPerBlock; ++o)
    weightRows[o] = weight + (firstOut + min(o, outputs - 1)) * p.weightStride;

  float sums[MaxRows][kOutputsPerBlock] = {};
  const int64_t chunks = p.in / 8;
  // Two chunks of weights in flight per thread, the first two loaded before the wait.
  uint4 w[2][kOutputsPerBlock];
  auto load = [&](uint4(&target)[kOutputsPerBlock], int64_t c) {
    if (c < chunks) {
#pragma unroll
      for (int o = 0; o < kOutputsPerBlock; ++o)
        target[o] = loadStreaming(weightRows[o] + c * 8);
    }
  };
  load(w[0], threadIdx.x);
  load(w[1], threadIdx.x + kThreads);
  asm volatile("griddepcontrol.wait;" ::: "memory"); // x (and y) are the earlier kernels'
  for (int64_t c = threadIdx.x; c < chunks; c += 2 * kThreads) {
    multiplyChunk(p, x, c, w[0], sums);
    load(w[0], c + 2 * kThreads);
    if (c + kThreads < chunks) {
      multiplyChunk(p, x, c + kThreads, w[1], sums);
      load(w[1], c + 3 * kThreads);
    }
  }
  // The next kernel's blocks may start their own weight loads while this one sums.
  asm volatile("griddepcontrol.launch_dependents;");

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < MaxRows; ++r)
#pragma unroll
    for (int o = 0; o < kOutputsPerBlock; ++o) {
      const float v = reduce::warpSum(sums[r][o]);
      if (lane == 0)
        partial[warp][r * kOutputsPerBlock + o] = v;
    }
  __syncthreads();
  const int r = threadIdx.x / kOutputsPerBlock, o = threadIdx.x % kOutputsPerBlock;
  if (r < p.rows && r < MaxRows && o < outputs)
    storeWarpsTotal(partial, threadIdx.x, p.accumulate, y[r * p.yStride + firstOut + o]);
}

// fp32 values as the B fragments of up to three bf16 terms: hi = bf16(v), mid = bf16(v - hi),
// lo = bf16(v - hi - mid) (each difference exact), whose sum is v to within 2^-24 relative: the
// products with bf16 weights are then the fp32 ones but for that last bit.
__device__ __forceinline__ void splitTerms(const float (&values)[8], uint32_t (&terms)[3][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float a = values[2 * i], b = values[2 * i + 1];
#pragma unroll
    for (int term = 0; term < 3; ++term) {
      const __nv_bfloat162 rounded = __floats2bfloat162_rn(a, b);
      terms[term][i] = *reinterpret_cast<const uint32_t *>(&rounded);
      const float2 back = __bfloat1622float2(rounded);
      a -= back.x;
      b -= back.y;
    }
  }
}

// Block `block` (of blocksOf(p)) of problem p on tensor cores (onTensorCores(p)).
template <int Stages>
__device__ __forceinline__ void gemvMmaBlock(const GemvParams &p, int64_t block, int64_t problem) {
  __shared__ float partial[kWarps][kMmaOutputs * 8]; // [warp][output * 8 + row]
  const float *x = p.x + problem * p.xBatchStride;
  const auto *weight = static_cast<const __nv_bfloat16 *>(p.weight) + problem * p.weightBatchStride;
  float *y = p.y + problem * p.yBatchStride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t firstOut = block * kMmaOutputs;
  const int outputs = int(min(int64_t(kMmaOutputs), p.out - firstOut));
  // Rows past the last output load the last one again (valid memory, products dropped).
  const __nv_bfloat16 *rowLow = weight + (firstOut + min(g, outputs - 1)) * p.weightStride + 8 * t;
  const __nv_bfloat16 *rowHigh =
      weight + (firstOut + min(g + 8, outputs - 1)) * p.weightStride + 8 * t;
  const bool holdsRow = g < p.rows; // x's row g is B's column g; past `rows` zeros
  const float *xRow = x + g * p.xStride + 8 * t;
  const int terms = p.roundInputToBf16 ? 1 : 3;
  // This warp's chunks: warp, warp + kWarps, ... (the block's warps read 512 adjacent bytes of
  // each weight row at a time).
  const int chunks = int(p.in / kMmaChunk), mine = (chunks - warp + kWarps - 1) / kWarps;
  auto chunkAt = [&](int i) { return int64_t(warp + kWarps * i) * kMmaChunk; };
  uint4 low[2][Stages], high[2][Stages];
  auto load = [&](uint4(&l)[Stages], uint4(&h)[Stages], int first) {
#pragma unroll
    for (int j = 0; j < Stages; ++j)
      if (first + j < mine) {
        l[j] = loadStreaming(rowLow + chunkAt(first + j));
        h[j] = loadStreaming(rowHigh + chunkAt(first + j));
      }
  };
  // One accumulator a term: three chains of MMAs, not one three times as long.
  float acc[3][4] = {};
  auto compute = [&](const uint4(&l)[Stages], const uint4(&h)[Stages], int first) {
#pragma unroll
    for (int j = 0; j < Stages; ++j) {
      if (first + j >= mine)
        break;
      uint32_t b[3][4] = {};
      if (holdsRow) {
        float values[8];
        inputChunk(xRow + chunkAt(first + j), false, values);
        splitTerms(values, b);
      }
#pragma unroll
      for (int term = 0; term < 3; ++term)
        if (term < terms) {
          mma::mma16816(acc[term], {l[j].x, h[j].x, l[j].y, h[j].y}, {b[term][0], b[term][1]});
          mma::mma16816(acc[term], {l[j].z, h[j].z, l[j].w, h[j].w}, {b[term][2], b[term][3]});
        }
    }
  };
  load(low[0], high[0], 0); // weights are constants: before the wait
  load(low[1], high[1], Stages);
  asm volatile("griddepcontrol.wait;" ::: "memory"); // x (and y) are the earlier kernels'
  for (int first = 0; first < mine; first += 2 * Stages) {
    compute(low[0], high[0], first);
    load(low[0], high[0], first + 2 * Stages);
    compute(low[1], high[1], first + Stages);
    load(low[1], high[1], first + 3 * Stages);
  }
  // The next kernel's blocks may start their own weight loads while this one sums.
  asm volatile("griddepcontrol.launch_dependents;");
#pragma unroll
  for (int e = 0; e < 4; ++e)
    partial[warp][mma::accRow(e) * 8 + mma::accColumn(e)] = (acc[0][e] + acc[1][e]) + acc[2][e];
  __syncthreads();
  const int output = threadIdx.x / 8, row = threadIdx.x % 8;
  if (threadIdx.x < kMmaOutputs * 8 && output < outputs && row < p.rows)
    storeWarpsTotal(partial, threadIdx.x, p.accumulate, y[row * p.yStride + firstOut + output]);
}

// The member owning this block of grid.x.
__device__ __forceinline__ int memberOf(const GemvGroup &group) {
  int member = 0;
#pragma unroll
  for (int m = 1; m < kGemvMaxGroup; ++m)
    if (m < group.count && int32_t(blockIdx.x) >= group.firstBlock[m])
      member = m;
  return member;
}

template <int MaxRows, int MmaStages = kMmaStage>
__global__ void __launch_bounds__(kThreads) gemvKernel(const __grid_constant__ GemvGroup group) {
  const int member = memberOf(group);
  const GemvParams &p = group.members[member];
  const int64_t block = int64_t(blockIdx.x) - group.firstBlock[member];
  if constexpr (MaxRows >= kGemvTensorCoreMinRows) { // the other sizes keep their registers
    if (onTensorCores(p)) {
      gemvMmaBlock<MmaStages>(p, block, blockIdx.y);
      return;
    }
  }
  gemvBlock<MaxRows>(p, block, blockIdx.y);
}

// The narrow form: warp `warp` of block `block` (of narrowBlocksOf(p)) computes outputs
// [first, first + 4) of problem p, batch entry `problem`, for every row.
template <int MaxRows>
__device__ __forceinline__ void gemvNarrowWarp(const GemvParams &p, int64_t block,
                                               int64_t problem) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t firstOut = (block * kWarps + warp) * kNarrowOutputsPerWarp;
  if (firstOut >= p.out)
    return; // no block barriers in this form
  const float *x = p.x + problem * p.xBatchStride;
  const auto *weight =
      static_cast<const __nv_bfloat16 *>(p.weight) + problem * p.weightBatchStride;
  float *y = p.y + problem * p.yBatchStride;
  const int outputs = int(min(int64_t(kNarrowOutputsPerWarp), p.out - firstOut));
  const bool holdsChunk = lane < p.in / 8;
  uint4 w[kNarrowOutputsPerWarp];
  if (holdsChunk) {
#pragma unroll
    for (int o = 0; o < kNarrowOutputsPerWarp; ++o) // past the last output: the last one again
      w[o] = loadStreaming(weight + (firstOut + min(o, outputs - 1)) * p.weightStride + lane * 8);
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  float sums[MaxRows][kNarrowOutputsPerWarp] = {};
  if (holdsChunk)
    multiplyChunk(p, x, lane, w, sums);
  asm volatile("griddepcontrol.launch_dependents;");
#pragma unroll
  for (int r = 0; r < MaxRows; ++r)
#pragma unroll
    for (int o = 0; o < kNarrowOutputsPerWarp; ++o) {
      const float v = reduce::warpSum(sums[r][o]);
      // Lane r * 4 + o stores it; 0.0f + v as the block form's sum over its warps (the
      // others' totals are zeros) turns a -0 into +0.
      if (lane == r * kNarrowOutputsPerWarp + o && r < p.rows && o < outputs) {
        const float total = 0.0f + v;
        float &target = y[r * p.yStride + firstOut + o];
        target = p.accumulate ? target + total : total;
      }
    }
}

template <int MaxRows>
__global__ void __launch_bounds__(kThreads)
    gemvNarrowKernel(const __grid_constant__ GemvGroup group) {
  const int member = memberOf(group);
  gemvNarrowWarp<MaxRows>(group.members[member], int64_t(blockIdx.x) - group.firstBlock[member],
                          blockIdx.y);
}

} // namespace

bool gemvSupports(const GemvParams &p) {
  return p.rows >= 1 && p.rows <= kGemvMaxRows && p.in > 0 && p.in % 8 == 0 && p.out > 0 && p.x &&
         p.weight && p.y && p.xStride >= p.in && p.xStride % 4 == 0 && p.weightStride >= p.in &&
         p.weightStride % 8 == 0 && p.yStride >= p.out && aligned16(p.x) && aligned16(p.weight) &&
         p.batch >= 1 && p.batch <= 65535 && p.xBatchStride % 4 == 0 &&
         p.weightBatchStride % 8 == 0 &&
         (p.out + kOutputsPerBlock - 1) / kOutputsPerBlock <= 0x7fffffff &&
         p.form >= GemvForm::Auto && p.form <= GemvForm::TensorCores;
}

bool gemvOnTensorCores(const GemvParams &p) { return onTensorCores(p); }

bool gemvGroupSupports(const GemvParams *members, int32_t count) {
  if (!members || count < 1 || count > kGemvMaxGroup)
    return false;
  int64_t blocks = 0;
  for (int32_t m = 0; m < count; ++m) {
    const GemvParams &p = members[m];
    if (!gemvSupports(p) || p.rows != members[0].rows || p.batch != members[0].batch ||
        p.roundInputToBf16 != members[0].roundInputToBf16)
      return false;
    blocks += blocksOf(p);
  }
  return blocks <= 0x7fffffff;
}

namespace {

// The tensor-core form's stages: kMmaDeepStage (two stages of 8 chunks a warp, 1 block an SM)
// when the group's blocks fit one wave of such blocks and every warp has more chunks than half
// the stages: narrow outputs over a wide input, each warp a chain of loads, so more of them in
// flight; else 2 chunks a stage, more blocks an SM. H200, Kimi-Linear's shapes at 8 rows, 2 /
// 4 / 8 chunks a stage: 2304 -> 2048 (128 blocks) 7.5 / 7.7 / 7.0 us, 2304 -> 256 6.2 / 5.9 /
// 5.4; 2304 -> 12576 21.3 / 27.2 / 31.0, 4096 -> 2304 (144 blocks: 2 waves at 8) 11.8 / 12.5 /
// 17.8, the LM head 2304 -> 163840 214 / 265 / 316. The stages only schedule the loads: each
// warp's MMAs run in the same order, so a row's bits are the same at any stage count.
bool gemvDeepStages(const GemvParams *members, int32_t count, int64_t blocks, int multiprocessors) {
  static const int deepPerSm = residentBlocksPerSm(gemvKernel<8, kMmaDeepStage>, kThreads);
  if (blocks > int64_t(deepPerSm) * multiprocessors)
    return false;
  for (int32_t m = 0; m < count; ++m) {
    const int64_t chunksPerWarp = (members[m].in / kMmaChunk + kWarps - 1) / kWarps;
    if (onTensorCores(members[m]) && chunksPerWarp <= kMmaDeepStage / 2)
      return false;
  }
  return true;
}

} // namespace

int launchGemvGroup(const GemvParams *members, int32_t count, cudaStream_t stream) {
  if (!gemvGroupSupports(members, count))
    return cudaErrorInvalidValue;
  // The narrow form when every member is narrow; other shapes keep the block form.
  bool narrow = true;
  for (int32_t m = 0; m < count; ++m)
    narrow = narrow && members[m].in <= kGemvNarrowMaxIn;
  GemvGroup group;
  group.count = count;
  for (int32_t m = 0; m < count; ++m) {
    group.members[m] = members[m];
    group.firstBlock[m + 1] =
        group.firstBlock[m] + int32_t(narrow ? narrowBlocksOf(members[m]) : blocksOf(members[m]));
  }
  const int32_t rows = members[0].rows;
  // The tensor-core form is compiled into the 8-row instance only (the others keep their
  // registers), which also runs fewer rows.
  bool tensorCores = false;
  for (int32_t m = 0; m < count; ++m)
    tensorCores = tensorCores || onTensorCores(members[m]);
  bool deepStages = false;
  if (tensorCores && !narrow) {
    const DeviceSetup device = deviceSetup([] { return cudaSuccess; });
    if (device.status != cudaSuccess)
      return int(device.status);
    deepStages = gemvDeepStages(members, count,
                                int64_t(group.firstBlock[count]) * members[0].batch,
                                device.multiprocessors);
  }
  DependentLaunch launch(dim3(unsigned(group.firstBlock[count]), unsigned(members[0].batch)),
                         dim3(kThreads), stream);
  const cudaError_t status =
      narrow        ? (rows == 1   ? cudaLaunchKernelEx(&launch.config, gemvNarrowKernel<1>, group)
                       : rows == 2 ? cudaLaunchKernelEx(&launch.config, gemvNarrowKernel<2>, group)
                       : rows <= 4 ? cudaLaunchKernelEx(&launch.config, gemvNarrowKernel<4>, group)
                                   : cudaLaunchKernelEx(&launch.config, gemvNarrowKernel<8>, group))
      : tensorCores
          ? (deepStages ? cudaLaunchKernelEx(&launch.config, gemvKernel<8, kMmaDeepStage>, group)
                        : cudaLaunchKernelEx(&launch.config, gemvKernel<8>, group))
      : rows == 1   ? cudaLaunchKernelEx(&launch.config, gemvKernel<1>, group)
      : rows == 2   ? cudaLaunchKernelEx(&launch.config, gemvKernel<2>, group)
      : rows <= 4   ? cudaLaunchKernelEx(&launch.config, gemvKernel<4>, group)
      : rows < kGemvTensorCoreMinRows
          ? cudaLaunchKernelEx(&launch.config, gemvKernel<kGemvTensorCoreMinRows - 1>, group)
          : cudaLaunchKernelEx(&launch.config, gemvKernel<8>, group);
  return int(status != cudaSuccess ? status : cudaGetLastError());
}

int launchGemv(const GemvParams &p, cudaStream_t stream) { return launchGemvGroup(&p, 1, stream); }

} // namespace hybrid::kernels::cuda
