// Verifiers of the `hybrid` ops. Every shape check names the op field, the checkpoint tensor and
// the attributes the expectation comes from, so a wrong checkpoint is diagnosed in one line:
//   'hybrid.kda' op q_proj weight 'model.layers.0.self_attn.q_proj.weight' has shape [256, 255],
//   expected [256, 256] (num_heads * head_dim = 256, hidden = 256)
#include "dialects/Hybrid/IR/HybridDialect.h"

#include "llvm/ADT/STLExtras.h"

#include <string>

using namespace mlir;
using namespace hybrid;

namespace {

std::string formatShape(ArrayRef<int64_t> shape) {
  std::string text = "[";
  for (auto [i, dim] : llvm::enumerate(shape)) {
    if (i)
      text += ", ";
    text += ShapedType::isDynamic(dim) ? std::string("?") : std::to_string(dim);
  }
  return text + "]";
}

LogicalResult checkWeightShape(Operation *op, StringRef role, WeightAttr weight,
                               ArrayRef<int64_t> expected, const std::string &because) {
  if (weight.getShape() == expected)
    return success();
  return op->emitOpError() << role << " weight '" << weight.getName()
                           << "' has shape " << formatShape(weight.getShape()) << ", expected "
                           << formatShape(expected) << " (" << because << ")";
}

// Same, for an optional weight field that must be present in this configuration.
LogicalResult checkRequiredWeight(Operation *op, StringRef role, WeightAttr weight,
                                  ArrayRef<int64_t> expected, const std::string &because,
                                  StringRef whyRequired) {
  if (!weight)
    return op->emitOpError() << "requires the " << role << " weight " << whyRequired;
  return checkWeightShape(op, role, weight, expected, because);
}

LogicalResult checkAbsentWeight(Operation *op, StringRef role, WeightAttr weight,
                                StringRef whyAbsent) {
  if (!weight)
    return success();
  return op->emitOpError() << "has an unexpected " << role << " weight '"
                           << weight.getName() << "' " << whyAbsent;
}

// The feature (last) dimension of a token-major activation; it must be static.
FailureOr<int64_t> featureDim(Operation *op, Value value, StringRef what) {
  auto type = cast<RankedTensorType>(value.getType());
  int64_t dim = type.getDimSize(1);
  if (ShapedType::isDynamic(dim))
    return op->emitOpError() << what << " must have a static feature dimension, got " << type;
  return dim;
}

LogicalResult checkSameTokens(Operation *op, Value a, Value b, StringRef what) {
  int64_t ta = cast<RankedTensorType>(a.getType()).getDimSize(0);
  int64_t tb = cast<RankedTensorType>(b.getType()).getDimSize(0);
  if (ShapedType::isDynamic(ta) || ShapedType::isDynamic(tb) || ta == tb)
    return success();
  return op->emitOpError() << what << " has " << tb << " tokens but the input has " << ta;
}

LogicalResult checkResultFeatures(Operation *op, int64_t expected, const std::string &because) {
  auto type = cast<RankedTensorType>(op->getResult(0).getType());
  if (type.getDimSize(1) == expected)
    return success();
  return op->emitOpError() << "result feature dimension is " << type.getDimSize(1) << ", expected "
                           << expected << " (" << because << ")";
}

std::string eq(StringRef name, int64_t value) { return (name + " = " + Twine(value)).str(); }

} // namespace

//===----------------------------------------------------------------------===//
// Attributes
//===----------------------------------------------------------------------===//

