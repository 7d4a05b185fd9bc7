// KDA decode step (see KdaDecode.h). Either path keeps each value column's slice of the K x V state
// in registers, so the state is read and written exactly once and every access is coalesced across
// a warp (row-major [K][V]).
//  - fused: one block per (head, sequence) does everything in one launch; the default.
//  - split: a prolog kernel does the conv (which shifts the conv state: one owner per channel, so
//    it cannot be spread over the state kernel's blocks), the norms and the gates; the state
//    kernel runs 4 blocks per head of 32 columns each and issues its state loads before waiting
//    on the prolog (programmatic dependent launch), and its last block per head does the norm.
//    Smaller, independent blocks keep more loads in flight; it wins only with many waves of work.
#include "../common/dependent_launch.cuh"
#include "../linear/gemv_arithmetic.cuh"
#include "hybrid/kernels/cuda/KdaDecode.h"
#include "kda_device_math.cuh"

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {
namespace {
using namespace kda_math;

// Where row `row`'s sequence keeps its states (KdaDecodeParams::stateIndices and strides).
__device__ inline size_t stateRowOf(const KdaDecodeParams &p, int row) {
  return p.stateIndices ? size_t(p.stateIndices[row]) : size_t(row);
}
__device__ inline float *convStateOf(const KdaDecodeParams &p, int row) {
  const size_t stride = p.convStateStride ? size_t(p.convStateStride)
                                          : size_t(3) * (p.convKernel - 1) * p.heads * p.headDim;
  return p.convState + stateRowOf(p, row) * stride;
}
template <typename State>
__device__ inline State *stateOf(const KdaDecodeParams &p, int row, int head) {
  const size_t headElements = size_t(p.headDim) * p.headDim;
  const size_t stride = p.stateStride ? size_t(p.stateStride) : p.heads * headElements;
  return static_cast<State *>(p.state) + stateRowOf(p, row) * stride + head * headElements;
}

// Short causal conv + SiLU of one channel of q, k and v for this step, shifting the channel's conv
// histories by one input. One thread owns a channel's histories. Every load is issued before the
// first store: the stores may alias the loads as far as the compiler knows, so shifting in place
// would otherwise be a chain of dependent L2 round trips.
__device__ inline void convolveAndShift(const KdaDecodeParams &p, int sequence, int channel,
                                        float out[3]) {
  const int channels = p.heads * p.headDim, history = p.convKernel - 1;
  float input[3], past[3][kKdaMaxConvKernel - 1], taps[3][kKdaMaxConvKernel];
#pragma unroll
  for (int projection = 0; projection < 3; ++projection) {
    input[projection] = p.qkv[(size_t(sequence) * 3 + projection) * channels + channel];
    const float *weights = p.weights.convWeight + (size_t(projection) * channels + channel) * p.convKernel;
    const float *pastIn =
        convStateOf(p, sequence) + size_t(projection) * history * channels + channel;
#pragma unroll
    for (int j = 0; j < kKdaMaxConvKernel; ++j)
      taps[projection][j] = j < p.convKernel ? weights[j] : 0.0f;
#pragma unroll
    for (int j = 0; j < kKdaMaxConvKernel - 1; ++j)
      past[projection][j] = j < history ? pastIn[size_t(j) * channels] : 0.0f;
  }
#pragma unroll
  for (int projection = 0; projection < 3; ++projection) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kKdaMaxConvKernel - 1; ++j)
      acc += j < history ? taps[projection][j] * past[projection][j] : 0.0f;
#pragma unroll
    for (int j = 0; j < kKdaMaxConvKernel; ++j)
      acc += j == history ? taps[projection][j] * input[projection] : 0.0f;
    out[projection] = acc * sigmoid(acc);
    float *pastOut = convStateOf(p, sequence) + size_t(projection) * history * channels + channel;
#pragma unroll
    for (int j = 0; j < kKdaMaxConvKernel - 1; ++j)
      if (j < history)
        pastOut[size_t(j) * channels] = j + 1 < history ? past[projection][j + 1] : input[projection];
  }
}

// A key channel's forget gate as a decay factor exp(g), from its logit, dt bias and A_log.
__device__ inline float channelDecay(float forgetLogit, float dtBias, float aLog,
                                     const KdaLayerWeights &w) {
  return forgetDecay(forgetLogit + dtBias, __expf(aLog), w);
}
// The forget gate of key channel `channel` as a decay factor exp(g).
__device__ inline float decayOf(const KdaDecodeParams &p, int sequence, int head, int channel) {
  return channelDecay(p.forget[size_t(sequence) * p.heads * p.headDim + channel],
                      p.weights.dtBias[channel], p.weights.aLog[head], p.weights);
}

