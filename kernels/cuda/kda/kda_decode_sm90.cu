// Fused KDA decode step (see KdaDecode.h). One block per (head, sequence); the threads of a block
// keep the head's K x V state in registers (each a slice of one value column), so the state is
// read and written exactly once and every access is coalesced across a warp (row-major [K][V]).
#include "hybrid/kernels/cuda/KdaDecode.h"

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {
namespace {

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ inline float softplus(float x) { return x > 20.0f ? x : log1pf(__expf(x)); }

// Sum over the block; every thread gets the total. `scratch` holds one float per warp.
template <int kThreads> __device__ inline float blockSum(float value, float *scratch) {
  constexpr int kWarps = kThreads / 32;
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads(); // scratch may still be read by a previous reduction
  if (lane == 0)
    scratch[warp] = value;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w)
    total += scratch[w];
  return total;
}

// kSplit threads share a value column, each holding kDim / kSplit of its rows: the state stays
// in registers without spilling and four times more warps keep loads in flight.
template <int kDim, int kSplit>
__global__ void __launch_bounds__(kDim *kSplit) kdaFusedDecodeKernel(KdaDecodeParams p) {
  constexpr int kThreads = kDim * kSplit, kRows = kDim / kSplit;
  const int head = blockIdx.x, sequence = blockIdx.y;
  const int v = threadIdx.x % kDim, group = threadIdx.x / kDim;
  const int channels = p.heads * kDim, channel = head * kDim + v;
  const int history = p.convKernel - 1;
  __shared__ float query[kDim], key[kDim], decay[kDim], update[kDim];
  __shared__ float partial[kSplit][kDim], scratch[kThreads / 32];

  // Short causal conv + SiLU of q, k, v for channel v (first group), shifting the conv state.
  float qkv[3] = {0.0f, 0.0f, 0.0f};
  if (group == 0) {
#pragma unroll
    for (int projection = 0; projection < 3; ++projection) {
      const float input = p.qkv[(size_t(sequence) * 3 + projection) * channels + channel];
      const float *taps = p.convWeight + (size_t(projection) * channels + channel) * p.convKernel;
      float *past = p.convState + size_t(sequence * 3 + projection) * history * channels + channel;
      float acc = taps[history] * input;
      for (int j = 0; j < history; ++j)
        acc += taps[j] * past[size_t(j) * channels];
      for (int j = 0; j + 1 < history; ++j)
        past[size_t(j) * channels] = past[size_t(j + 1) * channels];
      if (history > 0)
        past[size_t(history - 1) * channels] = input;
      qkv[projection] = acc * sigmoid(acc);
    }
  }

  // L2 norm of q and k over the head (eps on the sum of squares), q scaled by K^-1/2.
  const float qNorm = rsqrtf(blockSum<kThreads>(qkv[0] * qkv[0], scratch) + 1e-6f);
  const float kNorm = rsqrtf(blockSum<kThreads>(qkv[1] * qkv[1], scratch) + 1e-6f);
  const float beta = sigmoid(p.betaLogits[size_t(sequence) * p.heads + head]);
  if (group == 0) {
    query[v] = qkv[0] * qNorm * rsqrtf(float(kDim));
    key[v] = qkv[1] * kNorm;
    // Forget gate of key channel v, as a decay factor.
    const float f = p.forget[size_t(sequence) * channels + channel] + p.dtBias[channel];
    const float scaleA = __expf(p.aLog[head]);
    const float g = p.lowerBoundGate ? p.lowerBound * sigmoid(scaleA * f) : -scaleA * softplus(f);
    decay[v] = __expf(g);
  }
  __syncthreads();

  // Delta rule on column v, rows [group * kRows, (group + 1) * kRows):
  // S <- diag(decay) S; u = v - S^T k; S += beta k u^T; o = S^T q.
  const int firstRow = group * kRows;
  float *column = p.state + (size_t(sequence) * p.heads + head) * kDim * kDim +
                  size_t(firstRow) * kDim + v;
  float s[kRows];
  float predicted = 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    s[r] = column[size_t(r) * kDim] * decay[firstRow + r];
    predicted += s[r] * key[firstRow + r];
  }
  partial[group][v] = predicted;
  __syncthreads();
  if (group == 0) {
    float total = 0.0f;
#pragma unroll
    for (int g = 0; g < kSplit; ++g)
      total += partial[g][v];
    update[v] = beta * (qkv[2] - total);
  }
  __syncthreads();
  const float u = update[v];
  float o = 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    s[r] += key[firstRow + r] * u;
    o += s[r] * query[firstRow + r];
    column[size_t(r) * kDim] = s[r];
  }
  partial[group][v] = o; // every group has read `partial` for the prediction before the sync above
  __syncthreads();
  if (group == 0) {
    o = 0.0f;
#pragma unroll
    for (int g = 0; g < kSplit; ++g)
      o += partial[g][v];
  }

  // Gated RMSNorm over the head's outputs, sigmoid output gate.
  const float sumSquares = blockSum<kThreads>(group == 0 ? o * o : 0.0f, scratch);
  if (group == 0) {
    const float rstd = rsqrtf(sumSquares / kDim + p.normEpsilon);
    p.out[size_t(sequence) * channels + channel] =
        o * rstd * p.normWeight[v] * sigmoid(p.outputGate[size_t(sequence) * channels + channel]);
  }
}

} // namespace

int launchKdaFusedDecode(const KdaDecodeParams &params, void *stream) {
  if (params.batch <= 0 || params.heads <= 0 || params.convKernel < 1)
    return cudaErrorInvalidValue;
  const dim3 grid(params.heads, params.batch);
  auto cudaStream = static_cast<cudaStream_t>(stream);
  switch (params.headDim) {
  case 64:
    kdaFusedDecodeKernel<64, 4><<<grid, 64 * 4, 0, cudaStream>>>(params);
    break;
  case 128:
    kdaFusedDecodeKernel<128, 4><<<grid, 128 * 4, 0, cudaStream>>>(params);
    break;
  default:
    return cudaErrorInvalidValue;
  }
  return static_cast<int>(cudaGetLastError());
}

} // namespace hybrid::kernels::cuda
