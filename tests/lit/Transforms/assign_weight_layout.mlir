// RUN: hybrid-opt %s --hybrid-assign-weight-layout | FileCheck %s
// RUN: hybrid-opt %s --hybrid-assign-weight-layout --hybrid-plan-memory --hybrid-verify-plan-contract -o /dev/null

// Weights read as GEMM operands are tiled (128 bytes of K per tile row, smaller tiles for small
// matrices) and padded to whole tiles; the archive is laid out again. Tables, norm weights and
// weights another reader needs row-major stay as they are.
// CHECK-LABEL: plan.plan @layouts
// CHECK-SAME: weight_archive_bytes = 40960 : i64
// CHECK-NEXT: plan.weight "embed" : tensor<24x16xbf16> {offset = 4096 : i64, size = 768 : i64}
// CHECK-NEXT: plan.weight "norm" : tensor<16xbf16> {offset = 8192 : i64, size = 32 : i64}
// A 100x16 bf16 projection: 64x16 tiles (16 columns is all of K), padded to 128x16.
// CHECK-NEXT: plan.weight "proj" : tensor<100x16xbf16> {nz_tiled = true, offset = 12288 : i64, size = 4096 : i64, tile = array<i32: 64, 16>}
// The same weight read by a tiled GEMM and by the embedding lookup: row-major.
// CHECK-NEXT: plan.weight "shared" : tensor<24x16xbf16> {offset = 16384 : i64, size = 768 : i64}
// Block-quantized weights stay row-major (their scale grid is row-major).
// CHECK-NEXT: plan.weight "fp8" : tensor<24x16xf8E4M3FN> {block = array<i32: 24, 16>, offset = 20480 : i64, scale = 5 : i32, size = 384 : i64}
// CHECK-NEXT: plan.weight "fp8_scale_inv" : tensor<1x1xf32> {offset = 24576 : i64, size = 4 : i64}
// An fp32 24x100 head: 24x32 tiles (32 fp32 = 128 bytes of K), padded to 24x128.
// CHECK-NEXT: plan.weight "head" : tensor<24x100xf32> {nz_tiled = true, offset = 28672 : i64, size = 12288 : i64, tile = array<i32: 24, 32>}
plan.plan @layouts attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cpu", arch = "", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 24 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 32768 : i64, page_size = 64 : i32} {
  plan.weight "embed" : tensor<24x16xbf16> {offset = 4096 : i64, size = 768 : i64}
  plan.weight "norm" : tensor<16xbf16> {offset = 8192 : i64, size = 32 : i64}
  plan.weight "proj" : tensor<100x16xbf16> {offset = 12288 : i64, size = 3200 : i64}
  plan.weight "shared" : tensor<24x16xbf16> {offset = 16384 : i64, size = 768 : i64}
  plan.weight "fp8" : tensor<24x16xf8E4M3FN> {offset = 20480 : i64, size = 384 : i64, block = array<i32: 24, 16>, scale = 5 : i32}
  plan.weight "fp8_scale_inv" : tensor<1x1xf32> {offset = 24576 : i64, size = 4 : i64}
  plan.weight "head" : tensor<24x100xf32> {offset = 28672 : i64, size = 9600 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 0 : i64, token_ids = 0 : i32, logits = 6 : i32, layer_outputs = array<i32>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = -1 : i64, name = "ids"}
    plan.value f32 x 16 {offset = -1 : i64, name = "h"}
    plan.value f32 x 100 {offset = -1 : i64, name = "p"}
    plan.value f32 x 24 {offset = -1 : i64, name = "s"}
    plan.value f32 x 24 {offset = -1 : i64, name = "q"}
    plan.value f32 x 100 {offset = -1 : i64, name = "r"}
    plan.value f32 x 24 {offset = -1 : i64, name = "logits"}
    plan.value f32 x 16 {offset = -1 : i64, name = "e"}
    plan.dispatch embed [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
    plan.dispatch linear [1] -> [2] weights [2] {params = {}, stream = 0 : i32}
    plan.dispatch linear [1] -> [3] weights [3] {params = {}, stream = 0 : i32}
    plan.dispatch embed [0] -> [7] weights [3] {params = {}, stream = 0 : i32}
    plan.dispatch linear [7] -> [4] weights [4] {params = {}, stream = 0 : i32}
    plan.dispatch lm_head [2] -> [6] weights [6] {params = {}, stream = 0 : i32}
  }
}

// A plan for the cuda device keeps every weight row-major (cuBLASLt reads [out, in] as stored).
// CHECK-LABEL: plan.plan @cuda_layouts
// CHECK-SAME: weight_archive_bytes = 7296 : i64
// CHECK-NEXT: plan.weight "proj" : tensor<100x16xbf16> {offset = 4096 : i64, size = 3200 : i64}
plan.plan @cuda_layouts attributes {version = array<i32: 1, 0>, compiler = "test", model_type = "test", device = "cuda", arch = "sm_90a", world_size = 1 : i32, hidden_size = 16 : i64, vocab_size = 24 : i64, num_layers = 1 : i32, weight_archive_key = "", weight_archive_bytes = 7296 : i64, page_size = 64 : i32} {
  plan.weight "proj" : tensor<100x16xbf16> {offset = 4096 : i64, size = 3200 : i64}
  plan.program "prefill" attributes {max_tokens = 4 : i64, arena_bytes = 0 : i64, token_ids = 0 : i32, logits = 1 : i32, layer_outputs = array<i32>, num_streams = 1 : i32, num_events = 0 : i32} {
    plan.value i64 x 1 {offset = -1 : i64, name = "ids"}
    plan.value f32 x 100 {offset = -1 : i64, name = "logits"}
    plan.dispatch lm_head [0] -> [1] weights [0] {params = {}, stream = 0 : i32}
  }
}
