// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-annotate-quantization | FileCheck %s --check-prefix=DEFAULT
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-annotate-quantization=policy=none | FileCheck %s --check-prefix=NONE
// RUN: echo '{"indexer_qk": "none", "sparse_attention_kv_cache": "fp8_tiles", "kv_tile": 64, "projections": "bf16"}' > %t.kv-only.json
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-annotate-quantization=policy=%t.kv-only.json | FileCheck %s --check-prefix=KV-ONLY
// RUN: echo '{"dense_attention_kv_cache": "fp8_tiles"}' > %t.dense.json
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-annotate-quantization=policy=%t.dense.json | FileCheck %s --check-prefix=DENSE
// RUN: echo '{"indexer_qk": "fp8"}' > %t.fp8.json
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-annotate-quantization=policy=%t.fp8.json | FileCheck %s --check-prefix=FP8
// RUN: echo '{"indexer_qk": "int4"}' > %t.bad-value.json
// RUN: not hybrid-opt %s --hybrid-lower-to-plan --hybrid-annotate-quantization=policy=%t.bad-value.json 2>&1 | FileCheck %s --check-prefix=BAD-VALUE
// RUN: echo '{"weights": "fp8"}' > %t.bad-field.json
// RUN: not hybrid-opt %s --hybrid-lower-to-plan --hybrid-annotate-quantization=policy=%t.bad-field.json 2>&1 | FileCheck %s --check-prefix=BAD-FIELD
// RUN: not hybrid-opt %s --hybrid-lower-to-plan --hybrid-annotate-quantization=policy=%t.absent.json 2>&1 | FileCheck %s --check-prefix=ABSENT

// A DSA layer and a plain MLA layer: the default policy puts the indexer's query and key in
// MXFP8 and the sparse-attention (DSA) cache in FP8 tiles; the plain MLA cache stays full
// precision.

