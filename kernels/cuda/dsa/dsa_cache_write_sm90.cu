// Cache writers (see DsaCacheWrite.h): one block per token; a warp per 128-element tile of a
// latent row (amax by shuffles, then the codes), a warp per index key.
#include "../common/block_reduce.cuh"
#include "../common/dependent_launch.cuh"
#include "../common/fp8_quant.cuh"
#include "hybrid/kernels/cuda/DsaCacheWrite.h"
#include "hybrid/kernels/cuda/SparseMla.h"

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kThreads = 128, kWarpSize = 32;
constexpr int kTile = 128; // latent elements per FlashMLA scale
constexpr int kMxBlock = 32;

using reduce::warpMax;

// The byte offset of token t's slot: its page, then slot * rowBytes.
__device__ inline int64_t slotOffset(const PagedTokens &w, int t, int64_t pageBytes,
                                     int64_t rowBytes) {
  const int position = w.positions[t];
  const int32_t page = w.blockTables[int64_t(w.sequences[t]) * w.maxPages + position / w.pageTokens];
  return int64_t(page) * pageBytes + int64_t(position % w.pageTokens) * rowBytes;
}

__global__ void __launch_bounds__(kThreads) writeLatentRows(LatentWriteParams p, int64_t rowBytes) {
  waitForEarlierKernels(); // launched as a programmatic dependent
  letDependentsLaunch();
  const int t = blockIdx.x, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  unsigned char *row = static_cast<unsigned char *>(p.pages) +
                       slotOffset(p.where, t, int64_t(p.where.pageTokens) * rowBytes, rowBytes);
  const float *latent = p.latent + int64_t(t) * p.latentDim;
  if (p.type == LatentCacheType::F32) { // [latent | rope], as computed
    float *target = reinterpret_cast<float *>(row);
    for (int i = threadIdx.x; i < p.latentDim; i += kThreads)
      target[i] = latent[i];
    for (int i = threadIdx.x; i < p.ropeDim; i += kThreads)
      target[p.latentDim + i] = p.rope[int64_t(t) * p.ropeDim + i];
    return;
  }
  const int tiles = (p.latentDim + kTile - 1) / kTile;
  for (int tile = warp; tile < tiles; tile += kThreads / kWarpSize) {
    const int begin = tile * kTile, count = min(kTile, p.latentDim - begin);
    float amax = 0.0f; // NaN values are ignored, as std::fmax does in the reference
    for (int i = lane; i < count; i += kWarpSize)
      amax = fmaxf(amax, fabsf(latent[begin + i]));
    const float scale = quant::fp8TileScale(warpMax(amax), quant::Fp8Rule::FlashMlaPow2);
    for (int i = lane; i < count; i += kWarpSize)
      row[begin + i] = quant::floatToE4M3(__fdiv_rn(latent[begin + i], scale));
    if (lane == 0)
      reinterpret_cast<float *>(row + p.latentDim)[tile] = scale;
  }
  auto *rope = reinterpret_cast<uint16_t *>(row + p.latentDim + 4 * tiles);
  for (int i = threadIdx.x; i < p.ropeDim; i += kThreads)
    rope[i] = quant::floatToBf16(p.rope[int64_t(t) * p.ropeDim + i]);
}

__global__ void __launch_bounds__(kWarpSize)
    writeIndexKeys(IndexKeyWriteParams p, int64_t pageBytes) {
  const int t = blockIdx.x, lane = threadIdx.x;
  const int position = p.where.positions[t];
  const int32_t page =
      p.where.blockTables[int64_t(p.where.sequences[t]) * p.where.maxPages +
                          position / p.where.pageTokens];
  const int slot = position % p.where.pageTokens;
  unsigned char *base = static_cast<unsigned char *>(p.pages) + int64_t(page) * pageBytes;
  const float *key = p.keys + int64_t(t) * p.dim;
  if (p.type == IndexKeyType::F32) {
    float *target = reinterpret_cast<float *>(base) + int64_t(slot) * p.dim;
    for (int i = lane; i < p.dim; i += kWarpSize)
      target[i] = key[i];
    return;
  }
  unsigned char *codes = base + int64_t(slot) * p.dim;
  unsigned char *scales = base + int64_t(p.where.pageTokens) * p.dim;
  if (p.type == IndexKeyType::Fp8PerKey) {
    float amax = 0.0f;
    for (int i = lane; i < p.dim; i += kWarpSize)
      amax = fmaxf(amax, fabsf(key[i]));
    const float scale = quant::fp8TileScale(warpMax(amax), p.scale == IndexKeyScale::DeepSeekUe8m0
                                                               ? quant::Fp8Rule::DeepSeekUe8m0
                                                               : quant::Fp8Rule::DeepSeekLinear);
    for (int i = lane; i < p.dim; i += kWarpSize)
      codes[i] = quant::floatToE4M3(__fdiv_rn(key[i], scale));
    if (lane == 0)
      reinterpret_cast<float *>(scales)[slot] = scale;
    return;
  }
  // MXFP8: lane i holds element i of each 32-element block.
  for (int block = 0; block < p.dim / kMxBlock; ++block) {
    const float value = key[block * kMxBlock + lane];
    const bool finite = __all_sync(0xffffffffu, isfinite(value));
    if (!finite) { // a NaN scale and NaN codes (the reference's rule for such a block)
      codes[block * kMxBlock + lane] = 0x7F;
      if (lane == 0)
        scales[int64_t(slot) * (p.dim / kMxBlock) + block] = 0xFF;
      continue;
    }
    const uint8_t scaleCode = quant::mxScaleCodeRoundUp(warpMax(fabsf(value)));
    codes[block * kMxBlock + lane] = quant::floatToE4M3(ldexpf(value, -(int(scaleCode) - 127)));
    if (lane == 0)
      scales[int64_t(slot) * (p.dim / kMxBlock) + block] = scaleCode;
  }
}

bool validTokens(const PagedTokens &w) {
  return w.tokens > 0 && w.positions && w.sequences && w.blockTables && w.maxPages > 0 &&
         w.pageTokens > 0;
}

} // namespace

int launchWriteLatentRows(const LatentWriteParams &p, void *stream) {
  if (!validTokens(p.where) || p.latentDim <= 0 || p.latentDim % 4 != 0 || p.ropeDim < 0 ||
      p.ropeDim % 2 != 0 ||
      !p.latent || (p.ropeDim > 0 && !p.rope) || !p.pages)
    return cudaErrorInvalidValue;
  DependentLaunch launch(dim3(unsigned(p.where.tokens)), dim3(kThreads),
                         static_cast<cudaStream_t>(stream));
  const cudaError_t status = cudaLaunchKernelEx(&launch.config, writeLatentRows, p,
                                                latentRowBytes(p.type, p.latentDim, p.ropeDim));
  return int(status != cudaSuccess ? status : cudaGetLastError());
}

int launchWriteIndexKeys(const IndexKeyWriteParams &p, void *stream) {
  if (!validTokens(p.where) || p.dim <= 0 || p.dim > 128 ||
      (p.type == IndexKeyType::Mxfp8 && p.dim % kMxBlock != 0) || !p.keys || !p.pages)
    return cudaErrorInvalidValue;
  writeIndexKeys<<<unsigned(p.where.tokens), kWarpSize, 0, static_cast<cudaStream_t>(stream)>>>(
      p, indexerPageBytes(p.type, p.where.pageTokens, p.dim));
  return int(cudaGetLastError());
}

} // namespace hybrid::kernels::cuda
