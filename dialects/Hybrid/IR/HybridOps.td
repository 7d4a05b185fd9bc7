#ifndef HYBRID_OPS_TD
#define HYBRID_OPS_TD

include "dialects/Hybrid/IR/HybridBase.td"
include "dialects/Hybrid/IR/HybridAttrs.td"
include "mlir/IR/SymbolInterfaces.td"
include "mlir/IR/RegionKindInterface.td"
include "mlir/Interfaces/InferTypeOpInterface.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

// A token-major activation: tensor<?xDxT> (tokens x features).
def Hybrid_Activations : 2DTensorOf<[BF16, F16, F32]>;
def Hybrid_TokenIds : 1DTensorOf<[I64]>;
def Hybrid_Logits : 2DTensorOf<[F32]>;
def Hybrid_TopKIndices : 2DTensorOf<[I32]>;

//===----------------------------------------------------------------------===//
// Structure
//===----------------------------------------------------------------------===//

def Hybrid_ModelOp : Hybrid_Op<"model", [IsolatedFromAbove, Symbol, NoTerminator,
                                         SingleBlock]> {
  let summary = "a whole decoder-only model, token ids in, logits out";
  let description = [{
    Holds the layer ops of one model in a single block whose argument is the token ids
    (`tensor<?xi64>`) and whose `hybrid.return` yields the logits (`tensor<?xVxf32>`).
    Model-level facts from `config.json` are attributes; the op is a symbol so a module can hold
    several models (a draft and a target for speculative decoding). A model with FP8 weights says
    how the activations they multiply are quantized (MODEL_SPEC 8.1): `fp8_activation_scale` is
    "amax" (s = amax / 448, act_quant's default) or "ue8m0" (s rounded up to a power of two, the
    checkpoint's `scale_fmt`); `fp8_weight_block` is the checkpoint's `weight_block_size` (the
    weight elements one block scale covers per axis; a last, shorter block keeps its scale) when
    it says one, else the blocks are inferred from the scale grids.

    ```mlir
    hybrid.model @kimi_linear attributes {model_type = "kimi_linear", hidden_size = 256 : i64,
        vocab_size = 256 : i64, num_layers = 4 : i64} {
    ^bb0(%ids: tensor<?xi64>):
      %h = hybrid.embed %ids {weight = #hybrid.weight<"model.embed_tokens.weight" : tensor<256x256xbf16>>}
          : tensor<?xi64> -> tensor<?x256xbf16>
      ...
      hybrid.return %logits : tensor<?x256xf32>
    }
    ```

    A checkpoint with a multi-token-prediction layer (DeepSeek-V3's `num_nextn_predict_layers`,
    docs/mtp.md) adds an optional `mtp` region: its block takes the token ids of the *next*
    tokens and the main model's final hidden states (the LM head's input, one row per token) and
    returns the logits of the token after next; its ops share the main model's weights by name
    (the embedding) and hold the MTP layer's own.

    ```mlir
    } mtp {
    ^bb0(%next: tensor<?xi64>, %hidden: tensor<?x256xf32>):
      %e = hybrid.embed %next {weight = ...} : tensor<?xi64> -> tensor<?x256xbf16>
      %h = hybrid.mtp_input %e, %hidden {...} : tensor<?x256xbf16>, tensor<?x256xf32> -> tensor<?x256xbf16>
      ...
      hybrid.return %logits : tensor<?x256xf32>
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name, StrAttr:$model_type, I64Attr:$hidden_size,
                       I64Attr:$vocab_size, I64Attr:$num_layers,
                       OptionalAttr<StrAttr>:$fp8_activation_scale,
                       OptionalAttr<DenseI64ArrayAttr>:$fp8_weight_block);
  let regions = (region SizedRegion<1>:$body, MaxSizedRegion<1>:$mtp);
  let assemblyFormat = "$sym_name attr-dict-with-keyword $body (`mtp` $mtp^)?";
  let hasVerifier = 1;
  let extraClassDeclaration = [{
    ::mlir::Block &getBodyBlock() { return getBody().front(); }
    // The multi-token-prediction layer's block, or null when the model has none.
    ::mlir::Block *getMtpBlock() { return getMtp().empty() ? nullptr : &getMtp().front(); }
  }];
}

def Hybrid_ReturnOp : Hybrid_Op<"return", [Terminator, HasParent<"ModelOp">, Pure]> {
  let summary = "yields the logits of a `hybrid.model`";
  let description = [{
    ```mlir
    hybrid.return %logits : tensor<?x256xf32>
    ```
  }];
  let arguments = (ins Hybrid_Logits:$logits);
  let assemblyFormat = "$logits attr-dict `:` type($logits)";
}

//===----------------------------------------------------------------------===//
// Decoder glue
//===----------------------------------------------------------------------===//

def Hybrid_EmbedOp : Hybrid_Op<"embed", [Pure]> {
  let summary = "token embedding lookup";
  let description = [{
    `h[t] = weight[ids[t]]`, weight `[vocab, hidden]`.

    ```mlir
    %h = hybrid.embed %ids {weight = #hybrid.weight<"model.embed_tokens.weight" : tensor<256x256xbf16>>}
        : tensor<?xi64> -> tensor<?x256xbf16>
    ```
  }];
  let arguments = (ins Hybrid_TokenIds:$ids, Hybrid_WeightAttr:$weight);
  let results = (outs Hybrid_Activations:$result);
  let assemblyFormat = "$ids attr-dict `:` type($ids) `->` type($result)";
  let hasVerifier = 1;
}

def Hybrid_RmsNormOp : Hybrid_Op<"rms_norm", [Pure, SameOperandsAndResultType]> {
  let summary = "RMSNorm over the feature dimension";
  let description = [{
    `y = weight * x / sqrt(mean(x^2) + epsilon)`, statistics in fp32.

    ```mlir
    %x = hybrid.rms_norm %h {epsilon = 1.000000e-05 : f64,
        weight = #hybrid.weight<"model.layers.0.input_layernorm.weight" : tensor<256xbf16>>}
        : tensor<?x256xbf16>
    ```
  }];
  let arguments = (ins Hybrid_Activations:$input, Hybrid_WeightAttr:$weight, F64Attr:$epsilon);
  let results = (outs Hybrid_Activations:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def Hybrid_LinearOp : Hybrid_Op<"linear", [Pure]> {
  let summary = "projection y = x W^T without bias";
  let description = [{
    Weight `[out_features, in_features]` as stored by PyTorch `nn.Linear`. Used where a projection
    is shared by several layer ops (the MLA query latent `q_a_proj` feeds both sparse MLA and the
    DSA indexer).

    ```mlir
    %q = hybrid.linear %x {weight = #hybrid.weight<"model.layers.0.self_attn.q_a_proj.weight" : tensor<96x256xbf16>>}
        : tensor<?x256xbf16> -> tensor<?x96xbf16>
    ```
  }];
  let arguments = (ins Hybrid_Activations:$input, Hybrid_WeightAttr:$weight);
  let results = (outs Hybrid_Activations:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Hybrid_MtpInputOp : Hybrid_Op<"mtp_input", [Pure]> {
  let summary = "multi-token prediction input: eh_proj(concat(enorm(e), hnorm(h)))";
  let description = [{
    DeepSeek-V3's MTP module input (docs/mtp.md): the embedding `e` of the next token and the main
    model's final hidden state `h` at the same position are each RMS-normalised with their own
    weight, concatenated in that order (embedding first) and projected back to the hidden size by
    `eh_proj` `[hidden, 2 * hidden]`.

    ```mlir
    %x = hybrid.mtp_input %e, %h {epsilon = 1.0e-06 : f64,
        enorm = #hybrid.weight<"model.layers.3.enorm.weight" : tensor<256xbf16>>,
        hnorm = #hybrid.weight<"model.layers.3.hnorm.weight" : tensor<256xbf16>>,
        eh_proj = #hybrid.weight<"model.layers.3.eh_proj.weight" : tensor<256x512xbf16>>}
        : tensor<?x256xbf16>, tensor<?x256xf32> -> tensor<?x256xbf16>
    ```
  }];
  let arguments = (ins Hybrid_Activations:$embedding, Hybrid_Activations:$hidden,
                       F64Attr:$epsilon, Hybrid_WeightAttr:$enorm, Hybrid_WeightAttr:$hnorm,
                       Hybrid_WeightAttr:$eh_proj);
  let results = (outs Hybrid_Activations:$result);
  let assemblyFormat = [{
    $embedding `,` $hidden attr-dict `:` type($embedding) `,` type($hidden) `->` type($result)
  }];
  let hasVerifier = 1;
}

def Hybrid_AddOp : Hybrid_Op<"add", [Pure, Commutative, SameOperandsAndResultType]> {
  let summary = "elementwise sum (residual add, AttnRes partial sums)";
  let description = [{
    ```mlir
    %h1 = hybrid.add %h0, %a : tensor<?x256xbf16>
    ```
  }];
  let arguments = (ins Hybrid_Activations:$lhs, Hybrid_Activations:$rhs);
  let results = (outs Hybrid_Activations:$result);
  let assemblyFormat = "$lhs `,` $rhs attr-dict `:` type($result)";
}

def Hybrid_LmHeadOp : Hybrid_Op<"lm_head", [Pure]> {
  let summary = "vocabulary projection producing fp32 logits";
  let description = [{
    `logits = x W^T`, weight `[vocab, hidden]`, fp32 result.

    ```mlir
    %logits = hybrid.lm_head %x {weight = #hybrid.weight<"lm_head.weight" : tensor<256x256xbf16>>}
        : tensor<?x256xbf16> -> tensor<?x256xf32>
    ```
  }];
  let arguments = (ins Hybrid_Activations:$input, Hybrid_WeightAttr:$weight);
  let results = (outs Hybrid_Logits:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Mixers
//===----------------------------------------------------------------------===//

def Hybrid_KdaOp : Hybrid_Op<"kda", [SameOperandsAndResultType]> {
  let summary = "Kimi Delta Attention: gated delta-rule linear attention with a recurrent state";
  let description = [{
    MODEL_SPEC section 2. Per head (H heads of size K = V = `head_dim`): q, k, v projections, each
    through a causal depthwise short convolution of `conv_kernel` taps and SiLU; L2-normalised q and
    k; the forget gate `g` (per head and key channel, `gate_kind` softplus or lower_bound with
    `gate_lower_bound`) from the low-rank `f_a_proj`/`f_b_proj`, `A_log` and `dt_bias`;
    `beta = sigmoid(b_proj x)`; the delta-rule recurrence on the fp32 state `S` (`state_layout`);
    a gated RMSNorm (`o_norm`, `norm_epsilon`) with the sigmoid output gate from `g_a_proj`/`g_b_proj`
    (or the full-rank `g_proj`), then `o_proj`. Carries per sequence: the recurrent state
    `H x K x V` fp32 and the conv state (`conv_kernel - 1` pre-conv values per channel of q, k, v).

    ```mlir
    %a = hybrid.kda %x {num_heads = 2 : i64, head_dim = 128 : i64, conv_kernel = 4 : i64,
        gate_kind = #hybrid<kda_gate softplus>, state_layout = #hybrid<state_layout k_major>,
        norm_epsilon = 1.000000e-05 : f64,
        q_proj = #hybrid.weight<"model.layers.0.self_attn.q_proj.weight" : tensor<256x256xbf16>>,
        ...} : tensor<?x256xbf16>
    ```
  }];
  let arguments = (ins
    Hybrid_Activations:$input,
    ConfinedAttr<I64Attr, [IntPositive]>:$num_heads,
    ConfinedAttr<I64Attr, [IntPositive]>:$head_dim,
    ConfinedAttr<I64Attr, [IntPositive]>:$conv_kernel,
    Hybrid_KdaGateKindAttr:$gate_kind,
    OptionalAttr<F64Attr>:$gate_lower_bound,
    Hybrid_StateLayoutAttr:$state_layout,
    F64Attr:$norm_epsilon,
    Hybrid_WeightAttr:$q_proj, Hybrid_WeightAttr:$k_proj, Hybrid_WeightAttr:$v_proj,
    Hybrid_WeightAttr:$q_conv1d, Hybrid_WeightAttr:$k_conv1d, Hybrid_WeightAttr:$v_conv1d,
    Hybrid_WeightAttr:$f_a_proj, Hybrid_WeightAttr:$f_b_proj,
    Hybrid_WeightAttr:$A_log, Hybrid_WeightAttr:$dt_bias, Hybrid_WeightAttr:$b_proj,
    OptionalAttr<Hybrid_WeightAttr>:$g_a_proj, OptionalAttr<Hybrid_WeightAttr>:$g_b_proj,
    OptionalAttr<Hybrid_WeightAttr>:$g_proj,
    Hybrid_WeightAttr:$o_norm, Hybrid_WeightAttr:$o_proj
  );
  let results = (outs Hybrid_Activations:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
  let hasVerifier = 1;
}

class Hybrid_MlaBase<string mnemonic> : Hybrid_Op<mnemonic, []> {
  let results = (outs Hybrid_Activations:$result);
  let hasVerifier = 1;
}

def Hybrid_MlaOp : Hybrid_MlaBase<"mla"> {
  let summary = "Multi-head Latent Attention over all causal positions";
  let description = [{
    MODEL_SPEC section 3. Queries come from `q_proj` on the input, or, with a query LoRA
    (`q_lora_rank` set), from `q_b_proj` on the normalised query latent passed as the second
    operand (the `q_a_proj` + `q_a_layernorm` are separate ops so the DSA indexer can share them).
    Keys and values come from the compressed latent `c` (`kv_a_proj_with_mqa`, `kv_a_layernorm`
    with `latent_norm_epsilon`) through `kv_b_proj`; the `qk_rope_head_dim` slice of query and key is
    rotated per `rope` (or concatenated unrotated for `kind = none`). `softmax_scale` already
    includes the YaRN mscale. An optional sigmoid output gate `g_proj` multiplies the attention
    output before `o_proj`. Caches per token: `kv_lora_rank + qk_rope_head_dim` values.

    ```mlir
    %a = hybrid.mla %x {num_heads = 2 : i64, kv_lora_rank = 64 : i64, qk_nope_head_dim = 64 : i64,
        qk_rope_head_dim = 32 : i64, v_head_dim = 64 : i64, rope = #hybrid.rope<kind = none>,
        softmax_scale = 0.102 : f64, latent_norm_epsilon = 1.000000e-06 : f64,
        q_proj = #hybrid.weight<"model.layers.3.self_attn.q_proj.weight" : tensor<192x256xbf16>>,
        ...} : (tensor<?x256xbf16>) -> tensor<?x256xbf16>
    ```
  }];
  let arguments = (ins
    Hybrid_Activations:$input,
    Optional<Hybrid_Activations>:$q_latent,
    ConfinedAttr<I64Attr, [IntPositive]>:$num_heads,
    OptionalAttr<ConfinedAttr<I64Attr, [IntPositive]>>:$q_lora_rank,
    ConfinedAttr<I64Attr, [IntPositive]>:$kv_lora_rank,
    ConfinedAttr<I64Attr, [IntPositive]>:$qk_nope_head_dim,
    ConfinedAttr<I64Attr, [IntNonNegative]>:$qk_rope_head_dim,
    ConfinedAttr<I64Attr, [IntPositive]>:$v_head_dim,
    Hybrid_RopeAttr:$rope,
    F64Attr:$softmax_scale,
    F64Attr:$latent_norm_epsilon,
    OptionalAttr<Hybrid_WeightAttr>:$q_proj,
    OptionalAttr<Hybrid_WeightAttr>:$q_b_proj,
    Hybrid_WeightAttr:$kv_a_proj_with_mqa,
    Hybrid_WeightAttr:$kv_a_layernorm,
    Hybrid_WeightAttr:$kv_b_proj,
    OptionalAttr<Hybrid_WeightAttr>:$g_proj,
    Hybrid_WeightAttr:$o_proj
  );
  let assemblyFormat = "$input (`,` $q_latent^)? attr-dict `:` functional-type(operands, results)";
}

def Hybrid_SparseMlaOp : Hybrid_MlaBase<"sparse_mla"> {
  let summary = "MLA that attends only to the positions chosen by a DSA indexer";
  let description = [{
    MODEL_SPEC section 4.4: `hybrid.mla` restricted, per query token, to the key positions in
    `indices` (`tensor<?xKxi32>`, one row per query; -1 marks an empty slot). All heads share the
    index set. The cache is the same latent cache as MLA; the target quantizes it to FP8 tiles.

    ```mlir
    %a = hybrid.sparse_mla %x, %idx, %qn {num_heads = 2 : i64, q_lora_rank = 96 : i64, ...}
        : (tensor<?x256xbf16>, tensor<?x8xi32>, tensor<?x96xbf16>) -> tensor<?x256xbf16>
    ```
  }];
  let arguments = (ins
    Hybrid_Activations:$input,
    Hybrid_TopKIndices:$indices,
    Optional<Hybrid_Activations>:$q_latent,
    ConfinedAttr<I64Attr, [IntPositive]>:$num_heads,
    OptionalAttr<ConfinedAttr<I64Attr, [IntPositive]>>:$q_lora_rank,
    ConfinedAttr<I64Attr, [IntPositive]>:$kv_lora_rank,
    ConfinedAttr<I64Attr, [IntPositive]>:$qk_nope_head_dim,
    ConfinedAttr<I64Attr, [IntNonNegative]>:$qk_rope_head_dim,
    ConfinedAttr<I64Attr, [IntPositive]>:$v_head_dim,
    Hybrid_RopeAttr:$rope,
    F64Attr:$softmax_scale,
    F64Attr:$latent_norm_epsilon,
    OptionalAttr<Hybrid_WeightAttr>:$q_proj,
    OptionalAttr<Hybrid_WeightAttr>:$q_b_proj,
    Hybrid_WeightAttr:$kv_a_proj_with_mqa,
    Hybrid_WeightAttr:$kv_a_layernorm,
    Hybrid_WeightAttr:$kv_b_proj,
    OptionalAttr<Hybrid_WeightAttr>:$g_proj,
    Hybrid_WeightAttr:$o_proj
  );
  let assemblyFormat = [{
    $input `,` $indices (`,` $q_latent^)? attr-dict `:` functional-type(operands, results)
  }];
}

def Hybrid_DsaIndexerOp : Hybrid_Op<"dsa_indexer", [Pure]> {
  let summary = "DeepSeek lightning indexer: scores past positions and keeps the top-k";
  let description = [{
    MODEL_SPEC section 4.2. Per query token t and past position s <= t:
    `I[t,s] = sum_j w[t,j] * relu(q[t,j] . k[s] / sqrt(index_head_dim))`, with `index_heads` query
    heads from `wq_b` on the shared MLA query latent (second operand), one key per token from `wk`
    and a LayerNorm (`k_norm`, `k_norm_bias`, `norm_epsilon`), head weights from `weights_proj`
    scaled by `index_heads^-1/2`; the `rope_head_dim` leading channels of q and k are rotated per
    `rope`. Returns the `top_k` highest-scoring causal positions per token (fewer valid ones are
    padded with -1). Caches per token one `index_head_dim` key.

    ```mlir
    %idx = hybrid.dsa_indexer %x, %qn {index_heads = 4 : i64, index_head_dim = 64 : i64,
        top_k = 8 : i64, rope_head_dim = 32 : i64, rope = #hybrid.rope<kind = plain, pairing = half_split>,
        norm_epsilon = 1.000000e-06 : f64, wq_b = ..., wk = ..., k_norm = ..., k_norm_bias = ...,
        weights_proj = ...} : (tensor<?x256xbf16>, tensor<?x96xbf16>) -> tensor<?x8xi32>
    ```
  }];
  let arguments = (ins
    Hybrid_Activations:$input,
    Hybrid_Activations:$q_latent,
    ConfinedAttr<I64Attr, [IntPositive]>:$index_heads,
    ConfinedAttr<I64Attr, [IntPositive]>:$index_head_dim,
    ConfinedAttr<I64Attr, [IntPositive]>:$top_k,
    ConfinedAttr<I64Attr, [IntNonNegative]>:$rope_head_dim,
    Hybrid_RopeAttr:$rope,
    F64Attr:$norm_epsilon,
    Hybrid_WeightAttr:$wq_b, Hybrid_WeightAttr:$wk,
    Hybrid_WeightAttr:$k_norm, Hybrid_WeightAttr:$k_norm_bias,
    Hybrid_WeightAttr:$weights_proj
  );
  let results = (outs Hybrid_TopKIndices:$indices);
  let assemblyFormat = "$input `,` $q_latent attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
}

def Hybrid_AttnResOp : Hybrid_Op<"attn_res", [Pure, AllTypesMatch<["partial", "result"]>]> {
  let summary = "Block Attention Residual: softmax mix over completed blocks and the partial sum";
  let description = [{
    MODEL_SPEC section 6.2 (Kimi K3 form). The candidates are the completed block sums `blocks`
    (the first is the embedding) followed by the running `partial` sum of the current block
    (written first, as the op's main operand). Each
    candidate is RMS-normalised without weight; its score is the dot product with
    `norm * proj` (the norm weight folded into the pseudo-query); the result is the softmax-weighted
    sum of the un-normalised candidates, in fp32. `block_size` is the number of decoder layers per
    block; it is carried for the runtime's block bookkeeping. With no completed block (the
    attention-side mix of layer 0) the mix is the partial sum itself; the op is kept so that the
    checkpoint's weights of that mix stay referenced, and passes fold it away.

    ```mlir
    %h = hybrid.attn_res %partial over (%emb, %b1 : tensor<?x256xbf16>, tensor<?x256xbf16>) {block_size = 2 : i64, epsilon = 1.000000e-05 : f64,
        norm = #hybrid.weight<"model.layers.2.self_attention_res_norm.weight" : tensor<256xbf16>>,
        proj = #hybrid.weight<"model.layers.2.self_attention_res_proj.weight" : tensor<1x256xbf16>>}
        : tensor<?x256xbf16>
    ```
  }];
  let arguments = (ins
    Hybrid_Activations:$partial,
    Variadic<Hybrid_Activations>:$blocks,
    ConfinedAttr<I64Attr, [IntPositive]>:$block_size,
    F64Attr:$epsilon,
    Hybrid_WeightAttr:$norm,
    Hybrid_WeightAttr:$proj
  );
  let results = (outs Hybrid_Activations:$result);
  let assemblyFormat = "$partial `over` `(` ($blocks^ `:` type($blocks))? `)` attr-dict `:` type($result)";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Feed-forward
//===----------------------------------------------------------------------===//

def Hybrid_MlpOp : Hybrid_Op<"mlp", [Pure, SameOperandsAndResultType]> {
  let summary = "dense gated MLP (SwiGLU or SiTU)";
  let description = [{
    `y = down_proj(act(gate_proj x, up_proj x))`: `silu` is SwiGLU's `silu(g) * u`; `situ` is
    Kimi K3's `situ_beta * tanh(g / situ_beta) * sigmoid(g) * u'` with
    `u' = situ_linear_beta * tanh(u / situ_linear_beta)` (or `u` without `situ_linear_beta`).

    ```mlir
    %m = hybrid.mlp %x {activation = #hybrid<activation silu>,
        gate_proj = #hybrid.weight<"model.layers.0.mlp.gate_proj.weight" : tensor<256x256xbf16>>,
        up_proj = ..., down_proj = ...} : tensor<?x256xbf16>
    ```
  }];
  let arguments = (ins Hybrid_Activations:$input, Hybrid_ActivationAttr:$activation,
                       Hybrid_WeightAttr:$gate_proj, Hybrid_WeightAttr:$up_proj,
                       Hybrid_WeightAttr:$down_proj, OptionalAttr<F64Attr>:$situ_beta,
                       OptionalAttr<F64Attr>:$situ_linear_beta);
  let results = (outs Hybrid_Activations:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def Hybrid_MoeOp : Hybrid_Op<"moe", [Pure, SameOperandsAndResultType]> {
  let summary = "routed mixture of experts with optional shared experts";
  let description = [{
    MODEL_SPEC section 5. The router (`router`, fp32) scores `num_experts` experts with
    `score_function`; `correction_bias` (if present) is added for selection only; experts are
    split into `num_groups` groups of which the `topk_groups` best (sum of their top-2 biased scores)
    stay eligible; the `top_k` best eligible experts are chosen, their unbiased scores
    renormalised (`renormalize`) and scaled by `routed_scaling_factor`. Each expert is a SwiGLU with
    `intermediate_size`; the shared experts (`num_shared_experts` fused into one SwiGLU of width
    `num_shared_experts * intermediate_size`) are always added, unscaled. `activation` (default
    `silu`, with `situ_beta` / `situ_linear_beta` as in `hybrid.mlp`) applies to every expert.

    Latent MoE (Kimi K3): with `routed_expert_down_proj` [L, hidden] and `routed_expert_up_proj`
    [hidden, L] the routed experts work in an L-wide latent space: the router still reads `x`,
    the experts read `down x`, their weighted sum is RMS-normalised by `routed_expert_norm` [L]
    (when present, epsilon `routed_expert_norm_epsilon`) and lifted back by `up`; the shared
    experts stay at full width.

    ```mlir
    %m = hybrid.moe %x {num_experts = 8 : i64, top_k = 2 : i64, num_groups = 2 : i64,
        topk_groups = 1 : i64, score_function = #hybrid<score_function sigmoid>, renormalize = true,
        routed_scaling_factor = 2.5 : f64, intermediate_size = 64 : i64, num_shared_experts = 1 : i64,
        router = ..., correction_bias = ..., experts_gate_proj = [...], experts_up_proj = [...],
        experts_down_proj = [...], shared_gate_proj = ..., shared_up_proj = ...,
        shared_down_proj = ...} : tensor<?x256xbf16>
    ```
  }];
  let arguments = (ins
    Hybrid_Activations:$input,
    ConfinedAttr<I64Attr, [IntPositive]>:$num_experts,
    ConfinedAttr<I64Attr, [IntPositive]>:$top_k,
    ConfinedAttr<I64Attr, [IntPositive]>:$num_groups,
    ConfinedAttr<I64Attr, [IntPositive]>:$topk_groups,
    Hybrid_ScoreFunctionAttr:$score_function,
    BoolAttr:$renormalize,
    F64Attr:$routed_scaling_factor,
    ConfinedAttr<I64Attr, [IntPositive]>:$intermediate_size,
    ConfinedAttr<I64Attr, [IntNonNegative]>:$num_shared_experts,
    Hybrid_WeightAttr:$router,
    OptionalAttr<Hybrid_WeightAttr>:$correction_bias,
    Hybrid_WeightArrayAttr:$experts_gate_proj,
    Hybrid_WeightArrayAttr:$experts_up_proj,
    Hybrid_WeightArrayAttr:$experts_down_proj,
    OptionalAttr<Hybrid_WeightAttr>:$shared_gate_proj,
    OptionalAttr<Hybrid_WeightAttr>:$shared_up_proj,
    OptionalAttr<Hybrid_WeightAttr>:$shared_down_proj,
    OptionalAttr<Hybrid_ActivationAttr>:$activation,
    OptionalAttr<F64Attr>:$situ_beta,
    OptionalAttr<F64Attr>:$situ_linear_beta,
    OptionalAttr<Hybrid_WeightAttr>:$routed_expert_down_proj,
    OptionalAttr<Hybrid_WeightAttr>:$routed_expert_up_proj,
    OptionalAttr<Hybrid_WeightAttr>:$routed_expert_norm,
    OptionalAttr<F64Attr>:$routed_expert_norm_epsilon
  );
  let results = (outs Hybrid_Activations:$result);
  let assemblyFormat = "$input attr-dict `:` type($result)";
  let hasVerifier = 1;
}

#endif // HYBRID_OPS_TD