hybrid.model @mixed attributes {model_type = "test", hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 2 : i64} {
^bb0(%ids: tensor<?xi64>):
  %h = hybrid.embed %ids {weight = #hybrid.weight<"embed" : tensor<32x16xbf16>>} : tensor<?xi64> -> tensor<?x16xbf16> loc("model.embed_tokens")
  %x = hybrid.rms_norm %h {weight = #hybrid.weight<"norm" : tensor<16xbf16>>, epsilon = 1.0e-6 : f64} : tensor<?x16xbf16> loc("model.layers.0.input_layernorm")
  %qa = hybrid.linear %x {weight = #hybrid.weight<"q_a" : tensor<6x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x6xbf16> loc("model.layers.0.self_attn")
  %qn = hybrid.rms_norm %qa {weight = #hybrid.weight<"q_a_norm" : tensor<6xbf16>>, epsilon = 1.0e-6 : f64} : tensor<?x6xbf16> loc("model.layers.0.self_attn")
  %idx = hybrid.dsa_indexer %x, %qn {index_heads = 2 : i64, index_head_dim = 32 : i64, top_k = 3 : i64,
      rope_head_dim = 2 : i64, rope = #hybrid.rope<kind = plain, pairing = half_split>, norm_epsilon = 1.0e-6 : f64,
      wq_b = #hybrid.weight<"wq_b" : tensor<64x6xbf16>>, wk = #hybrid.weight<"wk" : tensor<32x16xbf16>>,
      k_norm = #hybrid.weight<"k_norm" : tensor<32xbf16>>, k_norm_bias = #hybrid.weight<"k_norm_bias" : tensor<32xbf16>>,
      weights_proj = #hybrid.weight<"weights_proj" : tensor<2x16xbf16>>} : (tensor<?x16xbf16>, tensor<?x6xbf16>) -> tensor<?x3xi32> loc("model.layers.0.self_attn.indexer")
  %a = hybrid.sparse_mla %x, %idx, %qn {num_heads = 2 : i64, q_lora_rank = 6 : i64, kv_lora_rank = 8 : i64,
      qk_nope_head_dim = 4 : i64, qk_rope_head_dim = 2 : i64, v_head_dim = 4 : i64, rope = #hybrid.rope<kind = plain>,
      softmax_scale = 0.4 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_b_proj = #hybrid.weight<"q_b" : tensor<12x6xbf16>>, kv_a_proj_with_mqa = #hybrid.weight<"kv_a" : tensor<10x16xbf16>>,
      kv_a_layernorm = #hybrid.weight<"kv_a_norm" : tensor<8xbf16>>, kv_b_proj = #hybrid.weight<"kv_b" : tensor<16x8xbf16>>,
      o_proj = #hybrid.weight<"o" : tensor<16x8xbf16>>} : (tensor<?x16xbf16>, tensor<?x3xi32>, tensor<?x6xbf16>) -> tensor<?x16xbf16> loc("model.layers.0.self_attn")
  %h1 = hybrid.add %h, %a : tensor<?x16xbf16> loc("model.layers.0.attn_residual")
  %b = hybrid.mla %h1 {num_heads = 2 : i64, kv_lora_rank = 8 : i64, qk_nope_head_dim = 4 : i64,
      qk_rope_head_dim = 2 : i64, v_head_dim = 4 : i64, rope = #hybrid.rope<kind = none>,
      softmax_scale = 0.4 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_proj = #hybrid.weight<"m.q" : tensor<12x16xbf16>>, kv_a_proj_with_mqa = #hybrid.weight<"m.kv_a" : tensor<10x16xbf16>>,
      kv_a_layernorm = #hybrid.weight<"m.kv_a_norm" : tensor<8xbf16>>, kv_b_proj = #hybrid.weight<"m.kv_b" : tensor<16x8xbf16>>,
      o_proj = #hybrid.weight<"m.o" : tensor<16x8xbf16>>} : (tensor<?x16xbf16>) -> tensor<?x16xbf16> loc("model.layers.1.self_attn")
  %h2 = hybrid.add %h1, %b : tensor<?x16xbf16> loc("model.layers.1.attn_residual")
  %logits = hybrid.lm_head %h2 {weight = #hybrid.weight<"head" : tensor<32x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x32xf32> loc("lm_head")
  hybrid.return %logits : tensor<?x32xf32>
}

// DEFAULT: plan.kv_cache_layer {dtype = f32, index_key_dim = 32 : i32, latent_dim = 8 : i32, layer = 0 : i32, quant = "fp8_tiles", rope_dim = 2 : i32}
// DEFAULT-NEXT: plan.kv_cache_layer {dtype = f32, index_key_dim = 0 : i32, latent_dim = 8 : i32, layer = 1 : i32, rope_dim = 2 : i32}
// DEFAULT: plan.dispatch indexer_query {{.*}}quantize = "mxfp8"
// DEFAULT: plan.dispatch indexer_key {{.*}}quantize = "mxfp8"

// NONE: plan.kv_cache_layer {dtype = f32, index_key_dim = 32 : i32, latent_dim = 8 : i32, layer = 0 : i32, rope_dim = 2 : i32}
// NONE-NOT: quantize = "mxfp8"

// KV-ONLY: plan.kv_cache_layer {dtype = f32, index_key_dim = 32 : i32, latent_dim = 8 : i32, layer = 0 : i32, quant = "fp8_tiles", quant_tile = 64 : i32, rope_dim = 2 : i32}
// KV-ONLY-NOT: quantize = "mxfp8"

// DENSE: plan.kv_cache_layer {dtype = f32, index_key_dim = 32 : i32, latent_dim = 8 : i32, layer = 0 : i32, quant = "fp8_tiles", rope_dim = 2 : i32}
// DENSE-NEXT: plan.kv_cache_layer {dtype = f32, index_key_dim = 0 : i32, latent_dim = 8 : i32, layer = 1 : i32, quant = "fp8_tiles", rope_dim = 2 : i32}

// FP8: plan.kv_cache_layer {dtype = f32, index_key_dim = 32 : i32, latent_dim = 8 : i32, layer = 0 : i32, quant = "fp8_tiles", rope_dim = 2 : i32}
// FP8: plan.dispatch indexer_query {{.*}}quantize = "fp8"
// FP8: plan.dispatch indexer_key {{.*}}quantize = "fp8"

// BAD-VALUE: error: quantization policy '{{.*}}bad-value.json': field 'indexer_qk' must be "mxfp8", "fp8" or "none"
// BAD-FIELD: error: quantization policy '{{.*}}bad-field.json': unknown field 'weights'
// ABSENT: error: quantization policy '{{.*}}absent.json': cannot read: No such file or directory
