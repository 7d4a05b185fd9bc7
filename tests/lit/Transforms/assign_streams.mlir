// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-assign-streams | FileCheck %s
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-assign-streams=max-streams=1 | FileCheck %s --check-prefix=ONE
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-assign-streams --hybrid-plan-memory --hybrid-verify-plan-contract -o /dev/null
// RUN: not hybrid-opt %s --hybrid-lower-to-plan --hybrid-assign-streams=max-streams=0 -o /dev/null 2>&1 | FileCheck %s --check-prefix=ZERO

// A DeepSeek-style layer: the indexer's query, key and head-weight prologs are independent and
// take three streams, joined by events before the fused scoring; the shared expert overlaps the
// routed experts on a second stream.

hybrid.model @dsa attributes {model_type = "test", hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i64} {
^bb0(%ids: tensor<?xi64>):
  %h = hybrid.embed %ids {weight = #hybrid.weight<"embed" : tensor<32x16xbf16>>} : tensor<?xi64> -> tensor<?x16xbf16> loc("model.embed_tokens")
  %x = hybrid.rms_norm %h {weight = #hybrid.weight<"norm" : tensor<16xbf16>>, epsilon = 1.0e-6 : f64} : tensor<?x16xbf16> loc("model.layers.0.input_layernorm")
  %qa = hybrid.linear %x {weight = #hybrid.weight<"q_a" : tensor<6x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x6xbf16> loc("model.layers.0.self_attn")
  %qn = hybrid.rms_norm %qa {weight = #hybrid.weight<"q_a_norm" : tensor<6xbf16>>, epsilon = 1.0e-6 : f64} : tensor<?x6xbf16> loc("model.layers.0.self_attn")
  %idx = hybrid.dsa_indexer %x, %qn {index_heads = 2 : i64, index_head_dim = 4 : i64, top_k = 3 : i64,
      rope_head_dim = 2 : i64, rope = #hybrid.rope<kind = plain, pairing = half_split>, norm_epsilon = 1.0e-6 : f64,
      wq_b = #hybrid.weight<"wq_b" : tensor<8x6xbf16>>, wk = #hybrid.weight<"wk" : tensor<4x16xbf16>>,
      k_norm = #hybrid.weight<"k_norm" : tensor<4xbf16>>, k_norm_bias = #hybrid.weight<"k_norm_bias" : tensor<4xbf16>>,
      weights_proj = #hybrid.weight<"weights_proj" : tensor<2x16xbf16>>} : (tensor<?x16xbf16>, tensor<?x6xbf16>) -> tensor<?x3xi32> loc("model.layers.0.self_attn.indexer")
  %a = hybrid.sparse_mla %x, %idx, %qn {num_heads = 2 : i64, q_lora_rank = 6 : i64, kv_lora_rank = 8 : i64,
      qk_nope_head_dim = 4 : i64, qk_rope_head_dim = 2 : i64, v_head_dim = 4 : i64, rope = #hybrid.rope<kind = plain>,
      softmax_scale = 0.4 : f64, latent_norm_epsilon = 1.0e-6 : f64,
      q_b_proj = #hybrid.weight<"q_b" : tensor<12x6xbf16>>, kv_a_proj_with_mqa = #hybrid.weight<"kv_a" : tensor<10x16xbf16>>,
      kv_a_layernorm = #hybrid.weight<"kv_a_norm" : tensor<8xbf16>>, kv_b_proj = #hybrid.weight<"kv_b" : tensor<16x8xbf16>>,
      o_proj = #hybrid.weight<"o" : tensor<16x8xbf16>>} : (tensor<?x16xbf16>, tensor<?x3xi32>, tensor<?x6xbf16>) -> tensor<?x16xbf16> loc("model.layers.0.self_attn")
  %h1 = hybrid.add %h, %a : tensor<?x16xbf16> loc("model.layers.0.attn_residual")
  %m = hybrid.moe %h1 {num_experts = 2 : i64, top_k = 1 : i64, num_groups = 1 : i64, topk_groups = 1 : i64,
      score_function = #hybrid<score_function sigmoid>, renormalize = true, routed_scaling_factor = 1.0 : f64,
      intermediate_size = 8 : i64, num_shared_experts = 1 : i64, router = #hybrid.weight<"router" : tensor<2x16xbf16>>,
      experts_gate_proj = [#hybrid.weight<"e0.g" : tensor<8x16xbf16>>, #hybrid.weight<"e1.g" : tensor<8x16xbf16>>],
      experts_up_proj = [#hybrid.weight<"e0.u" : tensor<8x16xbf16>>, #hybrid.weight<"e1.u" : tensor<8x16xbf16>>],
      experts_down_proj = [#hybrid.weight<"e0.d" : tensor<16x8xbf16>>, #hybrid.weight<"e1.d" : tensor<16x8xbf16>>],
      shared_gate_proj = #hybrid.weight<"s.g" : tensor<8x16xbf16>>, shared_up_proj = #hybrid.weight<"s.u" : tensor<8x16xbf16>>,
      shared_down_proj = #hybrid.weight<"s.d" : tensor<16x8xbf16>>} : tensor<?x16xbf16> loc("model.layers.0.moe")
  %h2 = hybrid.add %h1, %m : tensor<?x16xbf16> loc("model.layers.0.mlp_residual")
  %f = hybrid.rms_norm %h2 {weight = #hybrid.weight<"final" : tensor<16xbf16>>, epsilon = 1.0e-6 : f64} : tensor<?x16xbf16> loc("model.norm")
  %logits = hybrid.lm_head %f {weight = #hybrid.weight<"head" : tensor<32x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x32xf32> loc("lm_head")
  hybrid.return %logits : tensor<?x32xf32>
}

// CHECK: plan.program "prefill" attributes {{{.*}}num_events = [[EVENTS:[0-9]+]] : i32, num_streams = 3 : i32
// CHECK: plan.dispatch embed [0] -> [1] {{.*}}stream = 0 : i32}
// The normed input x is read by the key and head-weight prologs on other streams: it signals.
// CHECK-NEXT: plan.dispatch rms_norm [1] -> [2] {{.*}}signal_event = [[X:[0-9]+]] : i32, stream = 0 : i32}
// CHECK-NEXT: plan.dispatch linear [2] -> [3] {{.*}}stream = 0 : i32}
// CHECK-NEXT: plan.dispatch rms_norm [3] -> [4] {{.*}}stream = 0 : i32}
// Query prolog (stream 0), key prolog (stream 1), head weights (stream 2).
// CHECK-NEXT: plan.dispatch indexer_query [4] -> [5] {{.*}}stream = 0 : i32}
// CHECK-NEXT: plan.dispatch indexer_key [2] -> [6] {{.*}}signal_event = [[K:[0-9]+]] : i32, stream = 1 : i32, wait_events = array<i32: [[X]]>}
// CHECK-NEXT: plan.dispatch linear [2] -> [7] {{.*}}signal_event = [[W:[0-9]+]] : i32, stream = 2 : i32, wait_events = array<i32: [[X]]>}
// The fused scoring joins the three.
// CHECK-NEXT: plan.dispatch dsa_indexer [5, 6, 7] -> [8] {{.*}}stream = 0 : i32, wait_events = array<i32: [[K]], [[W]]>}
// CHECK-NEXT: plan.dispatch sparse_mla_prefill [2, 8, 4] -> [9]
// CHECK-NEXT: plan.dispatch add [1, 9] -> [10] {{.*}}signal_event = [[H1:[0-9]+]] : i32, stream = 0 : i32}
// Routed experts on stream 0, the shared expert on stream 1, joined by the sum.
// CHECK-NEXT: plan.dispatch router_topk [10] -> [11, 12] {{.*}}stream = 0 : i32}
// CHECK-NEXT: plan.dispatch moe_experts [10, 11, 12] -> [14] {{.*}}stream = 0 : i32}
// CHECK-NEXT: plan.dispatch mlp [10] -> [15] {{.*}}signal_event = [[SHARED:[0-9]+]] : i32, stream = 1 : i32, wait_events = array<i32: [[H1]]>}
// CHECK-NEXT: plan.dispatch add [14, 15] -> [13] {{.*}}stream = 0 : i32, wait_events = array<i32: [[SHARED]]>}

// One stream: everything in program order, no events.
// ONE: plan.program "prefill" attributes {{{.*}}num_events = 0 : i32, num_streams = 1 : i32
// ONE-NOT: wait_events = array<i32: {{[0-9]}}

// ZERO: error: max-streams must be at least 1, got 0
