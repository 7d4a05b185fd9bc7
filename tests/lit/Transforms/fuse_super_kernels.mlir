// RUN: hybrid-opt %s --split-input-file --hybrid-fuse-super-kernels | FileCheck %s
// RUN: hybrid-opt %s --split-input-file --hybrid-fuse-super-kernels --hybrid-assign-streams --hybrid-plan-memory --hybrid-verify-plan-contract -o /dev/null

// A residual add followed by the RMSNorm of its sum becomes one add_rms_norm writing both; the
// sum keeps feeding the residual chain. An RMSNorm of anything else stays as it is. An add whose
// sum only that add_rms_norm reads folds in as its third input: sum = 2 + (1 + 2), the two adds'
// order.
// CHECK-LABEL: plan.plan @residual
// CHECK: plan.dispatch embed [0] -> [1]
// CHECK-NEXT: plan.dispatch rms_norm [1] -> [2] weights [1] {params = {epsilon = 9.99999974E-6 : f32}
// CHECK-NEXT: plan.dispatch add_rms_norm [2, 1, 2] -> [4, 5] weights [2] {layer = 1 : i32, params = {epsilon = 9.99999997E-7 : f32}
// CHECK-NEXT: plan.dispatch lm_head [5] -> [6]
// CHECK-NOT: rms_norm [4]
plan.plan @residual attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 24 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 20480 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<24x16xbf16> {offset = 4096 : i64, size = 768 : i64}
  plan.weight "norm" : tensor<16xbf16> {offset = 8192 : i64, size = 32 : i64}
  plan.weight "final" : tensor<16xbf16> {offset = 12288 : i64, size = 32 : i64}
  plan.weight "head" : tensor<24x16xbf16> {offset = 16384 : i64, size = 768 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 0 : i64, token_ids = 0 : i32, logits = 6 : i32, layer_outputs = array<i32: 1, 4, 5>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = -1 : i64, name = "ids"}
    plan.value f32 x 16 {offset = -1 : i64, name = "h"}
    plan.value f32 x 16 {offset = -1 : i64, name = "x"}
    plan.value f32 x 16 {offset = -1 : i64, name = "h1"}
    plan.value f32 x 16 {offset = -1 : i64, name = "h2"}
    plan.value f32 x 16 {offset = -1 : i64, name = "final"}
    plan.value f32 x 24 {offset = -1 : i64, name = "logits"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
    // The norm of the embedding output is not fusable: its producer is no add or mix.
    plan.dispatch rms_norm [1] -> [2] weights [1] {params = {epsilon = 1.0e-5 : f32}, stream = 0 : i32}
    // This add's sum is read only by the next add: nothing to fuse.
    plan.dispatch add [1, 2] -> [3] weights [] {params = {}, stream = 0 : i32}
    plan.dispatch add [3, 2] -> [4] weights [] {layer = 1 : i32, params = {}, stream = 0 : i32}
    plan.dispatch rms_norm [4] -> [5] weights [2] {params = {epsilon = 1.0e-6 : f32}, stream = 0 : i32}
    plan.dispatch lm_head [5] -> [6] weights [3] {params = {}, stream = 0 : i32}
  }
}

// -----

// An AttnRes mix followed by the RMSNorm of the mix becomes attn_res_rms_norm: the norm's weight
// follows the mix's weights and its epsilon becomes output_norm_epsilon.
// CHECK-LABEL: plan.plan @mix
// CHECK: plan.dispatch attn_res_rms_norm [2, 1] -> [3, 4] weights [1, 2, 3] {params = {block_size = 2 : i32, epsilon = 9.99999974E-6 : f32, output_norm_epsilon = 9.99999997E-7 : f32}
// CHECK-NEXT: plan.dispatch add [3, 4] -> [5]
plan.plan @mix attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 24 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 24576 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<24x16xbf16> {offset = 4096 : i64, size = 768 : i64}
  plan.weight "ar.norm" : tensor<16xbf16> {offset = 8192 : i64, size = 32 : i64}
  plan.weight "ar.proj" : tensor<1x16xbf16> {offset = 12288 : i64, size = 32 : i64}
  plan.weight "norm" : tensor<16xbf16> {offset = 16384 : i64, size = 32 : i64}
  plan.weight "head" : tensor<24x16xbf16> {offset = 20480 : i64, size = 768 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 0 : i64, token_ids = 0 : i32, logits = 6 : i32, layer_outputs = array<i32>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = -1 : i64, name = "ids"}
    plan.value f32 x 16 {offset = -1 : i64, name = "emb"}
    plan.value f32 x 16 {offset = -1 : i64, name = "partial"}
    plan.value f32 x 16 {offset = -1 : i64, name = "mix"}
    plan.value f32 x 16 {offset = -1 : i64, name = "x"}
    plan.value f32 x 16 {offset = -1 : i64, name = "sum"}
    plan.value f32 x 24 {offset = -1 : i64, name = "logits"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch embed [0] -> [2] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch attn_res [2, 1] -> [3] weights [1, 2] {params = {block_size = 2 : i32, epsilon = 1.0e-5 : f32}, stream = 0 : i32}
    plan.dispatch rms_norm [3] -> [4] weights [3] {params = {epsilon = 1.0e-6 : f32}, stream = 0 : i32}
    plan.dispatch add [3, 4] -> [5] weights [] {params = {}, stream = 0 : i32}
    plan.dispatch lm_head [5] -> [6] weights [4] {params = {}, stream = 0 : i32}
  }
}

