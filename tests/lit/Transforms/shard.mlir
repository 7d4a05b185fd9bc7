// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-shard="tp=2 ep=2" | FileCheck %s
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-shard="tp=4" | FileCheck %s --check-prefix=TP4
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-shard="tp=2" --hybrid-fuse-super-kernels --hybrid-assign-streams --hybrid-plan-memory --hybrid-verify-plan-contract | FileCheck %s --check-prefix=PIPELINE
// RUN: not hybrid-opt %S/Inputs/shard_odd_heads.mlir --hybrid-lower-to-plan --hybrid-shard="tp=2" 2>&1 | FileCheck %s --check-prefix=HEADS
// RUN: not hybrid-opt %S/Inputs/shard_odd_heads.mlir --hybrid-lower-to-plan --hybrid-shard="tp=4" 2>&1 | FileCheck %s --check-prefix=HEADS4
// RUN: not hybrid-opt %S/Inputs/shard_shared_weight.mlir --hybrid-lower-to-plan --hybrid-shard="tp=2" 2>&1 | FileCheck %s --check-prefix=SHARED
// RUN: not hybrid-opt %s --hybrid-lower-to-plan --hybrid-shard="tp=2 ep=4" 2>&1 | FileCheck %s --check-prefix=EP
// RUN: not hybrid-opt %s --hybrid-lower-to-plan --hybrid-shard="cp=2 ep=3" 2>&1 | FileCheck %s --check-prefix=EPCP
// RUN: not hybrid-opt %s --hybrid-lower-to-plan --hybrid-shard="tp=2 cp=2 ep=4" 2>&1 | FileCheck %s --check-prefix=EPTPCP
// RUN: not hybrid-opt %s --hybrid-lower-to-plan --hybrid-shard="ep=2" 2>&1 | FileCheck %s --check-prefix=EPONE
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-shard="cp=2 ep=2" --hybrid-fuse-super-kernels --hybrid-assign-streams --hybrid-plan-memory --hybrid-verify-plan-contract | FileCheck %s --check-prefix=CPEP
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-shard="cp=2" | FileCheck %s --check-prefix=CP
// RUN: hybrid-opt %s --hybrid-lower-to-plan --hybrid-shard="tp=2 cp=2 ep=2" --hybrid-fuse-super-kernels --hybrid-assign-streams --hybrid-plan-memory --hybrid-verify-plan-contract | FileCheck %s --check-prefix=TPCP
// RUN: hybrid-opt %S/Inputs/shard_fp8.mlir --hybrid-lower-to-plan --hybrid-shard="tp=2 ep=2" | FileCheck %s --check-prefix=FP8
// RUN: hybrid-opt %S/Inputs/shard_fp8.mlir --hybrid-lower-to-plan --hybrid-shard="tp=2 ep=2" --hybrid-fuse-super-kernels --hybrid-assign-weight-layout --hybrid-assign-streams --hybrid-plan-memory --hybrid-verify-plan-contract | FileCheck %s --check-prefix=FP8PIPE
// RUN: not hybrid-opt %S/Inputs/shard_fp8.mlir --hybrid-lower-to-plan --hybrid-shard="tp=4" 2>&1 | FileCheck %s --check-prefix=FP8TP4

