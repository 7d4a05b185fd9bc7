// The routed experts' all-to-all over the context ranks (see MoeExchange.h): destination lists,
// packing, unpacking and the weighted combine of the returned rows. Small memory-bound kernels
// around the communicator's exchanges and the MoE forms.
#include "hybrid/kernels/cuda/MoeExchange.h"
#include "moe_combine.cuh"

#include <cuda_runtime.h>

#include <algorithm>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRouteThreads = 128;

unsigned gridFor(int64_t n) {
  return unsigned(std::min<int64_t>(std::max<int64_t>(1, (n + kThreads - 1) / kThreads), 8192));
}

// Each thread takes a contiguous run of the pairs, so the per-thread offsets scanned in thread
// order give every list the pairs in (t, k) order, as parallel::moeExpertParallel lists them.
__global__ void __launch_bounds__(kRouteThreads) routeToRanksKernel(MoeRouteToRanksParams p) {
  __shared__ int32_t offsets[kRouteThreads][kMoeExchangeMaxRanks];
  const int64_t pairs = int64_t(p.tokens) * p.topK;
  const int64_t per = (pairs + kRouteThreads - 1) / kRouteThreads;
  const int64_t begin = min(pairs, per * threadIdx.x), end = min(pairs, begin + per);
  const int32_t perRank = p.experts / p.ranks;
  int32_t *mine = offsets[threadIdx.x];
  for (int d = 0; d < p.ranks; ++d)
    mine[d] = 0;
  for (int64_t i = begin; i < end; ++i)
    if (const int32_t id = p.ids[i]; id >= 0 && id < p.experts)
      ++mine[id / perRank];
  __syncthreads();
  if (int(threadIdx.x) < p.ranks) { // one thread per rank: its list's offsets, thread by thread
    const int d = threadIdx.x;
    int32_t total = 0;
    for (int t = 0; t < kRouteThreads; ++t) {
      const int32_t n = offsets[t][d];
      offsets[t][d] = total;
      total += n;
    }
    p.counts[d] = float(total);
  }
  __syncthreads();
  for (int64_t i = begin; i < end; ++i) {
    const int32_t id = p.ids[i];
    if (id < 0 || id >= p.experts) {
      p.slots[i] = -1;
      continue;
    }
    const int d = id / perRank;
    const int32_t slot = mine[d]++;
    p.slots[i] = slot;
    p.pairs[int64_t(d) * pairs + slot] = int32_t(i);
  }
}

__global__ void __launch_bounds__(kThreads) packRowsKernel(MoePackRowsParams p) {
  const int64_t width = int64_t(p.hidden) + 1, pairs = int64_t(p.tokens) * p.topK;
  const int64_t total = int64_t(p.ranks) * p.chunkSlots * width;
  for (int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; index < total;
       index += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = index / width, column = index % width;
    const int64_t d = row / p.chunkSlots, slot = p.firstSlot + row % p.chunkSlots;
    const int32_t pair = slot < int64_t(p.counts[d]) ? p.pairs[d * pairs + slot] : -1;
    float value;
    if (pair < 0)
      value = column == 0 ? -1.0f : 0.0f;
    else
      value =
          column == 0 ? float(p.ids[pair]) : p.x[int64_t(pair / p.topK) * p.hidden + column - 1];
    p.sent[index] = value;
  }
}

__global__ void __launch_bounds__(kThreads) unpackRowsKernel(MoeUnpackRowsParams p) {
  const int64_t width = int64_t(p.hidden) + 1, total = int64_t(p.rows) * width;
  for (int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; index < total;
       index += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = index / width, column = index % width;
    if (column == 0) {
      p.ids[row] = int32_t(p.received[index]);
      p.weights[row] = 1.0f;
    } else {
      p.x[row * p.hidden + column - 1] = p.received[index];
    }
  }
}

