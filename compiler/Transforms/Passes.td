#ifndef HYBRID_PASSES_TD
#define HYBRID_PASSES_TD

include "mlir/Pass/PassBase.td"

def LowerToPlan : Pass<"hybrid-lower-to-plan", "mlir::ModuleOp"> {
  let summary = "Lower each hybrid.model to a plan.plan with prefill and decode programs";
  let description = [{
    Makes every execution decision explicit: the weight list with archive offsets (the layout
    rule of runtime/WeightArchive.h), the KV-cache and recurrent-state specs, and for each
    program the values (arena slots planned from liveness for `max_tokens` rows) and the kernel
    dispatches with their parameters and weights in the role order of plan.fbs. Prefill programs
    use the chunked KDA and prefill attention kernels; decode programs the recurrent ones.
  }];
  let dependentDialects = ["::hybrid::plan::PlanDialect"];
  let options = [
    Option<"device", "device", "std::string", /*default=*/"\"cpu\"",
           "Target device: cpu or cuda">,
    Option<"arch", "arch", "std::string", /*default=*/"\"\"",
           "Target architecture (sm_90a for cuda, empty for cpu)">,
    Option<"prefillTokens", "prefill-tokens", "int64_t", /*default=*/"4096",
           "Rows the prefill program's arena is planned for">,
    Option<"decodeTokens", "decode-tokens", "int64_t", /*default=*/"1",
           "Rows the decode program's arena is planned for">,
    Option<"pageSize", "page-size", "int32_t", /*default=*/"64",
           "Tokens per KV-cache page">,
    Option<"compilerId", "compiler-id", "std::string", /*default=*/"\"hybrid-compile\"",
           "Compiler identity recorded in the plan">
  ];
}

def Shard : Pass<"hybrid-shard", "mlir::ModuleOp"> {
  let summary = "Split a plan into one plan per rank for tensor, expert and context parallelism";
  let description = [{
    Runs right after --hybrid-lower-to-plan. For a world of tp x cp ranks it replaces each plan
    by one plan per rank (`@<name>_rank<r>`, with `rank`, `world_size` and the layout). Tensor
    parallelism (`tp`): MLA and KDA layers run heads [r H / tp, (r + 1) H / tp) (query, kv_b,
    gate, conv, beta and A_log/dt_bias rows by head; o_proj by the same columns), dense MLPs and
    shared experts intermediate rows [r I / tp, (r + 1) I / tp) (gate/up rows, down columns); each
    such dispatch's output is this rank's part of a sum, and an explicit `all_reduce_sum` step
    gives every rank the whole (activations stay replicated). With more ranks than heads
    (tp a multiple of H) each head runs on tp / H ranks and only the first adds its part; the
    others drop the layer's dispatches (and what only fed them) and add zeros. Expert parallelism
    (`ep`, 1 or tp): rank r holds routed experts [r E / ep, (r + 1) E / ep), the
    others' weights are absent, and an `all_reduce_sum` over the expert group combines the
    routed outputs (tokens are replicated, so dispatching them is free). With tp=1, `ep` = cp
    spreads the experts over the context ranks instead (context rank r holds the r-th share):
    the prefill's `moe_experts` gets `all_to_all = true` (the runtime sends each row to its
    experts' ranks and back; no all-reduce) and the decode's `moe_experts` is followed by an
    `all_reduce_sum` over the context group (every context rank decodes the same rows).
    Weights a rank reads become its slices (`slice = [axis, begin]`, the packer cuts them from
    the checkpoint), the rest leave its plan, and its archive is laid out again. A block-quantized weight (FP8 with
    128x128 `weight_scale_inv` blocks) is cut at whole blocks and its scale grid by the same
    blocks; a cut inside a block is an error naming the weight and the tp values that would
    keep every block whole. Heads or intermediate rows that do not split over the ranks are an
    error naming the layer.
    Context parallelism (`cp`; world rank = context rank x tp + tensor rank): the prefill's
    values hold this rank's zigzag share of the step (`rows = "context_shard"`: chunks i and
    2 cp - 1 - i of 2 cp). An `all_gather_rows` over the context group gives each MLA layer the
    step's cache rows (from `mla_cache_rows`), each DSA indexer the step's keys, each KDA layer
    every chunk's last conv_kernel - 1 input rows and then every chunk's `kda_context_summary`
    (the state-passing scan), and the LM head the final hidden rows in position order. Decode is
    unchanged: every rank ends the prefill holding the whole caches and state.
  }];
  let options = [
    Option<"tp", "tp", "int32_t", /*default=*/"1", "Tensor-parallel ranks">,
    Option<"ep", "ep", "int32_t", /*default=*/"1",
           "Expert-parallel ranks (1, tp, or cp when tp=1)">,
    Option<"cp", "cp", "int32_t", /*default=*/"1", "Context-parallel ranks (prefill)">
  ];
}

