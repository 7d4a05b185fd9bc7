// Context parallelism's KDA pieces (KdaContext.h): segment summaries through the prefill kernels,
// and the composition of summaries onto a state.
#include "hybrid/kernels/cuda/KdaContext.h"

#include <cuda_bf16.h>
#include <algorithm>
#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {
namespace {

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The workspace's parts (KdaSegmentSummaryParams::workspace), in this order.
struct SummaryWorkspace {
  size_t qkvZeroV = 0, convB = 0, convM = 0, statesM = 0, statesB = 0, out = 0, prefill = 0;
  size_t total() const { return qkvZeroV + convB + convM + statesM + statesB + out + prefill; }
};

KdaPrefillParams prefillOf(const KdaSegmentSummaryParams &p) {
  KdaPrefillParams prefill;
  static_cast<KdaLayerCall &>(prefill) = p;
  prefill.sequences = p.sequences;
  prefill.cuSeqlens = p.cuSeqlens;
  prefill.tokens = p.tokens;
  prefill.path = p.path;
  prefill.stateType = KdaStateType::F32;
  return prefill;
}

SummaryWorkspace summaryWorkspace(const KdaSegmentSummaryParams &p) {
  const size_t P = size_t(p.heads) * size_t(p.headDim), T = size_t(p.tokens);
  const size_t S = size_t(p.sequences), n = size_t(p.convKernel - 1);
  const size_t state = S * size_t(p.heads) * size_t(p.headDim) * size_t(p.headDim);
  SummaryWorkspace w;
  w.qkvZeroV = aligned(T * 3 * P * sizeof(float));
  w.convB = w.convM = aligned(S * 3 * n * P * sizeof(float));
  w.statesM = w.statesB = aligned(state * sizeof(float));
  w.out = aligned(T * P * sizeof(float));
  w.prefill = aligned(kdaPrefillWorkspaceBytes(prefillOf(p)));
  return w;
}

// The two runs' inputs: q and k as given with v = 0 (tokens and conv history), M = I, B = 0.
__global__ void prepareSummaryRuns(const float *qkv, float *qkvZeroV, int64_t qkvFloats,
                                   const float *conv, float *convB, float *convM,
                                   int64_t convFloats, int64_t history, float *statesM,
                                   float *statesB, int64_t stateFloats, int32_t dim, int64_t P) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;; i += stride) {
    bool any = false;
    if (i < qkvFloats) { // [T, 3, P]: the v projection is the third P
      qkvZeroV[i] = (i / P) % 3 == 2 ? 0.0f : qkv[i];
      any = true;
    }
    if (i < convFloats) { // [S, 3, W - 1, P]
      convB[i] = conv[i];
      convM[i] = (i / (history * P)) % 3 == 2 ? 0.0f : conv[i];
      any = true;
    }
    if (i < stateFloats) { // [S, H, K, K]
      const int64_t within = i % (int64_t(dim) * dim);
      statesM[i] = within / dim == within % dim ? 1.0f : 0.0f;
      statesB[i] = 0.0f;
      any = true;
    }
    if (!any)
      return;
  }
}

__device__ float loadAny(const void *base, size_t index, KdaStateType type) {
  return type == KdaStateType::BF16
             ? __bfloat162float(static_cast<const __nv_bfloat16 *>(base)[index])
             : static_cast<const float *>(base)[index];
}
__device__ void storeAny(void *base, size_t index, float value, KdaStateType type) {
  if (type == KdaStateType::BF16)
    static_cast<__nv_bfloat16 *>(base)[index] = __float2bfloat16_rn(value);
  else
    static_cast<float *>(base)[index] = value;
}

// One block per (head, value column v), one thread per key row i: the column S[:, v] evolves
// alone, S'[i, v] = sum_j M[i, j] S[j, v] + B[i, v], with the column in shared memory.
__global__ void composeSummaries(KdaComposeParams p) {
  __shared__ float column[128];
  const int head = blockIdx.x, v = blockIdx.y, i = threadIdx.x, K = p.headDim;
  const size_t headBase = size_t(head) * K * K;
  float value = loadAny(p.stateBefore, headBase + size_t(i) * K + v, p.beforeType);
  for (int s = 0; s < p.count; ++s) {
    column[i] = value;
    __syncthreads();
    const float *M = p.summaries + s * p.summaryStride + headBase;
    const float *B = M + size_t(p.heads) * K * K;
    float next = B[size_t(i) * K + v];
    for (int j = 0; j < K; ++j)
      next = fmaf(M[size_t(i) * K + j], column[j], next);
    __syncthreads();
    value = next;
  }
  storeAny(p.stateAfter, headBase + size_t(i) * K + v, value, p.afterType);
}

