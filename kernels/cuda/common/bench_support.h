// Shared by the kernel benchmarks (not installed): error handling, random device data, timing.
#pragma once

#include "hybrid/kernels/ref/Quant.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace hybrid::kernels::cuda::bench {

// Returns {} from the enclosing function with `error` set when a CUDA call fails.
#define BENCH_CHECK(call)                                                                         \
  do {                                                                                            \
    cudaError_t status_ = (call);                                                                 \
    if (status_ != cudaSuccess) {                                                                 \
      error = std::string(#call) + ": " + cudaGetErrorString(status_);                            \
      return {};                                                                                  \
    }                                                                                             \
  } while (0)

inline float *deviceRandom(size_t n, float scale, float offset, std::mt19937 &rng, std::string &error) {
  std::vector<float> host(n);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float &v : host)
    v = offset + scale * normal(rng);
  float *device = nullptr;
  if (cudaMalloc(&device, n * sizeof(float)) != cudaSuccess ||
      cudaMemcpy(device, host.data(), n * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) {
    error = "cannot allocate or fill " + std::to_string(n) + " floats on the device";
    cudaFree(device);
    return nullptr;
  }
  return device;
}

// The same, rounded to bf16 (round to nearest even), as bit patterns.
inline void *deviceRandomBf16(size_t n, float scale, float offset, std::mt19937 &rng,
                              std::string &error) {
  std::vector<uint16_t> host(n);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint16_t &bits : host)
    bits = ref::floatToBf16(offset + scale * normal(rng));
  void *device = nullptr;
  if (cudaMalloc(&device, n * sizeof(uint16_t)) != cudaSuccess ||
      cudaMemcpy(device, host.data(), n * sizeof(uint16_t), cudaMemcpyHostToDevice) !=
          cudaSuccess) {
    error = "cannot allocate or fill " + std::to_string(n) + " bf16 values on the device";
    cudaFree(device);
    return nullptr;
  }
  return device;
}

// Median over `repeats` timings of `iterations` calls of `body`, in microseconds per call.
template <typename Body>
double medianMicroseconds(cudaStream_t stream, int iterations, Body &&body) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> times;
  for (int repeat = 0; repeat < 7; ++repeat) {
    cudaEventRecord(start, stream);
    for (int i = 0; i < iterations; ++i)
      body();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float milliseconds = 0;
    cudaEventElapsedTime(&milliseconds, start, stop);
    times.push_back(1e3f * milliseconds / iterations);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

} // namespace hybrid::kernels::cuda::bench
