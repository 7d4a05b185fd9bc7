// MoE (see Moe.h): the router in one block per token (its choices made by one warp, and by one
// thread in the reference's order where the order decides ties or sums), and the per-(token, expert) SwiGLU on
// CUDA cores: a warp per output row reading the expert's weight row once, the token's input in
// shared memory.
#include "hybrid/kernels/cuda/Moe.h"
#include "../common/activation.cuh"
#include "../common/block_reduce.cuh"
#include "../common/dependent_launch.cuh"
#include "../common/device_setup.cuh"
#include "../common/fp8_quant.cuh"
#include "moe_combine.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;

using reduce::warpSum;

// a before b in the router's order: larger value, then lower index.
__device__ inline bool ranksBefore(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

// Launched as a programmatic dependent of the logits' GEMV: the bias loads while it drains.
__global__ void __launch_bounds__(kThreads) routerKernel(MoeRouterParams p) {
  __shared__ float scores[kMoeMaxExperts], choice[kMoeMaxExperts];
  __shared__ int chosen[kMoeMaxTopK];
  const int t = blockIdx.x, E = p.experts, tid = threadIdx.x;
  const float *logits = p.logits + size_t(t) * E;
  // The correction bias loads with the logits, not a barrier later: a decode token's router is
  // one block and all latency.
  constexpr int kBiasPerThread = kMoeMaxExperts / kThreads;
  float bias[kBiasPerThread];
#pragma unroll
  for (int j = 0; j < kBiasPerThread; ++j) {
    const int e = tid + j * kThreads;
    bias[j] = p.correctionBias && e < E ? p.correctionBias[e] : 0.0f;
  }
  waitForEarlierKernels(); // the logits are the GEMV's
  if (!p.softmax) {
    for (int e = tid; e < E; e += kThreads)
      scores[e] = 1.0f / (1.0f + expf(-logits[e]));
  } else {
    for (int e = tid; e < E; e += kThreads)
      scores[e] = logits[e];
    __syncthreads();
    if (tid == 0) { // the reference's order of the max and the sum
      float largest = scores[0];
      for (int e = 1; e < E; ++e)
        largest = fmaxf(largest, scores[e]);
      float sum = 0.0f;
      for (int e = 0; e < E; ++e)
        sum += scores[e] = expf(scores[e] - largest);
      for (int e = 0; e < E; ++e)
        scores[e] /= sum;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kBiasPerThread; ++j) {
    const int e = tid + j * kThreads;
    if (e < E)
      choice[e] = scores[e] + bias[j];
  }
  __syncthreads();
  if (p.groups > 1 && tid == 0) {
    // Each group's score (its top two biased scores, or its top one), the best groups kept.
    const int size = E / p.groups;
    float groupScores[64];
    for (int g = 0; g < p.groups; ++g) {
      float first = -INFINITY, second = -INFINITY;
      for (int e = g * size; e < (g + 1) * size; ++e) {
        const float v = choice[e];
        if (v > first) {
          second = first;
          first = v;
        } else if (v > second) {
          second = v;
        }
      }
      groupScores[g] = p.correctionBias && size >= 2 ? first + second : first;
    }
    bool keep[64] = {};
    for (int k = 0; k < p.topKGroups; ++k) {
      int best = -1;
      for (int g = 0; g < p.groups; ++g)
        if (!keep[g] && (best < 0 || ranksBefore(groupScores[g], g, groupScores[best], best)))
          best = g;
      keep[best] = true;
    }
    for (int e = 0; e < E; ++e)
      if (!keep[e / size])
        choice[e] = -INFINITY;
  }
  __syncthreads();
  // The top k, one warp-wide argmax per pick (no block barrier between picks: a decode token's
  // router is all latency). Lane l owns experts l + 32 i, bit i of its `taken` mask. The
  // ranking is a strict total order, so the pick is the one a block-wide argmax makes.
  if (tid >= 32)
    return;
  const int lane = tid;
  uint32_t taken = 0;
  for (int k = 0; k < p.topK; ++k) {
    float best = -INFINITY;
    int index = -1;
    for (int e = lane, i = 0; e < E; e += 32, ++i)
      if (!(taken >> i & 1u) && (index < 0 || ranksBefore(choice[e], e, best, index))) {
        best = choice[e];
        index = e;
      }
    for (int offset = 16; offset > 0; offset /= 2) {
      const float otherValue = __shfl_xor_sync(0xffffffffu, best, offset);
      const int otherIndex = __shfl_xor_sync(0xffffffffu, index, offset);
      if (otherIndex >= 0 && (index < 0 || ranksBefore(otherValue, otherIndex, best, index))) {
        best = otherValue;
        index = otherIndex;
      }
    }
    if (index % 32 == lane)
      taken |= 1u << (index / 32);
    if (lane == 0)
      chosen[k] = index;
  }
  __syncwarp();
  if (tid == 0) { // weights in the choice order, summed in that order
    float sum = 0.0f;
    for (int k = 0; k < p.topK; ++k)
      sum += scores[chosen[k]];
    for (int k = 0; k < p.topK; ++k) {
      float weight = scores[chosen[k]];
      if (p.renormalize)
        weight /= sum + 1e-20f;
      weight *= p.routedScalingFactor;
      p.ids[size_t(t) * p.topK + k] = chosen[k];
      p.weights[size_t(t) * p.topK + k] = weight;
    }
  }
}

template <typename T> __device__ inline float2 pairAt(const T *row, int i);
template <> __device__ inline float2 pairAt<__nv_bfloat16>(const __nv_bfloat16 *row, int i) {
  return __bfloat1622float2(reinterpret_cast<const __nv_bfloat162 *>(row)[i]);
}
template <> __device__ inline float2 pairAt<float>(const float *row, int i) {
  return reinterpret_cast<const float2 *>(row)[i];
}

template <> __device__ inline float2 pairAt<uint8_t>(const uint8_t *row, int i) {
  const __half2_raw halves =
      __nv_cvt_fp8x2_to_halfraw2(reinterpret_cast<const __nv_fp8x2_storage_t *>(row)[i], __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2 *>(&halves));
}

// row . v over `width` values (even), lanes over value pairs. For FP8 rows `scales` holds the
// row's block scales, one per 128 columns: each weight is its code times its block's scale.
template <typename T>
__device__ inline float rowDot(const T *row, const float *v, int width, int lane,
                               const float *scales = nullptr) {
  float sum = 0.0f;
  for (int i = lane; i < width / 2; i += 32) {
    float2 w = pairAt(row, i);
    if constexpr (sizeof(T) == 1) {
      const float scale = scales[2 * i / 128];
      w.x *= scale;
      w.y *= scale;
    }
    sum = fmaf(w.x, v[2 * i], sum);
    sum = fmaf(w.y, v[2 * i + 1], sum);
  }
  return warpSum(sum);
}

// The FP8 GEMM's activation rounding of v[0, width) in shared memory, in place: per 128 values
// (a warp each) the tile scale by `rule`, then each value to the E4M3 code of v / scale and back
// times scale, as ref::quantizeFp8Tiles then dequantizeFp8Tiles.
__device__ inline void roundFp8Tiles(float *v, int width, Fp8ActivationScale rule) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int first = warp * 128; first < width; first += kWarps * 128) {
    float amax = 0.0f;
    for (int i = lane; i < 128 && first + i < width; i += 32)
      amax = fmaxf(amax, fabsf(v[first + i]));
    for (int offset = 16; offset > 0; offset /= 2)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const float scale = quant::fp8TileScale(amax, rule == Fp8ActivationScale::DeepSeekLinear
                                                       ? quant::Fp8Rule::DeepSeekLinear
                                                       : quant::Fp8Rule::DeepSeekUe8m0);
    for (int i = lane; i < 128 && first + i < width; i += 32) {
      const __half_raw code = __nv_cvt_fp8_to_halfraw(quant::floatToE4M3(__fdiv_rn(v[first + i], scale)),
                                                      __NV_E4M3);
      v[first + i] = __half2float(__half(code)) * scale;
    }
  }
}

