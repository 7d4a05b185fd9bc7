// RUN: hybrid-opt %s --split-input-file --hybrid-plan-memory --hybrid-verify-plan-contract | FileCheck %s

// One stream: a slot is reused as soon as its last reader has run.
// CHECK-LABEL: plan.plan @one_stream
// CHECK: plan.program "prefill" attributes {arena_bytes = 640 : i64
// CHECK-NEXT: plan.value i64 x 1 {name = "ids", offset = 0 : i64}
// CHECK-NEXT: plan.value f32 x 16 {name = "h", offset = 64 : i64}
// CHECK-NEXT: plan.value f32 x 16 {name = "x", offset = 320 : i64}
// The ids' 64 bytes and h's 256 are free when y is written: y takes the first 256 of them.
// CHECK-NEXT: plan.value f32 x 16 {name = "y", offset = 0 : i64}
// The logits (384 bytes) start right after y: x's freed slot plus a grown arena tail.
// CHECK-NEXT: plan.value f32 x 24 {name = "logits", offset = 256 : i64}
plan.plan @one_stream attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 24 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<24x16xbf16> {offset = 4096 : i64, size = 768 : i64}
  plan.weight "norm" : tensor<16xbf16> {offset = 8192 : i64, size = 32 : i64}
  plan.weight "head" : tensor<24x16xbf16> {offset = 12288 : i64, size = 768 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 0 : i64, token_ids = 0 : i32, logits = 4 : i32, layer_outputs = array<i32>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = -1 : i64, name = "ids"}
    plan.value f32 x 16 {offset = -1 : i64, name = "h"}
    plan.value f32 x 16 {offset = -1 : i64, name = "x"}
    plan.value f32 x 16 {offset = -1 : i64, name = "y"}
    plan.value f32 x 24 {offset = -1 : i64, name = "logits"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch rms_norm [1] -> [2] weights [1] {params = {epsilon = 1.0e-5 : f32}, stream = 0 : i32}
    plan.dispatch rms_norm [2] -> [3] weights [1] {params = {epsilon = 1.0e-5 : f32}, stream = 0 : i32}
    plan.dispatch lm_head [3] -> [4] weights [2] {params = {}, stream = 0 : i32}
  }
}

// -----

// Two streams: stream 1 reads h while stream 0 goes on. Without an event, nothing on stream 0
// may take h's bytes; after the event joins the streams, they are free again.
// CHECK-LABEL: plan.plan @two_streams
// CHECK: plan.program "prefill" attributes {arena_bytes = 1088 : i64
// CHECK-NEXT: plan.value i64 x 1 {name = "ids", offset = 0 : i64}
// CHECK-NEXT: plan.value f32 x 16 {name = "h", offset = 64 : i64}
// CHECK-NEXT: plan.value f32 x 16 {name = "a", offset = 320 : i64}
// b (stream 0) must not reuse h: stream 1 may still be reading it.
// CHECK-NEXT: plan.value f32 x 16 {name = "b", offset = 576 : i64}
// CHECK-NEXT: plan.value f32 x 16 {name = "c", offset = 832 : i64}
// After the join h and b are dead; s takes b's slot (best fit), a is still being read.
// CHECK-NEXT: plan.value f32 x 16 {name = "s", offset = 576 : i64}
// CHECK-NEXT: plan.value f32 x 24 {name = "logits", offset = 0 : i64}
plan.plan @two_streams attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 24 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 16384 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<24x16xbf16> {offset = 4096 : i64, size = 768 : i64}
  plan.weight "norm" : tensor<16xbf16> {offset = 8192 : i64, size = 32 : i64}
  plan.weight "head" : tensor<24x16xbf16> {offset = 12288 : i64, size = 768 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 0 : i64, token_ids = 0 : i32, logits = 6 : i32, layer_outputs = array<i32>, num_streams = 2 : i32, num_events = 2 : i32} {
    plan.value i64 x 1 {offset = -1 : i64, name = "ids"}
    plan.value f32 x 16 {offset = -1 : i64, name = "h"}
    plan.value f32 x 16 {offset = -1 : i64, name = "a"}
    plan.value f32 x 16 {offset = -1 : i64, name = "b"}
    plan.value f32 x 16 {offset = -1 : i64, name = "c"}
    plan.value f32 x 16 {offset = -1 : i64, name = "s"}
    plan.value f32 x 24 {offset = -1 : i64, name = "logits"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32, signal_event = 0 : i32}
    plan.dispatch rms_norm [1] -> [2] weights [1] {params = {epsilon = 1.0e-5 : f32}, stream = 1 : i32, wait_events = array<i32: 0>, signal_event = 1 : i32}
    plan.dispatch rms_norm [1] -> [3] weights [1] {params = {epsilon = 1.0e-5 : f32}, stream = 0 : i32}
    plan.dispatch rms_norm [3] -> [4] weights [1] {params = {epsilon = 1.0e-5 : f32}, stream = 0 : i32}
    plan.dispatch add [2, 4] -> [5] weights [] {params = {}, stream = 0 : i32, wait_events = array<i32: 1>}
    plan.dispatch lm_head [5] -> [6] weights [2] {params = {}, stream = 0 : i32}
  }
}
