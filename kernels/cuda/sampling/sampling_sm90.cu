// Token choice on the GPU (see Sampling.h and ref::sampleToken, the definition it follows).
// One block of 1024 threads per row; every pass over the row reads it from global memory (a
// 163,840-word row is 640 KB, L2-resident across the passes). With a workspace the argmax,
// all a greedy row needs, first runs over parts of the row in many blocks.
#include "../common/dependent_launch.cuh"
#include "hybrid/kernels/cuda/Sampling.h"

#include <cmath>
#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;

// An unsigned key in the order of the floats (NaN as -infinity: never chosen).
__device__ inline uint32_t orderKey(float v) {
  if (isnan(v))
    v = -INFINITY;
  const uint32_t bits = __float_as_uint(v);
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}
__device__ inline float keyValue(uint32_t key) {
  return __uint_as_float(key & 0x80000000u ? key & 0x7fffffffu : ~key);
}

__device__ inline double blockSumDouble(double value, double *scratch) {
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  __syncthreads();
  if (threadIdx.x % 32 == 0)
    scratch[threadIdx.x / 32] = value;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kWarps; ++w)
    total += scratch[w];
  return total;
}

// The argmax in parts: part j of a row is the ids [j kPartIds, (j + 1) kPartIds), one block
// of kPartThreads each, its best (largest, lowest id among ties, NaN skipped; id -1 when the
// part has none) written for the row's block to reduce.
constexpr int kPartThreads = 256, kPartIds = kPartThreads * 16;
struct ArgmaxPart {
  float value;
  int32_t pad;
  int64_t id;
};

__host__ __device__ inline int64_t argmaxParts(int64_t vocab) {
  return (vocab + kPartIds - 1) / kPartIds;
}

// Whether (v, id) goes before (best, bestId) in the argmax: larger, then the lower id.
__device__ inline bool argmaxBefore(float v, int64_t id, float best, int64_t bestId) {
  return id >= 0 && (bestId < 0 || v > best || (v == best && id < bestId));
}

__device__ inline void warpArgmax(float &best, int64_t &bestId) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, best, offset);
    const int64_t id = __shfl_xor_sync(0xffffffffu, bestId, offset);
    if (argmaxBefore(v, id, best, bestId)) {
      best = v;
      bestId = id;
    }
  }
}

// The block's argmax from each thread's (best, bestId), in every thread: the warps' bests
// through shared memory (kBlockWarps of each), then taken in warp order.
template <int kBlockWarps>
__device__ inline void blockArgmax(float &best, int64_t &bestId, float *bestValues,
                                   int64_t *bestIds) {
  warpArgmax(best, bestId);
  if (threadIdx.x % 32 == 0) {
    bestValues[threadIdx.x / 32] = best;
    bestIds[threadIdx.x / 32] = bestId;
  }
  __syncthreads();
  best = -INFINITY;
  bestId = -1;
  for (int w = 0; w < kBlockWarps; ++w)
    if (argmaxBefore(bestValues[w], bestIds[w], best, bestId)) {
      best = bestValues[w];
      bestId = bestIds[w];
    }
}

__global__ void __launch_bounds__(kPartThreads) argmaxPartsKernel(SampleRowsParams p) {
  __shared__ float bestValues[kPartThreads / 32];
  __shared__ int64_t bestIds[kPartThreads / 32];
  const int part = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
  const int64_t V = p.vocab, first = int64_t(part) * kPartIds;
  const float *logits = p.logits + int64_t(row) * (p.logitsStride ? p.logitsStride : V);
  letDependentsLaunch(); // the rows' blocks may take their SMs now; they wait for every part
  // Every load issued before the first compare: 16 a thread, strided so a warp's are coalesced.
  float values[kPartIds / kPartThreads];
#pragma unroll
  for (int j = 0; j < kPartIds / kPartThreads; ++j) {
    const int64_t i = first + tid + j * kPartThreads;
    values[j] = i < V ? __ldcg(logits + i) : NAN;
  }
  float best = -INFINITY;
  int64_t bestId = -1;
#pragma unroll
  for (int j = 0; j < kPartIds / kPartThreads; ++j) // ids ascending: a tie keeps the first
    if (!isnan(values[j]) && (bestId < 0 || values[j] > best)) {
      best = values[j];
      bestId = first + tid + j * kPartThreads;
    }
  blockArgmax<kPartThreads / 32>(best, bestId, bestValues, bestIds);
  if (tid == 0)
    static_cast<ArgmaxPart *>(p.workspace)[int64_t(row) * argmaxParts(V) + part] = {best, 0,
                                                                                    bestId};
}

