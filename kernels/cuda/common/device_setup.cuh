// Once per device, not per launch: the shared-memory opt-ins a kernel family needs (function
// attributes belong to a device's context) and the device's SM count, cached by device id.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>

namespace hybrid::kernels::cuda {

struct DeviceSetup {
  cudaError_t status = cudaSuccess;
  int multiprocessors = 0;
};

// Runs `prepare()` (a cudaError_t: cudaFuncSetAttribute calls, say) and reads the SM count the
// first time the current device asks; later calls return the cached result. A failure is not
// cached: the next call retries. One cache per `Prepare` type, i.e. per call site's lambda.
template <typename Prepare> DeviceSetup deviceSetup(Prepare &&prepare) {
  static std::mutex mutex;
  static std::map<int, DeviceSetup> setups;
  int device = 0;
  if (const cudaError_t status = cudaGetDevice(&device); status != cudaSuccess)
    return {status, 0};
  std::lock_guard<std::mutex> lock(mutex);
  if (auto found = setups.find(device); found != setups.end())
    return found->second;
  DeviceSetup setup;
  setup.status = prepare();
  if (setup.status == cudaSuccess)
    setup.status =
        cudaDeviceGetAttribute(&setup.multiprocessors, cudaDevAttrMultiProcessorCount, device);
  if (setup.status == cudaSuccess)
    setups.emplace(device, setup);
  return setup;
}

// Blocks of `kernel` launched with `threads` threads (no dynamic shared memory) that one SM
// holds at once; 0 when the query fails (a caller then takes its form for many blocks).
template <typename Kernel> int residentBlocksPerSm(Kernel kernel, int threads) {
  int blocks = 0;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0) == cudaSuccess
             ? blocks
             : 0;
}

} // namespace hybrid::kernels::cuda