// The fused kernel's low-rank gates (KdaDecodeParams::forgetLowRank, gateLowRank): the head's
// kDim forget channels, then its kDim gate channels, over groups of 16 lanes, output j to group
// j % kGroups. Lane `sub` of a group multiplies chunk `sub` of the row's input as lane `sub` of
// the decode GEMV's narrow form does. That form's warp tree sees +0 in its lanes past
// rank / 8 <= 16, so its first step (offset 16) adds +0 and the rest stay within 16 lanes: the
// group's tree below makes the same sums in the same order, the GEMV's bits.
template <int kDim, int kThreads> struct LowRankGates {
  static constexpr int kGroups = kThreads / 16, kPerGroup = 2 * kDim / kGroups;
  static_assert(kPerGroup * kGroups == 2 * kDim && kPerGroup % 2 == 0,
                "a group's outputs: as many forget as gate channels");
  static_assert(kKdaDecodeMaxLowRank / 8 <= 16, "a chunk a lane of 16");
  uint4 weights[kPerGroup];
  float inputs[2][8] = {}; // the forget and gate inputs' chunks of the lane

  static __device__ const KdaLowRankGate &of(const KdaDecodeParams &p, int i) {
    return i < kPerGroup / 2 ? p.forgetLowRank : p.gateLowRank;
  }
  static __device__ bool lanesChunk(const KdaLowRankGate &gate) {
    return gate.weight && int(threadIdx.x % 16) < gate.rank / 8;
  }
  // The head's weight chunks: constants, loaded before the launch's wait.
  __device__ void load(const KdaDecodeParams &p, int head) {
    const int sub = threadIdx.x % 16, group = threadIdx.x / 16;
#pragma unroll
    for (int i = 0; i < kPerGroup; ++i) {
      const KdaLowRankGate &gate = of(p, i);
      const int channel = head * kDim + (group + i * kGroups) % kDim;
      weights[i] =
          lanesChunk(gate)
              ? gemv_arithmetic::loadStreaming(static_cast<const __nv_bfloat16 *>(gate.weight) +
                                               channel * gate.weightStride + sub * 8)
              : make_uint4(0, 0, 0, 0);
    }
  }
  // Row `sequence`'s input chunks, after the wait and before the conv's stores (which the
  // compiler must assume alias them: loaded after those, they were another L2 round trip).
  __device__ void loadInputs(const KdaDecodeParams &p, int sequence) {
    const int sub = threadIdx.x % 16;
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      const KdaLowRankGate &gate = which == 0 ? p.forgetLowRank : p.gateLowRank;
      if (lanesChunk(gate))
        gemv_arithmetic::inputChunk(gate.in + sequence * gate.inStride + sub * 8,
                                    p.lowRankRoundInputToBf16, inputs[which]);
    }
  }
  // The gates into out[2 * kDim] (shared; read them after a block barrier). Every thread calls
  // it (the shuffles).
  __device__ void compute(const KdaDecodeParams &p, float *out) const {
    const int sub = threadIdx.x % 16, group = threadIdx.x / 16;
#pragma unroll
    for (int i = 0; i < kPerGroup; ++i) {
      const KdaLowRankGate &gate = of(p, i);
      if (!gate.weight)
        continue; // the same for every thread: the shuffles stay whole-warp
      float sum = lanesChunk(gate)
                      ? gemv_arithmetic::dot8(weights[i], inputs[i < kPerGroup / 2 ? 0 : 1], 0.0f)
                      : 0.0f;
      sum += 0.0f; // the GEMV tree's offset-16 step: its lanes 16-31 hold +0 (a -0 becomes +0)
      for (int offset = 8; offset > 0; offset /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (sub == 0)
        out[group + i * kGroups] = 0.0f + sum; // as the narrow form's store
    }
  }
};

