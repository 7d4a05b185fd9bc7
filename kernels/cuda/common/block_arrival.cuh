// The last block to arrive: thread 0 of each block, after a __syncthreads of its block, adds one
// to a counter with acquire-release semantics at GPU scope (cumulative: it releases the writes
// the whole block made before the barrier, and acquires those of the blocks before it). Replaces
// threadFenceReduction's __threadfence by every thread on both sides (sequentially consistent
// fences, on the critical path of the indexer's select).
#pragma once

#include <cstdint>

namespace hybrid::kernels::cuda {

// Thread 0 only: whether this block is the `expected`-th to arrive at `counter`. The caller
// broadcasts the answer with a __syncthreads; the last block may then read every block's writes.
__device__ __forceinline__ bool arriveLast(unsigned *counter, unsigned expected) {
  unsigned before;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
               : "=r"(before)
               : "l"(counter)
               : "memory");
  return before == expected - 1;
}

} // namespace hybrid::kernels::cuda
