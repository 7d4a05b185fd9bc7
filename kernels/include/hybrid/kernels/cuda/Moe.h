// MoE on CUDA (MODEL_SPEC 5, issue 7): the noaux_tc router as one kernel after the router GEMM,
// and the routed experts' SwiGLU MLPs, either per (token, expert) on CUDA cores (decode: no host
// round trip, so it can be captured in a graph) or grouped by expert around the runtime's
// GEMMs (prefill: gather, GEMMs, scatter-add). fp32 activations, expert weights in bf16, fp32
// or FP8 with block scales;
// the reference's arithmetic up to summation order, every token's experts added in ascending
// expert order as ref::moeExperts does. CUDA-free header. Launches return 0 or a cudaError_t
// (cudaErrorInvalidValue for a bad shape or a missing pointer).
#pragma once

#include "hybrid/kernels/cuda/Activation.h"

#include "hybrid/kernels/cuda/Elementwise.h" // WeightType
#include "hybrid/kernels/cuda/Linear.h"      // Fp8ActivationScale

#include <cstddef>
#include <cstdint>

namespace hybrid::kernels::cuda {

inline constexpr int kMoeMaxExperts = 1024;
inline constexpr int kMoeMaxTopK = 32;

// ref::routeTokens: scores (sigmoid or softmax of the logits), the correction bias for the choice
// only, grouped top-k (groups ranked by their top-2 biased scores, or top-1 without a bias), the
// top-k experts of the kept groups (ties: lower id), their unbiased scores renormalized and
// scaled. ids / weights [tokens, topK] in descending order of the biased score.
struct MoeRouterParams {
  int32_t tokens = 0;
  int32_t experts = 0; // <= kMoeMaxExperts, a multiple of groups
  int32_t topK = 0;    // <= kMoeMaxTopK
  int32_t groups = 1;
  int32_t topKGroups = 1;
  bool softmax = false;                  // else sigmoid
  const float *logits = nullptr;         // [tokens, experts]
  const float *correctionBias = nullptr; // [experts] or null
  bool renormalize = true;
  float routedScalingFactor = 1.0f;
  int32_t *ids = nullptr;
  float *weights = nullptr;
};
int launchMoeRouter(const MoeRouterParams &params, void *stream);

// The routed experts of `tokens` rows: out[t] = sum over the row's topK experts e (ascending) of
// weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t). Per expert e, gate[e] / up[e] point to
// [intermediate, hidden] matrices and down[e] to [hidden, intermediate] (device arrays of
// device pointers, all of one type). An expert whose gate[e] is null is absent (an expert-
// parallel rank holds only its share; the plan's all-reduce adds the other ranks' parts): its
// pairs add nothing here and none of its pointers is read, as ref::moeExperts skips it.
struct MoeExpertsParams {
  int32_t tokens = 0;
  int32_t hidden = 0;       // <= kMoeMaxHidden
  int32_t intermediate = 0; // <= kMoeMaxHidden
  int32_t experts = 0;
  int32_t topK = 0;
  const float *x = nullptr;          // [tokens, hidden]
  const int32_t *ids = nullptr;      // [tokens, topK]
  const float *weights = nullptr;    // [tokens, topK]
  const void *const *gate = nullptr; // [experts]
  const void *const *up = nullptr;
  const void *const *down = nullptr;
  WeightType type = WeightType::BF16;
  // Fp8Block experts (DeepSeek-V3.2's): per expert its block scales, rows of `gateScaleStride`
  // (gate and up) or `downScaleStride` (down) floats per 128 weight rows, one per 128 columns (the
  // FP8 GEMM's layout, linearFp8WeightScaleStride); the inputs of each projection are rounded to
  // E4M3 per 128 values first (`activationScale`'s rule), as ref::linearFp8Activations does.
  const float *const *gateScales = nullptr;
  const float *const *upScales = nullptr;
  const float *const *downScales = nullptr;
  int32_t gateScaleStride = 0, downScaleStride = 0;
  Fp8ActivationScale activationScale = Fp8ActivationScale::DeepSeekLinear;
  GatedActivation activation; // SiLU (SwiGLU) or Kimi K3's SiTU
  float *out = nullptr;       // [tokens, hidden]
  void *workspace = nullptr;  // moeExpertsWorkspaceBytes
  // launchMoeExperts' choice of form: the (token, expert) pairs at or below which the per-token
  // form runs where the grouped tensor-core form could (0: kMoePerTokenMaxPairs; at most
  // kMoeTunedMaxPairs; docs/autotune.md). The forms' own launches ignore it.
  int32_t perTokenMaxPairs = 0;
};
inline constexpr int kMoeMaxHidden = 16384;

// Makes p's experts Fp8Block ones: the type, the three scale-pointer arrays ([experts] each) and
// their strides in the FP8 GEMM's layout for p.hidden and p.intermediate (set those first).
void setFp8Experts(MoeExpertsParams &p, const float *const *gateScales,
                   const float *const *upScales, const float *const *downScales);
// The default threshold: a decode step of up to 8 tokens' top-8 streams each pair's expert rows.
inline constexpr int32_t kMoePerTokenMaxPairs = 64;
// The largest threshold perTokenMaxPairs may set (what a runtime sizes the per-token workspace for).
inline constexpr int32_t kMoeTunedMaxPairs = 512;
// The grouped form's k step: hidden and intermediate must be multiples of it.
inline constexpr int32_t kMoeGroupedTileK = 64;

inline int32_t moePerTokenMaxPairs(const MoeExpertsParams &params) {
  return params.perTokenMaxPairs > 0 ? params.perTokenMaxPairs : kMoePerTokenMaxPairs;
}
// Whether the grouped tensor-core form takes experts of this type and shape (moeGroupedSupports
// without the per-launch checks).
inline bool moeGroupedShape(WeightType type, int64_t hidden, int64_t intermediate) {
  return type == WeightType::BF16 && hidden > 0 && hidden % kMoeGroupedTileK == 0 &&
         intermediate > 0 && intermediate % kMoeGroupedTileK == 0;
}

// Decode form: every (token, expert) pair on CUDA cores, one launch chain, no host round trip.
// bf16 steps of up to 16 pairs, hidden (<= 2304) and intermediate (<= 1024) multiples of 256,
// stream the experts' rows through shared memory in two launches; the others read them in
// three. Both give the same bits.
size_t moeExpertsWorkspaceBytes(int32_t tokens, int32_t topK, int32_t hidden, int32_t intermediate);
int launchMoeExpertsPerToken(const MoeExpertsParams &params, void *stream);

// Grouped form on tensor cores (bf16 experts, hidden and intermediate multiples of 64, every
// matrix 16-byte aligned): the pairs are sorted by expert on the GPU, then each expert's weights
// are read once per 64 of its tokens by two mma.sync launches (gate + up with SiLU, down), and the
// outputs are combined per token in ascending expert order. No host round trip: graph-safe.
// x enters the tensor cores as bf16, or as bf16 hi + lo (about 16 bits) with `splitInputs`.
bool moeGroupedSupports(const MoeExpertsParams &params);
size_t moeGroupedWorkspaceBytes(int32_t tokens, int32_t topK, int32_t hidden,
                                int32_t intermediate, int32_t experts);
int launchMoeExpertsGrouped(const MoeExpertsParams &params, bool splitInputs, void *stream);

// Either form, as a graph-safe step chooses: grouped on tensor cores when it supports the params
// and the step has more than moePerTokenMaxPairs(params) pairs, else per token. The workspace
// must hold the chosen form's (moeExpertsLaunchWorkspaceBytes). A perTokenMaxPairs outside
// 0..kMoeTunedMaxPairs is cudaErrorInvalidValue.
bool moeLaunchesGrouped(const MoeExpertsParams &params);
size_t moeExpertsLaunchWorkspaceBytes(const MoeExpertsParams &params);
int launchMoeExperts(const MoeExpertsParams &params, bool splitInputs, void *stream);

// Grouped form's pieces (experts run one by one around the GEMMs): rows[r] of x into out[r] (count rows of `width`), and out[rows[r]] +=
// scales[r] * in[r] (each target row at most once per call, so calls made expert by expert add
// in expert order).
int launchGatherRows(const float *x, int64_t width, const int32_t *rows, int32_t count, float *out,
                     void *stream);
int launchScatterAddRows(const float *in, int64_t width, const int32_t *rows, const float *scales,
                         int32_t count, float *out, void *stream);

} // namespace hybrid::kernels::cuda
