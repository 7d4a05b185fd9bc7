// The GPU a benchmark ran on, for its record (hybrid-bench --json). CUDA-free header.
#pragma once

#include <string>

namespace hybrid::kernels::cuda {

// "NVIDIA H200, 132 SMs, driver 13.0" or "no CUDA device".
std::string benchDeviceName();

// Opens (start) or closes the profiler's collection range (cudaProfilerStart / Stop), for
// `ncu --profile-from-start off` on one part of a benchmark. 0 or a cudaError_t.
int benchProfilerRange(bool start);

} // namespace hybrid::kernels::cuda