bool validShapes(int32_t heads, int32_t headDim, int32_t convKernel) {
  return heads > 0 && (headDim == 64 || headDim == 128) && convKernel >= 1 &&
         convKernel <= kKdaMaxConvKernel;
}

} // namespace

size_t kdaSegmentSummaryWorkspaceBytes(const KdaSegmentSummaryParams &params) {
  return summaryWorkspace(params).total();
}

int launchKdaSegmentSummary(const KdaSegmentSummaryParams &p, void *stream) {
  const int64_t K = p.headDim, transition = int64_t(p.heads) * K * K;
  if (!validShapes(p.heads, p.headDim, p.convKernel) || p.sequences < 1 || p.tokens < 0 ||
      !p.cuSeqlens || !p.summaries || !p.workspace || p.summaryStride < 2 * transition ||
      (p.convKernel > 1 && !p.convState))
    return int(cudaErrorInvalidValue);
  const auto s = static_cast<cudaStream_t>(stream);
  const SummaryWorkspace w = summaryWorkspace(p);
  auto *base = static_cast<unsigned char *>(p.workspace);
  auto *qkvZeroV = reinterpret_cast<float *>(base);
  auto *convB = reinterpret_cast<float *>(base + w.qkvZeroV);
  auto *convM = reinterpret_cast<float *>(base + w.qkvZeroV + w.convB);
  auto *statesM = reinterpret_cast<float *>(base + w.qkvZeroV + w.convB + w.convM);
  auto *statesB = reinterpret_cast<float *>(base + w.qkvZeroV + w.convB + w.convM + w.statesM);
  auto *out = reinterpret_cast<float *>(base + w.qkvZeroV + w.convB + w.convM + w.statesM +
                                        w.statesB);
  void *prefillWorkspace = base + w.qkvZeroV + w.convB + w.convM + w.statesM + w.statesB + w.out;

  const int64_t P = int64_t(p.heads) * K, history = p.convKernel - 1;
  const int64_t qkvFloats = int64_t(p.tokens) * 3 * P;
  const int64_t convFloats = int64_t(p.sequences) * 3 * history * P;
  const int64_t stateFloats = int64_t(p.sequences) * transition;
  const int64_t most = std::max({qkvFloats, convFloats, stateFloats});
  const int blocks = int(std::min<int64_t>((most + 255) / 256, 4096));
  prepareSummaryRuns<<<blocks, 256, 0, s>>>(p.qkv, qkvZeroV, qkvFloats, p.convState, convB, convM,
                                            convFloats, history, statesM, statesB, stateFloats,
                                            p.headDim, P);
  if (cudaError_t status = cudaGetLastError(); status != cudaSuccess)
    return int(status);
  if (p.tokens > 0) { // else every segment is empty: (I, 0)
    KdaPrefillParams offset = prefillOf(p);
    offset.convState = convB;
    offset.state = statesB;
    offset.out = out;
    offset.workspace = prefillWorkspace;
    if (int status = launchKdaPrefill(offset, stream); status != 0)
      return status;
    KdaPrefillParams transitionRun = offset;
    transitionRun.qkv = qkvZeroV;
    transitionRun.convState = convM;
    transitionRun.state = statesM;
    if (int status = launchKdaPrefill(transitionRun, stream); status != 0)
      return status;
  }
  const size_t pitch = size_t(p.summaryStride) * sizeof(float);
  const size_t width = size_t(transition) * sizeof(float);
  if (cudaError_t status = cudaMemcpy2DAsync(p.summaries, pitch, statesM, width, width,
                                             size_t(p.sequences), cudaMemcpyDeviceToDevice, s);
      status != cudaSuccess)
    return int(status);
  return int(cudaMemcpy2DAsync(p.summaries + transition, pitch, statesB, width, width,
                               size_t(p.sequences), cudaMemcpyDeviceToDevice, s));
}

int launchKdaComposeSummaries(const KdaComposeParams &p, void *stream) {
  if (!validShapes(p.heads, p.headDim, 1) || p.count < 0 || !p.stateBefore || !p.stateAfter ||
      (p.count > 0 &&
       (!p.summaries || p.summaryStride < 2 * int64_t(p.heads) * p.headDim * p.headDim)))
    return int(cudaErrorInvalidValue);
  composeSummaries<<<dim3(unsigned(p.heads), unsigned(p.headDim)), unsigned(p.headDim), 0,
                     static_cast<cudaStream_t>(stream)>>>(p);
  return int(cudaGetLastError());
}

} // namespace hybrid::kernels::cuda
