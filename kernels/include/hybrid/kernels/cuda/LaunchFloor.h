// The launch-overhead floor for benchmarks: an empty kernel. CUDA-free header.
#pragma once

namespace hybrid::kernels::cuda {

// Launches a kernel that does nothing on `stream` (a cudaStream_t); returns 0 or the CUDA error.
int launchEmptyKernel(int blocks, int threads, void *stream);

} // namespace hybrid::kernels::cuda
