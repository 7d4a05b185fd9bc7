// MoE (MODEL_SPEC §5): the noaux_tc router, SwiGLU experts and the routed + shared combination.
#pragma once

#include "hybrid/kernels/ref/Quant.h"

#include <cstdint>
#include <optional>
#include <span>

namespace hybrid::kernels::ref {

enum class RouterScoring { Sigmoid, Softmax };

struct RouterParams {
  int64_t numExperts = 0;
  int64_t topK = 0;
  int64_t numGroups = 1;  // n_group / num_expert_group
  int64_t topKGroups = 1; // topk_group
  RouterScoring scoring = RouterScoring::Sigmoid;
  // e_score_correction_bias [numExperts]; empty = none. Used only to choose experts.
  std::span<const float> correctionBias;
  bool renormalize = true; // norm_topk_prob / moe_renormalize
  float routedScalingFactor = 1.0f;
  // Kimi HF remote code adds the bias in place through a view, so its weights come from the biased
  // scores (MODEL_SPEC §5.2 CONFLICT). Off = DeepSeek reference, vLLM, HF transformers.
  bool weightsFromBiasedScores = false;
};

// Per token: s = σ(logits) (or softmax); s_b = s + bias; group score = sum of the top-2 s_b of each
// group (max when there is no bias or a group has one expert); keep the topKGroups best groups;
// pick the topK largest s_b among them (ties: lower expert id); weights = s of the chosen experts,
// divided by their sum (+1e-20) when renormalize, times routedScalingFactor.
// routerLogits [numTokens, numExperts] = x · W_gateᵀ; expertIds, expertWeights [numTokens, topK],
// in descending order of s_b.
void routeTokens(std::span<const float> routerLogits, int64_t numTokens, const RouterParams &params,
                 std::span<int32_t> expertIds, std::span<float> expertWeights);

// The activation of a gated MLP, applied to (g, u) = (gate x, up x) in fp32:
//   Silu: silu(g) · u (SwiGLU);
//   Situ: Kimi K3's SiTU (MODEL_SPEC 7.4), β·tanh(g/β)·σ(g) · u' with u' = β_lin·tanh(u/β_lin), or
//         u' = u when linearBeta is 0 (no cap on the linear half).
struct GatedActivation {
  enum class Kind { Silu, Situ };
  Kind kind = Kind::Silu;
  float beta = 0.0f;       // Situ: activation_situ_beta (4 in K3)
  float linearBeta = 0.0f; // Situ: activation_situ_linear_beta (25 in K3); 0: none
};
float gatedActivation(const GatedActivation &activation, float gate, float up);

// One gated MLP: y = down( act(gate x, up x) ). gate/up [intermediate, hidden], down [hidden,
// intermediate].
struct SwiGluWeights {
  std::span<const float> gateProj;
  std::span<const float> upProj;
  std::span<const float> downProj;
  int64_t hiddenSize = 0;
  int64_t intermediateSize = 0;
  // FP8 projections (held dequantized): each one's input is quantized as linearFp8Activations.
  std::optional<Fp8ScaleRule> fp8Activations;
  GatedActivation activation = {};
};

// out [numTokens, hidden] = SwiGLU(x). Used for dense MLPs, shared experts and routed experts.
void swiGluMlp(std::span<const float> x, int64_t numTokens, const SwiGluWeights &weights,
               std::span<float> out);

// out = Σ_k expertWeights[t, k] · experts[expertIds[t, k]](x_t) + Σ_shared shared(x_t).
void moeExperts(std::span<const float> x, int64_t numTokens, int64_t hiddenSize,
                std::span<const int32_t> expertIds, std::span<const float> expertWeights,
                int64_t topK, std::span<const SwiGluWeights> experts,
                std::span<const SwiGluWeights> sharedExperts, std::span<float> out);

} // namespace hybrid::kernels::ref
