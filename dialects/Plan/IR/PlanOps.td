#ifndef PLAN_OPS_TD
#define PLAN_OPS_TD

include "dialects/Plan/IR/PlanBase.td"
include "mlir/IR/SymbolInterfaces.td"

// Kernel ids: the names of plan.fbs `KernelId`, in the same order.
def Plan_KernelId : I32EnumAttr<"KernelId", "kernel to dispatch (plan.fbs KernelId)", [
    I32EnumAttrCase<"embed", 0>,
    I32EnumAttrCase<"rms_norm", 1>,
    I32EnumAttrCase<"linear", 2>,
    I32EnumAttrCase<"add", 3>,
    I32EnumAttrCase<"kda_chunk_prefill", 4>,
    I32EnumAttrCase<"kda_recurrent_decode", 5>,
    I32EnumAttrCase<"mla_prefill", 6>,
    I32EnumAttrCase<"mla_decode", 7>,
    I32EnumAttrCase<"dsa_indexer", 8>,
    I32EnumAttrCase<"sparse_mla_prefill", 9>,
    I32EnumAttrCase<"sparse_mla_decode", 10>,
    I32EnumAttrCase<"attn_res", 11>,
    I32EnumAttrCase<"mlp", 12>,
    I32EnumAttrCase<"moe_experts", 13>,
    I32EnumAttrCase<"lm_head", 14>,
    I32EnumAttrCase<"indexer_query", 15>,
    I32EnumAttrCase<"indexer_key", 16>,
    I32EnumAttrCase<"router_topk", 17>,
    I32EnumAttrCase<"add_rms_norm", 18>,
    I32EnumAttrCase<"attn_res_rms_norm", 19>,
    I32EnumAttrCase<"all_reduce_sum", 20>,
    I32EnumAttrCase<"all_gather_rows", 21>,
    I32EnumAttrCase<"kda_context_summary", 22>,
    I32EnumAttrCase<"mla_cache_rows", 23>
  ]> {
  let cppNamespace = "::hybrid::plan";
  let genSpecializedAttr = 0;
}
def Plan_KernelIdAttr : EnumAttr<Plan_Dialect, Plan_KernelId, "kernel">;

