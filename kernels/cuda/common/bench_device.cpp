#include "hybrid/kernels/cuda/BenchDevice.h"

#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {

std::string benchDeviceName() {
  int device = 0, driver = 0;
  cudaDeviceProp properties{};
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&properties, device) != cudaSuccess)
    return "no CUDA device";
  cudaDriverGetVersion(&driver);
  return std::string(properties.name) + ", " + std::to_string(properties.multiProcessorCount) +
         " SMs, driver " + std::to_string(driver / 1000) + "." +
         std::to_string(driver % 1000 / 10);
}

int benchProfilerRange(bool start) {
  return int(start ? cudaProfilerStart() : cudaProfilerStop());
}

} // namespace hybrid::kernels::cuda
