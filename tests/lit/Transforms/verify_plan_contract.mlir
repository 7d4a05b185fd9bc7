// RUN: hybrid-opt %s --split-input-file --hybrid-verify-plan-contract --verify-diagnostics | FileCheck %s

// A well-formed plan passes unchanged.
// CHECK-LABEL: plan.plan @ok
plan.plan @ok attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<32x16xbf16> {offset = 4096 : i64, size = 1024 : i64}
  plan.weight "head" : tensor<32x16xbf16> {offset = 8192 : i64, size = 1024 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 1024 : i64, token_ids = 0 : i32, logits = 2 : i32, layer_outputs = array<i32: 1>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = 0 : i64, name = "input_ids"}
    plan.value f32 x 16 {offset = 64 : i64, name = "h"}
    plan.value f32 x 32 {offset = 512 : i64, name = "logits"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch lm_head [1] -> [2] weights [1] {params = {}, stream = 0 : i32}
  }
}

// -----

plan.plan @read_before_write attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  plan.weight "head" : tensor<32x16xbf16> {offset = 4096 : i64, size = 1024 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 1024 : i64, token_ids = 0 : i32, logits = 2 : i32, layer_outputs = array<i32>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = 0 : i64, name = "input_ids"}
    plan.value f32 x 16 {offset = 64 : i64, name = "h"}
    plan.value f32 x 32 {offset = 512 : i64, name = "logits"}
    // expected-error @+1 {{reads value 1 before it is written}}
    plan.dispatch lm_head [1] -> [2] weights [0] {params = {}, stream = 0 : i32}
  }
}

// -----

plan.plan @weight_count attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<32x16xbf16> {offset = 4096 : i64, size = 1024 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 1024 : i64, token_ids = 0 : i32, logits = 1 : i32, layer_outputs = array<i32>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = 0 : i64, name = "input_ids"}
    plan.value f32 x 16 {offset = 64 : i64, name = "h"}
    // expected-error @+1 {{embed needs 1 weights, got 2}}
    plan.dispatch embed [0] -> [1] weights [0, 0] {params = {}, stream = 0 : i32}
  }
}

// -----

plan.plan @missing_param attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  plan.weight "norm" : tensor<16xbf16> {offset = 4096 : i64, size = 32 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 1024 : i64, token_ids = 0 : i32, logits = 1 : i32, layer_outputs = array<i32>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value f32 x 16 {offset = 0 : i64, name = "x"}
    plan.value f32 x 16 {offset = 256 : i64, name = "y"}
    // expected-error @+1 {{rms_norm needs param 'epsilon'}}
    plan.dispatch rms_norm [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
  }
}

// -----

plan.plan @overlapping_slots attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<32x16xbf16> {offset = 4096 : i64, size = 1024 : i64}
  plan.weight "head" : tensor<32x16xbf16> {offset = 8192 : i64, size = 1024 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 1024 : i64, token_ids = 0 : i32, logits = 2 : i32, layer_outputs = array<i32>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = 0 : i64, name = "input_ids"}
    plan.value f32 x 16 {offset = 64 : i64, name = "h"}
    // expected-error @+1 {{shares arena bytes with value 1 while both are live}}
    plan.value f32 x 32 {offset = 128 : i64, name = "logits"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch lm_head [1] -> [2] weights [1] {params = {}, stream = 0 : i32}
  }
}

// -----

plan.plan @unaligned_weight attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  // expected-error @+1 {{offset 5000 is not page aligned after the previous weight (ends at 0)}}
  plan.weight "embed" : tensor<32x16xbf16> {offset = 5000 : i64, size = 1024 : i64}
}

// -----

plan.plan @arena_too_small attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<32x16xbf16> {offset = 4096 : i64, size = 1024 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 100 : i64, token_ids = 0 : i32, logits = 1 : i32, layer_outputs = array<i32>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = 0 : i64, name = "input_ids"}
    // expected-error @+1 {{slot [64, 320) exceeds arena_bytes = 100}}
    plan.value f32 x 16 {offset = 64 : i64, name = "h"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
  }
}

// -----