LogicalResult WeightAttr::verify(function_ref<InFlightDiagnostic()> emitError, StringRef name,
                                 RankedTensorType type, StringRef scaleName,
                                 RankedTensorType scaleType) {
  if (name.empty())
    return emitError() << "weight needs a checkpoint tensor name";
  if (!type.hasStaticShape())
    return emitError() << "weight '" << name << "' must have a static shape, got "
                       << type;
  Type element = type.getElementType();
  bool isFp8 = llvm::isa<Float8E4M3FNType>(element);
  if (!isFp8 && !element.isBF16() && !element.isF16() && !element.isF32())
    return emitError() << "weight '" << name
                       << "' has unsupported dtype " << element
                       << " (expected bf16, f16, f32 or f8E4M3FN)";
  if (scaleName.empty() != !scaleType)
    return emitError() << "weight '" << name
                       << "' needs both a scale tensor name and a scale type";
  if (isFp8 && scaleName.empty())
    return emitError() << "fp8 weight '" << name
                       << "' needs its block scale tensor (weight_scale_inv)";
  if (scaleType) {
    if (!scaleType.getElementType().isF32())
      return emitError() << "scale '" << scaleName << "' of weight '" << name
                         << "' must be f32, got " << scaleType.getElementType();
    if (scaleType.getRank() != type.getRank())
      return emitError() << "scale '" << scaleName << "' has rank "
                         << scaleType.getRank() << " but weight '" << name
                         << "' has rank " << type.getRank();
    for (auto [dim, scaleDim] : llvm::zip(type.getShape(), scaleType.getShape()))
      if (scaleDim <= 0 || scaleDim > dim)
        return emitError() << "scale '" << scaleName << "' shape "
                           << formatShape(scaleType.getShape()) << " is not a block grid of weight '"
                           << name << "' shape " << formatShape(type.getShape());
  }
  return success();
}

LogicalResult RopeAttr::verify(function_ref<InFlightDiagnostic()> emitError, RopeKind kind,
                               RopePairing, Real theta, Real factor, int64_t originalMaxPosition,
                               Real betaFast, Real betaSlow, Real mscale, Real mscaleAllDim) {
  if (kind == RopeKind::none)
    return success();
  if (!(theta > 0))
    return emitError() << "rope theta must be positive, got " << theta.value;
  if (kind == RopeKind::yarn) {
    if (!(factor >= 1))
      return emitError() << "yarn rope factor must be >= 1, got " << factor.value;
    if (originalMaxPosition <= 0)
      return emitError() << "yarn rope needs original_max_position > 0, got "
                         << originalMaxPosition;
    if (!(betaFast > betaSlow) || !(betaSlow > 0))
      return emitError() << "yarn rope needs beta_fast > beta_slow > 0, got beta_fast = "
                         << betaFast.value << ", beta_slow = " << betaSlow.value;
    if (!(mscale > 0) || !(mscaleAllDim >= 0))
      return emitError() << "yarn rope mscale must be positive, got " << mscale.value;
  }
  return success();
}

//===----------------------------------------------------------------------===//
// Structure
//===----------------------------------------------------------------------===//

LogicalResult ModelOp::verify() {
  Block &block = getBodyBlock();
  if (block.getNumArguments() != 1 || !isa<RankedTensorType>(block.getArgument(0).getType()) ||
      block.getArgument(0).getType() !=
          RankedTensorType::get({ShapedType::kDynamic}, IntegerType::get(getContext(), 64)))
    return emitOpError() << "body must take exactly one argument of type tensor<?xi64> (token ids)";
  if (block.empty() || !isa<ReturnOp>(block.back()))
    return emitOpError() << "body must end with hybrid.return";
  auto logits = cast<RankedTensorType>(cast<ReturnOp>(block.back()).getLogits().getType());
  if (logits.getDimSize(1) != static_cast<int64_t>(getVocabSize()))
    return emitOpError() << "returns logits of width " << logits.getDimSize(1)
                         << " but vocab_size = " << getVocabSize();
  if (getHiddenSize() <= 0 || getVocabSize() <= 0 || getNumLayers() <= 0)
    return emitOpError() << "hidden_size, vocab_size and num_layers must be positive";
  if (std::optional<StringRef> scale = getFp8ActivationScale();
      scale && *scale != "amax" && *scale != "ue8m0")
    return emitOpError() << "fp8_activation_scale must be \"amax\" or \"ue8m0\", got \"" << *scale
                         << "\"";
  if (Block *mtp = getMtpBlock()) {
    auto hidden = mtp->getNumArguments() == 2
                      ? dyn_cast<RankedTensorType>(mtp->getArgument(1).getType())
                      : RankedTensorType();
    if (!hidden || mtp->getArgument(0).getType() != block.getArgument(0).getType() ||
        hidden.getRank() != 2 || hidden.getDimSize(1) != static_cast<int64_t>(getHiddenSize()))
      return emitOpError() << "mtp region must take the next token ids (tensor<?xi64>) and the "
                              "main model's hidden states (tensor<?x"
                           << getHiddenSize() << "x...>)";
    if (mtp->empty() || !isa<ReturnOp>(mtp->back()))
      return emitOpError() << "mtp region must end with hybrid.return";
    auto mtpLogits = cast<RankedTensorType>(cast<ReturnOp>(mtp->back()).getLogits().getType());
    if (mtpLogits.getDimSize(1) != static_cast<int64_t>(getVocabSize()))
      return emitOpError() << "mtp region returns logits of width " << mtpLogits.getDimSize(1)
                           << " but vocab_size = " << getVocabSize();
  }
  return success();
}

