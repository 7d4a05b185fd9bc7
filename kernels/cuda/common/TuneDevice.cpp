// The tuner's GPU identity and the dispatch of measurements to the families (Tune.h).
#include "hybrid/kernels/cuda/Tune.h"

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {

StatusOr<cache::TuningDevice> cudaTuningDevice() {
  int device = 0, devices = 0, driver = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    return Status::error("no CUDA device");
  cudaDeviceProp properties{};
  if (cudaError_t status = cudaGetDevice(&device); status != cudaSuccess)
    return Status::error(std::string("cudaGetDevice: ") + cudaGetErrorString(status));
  if (cudaError_t status = cudaGetDeviceProperties(&properties, device); status != cudaSuccess)
    return Status::error(std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(status));
  if (cudaError_t status = cudaDriverGetVersion(&driver); status != cudaSuccess)
    return Status::error(std::string("cudaDriverGetVersion: ") + cudaGetErrorString(status));
  // The toolkit the kernels were compiled with (another nvcc may schedule them differently).
  const std::string compiler = "cuda " + std::to_string(CUDART_VERSION / 1000) + "." +
                               std::to_string(CUDART_VERSION % 1000 / 10) + " sm_" +
                               std::to_string(properties.major) + std::to_string(properties.minor);
  return cache::TuningDevice{.gpu = properties.name,
                             .smCount = properties.multiProcessorCount,
                             .driverVersion = driver,
                             .compiler = compiler};
}

tuning::MeasureFn cudaMeasure(int32_t iterations) {
  return [iterations](const cache::TunableKernel &kernel, const cache::ShapeBucket &shape,
                      const std::vector<cache::TuningConfig> &configs,
                      tuning::Clock::time_point deadline)
             -> StatusOr<std::vector<tuning::CandidateTiming>> {
    if (kernel.name == tuning::kIndexerScores)
      return measureIndexerScores(shape, configs, deadline, iterations);
    if (kernel.name == tuning::kSparseMlaDecode)
      return measureSparseMlaDecode(shape, configs, deadline, iterations);
    if (kernel.name == tuning::kMoeExperts)
      return measureMoeExperts(shape, configs, deadline, iterations);
    if (kernel.name == tuning::kKdaDecode)
      return measureKdaDecode(shape, configs, deadline, iterations);
    return Status::error("no GPU measurement for kernel '" + kernel.name + "'");
  };
}

} // namespace hybrid::kernels::cuda