__global__ void __launch_bounds__(kThreads) sampleRowsKernel(SampleRowsParams p) {
  __shared__ float bestValues[kWarps];
  __shared__ int64_t bestIds[kWarps];
  __shared__ double sums[kWarps];
  __shared__ double prefixes[kThreads + 1];
  __shared__ uint32_t histogram[256];
  __shared__ int64_t lastKept[kWarps];
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t V = p.vocab;
  const float *logits = p.logits + int64_t(row) * (p.logitsStride ? p.logitsStride : V);
  const SamplingRow s = p.samplingRows[row];

  // 1. The argmax (largest, lowest id among ties; NaN skipped): over the parts' bests when
  // argmaxPartsKernel ran first, else over the row.
  float best = -INFINITY;
  int64_t bestId = -1;
  if (p.workspace) {
    waitForEarlierKernels(); // the parts
    const int64_t parts = argmaxParts(V);
    const auto *bests = static_cast<const ArgmaxPart *>(p.workspace) + int64_t(row) * parts;
    for (int64_t j = tid; j < parts; j += kThreads) {
      const ArgmaxPart part = bests[j];
      if (argmaxBefore(part.value, part.id, best, bestId)) {
        best = part.value;
        bestId = part.id;
      }
    }
  } else {
    for (int64_t i = tid; i < V; i += kThreads) {
      const float v = logits[i];
      if (!isnan(v) && (bestId < 0 || v > best)) {
        best = v;
        bestId = i;
      }
    }
  }
  blockArgmax<kWarps>(best, bestId, bestValues, bestIds);
  if (bestId < 0 || s.temperature <= 0.0f || s.topK == 1 || isinf(best)) {
    if (tid == 0)
      p.tokens[row] = bestId < 0 ? 0 : bestId;
    return;
  }
  const float m = best / s.temperature;
  auto scaled = [&](int64_t i) {
    const float v = logits[i];
    return isnan(v) ? -INFINITY : v / s.temperature;
  };

  // 2. top-k: the topK-th largest scaled logit, by a radix select over its order key.
  float threshold = -INFINITY;
  if (s.topK > 0 && s.topK < V) {
    uint32_t prefix = 0, remaining = uint32_t(s.topK);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = tid; b < 256; b += kThreads)
        histogram[b] = 0;
      __syncthreads();
      for (int64_t i = tid; i < V; i += kThreads) {
        const uint32_t key = orderKey(scaled(i));
        if (shift == 24 || (key >> (shift + 8)) == prefix)
          atomicAdd(&histogram[(key >> shift) & 0xffu], 1u);
      }
      __syncthreads();
      // From the largest digit down to the one holding the remaining-th largest.
      uint32_t digit = 0, above = 0;
      for (int b = 255; b >= 0; --b) {
        if (above + histogram[b] >= remaining) {
          digit = uint32_t(b);
          break;
        }
        above += histogram[b];
      }
      prefix = (prefix << 8) | digit;
      remaining -= above;
      __syncthreads(); // the histogram is reset next pass
    }
    threshold = keyValue(prefix);
  }
  auto weight = [&](int64_t i) {
    const float v = scaled(i);
    return v >= threshold && v > -INFINITY ? expf(v - m) : 0.0f;
  };

  // 3. top-p: the largest weight tau whose {w >= tau} holds at least topP of the mass.
  float tau = 0.0f;
  if (s.topP < 1.0f) {
    double total = 0.0;
    for (int64_t i = tid; i < V; i += kThreads)
      total += weight(i);
    const double mass = double(s.topP) * blockSumDouble(total, sums);
    // w <= 1: bisect the bit patterns of [0, 1] for the largest tau with S(tau) >= mass.
    uint32_t low = 0, high = 0x3f800000u; // S(low) >= mass always holds
    while (low < high) {
      const uint32_t middle = low + (high - low + 1) / 2;
      const float candidate = __uint_as_float(middle);
      double part = 0.0;
      for (int64_t i = tid; i < V; i += kThreads) {
        const float w = weight(i);
        if (w >= candidate)
          part += w;
      }
      if (blockSumDouble(part, sums) >= mass)
        low = middle;
      else
        high = middle - 1;
    }
    tau = __uint_as_float(low);
  }

  // 4. The inverse CDF in id order: contiguous segments per thread; their exclusive prefixes
  // summed by one thread in order, so the segments' intervals [E_t, E_t+1) partition [0, kept)
  // exactly and one thread claims the target.
  const int64_t segment = (V + kThreads - 1) / kThreads;
  const int64_t begin = min(V, int64_t(tid) * segment), end = min(V, begin + segment);
  double own = 0.0;
  int64_t last = -1;
  for (int64_t i = begin; i < end; ++i) {
    const float w = weight(i);
    if (w > 0.0f && w >= tau) {
      own += w;
      last = i;
    }
  }
  prefixes[tid] = own;
  __syncthreads();
  if (tid == 0) {
    double running = 0.0;
    for (int t = 0; t < kThreads; ++t) {
      const double next = running + prefixes[t];
      prefixes[t] = running;
      running = next;
    }
    prefixes[kThreads] = running; // the kept mass
  }
  int64_t lastInWarp = last;
  for (int offset = 16; offset > 0; offset /= 2)
    lastInWarp = max(lastInWarp, __shfl_xor_sync(0xffffffffu, lastInWarp, offset));
  if (lane == 0)
    lastKept[warp] = lastInWarp;
  __syncthreads();
  const double target = double(s.uniform) * prefixes[kThreads];
  if (prefixes[tid] <= target && target < prefixes[tid + 1]) {
    double running = prefixes[tid];
    int64_t chosen = last;
    for (int64_t i = begin; i < end; ++i) {
      const float w = weight(i);
      if (w > 0.0f && w >= tau) {
        running += w;
        if (running > target) {
          chosen = i;
          break;
        }
      }
    }
    p.tokens[row] = chosen;
  } else if (tid == 0 && !(target < prefixes[kThreads])) {
    int64_t lastOverall = -1; // rounding put the target past the kept mass
    for (int w = 0; w < kWarps; ++w)
      lastOverall = max(lastOverall, lastKept[w]);
    p.tokens[row] = lastOverall;
  }
}

} // namespace

