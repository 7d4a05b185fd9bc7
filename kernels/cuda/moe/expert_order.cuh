// A token's slots in ascending expert id (stable), the order both MoE forms add their experts'
// outputs in (ref::moeExperts' order). One thread sorts; topK is small.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hybrid::kernels::cuda {

__device__ inline void sortSlotsByExpert(const int32_t *ids, int topK, int *order) {
  for (int k = 0; k < topK; ++k) {
    int at = k;
    while (at > 0 && ids[order[at - 1]] > ids[k]) {
      order[at] = order[at - 1];
      --at;
    }
    order[at] = k;
  }
}

} // namespace hybrid::kernels::cuda