// Block (token blockIdx.x, columns blockIdx.y * blockDim.x + threadIdx.x): the returned rows
// combined as combineToken combines (combinedColumn, moe_combine.cuh).
__global__ void __launch_bounds__(kThreads) combineReturnedKernel(MoeCombineReturnedParams p) {
  __shared__ int order[kMoeMaxTopK];
  __shared__ const float *rows[kMoeMaxTopK];
  const int64_t token = blockIdx.x;
  const int32_t *ids = p.ids + token * p.topK;
  if (threadIdx.x == 0) {
    sortSlotsByExpert(ids, p.topK, order);
    for (int k = 0; k < p.topK; ++k) {
      const int32_t slot = p.slots[token * p.topK + k];
      rows[k] = nullptr;
      if (slot < 0)
        continue;
      const int64_t d = ids[k] / p.expertsPerRank;
      for (int c = 0; c < p.chunks; ++c)
        if (slot >= p.chunkBegin[c] && slot < p.chunkBegin[c] + p.chunkSlots[c])
          rows[k] = p.returned[c] + (d * p.chunkSlots[c] + slot - p.chunkBegin[c]) * p.hidden;
    }
  }
  __syncthreads();
  const int64_t j = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= p.hidden)
    return;
  p.out[token * p.hidden + j] = combinedColumn(order, p.topK, p.weights + token * p.topK, j,
                                               [&](int slot) { return rows[slot]; });
}

} // namespace

int launchMoeRouteToRanks(const MoeRouteToRanksParams &p, void *stream) {
  if (p.tokens < 0 || p.topK <= 0 || p.topK > kMoeMaxTopK || p.ranks <= 0 ||
      p.ranks > kMoeExchangeMaxRanks || p.experts <= 0 || p.experts % p.ranks != 0 ||
      int64_t(p.tokens) * p.topK > 0x7fffffff || !p.counts ||
      (p.tokens > 0 && (!p.ids || !p.slots || !p.pairs)))
    return cudaErrorInvalidValue;
  routeToRanksKernel<<<1, kRouteThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return int(cudaGetLastError());
}

int launchMoePackRows(const MoePackRowsParams &p, void *stream) {
  if (p.tokens < 0 || p.topK <= 0 || p.hidden <= 0 || p.ranks <= 0 || p.firstSlot < 0 ||
      p.chunkSlots < 0 || !p.counts || !p.sent || (p.tokens > 0 && (!p.x || !p.ids || !p.pairs)))
    return cudaErrorInvalidValue;
  const int64_t total = int64_t(p.ranks) * p.chunkSlots * (int64_t(p.hidden) + 1);
  if (total == 0)
    return 0;
  packRowsKernel<<<gridFor(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return int(cudaGetLastError());
}

int launchMoeUnpackRows(const MoeUnpackRowsParams &p, void *stream) {
  if (p.rows < 0 || p.hidden <= 0 || (p.rows > 0 && (!p.received || !p.x || !p.ids || !p.weights)))
    return cudaErrorInvalidValue;
  const int64_t total = int64_t(p.rows) * (int64_t(p.hidden) + 1);
  if (total == 0)
    return 0;
  unpackRowsKernel<<<gridFor(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return int(cudaGetLastError());
}

int launchMoeCombineReturned(const MoeCombineReturnedParams &p, void *stream) {
  if (p.tokens < 0 || p.topK <= 0 || p.topK > kMoeMaxTopK || p.hidden <= 0 ||
      p.expertsPerRank <= 0 || p.chunks < 1 || p.chunks > kMoeExchangeMaxChunks ||
      (p.tokens > 0 && (!p.ids || !p.weights || !p.slots || !p.out)))
    return cudaErrorInvalidValue;
  for (int c = 0; c < p.chunks; ++c)
    if (p.chunkSlots[c] < 0 || p.chunkBegin[c] < 0 || (p.chunkSlots[c] > 0 && !p.returned[c]))
      return cudaErrorInvalidValue;
  if (p.tokens == 0)
    return 0;
  const dim3 grid(unsigned(p.tokens), unsigned((p.hidden + kThreads - 1) / kThreads));
  combineReturnedKernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return int(cudaGetLastError());
}

} // namespace hybrid::kernels::cuda