def Plan_PlanOp : Plan_Op<"plan", [IsolatedFromAbove, Symbol, NoTerminator, SingleBlock]> {
  let summary = "an execution plan (plan.fbs `Plan`)";
  let description = [{
    Holds the plan's weights, cache specs and programs, in this order. Weight and cache-layer
    indices are their positions among ops of the same kind. `fp8_activation_scale` ("amax" or
    "ue8m0", the model's) is how GEMMs with FP8 weights quantize their activations. A sharded
    plan (--hybrid-shard) is one rank's: `rank` of `world_size`, sharded for `tensor_parallel`,
    `expert_parallel` and `context_parallel` (absent: 0 and 1, 1, 1).

    ```mlir
    plan.plan @kimi_linear attributes {version = array<i32: 1, 0>, compiler = "hybrid-compile 0.1.0",
        model_type = "kimi_linear", device = "cpu", arch = "", world_size = 1 : i32,
        hidden_size = 256 : i64, vocab_size = 256 : i64, num_layers = 4 : i32,
        weight_archive_key = "...", weight_archive_bytes = 6135808 : i64, page_size = 16 : i32} {
      plan.weight "model.embed_tokens.weight" : tensor<256x256xbf16> {offset = 4096 : i64, size = 131072 : i64}
      ...
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name, DenseI32ArrayAttr:$version, StrAttr:$compiler,
                       StrAttr:$model_type, StrAttr:$device, StrAttr:$arch, I32Attr:$world_size,
                       I64Attr:$hidden_size, I64Attr:$vocab_size, I32Attr:$num_layers,
                       StrAttr:$weight_archive_key, I64Attr:$weight_archive_bytes,
                       I32Attr:$page_size, OptionalAttr<StrAttr>:$fp8_activation_scale,
                       OptionalAttr<I32Attr>:$rank, OptionalAttr<I32Attr>:$tensor_parallel,
                       OptionalAttr<I32Attr>:$expert_parallel,
                       OptionalAttr<I32Attr>:$context_parallel);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$sym_name attr-dict-with-keyword $body";
  let extraClassDeclaration = [{
    ::mlir::Block &getBodyBlock() { return getBody().front(); }
  }];
}

def Plan_WeightOp : Plan_Op<"weight", [HasParent<"PlanOp">]> {
  let summary = "a weight in the archive (plan.fbs `Weight`)";
  let description = [{
    ```mlir
    plan.weight "model.layers.3.mlp.experts.0.up_proj.weight" : tensor<2048x7168xf8E4M3FN>
        {offset = 8192 : i64, size = 14680064 : i64, block = array<i32: 128, 128>, scale = 7 : i32}
    plan.weight "model.layers.0.self_attn.q_proj.weight" : tensor<4096x2304xbf16>
        {offset = 4096 : i64, size = 18874368 : i64, nz_tiled = true, tile = array<i32: 64, 64>}
    ```
    A tiled weight (`nz_tiled`, `tile`) is stored padded to whole tiles: `size` counts the padding.
    A sharded plan's weight may be this rank's part of the checkpoint tensor: `slice = [axis,
    begin]` along one axis, `type` the part's shape (the weight packer cuts it out).

    ```mlir
    plan.weight "model.layers.0.mlp.down_proj.weight" : tensor<256x128xbf16>
        {offset = 4096 : i64, size = 65536 : i64, slice = array<i64: 1, 128>}
    ```
  }];
  let arguments = (ins StrAttr:$name, TypeAttrOf<AnyRankedTensor>:$type, I64Attr:$offset,
                       I64Attr:$size, DefaultValuedAttr<BoolAttr, "false">:$nz_tiled,
                       OptionalAttr<DenseI32ArrayAttr>:$block, DefaultValuedAttr<I32Attr, "-1">:$scale,
                       OptionalAttr<DenseI32ArrayAttr>:$tile,
                       OptionalAttr<DenseI64ArrayAttr>:$slice);
  let assemblyFormat = "$name `:` $type attr-dict";
}

def Plan_KvCacheLayerOp : Plan_Op<"kv_cache_layer", [HasParent<"PlanOp">]> {
  let summary = "a paged latent KV cache of one attention layer (plan.fbs `KvCacheLayer`)";
  let description = [{
    ```mlir
    plan.kv_cache_layer {layer = 3 : i32, latent_dim = 64 : i32, rope_dim = 32 : i32, dtype = f32, index_key_dim = 0 : i32}
    plan.kv_cache_layer {layer = 0 : i32, latent_dim = 512 : i32, rope_dim = 64 : i32, dtype = f32,
        index_key_dim = 128 : i32, quant = "fp8_tiles", quant_tile = 128 : i32}
    ```
    `quant = "fp8_tiles"` stores the latent as E4M3 with a power-of-two scale per token and
    `quant_tile` elements (on `cpu` the values are quantized and kept dequantized in fp32).
  }];
  let arguments = (ins I32Attr:$layer, I32Attr:$latent_dim, I32Attr:$rope_dim, TypeAttr:$dtype,
                       I32Attr:$index_key_dim,
                       DefaultValuedAttr<StrAttr, "\"none\"">:$quant,
                       DefaultValuedAttr<I32Attr, "128">:$quant_tile);
  let assemblyFormat = "attr-dict";
}

def Plan_RecurrentStateLayerOp : Plan_Op<"recurrent_state_layer", [HasParent<"PlanOp">]> {
  let summary = "the fixed-size state of one KDA layer (plan.fbs `RecurrentStateLayer`)";
  let description = [{
    ```mlir
    plan.recurrent_state_layer {layer = 0 : i32, num_heads = 2 : i32, head_k_dim = 128 : i32,
        head_v_dim = 128 : i32, v_major = false, conv_channels = 768 : i32, conv_kernel = 4 : i32}
    ```
  }];
  let arguments = (ins I32Attr:$layer, I32Attr:$num_heads, I32Attr:$head_k_dim, I32Attr:$head_v_dim,
                       BoolAttr:$v_major, I32Attr:$conv_channels, I32Attr:$conv_kernel);
  let assemblyFormat = "attr-dict";
}

def Plan_ProgramOp : Plan_Op<"program", [HasParent<"PlanOp">, NoTerminator, SingleBlock]> {
  let summary = "a program: values and steps (plan.fbs `Program`)";
  let description = [{
    Value indices are positions among the program's `plan.value` ops. `hidden_input` (-1: none)
    is a value the runtime fills besides the token ids: the `mtp` program's main-model hidden
    states (docs/mtp.md).

    ```mlir
    plan.program "decode" attributes {max_tokens = 1 : i64, arena_bytes = 8192 : i64,
        token_ids = 0 : i32, logits = 41 : i32, layer_outputs = array<i32: 1, 7, 13>,
        num_streams = 1 : i32, num_events = 0 : i32} {
      plan.value i64 x 1 {offset = 0 : i64, name = "input_ids"}
      plan.dispatch embed [0] -> [1] weights [0] {stream = 0 : i32}
    }
    ```
  }];
  let arguments = (ins StrAttr:$name, I64Attr:$max_tokens, I64Attr:$arena_bytes, I32Attr:$token_ids,
                       I32Attr:$logits, DenseI32ArrayAttr:$layer_outputs, I32Attr:$num_streams,
                       I32Attr:$num_events, DefaultValuedAttr<I32Attr, "-1">:$hidden_input);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$name attr-dict-with-keyword $body";
  let extraClassDeclaration = [{
    ::mlir::Block &getBodyBlock() { return getBody().front(); }
  }];
}

def Plan_ValueOp : Plan_Op<"value", [HasParent<"ProgramOp">]> {
  let summary = "an activation slot in the program arena (plan.fbs `Value`)";
  let description = [{
    `rows x row_elements` elements of `dtype`, rows being the step's token count, at byte
    `offset` of the arena (planned for `max_tokens` rows). In a context-parallel prefill `rows`
    (plan.fbs `ValueRows`) may say otherwise: "context_shard" (this rank's tokens),
    "context_chunks" (one per chunk it holds: 2) or "all_context_chunks" (2 x context_parallel);
    absent: "step".

    ```mlir
    plan.value f32 x 256 {offset = 4096 : i64, name = "model.layers.0.self_attn"}
    plan.value f32 x 256 {offset = -1 : i64, name = "model.layers.0.mlp", rows = "context_shard"}
    ```
  }];
  let arguments = (ins TypeAttr:$dtype, I64Attr:$row_elements, I64Attr:$offset, StrAttr:$name,
                       DefaultValuedAttr<StrAttr, "\"step\"">:$rows);
  let assemblyFormat = "$dtype `x` $row_elements attr-dict";
  let extraClassDeclaration = [{
    // Rows the arena holds for this value: a chunk count for per-chunk values, else the
    // program's max_tokens.
    int64_t plannedRows(int64_t maxTokens, int64_t contextParallel) {
      if (getRows() == "context_chunks")
        return 2;
      if (getRows() == "all_context_chunks")
        return 2 * contextParallel;
      return maxTokens;
    }
  }];
}

def Plan_DispatchOp : Plan_Op<"dispatch", [HasParent<"ProgramOp">]> {
  let summary = "a kernel dispatch (plan.fbs `Dispatch`)";
  let description = [{
    Runs `kernel` on the input values, writing the output values (most kernels write one;
    router_topk writes the expert ids and weights); `weights` are weight indices in
    the kernel's role order (plan.fbs), -1 for an absent optional weight; `params` holds the
    kernel's parameters by their plan.fbs field names.

    ```mlir
    plan.dispatch rms_norm [1] -> [2] weights [3] {layer = 0 : i32, params = {epsilon = 1.0e-05 : f32}, stream = 0 : i32}
    ```
  }];
  let arguments = (ins Plan_KernelIdAttr:$kernel, DenseI32ArrayAttr:$inputs,
                       DenseI32ArrayAttr:$outputs, DenseI32ArrayAttr:$weights,
                       DictionaryAttr:$params, I32Attr:$stream,
                       DefaultValuedAttr<DenseI32ArrayAttr, "{}">:$wait_events,
                       DefaultValuedAttr<I32Attr, "-1">:$signal_event,
                       DefaultValuedAttr<I32Attr, "-1">:$layer);
  let assemblyFormat = "$kernel $inputs `->` $outputs `weights` $weights attr-dict";
}

def Plan_CopyOp : Plan_Op<"copy", [HasParent<"ProgramOp">]> {
  let summary = "a value-to-value copy (plan.fbs `Copy`)";
  let description = [{
    ```mlir
    plan.copy 3 -> 7 {stream = 0 : i32}
    ```
  }];
  let arguments = (ins I32Attr:$source, I32Attr:$destination, I32Attr:$stream);
  let assemblyFormat = "$source `->` $destination attr-dict";
}

#endif // PLAN_OPS_TD