//===----------------------------------------------------------------------===//
// Decoder glue
//===----------------------------------------------------------------------===//

LogicalResult EmbedOp::verify() {
  FailureOr<int64_t> hidden = featureDim(*this, getResult(), "result");
  if (failed(hidden))
    return failure();
  if (getWeight().getType().getRank() != 2)
    return emitOpError() << "weight '" << getWeight().getName()
                         << "' must be [vocab, hidden], got "
                         << formatShape(getWeight().getShape());
  return checkWeightShape(*this, "weight", getWeight(), {getWeight().getShape()[0], *hidden},
                          eq("hidden", *hidden));
}

LogicalResult RmsNormOp::verify() {
  FailureOr<int64_t> hidden = featureDim(*this, getInput(), "input");
  if (failed(hidden))
    return failure();
  if (!(getEpsilon().convertToDouble() > 0))
    return emitOpError() << "epsilon must be positive";
  return checkWeightShape(*this, "weight", getWeight(), {*hidden}, eq("hidden", *hidden));
}

LogicalResult LinearOp::verify() {
  FailureOr<int64_t> in = featureDim(*this, getInput(), "input");
  FailureOr<int64_t> out = featureDim(*this, getResult(), "result");
  if (failed(in) || failed(out) || failed(checkSameTokens(*this, getInput(), getResult(), "result")))
    return failure();
  return checkWeightShape(*this, "weight", getWeight(), {*out, *in},
                          eq("out", *out) + ", " + eq("in", *in));
}

LogicalResult MtpInputOp::verify() {
  FailureOr<int64_t> hidden = featureDim(*this, getResult(), "result");
  FailureOr<int64_t> embedded = featureDim(*this, getEmbedding(), "embedding");
  FailureOr<int64_t> previous = featureDim(*this, getHidden(), "hidden");
  if (failed(hidden) || failed(embedded) || failed(previous) ||
      failed(checkSameTokens(*this, getEmbedding(), getResult(), "result")) ||
      failed(checkSameTokens(*this, getHidden(), getResult(), "result")))
    return failure();
  if (*embedded != *hidden || *previous != *hidden)
    return emitOpError() << "embedding (" << *embedded << ") and hidden (" << *previous
                         << ") must both have the result's width " << *hidden;
  if (failed(checkWeightShape(*this, "enorm", getEnorm(), {*hidden}, eq("hidden", *hidden))) ||
      failed(checkWeightShape(*this, "hnorm", getHnorm(), {*hidden}, eq("hidden", *hidden))))
    return failure();
  return checkWeightShape(*this, "eh_proj", getEhProj(), {*hidden, 2 * *hidden},
                          eq("hidden", *hidden) + ": [hidden, 2 * hidden]");
}

