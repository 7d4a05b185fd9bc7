// Shared by the CUDA kernel tests: device buffers, random inputs, the relative RMS error.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace hybrid::kernels {

inline bool gpuPresent() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

template <typename T> struct DeviceBuffer {
  explicit DeviceBuffer(const std::vector<T> &host) : size(host.size()) {
    EXPECT_EQ(cudaMalloc(&data, size * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, host.data(), size * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(data); }
  DeviceBuffer(const DeviceBuffer &) = delete; // one owner of the allocation
  DeviceBuffer &operator=(const DeviceBuffer &) = delete;
  std::vector<T> download() const {
    std::vector<T> host(size);
    EXPECT_EQ(cudaMemcpy(host.data(), data, size * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }
  T *data = nullptr;
  size_t size;
};

inline std::vector<float> random(size_t n, std::mt19937 &rng, float scale, float offset = 0.0f) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(n);
  for (float &v : values)
    v = offset + scale * normal(rng);
  return values;
}

// sqrt(mean((a-b)^2)) / sqrt(mean(b^2)): the relative RMS error of DESIGN.md section 5.
inline double relativeRms(const std::vector<float> &a, const std::vector<float> &b) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    ref += double(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(ref, 1e-30));
}

} // namespace hybrid::kernels
