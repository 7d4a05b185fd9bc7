// --hybrid-annotate-quantization: precision by role, from a policy given as data (Passes.td).
#include "compiler/Transforms/Passes.h"

#include "mlir/IR/Builders.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"

namespace hybrid {
#define GEN_PASS_DEF_ANNOTATEQUANTIZATION
#include "compiler/Transforms/Passes.h.inc"
} // namespace hybrid

using namespace mlir;

namespace hybrid {
namespace {

// The precision of each role. Defaults: DeepSeek's hierarchy.
// The indexer's query and key activations: MXFP8 (one E8M0 scale per 32), or DeepSeek-V3.2's own
// FP8 (one power-of-two scale per query head and per key, MODEL_SPEC 4.3), or full precision.
// In the order of the policy field's values.
enum class IndexerQuant { Mxfp8, Fp8, None };

struct QuantizationPolicy {
  IndexerQuant indexer = IndexerQuant::Mxfp8; // indexer query and key activations
  bool sparseKvFp8 = true;    // the sparse-attention (DSA) latent cache
  bool denseKvFp8 = false;    // the latent cache of MLA layers without an indexer (opt-in)
  int32_t kvTile = 128;       // elements per scale of the FP8 KV cache
};

// "default", "none", or a JSON file:
//   {"indexer_qk": "mxfp8"|"fp8"|"none", "sparse_attention_kv_cache": "fp8_tiles"|"none",
//    "dense_attention_kv_cache": "fp8_tiles"|"none", "kv_tile": 128, "projections": "bf16"}
FailureOr<QuantizationPolicy> loadPolicy(StringRef spec, Operation *op) {
  QuantizationPolicy policy;
  if (spec == "default")
    return policy;
  if (spec == "none") {
    policy.indexer = IndexerQuant::None;
    policy.sparseKvFp8 = false;
    return policy;
  }
  auto buffer = llvm::MemoryBuffer::getFile(spec);
  if (!buffer)
    return op->emitError() << "quantization policy '" << spec << "': cannot read: "
                           << buffer.getError().message();
  llvm::Expected<llvm::json::Value> json = llvm::json::parse((*buffer)->getBuffer());
  if (!json)
    return op->emitError() << "quantization policy '" << spec
                           << "': malformed JSON: " << llvm::toString(json.takeError());
  const llvm::json::Object *root = json->getAsObject();
  if (!root)
    return op->emitError() << "quantization policy '" << spec << "': expected a JSON object";
  // The index in `values` of the string a field names; `absent` where the field is missing.
  auto choice = [&](StringRef field, ArrayRef<StringRef> values,
                    size_t absent) -> FailureOr<size_t> {
    const llvm::json::Value *value = root->get(field);
    if (!value)
      return absent;
    if (std::optional<StringRef> text = value->getAsString())
      if (const auto *found = llvm::find(values, *text); found != values.end())
        return size_t(found - values.begin());
    std::string allowed;
    for (size_t i = 0; i < values.size(); ++i)
      allowed += (i == 0                   ? ""
                  : i + 1 == values.size() ? " or "
                                           : ", ") +
                 ("\"" + values[i] + "\"").str();
    return op->emitError() << "quantization policy '" << spec << "': field '" << field
                           << "' must be " << allowed;
  };
  for (const auto &[key, value] : *root) {
    if (key != "indexer_qk" && key != "sparse_attention_kv_cache" &&
        key != "dense_attention_kv_cache" && key != "kv_tile" && key != "projections")
      return op->emitError() << "quantization policy '" << spec << "': unknown field '"
                             << key.str() << "'";
  }
  const StringRef indexerValues[] = {"mxfp8", "fp8", "none"}; // IndexerQuant's order
  const StringRef kvValues[] = {"fp8_tiles", "none"};
  FailureOr<size_t> indexer = choice("indexer_qk", indexerValues, size_t(policy.indexer));
  FailureOr<size_t> sparseKv =
      choice("sparse_attention_kv_cache", kvValues, policy.sparseKvFp8 ? 0 : 1);
  FailureOr<size_t> denseKv =
      choice("dense_attention_kv_cache", kvValues, policy.denseKvFp8 ? 0 : 1);
  if (failed(indexer) || failed(sparseKv) || failed(denseKv))
    return failure();
  policy.indexer = IndexerQuant(*indexer);
  policy.sparseKvFp8 = *sparseKv == 0;
  policy.denseKvFp8 = *denseKv == 0;
  if (const llvm::json::Value *tile = root->get("kv_tile")) {
    std::optional<int64_t> value = tile->getAsInteger();
    if (!value || *value <= 0 || *value > 4096)
      return op->emitError() << "quantization policy '" << spec
                             << "': field 'kv_tile' must be an integer in 1..4096";
    policy.kvTile = static_cast<int32_t>(*value);
  }
  if (const llvm::json::Value *projections = root->get("projections"))
    if (projections->getAsString() != StringRef("bf16"))
      return op->emitError() << "quantization policy '" << spec
                             << "': field 'projections' must be \"bf16\" (the checkpoint's "
                                "precision; FP8 projections come from FP8 checkpoints)";
  return policy;
}

LogicalResult annotate(plan::PlanOp planOp, const QuantizationPolicy &policy) {
  Builder builder(planOp.getContext());
  if (policy.indexer != IndexerQuant::None) {
    const bool mxfp8 = policy.indexer == IndexerQuant::Mxfp8;
    WalkResult result = planOp.walk([&](plan::DispatchOp dispatch) {
      if (dispatch.getKernel() != plan::KernelId::indexer_query &&
          dispatch.getKernel() != plan::KernelId::indexer_key)
        return WalkResult::advance();
      auto headDim = dispatch.getParams().getAs<IntegerAttr>("index_head_dim");
      if (mxfp8 && (!headDim || headDim.getInt() % 32 != 0)) {
        dispatch.emitOpError() << "MXFP8 needs index_head_dim to be a multiple of 32 (one E8M0 "
                                  "scale per 32 elements of a head)";
        return WalkResult::interrupt();
      }
      NamedAttrList params(dispatch.getParams());
      params.set("quantize", builder.getStringAttr(mxfp8 ? "mxfp8" : "fp8"));
      dispatch.setParamsAttr(params.getDictionary(builder.getContext()));
      return WalkResult::advance();
    });
    if (result.wasInterrupted())
      return failure();
  }
  // The sparse-attention cache: the KV layers that carry indexer keys (DSA layers); the dense
  // one: the other MLA layers' (Kimi's), when the policy asks.
  for (plan::KvCacheLayerOp layer : planOp.getBodyBlock().getOps<plan::KvCacheLayerOp>())
    if (layer.getIndexKeyDim() > 0 ? policy.sparseKvFp8 : policy.denseKvFp8) {
      layer.setQuantAttr(builder.getStringAttr("fp8_tiles"));
      layer.setQuantTileAttr(builder.getI32IntegerAttr(policy.kvTile));
    }
  return success();
}

struct AnnotateQuantizationPass : impl::AnnotateQuantizationBase<AnnotateQuantizationPass> {
  using AnnotateQuantizationBase::AnnotateQuantizationBase;
  void runOnOperation() override {
    FailureOr<QuantizationPolicy> loaded = loadPolicy(policy, getOperation());
    if (failed(loaded))
      return signalPassFailure();
    for (plan::PlanOp planOp : getOperation().getOps<plan::PlanOp>())
      if (failed(annotate(planOp, *loaded)))
        return signalPassFailure();
  }
};

} // namespace
} // namespace hybrid