LogicalResult LmHeadOp::verify() {
  FailureOr<int64_t> hidden = featureDim(*this, getInput(), "input");
  FailureOr<int64_t> vocab = featureDim(*this, getResult(), "result");
  if (failed(hidden) || failed(vocab) ||
      failed(checkSameTokens(*this, getInput(), getResult(), "result")))
    return failure();
  return checkWeightShape(*this, "weight", getWeight(), {*vocab, *hidden},
                          eq("vocab", *vocab) + ", " + eq("hidden", *hidden));
}

//===----------------------------------------------------------------------===//
// Mixers
//===----------------------------------------------------------------------===//

LogicalResult KdaOp::verify() {
  FailureOr<int64_t> hiddenOr = featureDim(*this, getInput(), "input");
  if (failed(hiddenOr))
    return failure();
  const int64_t d = *hiddenOr, h = getNumHeads(), k = getHeadDim(), w = getConvKernel();
  const int64_t p = h * k;
  const std::string proj = eq("num_heads * head_dim", p) + ", " + eq("hidden", d);
  Operation *op = *this;

  if (getGateKind() == KdaGateKind::lower_bound) {
    if (!getGateLowerBound())
      return emitOpError() << "gate_kind lower_bound requires gate_lower_bound";
    if (!(getGateLowerBound()->convertToDouble() < 0))
      return emitOpError() << "gate_lower_bound must be negative, got "
                           << getGateLowerBound()->convertToDouble();
  } else if (getGateLowerBound()) {
    return emitOpError() << "gate_lower_bound is only meaningful with gate_kind lower_bound";
  }
  if (!(getNormEpsilon().convertToDouble() > 0))
    return emitOpError() << "norm_epsilon must be positive";

  for (auto [role, weight] : {std::pair{"q_proj", getQProj()}, {"k_proj", getKProj()},
                              {"v_proj", getVProj()}})
    if (failed(checkWeightShape(op, role, weight, {p, d}, proj)))
      return failure();
  for (auto [role, weight] : {std::pair{"q_conv1d", getQConv1d()}, {"k_conv1d", getKConv1d()},
                              {"v_conv1d", getVConv1d()}})
    if (failed(checkWeightShape(op, role, weight, {p, 1, w},
                                eq("num_heads * head_dim", p) + ", " + eq("conv_kernel", w))))
      return failure();

  // The forget gate is low rank: f_a_proj [rank, hidden], f_b_proj [P, rank].
  WeightAttr fa = getFAProj(), fb = getFBProj();
  if (fa.getType().getRank() != 2 || fa.getShape()[1] != d)
    return checkWeightShape(op, "f_a_proj", fa, {fa.getShape()[0], d}, eq("hidden", d));
  if (failed(checkWeightShape(op, "f_b_proj", fb, {p, fa.getShape()[0]},
                              eq("num_heads * head_dim", p) + ", f_a_proj rank = " +
                                  std::to_string(fa.getShape()[0]))))
    return failure();

  if (getALog().getNumElements() != h)
    return emitOpError() << "A_log weight '" << getALog().getName() << "' has shape "
                         << formatShape(getALog().getShape()) << ", expected " << h
                         << " values (" << eq("num_heads", h) << ")";
  if (failed(checkWeightShape(op, "dt_bias", getDtBias(), {p}, eq("num_heads * head_dim", p))) ||
      failed(checkWeightShape(op, "b_proj", getBProj(), {h, d},
                              eq("num_heads", h) + ", " + eq("hidden", d))))
    return failure();

  // Output gate: low rank (g_a_proj + g_b_proj, Kimi-Linear) or full rank (g_proj, K3).
  if (getGProj()) {
    if (getGAProj() || getGBProj())
      return emitOpError() << "has both the full-rank output gate g_proj and the low-rank "
                              "g_a_proj/g_b_proj; expected one of them";
    if (failed(checkWeightShape(op, "g_proj", *getGProj(), {p, d}, proj)))
      return failure();
  } else {
    if (!getGAProj() || !getGBProj())
      return emitOpError() << "requires the output gate: g_a_proj and g_b_proj, or g_proj";
    WeightAttr ga = *getGAProj(), gb = *getGBProj();
    if (ga.getType().getRank() != 2 || ga.getShape()[1] != d)
      return checkWeightShape(op, "g_a_proj", ga, {ga.getShape()[0], d}, eq("hidden", d));
    if (failed(checkWeightShape(op, "g_b_proj", gb, {p, ga.getShape()[0]},
                                eq("num_heads * head_dim", p) + ", g_a_proj rank = " +
                                    std::to_string(ga.getShape()[0]))))
      return failure();
  }
  if (failed(checkWeightShape(op, "o_norm", getONorm(), {k}, eq("head_dim", k))))
    return failure();
  return checkWeightShape(op, "o_proj", getOProj(), {d, p},
                          eq("hidden", d) + ", " + eq("num_heads * head_dim", p));
}

