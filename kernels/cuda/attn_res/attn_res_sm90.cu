// AttnRes mix (+ RMSNorm), see AttnRes.h: one block per token. Each candidate's two sums (its
// squares, and proj * norm_weight * value) in one pass, the softmax by one thread in candidate
// order, then the mix and its RMSNorm.
#include "hybrid/kernels/cuda/AttnRes.h"
#include "../common/block_reduce.cuh"

#include <cuda_runtime.h>

#include <cmath>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) attnResKernel(AttnResParams p) {
  __shared__ float partial[kThreads / 32];
  __shared__ float weights[kAttnResMaxCandidates];
  const int t = blockIdx.x, dim = p.dim;
  for (int m = 0; m < p.candidates; ++m) {
    const float *value = p.values[m] + size_t(t) * dim;
    float squares = 0.0f, projected = 0.0f;
    for (int d = threadIdx.x; d < dim; d += kThreads) {
      squares += value[d] * value[d];
      projected += p.projWeight[d] * (p.normWeight[d] * value[d]);
    }
    const float sumSquares = reduce::blockSum<kThreads>(squares, partial);
    const float sumProjected = reduce::blockSum<kThreads>(projected, partial);
    if (threadIdx.x == 0) // the score: proj . (w * v * rms^-1), the scalar factored out
      weights[m] = sumProjected * (1.0f / sqrtf(sumSquares / float(dim) + p.epsilon));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float largest = -INFINITY;
    for (int m = 0; m < p.candidates; ++m)
      largest = fmaxf(largest, weights[m]);
    float sum = 0.0f;
    for (int m = 0; m < p.candidates; ++m)
      sum += weights[m] = expf(weights[m] - largest);
    for (int m = 0; m < p.candidates; ++m)
      weights[m] /= sum;
  }
  __syncthreads();
  float *mixed = p.mixed + size_t(t) * dim;
  float squares = 0.0f;
  for (int d = threadIdx.x; d < dim; d += kThreads) {
    float sum = 0.0f; // in candidate order, as the reference
    for (int m = 0; m < p.candidates; ++m)
      sum += weights[m] * p.values[m][size_t(t) * dim + d];
    mixed[d] = sum;
    squares += sum * sum;
  }
  if (!p.normed)
    return;
  const float scale =
      1.0f / sqrtf(reduce::blockSum<kThreads>(squares, partial) / float(dim) + p.outputEpsilon);
  float *normed = p.normed + size_t(t) * dim;
  for (int d = threadIdx.x; d < dim; d += kThreads) // each thread reads back its own values
    normed[d] = p.outputNormWeight[d] * (mixed[d] * scale);
}

} // namespace

int launchAttnResMix(const AttnResParams &p, void *stream) {
  if (p.tokens <= 0 || p.dim <= 0 || p.candidates <= 0 || p.candidates > kAttnResMaxCandidates ||
      !p.normWeight || !p.projWeight || !p.mixed || (p.normed && !p.outputNormWeight))
    return cudaErrorInvalidValue;
  for (int m = 0; m < p.candidates; ++m)
    if (!p.values[m])
      return cudaErrorInvalidValue;
  attnResKernel<<<unsigned(p.tokens), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return int(cudaGetLastError());
}

} // namespace hybrid::kernels::cuda
