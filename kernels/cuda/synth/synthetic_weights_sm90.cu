// Synthetic weights in device memory (SyntheticWeights.h): a grid-stride loop, each thread
// computing its elements from their positions and rounding them with the bit-exact device twins
// of the reference quantizers, so the bytes equal ref::fillSynthetic's.
#include "hybrid/kernels/cuda/SyntheticWeights.h"
#include "../common/fp8_quant.cuh"

#include <cuda_runtime.h>

#include <algorithm>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <SyntheticStorage Storage, typename Index>
__global__ void syntheticFillKernel(SyntheticFill fill, void *out) {
  for (int64_t stored = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
       stored < fill.storedElements; stored += int64_t(gridDim.x) * blockDim.x) {
    const int64_t element = syntheticLogicalIndexIn<Index>(fill, Index(stored));
    const float value = element < 0 ? 0.0f : syntheticValue(fill, element);
    if constexpr (Storage == SyntheticStorage::F32)
      static_cast<float *>(out)[stored] = value;
    else if constexpr (Storage == SyntheticStorage::BF16)
      static_cast<uint16_t *>(out)[stored] = quant::floatToBf16(value);
    else
      static_cast<uint8_t *>(out)[stored] = quant::floatToE4M3(value);
  }
}

} // namespace

int launchSyntheticFill(const SyntheticFill &fill, void *out, void *stream) {
  if (fill.storedElements < 0 || (fill.storedElements > 0 && !out) ||
      static_cast<uint8_t>(fill.kind) >= kSyntheticKindCount)
    return cudaErrorInvalidValue;
  if (fill.storedElements == 0)
    return cudaSuccess;
  int device = 0, sms = 0;
  if (cudaError_t error = cudaGetDevice(&device); error != cudaSuccess)
    return error;
  if (cudaError_t error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      error != cudaSuccess)
    return error;
  // Enough resident blocks to saturate the memory system; the loop strides over the rest.
  const auto blocks = unsigned(std::clamp<int64_t>((fill.storedElements + kThreads - 1) / kThreads,
                                                   1, int64_t(sms) * 16));
  auto s = static_cast<cudaStream_t>(stream);
  const bool narrow = syntheticIndexFits32(fill);
  auto launch = [&](auto kernel32, auto kernel64) {
    if (narrow)
      kernel32<<<blocks, kThreads, 0, s>>>(fill, out);
    else
      kernel64<<<blocks, kThreads, 0, s>>>(fill, out);
  };
  switch (fill.storage) {
  case SyntheticStorage::F32:
    launch(syntheticFillKernel<SyntheticStorage::F32, uint32_t>,
           syntheticFillKernel<SyntheticStorage::F32, int64_t>);
    break;
  case SyntheticStorage::BF16:
    launch(syntheticFillKernel<SyntheticStorage::BF16, uint32_t>,
           syntheticFillKernel<SyntheticStorage::BF16, int64_t>);
    break;
  case SyntheticStorage::F8E4M3:
    launch(syntheticFillKernel<SyntheticStorage::F8E4M3, uint32_t>,
           syntheticFillKernel<SyntheticStorage::F8E4M3, int64_t>);
    break;
  default:
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

} // namespace hybrid::kernels::cuda
