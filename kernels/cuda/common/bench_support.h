// Shared by the kernel benchmarks (not installed): error handling, random device data, timing.
#pragma once

#include "hybrid/kernels/ref/Quant.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
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

// Device buffers a benchmark allocates for one shape, freed together when the holder goes out of
// scope: on every way out, an error's or the shape's end.
class DeviceAllocations {
public:
  DeviceAllocations() = default;
  ~DeviceAllocations() {
    for (void *pointer : pointers_)
      cudaFree(pointer);
  }
  DeviceAllocations(const DeviceAllocations &) = delete; // one owner of each allocation
  DeviceAllocations &operator=(const DeviceAllocations &) = delete;
  // Takes `pointer` (may be null: a failed allocation) and returns it.
  template <typename T> T *keep(T *pointer) {
    if (pointer)
      pointers_.push_back(const_cast<void *>(static_cast<const void *>(pointer)));
    return pointer;
  }
  // `count` uninitialized T on the device, kept; null when the allocation fails.
  template <typename T> T *allocate(size_t count) {
    void *pointer = nullptr;
    return cudaMalloc(&pointer, std::max<size_t>(1, count) * sizeof(T)) == cudaSuccess
               ? static_cast<T *>(keep(pointer))
               : nullptr;
  }

private:
  std::vector<void *> pointers_;
};

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

// n random finite E4M3 codes (0x7f and 0xff are NaN), either sign, on the device.
inline uint8_t *deviceRandomFp8(size_t n, std::mt19937 &rng, std::string &error) {
  std::vector<uint8_t> host(n);
  std::uniform_int_distribution<int> magnitude(0, 0x7e), sign(0, 1);
  for (uint8_t &code : host)
    code = uint8_t(magnitude(rng) | sign(rng) << 7);
  uint8_t *device = nullptr;
  if (cudaMalloc(&device, n) != cudaSuccess ||
      cudaMemcpy(device, host.data(), n, cudaMemcpyHostToDevice) != cudaSuccess) {
    error = "cannot allocate or fill " + std::to_string(n) + " FP8 codes on the device";
    cudaFree(device);
    return nullptr;
  }
  return device;
}

// `count` block scales for random E4M3 codes (deviceRandomFp8): uniform in [0.5e-3, 2e-3].
inline std::vector<float> randomFp8BlockScales(size_t count, std::mt19937 &rng) {
  std::uniform_real_distribution<float> scale(0.5e-3f, 2e-3f);
  std::vector<float> scales(count);
  for (float &v : scales)
    v = scale(rng);
  return scales;
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

// "meets >= 70% of the floor (81%)" / "misses: 21.4% of the floor, needs 3.3x": a measured share
// of a floor (floor time / measured time) against the target share.
inline std::string floorShareVerdict(double share, double target, const char *floor) {
  char text[128];
  if (share >= target)
    std::snprintf(text, sizeof text, "meets >= %.0f%% of %s (%.0f%%)", 100 * target, floor,
                  100 * share);
  else
    std::snprintf(text, sizeof text, "misses: %.1f%% of %s, needs %.1fx", 100 * share, floor,
                  target / share);
  return text;
}

// A device copy of `host`; nullptr on failure.
template <typename T> T *deviceCopy(const std::vector<T> &host) {
  T *device = nullptr;
  if (cudaMalloc(&device, std::max<size_t>(1, host.size()) * sizeof(T)) != cudaSuccess)
    return nullptr;
  if (cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice) !=
      cudaSuccess) {
    cudaFree(device);
    return nullptr;
  }
  return device;
}

// Median microseconds per replay of what `launch(stream)` enqueues, captured once as a CUDA graph
// (how a decode step runs it); a negative value when the capture fails.
template <typename Launch> double graphMicroseconds(int iterations, Launch &&launch) {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
    return -1;
  const bool captured =
      cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess &&
      launch(stream) == 0 && cudaStreamEndCapture(stream, &graph) == cudaSuccess &&
      cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  const double microseconds =
      captured ? medianMicroseconds(stream, iterations, [&] { cudaGraphLaunch(exec, stream); })
               : -1;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return microseconds;
}

// A pool of `pages` pages on the device whose first pages are `distinct` (host pages made by
// `makePage()`, each pageBytes long) and the rest copies of them: large caches without generating
// gigabytes on the host. nullptr on failure (nothing left allocated).
template <typename MakePage>
unsigned char *devicePagePool(int64_t pages, int64_t pageBytes, int64_t distinct,
                              MakePage &&makePage) {
  unsigned char *pool = nullptr;
  if (cudaMalloc(&pool, size_t(pages * pageBytes)) != cudaSuccess)
    return nullptr;
  bool ok = true;
  for (int64_t i = 0; ok && i < std::min(distinct, pages); ++i) {
    const std::vector<uint8_t> page = makePage();
    ok = page.size() == size_t(pageBytes) &&
         cudaMemcpy(pool + i * pageBytes, page.data(), page.size(), cudaMemcpyHostToDevice) ==
             cudaSuccess;
  }
  for (int64_t filled = distinct; ok && filled < pages; filled *= 2) // doubling copies
    ok = cudaMemcpy(pool + filled * pageBytes, pool,
                    size_t(std::min(filled, pages - filled) * pageBytes),
                    cudaMemcpyDeviceToDevice) == cudaSuccess;
  if (!ok) {
    cudaFree(pool);
    return nullptr;
  }
  return pool;
}

} // namespace hybrid::kernels::cuda::bench