// Block (token-slot, 8 rows of the intermediate): h = silu(gate x) * up x.
template <typename T>
__global__ void __launch_bounds__(kThreads) gateUpKernel(MoeExpertsParams p, float *h) {
  extern __shared__ float x[];
  waitForEarlierKernels(); // the router's ids, x
  letDependentsLaunch();
  const int slot = blockIdx.x, token = slot / p.topK;
  const int expert = p.ids[slot];
  if (!expertHeld(p, expert)) // the whole block: an invalid or absent expert adds nothing
    return;
  for (int i = threadIdx.x; i < p.hidden; i += kThreads)
    x[i] = p.x[size_t(token) * p.hidden + i];
  __syncthreads();
  if constexpr (sizeof(T) == 1) {
    roundFp8Tiles(x, p.hidden, p.activationScale);
    __syncthreads();
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = int(blockIdx.y) * kWarps + warp;
  if (row >= p.intermediate)
    return;
  const T *gate = static_cast<const T *>(p.gate[expert]) + size_t(row) * p.hidden;
  const T *up = static_cast<const T *>(p.up[expert]) + size_t(row) * p.hidden;
  const float *gateScales = nullptr, *upScales = nullptr;
  if constexpr (sizeof(T) == 1) {
    gateScales = p.gateScales[expert] + size_t(row / 128) * p.gateScaleStride;
    upScales = p.upScales[expert] + size_t(row / 128) * p.gateScaleStride;
  }
  const float g = rowDot(gate, x, p.hidden, lane, gateScales);
  const float u = rowDot(up, x, p.hidden, lane, upScales);
  if (lane == 0)
    h[size_t(slot) * p.intermediate + row] = gatedActivationValue(p.activation, g, u);
}

// Block (token-slot, 8 rows of the output): y = down h.
template <typename T>
__global__ void __launch_bounds__(kThreads) downKernel(MoeExpertsParams p, const float *h,
                                                       float *y) {
  extern __shared__ float hs[];
  waitForEarlierKernels();
  letDependentsLaunch();
  const int slot = blockIdx.x, expert = p.ids[slot];
  if (!expertHeld(p, expert)) // the whole block; gateUpKernel wrote no h for it
    return;
  for (int i = threadIdx.x; i < p.intermediate; i += kThreads)
    hs[i] = h[size_t(slot) * p.intermediate + i];
  __syncthreads();
  if constexpr (sizeof(T) == 1) {
    roundFp8Tiles(hs, p.intermediate, p.activationScale);
    __syncthreads();
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = int(blockIdx.y) * kWarps + warp;
  if (row >= p.hidden)
    return;
  const T *down = static_cast<const T *>(p.down[expert]) + size_t(row) * p.intermediate;
  const float *scales = nullptr;
  if constexpr (sizeof(T) == 1)
    scales = p.downScales[expert] + size_t(row / 128) * p.downScaleStride;
  const float v = rowDot(down, hs, p.intermediate, lane, scales);
  if (lane == 0)
    y[size_t(slot) * p.hidden + row] = v;
}

// Block (token, kThreads columns): its experts' weighted outputs added in ascending expert
// order, from zero. Column blocks spread a decode token over many SMs.
__global__ void __launch_bounds__(kThreads) combineKernel(MoeExpertsParams p, const float *y) {
  waitForEarlierKernels();
  letDependentsLaunch();
  combineToken(p, y, [&](int token, int slot) -> int64_t {
    const int32_t expert = p.ids[int64_t(token) * p.topK + slot];
    return expertHeld(p, expert) ? int64_t(token) * p.topK + slot : -1;
  });
}

__global__ void gatherRowsKernel(const float *x, int64_t width, const int32_t *rows, int32_t count,
                                 float *out) {
  const int64_t total = int64_t(count) * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = x[int64_t(rows[i / width]) * width + i % width];
}

__global__ void scatterAddRowsKernel(const float *in, int64_t width, const int32_t *rows,
                                     const float *scales, int32_t count, float *out) {
  const int64_t total = int64_t(count) * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width;
    float &target = out[int64_t(rows[r]) * width + i % width];
    target = __fadd_rn(target, __fmul_rn(scales[r], in[i]));
  }
}

unsigned gridFor(int64_t n) {
  return unsigned(std::min<int64_t>(std::max<int64_t>(1, (n + kThreads - 1) / kThreads), 8192));
}

template <typename T> int launchPerToken(const MoeExpertsParams &p, cudaStream_t stream) {
  const DeviceSetup setup = deviceSetup([] {
    const int limit = kMoeMaxHidden * int(sizeof(float));
    cudaError_t status = cudaFuncSetAttribute(gateUpKernel<T>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
    if (status == cudaSuccess)
      status = cudaFuncSetAttribute(downKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    limit);
    return status;
  });
  if (setup.status != cudaSuccess)
    return int(setup.status);
  auto *h = static_cast<float *>(p.workspace);
  float *y = h + size_t(p.tokens) * p.topK * p.intermediate;
  // Each a programmatic dependent of the kernel before: three launches of a decode step's
  // latency-bound MoE layer overlap their predecessors' drain.
  const unsigned slots = unsigned(p.tokens * p.topK);
  DependentLaunch gateUp(dim3(slots, unsigned((p.intermediate + kWarps - 1) / kWarps)),
                         dim3(kThreads), stream);
  gateUp.config.dynamicSmemBytes = size_t(p.hidden) * sizeof(float);
  cudaError_t status = cudaLaunchKernelEx(&gateUp.config, gateUpKernel<T>, p, h);
  if (status != cudaSuccess)
    return int(status);
  DependentLaunch down(dim3(slots, unsigned((p.hidden + kWarps - 1) / kWarps)), dim3(kThreads),
                       stream);
  down.config.dynamicSmemBytes = size_t(p.intermediate) * sizeof(float);
  status = cudaLaunchKernelEx(&down.config, downKernel<T>, p, static_cast<const float *>(h), y);
  if (status != cudaSuccess)
    return int(status);
  DependentLaunch combine(
      dim3(unsigned(p.tokens), unsigned((p.hidden + kThreads - 1) / kThreads)), dim3(kThreads),
      stream);
  status = cudaLaunchKernelEx(&combine.config, combineKernel, p, static_cast<const float *>(y));
  return int(status != cudaSuccess ? status : cudaGetLastError());
}

} // namespace

int launchMoeRouter(const MoeRouterParams &p, void *stream) {
  if (p.tokens <= 0 || p.experts <= 0 || p.experts > kMoeMaxExperts || p.topK <= 0 ||
      p.topK > kMoeMaxTopK || p.topK > p.experts || p.groups <= 0 || p.groups > 64 ||
      p.experts % p.groups != 0 || p.topKGroups <= 0 || p.topKGroups > p.groups || !p.logits ||
      !p.ids || !p.weights)
    return cudaErrorInvalidValue;
  DependentLaunch launch(dim3(unsigned(p.tokens)), dim3(kThreads),
                         static_cast<cudaStream_t>(stream));
  const cudaError_t status = cudaLaunchKernelEx(&launch.config, routerKernel, p);
  return int(status != cudaSuccess ? status : cudaGetLastError());
}

size_t moeExpertsWorkspaceBytes(int32_t tokens, int32_t topK, int32_t hidden,
                                int32_t intermediate) {
  return tokens > 0 && topK > 0
             ? size_t(tokens) * topK * (size_t(hidden) + size_t(intermediate)) * sizeof(float)
             : 0;
}

int launchMoeExpertsPerToken(const MoeExpertsParams &p, void *stream) {
  if (p.tokens <= 0 || p.hidden <= 0 || p.hidden > kMoeMaxHidden || p.hidden % 2 != 0 ||
      p.intermediate <= 0 || p.intermediate > kMoeMaxHidden || p.intermediate % 2 != 0 ||
      p.experts <= 0 || p.topK <= 0 || p.topK > kMoeMaxTopK || !p.x || !p.ids || !p.weights ||
      !p.gate || !p.up || !p.down || !p.out || !p.workspace || !gatedActivationValid(p.activation))
    return cudaErrorInvalidValue;
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.type == WeightType::Fp8Block) {
    if (!p.gateScales || !p.upScales || !p.downScales || p.gateScaleStride <= 0 ||
        p.downScaleStride <= 0)
      return cudaErrorInvalidValue;
    return launchPerToken<uint8_t>(p, s);
  }
  return p.type == WeightType::BF16 ? launchPerToken<__nv_bfloat16>(p, s)
                                    : launchPerToken<float>(p, s);
}

int launchGatherRows(const float *x, int64_t width, const int32_t *rows, int32_t count, float *out,
                     void *stream) {
  if (width <= 0 || count < 0 || (count > 0 && (!x || !rows || !out)))
    return cudaErrorInvalidValue;
  if (count == 0)
    return 0;
  gatherRowsKernel<<<gridFor(int64_t(count) * width), kThreads, 0,
                     static_cast<cudaStream_t>(stream)>>>(x, width, rows, count, out);
  return int(cudaGetLastError());
}

int launchScatterAddRows(const float *in, int64_t width, const int32_t *rows, const float *scales,
                         int32_t count, float *out, void *stream) {
  if (width <= 0 || count < 0 || (count > 0 && (!in || !rows || !scales || !out)))
    return cudaErrorInvalidValue;
  if (count == 0)
    return 0;
  scatterAddRowsKernel<<<gridFor(int64_t(count) * width), kThreads, 0,
                         static_cast<cudaStream_t>(stream)>>>(in, width, rows, scales, count, out);
  return int(cudaGetLastError());
}

} // namespace hybrid::kernels::cuda
