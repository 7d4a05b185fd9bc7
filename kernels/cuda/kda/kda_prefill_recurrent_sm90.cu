// KDA recurrent prefill (see KdaPrefill.h). One block per (head, sequence) walks the sequence's
// tokens with the head's K x V state in registers (kSplit threads per value column, as in the
// decode kernel) and the conv histories of the head's channels in registers too, so state and
// conv state are read once and written once per sequence, not per token.
#include "hybrid/kernels/cuda/KdaDecode.h"
#include "hybrid/kernels/cuda/KdaPrefill.h"
#include "kda_device_math.cuh"

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {
namespace {
using namespace kda_math;

template <int kDim, int kSplit, typename State>
__global__ void __launch_bounds__(kDim *kSplit) kdaRecurrentPrefillKernel(KdaPrefillParams p) {
  constexpr int kThreads = kDim * kSplit, kRows = kDim / kSplit, kHistory = kKdaMaxConvKernel - 1;
  const int head = blockIdx.x, sequence = blockIdx.y;
  const int begin = p.cuSeqlens[sequence], end = p.cuSeqlens[sequence + 1];
  if (end <= begin)
    return; // an empty sequence keeps its states
  const int v = threadIdx.x % kDim, group = threadIdx.x / kDim;
  const int channels = p.heads * kDim, channel = head * kDim + v;
  const int history = p.convKernel - 1;
  __shared__ float query[kDim], key[kDim], decay[kDim], update[kDim];
  __shared__ float partial[kSplit][kDim], scratch[kThreads / 32];
  __shared__ float2 pairScratch[kThreads / 32];

  // Per-channel constants and conv histories (group 0 owns channel v of q, k and v).
  float taps[3][kKdaMaxConvKernel] = {}, past[3][kHistory] = {};
  float dtBias = 0.0f, normWeight = 0.0f;
  float *convState = p.convState + size_t(sequence) * 3 * history * channels + channel;
  if (group == 0) {
#pragma unroll
    for (int projection = 0; projection < 3; ++projection) {
#pragma unroll
      for (int j = 0; j < kKdaMaxConvKernel; ++j)
        if (j < p.convKernel)
          taps[projection][j] =
              p.weights.convWeight[(size_t(projection) * channels + channel) * p.convKernel + j];
#pragma unroll
      for (int j = 0; j < kHistory; ++j)
        if (j < history)
          past[projection][j] = convState[(size_t(projection) * history + j) * channels];
    }
    dtBias = p.weights.dtBias[channel];
    normWeight = p.weights.normWeight[v];
  }
  const float scaleA = __expf(p.weights.aLog[head]);

  const int firstRow = group * kRows;
  State *column = static_cast<State *>(p.state) +
                  (size_t(sequence) * p.heads + head) * kDim * kDim + size_t(firstRow) * kDim + v;
  float s[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    s[r] = loadState(column + size_t(r) * kDim);

  // A token's inputs, loaded one token ahead so their latency overlaps the previous token's work.
  struct TokenInputs {
    float qkv[3], forget, gate, betaLogit;
  };
  auto load = [&](int t) {
    TokenInputs in{};
    in.betaLogit = p.betaLogits[size_t(t) * p.heads + head];
    if (group == 0) {
#pragma unroll
      for (int projection = 0; projection < 3; ++projection)
        in.qkv[projection] = p.qkv[(size_t(t) * 3 + projection) * channels + channel];
      in.forget = p.forget[size_t(t) * channels + channel];
      in.gate = p.outputGate[size_t(t) * channels + channel];
    }
    return in;
  };
  TokenInputs next = load(begin);
  for (int t = begin; t < end; ++t) {
    const TokenInputs current = next;
    if (t + 1 < end)
      next = load(t + 1);
    const float beta = sigmoid(current.betaLogit);
    float qkv[3] = {0.0f, 0.0f, 0.0f}, gateLogit = 0.0f, channelDecay = 0.0f;
    if (group == 0) {
#pragma unroll
      for (int projection = 0; projection < 3; ++projection) {
        const float input = current.qkv[projection];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < kHistory; ++j)
          acc += j < history ? taps[projection][j] * past[projection][j] : 0.0f;
#pragma unroll
        for (int j = 0; j < kKdaMaxConvKernel; ++j)
          acc += j == history ? taps[projection][j] * input : 0.0f;
        qkv[projection] = acc * sigmoid(acc);
#pragma unroll
        for (int j = 0; j < kHistory; ++j)
          if (j < history)
            past[projection][j] = j + 1 < history ? past[projection][j + 1] : input;
      }
      channelDecay = forgetDecay(current.forget + dtBias, scaleA, p.weights);
      gateLogit = current.gate;
    }
    const float2 squares =
        blockSum<kThreads>(make_float2(qkv[0] * qkv[0], qkv[1] * qkv[1]), pairScratch);
    if (group == 0) {
      query[v] = qkv[0] * rsqrtf(squares.x + 1e-6f) * rsqrtf(float(kDim));
      key[v] = qkv[1] * rsqrtf(squares.y + 1e-6f);
      decay[v] = channelDecay;
    }
    __syncthreads();

    // The state is stored once, after the last token.
    const float o = deltaRuleColumn<kRows, kSplit, kDim, false>(
        s, query, key, decay, beta, qkv[2], firstRow, group, v, partial, update,
        static_cast<State *>(nullptr), kDim);
    const float sumSquares = blockSum<kThreads>(group == 0 ? o * o : 0.0f, scratch);
    if (group == 0)
      p.out[size_t(t) * channels + channel] =
          o * rsqrtf(sumSquares / kDim + p.weights.normEpsilon) * normWeight * sigmoid(gateLogit);
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r)
    storeState(column + size_t(r) * kDim, s[r]);
  if (group == 0) {
#pragma unroll
    for (int projection = 0; projection < 3; ++projection)
#pragma unroll
      for (int j = 0; j < kHistory; ++j)
        if (j < history)
          convState[(size_t(projection) * history + j) * channels] = past[projection][j];
  }
}

} // namespace

int launchKdaRecurrentPrefill(const KdaPrefillParams &params, void *stream) {
  if (params.sequences <= 0 || params.heads <= 0 || params.convKernel < 1 ||
      params.convKernel > kKdaMaxConvKernel || params.cuSeqlens == nullptr)
    return cudaErrorInvalidValue;
  const dim3 grid(params.heads, params.sequences);
  auto cudaStream = static_cast<cudaStream_t>(stream);
  if (params.headDim != 64 && params.headDim != 128)
    return cudaErrorInvalidValue;
  return withStateType(params.stateType, [&](auto tag) {
    using State = typename decltype(tag)::type;
    if (params.headDim == 64)
      kdaRecurrentPrefillKernel<64, 4, State><<<grid, 64 * 4, 0, cudaStream>>>(params);
    else
      kdaRecurrentPrefillKernel<128, 4, State><<<grid, 128 * 4, 0, cudaStream>>>(params);
    return static_cast<int>(cudaGetLastError());
  });
}

} // namespace hybrid::kernels::cuda