int launchSampleRows(const SampleRowsParams &p, void *stream) {
  if (p.rows <= 0 || p.rows > 0x7fffffff || p.vocab <= 0 || !p.logits || !p.samplingRows ||
      !p.tokens || (p.logitsStride != 0 && p.logitsStride < p.vocab))
    return cudaErrorInvalidValue;
  const auto s = static_cast<cudaStream_t>(stream);
  if (!p.workspace || p.rows > 65535) { // (the parts' grid takes rows as its y)
    SampleRowsParams whole = p;
    whole.workspace = nullptr; // the row's block reads the row, no parts
    sampleRowsKernel<<<unsigned(p.rows), kThreads, 0, s>>>(whole);
    return int(cudaGetLastError());
  }
  if (reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0 || argmaxParts(p.vocab) > 0x7fffffff)
    return cudaErrorInvalidValue;
  argmaxPartsKernel<<<dim3(unsigned(argmaxParts(p.vocab)), unsigned(p.rows)), kPartThreads, 0, s>>>(
      p);
  if (const cudaError_t status = cudaGetLastError())
    return int(status);
  // The row's block starts while the parts drain (it waits for them before reading).
  DependentLaunch launch(dim3(unsigned(p.rows)), dim3(kThreads), s);
  const cudaError_t status = cudaLaunchKernelEx(&launch.config, sampleRowsKernel, p);
  return int(status != cudaSuccess ? status : cudaGetLastError());
}

size_t sampleRowsWorkspaceBytes(int64_t rows, int64_t vocab) {
  return rows > 0 && vocab > 0 ? size_t(rows) * size_t(argmaxParts(vocab)) * sizeof(ArgmaxPart) : 0;
}

} // namespace hybrid::kernels::cuda
