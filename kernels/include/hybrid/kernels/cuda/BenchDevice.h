// The GPU a benchmark ran on, for its record (hybrid-bench --json). CUDA-free header.
#pragma once

#include <string>

namespace hybrid::kernels::cuda {

// "NVIDIA H200, 132 SMs, driver 13.0" or "no CUDA device".
std::string benchDeviceName();

} // namespace hybrid::kernels::cuda