namespace {

// Shared by hybrid.mla and hybrid.sparse_mla.
template <typename MlaLikeOp> LogicalResult verifyMla(MlaLikeOp op) {
  FailureOr<int64_t> hiddenOr = featureDim(op, op.getInput(), "input");
  if (failed(hiddenOr))
    return failure();
  const int64_t d = *hiddenOr, n = op.getNumHeads(), dn = op.getQkNopeHeadDim(),
                dr = op.getQkRopeHeadDim(), dv = op.getVHeadDim(), rkv = op.getKvLoraRank();
  Operation *o = op;
  if (failed(checkResultFeatures(o, d, eq("hidden", d))))
    return failure();
  if (op.getRope().getKind() != RopeKind::none && dr % 2 != 0)
    return op.emitOpError() << "rotary embedding needs an even qk_rope_head_dim, got " << dr;
  if (!(op.getSoftmaxScale().convertToDouble() > 0) ||
      !(op.getLatentNormEpsilon().convertToDouble() > 0))
    return op.emitOpError() << "softmax_scale and latent_norm_epsilon must be positive";

  const int64_t qOut = n * (dn + dr);
  const std::string qWhy = eq("num_heads * (qk_nope_head_dim + qk_rope_head_dim)", qOut);
  auto qProj = op.getQProj().value_or(WeightAttr());
  auto qbProj = op.getQBProj().value_or(WeightAttr());
  if (std::optional<uint64_t> rank = op.getQLoraRank()) {
    const int64_t rq = static_cast<int64_t>(*rank);
    if (!op.getQLatent())
      return op.emitOpError() << "q_lora_rank = " << rq
                              << " requires the query latent operand (q_a_layernorm output)";
    FailureOr<int64_t> latent = featureDim(o, op.getQLatent(), "query latent");
    if (failed(latent) || failed(checkSameTokens(o, op.getInput(), op.getQLatent(), "query latent")))
      return failure();
    if (*latent != rq)
      return op.emitOpError() << "query latent has " << *latent << " features but q_lora_rank = "
                              << rq;
    if (failed(checkAbsentWeight(o, "q_proj", qProj, "when q_lora_rank is set")) ||
        failed(checkRequiredWeight(o, "q_b_proj", qbProj, {qOut, rq},
                                   qWhy + ", " + eq("q_lora_rank", rq), "when q_lora_rank is set")))
      return failure();
  } else {
    if (op.getQLatent())
      return op.emitOpError() << "has a query latent operand but no q_lora_rank";
    if (failed(checkAbsentWeight(o, "q_b_proj", qbProj, "without q_lora_rank")) ||
        failed(checkRequiredWeight(o, "q_proj", qProj, {qOut, d}, qWhy + ", " + eq("hidden", d),
                                   "without q_lora_rank")))
      return failure();
  }
  if (failed(checkWeightShape(o, "kv_a_proj_with_mqa", op.getKvAProjWithMqa(), {rkv + dr, d},
                              eq("kv_lora_rank + qk_rope_head_dim", rkv + dr) + ", " +
                                  eq("hidden", d))) ||
      failed(checkWeightShape(o, "kv_a_layernorm", op.getKvALayernorm(), {rkv},
                              eq("kv_lora_rank", rkv))) ||
      failed(checkWeightShape(o, "kv_b_proj", op.getKvBProj(), {n * (dn + dv), rkv},
                              eq("num_heads * (qk_nope_head_dim + v_head_dim)", n * (dn + dv)) +
                                  ", " + eq("kv_lora_rank", rkv))) ||
      failed(checkWeightShape(o, "o_proj", op.getOProj(), {d, n * dv},
                              eq("hidden", d) + ", " + eq("num_heads * v_head_dim", n * dv))))
    return failure();
  if (auto gate = op.getGProj())
    return checkWeightShape(o, "g_proj", *gate, {n * dv, d},
                            eq("num_heads * v_head_dim", n * dv) + ", " + eq("hidden", d));
  return success();
}

} // namespace

