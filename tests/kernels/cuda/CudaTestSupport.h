// Shared by the CUDA kernel tests: device buffers, random inputs, the relative RMS error (and
// differingBits, from tests/support).
#pragma once

#include "../../support/DifferingBits.h" // differingBits
#include "hybrid/kernels/ref/Quant.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <random>
#include <span>
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

// bf16 bit patterns of `values` (round to nearest even), and back.
inline std::vector<uint16_t> bf16Bits(const std::vector<float> &values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    bits[i] = ref::floatToBf16(values[i]);
  return bits;
}
inline std::vector<float> bf16Values(const std::vector<uint16_t> &bits) {
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i)
    values[i] = ref::bf16ToFloat(bits[i]);
  return values;
}
inline std::vector<float> roundedToBf16(const std::vector<float> &values) {
  return bf16Values(bf16Bits(values));
}

// A recurrent state on the device in either storage type (KdaStateType): `bf16` keeps it as bf16
// bits of the values given (rounded), otherwise fp32.
struct DeviceState {
  DeviceState(const std::vector<float> &values, bool bf16)
      : bf16(bf16), f32(bf16 ? std::vector<float>() : values),
        bits(bf16 ? bf16Bits(values) : std::vector<uint16_t>()) {}
  void *data() { return bf16 ? static_cast<void *>(bits.data) : static_cast<void *>(f32.data); }
  std::vector<float> download() const { return bf16 ? bf16Values(bits.download()) : f32.download(); }
  bool bf16;
  DeviceBuffer<float> f32;
  DeviceBuffer<uint16_t> bits;
};

} // namespace hybrid::kernels