// -----

// An MoE layer's routed + shared sum, read only by the residual add before the next norm, folds
// into that add_rms_norm (its inputs: the residual, then the two experts' outputs). The same
// pattern with the sum also named a layer output (its value read outside the step list) stays.
// CHECK-LABEL: plan.plan @moe_sum
// CHECK: plan.dispatch add_rms_norm [1, 2, 3] -> [5, 6]
// CHECK-NOT: plan.dispatch add [
// CHECK-LABEL: plan.program "named"
// CHECK: plan.dispatch add [2, 3] -> [4]
// CHECK-NEXT: plan.dispatch add_rms_norm [1, 4] -> [5, 6]
plan.plan @moe_sum attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 24 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<24x16xbf16> {offset = 4096 : i64, size = 768 : i64}
  plan.weight "norm" : tensor<16xbf16> {offset = 8192 : i64, size = 32 : i64}
  plan.weight "head" : tensor<24x16xbf16> {offset = 12288 : i64, size = 768 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 0 : i64, token_ids = 0 : i32, logits = 7 : i32, layer_outputs = array<i32: 1, 5>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = -1 : i64, name = "ids"}
    plan.value f32 x 16 {offset = -1 : i64, name = "residual"}
    plan.value f32 x 16 {offset = -1 : i64, name = "routed"}
    plan.value f32 x 16 {offset = -1 : i64, name = "shared"}
    plan.value f32 x 16 {offset = -1 : i64, name = "moe"}
    plan.value f32 x 16 {offset = -1 : i64, name = "sum"}
    plan.value f32 x 16 {offset = -1 : i64, name = "normed"}
    plan.value f32 x 24 {offset = -1 : i64, name = "logits"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch embed [0] -> [2] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch embed [0] -> [3] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch add [2, 3] -> [4] weights [] {layer = 1 : i32, params = {}, stream = 0 : i32}
    plan.dispatch add [1, 4] -> [5] weights [] {layer = 1 : i32, params = {}, stream = 0 : i32}
    plan.dispatch rms_norm [5] -> [6] weights [1] {params = {epsilon = 1.0e-6 : f32}, stream = 0 : i32}
    plan.dispatch lm_head [6] -> [7] weights [2] {params = {}, stream = 0 : i32}
  }
  plan.program "named" attributes {max_tokens = 4 : i64, arena_bytes = 0 : i64, token_ids = 0 : i32, logits = 7 : i32, layer_outputs = array<i32: 1, 4, 5>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = -1 : i64, name = "ids"}
    plan.value f32 x 16 {offset = -1 : i64, name = "residual"}
    plan.value f32 x 16 {offset = -1 : i64, name = "routed"}
    plan.value f32 x 16 {offset = -1 : i64, name = "shared"}
    plan.value f32 x 16 {offset = -1 : i64, name = "moe"}
    plan.value f32 x 16 {offset = -1 : i64, name = "sum"}
    plan.value f32 x 16 {offset = -1 : i64, name = "normed"}
    plan.value f32 x 24 {offset = -1 : i64, name = "logits"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch embed [0] -> [2] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch embed [0] -> [3] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch add [2, 3] -> [4] weights [] {layer = 1 : i32, params = {}, stream = 0 : i32}
    plan.dispatch add [1, 4] -> [5] weights [] {layer = 1 : i32, params = {}, stream = 0 : i32}
    plan.dispatch rms_norm [5] -> [6] weights [1] {params = {epsilon = 1.0e-6 : f32}, stream = 0 : i32}
    plan.dispatch lm_head [6] -> [7] weights [2] {params = {}, stream = 0 : i32}
  }
}
