// The FP8 block-scaled linear layer at decode rows (see fp8_gemv.cuh). A block computes 16 outputs
// for every row with mma.sync m16n8k32 (E4M3 in, fp32 out), the rows as the MMA's 8 columns; its
// 8 (or 4) warps take every 8th (4th) 128-wide k tile (one weight scale block wide). Per tile a
// warp runs four MMAs into a fresh accumulator and adds it times the tile's weight scale and each
// row's activation scale to its total: the per-128 promotion of the reference (MODEL_SPEC §8.1), as
// DeepGEMM does. Lane (g, t) loads 16 bytes (k 16t..16t+15 of a 64-wide chunk) of weight rows g
// and g + 8 and of activation row g, and uses them as the fragments of two MMAs whose logical k
// 4t..4t+3 and 4t+16..4t+19 stand for 16t..16t+7 and 16t+8..16t+15: A and B permute k alike.
// The warps' totals are then summed in warp order. The loop does not depend on `rows`, and an
// MMA's column never sees another's: a row's bits are the same at 1 to 8 rows (a decode step
// and a speculation pass share them).
#include "../common/dependent_launch.cuh"
#include "../common/device_setup.cuh"
#include "../common/warp_mma.cuh"
#include "fp8_gemv.cuh"
#include "gemv.cuh" // kGemvMaxRows
#include "gemv_arithmetic.cuh" // loadStreaming, storeWarpsTotal

#include <cstdint>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kOutputs = 16;
constexpr int kTile = int(kFp8BlockSize), kChunk = 64;

// kStages tiles of weights in flight a warp: a ring of registers, refilled as each is multiplied.
template <int kWarps, int kStages>
__global__ void __launch_bounds__(kWarps * 32)
    fp8GemvKernel(LinearFp8Params p, int64_t paddedRows, int64_t scaleOffset, int64_t scaleStride) {
  static_assert(kWarps * 32 >= kOutputs * 8, "a thread a (output, row) in the final sum");
  __shared__ float partial[kWarps][kOutputs * 8]; // [warp][output * 8 + row]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t firstOut = int64_t(blockIdx.x) * kOutputs;
  const int outputs = int(min(int64_t(kOutputs), p.out - firstOut));
  const int64_t weightStride = p.weightStride ? p.weightStride : p.in;
  const int64_t yStride = p.yStride ? p.yStride : p.out;
  const auto *weight = static_cast<const uint8_t *>(p.weight);
  // Rows past the last output load the last one again (valid memory, products dropped).
  const uint8_t *rowLow = weight + (firstOut + min(g, outputs - 1)) * weightStride + 16 * t;
  const uint8_t *rowHigh = weight + (firstOut + min(g + 8, outputs - 1)) * weightStride + 16 * t;
  // The block's 16 outputs lie in one 128-row weight scale block.
  const float *weightScales = p.weightScale + (firstOut / kTile) * scaleStride;
  const auto *codes = static_cast<const uint8_t *>(p.scratch);
  const auto *activationScales =
      reinterpret_cast<const float *>(static_cast<const char *>(p.scratch) + scaleOffset);
  const bool holdsRow = g < p.rows; // activation row g is B's column g; past `rows` zeros
  const uint8_t *xRow = codes + g * p.in + 16 * t;
  const int tiles = int(p.in / kTile), mine = (tiles - warp + kWarps - 1) / kWarps;
  auto tileAt = [&](int i) { return warp + kWarps * i; };
  // A tile's weights: chunk 0's rows g and g + 8, then chunk 1's; kStages tiles in flight.
  uint4 w[kStages][4];
  auto load = [&](uint4(&target)[4], int i) {
    if (i < mine) {
      const int64_t k = int64_t(tileAt(i)) * kTile;
      target[0] = gemv_arithmetic::loadStreaming(rowLow + k);
      target[1] = gemv_arithmetic::loadStreaming(rowHigh + k);
      target[2] = gemv_arithmetic::loadStreaming(rowLow + k + kChunk);
      target[3] = gemv_arithmetic::loadStreaming(rowHigh + k + kChunk);
    }
  };
  float total[4] = {};
  auto multiply = [&](const uint4(&tile)[4], int i) {
    const int64_t k = int64_t(tileAt(i)) * kTile;
    uint4 x0 = make_uint4(0, 0, 0, 0), x1 = make_uint4(0, 0, 0, 0);
    if (holdsRow) {
      x0 = *reinterpret_cast<const uint4 *>(xRow + k);
      x1 = *reinterpret_cast<const uint4 *>(xRow + k + kChunk);
    }
    float acc[4] = {};
    mma::mmaE4m3Add(acc, {tile[0].x, tile[1].x, tile[0].y, tile[1].y}, {x0.x, x0.y});
    mma::mmaE4m3Add(acc, {tile[0].z, tile[1].z, tile[0].w, tile[1].w}, {x0.z, x0.w});
    mma::mmaE4m3Add(acc, {tile[2].x, tile[3].x, tile[2].y, tile[3].y}, {x1.x, x1.y});
    mma::mmaE4m3Add(acc, {tile[2].z, tile[3].z, tile[2].w, tile[3].w}, {x1.z, x1.w});
    const float weightScale = __ldg(weightScales + tileAt(i));
#pragma unroll
    for (int e = 0; e < 4; ++e) // column (row) < 8 <= paddedRows: pad rows' scales are finite
      total[e] += acc[e] * (weightScale *
                            activationScales[int64_t(tileAt(i)) * paddedRows + mma::accColumn(e)]);
  };
  if constexpr (kStages == 2) {
    // Spelled out: the ring's form of it ran the wide shapes 5-8% slower (H200, 16384 -> 7168
    // 36.5 -> 39.2 us).
    load(w[0], 0); // weights are constants: before the wait
    load(w[1], 1);
    waitForEarlierKernels(); // the activation codes and scales
    for (int i = 0; i < mine; i += 2) {
      multiply(w[0], i);
      load(w[0], i + 2);
      if (i + 1 < mine) {
        multiply(w[1], i + 1);
        load(w[1], i + 3);
      }
    }
  } else {
#pragma unroll
    for (int s = 0; s < kStages; ++s)
      load(w[s], s);
    waitForEarlierKernels();
    for (int i = 0; i < mine; i += kStages) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) // tiles in order: the same sums at any kStages
        if (i + s < mine) {
          multiply(w[s], i + s);
          load(w[s], i + s + kStages);
        }
    }
  }
  letDependentsLaunch();
