#ifndef HYBRID_ATTRS_TD
#define HYBRID_ATTRS_TD

include "dialects/Hybrid/IR/HybridBase.td"
include "mlir/IR/BuiltinAttributeInterfaces.td"

//===----------------------------------------------------------------------===//
// Enums
//===----------------------------------------------------------------------===//

def Hybrid_KdaGateKind : I32EnumAttr<"KdaGateKind", "KDA forget-gate form", [
    I32EnumAttrCase<"softplus", 0>,     // g = -exp(A_log) * softplus(f + dt_bias)   (Kimi-Linear)
    I32EnumAttrCase<"lower_bound", 1>   // g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))  (K3)
  ]> {
  let cppNamespace = "::hybrid";
  let genSpecializedAttr = 0;
}
def Hybrid_KdaGateKindAttr : EnumAttr<Hybrid_Dialect, Hybrid_KdaGateKind, "kda_gate">;

def Hybrid_StateLayout : I32EnumAttr<"StateLayout", "KDA recurrent-state layout per head", [
    I32EnumAttrCase<"k_major", 0>,  // [K, V]: fla default
    I32EnumAttrCase<"v_major", 1>   // [V, K]: fla state_v_first, Kimi K3
  ]> {
  let cppNamespace = "::hybrid";
  let genSpecializedAttr = 0;
}
def Hybrid_StateLayoutAttr : EnumAttr<Hybrid_Dialect, Hybrid_StateLayout, "state_layout">;

def Hybrid_RopeKind : I32EnumAttr<"RopeKind", "rotary position embedding kind", [
    I32EnumAttrCase<"none", 0>,   // NoPE (Kimi-Linear MLA)
    I32EnumAttrCase<"plain", 1>,
    I32EnumAttrCase<"yarn", 2>
  ]> {
  let cppNamespace = "::hybrid";
  let genSpecializedAttr = 0;
}

def Hybrid_RopePairing : I32EnumAttr<"RopePairing", "which channels RoPE rotates together", [
    I32EnumAttrCase<"interleaved", 0>,  // (x[2i], x[2i+1]): GPT-J style
    I32EnumAttrCase<"half_split", 1>    // (x[i], x[i+d/2]): NeoX style
  ]> {
  let cppNamespace = "::hybrid";
  let genSpecializedAttr = 0;
}

def Hybrid_ScoreFunction : I32EnumAttr<"ScoreFunction", "MoE router score function", [
    I32EnumAttrCase<"sigmoid", 0>,
    I32EnumAttrCase<"softmax", 1>
  ]> {
  let cppNamespace = "::hybrid";
  let genSpecializedAttr = 0;
}
def Hybrid_ScoreFunctionAttr : EnumAttr<Hybrid_Dialect, Hybrid_ScoreFunction, "score_function">;

def Hybrid_Activation : I32EnumAttr<"Activation", "gated-MLP activation", [
    I32EnumAttrCase<"silu", 0>,  // silu(g) * u (SwiGLU)
    I32EnumAttrCase<"situ", 1>   // beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta) (K3)
  ]> {
  let cppNamespace = "::hybrid";
  let genSpecializedAttr = 0;
}
def Hybrid_ActivationAttr : EnumAttr<Hybrid_Dialect, Hybrid_Activation, "activation">;

//===----------------------------------------------------------------------===//
// Attributes
//===----------------------------------------------------------------------===//

def Hybrid_WeightAttr : AttrDef<Hybrid_Dialect, "Weight"> {
  let mnemonic = "weight";
  let summary = "a checkpoint tensor referenced by name, dtype and shape";
  let description = [{
    Names one tensor of the source checkpoint exactly as it is stored (original Hub name), with its
    dtype and shape as a tensor type. The data itself never enters the IR: the weight packer reads
    it from the checkpoint when it writes the weight archive.

    FP8 block-quantized weights (DeepSeek `weight_block_size: [128, 128]`) also name their scale
    tensor (`weight_scale_inv`, fp32, one multiplier per 128x128 block).

    ```mlir
    #hybrid.weight<"model.layers.0.mlp.up_proj.weight" : tensor<18432x7168xbf16>>
    #hybrid.weight<"model.layers.3.mlp.experts.0.up_proj.weight" : tensor<2048x7168xf8E4M3FN>,
                   scale "model.layers.3.mlp.experts.0.up_proj.weight_scale_inv" : tensor<16x56xf32>>
    ```
  }];
  let parameters = (ins
    StringRefParameter<"checkpoint tensor name">:$name,
    "::mlir::RankedTensorType":$type,
    StringRefParameter<"name of the block-scale tensor", "\"\"">:$scale_name,
    OptionalParameter<"::mlir::RankedTensorType">:$scale_type
  );
  let assemblyFormat = [{
    `<` $name `:` $type (`,` `scale` $scale_name^ `:` $scale_type)? `>`
  }];
  let genVerifyDecl = 1;
  let extraClassDeclaration = [{
    ::llvm::ArrayRef<int64_t> getShape() const { return getType().getShape(); }
    ::mlir::Type getElementType() const { return getType().getElementType(); }
    int64_t getNumElements() const { return getType().getNumElements(); }
  }];
}

def Hybrid_WeightArrayAttr : TypedArrayAttrBase<Hybrid_WeightAttr, "array of checkpoint tensors">;

def Hybrid_RopeAttr : AttrDef<Hybrid_Dialect, "Rope"> {
  let mnemonic = "rope";
  let summary = "rotary position embedding: kind, channel pairing and YaRN parameters";
  let description = [{
    `kind = none` is NoPE (Kimi-Linear MLA: the rope slices are concatenated unrotated).
    `plain` rotates by `t * theta^(-2i/d)`; `yarn` blends interpolated and extrapolated frequencies
    (MODEL_SPEC section 3.2) with `factor`, `original_max_position`, `beta_fast`, `beta_slow`, and
    scales the softmax by `(0.1 * mscale_all_dim * ln(factor) + 1)^2` (no scaling when
    `mscale_all_dim` is 0).
    `pairing` says which channels rotate together: `interleaved` (x[2i], x[2i+1]) or `half_split`
    (x[i], x[i + d/2]).

    ```mlir
    #hybrid.rope<kind = none>
    #hybrid.rope<kind = yarn, pairing = interleaved, theta = 1.000000e+04, factor = 4.000000e+01,
                 original_max_position = 4096>
    ```
  }];
  let parameters = (ins
    EnumParameter<Hybrid_RopeKind>:$kind,
    DefaultValuedParameter<"::hybrid::RopePairing", "::hybrid::RopePairing::interleaved">:$pairing,
    DefaultValuedParameter<"::hybrid::Real", "::hybrid::Real{10000.0}">:$theta,
    DefaultValuedParameter<"::hybrid::Real", "::hybrid::Real{1.0}">:$factor,
    DefaultValuedParameter<"int64_t", "0">:$original_max_position,
    DefaultValuedParameter<"::hybrid::Real", "::hybrid::Real{32.0}">:$beta_fast,
    DefaultValuedParameter<"::hybrid::Real", "::hybrid::Real{1.0}">:$beta_slow,
    DefaultValuedParameter<"::hybrid::Real", "::hybrid::Real{1.0}">:$mscale,
    DefaultValuedParameter<"::hybrid::Real", "::hybrid::Real{0.0}">:$mscale_all_dim
  );
  let assemblyFormat = "`<` struct(params) `>`";
  let genVerifyDecl = 1;
}

#endif // HYBRID_ATTRS_TD
