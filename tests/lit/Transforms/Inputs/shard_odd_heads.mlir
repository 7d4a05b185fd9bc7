// Input of shard.mlir: an MLA layer of three heads, which split over neither two ranks nor four.
hybrid.model @odd attributes {model_type = "test", hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i64} {
^bb0(%ids: tensor<?xi64>):
  %h = hybrid.embed %ids {weight = #hybrid.weight<"embed" : tensor<32x16xbf16>>} : tensor<?xi64> -> tensor<?x16xbf16> loc("model.embed_tokens")
  %a = hybrid.mla %h {num_heads = 3 : i64, kv_lora_rank = 8 : i64, qk_nope_head_dim = 4 : i64,
      qk_rope_head_dim = 2 : i64, v_head_dim = 4 : i64, rope = #hybrid.rope<kind = none>,
      softmax_scale = 0.408 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_proj = #hybrid.weight<"mla.q_proj" : tensor<18x16xbf16>>,
      kv_a_proj_with_mqa = #hybrid.weight<"mla.kv_a" : tensor<10x16xbf16>>,
      kv_a_layernorm = #hybrid.weight<"mla.kv_a_ln" : tensor<8xbf16>>,
      kv_b_proj = #hybrid.weight<"mla.kv_b" : tensor<24x8xbf16>>,
      o_proj = #hybrid.weight<"mla.o_proj" : tensor<16x12xbf16>>} : (tensor<?x16xbf16>) -> tensor<?x16xbf16> loc("model.layers.0.self_attn")
  %h1 = hybrid.add %h, %a : tensor<?x16xbf16> loc("model.layers.0.attn_residual")
  %logits = hybrid.lm_head %h1 {weight = #hybrid.weight<"lm_head" : tensor<32x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x32xf32> loc("lm_head")
  hybrid.return %logits : tensor<?x32xf32>
}
