// RUN: hybrid-opt %s --split-input-file --verify-diagnostics

// Each verifier names the offending field, the checkpoint tensor and the expected value.

func.func @kda_wrong_q_proj(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{q_proj weight 'kda.q_proj' has shape [8, 15], expected [8, 16] (num_heads * head_dim = 8, hidden = 16)}}
  %0 = hybrid.kda %x {num_heads = 2 : i64, head_dim = 4 : i64, conv_kernel = 4 : i64,
      gate_kind = #hybrid<kda_gate softplus>, state_layout = #hybrid<state_layout k_major>,
      norm_epsilon = 1.0e-5 : f64,
      q_proj = #hybrid.weight<"kda.q_proj" : tensor<8x15xbf16>>,
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
  return
}

// -----

func.func @kda_conv_kernel_mismatch(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{k_conv1d weight 'kda.k_conv1d' has shape [8, 1, 3], expected [8, 1, 4] (num_heads * head_dim = 8, conv_kernel = 4)}}
  %0 = hybrid.kda %x {num_heads = 2 : i64, head_dim = 4 : i64, conv_kernel = 4 : i64,
      gate_kind = #hybrid<kda_gate softplus>, state_layout = #hybrid<state_layout k_major>,
      norm_epsilon = 1.0e-5 : f64,
      q_proj = #hybrid.weight<"kda.q_proj" : tensor<8x16xbf16>>,
      k_proj = #hybrid.weight<"kda.k_proj" : tensor<8x16xbf16>>,
      v_proj = #hybrid.weight<"kda.v_proj" : tensor<8x16xbf16>>,
      q_conv1d = #hybrid.weight<"kda.q_conv1d" : tensor<8x1x4xbf16>>,
      k_conv1d = #hybrid.weight<"kda.k_conv1d" : tensor<8x1x3xbf16>>,
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
  return
}

// -----

func.func @kda_lower_bound_missing(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{gate_kind lower_bound requires gate_lower_bound}}
  %0 = hybrid.kda %x {num_heads = 2 : i64, head_dim = 4 : i64, conv_kernel = 4 : i64,
      gate_kind = #hybrid<kda_gate lower_bound>, state_layout = #hybrid<state_layout k_major>,
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
      g_proj = #hybrid.weight<"kda.g_proj" : tensor<8x16xbf16>>,
      o_norm = #hybrid.weight<"kda.o_norm" : tensor<4xbf16>>,
      o_proj = #hybrid.weight<"kda.o_proj" : tensor<16x8xbf16>>} : tensor<?x16xbf16>
  return
}

// -----

func.func @kda_no_output_gate(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{requires the output gate: g_a_proj and g_b_proj, or g_proj}}
  %0 = hybrid.kda %x {num_heads = 2 : i64, head_dim = 4 : i64, conv_kernel = 4 : i64,
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
      o_norm = #hybrid.weight<"kda.o_norm" : tensor<4xbf16>>,
      o_proj = #hybrid.weight<"kda.o_proj" : tensor<16x8xbf16>>} : tensor<?x16xbf16>
  return
}

// -----

func.func @kda_zero_heads(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{attribute 'num_heads' failed to satisfy constraint: 64-bit signless integer attribute whose value is positive}}
  %0 = hybrid.kda %x {num_heads = 0 : i64, head_dim = 4 : i64, conv_kernel = 4 : i64,
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
  return
}

// -----

func.func @mla_q_lora_without_latent(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{q_lora_rank = 6 requires the query latent operand (q_a_layernorm output)}}
  %0 = hybrid.mla %x {num_heads = 2 : i64, q_lora_rank = 6 : i64, kv_lora_rank = 8 : i64,
      qk_nope_head_dim = 4 : i64, qk_rope_head_dim = 2 : i64, v_head_dim = 4 : i64,
      rope = #hybrid.rope<kind = plain>, softmax_scale = 0.4 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_b_proj = #hybrid.weight<"mla.q_b_proj" : tensor<12x6xbf16>>,
      kv_a_proj_with_mqa = #hybrid.weight<"mla.kv_a" : tensor<10x16xbf16>>,
      kv_a_layernorm = #hybrid.weight<"mla.kv_a_ln" : tensor<8xbf16>>,
      kv_b_proj = #hybrid.weight<"mla.kv_b" : tensor<16x8xbf16>>,
      o_proj = #hybrid.weight<"mla.o_proj" : tensor<16x8xbf16>>} : (tensor<?x16xbf16>) -> tensor<?x16xbf16>
  return
}

