// MLA — Multi-head Latent Attention (MODEL_SPEC §3) and rotary position embeddings (§3.2, §4.2).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace hybrid::kernels::ref {

// ---- RoPE
// ----------------------------------------------------------------------------------------

// Which dimensions form the rotated pairs of a rotaryDim-long vector (pair i uses frequency i):
//   Interleaved (GPT-J, DeepSeek MLA):        (x[2i], x[2i+1])
//   HalfSplit   (NeoX, DeepSeek indexer, HF): (x[i], x[i + rotaryDim/2])
// None leaves the vector unchanged (Kimi-Linear's NoPE MLA).
enum class RopeLayout { None, Interleaved, HalfSplit };

// θ_i = theta^(−2i/rotaryDim), i < rotaryDim/2.
std::vector<float> ropeInverseFrequencies(int64_t rotaryDim, double theta);

// YaRN context extension as in DeepSeek's precompute_freqs_cis / HF "yarn" rope. mscaleAllDim 0
// means absent (no softmax-scale correction). The cos/sin amplitude factor HF derives from
// mscale / mscaleAllDim is 1 when they are equal (DeepSeek-V3.2) and is not applied here.
struct YarnConfig {
  double factor = 1.0;
  int64_t originalMaxPositions = 4096;
  double betaFast = 32.0;
  double betaSlow = 1.0;
  double mscale = 1.0;
  double mscaleAllDim = 0.0;
};

// The frequency-index ramp [low, high]: low = floor(corr(betaFast)), high = ceil(corr(betaSlow)),
// corr(r) = rotaryDim · ln(originalMaxPositions / (2π r)) / (2 ln theta), clamped to [0,
// rotaryDim−1].
struct YarnRamp {
  int64_t low = 0;
  int64_t high = 0;
};
YarnRamp yarnCorrectionRange(int64_t rotaryDim, double theta, const YarnConfig &yarn);

// θ'_i = θ_i / factor · ramp_i + θ_i · (1 − ramp_i), ramp_i = clamp((i − low)/(high − low), 0, 1).
std::vector<float> yarnInverseFrequencies(int64_t rotaryDim, double theta, const YarnConfig &yarn);

// m = 0.1 · mscale · ln(factor) + 1 (1 when factor ≤ 1). With mscale_all_dim the attention softmax
// scale becomes headDim^−1/2 · m².
double yarnMscale(double factor, double mscale);

// Rotates one vector of 2·inverseFrequencies.size() values in place by the angles position · θ_i.
void applyRope(std::span<float> x, int64_t position, std::span<const float> inverseFrequencies,
               RopeLayout layout);

// ---- Attention
// -----------------------------------------------------------------------------------

// MHA-form MLA over a latent cache (§3.2): keys/values of every cached position are expanded from
// the latent c_s (already through kv_a_layernorm) with kv_b_proj, and the shared rope key k_r,s
// (already rotated) is appended to each head's key:
//   k_{h,s} = [W_UK,h c_s ; k_r,s],  v_{h,s} = W_UV,h c_s,
//   o_{t,h} = Σ_s softmax_s(softmaxScale · q_{t,h}·k_{h,s}) v_{h,s}
// over s ≤ queryPositions[t] (dense causal), or, when sparseIndices is given, over exactly the
// listed positions of row t (−1 entries are skipped; causality is the index producer's job).
// A query with no key at all gets a zero output.
struct MlaAttentionParams {
  int64_t numQueries = 0;
  int64_t numKeys = 0; // cached positions 0 .. numKeys−1
  int64_t numHeads = 0;
  int64_t nopeDim = 0;   // qk_nope_head_dim
  int64_t ropeDim = 0;   // qk_rope_head_dim
  int64_t valueDim = 0;  // v_head_dim
  int64_t latentDim = 0; // kv_lora_rank
  float softmaxScale = 0.0f;
  const float *queries = nullptr; // [numQueries, numHeads, nopeDim + ropeDim], nope first
  // [numQueries] absolute positions; null: the queries are the last numQueries cached positions.
  const int64_t *queryPositions = nullptr;
  const float *latents = nullptr;         // [numKeys, latentDim]
  const float *ropeKeys = nullptr;        // [numKeys, ropeDim]
  const float *kvBProj = nullptr;         // [numHeads · (nopeDim + valueDim), latentDim]
  const int32_t *sparseIndices = nullptr; // [numQueries, topK] or null for dense causal
  int64_t topK = 0;
  float *out = nullptr; // [numQueries, numHeads, valueDim]
};

void mlaAttention(const MlaAttentionParams &params);

// ---- The absorbed MQA form (§3.3): the same attention with one (latentDim + ropeDim)-wide key
// per position, shared by all heads, which is what the GPU decode kernels compute over the cache:
//   q~_h = W_UK[h]^T q_nope_h,  Q_h = [q~_h ; q_r_h],  K_s = [c_s ; k_r,s],
//   o^_h = sum_s softmax_s(softmaxScale * Q_h . K_s) c_s,  o_h = W_UV[h] o^_h.

// queries [numQueries, numHeads, nopeDim + ropeDim] -> absorbed [numQueries, numHeads,
// latentDim + ropeDim] (the rope part copied), with kvBProj [numHeads * (nopeDim + valueDim),
// latentDim] as in MlaAttentionParams.
void absorbMlaQueries(const MlaAttentionParams &params, float *absorbed);

struct LatentAttentionParams {
  int64_t numQueries = 0;
  int64_t numKeys = 0;
  int64_t numHeads = 0;
  int64_t latentDim = 0;
  int64_t ropeDim = 0;
  float softmaxScale = 0.0f;
  const float *queries = nullptr;          // [numQueries, numHeads, latentDim + ropeDim]
  const int64_t *queryPositions = nullptr; // as MlaAttentionParams (dense causal only)
  const float *latents = nullptr;          // [numKeys, latentDim]
  const float *ropeKeys = nullptr;         // [numKeys, ropeDim]
  const int32_t *sparseIndices = nullptr;  // [numQueries, topK] or null; -1 entries skipped
  int64_t topK = 0;
  float *out = nullptr; // [numQueries, numHeads, latentDim]: o^_h (zero without keys)
};

void latentAttention(const LatentAttentionParams &params);

// latentOut [numQueries, numHeads, latentDim] -> out [numQueries, numHeads, valueDim]:
// o_h = W_UV[h] o^_h.
void expandLatentOutputs(const MlaAttentionParams &params, const float *latentOut, float *out);

} // namespace hybrid::kernels::ref