LogicalResult MlaOp::verify() { return verifyMla(*this); }

LogicalResult SparseMlaOp::verify() {
  if (failed(checkSameTokens(*this, getInput(), getIndices(), "indices")))
    return failure();
  return verifyMla(*this);
}

LogicalResult DsaIndexerOp::verify() {
  FailureOr<int64_t> hiddenOr = featureDim(*this, getInput(), "input");
  FailureOr<int64_t> latentOr = featureDim(*this, getQLatent(), "query latent");
  if (failed(hiddenOr) || failed(latentOr) ||
      failed(checkSameTokens(*this, getInput(), getQLatent(), "query latent")))
    return failure();
  const int64_t d = *hiddenOr, rq = *latentOr, hi = getIndexHeads(), di = getIndexHeadDim(),
                dr = getRopeHeadDim(), k = getTopK();
  Operation *op = *this;
  if (dr > di)
    return emitOpError() << "rope_head_dim = " << dr << " exceeds index_head_dim = " << di;
  if (getRope().getKind() != RopeKind::none && dr % 2 != 0)
    return emitOpError() << "rotary embedding needs an even rope_head_dim, got " << dr;
  if (failed(checkResultFeatures(op, k, eq("top_k", k))) ||
      failed(checkSameTokens(op, getInput(), getIndices(), "result")))
    return failure();
  if (!(getNormEpsilon().convertToDouble() > 0))
    return emitOpError() << "norm_epsilon must be positive";
  if (failed(checkWeightShape(op, "wq_b", getWqB(), {hi * di, rq},
                              eq("index_heads * index_head_dim", hi * di) + ", " +
                                  eq("query latent", rq))) ||
      failed(checkWeightShape(op, "wk", getWk(), {di, d},
                              eq("index_head_dim", di) + ", " + eq("hidden", d))) ||
      failed(checkWeightShape(op, "k_norm", getKNorm(), {di}, eq("index_head_dim", di))) ||
      failed(checkWeightShape(op, "k_norm_bias", getKNormBias(), {di}, eq("index_head_dim", di))))
    return failure();
  return checkWeightShape(op, "weights_proj", getWeightsProj(), {hi, d},
                          eq("index_heads", hi) + ", " + eq("hidden", d));
}

LogicalResult AttnResOp::verify() {
  FailureOr<int64_t> hiddenOr = featureDim(*this, getPartial(), "partial sum");
  if (failed(hiddenOr))
    return failure();
  const int64_t d = *hiddenOr;
  for (auto [i, block] : llvm::enumerate(getBlocks()))
    if (block.getType() != getPartial().getType())
      return emitOpError() << "block " << i << " has type " << block.getType()
                           << " but the partial sum has type " << getPartial().getType();
  if (getResult().getType() != getPartial().getType())
    return emitOpError() << "result type must match the partial sum";
  if (!(getEpsilon().convertToDouble() > 0))
    return emitOpError() << "epsilon must be positive";
  if (failed(checkWeightShape(*this, "norm", getNorm(), {d}, eq("hidden", d))))
    return failure();
  return checkWeightShape(*this, "proj", getProj(), {1, d}, eq("hidden", d));
}

