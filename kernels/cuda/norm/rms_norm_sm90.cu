// RMSNorm (+ residual add) and LayerNorm on CUDA (see Norm.h): one block per row, the row's
// squares summed in fp32 by the block, then each element normalised and scaled. Rows of up to
// kThreads * kCachedPerThread values are read once into registers, every load issued before the
// first is used: a decode step's norms are one row each, where a loop of dependent loads (the
// compiler cannot hoist x past the stores to a possibly aliasing sum) made each launch about 8 us
// of memory latency. RMSNorms launch as programmatic dependents (the weights load while the
// kernel before drains; the next GEMV's blocks start loading their weights while this one runs).
#include "hybrid/kernels/cuda/Norm.h"
#include "../common/block_reduce.cuh"
#include "../common/dependent_launch.cuh"

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Rows of up to 4096 values (Kimi-Linear's) or 8192 (DeepSeek-V3.2's 7168: in the loop kernel
// below they were 28 dependent L2 round trips, 22 us a decode norm on the H200). Both sizes
// sum as the loop kernel does, so a row's bits do not depend on which one runs. The long form
// takes ~140 registers, one block an SM: it is for decode's few rows (a latency), while a
// prefill's many rows stream through the loop kernel's eight blocks an SM.
constexpr int kCachedPerThread = 16, kLongCachedPerThread = 32;
constexpr int64_t kLongCachedMostRows = 64;

template <int kCachedPerThread>
__global__ void __launch_bounds__(kThreads) rmsNormCachedKernel(RmsNormParams p) {
  __shared__ float warpSums[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float *x = p.x + row * p.dim;
  float *y = p.y + row * p.dim;
  float values[kCachedPerThread], weights[kCachedPerThread];
  // The weights load before the row, not after the reduction, and while the kernel before
  // drains: a kernel that is all latency (a decode row, one block).
#pragma unroll
  for (int j = 0; j < kCachedPerThread; ++j) {
    const int64_t i = threadIdx.x + j * kThreads;
    weights[j] = p.weight && i < p.dim ? p.weight[i] : 1.0f;
  }
  waitForEarlierKernels();
  letDependentsLaunch();
#pragma unroll
  for (int j = 0; j < kCachedPerThread; ++j) {
    const int64_t i = threadIdx.x + j * kThreads;
    values[j] = i < p.dim ? x[i] : 0.0f;
  }
  if (p.addend) {
    const float *addend = p.addend + row * p.dim;
    float *sum = p.sum + row * p.dim;
    float added[kCachedPerThread];
#pragma unroll
    for (int j = 0; j < kCachedPerThread; ++j) {
      const int64_t i = threadIdx.x + j * kThreads;
      added[j] = i < p.dim ? addend[i] : 0.0f;
    }
    if (p.secondAddend) { // x + (addend + secondAddend): the folded add's sum first
      const float *second = p.secondAddend + row * p.dim;
#pragma unroll
      for (int j = 0; j < kCachedPerThread; ++j) {
        const int64_t i = threadIdx.x + j * kThreads;
        added[j] += i < p.dim ? second[i] : 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < kCachedPerThread; ++j) {
      const int64_t i = threadIdx.x + j * kThreads;
      values[j] += added[j];
      if (i < p.dim)
        sum[i] = values[j];
    }
  }
  float squares = 0.0f; // in the loop kernel's order: element tid, tid + kThreads, ...
#pragma unroll
  for (int j = 0; j < kCachedPerThread; ++j)
    squares += values[j] * values[j];
  const float scale =
      rsqrtf(reduce::blockSum<kThreads>(squares, warpSums) / float(p.dim) + p.epsilon);
#pragma unroll
  for (int j = 0; j < kCachedPerThread; ++j) {
    const int64_t i = threadIdx.x + j * kThreads;
    if (i < p.dim) {
      const float normalised = values[j] * scale;
      y[i] = p.weight ? weights[j] * normalised : normalised;
    }
  }
}

// Longer rows: the same arithmetic, element by element.
__global__ void __launch_bounds__(kThreads) rmsNormKernel(RmsNormParams p) {
  __shared__ float warpSums[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float *x = p.x + row * p.dim;
  const float *addend = p.addend ? p.addend + row * p.dim : nullptr;
  float *sum = p.addend ? p.sum + row * p.dim : nullptr;
  float *y = p.y + row * p.dim;
  waitForEarlierKernels();
  letDependentsLaunch();
  float squares = 0.0f;
  for (int64_t i = threadIdx.x; i < p.dim; i += kThreads) {
    float value = x[i];
    if (addend) {
      value += p.secondAddend ? addend[i] + p.secondAddend[row * p.dim + i] : addend[i];
      sum[i] = value;
    }
    squares += value * value;
  }
  const float scale =
      rsqrtf(reduce::blockSum<kThreads>(squares, warpSums) / float(p.dim) + p.epsilon);
  // Each thread reads back what it wrote itself (sum), so no barrier is needed before this pass.
  const float *source = addend ? sum : x;
  for (int64_t i = threadIdx.x; i < p.dim; i += kThreads) {
    const float normalised = source[i] * scale;
    y[i] = p.weight ? p.weight[i] * normalised : normalised;
  }
}

// Two passes over the row (mean, then the centred squares), as the reference.
__global__ void __launch_bounds__(kThreads) layerNormKernel(LayerNormParams p) {
  __shared__ float warpSums[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float *x = p.x + row * p.dim;
  float *y = p.y + row * p.dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < p.dim; i += kThreads)
    sum += x[i];
  const float mean = reduce::blockSum<kThreads>(sum, warpSums) / float(p.dim);
  float squares = 0.0f;
  for (int64_t i = threadIdx.x; i < p.dim; i += kThreads)
    squares += (x[i] - mean) * (x[i] - mean);
  const float scale =
      1.0f / sqrtf(reduce::blockSum<kThreads>(squares, warpSums) / float(p.dim) + p.epsilon);
  for (int64_t i = threadIdx.x; i < p.dim; i += kThreads)
    y[i] = (x[i] - mean) * scale * p.weight[i] + p.bias[i];
}

} // namespace

int launchLayerNorm(const LayerNormParams &params, void *stream) {
  if (params.rows <= 0 || params.dim <= 0 || !params.x || !params.y || !params.weight ||
      !params.bias || params.rows > 0x7fffffff)
    return cudaErrorInvalidValue;
  layerNormKernel<<<unsigned(params.rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      params);
  return static_cast<int>(cudaGetLastError());
}

int launchRmsNorm(const RmsNormParams &params, void *stream) {
  if (params.rows <= 0 || params.dim <= 0 || !params.x || !params.y ||
      (params.addend && !params.sum) || (params.secondAddend && !params.addend) ||
      params.rows > 0x7fffffff)
    return cudaErrorInvalidValue;
  DependentLaunch launch(dim3(unsigned(params.rows)), dim3(kThreads),
                         static_cast<cudaStream_t>(stream));
  const cudaError_t status =
      params.dim <= int64_t(kThreads) * kCachedPerThread
          ? cudaLaunchKernelEx(&launch.config, rmsNormCachedKernel<kCachedPerThread>, params)
      : params.dim <= int64_t(kThreads) * kLongCachedPerThread && params.rows <= kLongCachedMostRows
          ? cudaLaunchKernelEx(&launch.config, rmsNormCachedKernel<kLongCachedPerThread>, params)
          : cudaLaunchKernelEx(&launch.config, rmsNormKernel, params);
  return static_cast<int>(status != cudaSuccess ? status : cudaGetLastError());
}

} // namespace hybrid::kernels::cuda
