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
  std::string_view name;       // the plan dialect's spelling
  int minInputs;
  int maxInputs;               // -1: unbounded (AttnRes blocks)
  int numOutputs;
  fb::KernelParams params;
  int fixedWeights;            // role count before any per-expert weights
  uint32_t optionalWeights;    // bit i set: role i may be -1
  bool perExpertWeights;       // MoeExperts: 3 roles per expert (gate, up, down)
  std::array<std::string_view, 16> weightRoles;
};

inline constexpr KernelSignature kKernelSignatures[] = {
    {fb::KernelId::Embed, "embed", 1, 1, 1, fb::KernelParams::EmbedParams, 1, 0, false, {"table"}},
    {fb::KernelId::RmsNorm, "rms_norm", 1, 1, 1, fb::KernelParams::RmsNormParams, 1, 0, false,
     {"weight"}},
    {fb::KernelId::Linear, "linear", 1, 1, 1, fb::KernelParams::LinearParams, 1, 0, false,
     {"weight"}},
    {fb::KernelId::Add, "add", 2, 2, 1, fb::KernelParams::AddParams, 0, 0, false, {}},
    {fb::KernelId::KdaChunkPrefill, "kda_chunk_prefill", 1, 1, 1, fb::KernelParams::KdaParams, 16,
     (1u << 11) | (1u << 12) | (1u << 13), false,
     {"q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj",
      "A_log", "dt_bias", "b_proj", "g_a_proj", "g_b_proj", "g_proj", "o_norm", "o_proj"}},
    {fb::KernelId::KdaRecurrentDecode, "kda_recurrent_decode", 1, 1, 1, fb::KernelParams::KdaParams,
     16, (1u << 11) | (1u << 12) | (1u << 13), false,
     {"q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj",
      "A_log", "dt_bias", "b_proj", "g_a_proj", "g_b_proj", "g_proj", "o_norm", "o_proj"}},
    {fb::KernelId::MlaPrefill, "mla_prefill", 1, 2, 1, fb::KernelParams::MlaParams, 7,
     (1u << 0) | (1u << 1) | (1u << 5), false,
     {"q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
      "o_proj"}},
    {fb::KernelId::MlaDecode, "mla_decode", 1, 2, 1, fb::KernelParams::MlaParams, 7,
     (1u << 0) | (1u << 1) | (1u << 5), false,
     {"q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
      "o_proj"}},
    {fb::KernelId::DsaIndexer, "dsa_indexer", 3, 3, 1, fb::KernelParams::DsaIndexerParams, 0, 0,
     false, {}},
    {fb::KernelId::SparseMlaPrefill, "sparse_mla_prefill", 2, 3, 1, fb::KernelParams::MlaParams, 7,
     (1u << 0) | (1u << 1) | (1u << 5), false,
     {"q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
      "o_proj"}},
    {fb::KernelId::SparseMlaDecode, "sparse_mla_decode", 2, 3, 1, fb::KernelParams::MlaParams, 7,
     (1u << 0) | (1u << 1) | (1u << 5), false,
     {"q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj",
      "o_proj"}},
    {fb::KernelId::AttnRes, "attn_res", 1, -1, 1, fb::KernelParams::AttnResParams, 2, 0, false,
     {"norm", "proj"}},
    {fb::KernelId::Mlp, "mlp", 1, 1, 1, fb::KernelParams::MlpParams, 3, 0, false,
     {"gate_proj", "up_proj", "down_proj"}},
    {fb::KernelId::MoeExperts, "moe_experts", 3, 3, 1, fb::KernelParams::MoeParams, 0, 0, true,
     {}},
    {fb::KernelId::LmHead, "lm_head", 1, 1, 1, fb::KernelParams::LmHeadParams, 1, 0, false,
     {"weight"}},
    {fb::KernelId::IndexerQuery, "indexer_query", 1, 1, 1, fb::KernelParams::DsaIndexerParams, 1,
     0, false, {"wq_b"}},
    {fb::KernelId::IndexerKey, "indexer_key", 1, 1, 1, fb::KernelParams::DsaIndexerParams, 3, 0,
     false, {"wk", "k_norm", "k_norm_bias"}},
    {fb::KernelId::RouterTopK, "router_topk", 1, 1, 2, fb::KernelParams::MoeParams, 2, 1u << 1,
     false, {"router", "correction_bias"}},
};

// nullptr for an id outside the table (a corrupted or newer plan).
inline const KernelSignature *kernelSignature(fb::KernelId kernel) {
  for (const KernelSignature &signature : kKernelSignatures)
    if (signature.kernel == kernel)
      return &signature;
  return nullptr;
}

} // namespace hybrid::plan