//===----------------------------------------------------------------------===//
// Feed-forward
//===----------------------------------------------------------------------===//

namespace {

LogicalResult verifyGatedMlp(Operation *op, StringRef prefix, WeightAttr gate, WeightAttr up,
                             WeightAttr down, int64_t d, int64_t width, const std::string &why) {
  const std::string gateRole = (prefix + "gate_proj").str(), upRole = (prefix + "up_proj").str(),
                    downRole = (prefix + "down_proj").str();
  if (failed(checkWeightShape(op, gateRole, gate, {width, d}, why + ", " + eq("hidden", d))) ||
      failed(checkWeightShape(op, upRole, up, {width, d}, why + ", " + eq("hidden", d))))
    return failure();
  return checkWeightShape(op, downRole, down, {d, width}, eq("hidden", d) + ", " + why);
}

// SiTU needs its positive beta (and, when given, a positive linear beta); SiLU takes neither.
LogicalResult verifyActivation(Operation *op, Activation activation,
                               std::optional<APFloat> beta, std::optional<APFloat> linearBeta) {
  if (activation == Activation::silu) {
    if (beta || linearBeta)
      return op->emitOpError() << "situ_beta and situ_linear_beta are only meaningful with the "
                                  "situ activation";
    return success();
  }
  if (!beta || !(beta->convertToDouble() > 0))
    return op->emitOpError() << "the situ activation requires a positive situ_beta";
  if (linearBeta && !(linearBeta->convertToDouble() > 0))
    return op->emitOpError() << "situ_linear_beta must be positive when given";
  return success();
}

} // namespace

LogicalResult MlpOp::verify() {
  FailureOr<int64_t> hidden = featureDim(*this, getInput(), "input");
  if (failed(hidden))
    return failure();
  WeightAttr gate = getGateProj();
  if (gate.getType().getRank() != 2)
    return emitOpError() << "gate_proj weight '" << gate.getName()
                         << "' must be [intermediate, hidden], got "
                         << formatShape(gate.getShape());
  const int64_t width = gate.getShape()[0];
  if (failed(verifyActivation(*this, getActivation(), getSituBeta(), getSituLinearBeta())))
    return failure();
  return verifyGatedMlp(*this, "", gate, getUpProj(), getDownProj(), *hidden, width,
                        eq("intermediate", width));
}

