// RUN: hybrid-opt %s --hybrid-lower-to-plan | FileCheck %s
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-plan-memory --hybrid-verify-plan-contract | hybrid-opt --hybrid-verify-plan-contract | FileCheck %s --check-prefix=PLANNED
// RUN: hybrid-opt %s --hybrid-lower-to-plan="prefill-tokens=8 device=cuda arch=sm_90a" | FileCheck %s --check-prefix=CUDA

// A two-layer model (KDA + dense MLP, MLA + MoE) lowers to weights at page-aligned archive
// offsets, cache specs, and prefill/decode programs whose values live in a liveness-planned arena.

hybrid.model @tiny attributes {model_type = "test", hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 2 : i64} {
^bb0(%ids: tensor<?xi64>):
  %h = hybrid.embed %ids {weight = #hybrid.weight<"embed" : tensor<32x16xbf16>>} : tensor<?xi64> -> tensor<?x16xbf16> loc("model.embed_tokens")
  %x0 = hybrid.rms_norm %h {weight = #hybrid.weight<"l0.norm" : tensor<16xbf16>>, epsilon = 1.0e-5 : f64} : tensor<?x16xbf16> loc("model.layers.0.input_layernorm")
  %a0 = hybrid.kda %x0 {num_heads = 2 : i64, head_dim = 4 : i64, conv_kernel = 4 : i64,
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
      o_proj = #hybrid.weight<"kda.o_proj" : tensor<16x8xbf16>>} : tensor<?x16xbf16> loc("model.layers.0.self_attn")
  %h1 = hybrid.add %h, %a0 : tensor<?x16xbf16> loc("model.layers.0.attn_residual")
  %m0 = hybrid.mlp %h1 {activation = #hybrid<activation silu>,
      gate_proj = #hybrid.weight<"mlp.gate" : tensor<8x16xbf16>>,
      up_proj = #hybrid.weight<"mlp.up" : tensor<8x16xbf16>>,
      down_proj = #hybrid.weight<"mlp.down" : tensor<16x8xbf16>>} : tensor<?x16xbf16> loc("model.layers.0.mlp")
  %h2 = hybrid.add %h1, %m0 : tensor<?x16xbf16> loc("model.layers.0.mlp_residual")
  %a1 = hybrid.mla %h2 {num_heads = 2 : i64, kv_lora_rank = 8 : i64, qk_nope_head_dim = 4 : i64,
      qk_rope_head_dim = 2 : i64, v_head_dim = 4 : i64, rope = #hybrid.rope<kind = none>,
      softmax_scale = 0.408 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_proj = #hybrid.weight<"mla.q_proj" : tensor<12x16xbf16>>,
      kv_a_proj_with_mqa = #hybrid.weight<"mla.kv_a" : tensor<10x16xbf16>>,
      kv_a_layernorm = #hybrid.weight<"mla.kv_a_ln" : tensor<8xbf16>>,
      kv_b_proj = #hybrid.weight<"mla.kv_b" : tensor<16x8xbf16>>,
      o_proj = #hybrid.weight<"mla.o_proj" : tensor<16x8xbf16>>} : (tensor<?x16xbf16>) -> tensor<?x16xbf16> loc("model.layers.1.self_attn")
  %h3 = hybrid.add %h2, %a1 : tensor<?x16xbf16> loc("model.layers.1.attn_residual")
  %m1 = hybrid.moe %h3 {num_experts = 2 : i64, top_k = 1 : i64, num_groups = 1 : i64, topk_groups = 1 : i64,
      score_function = #hybrid<score_function sigmoid>, renormalize = true, routed_scaling_factor = 2.5 : f64,
      intermediate_size = 8 : i64, num_shared_experts = 0 : i64,
      router = #hybrid.weight<"moe.gate" : tensor<2x16xbf16>>,
      experts_gate_proj = [#hybrid.weight<"e0.gate" : tensor<8x16xf8E4M3FN>, scale "e0.gate_scale_inv" : tensor<1x1xf32>>, #hybrid.weight<"e1.gate" : tensor<8x16xbf16>>],
      experts_up_proj = [#hybrid.weight<"e0.up" : tensor<8x16xbf16>>, #hybrid.weight<"e1.up" : tensor<8x16xbf16>>],
      experts_down_proj = [#hybrid.weight<"e0.down" : tensor<16x8xbf16>>, #hybrid.weight<"e1.down" : tensor<16x8xbf16>>]} : tensor<?x16xbf16> loc("model.layers.1.moe")
  %h4 = hybrid.add %h3, %m1 : tensor<?x16xbf16> loc("model.layers.1.mlp_residual")
  %f = hybrid.rms_norm %h4 {weight = #hybrid.weight<"final.norm" : tensor<16xbf16>>, epsilon = 1.0e-5 : f64} : tensor<?x16xbf16> loc("model.norm")
  %logits = hybrid.lm_head %f {weight = #hybrid.weight<"lm_head" : tensor<32x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x32xf32> loc("lm_head")
  hybrid.return %logits : tensor<?x32xf32>
}

// CHECK-LABEL: plan.plan @tiny attributes
// CHECK-SAME: device = "cpu"
// CHECK-SAME: model_type = "test", num_layers = 2 : i32, page_size = 64 : i32, version = array<i32: 1, 5>
// Weights in first-use order, each page aligned; an fp8 weight's scale follows it.
// CHECK-NEXT: plan.weight "embed" : tensor<32x16xbf16> {offset = 4096 : i64, size = 1024 : i64}
// CHECK-NEXT: plan.weight "l0.norm" : tensor<16xbf16> {offset = 8192 : i64, size = 32 : i64}
// CHECK: plan.weight "e0.gate" : tensor<8x16xf8E4M3FN> {block = array<i32: 8, 16>, offset = {{[0-9]+}} : i64, scale = [[SCALE:[0-9]+]] : i32, size = 128 : i64}
// CHECK-NEXT: plan.weight "e0.gate_scale_inv" : tensor<1x1xf32>
// CHECK: plan.kv_cache_layer {dtype = f32, index_key_dim = 0 : i32, latent_dim = 8 : i32, layer = 1 : i32, rope_dim = 2 : i32}
// CHECK-NEXT: plan.recurrent_state_layer {conv_channels = 24 : i32, conv_kernel = 4 : i32, head_k_dim = 4 : i32, head_v_dim = 4 : i32, layer = 0 : i32, num_heads = 2 : i32, v_major = false}

// Arena offsets are left to --hybrid-plan-memory.
// CHECK: plan.program "prefill" attributes {arena_bytes = 0 : i64, layer_outputs = array<i32: 1, 6, 12, 13>, logits = 14 : i32, max_tokens = 4096 : i64, num_events = 0 : i32, num_streams = 1 : i32, token_ids = 0 : i32}
// CHECK-NEXT: plan.value i64 x 1 {name = "input_ids", offset = -1 : i64}
// CHECK-NEXT: plan.value f32 x 16 {name = "model.embed_tokens", offset = -1 : i64}
// CHECK: plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
// CHECK-NEXT: plan.dispatch rms_norm [1] -> [2] weights [1] {layer = 0 : i32, params = {epsilon = 9.99999974E-6 : f32}, stream = 0 : i32}
// CHECK-NEXT: plan.dispatch kda_chunk_prefill [2] -> [3] weights [{{([0-9]+, )+}}-1, {{[0-9]+}}, {{[0-9]+}}]
// CHECK-SAME: params = {conv_kernel = 4 : i32, gate = "softplus", gate_lower_bound = 0.000000e+00 : f32, head_dim = 4 : i32, norm_epsilon = 9.99999974E-6 : f32, num_heads = 2 : i32, state_layout = "k_major", state_slot = 0 : i32}
// CHECK-NEXT: plan.dispatch add [1, 3] -> [4]
// CHECK-NEXT: plan.dispatch mlp [4] -> [5]
// CHECK-NEXT: plan.dispatch add [4, 5] -> [6]
// CHECK-NEXT: plan.dispatch mla_prefill [6] -> [7] weights [{{[0-9]+}}, -1, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, -1, {{[0-9]+}}] {layer = 1 : i32, params = {kv_lora_rank = 8 : i32, kv_slot = 0 : i32, latent_norm_epsilon = 9.99999997E-7 : f32, num_heads = 2 : i32, q_lora_rank = 0 : i32, qk_nope_head_dim = 4 : i32, qk_rope_head_dim = 2 : i32, rope = {beta_fast = 3.200000e+01 : f64, beta_slow = 1.000000e+00 : f64, factor = 1.000000e+00 : f64, kind = "none", mscale = 1.000000e+00 : f64, mscale_all_dim = 0.000000e+00 : f64, original_max_position = 0 : i64, pairing = "interleaved", theta = 1.000000e+04 : f64}, softmax_scale = 4.080000e-01 : f32, v_head_dim = 4 : i32}
// MoE: the router + grouped top-k writes expert ids and weights (no correction bias here), the
// routed experts read them (gate, up, down per expert); no shared expert in this layer.
// CHECK-NEXT: plan.dispatch add [6, 7] -> [8]
// CHECK-NEXT: plan.dispatch router_topk [8] -> [9, 10] weights [{{[0-9]+}}, -1]
// CHECK-NEXT: plan.dispatch moe_experts [8, 9, 10] -> [11] weights [{{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}]
// CHECK-NEXT: plan.dispatch add [8, 11] -> [12]
// CHECK-NEXT: plan.dispatch rms_norm [12] -> [13]
// CHECK-NEXT: plan.dispatch lm_head [13] -> [14]

// The decode program runs the recurrent kernels with a one-token arena.
// CHECK: plan.program "decode" attributes {{{.*}}max_tokens = 1 : i64
// CHECK: plan.dispatch kda_recurrent_decode [2] -> [3]
// CHECK: plan.dispatch mla_decode [6] -> [7]

// CUDA: plan.plan @tiny attributes {arch = "sm_90a"
// CUDA-SAME: device = "cuda"
// Activations are fp32 on the GPU too, for now: the cuda device runs what it has no kernel for
// with the cpu reference on the same values (docs/runtime.md).
// CUDA: plan.program "prefill" attributes {{{.*}}max_tokens = 8 : i64
// CUDA: plan.value f32 x 16

// With memory planned: the ids first, the embedding after them (4096 rows x 8 bytes), slots reused
// once dead, the logits last.
// PLANNED: plan.program "prefill" attributes {arena_bytes = 1048576 : i64
// PLANNED-NEXT: plan.value i64 x 1 {name = "input_ids", offset = 0 : i64}
// PLANNED-NEXT: plan.value f32 x 16 {name = "model.embed_tokens", offset = 32768 : i64}
// PLANNED-NEXT: plan.value f32 x 16 {name = "model.layers.0.input_layernorm", offset = 294912 : i64}
// PLANNED-NEXT: plan.value f32 x 16 {name = "model.layers.0.self_attn", offset = 557056 : i64}
// PLANNED-NEXT: plan.value f32 x 16 {name = "model.layers.0.attn_residual", offset = 294912 : i64}
