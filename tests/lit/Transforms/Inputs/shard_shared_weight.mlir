// Input of shard.mlir: an MLP's gate projection also read whole by a linear layer.
hybrid.model @shared attributes {model_type = "test", hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i64} {
^bb0(%ids: tensor<?xi64>):
  %h = hybrid.embed %ids {weight = #hybrid.weight<"embed" : tensor<32x16xbf16>>} : tensor<?xi64> -> tensor<?x16xbf16> loc("model.embed_tokens")
  %m = hybrid.mlp %h {activation = #hybrid<activation silu>,
      gate_proj = #hybrid.weight<"mlp.gate" : tensor<16x16xbf16>>,
      up_proj = #hybrid.weight<"mlp.up" : tensor<16x16xbf16>>,
      down_proj = #hybrid.weight<"mlp.down" : tensor<16x16xbf16>>} : tensor<?x16xbf16> loc("model.layers.0.mlp")
  %p = hybrid.linear %m {weight = #hybrid.weight<"mlp.gate" : tensor<16x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x16xbf16> loc("model.layers.0.probe")
  %logits = hybrid.lm_head %p {weight = #hybrid.weight<"lm_head" : tensor<32x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x32xf32> loc("lm_head")
  hybrid.return %logits : tensor<?x32xf32>
}
