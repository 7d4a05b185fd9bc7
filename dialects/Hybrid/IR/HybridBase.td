#ifndef HYBRID_BASE_TD
#define HYBRID_BASE_TD

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/EnumAttr.td"

def Hybrid_Dialect : Dialect {
  let name = "hybrid";
  let cppNamespace = "::hybrid";
  let summary = "Layer-level IR of hybrid-attention LLMs";
  let description = [{
    One op per layer family of hybrid-attention models: KDA (gated delta-rule linear attention),
    MLA, the DeepSeek sparse-attention indexer and sparse MLA, Block Attention Residuals, MoE and
    dense MLPs, plus the glue of a decoder (embedding, RMSNorm, projection, residual add, LM head).

    Activations are ranked tensors with a dynamic token dimension (`tensor<?x2304xbf16>`).
    Weights are never inlined: every op refers to its parameters by checkpoint tensor name, dtype
    and shape through `#hybrid.weight` attributes, and the verifiers check each shape against the
    op's attributes, naming the offending field and tensor. The math of every op is specified in
    `MODEL_SPEC.md`; section numbers below refer to it.
  }];
  let useDefaultAttributePrinterParser = 1;
}

class Hybrid_Op<string mnemonic, list<Trait> traits = []>
    : Op<Hybrid_Dialect, mnemonic, traits>;

#endif // HYBRID_BASE_TD