def FuseSuperKernels : Pass<"hybrid-fuse-super-kernels", "mlir::ModuleOp"> {
  let summary = "Rewrite groups of plan steps into fused kernels";
  let description = [{
    Folds each RMSNorm into the step producing its input when that step is a residual add
    (`add_rms_norm`) or an AttnRes mix (`attn_res_rms_norm`): one kernel writes both the sum, which
    the residual chain keeps reading, and its normalised form, while the sum is still in registers
    or cache. Then an `add` whose sum only an `add_rms_norm` reads (an MoE layer's routed +
    shared experts before the residual add) folds into it as a third input: sum = a + (b + c),
    the two adds' order and bits, one launch less. The other fusions of the kernel library are
    already single kernels when lowered:
    the KDA prolog (short conv, SiLU, L2 norm, gate, beta) and the gated RMSNorm with its output
    gate live inside `kda_*`; the indexer's scoring, head weighting and top-k inside `dsa_indexer`
    (an unfused form would materialize a tokens x context score matrix); router logits and grouped
    top-k inside `router_topk`; SwiGLU inside `mlp` and `moe_experts`.
  }];
}

def AnnotateQuantization : Pass<"hybrid-annotate-quantization", "mlir::ModuleOp"> {
  let summary = "Attach precisions by role from a policy given as data";
  let description = [{
    The policy is `default`, `none` or a JSON file (docs/quantization.md). The default is the
    DeepSeek-style hierarchy: the DSA indexer's query and key activations in MXFP8 (E4M3
    elements, one E8M0 scale per 32, round-up scale rule), the sparse-attention KV cache's latent
    in FP8 E4M3 with one power-of-two fp32 scale per token and 128-element tile (FlashMLA's V32
    layout, rope part in bf16), projections in BF16 (the checkpoint's precision); `indexer_qk:
    fp8` takes DeepSeek-V3.2's own indexer FP8 instead (E4M3, one power-of-two scale per query
    head and per key, ue8m0). Each decision is
    a field of the plan (`quantize` on the indexer prologs, `quant` on the KV layer); the cpu
    device quantizes and dequantizes bit-exactly to those definitions.
  }];
  let options = [
    Option<"policy", "policy", "std::string", /*default=*/"\"default\"",
           "default, none, or a JSON policy file">
  ];
}

def AssignWeightLayout : Pass<"hybrid-assign-weight-layout", "mlir::ModuleOp"> {
  let summary = "Tile the weights GEMM kernels read into the blocks they load";
  let description = [{
    A weight becomes `nz_tiled` with the tile of `defaultTileFor` (128 bytes of K per tile row:
    64x64 bf16, 64x128 fp8, 32x32 fp32; smaller for small matrices) when every dispatch reading it
    reads that role as a tiled GEMM operand (`tiledWeights` in kernel_signatures.h). Its size
    becomes the tiled size (padded to whole tiles) and the archive is laid out again. The weight
    packer re-tiles once, at compile time; the runtime never converts layouts. Block-quantized
    weights stay row-major for now (their scale grid is indexed row-major). Plans for the cuda
    device keep every weight row-major: its GEMMs (cuBLASLt) read the checkpoint's layout.
  }];
}

def AssignStreams : Pass<"hybrid-assign-streams", "mlir::ModuleOp"> {
  let summary = "Put independent steps on separate streams and join them with events";
  let description = [{
    Builds each program's dependency graph (value writers, and program order between steps on the
    same KV slot or recurrent state) and walks it in program order: a step continues the lowest
    stream whose last step it already depends on, so nothing is serialized that need not be, and
    a step independent of every stream's tail opens a new stream (up to `max-streams`). The
    indexer's three prologs (query, key, head weights) land on three streams and the shared
    expert overlaps the routed ones. A sharded plan's collectives (`all_reduce_sum`) go on one
    stream of their own after the compute streams, in program order, so every rank issues them in
    the same order. Every cross-stream dependency that the stream order does not
    already imply gets an event: the producer signals it, the consumer waits for it.
  }];
  let options = [
    Option<"maxStreams", "max-streams", "int32_t", /*default=*/"3", "Streams to use at most">
  ];
}

def PlanMemory : Pass<"hybrid-plan-memory", "mlir::ModuleOp"> {
  let summary = "Place every program value in its program's activation arena";
  let description = [{
    One arena per program (per shape bucket: prefill plans `max_tokens` rows, decode one). A
    value's slot is reused only once every step that writes or reads it happens before the new
    writer under the program's stream and event order, so streams never race on arena bytes;
    freedom is decided per writing step (a slot free for one stream may still be busy for
    another). Allocation is best fit among the gaps between busy slots, 64-byte aligned. The logits stay live to
    the end (the host reads them); the token ids are placed first (the host writes them).
  }];
}

def VerifyPlanContract : Pass<"hybrid-verify-plan-contract", "mlir::ModuleOp"> {
  let summary = "Check everything the plan writer and the runtime rely on";
  let description = [{
    Runs right before serialization so the writer can trust its input: value, weight and
    cache-slot indices in range; values defined before use and outputs written once per step;
    weight counts per kernel in plan.fbs role order; params complete for each kernel; arena
    slots of simultaneously live values disjoint and inside `arena_bytes`; weight offsets page
    aligned, in order and non-overlapping; scale weights consistent with their block grid.
  }];
}

#endif // HYBRID_PASSES_TD