// The model of lower_to_plan.mlir (KDA + dense MLP, MLA + MoE; 2 heads each, intermediate 8,
// 2 experts), sharded: one plan per rank, per-head and per-column weight slices, an explicit
// all-reduce after each partial output, routed experts split by ep.

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
      experts_gate_proj = [#hybrid.weight<"e0.gate" : tensor<8x16xbf16>>, #hybrid.weight<"e1.gate" : tensor<8x16xbf16>>],
      experts_up_proj = [#hybrid.weight<"e0.up" : tensor<8x16xbf16>>, #hybrid.weight<"e1.up" : tensor<8x16xbf16>>],
      experts_down_proj = [#hybrid.weight<"e0.down" : tensor<16x8xbf16>>, #hybrid.weight<"e1.down" : tensor<16x8xbf16>>]} : tensor<?x16xbf16> loc("model.layers.1.moe")
  %h4 = hybrid.add %h3, %m1 : tensor<?x16xbf16> loc("model.layers.1.mlp_residual")
  %f = hybrid.rms_norm %h4 {weight = #hybrid.weight<"final.norm" : tensor<16xbf16>>, epsilon = 1.0e-5 : f64} : tensor<?x16xbf16> loc("model.norm")
  %logits = hybrid.lm_head %f {weight = #hybrid.weight<"lm_head" : tensor<32x16xbf16>>} : tensor<?x16xbf16> -> tensor<?x32xf32> loc("lm_head")
  hybrid.return %logits : tensor<?x32xf32>
}

// Rank 0 of tp=2, ep=2: head 0 of each attention layer, intermediate rows [0, 4), expert 0.
// CHECK-LABEL: plan.plan @tiny_rank0 attributes
// CHECK-SAME: expert_parallel = 2 : i32
// CHECK-SAME: rank = 0 : i32, tensor_parallel = 2 : i32
// CHECK-SAME: world_size = 2 : i32
// CHECK: plan.weight "kda.A_log" : tensor<1x1x1x1xf32> {{{.*}}slice = array<i64: 2, 0>}
// CHECK: plan.weight "kda.b_proj" : tensor<1x16xbf16> {{{.*}}slice = array<i64: 0, 0>}
// CHECK: plan.weight "kda.dt_bias" : tensor<4xf32> {{{.*}}slice = array<i64: 0, 0>}
// The low-rank gate input stays whole.
// CHECK: plan.weight "kda.f_a_proj" : tensor<4x16xbf16> {offset = {{[0-9]+}} : i64, size = 128 : i64}
// CHECK: plan.weight "kda.f_b_proj" : tensor<4x4xbf16> {{{.*}}slice = array<i64: 0, 0>}
// CHECK: plan.weight "kda.k_conv1d" : tensor<4x1x4xbf16> {{{.*}}slice = array<i64: 0, 0>}
// CHECK: plan.weight "kda.o_proj" : tensor<16x4xbf16> {{{.*}}slice = array<i64: 1, 0>}
// CHECK: plan.weight "mlp.down" : tensor<16x4xbf16> {{{.*}}slice = array<i64: 1, 0>}
// CHECK: plan.weight "mlp.gate" : tensor<4x16xbf16> {{{.*}}slice = array<i64: 0, 0>}
// The latent projection and its norm are shared by all heads.
// CHECK: plan.weight "mla.kv_a_ln" : tensor<8xbf16> {offset = {{[0-9]+}} : i64, size = 16 : i64}
// CHECK: plan.weight "mla.kv_a" : tensor<10x16xbf16> {offset = {{[0-9]+}} : i64, size = 320 : i64}
// CHECK: plan.weight "mla.kv_b" : tensor<8x8xbf16> {{{.*}}slice = array<i64: 0, 0>}
// CHECK: plan.weight "mla.o_proj" : tensor<16x4xbf16> {{{.*}}slice = array<i64: 1, 0>}
// CHECK: plan.weight "mla.q_proj" : tensor<6x16xbf16> {{{.*}}slice = array<i64: 0, 0>}
// CHECK: plan.weight "e0.down"
// CHECK-NOT: plan.weight "e1.
// CHECK: plan.recurrent_state_layer {conv_channels = 12 : i32, {{.*}}num_heads = 1 : i32
// CHECK-LABEL: plan.program "prefill"
// CHECK-DAG: plan.value f32 x 16 {name = "model.layers.0.self_attn.sum", offset = -1 : i64}
// CHECK-DAG: plan.value f32 x 16 {name = "model.layers.1.moe.sum", offset = -1 : i64}
// CHECK: plan.dispatch  kda_chunk_prefill [2] -> [3] {{.*}}num_heads = 1 : i32
// CHECK-NEXT: plan.dispatch  all_reduce_sum [3] -> {{\[}}[[KDA:[0-9]+]]] weights [] {layer = 0 : i32, params = {group = "tensor_parallel"}
// CHECK-NEXT: plan.dispatch  add [1, [[KDA]]] -> [4]
// CHECK-NEXT: plan.dispatch  mlp [4] -> [5]
// CHECK-NEXT: plan.dispatch  all_reduce_sum [5] -> {{\[}}[[MLP:[0-9]+]]] weights [] {layer = 0 : i32, params = {group = "tensor_parallel"}
// CHECK-NEXT: plan.dispatch  add [4, [[MLP]]] -> [6]
// CHECK-NEXT: plan.dispatch  mla_prefill [6] -> [7] {{.*}}num_heads = 1 : i32
// CHECK-NEXT: plan.dispatch  all_reduce_sum [7] -> {{\[}}[[MLA:[0-9]+]]]
// CHECK-NEXT: plan.dispatch  add [6, [[MLA]]] -> [8]
// CHECK-NEXT: plan.dispatch  router_topk
// Expert 1 lives on rank 1: its weights are absent here.
// CHECK-NEXT: plan.dispatch  moe_experts [8, 9, 10] -> [11] weights [{{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, -1, -1, -1]
// CHECK-NEXT: plan.dispatch  all_reduce_sum [11] -> {{\[}}[[MOE:[0-9]+]]] weights [] {layer = 1 : i32, params = {group = "expert_parallel"}
// CHECK-NEXT: plan.dispatch  add [8, [[MOE]]] -> [12]
// CHECK-LABEL: plan.program "decode"
// CHECK: plan.dispatch  kda_recurrent_decode [2] -> [3] {{.*}}num_heads = 1 : i32
// CHECK-NEXT: plan.dispatch  all_reduce_sum [3]

// Rank 1: head 1, rows [4, 8), expert 1.
// CHECK-LABEL: plan.plan @tiny_rank1 attributes
// CHECK-SAME: rank = 1 : i32
// CHECK: plan.weight "kda.A_log" : tensor<1x1x1x1xf32> {{{.*}}slice = array<i64: 2, 1>}
// CHECK: plan.weight "kda.dt_bias" : tensor<4xf32> {{{.*}}slice = array<i64: 0, 4>}
// CHECK: plan.weight "kda.o_proj" : tensor<16x4xbf16> {{{.*}}slice = array<i64: 1, 4>}
// CHECK: plan.weight "mlp.down" : tensor<16x4xbf16> {{{.*}}slice = array<i64: 1, 4>}
// CHECK: plan.weight "mla.kv_b" : tensor<8x8xbf16> {{{.*}}slice = array<i64: 0, 8>}
// CHECK: plan.weight "mla.q_proj" : tensor<6x16xbf16> {{{.*}}slice = array<i64: 0, 6>}
// CHECK-NOT: plan.weight "e0.
// CHECK: plan.weight "e1.down"
// CHECK: plan.dispatch  moe_experts [8, 9, 10] -> [11] weights [-1, -1, -1, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}]
// CHECK-NOT: plan.plan @tiny {

// tp=4 over 2 heads: each head runs on 2 ranks and only the first adds its part. Rank 1 holds
// no head: its attention layers (and the norm that only fed KDA) are gone, the all-reduces add
// zeros, and none of their weights stay in its plan. The MLP still splits 4 ways.
// TP4-LABEL: plan.plan @tiny_rank0 attributes
// TP4: plan.dispatch  kda_chunk_prefill [2] -> [3]
// TP4-NEXT: plan.dispatch  all_reduce_sum [3] -> [15]
// TP4-LABEL: plan.plan @tiny_rank1 attributes
// TP4-NOT: plan.weight "kda.
// TP4-NOT: plan.weight "mla.
// TP4: plan.weight "mlp.down" : tensor<16x2xbf16> {{{.*}}slice = array<i64: 1, 2>}
// TP4: plan.recurrent_state_layer {{{.*}}num_heads = 1 : i32
// TP4-LABEL: plan.program "prefill"
// TP4: plan.dispatch  embed [0] -> [1]
// TP4-NEXT: plan.dispatch  all_reduce_sum [] -> [15]
// TP4-NEXT: plan.dispatch  add [1, 15] -> [4]
// TP4-NEXT: plan.dispatch  mlp [4] -> [5]
// TP4-NEXT: plan.dispatch  all_reduce_sum [5] -> [16]
// TP4-NEXT: plan.dispatch  add [4, 16] -> [6]
// TP4-NEXT: plan.dispatch  all_reduce_sum [] -> [17]
// TP4-NEXT: plan.dispatch  add [6, 17] -> [8]
// TP4-LABEL: plan.plan @tiny_rank2 attributes
// TP4: plan.weight "kda.A_log" : tensor<1x1x1x1xf32> {{{.*}}slice = array<i64: 2, 1>}
// TP4-LABEL: plan.plan @tiny_rank3 attributes
// TP4-NOT: plan.dispatch  kda_

// Through the rest of the pipeline: the all-reduces get a stream of their own (stream 1, after
// the compute stream), joined by events, and the contract verifier accepts the plan.
// PIPELINE-LABEL: plan.plan @tiny_rank0 attributes
// PIPELINE: plan.program "prefill" attributes {{{.*}}num_streams = 2 : i32
// PIPELINE: plan.dispatch  kda_chunk_prefill [2] -> [3] {{.*}}signal_event = [[E0:[0-9]+]] : i32, stream = 0 : i32}
// PIPELINE-NEXT: plan.dispatch  all_reduce_sum [3] -> {{\[}}[[SUM:[0-9]+]]] {{.*}}signal_event = [[E1:[0-9]+]] : i32, stream = 1 : i32, wait_events = array<i32: [[E0]]>}
// PIPELINE-NEXT: plan.dispatch  add{{(_rms_norm)?}} [1, [[SUM]]] {{.*}}stream = 0 : i32, wait_events = array<i32: [[E1]]>}
// PIPELINE-LABEL: plan.plan @tiny_rank1 attributes

// Heads that split neither way are an error naming the layer (Inputs/shard_odd_heads.mlir: an
// MLA layer of three heads).
// HEADS: error: loc("model.layers.0.self_attn"): 'plan.dispatch' op layer 0: 3 MLA heads cannot be split over tp=2 ranks (one must divide the other)
// HEADS4: error: loc("model.layers.0.self_attn"): 'plan.dispatch' op layer 0: 3 MLA heads cannot be split over tp=4 ranks

// A weight cut for one kernel (the MLP's gate rows) but read whole by another is refused
// (Inputs/shard_shared_weight.mlir).
// SHARED: error: loc("model.layers.0.probe"): 'plan.dispatch' op layer 0 reads weight 'mlp.gate' whole, which another kernel reads as this rank's slice

// Experts go over the tensor-parallel ranks, or with tp=1 over the context ranks, or none.
// EP: error: --hybrid-shard: ep=4 must be 1 or tp=2: experts are spread over the tensor-parallel ranks, which hold the same tokens, or with tp=1 over the context-parallel ranks (an all-to-all in the prefill){{$}}
// EPCP: error: --hybrid-shard: ep=3 must be 1, tp=1 or cp=2: experts are spread over the tensor-parallel ranks
// EPTPCP: error: --hybrid-shard: ep=4 must be 1 or tp=2: {{.*}}; experts over both the tensor and the context ranks (ep=4) are not built
// EPONE: error: --hybrid-shard: ep=2 must be 1 or tp=1: experts are spread over the tensor-parallel ranks

// cp=2 ep=2 (tp=1): the experts are spread over the context ranks, context rank r holding
// expert r. The prefill's moe_experts exchanges this rank's rows by an all-to-all (all_to_all,
// on the collective stream: every rank issues it in the same order as the gathers) and no
// all-reduce follows it; the decode runs the same token on both ranks, so its moe_experts is a
// partial sum completed by an all_reduce_sum over the context group. The contract verifier
// accepts both.
// CPEP-LABEL: plan.plan @tiny_rank0 attributes
// CPEP-SAME: context_parallel = 2 : i32
// CPEP-SAME: expert_parallel = 2 : i32
// CPEP-SAME: rank = 0 : i32, tensor_parallel = 1 : i32
// CPEP-NOT: slice =
// CPEP: plan.weight "e0.down"
// CPEP-NOT: plan.weight "e1.
// CPEP-LABEL: plan.program "prefill" attributes {{{.*}}num_streams = 2 : i32
// CPEP-NOT: all_reduce_sum
// CPEP: plan.dispatch  router_topk [8] -> [9, 10] {{.*}}stream = 0 : i32
// CPEP-NEXT: plan.dispatch  moe_experts [8, 9, 10] -> [11] weights [{{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, -1, -1, -1] {layer = 1 : i32, params = {activation = "silu", all_to_all = true, {{.*}}stream = 1 : i32, wait_events =
// CPEP-NEXT: plan.dispatch  add{{(_rms_norm)?}} [8, 11]
// CPEP-NOT: all_reduce_sum
// CPEP-LABEL: plan.program "decode"
// CPEP: plan.dispatch  moe_experts [8, 9, 10] -> [11] weights [{{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}, -1, -1, -1] {layer = 1 : i32, params = {activation = "silu", intermediate_size
// CPEP-NEXT: plan.dispatch  all_reduce_sum [11] -> {{\[}}[[SUM:[0-9]+]]] weights [] {layer = 1 : i32, params = {group = "context_parallel"}
// CPEP-NEXT: plan.dispatch  add{{(_rms_norm)?}} [8, [[SUM]]]
// CPEP-LABEL: plan.plan @tiny_rank1 attributes
// CPEP-SAME: rank = 1 : i32
// CPEP-NOT: plan.weight "e0.
// CPEP: plan.weight "e1.down"
// CPEP: plan.dispatch  moe_experts [8, 9, 10] -> [11] weights [-1, -1, -1, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}] {{{.*}}all_to_all = true
// CPEP: plan.dispatch  moe_experts [8, 9, 10] -> [11] weights [-1, -1, -1, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}]
// CPEP-NEXT: plan.dispatch  all_reduce_sum [11] {{.*}}group = "context_parallel"

// cp=2: every rank keeps every head and weight; the prefill's values hold this rank's zigzag
// rows, and gathers over the context group give each layer what it needs from every position:
// KDA the chunks' conv tails and then every chunk's summary, MLA the step's cache rows, the LM
// head the final rows in position order. No all-reduce (tp=1), and decode is unchanged.
// CP-LABEL: plan.plan @tiny_rank1 attributes
// CP-SAME: context_parallel = 2 : i32
// CP-SAME: rank = 1 : i32, tensor_parallel = 1 : i32
// CP-SAME: world_size = 2 : i32
// CP-NOT: slice =
// CP: plan.recurrent_state_layer {conv_channels = 24 : i32, {{.*}}num_heads = 2 : i32
// CP-LABEL: plan.program "prefill"
// CP-NEXT: plan.value i64 x 1 {name = "input_ids", offset = -1 : i64, rows = "context_shard"}
// CP-NEXT: plan.value f32 x 16 {name = "model.embed_tokens", offset = -1 : i64, rows = "context_shard"}
// CP: plan.value f32 x 32 {name = "lm_head", offset = -1 : i64}
// CP-NEXT: plan.value f32 x 16 {name = "model.layers.0.input_layernorm.conv_tails", offset = -1 : i64}
// CP-NEXT: plan.value f32 x 64 {name = "model.layers.0.self_attn.summaries", offset = -1 : i64, rows = "context_chunks"}
// CP-NEXT: plan.value f32 x 64 {name = "model.layers.0.self_attn.summaries.all", offset = -1 : i64, rows = "all_context_chunks"}
// CP-NEXT: plan.value f32 x 10 {name = "model.layers.1.self_attn.cache_rows", offset = -1 : i64, rows = "context_shard"}
// CP-NEXT: plan.value f32 x 10 {name = "model.layers.1.self_attn.cache_rows.gathered", offset = -1 : i64}
// CP-NEXT: plan.value f32 x 16 {name = "model.norm.gathered", offset = -1 : i64}
// CP: plan.dispatch  rms_norm [1] -> [2]
// CP-NEXT: plan.dispatch  all_gather_rows [2] -> [15] weights [] {layer = 0 : i32, params = {group = "context_parallel", tail_rows = 3 : i32}
// CP-NEXT: plan.dispatch  kda_context_summary [2, 15] -> [16] weights {{\[}}[[KDAW:.*]]] {layer = 0 : i32
// CP-NEXT: plan.dispatch  all_gather_rows [16] -> [17] weights [] {layer = 0 : i32, params = {group = "context_parallel"}
// CP-NEXT: plan.dispatch  kda_chunk_prefill [2, 15, 17] -> [3] weights {{\[}}[[KDAW]]] {layer = 0 : i32
// CP-NOT: all_reduce_sum
// CP: plan.dispatch  add [4, 5] -> [6]
// CP-NEXT: plan.dispatch  mla_cache_rows [6] -> [18] weights {{\[}}[[KVA:[0-9]+]], [[KVN:[0-9]+]]] {layer = 1 : i32
// CP-NEXT: plan.dispatch  all_gather_rows [18] -> [19] weights [] {layer = 1 : i32, params = {group = "context_parallel"}
// CP-NEXT: plan.dispatch  mla_prefill [6, 19] -> [7] weights [{{[0-9]+}}, -1, [[KVA]], [[KVN]],
// CP: plan.dispatch  rms_norm [12] -> [13]
// CP-NEXT: plan.dispatch  all_gather_rows [13] -> [20] weights [] {params = {group = "context_parallel"}
// CP-NEXT: plan.dispatch  lm_head [20] -> [14]
// CP-LABEL: plan.program "decode"
// CP-NEXT: plan.value i64 x 1 {name = "input_ids", offset = -1 : i64}
// CP-NOT: all_gather_rows
// CP: plan.dispatch  kda_recurrent_decode [2] -> [3]
// CP-NOT: all_gather_rows
// CP: plan.dispatch  lm_head [13] -> [14]

// tp=2 cp=2 ep=2 through the rest of the pipeline: world rank 3 is tensor rank 1 of context
// rank 1 (head 1, expert 1); the gathers join the all-reduces on the collective stream, per-chunk
// values get arena slots of 2 and 4 rows, and the contract verifier accepts the plan.
// TPCP-LABEL: plan.plan @tiny_rank3 attributes
// TPCP-SAME: context_parallel = 2 : i32
// TPCP-SAME: expert_parallel = 2 : i32
// TPCP-SAME: rank = 3 : i32, tensor_parallel = 2 : i32
// TPCP-SAME: world_size = 4 : i32
// TPCP: plan.weight "kda.A_log" : tensor<1x1x1x1xf32> {{{.*}}slice = array<i64: 2, 1>}
// TPCP-NOT: plan.weight "e0.
// TPCP: plan.weight "e1.down"
// TPCP-LABEL: plan.program "prefill" attributes {{{.*}}num_streams = 2 : i32
// TPCP: plan.value f32 x 32 {name = "model.layers.0.self_attn.summaries", offset = {{[0-9]+}} : i64, rows = "context_chunks"}
// TPCP: plan.dispatch  all_gather_rows [2] -> [{{[0-9]+}}] {{.*}}params = {group = "context_parallel", tail_rows = 3 : i32}, {{.*}}stream = 1 : i32
// TPCP: plan.dispatch  kda_context_summary {{.*}}num_heads = 1 : i32{{.*}}stream = 0 : i32
// TPCP: plan.dispatch  kda_chunk_prefill [2, {{[0-9]+}}, {{[0-9]+}}] -> [3] {{.*}}num_heads = 1 : i32
// TPCP-NEXT: plan.dispatch  all_reduce_sum [3] {{.*}}group = "tensor_parallel"{{.*}}stream = 1 : i32
// TPCP: plan.dispatch  moe_experts [{{.*}}] -> [{{[0-9]+}}] weights [-1, -1, -1, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}]
// TPCP-NEXT: plan.dispatch  all_reduce_sum {{.*}}group = "expert_parallel"
// TPCP: plan.dispatch  all_gather_rows {{.*}}params = {group = "context_parallel"}{{.*}}stream = 1 : i32
// TPCP-NEXT: plan.dispatch  lm_head
// TPCP-LABEL: plan.program "decode"
// TPCP-NOT: all_gather_rows
// TPCP: plan.dispatch  lm_head

// FP8 block-quantized weights (Inputs/shard_fp8.mlir, 128x128 blocks): each rank's slice is whole
// blocks and its scale grid is cut by the same blocks (rows [128, 256) take scale row 1). Routed
// experts stay whole, their scales with them; the other rank's experts and scales leave the plan.
// FP8-LABEL: plan.plan @fp8_rank0
// FP8-SAME: expert_parallel = 2 : i32{{.*}}rank = 0 : i32, tensor_parallel = 2 : i32
// FP8: plan.weight "l0.kv_a" : tensor<160x256xf8E4M3FN> {block = array<i32: 128, 128>, offset = {{[0-9]+}} : i64, scale = [[KVAS:[0-9]+]] : i32, size = 40960 : i64}
// FP8-NEXT: plan.weight "l0.kv_a_scale_inv" : tensor<2x2xf32> {offset = {{[0-9]+}} : i64, size = 16 : i64}
// FP8-NEXT: plan.weight "l0.kv_b" : tensor<256x96xf8E4M3FN> {{{.*}}size = 24576 : i64, slice = array<i64: 0, 0>}
// FP8-NEXT: plan.weight "l0.kv_b_scale_inv" : tensor<2x1xf32> {{{.*}}size = 8 : i64, slice = array<i64: 0, 0>}
// FP8-NEXT: plan.weight "l0.o_proj" : tensor<256x128xf8E4M3FN> {{{.*}}slice = array<i64: 1, 0>}
// FP8-NEXT: plan.weight "l0.o_proj_scale_inv" : tensor<2x1xf32> {{{.*}}slice = array<i64: 1, 0>}
// FP8-NEXT: plan.weight "l0.q_proj" : tensor<256x256xf8E4M3FN> {{{.*}}slice = array<i64: 0, 0>}
// FP8-NEXT: plan.weight "l0.q_proj_scale_inv" : tensor<2x2xf32> {{{.*}}slice = array<i64: 0, 0>}
// FP8-NEXT: plan.weight "l0.down" : tensor<256x128xf8E4M3FN> {{{.*}}slice = array<i64: 1, 0>}
// FP8-NEXT: plan.weight "l0.down_scale_inv" : tensor<2x1xf32> {{{.*}}slice = array<i64: 1, 0>}
// FP8-NEXT: plan.weight "l0.gate" : tensor<128x256xf8E4M3FN> {{{.*}}slice = array<i64: 0, 0>}
// FP8-NEXT: plan.weight "l0.gate_scale_inv" : tensor<1x2xf32> {{{.*}}slice = array<i64: 0, 0>}
// FP8-NEXT: plan.weight "l0.up" : tensor<128x256xf8E4M3FN> {{{.*}}slice = array<i64: 0, 0>}
// FP8-NEXT: plan.weight "l0.up_scale_inv" : tensor<1x2xf32> {{{.*}}slice = array<i64: 0, 0>}
// FP8-NEXT: plan.weight "e0.down" : tensor<256x128xf8E4M3FN> {block = array<i32: 128, 128>, offset = {{[0-9]+}} : i64, scale = 17 : i32, size = 32768 : i64}
// FP8-NEXT: plan.weight "e0.down_scale_inv" : tensor<2x1xf32> {offset = {{[0-9]+}} : i64, size = 8 : i64}
// FP8-NEXT: plan.weight "e0.gate" : tensor<128x256xf8E4M3FN>
// FP8-NEXT: plan.weight "e0.gate_scale_inv" : tensor<1x2xf32> {offset
// FP8-NEXT: plan.weight "e0.up" : tensor<128x256xf8E4M3FN>
// FP8-NEXT: plan.weight "e0.up_scale_inv" : tensor<1x2xf32> {offset
// FP8-NEXT: plan.weight "l1.router"
// FP8-NEXT: plan.weight "l1.shared.down" : tensor<256x128xf8E4M3FN> {{{.*}}slice = array<i64: 1, 0>}
// FP8-NEXT: plan.weight "l1.shared.down_scale_inv" : tensor<2x1xf32> {{{.*}}slice = array<i64: 1, 0>}
// FP8-NEXT: plan.weight "l1.shared.gate" : tensor<128x256xf8E4M3FN> {{{.*}}slice = array<i64: 0, 0>}
// FP8-NEXT: plan.weight "l1.shared.gate_scale_inv" : tensor<1x2xf32> {{{.*}}slice = array<i64: 0, 0>}
// FP8: plan.program "prefill"
// FP8: mla_prefill [{{[0-9]+}}] -> [{{[0-9]+}}] weights [{{[0-9]+}}, -1, 2, 1, 4, -1, 6] {{{.*}}num_heads = 2 : i32
// FP8: moe_experts [{{.*}}] -> [{{[0-9]+}}] weights [18, 20, 16, -1, -1, -1]
// FP8-LABEL: plan.plan @fp8_rank1
// FP8: plan.weight "l0.kv_b" : tensor<256x96xf8E4M3FN> {{{.*}}slice = array<i64: 0, 256>}
// FP8-NEXT: plan.weight "l0.kv_b_scale_inv" : tensor<2x1xf32> {{{.*}}slice = array<i64: 0, 2>}
// FP8-NEXT: plan.weight "l0.o_proj" : tensor<256x128xf8E4M3FN> {{{.*}}slice = array<i64: 1, 128>}
// FP8-NEXT: plan.weight "l0.o_proj_scale_inv" : tensor<2x1xf32> {{{.*}}slice = array<i64: 1, 1>}
// FP8-NEXT: plan.weight "l0.q_proj" : tensor<256x256xf8E4M3FN> {{{.*}}slice = array<i64: 0, 256>}
// FP8-NEXT: plan.weight "l0.q_proj_scale_inv" : tensor<2x2xf32> {{{.*}}slice = array<i64: 0, 2>}
// FP8: plan.weight "l0.gate" : tensor<128x256xf8E4M3FN> {{{.*}}slice = array<i64: 0, 128>}
// FP8-NEXT: plan.weight "l0.gate_scale_inv" : tensor<1x2xf32> {{{.*}}slice = array<i64: 0, 1>}
// FP8-NOT: "e0.
// FP8: plan.weight "e1.down" : tensor<256x128xf8E4M3FN>
// FP8-NEXT: plan.weight "e1.down_scale_inv" : tensor<2x1xf32> {offset
// FP8: moe_experts [{{.*}}] -> [{{[0-9]+}}] weights [-1, -1, -1, {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}]

// Through the rest of the pipeline and the contract verifier (each sliced scale grid covers its
// weight's part in 128 blocks): FP8 weights stay row-major, only bf16 ones are tiled.
// FP8PIPE-LABEL: plan.plan @fp8_rank1
// FP8PIPE: plan.weight "l0.o_proj" : tensor<256x128xf8E4M3FN> {block = array<i32: 128, 128>, offset = {{[0-9]+}} : i64, scale = {{[0-9]+}} : i32, size = 32768 : i64, slice = array<i64: 1, 128>}
// FP8PIPE: plan.weight "lm_head" : tensor<32x256xbf16> {nz_tiled = true

// A cut inside a 128 block is refused, naming the weight, the cut and the tp values that work.
// FP8TP4: error: loc("model.layers.0.self_attn"): 'plan.dispatch' op layer 0: block-quantized weight 'l0.o_proj' 'tensor<256x256xf8E4M3FN>' cannot be sliced for tp=4: this rank's columns [0, 64) cut through its 128-entry scale blocks along axis 1 ('l0.o_proj_scale_inv'); tp=1, 2 keep every block whole
