// What every kernel of plan.fbs takes: operand counts, the weight roles in order (which may be
// absent), the params table. One table shared by the compiler's contract verifier and the
// runtime's plan loader, so the two can never disagree.
#pragma once

#include "runtime/schema/plan_generated.h"

#include <array>
#include <cstdint>
#include <string_view>

namespace hybrid::plan {

struct KernelSignature {
  fb::KernelId kernel;
  std::string_view name; // the plan dialect's spelling
  int minInputs;
  int maxInputs; // -1: unbounded (AttnRes blocks)
  int numOutputs;
  fb::KernelParams params;
  int fixedWeights;         // role count before any per-expert weights
  uint32_t optionalWeights; // bit i set: role i may be -1
  bool perExpertWeights;    // MoeExperts: 3 roles per expert (gate, up, down)
  std::array<std::string_view, 16> weightRoles;
  // What the kernel fuses into one launch (empty for a plain kernel), for reports.
  std::string_view fuses;
  // Roles the kernel reads as a GEMM operand that accepts the tiled layout
  // (--hybrid-assign-weight-layout tiles exactly these; the others stay row-major).
  uint32_t tiledWeights = 0;
};

// KDA: the q/k/v, forget-gate, beta, output-gate and output projections (not the conv taps,
// A_log, dt_bias or the norm weight). MLA: the query, latent, output-gate and output projections
// (kv_b_proj is read per head inside the attention).
inline constexpr uint32_t kKdaTiledRoles = (1u << 0) | (1u << 1) | (1u << 2) | (1u << 6) |
                                           (1u << 7) | (1u << 10) | (1u << 11) | (1u << 12) |
                                           (1u << 13) | (1u << 15);
inline constexpr uint32_t kMlaTiledRoles =
    (1u << 0) | (1u << 1) | (1u << 2) | (1u << 5) | (1u << 6);

inline constexpr std::array<std::string_view, 16> kKdaRoles = {
    "q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj",
    "A_log",  "dt_bias", "b_proj", "g_a_proj", "g_b_proj", "g_proj",   "o_norm",   "o_proj"};
inline constexpr std::array<std::string_view, 16> kMlaRoles = {
    "q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj", "o_proj"};
inline constexpr uint32_t kKdaOptionalRoles = (1u << 11) | (1u << 12) | (1u << 13);
inline constexpr uint32_t kMlaOptionalRoles = (1u << 0) | (1u << 1) | (1u << 5);
inline constexpr const char *kKdaPrefillFuses =
    "projections + short conv + SiLU + L2 norm + gate + beta + chunked delta rule + gated RMSNorm "
    "+ output gate";
inline constexpr const char *kKdaDecodeFuses =
    "projections + conv-state update + gate + beta + delta-rule step + gated RMSNorm + output gate";
inline constexpr const char *kMlaFuses =
    "latent projection + norm + rope + cache append + attention + output projection";
inline constexpr const char *kSparseMlaFuses =
    "latent projection + norm + rope + cache append + top-k attention + output projection";

// Fields: kernel, name, min/max inputs, outputs, params, fixed weights, optional roles,
// per-expert weights, role names, what it fuses, tiled roles.
inline constexpr KernelSignature kKernelSignatures[] = {
    {fb::KernelId::Embed, "embed", 1, 1, 1, fb::KernelParams::EmbedParams, 1, 0, false, {"table"},
     "", 0},
    {fb::KernelId::RmsNorm, "rms_norm", 1, 1, 1, fb::KernelParams::RmsNormParams, 1, 0, false,
     {"weight"}, "", 0},
    // Two inputs: the projection of their row-wise concatenation (the MTP input's eh_proj).
    {fb::KernelId::Linear, "linear", 1, 2, 1, fb::KernelParams::LinearParams, 1, 0, false,
     {"weight"}, "", 1u << 0},
    {fb::KernelId::Add, "add", 2, 2, 1, fb::KernelParams::AddParams, 0, 0, false, {}, "", 0},
    // Context-parallel prefill: [x, x_tails, summaries] (plan.fbs KdaParams).
    {fb::KernelId::KdaChunkPrefill, "kda_chunk_prefill", 1, 3, 1, fb::KernelParams::KdaParams, 16,
     kKdaOptionalRoles, false, kKdaRoles, kKdaPrefillFuses, kKdaTiledRoles},
    {fb::KernelId::KdaRecurrentDecode, "kda_recurrent_decode", 1, 1, 1, fb::KernelParams::KdaParams,
     16, kKdaOptionalRoles, false, kKdaRoles, kKdaDecodeFuses, kKdaTiledRoles},
    // Context-parallel prefill: the step's gathered cache rows after the other inputs.
    {fb::KernelId::MlaPrefill, "mla_prefill", 1, 3, 1, fb::KernelParams::MlaParams, 7,
     kMlaOptionalRoles, false, kMlaRoles, kMlaFuses, kMlaTiledRoles},
    {fb::KernelId::MlaDecode, "mla_decode", 1, 2, 1, fb::KernelParams::MlaParams, 7,
     kMlaOptionalRoles, false, kMlaRoles, kMlaFuses, kMlaTiledRoles},
    {fb::KernelId::DsaIndexer, "dsa_indexer", 3, 3, 1, fb::KernelParams::DsaIndexerParams, 0, 0,
     false, {}, "key staging + scores over the paged keys + head weighting + top-k", 0},
    {fb::KernelId::SparseMlaPrefill, "sparse_mla_prefill", 2, 4, 1, fb::KernelParams::MlaParams,
     7, kMlaOptionalRoles, false, kMlaRoles, kSparseMlaFuses, kMlaTiledRoles},
    {fb::KernelId::SparseMlaDecode, "sparse_mla_decode", 2, 3, 1, fb::KernelParams::MlaParams, 7,
     kMlaOptionalRoles, false, kMlaRoles, kSparseMlaFuses, kMlaTiledRoles},
    {fb::KernelId::AttnRes, "attn_res", 1, -1, 1, fb::KernelParams::AttnResParams, 2, 0, false,
     {"norm", "proj"}, "RMS of every candidate + scores + softmax + weighted sum", 0},
    {fb::KernelId::Mlp, "mlp", 1, 1, 1, fb::KernelParams::MlpParams, 3, 0, false,
     {"gate_proj", "up_proj", "down_proj"},
     "gate/up projections + SiLU x up + down projection (SwiGLU)", 0},
    {fb::KernelId::MoeExperts, "moe_experts", 3, 3, 1, fb::KernelParams::MoeParams, 0, 0, true, {},
     "per-expert SwiGLU + weighted combine", 0},
    {fb::KernelId::LmHead, "lm_head", 1, 1, 1, fb::KernelParams::LmHeadParams, 1, 0, false,
     {"weight"}, "", 1u << 0},
    {fb::KernelId::IndexerQuery, "indexer_query", 1, 1, 1, fb::KernelParams::DsaIndexerParams, 1,
     0, false, {"wq_b"}, "projection + rope", 1u << 0},
    {fb::KernelId::IndexerKey, "indexer_key", 1, 1, 1, fb::KernelParams::DsaIndexerParams, 3, 0,
     false, {"wk", "k_norm", "k_norm_bias"}, "projection + LayerNorm + rope", 1u << 0},
    {fb::KernelId::RouterTopK, "router_topk", 1, 1, 2, fb::KernelParams::MoeParams, 2, 1u << 1,
     false, {"router", "correction_bias"},
     "router logits + scores + grouped top-k + renormalize", 1u << 0},
    {fb::KernelId::AddRmsNorm, "add_rms_norm", 2, 3, 2, fb::KernelParams::RmsNormParams, 1, 0,
     false, {"weight"}, "residual add (of a sum of two, with a third input) + RMSNorm of the sum",
     0},
    {fb::KernelId::AttnResRmsNorm, "attn_res_rms_norm", 1, -1, 2, fb::KernelParams::AttnResParams,
     3, 0, false, {"norm", "proj", "output_norm"}, "AttnRes mix + RMSNorm of the mix", 0},
    // No input: this rank holds no part of the sum and adds zeros (a replicated head's copy).
    {fb::KernelId::AllReduceSum, "all_reduce_sum", 0, 1, 1, fb::KernelParams::CollectiveParams, 0,
     0, false, {}, "", 0},
    // Context parallelism (docs/parallelism.md): the gather that restores position order, the KDA
    // state-passing scan's per-chunk summaries, the attention's cache rows of this rank's tokens.
    {fb::KernelId::AllGatherRows, "all_gather_rows", 1, 1, 1, fb::KernelParams::CollectiveParams,
     0, 0, false, {}, "", 0},
    {fb::KernelId::KdaContextSummary, "kda_context_summary", 2, 2, 1, fb::KernelParams::KdaParams,
     16, kKdaOptionalRoles, false, kKdaRoles,
     "projections + short conv + SiLU + L2 norm + gate + beta + chunk transition summary",
     kKdaTiledRoles},
    {fb::KernelId::MlaCacheRows, "mla_cache_rows", 1, 1, 1, fb::KernelParams::MlaParams, 2, 0,
     false, {"kv_a_proj_with_mqa", "kv_a_layernorm"}, "latent projection + norm + rope", 1u << 0},
};

// nullptr for an id outside the table (a corrupted or newer plan).
inline const KernelSignature *kernelSignature(fb::KernelId kernel) {
  for (const KernelSignature &signature : kKernelSignatures)
    if (signature.kernel == kernel)
      return &signature;
  return nullptr;
}

} // namespace hybrid::plan
