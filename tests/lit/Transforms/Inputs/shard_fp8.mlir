// Input of shard.mlir: DeepSeek-V3.2's FP8 checkpoint layout at small widths. Every projection is
// FP8 E4M3 with one fp32 scale per 128x128 block (`weight_scale_inv`; the last block along an
// axis may be partial, as q_lora 96 is). Layer 0: MLA with 4 heads (q 64 + 64 rope, kv_b 64 + 64,
// v 64) and a dense MLP of 256 rows; layer 1: MLA and a MoE of 2 routed experts plus shared
// experts of 256 rows. At tp=2 every cut falls on a block boundary (2 heads: 256 query and kv_b
// rows, 128 o_proj columns; 128 MLP rows); at tp=4 one head's 64 o_proj columns cut a block.
hybrid.model @fp8 attributes {model_type = "test", hidden_size = 256 : i64, vocab_size = 32 : i64, num_layers = 2 : i64, fp8_activation_scale = "ue8m0", fp8_weight_block = array<i64: 128, 128>} {
^bb0(%ids: tensor<?xi64>):
  %h = hybrid.embed %ids {weight = #hybrid.weight<"embed" : tensor<32x256xbf16>>} : tensor<?xi64> -> tensor<?x256xbf16> loc("model.embed_tokens")
  %a0 = hybrid.mla %h {num_heads = 4 : i64, kv_lora_rank = 96 : i64, qk_nope_head_dim = 64 : i64,
      qk_rope_head_dim = 64 : i64, v_head_dim = 64 : i64, rope = #hybrid.rope<kind = none>,
      softmax_scale = 0.088 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_proj = #hybrid.weight<"l0.q_proj" : tensor<512x256xf8E4M3FN>, scale "l0.q_proj_scale_inv" : tensor<4x2xf32>>,
      kv_a_proj_with_mqa = #hybrid.weight<"l0.kv_a" : tensor<160x256xf8E4M3FN>, scale "l0.kv_a_scale_inv" : tensor<2x2xf32>>,
      kv_a_layernorm = #hybrid.weight<"l0.kv_a_ln" : tensor<96xbf16>>,
      kv_b_proj = #hybrid.weight<"l0.kv_b" : tensor<512x96xf8E4M3FN>, scale "l0.kv_b_scale_inv" : tensor<4x1xf32>>,
      o_proj = #hybrid.weight<"l0.o_proj" : tensor<256x256xf8E4M3FN>, scale "l0.o_proj_scale_inv" : tensor<2x2xf32>>} : (tensor<?x256xbf16>) -> tensor<?x256xbf16> loc("model.layers.0.self_attn")
  %h1 = hybrid.add %h, %a0 : tensor<?x256xbf16> loc("model.layers.0.attn_residual")
  %m0 = hybrid.mlp %h1 {activation = #hybrid<activation silu>,
      gate_proj = #hybrid.weight<"l0.gate" : tensor<256x256xf8E4M3FN>, scale "l0.gate_scale_inv" : tensor<2x2xf32>>,
      up_proj = #hybrid.weight<"l0.up" : tensor<256x256xf8E4M3FN>, scale "l0.up_scale_inv" : tensor<2x2xf32>>,
      down_proj = #hybrid.weight<"l0.down" : tensor<256x256xf8E4M3FN>, scale "l0.down_scale_inv" : tensor<2x2xf32>>} : tensor<?x256xbf16> loc("model.layers.0.mlp")
  %h2 = hybrid.add %h1, %m0 : tensor<?x256xbf16> loc("model.layers.0.mlp_residual")
  %m1 = hybrid.moe %h2 {num_experts = 2 : i64, top_k = 1 : i64, num_groups = 1 : i64, topk_groups = 1 : i64,
      score_function = #hybrid<score_function sigmoid>, renormalize = true, routed_scaling_factor = 2.5 : f64,
      intermediate_size = 128 : i64, num_shared_experts = 2 : i64,
      router = #hybrid.weight<"l1.router" : tensor<2x256xbf16>>,
      experts_gate_proj = [#hybrid.weight<"e0.gate" : tensor<128x256xf8E4M3FN>, scale "e0.gate_scale_inv" : tensor<1x2xf32>>, #hybrid.weight<"e1.gate" : tensor<128x256xf8E4M3FN>, scale "e1.gate_scale_inv" : tensor<1x2xf32>>],
      experts_up_proj = [#hybrid.weight<"e0.up" : tensor<128x256xf8E4M3FN>, scale "e0.up_scale_inv" : tensor<1x2xf32>>, #hybrid.weight<"e1.up" : tensor<128x256xf8E4M3FN>, scale "e1.up_scale_inv" : tensor<1x2xf32>>],
      experts_down_proj = [#hybrid.weight<"e0.down" : tensor<256x128xf8E4M3FN>, scale "e0.down_scale_inv" : tensor<2x1xf32>>, #hybrid.weight<"e1.down" : tensor<256x128xf8E4M3FN>, scale "e1.down_scale_inv" : tensor<2x1xf32>>],
      shared_gate_proj = #hybrid.weight<"l1.shared.gate" : tensor<256x256xf8E4M3FN>, scale "l1.shared.gate_scale_inv" : tensor<2x2xf32>>,
      shared_up_proj = #hybrid.weight<"l1.shared.up" : tensor<256x256xf8E4M3FN>, scale "l1.shared.up_scale_inv" : tensor<2x2xf32>>,
      shared_down_proj = #hybrid.weight<"l1.shared.down" : tensor<256x256xf8E4M3FN>, scale "l1.shared.down_scale_inv" : tensor<2x2xf32>>} : tensor<?x256xbf16> loc("model.layers.1.moe")
  %h3 = hybrid.add %h2, %m1 : tensor<?x256xbf16> loc("model.layers.1.mlp_residual")
  %logits = hybrid.lm_head %h3 {weight = #hybrid.weight<"lm_head" : tensor<32x256xbf16>>} : tensor<?x256xbf16> -> tensor<?x32xf32> loc("lm_head")
  hybrid.return %logits : tensor<?x32xf32>
}