// Two streams without an event between the write on stream 0 and the read on stream 1.
plan.plan @unordered_read attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<32x16xbf16> {offset = 4096 : i64, size = 1024 : i64}
  plan.weight "head" : tensor<32x16xbf16> {offset = 8192 : i64, size = 1024 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 1024 : i64, token_ids = 0 : i32, logits = 2 : i32, layer_outputs = array<i32>, num_streams = 2 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = 0 : i64, name = "input_ids"}
    plan.value f32 x 16 {offset = 64 : i64, name = "h"}
    plan.value f32 x 32 {offset = 512 : i64, name = "logits"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
    // expected-error @+1 {{reads value 1 which another stream may not have written yet (no event orders it after step 0)}}
    plan.dispatch lm_head [1] -> [2] weights [1] {params = {}, stream = 1 : i32}
  }
}

// -----

// all_to_all (the routed experts exchanging rows over the context ranks) outside the layout
// that spreads the experts over them (expert_parallel = context_parallel, tensor_parallel 1).
plan.plan @all_to_all_without_experts_over_context attributes {version = array<i32: 1, 5>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 24576 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<32x16xbf16> {offset = 4096 : i64, size = 1024 : i64}
  plan.weight "router" : tensor<1x16xbf16> {offset = 8192 : i64, size = 32 : i64}
  plan.weight "e0.gate" : tensor<8x16xbf16> {offset = 12288 : i64, size = 256 : i64}
  plan.weight "e0.up" : tensor<8x16xbf16> {offset = 16384 : i64, size = 256 : i64}
  plan.weight "e0.down" : tensor<16x8xbf16> {offset = 20480 : i64, size = 256 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 1024 : i64, token_ids = 0 : i32, logits = 4 : i32, layer_outputs = array<i32>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = 0 : i64, name = "input_ids"}
    plan.value f32 x 16 {offset = 64 : i64, name = "x"}
    plan.value i32 x 1 {offset = 320 : i64, name = "ids"}
    plan.value f32 x 1 {offset = 384 : i64, name = "weights"}
    plan.value f32 x 16 {offset = 448 : i64, name = "routed"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch router_topk [1] -> [2, 3] weights [1, -1] {params = {num_experts = 1 : i32, top_k = 1 : i32, num_groups = 1 : i32, topk_groups = 1 : i32, score_function = "sigmoid", renormalize = true, routed_scaling_factor = 1.0 : f32, intermediate_size = 8 : i32, num_shared_experts = 0 : i32}, stream = 0 : i32}
    // expected-error @+1 {{all_to_all: only moe_experts on a context-parallel prefill's rows, in a plan whose experts are spread over the context ranks (expert_parallel = context_parallel, tensor_parallel 1; this plan has tensor_parallel 1, expert_parallel 1, context_parallel 1)}}
    plan.dispatch moe_experts [1, 2, 3] -> [4] weights [2, 3, 4] {params = {num_experts = 1 : i32, top_k = 1 : i32, num_groups = 1 : i32, topk_groups = 1 : i32, score_function = "sigmoid", renormalize = true, routed_scaling_factor = 1.0 : f32, intermediate_size = 8 : i32, num_shared_experts = 0 : i32, all_to_all = true}, stream = 0 : i32}
  }
}

// -----

// An all-reduce over the context ranks where the experts are not spread over them.
plan.plan @context_all_reduce attributes {version = array<i32: 1, 5>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 2 : i32, rank = 0 : i32, tensor_parallel = 1 : i32, expert_parallel = 1 : i32, context_parallel = 2 : i32, hidden_size = 16 : i64, vocab_size = 32 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<32x16xbf16> {offset = 4096 : i64, size = 1024 : i64}
  plan.weight "head" : tensor<32x16xbf16> {offset = 8192 : i64, size = 1024 : i64}
  plan.program "decode" attributes {max_tokens = 1 : i64, arena_bytes = 1024 : i64, token_ids = 0 : i32, logits = 3 : i32, layer_outputs = array<i32>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = 0 : i64, name = "input_ids"}
    plan.value f32 x 16 {offset = 64 : i64, name = "h"}
    plan.value f32 x 16 {offset = 128 : i64, name = "h.sum"}
    plan.value f32 x 32 {offset = 512 : i64, name = "logits"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
    // expected-error @+1 {{all_reduce_sum over the context_parallel group: only the decode's routed experts in a plan whose experts are spread over the context ranks (expert_parallel = context_parallel, tensor_parallel 1)}}
    plan.dispatch all_reduce_sum [1] -> [2] weights [] {params = {group = "context_parallel"}, stream = 0 : i32}
    plan.dispatch lm_head [2] -> [3] weights [1] {params = {}, stream = 0 : i32}
  }
}
