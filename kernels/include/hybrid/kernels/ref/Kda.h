// KDA — Kimi Delta Attention (MODEL_SPEC §2): the prolog pieces (short conv, gate, beta) and the
// gated delta-rule core in two forms, token recurrence (decode) and chunked WY/UT (prefill). Both
// take the recurrent state in and hand it back updated, so prefill and decode compose.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

namespace hybrid::kernels::ref {

// Depthwise causal conv + SiLU over one projection (q, k or v) of `channels` values per token:
//   out[t, c] = silu( Σ_{j<W} weight[c, j] · in[t − (W−1) + j, c] )
// weight [channels, W] (the checkpoint's [channels, 1, W]); weight[c, W−1] multiplies the current
// token. convState [W−1, channels] holds the pre-conv inputs of the W−1 tokens before in[0] (oldest
// first; zeros at sequence start) and is replaced by the last W−1 inputs of (convState ++ in), so
// one token at a time gives the same result as the whole sequence.
void shortConvSilu(std::span<const float> in, std::span<const float> weight,
                   std::span<float> convState, std::span<float> out, int64_t numTokens,
                   int64_t channels, int64_t kernelSize);

// Forget gate (log-decay, ≤ 0) per token, head h and key channel c, from f = f_b_proj(f_a_proj(x))
// [T, H·K], A_log [H] and dt_bias [H·K]:
//   softplus form:    g = −exp(A_log[h]) · softplus(f + dt_bias)
//   lower-bound form: g = lowerBound · σ(exp(A_log[h]) · (f + dt_bias))   (Kimi K3, lowerBound −5)
// g has the shape of f.
void kdaGate(std::span<const float> f, std::span<const float> aLog, std::span<const float> dtBias,
             std::span<float> g, int64_t numTokens, int64_t numHeads, int64_t keyDim,
             std::optional<float> lowerBound = std::nullopt);

// β = σ(b_proj(x)), elementwise, in place.
void kdaBeta(std::span<float> betaLogits);

// The core. q, k [T, H, K] must already be l2-normalised (l2NormalizeRows); `scale` (K^−1/2 by
// default) multiplies q inside. v [T, H, V]; g [T, H, K] log-decays; beta [T, H].
// state [H, K, V] fp32 (K-major: state[h][key][value]) is read as the state before token 0 and
// overwritten with the state after the last token. out [T, H, V].
struct KdaParams {
  int64_t numTokens = 0;
  int64_t numHeads = 0;
  int64_t keyDim = 0;
  int64_t valueDim = 0;
  float scale = 0.0f; // 0 means keyDim^−1/2
  const float *q = nullptr;
  const float *k = nullptr;
  const float *v = nullptr;
  const float *g = nullptr;
  const float *beta = nullptr;
  float *state = nullptr;
  float *out = nullptr;
};

// Token-by-token recurrence (§2.2 step 6); decode is numTokens = 1.
void kdaRecurrent(const KdaParams &params);

// Chunked WY/UT form (§2.3), equal to kdaRecurrent up to fp32 rounding. The last chunk may be
// partial (numTokens need not be a multiple of chunkSize).
void kdaChunked(const KdaParams &params, int64_t chunkSize = 64);

// Sequence-parallel form (state-passing scan, for context parallelism and for splitting one long
// sequence over many SMs), equal to kdaRecurrent up to fp32 rounding. A token's update is affine
// in the state, S' = A_t S + b_t with A_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) and b_t = β_t k_t v_tᵀ,
// so each of `segments` contiguous token ranges is summarized independently (in parallel) by
//   B_s = its final state from a zero state,  M_s = A_last … A_first (the recurrence with v = 0
//   from S = I, a K×K "state"),
// the segments' initial states follow by a short sequential combine S_{s+1} = M_s S_s + B_s, and
// each segment then reruns from its true initial state for its outputs. The work is about 3x the
// recurrence (M costs K×K per token), at depth T / segments.
void kdaSegmentScan(const KdaParams &params, int64_t segments);

// The scan's pieces, for segments on different ranks (context parallelism). A segment's summary:
// `transition` M [H, K, K] and `offset` B [H, K, V] (its state and out are not read or written).
void kdaSegmentSummary(const KdaParams &segment, float *transition, float *offset);
// next = M state + B per head (the state after the segment, from `state` before it).
void kdaApplySummary(int64_t numHeads, int64_t keyDim, int64_t valueDim, const float *transition,
                     const float *offset, const float *state, float *next);

} // namespace hybrid::kernels::ref
