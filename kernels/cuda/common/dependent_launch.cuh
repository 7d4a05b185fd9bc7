// A launch that may start while the kernel before it in the stream drains (programmatic
// dependent launch): the kernel must run griddepcontrol.wait before it reads that kernel's
// output, and may run griddepcontrol.launch_dependents to let the next one start early.
#pragma once

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {

// Pass &launch.config to cudaLaunchKernelEx; the config points into the object, so keep it in
// place (not copyable).
struct DependentLaunch {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute[1] = {};

  DependentLaunch(dim3 grid, dim3 block, cudaStream_t stream) {
    config.gridDim = grid;
    config.blockDim = block;
    config.stream = stream;
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  DependentLaunch(const DependentLaunch &) = delete;
  DependentLaunch &operator=(const DependentLaunch &) = delete;
};

// Device side. Before its first read of an earlier kernel's output (and its first write of
// anything an earlier kernel may read), a dependent waits for the earlier kernels to finish;
// whatever only reads constants (weights) may come before. A no-op when launched plainly.
__device__ __forceinline__ void waitForEarlierKernels() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
// Lets the next kernel, if it is a dependent, start its own constant loads now; it still waits
// for this kernel to finish before it reads what this one writes.
__device__ __forceinline__ void letDependentsLaunch() {
  asm volatile("griddepcontrol.launch_dependents;");
}

} // namespace hybrid::kernels::cuda