#pragma unroll
  for (int e = 0; e < 4; ++e)
    partial[warp][mma::accRow(e) * 8 + mma::accColumn(e)] = total[e];
  __syncthreads();
  const int output = threadIdx.x / 8, row = threadIdx.x % 8;
  if (threadIdx.x < kOutputs * 8 && output < outputs && row < p.rows)
    gemv_arithmetic::storeWarpsTotal(partial, threadIdx.x, p.accumulate,
                                     p.y[row * yStride + firstOut + output]);
}

} // namespace

bool fp8GemvSupports(const LinearFp8Params &p) {
  const int64_t weightStride = p.weightStride ? p.weightStride : p.in;
  const int64_t yStride = p.yStride ? p.yStride : p.out;
  return p.rows >= 1 && p.rows <= kGemvMaxRows && p.in > 0 && p.in % kFp8BlockSize == 0 &&
         p.out > 0 && (p.out + kOutputs - 1) / kOutputs <= 0x7fffffff && weightStride >= p.in &&
         weightStride % 16 == 0 && yStride >= p.out && p.weight && p.weightScale && p.y &&
         p.scratch && gemv_arithmetic::aligned16(p.weight) &&
         gemv_arithmetic::aligned16(p.scratch) &&
         linearFp8ScratchScaleOffset(p.rows, p.in) % 4 == 0;
}

// How a shape runs: (warps, stages) = (8, 2) by default; (8, kDeepStages) when the outputs'
// blocks fit one wave of such blocks (222 registers: 1 an SM) and a warp has more tiles than
// half the stages: narrow outputs over a wide input, few blocks, each a chain of loads, so
// more of them in flight (H200, 1 row: 7168 -> 1536 9.9 -> 8.4 us, 7168 -> 576 9.2 -> 6.9; 4
// stages at 7168 -> 4096, 256 blocks at 2 an SM, ran 12.3 -> 13.1 and are not used); (4, 2) when
// 8-warp blocks (80 registers: 3 an SM) would not fit one wave, so that 7168-wide outputs' 448
// blocks run in one wave, not 1.13 with a tail. H200, DeepSeek-V3.2's shapes at 1 row, 4 warps
// against 8: 16384 -> 7168 41.5 -> 36.7 us, 1536 -> 8192 8.9 -> 7.3; but 7168 -> 1536 9.9 ->
// 14.6 (fewer warps to split k among). The choice depends on the shape alone: a row's bits
// stay the same at 1 to 8 rows (and the stages do not change the order of the sums).
namespace {

constexpr int kDeepStages = 8;
using Fp8GemvKernel = void (*)(LinearFp8Params, int64_t, int64_t, int64_t);
struct Fp8GemvForm {
  Fp8GemvKernel kernel;
  int threads;
};

Fp8GemvForm fp8GemvForm(int64_t blocks, int64_t in, int multiprocessors) {
  static const int deepPerSm = residentBlocksPerSm(fp8GemvKernel<8, kDeepStages>, 256);
  static const int widePerSm = residentBlocksPerSm(fp8GemvKernel<8, 2>, 256);
  const int64_t tilesPerWarp = (in / kTile + 7) / 8;
  if (tilesPerWarp > kDeepStages / 2 && blocks <= int64_t(deepPerSm) * multiprocessors)
    return {fp8GemvKernel<8, kDeepStages>, 256};
  if (widePerSm == 0 || blocks <= int64_t(widePerSm) * multiprocessors)
    return {fp8GemvKernel<8, 2>, 256};
  return {fp8GemvKernel<4, 2>, 128};
}

} // namespace

int launchFp8Gemv(const LinearFp8Params &p, cudaStream_t stream) {
  if (!fp8GemvSupports(p))
    return cudaErrorInvalidValue;
  const DeviceSetup device = deviceSetup([] { return cudaSuccess; });
  if (device.status != cudaSuccess)
    return int(device.status);
  const int64_t blocks = (p.out + kOutputs - 1) / kOutputs;
  const Fp8GemvForm form = fp8GemvForm(blocks, p.in, device.multiprocessors);
  DependentLaunch launch(dim3(unsigned(blocks)), dim3(unsigned(form.threads)), stream);
  const cudaError_t status = cudaLaunchKernelEx(
      &launch.config, form.kernel, p, linearFp8PaddedRows(p.rows),
      int64_t(linearFp8ScratchScaleOffset(p.rows, p.in)), linearFp8WeightScaleStride(p.in));
  return int(status != cudaSuccess ? status : cudaGetLastError());
}

} // namespace hybrid::kernels::cuda
