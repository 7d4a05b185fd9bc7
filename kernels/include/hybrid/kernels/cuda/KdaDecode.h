// The fused KDA decode step on CUDA (sm_90a): one token per sequence through the short
// convolution (with its state), SiLU, L2 norm of q and k, the forget gate and beta, the delta-rule
// update of the fp32 state (read once, written once), the output and the gated RMSNorm.
// CUDA-free header: the runtime and the tests include it without nvcc.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hybrid::kernels::cuda {

// A KDA layer's own parameters (not per call), fp32 on the device; shared by decode and prefill.
struct KdaLayerWeights {
  const float *convWeight = nullptr; // [3, heads * headDim, W] (the checkpoint's [P, 1, W] per projection)
  const float *aLog = nullptr;       // [heads]
  const float *dtBias = nullptr;     // [heads * headDim]
  const float *normWeight = nullptr; // [headDim], shared by the heads
  float normEpsilon = 1e-5f;
  bool lowerBoundGate = false;       // Kimi K3: g = lowerBound * sigmoid(exp(A_log) * (f + dt_bias))
  float lowerBound = -5.0f;
};

// How the recurrent state is stored. The kernels always compute in fp32; BF16 rounds the state
// once per call when it is written back (half the memory and state traffic, at the price of
// that rounding accumulating over calls: one rounding per decode step).
enum class KdaStateType : int32_t { F32, BF16 };

// Which kernels run the step (see kKdaDecodeSplitPairs); tests and benchmarks force one, and a
// tuned configuration may (the kda-decode family, docs/autotune.md).
enum class KdaDecodePath : int32_t { Auto, Fused, Split };

// What a KDA layer's decode step and prefill share: its shapes, weights and device tensors. Rows
// are tokens (a decode step's batch, one per sequence, or prefill's packed tokens); fp32, channel
// c = head * headDim + i. The states are per sequence, read as the state before the call and
// overwritten with the state after it.
struct KdaLayerCall {
  int32_t heads = 0;
  int32_t headDim = 0;      // K = V
  int32_t convKernel = 4;   // W; the conv state keeps W - 1 inputs per channel
  KdaLayerWeights weights;
  const float *qkv = nullptr;        // [rows, 3, heads * headDim]: q, k, v projections before the conv
  const float *forget = nullptr;     // [rows, heads * headDim]: f_b_proj(f_a_proj(x))
  const float *betaLogits = nullptr; // [rows, heads]: b_proj(x)
  const float *outputGate = nullptr; // [rows, heads * headDim]: pre-sigmoid output gate
  float *convState = nullptr;        // [sequences, 3, W - 1, heads * headDim], oldest input first
  void *state = nullptr;             // [sequences, heads, K, V] (K-major), as stateType says
  KdaStateType stateType = KdaStateType::F32;
  float *out = nullptr;              // [rows, heads * headDim]: gated-normed attention output
};

// A low-rank gate's second half (Kimi's f_b_proj, g_b_proj) for the fused path to compute from
// the first half's output instead of reading the gate: channel c is weight row c (bf16) dotted
// with the row's `in`, summed as the decode GEMV's narrow form sums it (kernels/cuda/linear/
// gemv.cuh; bf16(in) with roundInputToBf16), so the gate has that launch's bits without it.
struct KdaLowRankGate {
  const float *in = nullptr; // [batch, rank], row stride inStride; 16-byte aligned rows
  int64_t inStride = 0;
  const void *weight = nullptr; // bf16 [heads * headDim, rank], row stride weightStride; aligned
  int64_t weightStride = 0;
  int32_t rank = 0; // a multiple of 8, at most kKdaDecodeMaxLowRank
};
inline constexpr int32_t kKdaDecodeMaxLowRank = 128;

// One decode step: batch sequences, one token (row) each; headDim 128 (Kimi-Linear) or 64.
struct KdaDecodeParams : KdaLayerCall {
  int32_t batch = 0;
  // Row b updates the states of sequence stateIndices[b] (a device array of batch entries; null:
  // sequence b): its state at stateIndices[b] * stateStride elements of `state` (0: heads * K * V,
  // dense) and its conv state at stateIndices[b] * convStateStride floats of `convState` (0:
  // 3 (W - 1) heads * K). A batch of sequences whose states sit in a pool's slots, not packed.
  const int32_t *stateIndices = nullptr;
  int64_t stateStride = 0;
  int64_t convStateStride = 0;
  // Device scratch of kdaDecodeWorkspaceBytes(*this) bytes, 16-byte aligned; may be null when
  // that is 0. Not shared between launches that may run concurrently.
  void *workspace = nullptr;
  KdaDecodePath path = KdaDecodePath::Auto;
  // Optional, the fused path only: with a weight set, `forget` (`outputGate`) is computed in the
  // kernel from this low-rank input instead of read (one GEMV launch less a layer).
  KdaLowRankGate forgetLowRank, gateLowRank;
  bool lowRankRoundInputToBf16 = false; // the GEMV's roundInputToBf16 for both
};

// With KdaDecodePath::Auto, a step runs as one fused kernel unless headDim is 128 and there are at
// least kKdaDecodeSplitPairs (sequence, head) pairs: then a prolog kernel (conv, norms, gates)
// feeds a state kernel of 4x more, smaller blocks launched with programmatic dependent launch,
// whose last block per head applies the gated RMSNorm (3-5% faster there on the H200; slower
// below, and at headDim 64 everywhere: docs/performance.md). The split path needs
// kdaDecodeWorkspaceBytes() of workspace; the fused path none (0).
constexpr int64_t kKdaDecodeSplitPairs = 4096;
// Whether a step of these params runs the split path (Auto: the rule above).
inline bool kdaDecodeUsesSplit(KdaDecodePath path, int64_t batch, int64_t heads, int64_t headDim) {
  if (path != KdaDecodePath::Auto)
    return path == KdaDecodePath::Split;
  return headDim == 128 && batch * heads >= kKdaDecodeSplitPairs;
}
// The longest short convolution the kernels take (Kimi-Linear uses 4).
constexpr int32_t kKdaMaxConvKernel = 4;
size_t kdaDecodeWorkspaceBytes(const KdaDecodeParams &params);

// Launches on `stream` (a cudaStream_t, null for the default stream). Returns 0 or the CUDA error
// code (cudaError_t); an unsupported headDim or convKernel, a path outside the enum, a missing
// workspace, or a low-rank gate on the split path or outside KdaLowRankGate's limits, returns
// cudaErrorInvalidValue (1).
int launchKdaFusedDecode(const KdaDecodeParams &params, void *stream);

} // namespace hybrid::kernels::cuda
