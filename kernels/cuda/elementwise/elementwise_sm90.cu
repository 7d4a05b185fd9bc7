// Embedding gather, residual add, silu(gate) * up, the sigmoid gate and the MXFP8 round trip on
// CUDA (see Elementwise.h): grid-stride loops over the elements (warps over 32-value blocks).
// The add and the gates, small kernels between GEMVs in a decode step, launch as programmatic
// dependents: their launch overlaps the kernel before, and the next GEMV's weight loads them.
#include "hybrid/kernels/cuda/Elementwise.h"
#include "../common/activation.cuh"
#include "../common/dependent_launch.cuh"
#include "../common/fp8_quant.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocksFor(int64_t n) {
  return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 8192));
}

template <typename T>
__global__ void embedKernel(const int64_t *ids, int64_t rows, const T *table, int64_t width,
                            float *out) {
  const int64_t total = rows * width;
  for (int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; index < total;
       index += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = index / width, column = index % width;
    if constexpr (sizeof(T) == 2)
      out[index] = __bfloat162float(table[ids[row] * width + column]);
    else
      out[index] = table[ids[row] * width + column];
  }
}

__global__ void addKernel(const float *a, const float *b, float *y, int64_t n) {
  waitForEarlierKernels();
  letDependentsLaunch();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = a[i] + b[i];
}

__global__ void siluMulKernel(const float *gate, const float *up, int64_t rows, int64_t width,
                              int64_t stride, float *out) {
  waitForEarlierKernels();
  letDependentsLaunch();
  const int64_t total = rows * width;
  for (int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; index < total;
       index += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = index / width, column = index % width;
    const float g = gate[row * stride + column];
    out[index] = g / (1.0f + expf(-g)) * up[row * stride + column];
  }
}

__global__ void gatedActivationKernel(const float *gate, const float *up, int64_t rows,
                                      int64_t width, int64_t stride, float *out,
                                      GatedActivation activation) {
  waitForEarlierKernels();
  letDependentsLaunch();
  const int64_t total = rows * width;
  for (int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; index < total;
       index += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = index / width, column = index % width;
    out[index] = gatedActivationValue(activation, gate[row * stride + column],
                                      up[row * stride + column]);
  }
}

__global__ void sigmoidGateKernel(float *x, const float *gate, int64_t n) {
  waitForEarlierKernels();
  letDependentsLaunch();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}

// A warp per 32-value block, lane i on value i.
__global__ void mxfp8RoundTripKernel(float *x, int64_t blocks) {
  const int lane = threadIdx.x % 32;
  for (int64_t block = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; block < blocks;
       block += int64_t(gridDim.x) * blockDim.x / 32) {
    float &value = x[block * 32 + lane];
    value = quant::mxfp8RoundTrip(value);
  }
}

int finish() { return static_cast<int>(cudaGetLastError()); }

// `kernel` on blocksFor(n) blocks as a programmatic dependent.
template <typename... Parameters, typename... Arguments>
int launchDependent(void (*kernel)(Parameters...), int64_t n, void *stream,
                    Arguments &&...arguments) {
  DependentLaunch launch(dim3(blocksFor(n)), dim3(kThreads), static_cast<cudaStream_t>(stream));
  const cudaError_t status =
      cudaLaunchKernelEx(&launch.config, kernel, std::forward<Arguments>(arguments)...);
  return status != cudaSuccess ? static_cast<int>(status) : finish();
}

} // namespace

int launchEmbed(const int64_t *ids, int64_t rows, const void *table, TableType type,
                int64_t vocab, int64_t width, float *out, void *stream) {
  if (rows <= 0 || width <= 0 || vocab <= 0 || !ids || !table || !out)
    return cudaErrorInvalidValue;
  auto s = static_cast<cudaStream_t>(stream);
  if (type == TableType::BF16)
    embedKernel<<<blocksFor(rows * width), kThreads, 0, s>>>(
        ids, rows, static_cast<const __nv_bfloat16 *>(table), width, out);
  else
    embedKernel<<<blocksFor(rows * width), kThreads, 0, s>>>(
        ids, rows, static_cast<const float *>(table), width, out);
  return finish();
}

int launchAdd(const float *a, const float *b, float *y, int64_t n, void *stream) {
  if (n <= 0 || !a || !b || !y)
    return cudaErrorInvalidValue;
  return launchDependent(addKernel, n, stream, a, b, y, n);
}

int launchSiluMul(const float *gate, const float *up, int64_t rows, int64_t width,
                  int64_t inputStride, float *out, void *stream) {
  if (rows <= 0 || width <= 0 || inputStride < width || !gate || !up || !out)
    return cudaErrorInvalidValue;
  return launchDependent(siluMulKernel, rows * width, stream, gate, up, rows, width, inputStride,
                         out);
}

int launchGatedActivation(const float *gate, const float *up, int64_t rows, int64_t width,
                          int64_t inputStride, float *out, const GatedActivation &activation,
                          void *stream) {
  if (activation.kind == GatedActivation::Kind::Silu)
    return launchSiluMul(gate, up, rows, width, inputStride, out, stream);
  if (rows <= 0 || width <= 0 || inputStride < width || !gate || !up || !out ||
      !gatedActivationValid(activation))
    return cudaErrorInvalidValue;
  return launchDependent(gatedActivationKernel, rows * width, stream, gate, up, rows, width,
                         inputStride, out, activation);
}

int launchSigmoidGate(float *x, const float *gate, int64_t n, void *stream) {
  if (n <= 0 || !x || !gate)
    return cudaErrorInvalidValue;
  return launchDependent(sigmoidGateKernel, n, stream, x, gate, n);
}

int launchMxfp8RoundTrip(float *x, int64_t n, void *stream) {
  if (n <= 0 || n % 32 != 0 || !x)
    return cudaErrorInvalidValue;
  mxfp8RoundTripKernel<<<blocksFor(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x,
                                                                                         n / 32);
  return finish();
}

} // namespace hybrid::kernels::cuda