// kSplit threads share a value column, each holding kDim / kSplit of its rows: the state stays
// in registers without spilling and four times more warps keep loads in flight.
template <int kDim, int kSplit, typename State>
__global__ void __launch_bounds__(kDim *kSplit) kdaFusedDecodeKernel(KdaDecodeParams p) {
  constexpr int kThreads = kDim * kSplit, kRows = kDim / kSplit;
  const int head = blockIdx.x, sequence = blockIdx.y;
  const bool forgetLowRank = p.forgetLowRank.weight, gateLowRank = p.gateLowRank.weight;
  LowRankGates<kDim, kThreads> lowRank;
  if (forgetLowRank || gateLowRank)
    lowRank.load(p, head);
  waitForEarlierKernels(); // launched as a programmatic dependent
  letDependentsLaunch();
  const int v = threadIdx.x % kDim, group = threadIdx.x / kDim;
  const int channels = p.heads * kDim, channel = head * kDim + v;
  __shared__ float query[kDim], key[kDim], decay[kDim], update[kDim], lowRankGates[2 * kDim];
  __shared__ float partial[kSplit][kDim], scratch[kThreads / 32];
  __shared__ float2 pairScratch[kThreads / 32];

  // Loads that do not depend on the conv go out before its stores (which may alias them).
  if (forgetLowRank || gateLowRank)
    lowRank.loadInputs(p, sequence);
  const float beta = sigmoid(p.betaLogits[size_t(sequence) * p.heads + head]);
  float forgetLogit = 0.0f, dtBias = 0.0f, aLog = 0.0f, gateLogit = 0.0f, normWeight = 0.0f;
  float qkv[3] = {0.0f, 0.0f, 0.0f};
  if (group == 0) {
    if (!forgetLowRank)
      forgetLogit = p.forget[size_t(sequence) * channels + channel];
    dtBias = p.weights.dtBias[channel];
    aLog = p.weights.aLog[head];
    if (!gateLowRank)
      gateLogit = p.outputGate[size_t(sequence) * channels + channel];
    normWeight = p.weights.normWeight[v];
    // Short causal conv + SiLU of q, k, v for channel v, shifting the conv state.
    convolveAndShift(p, sequence, channel, qkv);
  }
  if (forgetLowRank || gateLowRank)
    lowRank.compute(p, lowRankGates);

  // L2 norm of q and k over the head (eps on the sum of squares), q scaled by K^-1/2. The block
  // sum's barriers also publish the low-rank gates.
  const float2 squares =
      blockSum<kThreads>(make_float2(qkv[0] * qkv[0], qkv[1] * qkv[1]), pairScratch);
  const float qNorm = rsqrtf(squares.x + 1e-6f), kNorm = rsqrtf(squares.y + 1e-6f);
  if (group == 0) {
    if (forgetLowRank)
      forgetLogit = lowRankGates[v];
    if (gateLowRank)
      gateLogit = lowRankGates[kDim + v];
    query[v] = qkv[0] * qNorm * rsqrtf(float(kDim));
    key[v] = qkv[1] * kNorm;
    // the forget gate of key channel v, as a decay factor
    decay[v] = channelDecay(forgetLogit, dtBias, aLog, p.weights);
  }
  __syncthreads();

  // Delta rule on column v, rows [group * kRows, (group + 1) * kRows).
  const int firstRow = group * kRows;
  State *column = stateOf<State>(p, sequence, head) + size_t(firstRow) * kDim + v;
  float s[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    s[r] = loadState(column + size_t(r) * kDim);
  const float o = deltaRuleColumn<kRows, kSplit, kDim, true>(s, query, key, decay, beta, qkv[2], firstRow,
                                                       group, v, partial, update, column, kDim);

  // Gated RMSNorm over the head's outputs, sigmoid output gate.
  const float sumSquares = blockSum<kThreads>(group == 0 ? o * o : 0.0f, scratch);
  if (group == 0) {
    const float rstd = rsqrtf(sumSquares / kDim + p.weights.normEpsilon);
    p.out[size_t(sequence) * channels + channel] = o * rstd * normWeight * sigmoid(gateLogit);
  }
}

// Split path. Per (sequence, head) the prolog writes [query K][key K][decay K][value V][beta, pad 3].
template <int kDim> constexpr int kPreparedFloats = 4 * kDim + 4;

template <int kDim> size_t splitWorkspaceBytes(int64_t pairs) {
  // prepared rows, then the raw (pre-norm) outputs, then one arrival counter per pair
  return size_t(pairs) * ((kPreparedFloats<kDim> + kDim) * sizeof(float) + sizeof(unsigned));
}

template <int kDim>
__global__ void __launch_bounds__(kDim)
    kdaDecodePrologKernel(KdaDecodeParams p, float *prepared, unsigned *arrivals) {
  // The state kernel may launch now: it only loads state until it waits on this grid. This
  // one is itself a programmatic dependent of the projections' GEMV.
  asm volatile("griddepcontrol.launch_dependents;");
  waitForEarlierKernels();
  const int head = blockIdx.x, sequence = blockIdx.y, i = threadIdx.x;
  const int channel = head * kDim + i;
  __shared__ float2 pairScratch[kDim / 32];
  const size_t pair = size_t(sequence) * p.heads + head;
  const float channelDecay = decayOf(p, sequence, head, channel); // before the conv's stores
  const float betaLogit = p.betaLogits[pair];
  float qkv[3];
  convolveAndShift(p, sequence, channel, qkv);
  const float2 squares =
      blockSum<kDim>(make_float2(qkv[0] * qkv[0], qkv[1] * qkv[1]), pairScratch);
  const float qNorm = rsqrtf(squares.x + 1e-6f), kNorm = rsqrtf(squares.y + 1e-6f);
  float *row = prepared + pair * kPreparedFloats<kDim>;
  row[i] = qkv[0] * qNorm * rsqrtf(float(kDim));
  row[kDim + i] = qkv[1] * kNorm;
  row[2 * kDim + i] = channelDecay;
  row[3 * kDim + i] = qkv[2];
  if (i == 0) {
    row[4 * kDim] = sigmoid(betaLogit);
    arrivals[pair] = 0;
  }
}

template <int kDim, int kColumns, int kWarps, typename State>
__global__ void __launch_bounds__(32 * kWarps)
    kdaDecodeStateKernel(KdaDecodeParams p, const float *prepared, unsigned *arrivals,
                         float *rawOut) {
  constexpr int kThreads = 32 * kWarps, kGroups = kThreads / kColumns, kRows = kDim / kGroups;
  constexpr int kTiles = kDim / kColumns;
  const int head = blockIdx.y, sequence = blockIdx.z;
  const int column = threadIdx.x % kColumns, group = threadIdx.x / kColumns;
  const int v = blockIdx.x * kColumns + column, firstRow = group * kRows;
  const size_t pair = size_t(sequence) * p.heads + head;
  State *stateColumn = stateOf<State>(p, sequence, head) + size_t(firstRow) * kDim + v;
  float s[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    s[r] = loadState(stateColumn + size_t(r) * kDim);
  asm volatile("griddepcontrol.wait;" ::: "memory"); // the prolog's writes are visible after this

  __shared__ float gates[3 * kDim], partial[kGroups][kColumns], update[kColumns], scratch[kWarps];
  __shared__ bool lastOfHead;
  const float *row = prepared + pair * kPreparedFloats<kDim>;
  for (int i = threadIdx.x; i < 3 * kDim; i += kThreads)
    gates[i] = row[i];
  const float beta = row[4 * kDim];
  __syncthreads();
  const float *query = gates, *key = gates + kDim, *decay = gates + 2 * kDim;

  const float o = deltaRuleColumn<kRows, kGroups, kColumns, true>(
      s, query, key, decay, beta, group == 0 ? row[3 * kDim + v] : 0.0f, firstRow, group, column,
      partial, update, stateColumn, kDim);
  float *headOut = rawOut + pair * kDim;
  if (group == 0) {
    headOut[v] = o;
    __threadfence(); // publish before arriving, so the last block sees every column
  }
  __syncthreads();
  if (threadIdx.x == 0)
    lastOfHead = atomicAdd(&arrivals[pair], 1u) == kTiles - 1;
  __syncthreads();
  if (!lastOfHead)
    return;

  // Last block of the head: gated RMSNorm over all V outputs (read past L1, written by peers).
  __threadfence();
  float squares = 0.0f;
  for (int i = threadIdx.x; i < kDim; i += kThreads) {
    const float x = __ldcg(headOut + i);
    squares += x * x;
  }
  const float rstd = rsqrtf(blockSum<kThreads>(squares, scratch) / kDim + p.weights.normEpsilon);
  const size_t base = size_t(sequence) * p.heads * kDim + size_t(head) * kDim;
  for (int i = threadIdx.x; i < kDim; i += kThreads)
    p.out[base + i] = __ldcg(headOut + i) * rstd * p.weights.normWeight[i] * sigmoid(p.outputGate[base + i]);
}

template <int kDim> int launchFused(const KdaDecodeParams &params, cudaStream_t stream) {
  constexpr int kSplit = 4;
  const dim3 grid(params.heads, params.batch);
  return withStateType(params.stateType, [&](auto tag) {
    using State = typename decltype(tag)::type;
    DependentLaunch launch(grid, dim3(kDim * kSplit), stream);
    const cudaError_t status =
        cudaLaunchKernelEx(&launch.config, kdaFusedDecodeKernel<kDim, kSplit, State>, params);
    return static_cast<int>(status != cudaSuccess ? status : cudaGetLastError());
  });
}

template <int kDim> int launchSplit(const KdaDecodeParams &params, cudaStream_t stream) {
  constexpr int kColumns = 32, kWarps = 4;
  const int64_t pairs = int64_t(params.batch) * params.heads;
  auto *prepared = static_cast<float *>(params.workspace);
  float *rawOut = prepared + pairs * kPreparedFloats<kDim>;
  auto *arrivals = reinterpret_cast<unsigned *>(rawOut + pairs * kDim);
  DependentLaunch prolog(dim3(params.heads, params.batch), dim3(kDim), stream);
  if (const cudaError_t status = cudaLaunchKernelEx(&prolog.config, kdaDecodePrologKernel<kDim>,
                                                    params, prepared, arrivals))
    return static_cast<int>(status);
  DependentLaunch launch(dim3(kDim / kColumns, params.heads, params.batch), dim3(32 * kWarps),
                         stream);
  return withStateType(params.stateType, [&](auto tag) {
    using State = typename decltype(tag)::type;
    const cudaError_t status =
        cudaLaunchKernelEx(&launch.config, kdaDecodeStateKernel<kDim, kColumns, kWarps, State>, params,
                           static_cast<const float *>(prepared), arrivals, rawOut);
    return static_cast<int>(status != cudaSuccess ? status : cudaGetLastError());
  });
}

bool useSplit(const KdaDecodeParams &params) {
  return kdaDecodeUsesSplit(params.path, params.batch, params.heads, params.headDim);
}

// Unset, or within KdaLowRankGate's limits (the GEMV's narrow form's, at most 16 chunks).
bool validLowRank(const KdaLowRankGate &gate) {
  return !gate.weight ||
         (gate.in && gate.rank >= 8 && gate.rank <= kKdaDecodeMaxLowRank && gate.rank % 8 == 0 &&
          gate.inStride >= gate.rank && gate.inStride % 4 == 0 &&
          gemv_arithmetic::aligned16(gate.in) && gate.weightStride >= gate.rank &&
          gate.weightStride % 8 == 0 && gemv_arithmetic::aligned16(gate.weight));
}

} // namespace

size_t kdaDecodeWorkspaceBytes(const KdaDecodeParams &params) {
  if (params.batch <= 0 || params.heads <= 0 || !useSplit(params))
    return 0;
  const int64_t pairs = int64_t(params.batch) * params.heads;
  switch (params.headDim) {
  case 64:
    return splitWorkspaceBytes<64>(pairs);
  case 128:
    return splitWorkspaceBytes<128>(pairs);
  default:
    return 0;
  }
}

int launchKdaFusedDecode(const KdaDecodeParams &params, void *stream) {
  if (params.batch <= 0 || params.heads <= 0 || params.convKernel < 1 ||
      params.convKernel > kKdaMaxConvKernel || static_cast<int32_t>(params.path) < 0 ||
      static_cast<int32_t>(params.path) > static_cast<int32_t>(KdaDecodePath::Split))
    return cudaErrorInvalidValue;
  if (params.headDim != 64 && params.headDim != 128)
    return cudaErrorInvalidValue;
  const bool lowRank = params.forgetLowRank.weight || params.gateLowRank.weight;
  if (!validLowRank(params.forgetLowRank) || !validLowRank(params.gateLowRank) ||
      (lowRank && useSplit(params)))
    return cudaErrorInvalidValue;
  auto cudaStream = static_cast<cudaStream_t>(stream);
  if (useSplit(params)) {
    if (params.workspace == nullptr)
      return cudaErrorInvalidValue;
    return params.headDim == 64 ? launchSplit<64>(params, cudaStream)
                                : launchSplit<128>(params, cudaStream);
  }
  return params.headDim == 64 ? launchFused<64>(params, cudaStream)
                              : launchFused<128>(params, cudaStream);
}

} // namespace hybrid::kernels::cuda