LogicalResult MoeOp::verify() {
  FailureOr<int64_t> hiddenOr = featureDim(*this, getInput(), "input");
  if (failed(hiddenOr))
    return failure();
  const int64_t d = *hiddenOr, e = getNumExperts(), k = getTopK(), g = getNumGroups(),
                kg = getTopkGroups(), width = getIntermediateSize(), ns = getNumSharedExperts();
  Operation *op = *this;
  if (e % g != 0)
    return emitOpError() << "num_experts = " << e << " is not divisible by num_groups = " << g;
  if (kg > g)
    return emitOpError() << "topk_groups = " << kg << " exceeds num_groups = " << g;
  if (k > kg * (e / g))
    return emitOpError() << "top_k = " << k << " exceeds the " << kg * (e / g)
                         << " experts in the topk_groups = " << kg << " eligible groups";
  if (!(getRoutedScalingFactor().convertToDouble() > 0))
    return emitOpError() << "routed_scaling_factor must be positive";
  if (failed(checkWeightShape(op, "router", getRouter(), {e, d},
                              eq("num_experts", e) + ", " + eq("hidden", d))))
    return failure();
  if (auto bias = getCorrectionBias())
    if (failed(checkWeightShape(op, "correction_bias", *bias, {e}, eq("num_experts", e))))
      return failure();

  for (auto [role, experts] : {std::pair{"experts_gate_proj", getExpertsGateProj()},
                               {"experts_up_proj", getExpertsUpProj()},
                               {"experts_down_proj", getExpertsDownProj()}})
    if (static_cast<int64_t>(experts.size()) != e)
      return emitOpError() << role << " lists " << experts.size() << " weights, expected "
                           << eq("num_experts", e);
  if (failed(verifyActivation(op, getActivation().value_or(Activation::silu), getSituBeta(),
                              getSituLinearBeta())))
    return failure();

  // Latent MoE: the routed experts read and write the latent width L.
  int64_t expertWidth = d;
  auto latentDown = getRoutedExpertDownProj(), latentUp = getRoutedExpertUpProj();
  auto latentNorm = getRoutedExpertNorm();
  if (latentDown.has_value() != latentUp.has_value())
    return emitOpError() << "latent MoE needs both routed_expert_down_proj and "
                            "routed_expert_up_proj";
  if (latentNorm && !latentDown)
    return emitOpError() << "routed_expert_norm without the latent projections";
  if (latentNorm.has_value() != getRoutedExpertNormEpsilon().has_value())
    return emitOpError() << "routed_expert_norm and routed_expert_norm_epsilon go together";
  if (latentDown) {
    if (latentDown->getType().getRank() != 2)
      return emitOpError() << "routed_expert_down_proj weight '" << latentDown->getName()
                           << "' must be [latent, hidden], got "
                           << formatShape(latentDown->getShape());
    expertWidth = latentDown->getShape()[0];
    if (failed(checkWeightShape(op, "routed_expert_down_proj", *latentDown, {expertWidth, d},
                                eq("latent", expertWidth) + ", " + eq("hidden", d))) ||
        failed(checkWeightShape(op, "routed_expert_up_proj", *latentUp, {d, expertWidth},
                                eq("hidden", d) + ", " + eq("latent", expertWidth))))
      return failure();
    if (latentNorm && failed(checkWeightShape(op, "routed_expert_norm", *latentNorm,
                                              {expertWidth}, eq("latent", expertWidth))))
      return failure();
  }
  for (int64_t i = 0; i < e; ++i) {
    auto gate = cast<WeightAttr>(getExpertsGateProj()[i]);
    auto up = cast<WeightAttr>(getExpertsUpProj()[i]);
    auto down = cast<WeightAttr>(getExpertsDownProj()[i]);
    if (failed(verifyGatedMlp(op, "experts_", gate, up, down, expertWidth, width,
                              eq("intermediate_size", width))))
      return failure();
  }

  auto sharedGate = getSharedGateProj().value_or(WeightAttr());
  auto sharedUp = getSharedUpProj().value_or(WeightAttr());
  auto sharedDown = getSharedDownProj().value_or(WeightAttr());
  if (ns == 0) {
    if (sharedGate || sharedUp || sharedDown)
      return emitOpError() << "has shared-expert weights but num_shared_experts = 0";
    return success();
  }
  if (!sharedGate || !sharedUp || !sharedDown)
    return emitOpError() << "num_shared_experts = " << ns
                         << " requires shared_gate_proj, shared_up_proj and shared_down_proj";
  return verifyGatedMlp(op, "shared_", sharedGate, sharedUp, sharedDown, d, ns * width,
                        eq("num_shared_experts * intermediate_size", ns * width));
}

int32_t hybrid::layerOf(Operation *op) {
  auto name = dyn_cast<NameLoc>(op->getLoc());
  if (!name)
    return -1;
  StringRef rest = name.getName().getValue();
  int32_t layer = -1;
  if (!rest.consume_front("model.layers.") || rest.consumeInteger(10, layer))
    return -1;
  return layer;
}

#define GET_OP_CLASSES
#include "dialects/Hybrid/IR/HybridOps.cpp.inc"