// -----

func.func @mla_wrong_kv_b(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{kv_b_proj weight 'mla.kv_b' has shape [12, 8], expected [16, 8] (num_heads * (qk_nope_head_dim + v_head_dim) = 16, kv_lora_rank = 8)}}
  %0 = hybrid.mla %x {num_heads = 2 : i64, kv_lora_rank = 8 : i64,
      qk_nope_head_dim = 4 : i64, qk_rope_head_dim = 2 : i64, v_head_dim = 4 : i64,
      rope = #hybrid.rope<kind = none>, softmax_scale = 0.4 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_proj = #hybrid.weight<"mla.q_proj" : tensor<12x16xbf16>>,
      kv_a_proj_with_mqa = #hybrid.weight<"mla.kv_a" : tensor<10x16xbf16>>,
      kv_a_layernorm = #hybrid.weight<"mla.kv_a_ln" : tensor<8xbf16>>,
      kv_b_proj = #hybrid.weight<"mla.kv_b" : tensor<12x8xbf16>>,
      o_proj = #hybrid.weight<"mla.o_proj" : tensor<16x8xbf16>>} : (tensor<?x16xbf16>) -> tensor<?x16xbf16>
  return
}

// -----

func.func @mla_both_query_projections(%x: tensor<?x16xbf16>, %q: tensor<?x6xbf16>) {
  // expected-error @+1 {{has an unexpected q_proj weight 'mla.q_proj' when q_lora_rank is set}}
  %0 = hybrid.mla %x, %q {num_heads = 2 : i64, q_lora_rank = 6 : i64, kv_lora_rank = 8 : i64,
      qk_nope_head_dim = 4 : i64, qk_rope_head_dim = 2 : i64, v_head_dim = 4 : i64,
      rope = #hybrid.rope<kind = plain>, softmax_scale = 0.4 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_proj = #hybrid.weight<"mla.q_proj" : tensor<12x16xbf16>>,
      q_b_proj = #hybrid.weight<"mla.q_b_proj" : tensor<12x6xbf16>>,
      kv_a_proj_with_mqa = #hybrid.weight<"mla.kv_a" : tensor<10x16xbf16>>,
      kv_a_layernorm = #hybrid.weight<"mla.kv_a_ln" : tensor<8xbf16>>,
      kv_b_proj = #hybrid.weight<"mla.kv_b" : tensor<16x8xbf16>>,
      o_proj = #hybrid.weight<"mla.o_proj" : tensor<16x8xbf16>>} : (tensor<?x16xbf16>, tensor<?x6xbf16>) -> tensor<?x16xbf16>
  return
}

// -----

func.func @mla_odd_rope(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{rotary embedding needs an even qk_rope_head_dim, got 3}}
  %0 = hybrid.mla %x {num_heads = 2 : i64, kv_lora_rank = 8 : i64,
      qk_nope_head_dim = 4 : i64, qk_rope_head_dim = 3 : i64, v_head_dim = 4 : i64,
      rope = #hybrid.rope<kind = plain>, softmax_scale = 0.4 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_proj = #hybrid.weight<"mla.q_proj" : tensor<14x16xbf16>>,
      kv_a_proj_with_mqa = #hybrid.weight<"mla.kv_a" : tensor<11x16xbf16>>,
      kv_a_layernorm = #hybrid.weight<"mla.kv_a_ln" : tensor<8xbf16>>,
      kv_b_proj = #hybrid.weight<"mla.kv_b" : tensor<16x8xbf16>>,
      o_proj = #hybrid.weight<"mla.o_proj" : tensor<16x8xbf16>>} : (tensor<?x16xbf16>) -> tensor<?x16xbf16>
  return
}

// -----

func.func @yarn_without_original_length() attributes {
  // expected-error @+1 {{yarn rope needs original_max_position > 0, got 0}}
  rope = #hybrid.rope<kind = yarn, factor = 40.0>} {
  return
}

// -----

func.func @indexer_wrong_top_k(%x: tensor<?x16xbf16>, %q: tensor<?x6xbf16>) {
  // expected-error @+1 {{result feature dimension is 4, expected 3 (top_k = 3)}}
  %0 = hybrid.dsa_indexer %x, %q {index_heads = 2 : i64, index_head_dim = 4 : i64, top_k = 3 : i64,
      rope_head_dim = 2 : i64, rope = #hybrid.rope<kind = plain, pairing = half_split>,
      norm_epsilon = 1.0e-6 : f64,
      wq_b = #hybrid.weight<"dsa.wq_b" : tensor<8x6xbf16>>,
      wk = #hybrid.weight<"dsa.wk" : tensor<4x16xbf16>>,
      k_norm = #hybrid.weight<"dsa.k_norm" : tensor<4xbf16>>,
      k_norm_bias = #hybrid.weight<"dsa.k_norm_bias" : tensor<4xbf16>>,
      weights_proj = #hybrid.weight<"dsa.weights_proj" : tensor<2x16xbf16>>} : (tensor<?x16xbf16>, tensor<?x6xbf16>) -> tensor<?x4xi32>
  return
}

// -----

func.func @indexer_wrong_weights_proj(%x: tensor<?x16xbf16>, %q: tensor<?x6xbf16>) {
  // expected-error @+1 {{weights_proj weight 'dsa.weights_proj' has shape [3, 16], expected [2, 16] (index_heads = 2, hidden = 16)}}
  %0 = hybrid.dsa_indexer %x, %q {index_heads = 2 : i64, index_head_dim = 4 : i64, top_k = 3 : i64,
      rope_head_dim = 2 : i64, rope = #hybrid.rope<kind = plain, pairing = half_split>,
      norm_epsilon = 1.0e-6 : f64,
      wq_b = #hybrid.weight<"dsa.wq_b" : tensor<8x6xbf16>>,
      wk = #hybrid.weight<"dsa.wk" : tensor<4x16xbf16>>,
      k_norm = #hybrid.weight<"dsa.k_norm" : tensor<4xbf16>>,
      k_norm_bias = #hybrid.weight<"dsa.k_norm_bias" : tensor<4xbf16>>,
      weights_proj = #hybrid.weight<"dsa.weights_proj" : tensor<3x16xbf16>>} : (tensor<?x16xbf16>, tensor<?x6xbf16>) -> tensor<?x3xi32>
  return
}

// -----

func.func @moe_too_few_experts(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{experts_up_proj lists 1 weights, expected num_experts = 2}}
  %0 = hybrid.moe %x {num_experts = 2 : i64, top_k = 1 : i64, num_groups = 1 : i64, topk_groups = 1 : i64,
      score_function = #hybrid<score_function sigmoid>, renormalize = true, routed_scaling_factor = 1.0 : f64,
      intermediate_size = 8 : i64, num_shared_experts = 0 : i64,
      router = #hybrid.weight<"moe.gate" : tensor<2x16xbf16>>,
      experts_gate_proj = [#hybrid.weight<"e0.gate" : tensor<8x16xbf16>>, #hybrid.weight<"e1.gate" : tensor<8x16xbf16>>],
      experts_up_proj = [#hybrid.weight<"e0.up" : tensor<8x16xbf16>>],
      experts_down_proj = [#hybrid.weight<"e0.down" : tensor<16x8xbf16>>, #hybrid.weight<"e1.down" : tensor<16x8xbf16>>]} : tensor<?x16xbf16>
  return
}

// -----

func.func @moe_top_k_beyond_groups(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{top_k = 2 exceeds the 1 experts in the topk_groups = 1 eligible groups}}
  %0 = hybrid.moe %x {num_experts = 2 : i64, top_k = 2 : i64, num_groups = 2 : i64, topk_groups = 1 : i64,
      score_function = #hybrid<score_function sigmoid>, renormalize = true, routed_scaling_factor = 1.0 : f64,
      intermediate_size = 8 : i64, num_shared_experts = 0 : i64,
      router = #hybrid.weight<"moe.gate" : tensor<2x16xbf16>>,
      experts_gate_proj = [#hybrid.weight<"e0.gate" : tensor<8x16xbf16>>, #hybrid.weight<"e1.gate" : tensor<8x16xbf16>>],
      experts_up_proj = [#hybrid.weight<"e0.up" : tensor<8x16xbf16>>, #hybrid.weight<"e1.up" : tensor<8x16xbf16>>],
      experts_down_proj = [#hybrid.weight<"e0.down" : tensor<16x8xbf16>>, #hybrid.weight<"e1.down" : tensor<16x8xbf16>>]} : tensor<?x16xbf16>
  return
}

// -----

func.func @moe_wrong_expert_down(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{experts_down_proj weight 'e1.down' has shape [16, 4], expected [16, 8] (hidden = 16, intermediate_size = 8)}}
  %0 = hybrid.moe %x {num_experts = 2 : i64, top_k = 1 : i64, num_groups = 1 : i64, topk_groups = 1 : i64,
      score_function = #hybrid<score_function softmax>, renormalize = false, routed_scaling_factor = 1.0 : f64,
      intermediate_size = 8 : i64, num_shared_experts = 0 : i64,
      router = #hybrid.weight<"moe.gate" : tensor<2x16xbf16>>,
      experts_gate_proj = [#hybrid.weight<"e0.gate" : tensor<8x16xbf16>>, #hybrid.weight<"e1.gate" : tensor<8x16xbf16>>],
      experts_up_proj = [#hybrid.weight<"e0.up" : tensor<8x16xbf16>>, #hybrid.weight<"e1.up" : tensor<8x16xbf16>>],
      experts_down_proj = [#hybrid.weight<"e0.down" : tensor<16x8xbf16>>, #hybrid.weight<"e1.down" : tensor<16x4xbf16>>]} : tensor<?x16xbf16>
  return
}

// -----

func.func @moe_shared_missing(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{num_shared_experts = 1 requires shared_gate_proj, shared_up_proj and shared_down_proj}}
  %0 = hybrid.moe %x {num_experts = 1 : i64, top_k = 1 : i64, num_groups = 1 : i64, topk_groups = 1 : i64,
      score_function = #hybrid<score_function sigmoid>, renormalize = true, routed_scaling_factor = 1.0 : f64,
      intermediate_size = 8 : i64, num_shared_experts = 1 : i64,
      router = #hybrid.weight<"moe.gate" : tensor<1x16xbf16>>,
      experts_gate_proj = [#hybrid.weight<"e0.gate" : tensor<8x16xbf16>>],
      experts_up_proj = [#hybrid.weight<"e0.up" : tensor<8x16xbf16>>],
      experts_down_proj = [#hybrid.weight<"e0.down" : tensor<16x8xbf16>>]} : tensor<?x16xbf16>
  return
}

// -----

func.func @mlp_wrong_down(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{down_proj weight 'mlp.down' has shape [8, 16], expected [16, 8] (hidden = 16, intermediate = 8)}}
  %0 = hybrid.mlp %x {activation = #hybrid<activation silu>,
      gate_proj = #hybrid.weight<"mlp.gate" : tensor<8x16xbf16>>,
      up_proj = #hybrid.weight<"mlp.up" : tensor<8x16xbf16>>,
      down_proj = #hybrid.weight<"mlp.down" : tensor<8x16xbf16>>} : tensor<?x16xbf16>
  return
}

// -----

func.func @attn_res_wrong_proj(%x: tensor<?x16xbf16>, %b: tensor<?x16xbf16>) {
  // expected-error @+1 {{proj weight 'ar.proj' has shape [16], expected [1, 16] (hidden = 16)}}
  %0 = hybrid.attn_res %x over (%b : tensor<?x16xbf16>) {block_size = 2 : i64, epsilon = 1.0e-5 : f64,
      norm = #hybrid.weight<"ar.norm" : tensor<16xbf16>>, proj = #hybrid.weight<"ar.proj" : tensor<16xbf16>>} : tensor<?x16xbf16>
  return
}

// -----

func.func @attn_res_block_type(%x: tensor<?x16xbf16>, %b: tensor<?x16xf32>) {
  // expected-error @+1 {{block 0 has type 'tensor<?x16xf32>' but the partial sum has type 'tensor<?x16xbf16>'}}
  %0 = hybrid.attn_res %x over (%b : tensor<?x16xf32>) {block_size = 2 : i64, epsilon = 1.0e-5 : f64,
      norm = #hybrid.weight<"ar.norm" : tensor<16xbf16>>, proj = #hybrid.weight<"ar.proj" : tensor<1x16xbf16>>} : tensor<?x16xbf16>
  return
}

// -----

func.func @rms_norm_wrong_weight(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{weight weight 'norm' has shape [8], expected [16] (hidden = 16)}}
  %0 = hybrid.rms_norm %x {weight = #hybrid.weight<"norm" : tensor<8xbf16>>, epsilon = 1.0e-5 : f64} : tensor<?x16xbf16>
  return
}

// -----

func.func @fp8_weight_without_scale(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{fp8 weight 'w' needs its block scale tensor (weight_scale_inv)}}
  %0 = hybrid.linear %x {weight = #hybrid.weight<"w" : tensor<8x16xf8E4M3FN>>} : tensor<?x16xbf16> -> tensor<?x8xbf16>
  return
}

// -----

func.func @weight_with_integer_dtype(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{weight 'w' has unsupported dtype 'i64' (expected bf16, f16, f32 or f8E4M3FN)}}
  %0 = hybrid.linear %x {weight = #hybrid.weight<"w" : tensor<8x16xi64>>} : tensor<?x16xbf16> -> tensor<?x8xbf16>
  return
}

// -----

func.func @linear_dynamic_features(%x: tensor<?x?xbf16>) {
  // expected-error @+1 {{input must have a static feature dimension, got 'tensor<?x?xbf16>'}}
  %0 = hybrid.linear %x {weight = #hybrid.weight<"w" : tensor<8x16xbf16>>} : tensor<?x?xbf16> -> tensor<?x8xbf16>
  return
}

// -----

// expected-error @+1 {{returns logits of width 16 but vocab_size = 32}}
hybrid.model @bad_vocab attributes {model_type = "test", hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i64} {
^bb0(%ids: tensor<?xi64>):
  %h = hybrid.embed %ids {weight = #hybrid.weight<"embed" : tensor<16x16xbf16>>} : tensor<?xi64> -> tensor<?x16xbf16>
  %logits = hybrid.lm_head %h {weight = #hybrid.weight<"head" : tensor<16x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x16xf32>
  hybrid.return %logits : tensor<?x16xf32>
}

// -----

// expected-error @+1 {{body must take exactly one argument of type tensor<?xi64> (token ids)}}
hybrid.model @bad_input attributes {model_type = "test", hidden_size = 16 : i64, vocab_size = 16 : i64, num_layers = 1 : i64} {
^bb0(%ids: tensor<?xi64>, %positions: tensor<?xi64>):
  %h = hybrid.embed %ids {weight = #hybrid.weight<"embed" : tensor<16x16xbf16>>} : tensor<?xi64> -> tensor<?x16xbf16>
  %logits = hybrid.lm_head %h {weight = #hybrid.weight<"head" : tensor<16x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x16xf32>
  hybrid.return %logits : tensor<?x16xf32>
}

// -----

func.func @mtp_input_eh_proj_not_twice_hidden(%e: tensor<?x16xbf16>, %h: tensor<?x16xf32>) {
  // expected-error @+1 {{eh_proj weight 'mtp.eh_proj' has shape [16, 16], expected [16, 32] (hidden = 16: [hidden, 2 * hidden])}}
  %0 = hybrid.mtp_input %e, %h {epsilon = 1.0e-6 : f64,
      enorm = #hybrid.weight<"mtp.enorm" : tensor<16xbf16>>,
      hnorm = #hybrid.weight<"mtp.hnorm" : tensor<16xbf16>>,
      eh_proj = #hybrid.weight<"mtp.eh_proj" : tensor<16x16xbf16>>}
      : tensor<?x16xbf16>, tensor<?x16xf32> -> tensor<?x16xbf16>
  return
}

// -----

func.func @situ_without_beta(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{the situ activation requires a positive situ_beta}}
  %0 = hybrid.mlp %x {activation = #hybrid<activation situ>,
      gate_proj = #hybrid.weight<"mlp.gate_proj" : tensor<8x16xbf16>>,
      up_proj = #hybrid.weight<"mlp.up_proj" : tensor<8x16xbf16>>,
      down_proj = #hybrid.weight<"mlp.down_proj" : tensor<16x8xbf16>>} : tensor<?x16xbf16>
  return
}

// -----

func.func @silu_with_beta(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{situ_beta and situ_linear_beta are only meaningful with the situ activation}}
  %0 = hybrid.mlp %x {activation = #hybrid<activation silu>, situ_beta = 4.0 : f64,
      gate_proj = #hybrid.weight<"mlp.gate_proj" : tensor<8x16xbf16>>,
      up_proj = #hybrid.weight<"mlp.up_proj" : tensor<8x16xbf16>>,
      down_proj = #hybrid.weight<"mlp.down_proj" : tensor<16x8xbf16>>} : tensor<?x16xbf16>
  return
}

// -----

func.func @latent_moe_without_up(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{latent MoE needs both routed_expert_down_proj and routed_expert_up_proj}}
  %0 = hybrid.moe %x {num_experts = 2 : i64, top_k = 1 : i64, num_groups = 1 : i64, topk_groups = 1 : i64,
      score_function = #hybrid<score_function sigmoid>, renormalize = true, routed_scaling_factor = 1.0 : f64,
      intermediate_size = 4 : i64, num_shared_experts = 0 : i64,
      router = #hybrid.weight<"moe.gate" : tensor<2x16xbf16>>,
      experts_gate_proj = [#hybrid.weight<"moe.e0.gate" : tensor<4x8xbf16>>, #hybrid.weight<"moe.e1.gate" : tensor<4x8xbf16>>],
      experts_up_proj = [#hybrid.weight<"moe.e0.up" : tensor<4x8xbf16>>, #hybrid.weight<"moe.e1.up" : tensor<4x8xbf16>>],
      experts_down_proj = [#hybrid.weight<"moe.e0.down" : tensor<8x4xbf16>>, #hybrid.weight<"moe.e1.down" : tensor<8x4xbf16>>],
      routed_expert_down_proj = #hybrid.weight<"moe.latent_down" : tensor<8x16xbf16>>} : tensor<?x16xbf16>
  return
}

// -----

func.func @latent_moe_experts_at_full_width(%x: tensor<?x16xbf16>) {
  // expected-error @+1 {{experts_gate_proj weight 'moe.e0.gate' has shape [4, 16], expected [4, 8]}}
  %0 = hybrid.moe %x {num_experts = 2 : i64, top_k = 1 : i64, num_groups = 1 : i64, topk_groups = 1 : i64,
      score_function = #hybrid<score_function sigmoid>, renormalize = true, routed_scaling_factor = 1.0 : f64,
      intermediate_size = 4 : i64, num_shared_experts = 0 : i64,
      router = #hybrid.weight<"moe.gate" : tensor<2x16xbf16>>,
      experts_gate_proj = [#hybrid.weight<"moe.e0.gate" : tensor<4x16xbf16>>, #hybrid.weight<"moe.e1.gate" : tensor<4x16xbf16>>],
      experts_up_proj = [#hybrid.weight<"moe.e0.up" : tensor<4x16xbf16>>, #hybrid.weight<"moe.e1.up" : tensor<4x16xbf16>>],
      experts_down_proj = [#hybrid.weight<"moe.e0.down" : tensor<16x4xbf16>>, #hybrid.weight<"moe.e1.down" : tensor<16x4xbf16>>],
      routed_expert_down_proj = #hybrid.weight<"moe.latent_down" : tensor<8x16xbf16>>,
      routed_expert_up_proj = #hybrid.weight<"moe.latent_up" : tensor<16x8xbf16>>} : tensor<?x16xbf16>
  return
}
