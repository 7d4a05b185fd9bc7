// RUN: hybrid-opt %s | FileCheck %s
// RUN: hybrid-opt %s | hybrid-opt | FileCheck %s
// RUN: hybrid-opt %s --mlir-print-op-generic | hybrid-opt | FileCheck %s

// Every op of the dialect in one small model (hidden 16, vocab 32): parse, verify, print, re-parse.

#embed = #hybrid.weight<"model.embed_tokens.weight" : tensor<32x16xbf16>>
#norm = #hybrid.weight<"norm.weight" : tensor<16xbf16>>

// CHECK-LABEL: hybrid.model @tiny
// CHECK-SAME: attributes {hidden_size = 16 : i64, model_type = "test", num_layers = 4 : i64, vocab_size = 32 : i64}
hybrid.model @tiny attributes {model_type = "test", hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 4 : i64} {
^bb0(%ids: tensor<?xi64>):
  // CHECK: %[[H:.*]] = hybrid.embed %{{.*}} {weight = #hybrid.weight<"model.embed_tokens.weight" : tensor<32x16xbf16>>} : tensor<?xi64> -> tensor<?x16xbf16>
  %h = hybrid.embed %ids {weight = #embed} : tensor<?xi64> -> tensor<?x16xbf16>
  // CHECK: %[[X:.*]] = hybrid.rms_norm %[[H]] {epsilon = 1.000000e-05 : f64, weight = #hybrid.weight<"norm.weight" : tensor<16xbf16>>} : tensor<?x16xbf16>
  %x = hybrid.rms_norm %h {weight = #norm, epsilon = 1.0e-5 : f64} : tensor<?x16xbf16>

  // CHECK: hybrid.kda %[[X]] {A_log = #hybrid.weight<"kda.A_log" : tensor<1x1x2x1xf32>>
  // CHECK-SAME: conv_kernel = 4 : i64
  // CHECK-SAME: gate_kind = #hybrid<kda_gate softplus>
  // CHECK-SAME: head_dim = 4 : i64
  // CHECK-SAME: num_heads = 2 : i64
  // CHECK-SAME: state_layout = #hybrid<state_layout k_major>
  // CHECK-SAME: : tensor<?x16xbf16>
  %kda = hybrid.kda %x {num_heads = 2 : i64, head_dim = 4 : i64, conv_kernel = 4 : i64,
      gate_kind = #hybrid<kda_gate softplus>, state_layout = #hybrid<state_layout k_major>,
      norm_epsilon = 1.0e-5 : f64,
      q_proj = #hybrid.weight<"kda.q_proj" : tensor<8x16xbf16>>,
      k_proj = #hybrid.weight<"kda.k_proj" : tensor<8x16xbf16>>,
      v_proj = #hybrid.weight<"kda.v_proj" : tensor<8x16xbf16>>,
      q_conv1d = #hybrid.weight<"kda.q_conv1d" : tensor<8x1x4xbf16>>,
      k_conv1d = #hybrid.weight<"kda.k_conv1d" : tensor<8x1x4xbf16>>,
      v_conv1d = #hybrid.weight<"kda.v_conv1d" : tensor<8x1x4xbf16>>,
      f_a_proj = #hybrid.weight<"kda.f_a_proj" : tensor<4x16xbf16>>,
      f_b_proj = #hybrid.weight<"kda.f_b_proj" : tensor<8x4xbf16>>,
      A_log = #hybrid.weight<"kda.A_log" : tensor<1x1x2x1xf32>>,
      dt_bias = #hybrid.weight<"kda.dt_bias" : tensor<8xf32>>,
      b_proj = #hybrid.weight<"kda.b_proj" : tensor<2x16xbf16>>,
      g_a_proj = #hybrid.weight<"kda.g_a_proj" : tensor<4x16xbf16>>,
      g_b_proj = #hybrid.weight<"kda.g_b_proj" : tensor<8x4xbf16>>,
      o_norm = #hybrid.weight<"kda.o_norm" : tensor<4xbf16>>,
      o_proj = #hybrid.weight<"kda.o_proj" : tensor<16x8xbf16>>} : tensor<?x16xbf16>

  // The K3 variant: lower-bound gate, full-rank output gate, V-major state.
  // CHECK: hybrid.kda
  // CHECK-SAME: g_proj = #hybrid.weight<"k3.g_proj" : tensor<8x16xbf16>>
  // CHECK-SAME: gate_kind = #hybrid<kda_gate lower_bound>, gate_lower_bound = -5.000000e+00 : f64
  // CHECK-SAME: state_layout = #hybrid<state_layout v_major>
  %kda3 = hybrid.kda %x {num_heads = 2 : i64, head_dim = 4 : i64, conv_kernel = 4 : i64,
      gate_kind = #hybrid<kda_gate lower_bound>, gate_lower_bound = -5.0 : f64,
      state_layout = #hybrid<state_layout v_major>, norm_epsilon = 1.0e-5 : f64,
      q_proj = #hybrid.weight<"k3.q_proj" : tensor<8x16xbf16>>,
      k_proj = #hybrid.weight<"k3.k_proj" : tensor<8x16xbf16>>,
      v_proj = #hybrid.weight<"k3.v_proj" : tensor<8x16xbf16>>,
      q_conv1d = #hybrid.weight<"k3.q_conv1d" : tensor<8x1x4xf32>>,
      k_conv1d = #hybrid.weight<"k3.k_conv1d" : tensor<8x1x4xf32>>,
      v_conv1d = #hybrid.weight<"k3.v_conv1d" : tensor<8x1x4xf32>>,
      f_a_proj = #hybrid.weight<"k3.f_a_proj" : tensor<4x16xbf16>>,
      f_b_proj = #hybrid.weight<"k3.f_b_proj" : tensor<8x4xbf16>>,
      A_log = #hybrid.weight<"k3.A_log" : tensor<2xf32>>,
      dt_bias = #hybrid.weight<"k3.dt_bias" : tensor<8xf32>>,
      b_proj = #hybrid.weight<"k3.b_proj" : tensor<2x16xbf16>>,
      g_proj = #hybrid.weight<"k3.g_proj" : tensor<8x16xbf16>>,
      o_norm = #hybrid.weight<"k3.o_norm" : tensor<4xbf16>>,
      o_proj = #hybrid.weight<"k3.o_proj" : tensor<16x8xbf16>>} : tensor<?x16xbf16>

  // CHECK: hybrid.mla %[[X]] {
  // CHECK-SAME: rope = #hybrid.rope<kind = none>
  // CHECK-SAME: : (tensor<?x16xbf16>) -> tensor<?x16xbf16>
  %mla = hybrid.mla %x {num_heads = 2 : i64, kv_lora_rank = 8 : i64, qk_nope_head_dim = 4 : i64,
      qk_rope_head_dim = 2 : i64, v_head_dim = 4 : i64, rope = #hybrid.rope<kind = none>,
      softmax_scale = 0.408 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_proj = #hybrid.weight<"mla.q_proj" : tensor<12x16xbf16>>,
      kv_a_proj_with_mqa = #hybrid.weight<"mla.kv_a_proj_with_mqa" : tensor<10x16xbf16>>,
      kv_a_layernorm = #hybrid.weight<"mla.kv_a_layernorm" : tensor<8xbf16>>,
      kv_b_proj = #hybrid.weight<"mla.kv_b_proj" : tensor<16x8xbf16>>,
      g_proj = #hybrid.weight<"mla.g_proj" : tensor<8x16xbf16>>,
      o_proj = #hybrid.weight<"mla.o_proj" : tensor<16x8xbf16>>} : (tensor<?x16xbf16>) -> tensor<?x16xbf16>

  // DSA: shared query latent, indexer, sparse MLA with YaRN rope.
  // CHECK: %[[QA:.*]] = hybrid.linear %[[X]] {weight = #hybrid.weight<"dsa.q_a_proj" : tensor<6x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x6xbf16>
  %qa = hybrid.linear %x {weight = #hybrid.weight<"dsa.q_a_proj" : tensor<6x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x6xbf16>
  // CHECK: %[[QN:.*]] = hybrid.rms_norm %[[QA]]
  %qn = hybrid.rms_norm %qa {weight = #hybrid.weight<"dsa.q_a_layernorm" : tensor<6xbf16>>, epsilon = 1.0e-6 : f64} : tensor<?x6xbf16>
  // CHECK: %[[IDX:.*]] = hybrid.dsa_indexer %[[X]], %[[QN]] {
  // CHECK-SAME: rope = #hybrid.rope<kind = yarn, pairing = half_split, factor = 4.000000e+01, original_max_position = 4096>
  // CHECK-SAME: top_k = 3 : i64
  // CHECK-SAME: : (tensor<?x16xbf16>, tensor<?x6xbf16>) -> tensor<?x3xi32>
  %idx = hybrid.dsa_indexer %x, %qn {index_heads = 2 : i64, index_head_dim = 4 : i64, top_k = 3 : i64,
      rope_head_dim = 2 : i64,
      rope = #hybrid.rope<kind = yarn, pairing = half_split, factor = 40.0, original_max_position = 4096>,
      norm_epsilon = 1.0e-6 : f64,
      wq_b = #hybrid.weight<"dsa.wq_b" : tensor<8x6xbf16>>,
      wk = #hybrid.weight<"dsa.wk" : tensor<4x16xbf16>>,
      k_norm = #hybrid.weight<"dsa.k_norm" : tensor<4xbf16>>,
      k_norm_bias = #hybrid.weight<"dsa.k_norm_bias" : tensor<4xbf16>>,
      weights_proj = #hybrid.weight<"dsa.weights_proj" : tensor<2x16xbf16>>} : (tensor<?x16xbf16>, tensor<?x6xbf16>) -> tensor<?x3xi32>
  // CHECK: hybrid.sparse_mla %[[X]], %[[IDX]], %[[QN]] {
  // CHECK-SAME: q_lora_rank = 6 : i64
  // CHECK-SAME: rope = #hybrid.rope<kind = yarn, factor = 4.000000e+01, original_max_position = 4096, mscale_all_dim = 1.000000e+00>
  // CHECK-SAME: : (tensor<?x16xbf16>, tensor<?x3xi32>, tensor<?x6xbf16>) -> tensor<?x16xbf16>
  %sparse = hybrid.sparse_mla %x, %idx, %qn {num_heads = 2 : i64, q_lora_rank = 6 : i64,
      kv_lora_rank = 8 : i64, qk_nope_head_dim = 4 : i64, qk_rope_head_dim = 2 : i64, v_head_dim = 4 : i64,
      rope = #hybrid.rope<kind = yarn, factor = 40.0, original_max_position = 4096, mscale_all_dim = 1.0>,
      softmax_scale = 0.765 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_b_proj = #hybrid.weight<"dsa.q_b_proj" : tensor<12x6xbf16>>,
      kv_a_proj_with_mqa = #hybrid.weight<"dsa.kv_a_proj_with_mqa" : tensor<10x16xbf16>>,
      kv_a_layernorm = #hybrid.weight<"dsa.kv_a_layernorm" : tensor<8xbf16>>,
      kv_b_proj = #hybrid.weight<"dsa.kv_b_proj" : tensor<16x8xbf16>>,
      o_proj = #hybrid.weight<"dsa.o_proj" : tensor<16x8xbf16>>} : (tensor<?x16xbf16>, tensor<?x3xi32>, tensor<?x6xbf16>) -> tensor<?x16xbf16>

  // CHECK: %[[R:.*]] = hybrid.add %[[H]], %{{.*}} : tensor<?x16xbf16>
  %r = hybrid.add %h, %kda : tensor<?x16xbf16>

  // FP8 block-scaled weights carry their scale tensor.
  // CHECK: hybrid.mlp %[[R]] {activation = #hybrid<activation silu>
  // CHECK-SAME: gate_proj = #hybrid.weight<"mlp.gate_proj" : tensor<8x16xf8E4M3FN>, scale "mlp.gate_proj_scale_inv" : tensor<1x1xf32>>
  %mlp = hybrid.mlp %r {activation = #hybrid<activation silu>,
      gate_proj = #hybrid.weight<"mlp.gate_proj" : tensor<8x16xf8E4M3FN>, scale "mlp.gate_proj_scale_inv" : tensor<1x1xf32>>,
      up_proj = #hybrid.weight<"mlp.up_proj" : tensor<8x16xbf16>>,
      down_proj = #hybrid.weight<"mlp.down_proj" : tensor<16x8xbf16>>} : tensor<?x16xbf16>

  // CHECK: hybrid.moe %[[R]] {
  // CHECK-SAME: experts_down_proj = [#hybrid.weight<"moe.e0.down" : tensor<16x8xbf16>>, #hybrid.weight<"moe.e1.down" : tensor<16x8xbf16>>, #hybrid.weight<"moe.e2.down" : tensor<16x8xbf16>>, #hybrid.weight<"moe.e3.down" : tensor<16x8xbf16>>]
  // CHECK-SAME: score_function = #hybrid<score_function sigmoid>
  // CHECK-SAME: : tensor<?x16xbf16>
  %moe = hybrid.moe %r {num_experts = 4 : i64, top_k = 2 : i64, num_groups = 2 : i64, topk_groups = 1 : i64,
      score_function = #hybrid<score_function sigmoid>, renormalize = true, routed_scaling_factor = 2.5 : f64,
      intermediate_size = 8 : i64, num_shared_experts = 1 : i64,
      router = #hybrid.weight<"moe.gate" : tensor<4x16xbf16>>,
      correction_bias = #hybrid.weight<"moe.bias" : tensor<4xf32>>,
      experts_gate_proj = [#hybrid.weight<"moe.e0.gate" : tensor<8x16xbf16>>, #hybrid.weight<"moe.e1.gate" : tensor<8x16xbf16>>,
                           #hybrid.weight<"moe.e2.gate" : tensor<8x16xbf16>>, #hybrid.weight<"moe.e3.gate" : tensor<8x16xbf16>>],
      experts_up_proj = [#hybrid.weight<"moe.e0.up" : tensor<8x16xbf16>>, #hybrid.weight<"moe.e1.up" : tensor<8x16xbf16>>,
                         #hybrid.weight<"moe.e2.up" : tensor<8x16xbf16>>, #hybrid.weight<"moe.e3.up" : tensor<8x16xbf16>>],
      experts_down_proj = [#hybrid.weight<"moe.e0.down" : tensor<16x8xbf16>>, #hybrid.weight<"moe.e1.down" : tensor<16x8xbf16>>,
                           #hybrid.weight<"moe.e2.down" : tensor<16x8xbf16>>, #hybrid.weight<"moe.e3.down" : tensor<16x8xbf16>>],
      shared_gate_proj = #hybrid.weight<"moe.shared.gate" : tensor<8x16xbf16>>,
      shared_up_proj = #hybrid.weight<"moe.shared.up" : tensor<8x16xbf16>>,
      shared_down_proj = #hybrid.weight<"moe.shared.down" : tensor<16x8xbf16>>} : tensor<?x16xbf16>

  // CHECK: hybrid.attn_res %{{.*}} over() {block_size = 2 : i64
  %first = hybrid.attn_res %mla over () {block_size = 2 : i64, epsilon = 1.0e-5 : f64,
      norm = #hybrid.weight<"ar.0.norm" : tensor<16xbf16>>, proj = #hybrid.weight<"ar.0.proj" : tensor<1x16xbf16>>} : tensor<?x16xbf16>
  // CHECK: %[[MIX:.*]] = hybrid.attn_res %{{.*}} over(%[[H]], %[[R]] : tensor<?x16xbf16>, tensor<?x16xbf16>) {block_size = 2 : i64
  %mix = hybrid.attn_res %moe over (%h, %r : tensor<?x16xbf16>, tensor<?x16xbf16>) {block_size = 2 : i64, epsilon = 1.0e-5 : f64,
      norm = #hybrid.weight<"ar.1.norm" : tensor<16xbf16>>, proj = #hybrid.weight<"ar.1.proj" : tensor<1x16xbf16>>} : tensor<?x16xbf16>

  // CHECK: %[[LOGITS:.*]] = hybrid.lm_head %[[MIX]] {weight = #hybrid.weight<"lm_head.weight" : tensor<32x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x32xf32>
  %logits = hybrid.lm_head %mix {weight = #hybrid.weight<"lm_head.weight" : tensor<32x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x32xf32>
  // CHECK: hybrid.return %[[LOGITS]] : tensor<?x32xf32>
  hybrid.return %logits : tensor<?x32xf32>
}

// Kimi K3's feed-forwards: the SiTU activation and the latent MoE (experts in an 8-wide latent
// space between routed_expert_down_proj and routed_expert_up_proj, with routed_expert_norm).
// CHECK-LABEL: func.func @k3_feed_forward
func.func @k3_feed_forward(%x: tensor<?x16xbf16>) {
  // CHECK: hybrid.mlp %{{.*}} {activation = #hybrid<activation situ>
  // CHECK-SAME: situ_beta = 4.000000e+00 : f64, situ_linear_beta = 2.500000e+01 : f64
  %mlp = hybrid.mlp %x {activation = #hybrid<activation situ>, situ_beta = 4.0 : f64,
      situ_linear_beta = 25.0 : f64,
      gate_proj = #hybrid.weight<"mlp.gate_proj" : tensor<8x16xbf16>>,
      up_proj = #hybrid.weight<"mlp.up_proj" : tensor<8x16xbf16>>,
      down_proj = #hybrid.weight<"mlp.down_proj" : tensor<16x8xbf16>>} : tensor<?x16xbf16>
  // CHECK: hybrid.moe %{{.*}} {activation = #hybrid<activation situ>
  // CHECK-SAME: routed_expert_down_proj = #hybrid.weight<"moe.latent_down" : tensor<8x16xbf16>>
  // CHECK-SAME: routed_expert_norm = #hybrid.weight<"moe.latent_norm" : tensor<8xbf16>>, routed_expert_norm_epsilon = 1.000000e-05 : f64
  // CHECK-SAME: routed_expert_up_proj = #hybrid.weight<"moe.latent_up" : tensor<16x8xbf16>>
  %moe = hybrid.moe %x {num_experts = 2 : i64, top_k = 1 : i64, num_groups = 1 : i64, topk_groups = 1 : i64,
      score_function = #hybrid<score_function sigmoid>, renormalize = true, routed_scaling_factor = 2.5 : f64,
      intermediate_size = 4 : i64, num_shared_experts = 0 : i64,
      activation = #hybrid<activation situ>, situ_beta = 4.0 : f64,
      router = #hybrid.weight<"moe.gate" : tensor<2x16xbf16>>,
      experts_gate_proj = [#hybrid.weight<"moe.e0.gate" : tensor<4x8xbf16>>, #hybrid.weight<"moe.e1.gate" : tensor<4x8xbf16>>],
      experts_up_proj = [#hybrid.weight<"moe.e0.up" : tensor<4x8xbf16>>, #hybrid.weight<"moe.e1.up" : tensor<4x8xbf16>>],
      experts_down_proj = [#hybrid.weight<"moe.e0.down" : tensor<8x4xbf16>>, #hybrid.weight<"moe.e1.down" : tensor<8x4xbf16>>],
      routed_expert_down_proj = #hybrid.weight<"moe.latent_down" : tensor<8x16xbf16>>,
      routed_expert_up_proj = #hybrid.weight<"moe.latent_up" : tensor<16x8xbf16>>,
      routed_expert_norm = #hybrid.weight<"moe.latent_norm" : tensor<8xbf16>>,
      routed_expert_norm_epsilon = 1.0e-5 : f64} : tensor<?x16xbf16>
  return
}
