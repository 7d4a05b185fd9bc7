#include "compiler/Import/Importer.h"

#include "compiler/Import/Checkpoint.h"
#include "compiler/Import/ModelConfig.h"
#include "dialects/Hybrid/IR/HybridDialect.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/Verifier.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/Regex.h"

#include <cmath>
#include <set>

using namespace mlir;

namespace hybrid::import {
namespace {

std::string expand(std::string text, int64_t layer, int64_t expert) {
  auto replace = [&](const std::string &key, int64_t value) {
    for (size_t at = text.find(key); at != std::string::npos; at = text.find(key))
      text.replace(at, key.size(), std::to_string(value));
  };
  if (layer >= 0)
    replace("{layer}", layer);
  if (expert >= 0)
    replace("{expert}", expert);
  return text;
}

// Runs an attribute verifier and returns its diagnostic, if any, instead of printing it.
template <typename VerifyFn>
std::optional<std::string> attributeError(MLIRContext &context, VerifyFn &&verifyFn) {
  std::string message;
  ScopedDiagnosticHandler handler(&context, [&](Diagnostic &diag) {
    if (message.empty())
      message = diag.str();
    return success();
  });
  auto diagnose = [&]() { return mlir::emitError(UnknownLoc::get(&context)); };
  if (succeeded(verifyFn(diagnose)))
    return std::nullopt;
  return message;
}

std::string shapeText(ArrayRef<int64_t> shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

class ModelImporter {
public:
  ModelImporter(MLIRContext &context, const Checkpoint &checkpoint,
                const ArchitectureMapping &mapping)
      : context_(context), builder_(&context), checkpoint_(checkpoint), mapping_(mapping),
        config_(checkpoint.config(), mapping, checkpoint.configPath()) {}

  StatusOr<OwningOpRef<ModuleOp>> run();

private:
  // A checkpoint weight for `group.role` of a layer (and expert); a null attribute when `required`
  // is false and the tensor is absent.
  StatusOr<WeightAttr> weight(const std::string &group, const std::string &role,
                              int64_t layer = -1, int64_t expert = -1, bool required = true);
  StatusOr<Type> elementType(const std::string &tensor, safetensors::DType dtype);
  // Adds `name = weight` to `attrs`, skipping absent optional weights.
  Status addWeight(SmallVectorImpl<NamedAttribute> &attrs, const std::string &group,
                   const std::string &role, int64_t layer, bool required = true);

  StatusOr<Value> buildMixer(const std::string &kind, int64_t layer, Value input);
  StatusOr<Value> buildKda(int64_t layer, Value input);
  StatusOr<Value> buildMla(int64_t layer, Value input, bool sparse);
  StatusOr<Value> buildFfn(const std::string &kind, int64_t layer, Value input);
  // The gated-MLP activation (hidden_act; SiTU's betas) of dense MLPs and MoE experts; SiLU is
  // left out when `silentSilu` (the op's default).
  Status addActivation(SmallVectorImpl<NamedAttribute> &attrs, bool silentSilu);
  StatusOr<Value> buildRmsNorm(Value input, const std::string &group, const std::string &role,
                               int64_t layer, double epsilon, Location loc);
  StatusOr<Value> buildAttnRes(ArrayRef<Value> blocks, Value partial, const std::string &group,
                               const std::string &normRole, const std::string &projRole,
                               int64_t layer, Location loc);
  StatusOr<RopeAttr> rope(bool interleaved, bool noRope);

  // DeepSeek-V3's multi-token-prediction layer (docs/mtp.md) as the model's `mtp` region, when
  // the config announces one (num_nextn_predict_layers).
  Status buildMtp(ModelOp model, WeightAttr embedWeight, WeightAttr lmHead);
  // The mixer / feed-forward kind of a layer past num_hidden_layers: per-layer lists stop at
  // num_hidden_layers, so only the rules that compute a kind from the index apply.
  StatusOr<std::string> extraLayerKind(const std::vector<llvm::json::Object> &rules,
                                       int64_t layer, const std::string &what);

  Status checkAllTensorsUsed();
  Status verify(ModuleOp module) const;

  Location layerLoc(int64_t layer, const std::string &part) {
    return NameLoc::get(builder_.getStringAttr("model.layers." + std::to_string(layer) + "." + part));
  }
  RankedTensorType activations(int64_t features) const {
    return RankedTensorType::get({ShapedType::kDynamic, features}, activationType_);
  }
  NamedAttribute i64(StringRef name, int64_t value) {
    return builder_.getNamedAttr(name, builder_.getI64IntegerAttr(value));
  }
  NamedAttribute f64(StringRef name, double value) {
    return builder_.getNamedAttr(name, builder_.getF64FloatAttr(value));
  }

  // A yes/no setting that may be absent (nullopt: the checkpoint's tensors decide).
  StatusOr<std::optional<bool>> optionalFlag(const std::string &name) {
    if (!mapping_.config.count(name))
      return std::optional<bool>();
    HYBRID_ASSIGN_OR_RETURN(std::optional<llvm::json::Value> value, config_.get(name));
    if (!value)
      return std::optional<bool>();
    HYBRID_ASSIGN_OR_RETURN(bool flag, config_.getBool(name));
    return std::optional<bool>(flag);
  }

  // An optional gate weight the config switches on, off, or leaves to the checkpoint: on, the
  // tensor must exist (the error names the config field); off, it is not read (so a stray one is
  // reported as unused).
  Status addGate(SmallVectorImpl<NamedAttribute> &attrs, const std::string &group,
                 const std::string &role, int64_t layer, std::optional<bool> enabled,
                 const std::string &setting) {
    if (enabled && !*enabled)
      return Status::ok();
    if (enabled && !checkpoint_.find(expand(mapping_.tensorTemplate(group, role), layer, -1)))
      return Status::error(checkpoint_.dir() + ": missing tensor '" +
                           expand(mapping_.tensorTemplate(group, role), layer, -1) + "' (" +
                           group + "." + role + " of layer " + std::to_string(layer) + "): " +
                           config_.path() + " sets " + config_.describe(setting) + " to true");
    return addWeight(attrs, group, role, layer, /*required=*/false);
  }

  // hybrid.model's fp8_activation_scale: the checkpoint's scale_fmt ("ue8m0"), else "amax"
  // (act_quant's default).
  StatusOr<std::string> fp8ActivationScale() {
    if (!mapping_.config.count("fp8.activation_scale"))
      return std::string("amax");
    HYBRID_ASSIGN_OR_RETURN(std::optional<std::string> format,
                            config_.getOptionalString("fp8.activation_scale"));
    if (format && *format != "ue8m0")
      return Status::error(config_.path() + ": quantization_config.scale_fmt '" + *format +
                           "' is not supported (\"ue8m0\", or absent for amax/448 scales)");
    return format.value_or("amax");
  }

  // hybrid.model's fp8_weight_block: quantization_config.weight_block_size ([128, 128] for
  // DeepSeek-V3.2), when the checkpoint has one.
  StatusOr<std::optional<std::vector<int64_t>>> fp8WeightBlock() {
    if (!mapping_.config.count("fp8.weight_block"))
      return std::optional<std::vector<int64_t>>();
    HYBRID_ASSIGN_OR_RETURN(std::optional<llvm::json::Value> value, config_.get("fp8.weight_block"));
    if (!value || value->kind() == llvm::json::Value::Null)
      return std::optional<std::vector<int64_t>>();
    const llvm::json::Array *array = value->getAsArray();
    std::vector<int64_t> block;
    if (array)
      for (const llvm::json::Value &element : *array)
        if (std::optional<int64_t> size = element.getAsInteger(); size && *size > 0)
          block.push_back(*size);
    if (!array || block.size() != 2 || array->size() != 2)
      return Status::error(config_.path() +
                           ": quantization_config.weight_block_size must be two positive "
                           "integers (rows, columns of a scale's block)");
    return std::optional<std::vector<int64_t>>(block);
  }

  MLIRContext &context_;
  OpBuilder builder_;
  const Checkpoint &checkpoint_;
  const ArchitectureMapping &mapping_;
  ModelConfig config_;
  std::map<std::string, std::string> referencedBy_; // tensor -> "group.role" that used it
  Type activationType_;
  bool hasFp8Weights_ = false; // then the model says how FP8 GEMMs quantize their activations
  int64_t hidden_ = 0;
  int64_t numLayers_ = 0;
  bool mtpImported_ = false; // then layer numLayers_'s tensors must all be referenced
  double rmsNormEps_ = 0;
};

StatusOr<Type> ModelImporter::elementType(const std::string &tensor,
                                          safetensors::DType dtype) {
  switch (dtype) {
  case safetensors::DType::BF16:
    return Type(builder_.getBF16Type());
  case safetensors::DType::F16:
    return Type(builder_.getF16Type());
  case safetensors::DType::F32:
    return Type(builder_.getF32Type());
  case safetensors::DType::F8_E4M3:
    return Type(builder_.getFloat8E4M3FNType());
  default:
    break;
  }
  const CheckpointTensor *found = checkpoint_.find(tensor);
  return Status::error(checkpoint_.pathOf(*found) + ": tensor '" + tensor + "' has dtype " +
                       std::string(safetensors::dtypeName(dtype)) +
                       ", not a weight dtype (BF16, F16, F32 or F8_E4M3)");
}

StatusOr<WeightAttr> ModelImporter::weight(const std::string &group, const std::string &role,
                                           int64_t layer, int64_t expert, bool required) {
  const std::string pattern = mapping_.tensorTemplate(group, role);
  if (pattern.empty()) {
    if (!required)
      return WeightAttr();
    return Status::error(mapping_.source + ": no tensor name for " + group + "." + role);
  }
  const std::string name = expand(pattern, layer, expert);
  const CheckpointTensor *tensor = checkpoint_.find(name);
  if (!tensor) {
    if (!required)
      return WeightAttr();
    return Status::error(checkpoint_.dir() + ": missing tensor '" + name + "' (" + group + "." +
                         role + (layer >= 0 ? " of layer " + std::to_string(layer) : "") + ")");
  }
  auto [it, inserted] = referencedBy_.emplace(name, group + "." + role);
  if (!inserted)
    return Status::error(mapping_.source + ": tensor '" + name + "' is used by both " + it->second +
                         " and " + group + "." + role);

  HYBRID_ASSIGN_OR_RETURN(Type element, elementType(name, tensor->info->dtype));
  auto type = RankedTensorType::get(tensor->info->shape, element);
  if (tensor->info->dtype != safetensors::DType::F8_E4M3)
    return WeightAttr::get(&context_, name, type, "", RankedTensorType());
  hasFp8Weights_ = true;

  // FP8 block-quantized weight: its scale tensor travels with it.
  const std::string scaleName = name + mapping_.fp8ScaleSuffix;
  const CheckpointTensor *scale = checkpoint_.find(scaleName);
  if (mapping_.fp8ScaleSuffix.empty() || !scale)
    return Status::error(checkpoint_.pathOf(*tensor) + ": fp8 tensor '" + name +
                         "' has no block scale tensor '" + scaleName + "'");
  if (scale->info->dtype != safetensors::DType::F32)
    return Status::error(checkpoint_.pathOf(*scale) + ": scale tensor '" + scaleName + "' must be F32");
  referencedBy_.emplace(scaleName, group + "." + role + " scale");
  auto scaleType = RankedTensorType::get(scale->info->shape, builder_.getF32Type());
  if (std::optional<std::string> error = attributeError(context_, [&](auto diagnose) {
        return WeightAttr::verify(diagnose, name, type, scaleName, scaleType);
      }))
    return Status::error(checkpoint_.pathOf(*scale) + ": " + *error);
  return WeightAttr::get(&context_, name, type, scaleName, scaleType);
}

Status ModelImporter::addWeight(SmallVectorImpl<NamedAttribute> &attrs, const std::string &group,
                                const std::string &role, int64_t layer, bool required) {
  HYBRID_ASSIGN_OR_RETURN(WeightAttr attr, weight(group, role, layer, -1, required));
  if (attr)
    attrs.push_back(builder_.getNamedAttr(role, attr));
  return Status::ok();
}

StatusOr<RopeAttr> ModelImporter::rope(bool interleaved, bool noRope) {
  if (noRope)
    return RopeAttr::get(&context_, RopeKind::none, RopePairing::interleaved, Real{10000.0},
                         Real{1.0}, 0, Real{32.0}, Real{1.0}, Real{1.0}, Real{0.0});
  HYBRID_ASSIGN_OR_RETURN(double theta, config_.getDouble("rope.theta"));
  HYBRID_ASSIGN_OR_RETURN(std::string type, config_.getString("rope.type"));
  RopePairing pairing = interleaved ? RopePairing::interleaved : RopePairing::half_split;
  if (type == "default")
    return RopeAttr::get(&context_, RopeKind::plain, pairing, Real{theta}, Real{1.0}, 0, Real{32.0},
                         Real{1.0}, Real{1.0}, Real{0.0});
  if (type != "yarn")
    return Status::error(config_.path() + ": rope scaling type '" + type +
                         "' is not supported (default or yarn)");
  HYBRID_ASSIGN_OR_RETURN(double factor, config_.getDouble("rope.factor"));
  HYBRID_ASSIGN_OR_RETURN(int64_t original, config_.getInt("rope.original_max_position"));
  HYBRID_ASSIGN_OR_RETURN(double betaFast, config_.getDouble("rope.beta_fast"));
  HYBRID_ASSIGN_OR_RETURN(double betaSlow, config_.getDouble("rope.beta_slow"));
  HYBRID_ASSIGN_OR_RETURN(double mscale, config_.getDouble("rope.mscale"));
  HYBRID_ASSIGN_OR_RETURN(double mscaleAllDim, config_.getDouble("rope.mscale_all_dim"));
  if (std::optional<std::string> error = attributeError(context_, [&](auto diagnose) {
        return RopeAttr::verify(diagnose, RopeKind::yarn, pairing, Real{theta}, Real{factor},
                                original, Real{betaFast}, Real{betaSlow}, Real{mscale},
                                Real{mscaleAllDim});
      }))
    return Status::error(config_.path() + ": rope_scaling: " + *error);
  return RopeAttr::get(&context_, RopeKind::yarn, pairing, Real{theta}, Real{factor}, original,
                       Real{betaFast}, Real{betaSlow}, Real{mscale}, Real{mscaleAllDim});
}

StatusOr<Value> ModelImporter::buildRmsNorm(Value input, const std::string &group,
                                            const std::string &role, int64_t layer,
                                            double epsilon, Location loc) {
  HYBRID_ASSIGN_OR_RETURN(WeightAttr norm, weight(group, role, layer));
  return builder_
      .create<RmsNormOp>(loc, input.getType(), input, norm, builder_.getF64FloatAttr(epsilon))
      .getResult();
}

StatusOr<Value> ModelImporter::buildAttnRes(ArrayRef<Value> blocks, Value partial,
                                            const std::string &group, const std::string &normRole,
                                            const std::string &projRole, int64_t layer,
                                            Location loc) {
  HYBRID_ASSIGN_OR_RETURN(int64_t blockSize, config_.getInt("attn_res.block_size"));
  HYBRID_ASSIGN_OR_RETURN(WeightAttr norm, weight(group, normRole, layer));
  HYBRID_ASSIGN_OR_RETURN(WeightAttr proj, weight(group, projRole, layer));
  return builder_
      .create<AttnResOp>(loc, partial.getType(), partial, blocks,
                         builder_.getI64IntegerAttr(blockSize),
                         builder_.getF64FloatAttr(rmsNormEps_), norm, proj)
      .getResult();
}

StatusOr<Value> ModelImporter::buildKda(int64_t layer, Value input) {
  HYBRID_ASSIGN_OR_RETURN(int64_t heads, config_.getInt("kda.num_heads"));
  HYBRID_ASSIGN_OR_RETURN(int64_t headDim, config_.getInt("kda.head_dim"));
  HYBRID_ASSIGN_OR_RETURN(int64_t convKernel, config_.getInt("kda.conv_kernel"));
  HYBRID_ASSIGN_OR_RETURN(std::optional<double> lowerBound,
                          config_.getOptionalDouble("kda.gate_lower_bound"));
  if (lowerBound && !(std::isfinite(*lowerBound) && *lowerBound < 0))
    return Status::error(config_.path() + ": " + config_.describe("kda.gate_lower_bound") +
                         " must be negative (the safe gate's floor on log-decay, -5 in Kimi K3), "
                         "got " + std::to_string(*lowerBound));
  HYBRID_ASSIGN_OR_RETURN(std::string layoutName, config_.getString("kda.state_layout"));
  std::optional<StateLayout> layout = symbolizeStateLayout(layoutName);
  if (!layout)
    return Status::error(mapping_.source + ": unknown KDA state layout '" + layoutName + "'");

  SmallVector<NamedAttribute> attrs = {
      i64("num_heads", heads), i64("head_dim", headDim), i64("conv_kernel", convKernel),
      builder_.getNamedAttr("gate_kind", KdaGateKindAttr::get(&context_, lowerBound
                                                                             ? KdaGateKind::lower_bound
                                                                             : KdaGateKind::softplus)),
      builder_.getNamedAttr("state_layout", StateLayoutAttr::get(&context_, *layout)),
      f64("norm_epsilon", rmsNormEps_)};
  if (lowerBound)
    attrs.push_back(f64("gate_lower_bound", *lowerBound));
  for (const char *role : {"q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d",
                           "f_a_proj", "f_b_proj", "A_log", "dt_bias", "b_proj", "o_norm",
                           "o_proj"})
    HYBRID_RETURN_IF_ERROR(addWeight(attrs, "kda", role, layer));
  // Output gate: full rank (g_proj, K3's use_full_rank_gate) when the config says so or, when it
  // is silent, when the checkpoint has it; else the low-rank pair.
  HYBRID_ASSIGN_OR_RETURN(std::optional<bool> fullRank, optionalFlag("kda.full_rank_output_gate"));
  size_t before = attrs.size();
  HYBRID_RETURN_IF_ERROR(
      addGate(attrs, "kda", "g_proj", layer, fullRank, "kda.full_rank_output_gate"));
  if (attrs.size() == before) {
    HYBRID_RETURN_IF_ERROR(addWeight(attrs, "kda", "g_a_proj", layer));
    HYBRID_RETURN_IF_ERROR(addWeight(attrs, "kda", "g_b_proj", layer));
  }
  return builder_
      .create<KdaOp>(layerLoc(layer, "self_attn"), TypeRange{input.getType()}, ValueRange{input},
                     attrs)
      .getResult();
}

StatusOr<Value> ModelImporter::buildMla(int64_t layer, Value input, bool sparse) {
  const Location loc = layerLoc(layer, "self_attn");
  HYBRID_ASSIGN_OR_RETURN(int64_t heads, config_.getInt("mla.num_heads"));
  HYBRID_ASSIGN_OR_RETURN(std::optional<int64_t> qLoraRank,
                          config_.getOptionalInt("mla.q_lora_rank"));
  HYBRID_ASSIGN_OR_RETURN(int64_t kvLoraRank, config_.getInt("mla.kv_lora_rank"));
  HYBRID_ASSIGN_OR_RETURN(int64_t nopeDim, config_.getInt("mla.qk_nope_head_dim"));
  HYBRID_ASSIGN_OR_RETURN(int64_t ropeDim, config_.getInt("mla.qk_rope_head_dim"));
  HYBRID_ASSIGN_OR_RETURN(int64_t vDim, config_.getInt("mla.v_head_dim"));
  HYBRID_ASSIGN_OR_RETURN(bool noRope, config_.getBool("mla.use_nope"));
  HYBRID_ASSIGN_OR_RETURN(bool interleaved, config_.getBool("mla.rope_interleave"));
  HYBRID_ASSIGN_OR_RETURN(double latentEps, config_.getDouble("mla.latent_norm_eps"));
  HYBRID_ASSIGN_OR_RETURN(RopeAttr ropeAttr, rope(interleaved, noRope));

  // YaRN sharpens the softmax by mscale^2 (mscale_all_dim form of the HF reference).
  double softmaxScale = 1.0 / std::sqrt(static_cast<double>(nopeDim + ropeDim));
  if (ropeAttr.getKind() == RopeKind::yarn && ropeAttr.getMscaleAllDim() > 0) {
    double m = 0.1 * ropeAttr.getMscaleAllDim() * std::log(ropeAttr.getFactor()) + 1.0;
    softmaxScale *= m * m;
  }

  SmallVector<NamedAttribute> attrs = {
      i64("num_heads", heads),      i64("kv_lora_rank", kvLoraRank),
      i64("qk_nope_head_dim", nopeDim), i64("qk_rope_head_dim", ropeDim),
      i64("v_head_dim", vDim),      builder_.getNamedAttr("rope", ropeAttr),
      f64("softmax_scale", softmaxScale), f64("latent_norm_epsilon", latentEps)};

  // The query latent (q-LoRA) is computed outside the attention op so the indexer can share it.
  Value queryLatent;
  if (qLoraRank) {
    attrs.push_back(i64("q_lora_rank", *qLoraRank));
    HYBRID_ASSIGN_OR_RETURN(WeightAttr qa, weight("mla", "q_a_proj", layer));
    if (qa.getType().getRank() != 2)
      return Status::error(checkpoint_.pathOf(*checkpoint_.find(qa.getName().str())) + ": tensor '" +
                           qa.getName().str() + "' must be 2-D");
    Value projected =
        builder_.create<LinearOp>(loc, activations(qa.getShape()[0]), input, qa).getResult();
    HYBRID_ASSIGN_OR_RETURN(queryLatent,
                            buildRmsNorm(projected, "mla", "q_a_layernorm", layer, latentEps, loc));
    HYBRID_RETURN_IF_ERROR(addWeight(attrs, "mla", "q_b_proj", layer));
  } else {
    if (sparse)
      return Status::error(config_.path() + ": the DSA indexer needs the MLA query latent, but "
                                            "q_lora_rank is null");
    HYBRID_RETURN_IF_ERROR(addWeight(attrs, "mla", "q_proj", layer));
  }
  for (const char *role : {"kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"})
    HYBRID_RETURN_IF_ERROR(addWeight(attrs, "mla", role, layer));
  // K3's sigmoid output gate (mla_use_output_gate).
  HYBRID_ASSIGN_OR_RETURN(std::optional<bool> outputGate, optionalFlag("mla.output_gate"));
  HYBRID_RETURN_IF_ERROR(addGate(attrs, "mla", "g_proj", layer, outputGate, "mla.output_gate"));

  if (!sparse) {
    SmallVector<Value> operands = {input};
    if (queryLatent)
      operands.push_back(queryLatent);
    return builder_.create<MlaOp>(loc, TypeRange{input.getType()}, operands, attrs).getResult();
  }

  // DSA: the lightning indexer picks the positions sparse MLA reads.
  HYBRID_ASSIGN_OR_RETURN(int64_t indexHeads, config_.getInt("indexer.num_heads"));
  HYBRID_ASSIGN_OR_RETURN(int64_t indexHeadDim, config_.getInt("indexer.head_dim"));
  HYBRID_ASSIGN_OR_RETURN(int64_t topK, config_.getInt("indexer.top_k"));
  HYBRID_ASSIGN_OR_RETURN(bool indexerInterleaved, config_.getBool("indexer.rope_interleave"));
  HYBRID_ASSIGN_OR_RETURN(double indexerEps, config_.getDouble("indexer.norm_eps"));
  HYBRID_ASSIGN_OR_RETURN(RopeAttr indexerRope, rope(indexerInterleaved, noRope));
  SmallVector<NamedAttribute> indexerAttrs = {
      i64("index_heads", indexHeads), i64("index_head_dim", indexHeadDim), i64("top_k", topK),
      i64("rope_head_dim", ropeDim), builder_.getNamedAttr("rope", indexerRope),
      f64("norm_epsilon", indexerEps)};
  for (const char *role : {"wq_b", "wk", "k_norm", "k_norm_bias", "weights_proj"})
    HYBRID_RETURN_IF_ERROR(addWeight(indexerAttrs, "dsa_indexer", role, layer));
  auto indicesType = RankedTensorType::get({ShapedType::kDynamic, topK}, builder_.getI32Type());
  Value indices = builder_
                      .create<DsaIndexerOp>(layerLoc(layer, "self_attn.indexer"),
                                            TypeRange{indicesType},
                                            ValueRange{input, queryLatent}, indexerAttrs)
                      .getResult();
  return builder_
      .create<SparseMlaOp>(loc, TypeRange{input.getType()},
                           ValueRange{input, indices, queryLatent}, attrs)
      .getResult();
}

StatusOr<Value> ModelImporter::buildMixer(const std::string &kind, int64_t layer, Value input) {
  if (kind == "kda")
    return buildKda(layer, input);
  if (kind == "mla")
    return buildMla(layer, input, /*sparse=*/false);
  if (kind == "mla_dsa")
    return buildMla(layer, input, /*sparse=*/true);
  return Status::error(mapping_.source + ": unknown mixer kind '" + kind + "' for layer " +
                       std::to_string(layer) + " (known: kda, mla, mla_dsa)");
}

Status ModelImporter::addActivation(SmallVectorImpl<NamedAttribute> &attrs, bool silentSilu) {
  HYBRID_ASSIGN_OR_RETURN(std::string activation, config_.getString("mlp.activation"));
  std::optional<Activation> act = symbolizeActivation(activation);
  if (!act)
    return Status::error(config_.path() + ": " + config_.describe("mlp.activation") + " '" +
                         activation + "' is not supported (silu, situ)");
  if (*act == Activation::silu && silentSilu)
    return Status::ok();
  attrs.push_back(builder_.getNamedAttr("activation", ActivationAttr::get(&context_, *act)));
  if (*act != Activation::situ)
    return Status::ok();
  // K3's SiTU: the gate's soft cap is required, the linear half's optional.
  std::optional<double> beta, linearBeta;
  if (mapping_.config.count("mlp.situ_beta")) {
    HYBRID_ASSIGN_OR_RETURN(beta, config_.getOptionalDouble("mlp.situ_beta"));
  }
  if (mapping_.config.count("mlp.situ_linear_beta")) {
    HYBRID_ASSIGN_OR_RETURN(linearBeta, config_.getOptionalDouble("mlp.situ_linear_beta"));
  }
  if (!beta || !(*beta > 0))
    return Status::error(config_.path() + ": the situ activation needs a positive " +
                         config_.describe("mlp.situ_beta"));
  if (linearBeta && !(*linearBeta > 0))
    return Status::error(config_.path() + ": " + config_.describe("mlp.situ_linear_beta") +
                         " must be positive");
  attrs.push_back(f64("situ_beta", *beta));
  if (linearBeta)
    attrs.push_back(f64("situ_linear_beta", *linearBeta));
  return Status::ok();
}

StatusOr<Value> ModelImporter::buildFfn(const std::string &kind, int64_t layer, Value input) {
  if (kind == "mlp") {
    const Location loc = layerLoc(layer, "mlp");
    SmallVector<NamedAttribute> attrs;
    HYBRID_RETURN_IF_ERROR(addActivation(attrs, /*silentSilu=*/false));
    for (const char *role : {"gate_proj", "up_proj", "down_proj"})
      HYBRID_RETURN_IF_ERROR(addWeight(attrs, "mlp", role, layer));
    return builder_.create<MlpOp>(loc, TypeRange{input.getType()}, ValueRange{input}, attrs)
        .getResult();
  }
  if (kind != "moe" && kind != "latent_moe")
    return Status::error(mapping_.source + ": unknown feed-forward kind '" + kind +
                         "' for layer " + std::to_string(layer) + " (known: mlp, moe, latent_moe)");
  // Latent MoE (K3): routed_expert_hidden_size makes every MoE layer latent; a layer listed as
  // latent_moe requires it.
  std::optional<int64_t> latentSize;
  if (mapping_.config.count("moe.latent_size")) {
    HYBRID_ASSIGN_OR_RETURN(latentSize, config_.getOptionalInt("moe.latent_size"));
  }
  if (kind == "latent_moe" && !latentSize)
    return Status::error(config_.path() + ": layer " + std::to_string(layer) +
                         " is a latent MoE but " +
                         (mapping_.config.count("moe.latent_size")
                              ? config_.describe("moe.latent_size") + " is not set"
                              : std::string("the mapping has no moe.latent_size")));
  if (latentSize && *latentSize <= 0)
    return Status::error(config_.path() + ": " + config_.describe("moe.latent_size") +
                         " must be positive");

  HYBRID_ASSIGN_OR_RETURN(int64_t experts, config_.getInt("moe.num_experts"));
  HYBRID_ASSIGN_OR_RETURN(int64_t topK, config_.getInt("moe.top_k"));
  HYBRID_ASSIGN_OR_RETURN(int64_t groups, config_.getInt("moe.num_groups"));
  HYBRID_ASSIGN_OR_RETURN(int64_t topkGroups, config_.getInt("moe.topk_groups"));
  HYBRID_ASSIGN_OR_RETURN(std::string scoreName, config_.getString("moe.score_function"));
  HYBRID_ASSIGN_OR_RETURN(bool renormalize, config_.getBool("moe.renormalize"));
  HYBRID_ASSIGN_OR_RETURN(double scaling, config_.getDouble("moe.routed_scaling_factor"));
  HYBRID_ASSIGN_OR_RETURN(int64_t shared, config_.getInt("moe.num_shared_experts"));
  HYBRID_ASSIGN_OR_RETURN(int64_t width, config_.getInt("moe.intermediate_size"));
  std::optional<ScoreFunction> score = symbolizeScoreFunction(scoreName);
  if (!score)
    return Status::error(config_.path() + ": router score function '" + scoreName +
                         "' is not supported (sigmoid or softmax)");
  SmallVector<NamedAttribute> attrs = {
      i64("num_experts", experts), i64("top_k", topK), i64("num_groups", groups),
      i64("topk_groups", topkGroups),
      builder_.getNamedAttr("score_function", ScoreFunctionAttr::get(&context_, *score)),
      builder_.getNamedAttr("renormalize", builder_.getBoolAttr(renormalize)),
      f64("routed_scaling_factor", scaling), i64("intermediate_size", width),
      i64("num_shared_experts", shared)};
  HYBRID_RETURN_IF_ERROR(addWeight(attrs, "moe", "router", layer));
  HYBRID_RETURN_IF_ERROR(addWeight(attrs, "moe", "correction_bias", layer, /*required=*/false));
  for (const char *role : {"experts_gate_proj", "experts_up_proj", "experts_down_proj"}) {
    SmallVector<Attribute> list;
    for (int64_t e = 0; e < experts; ++e) {
      HYBRID_ASSIGN_OR_RETURN(WeightAttr w, weight("moe", role, layer, e));
      list.push_back(w);
    }
    attrs.push_back(builder_.getNamedAttr(role, builder_.getArrayAttr(list)));
  }
  if (shared > 0)
    for (const char *role : {"shared_gate_proj", "shared_up_proj", "shared_down_proj"})
      HYBRID_RETURN_IF_ERROR(addWeight(attrs, "moe", role, layer));
  HYBRID_RETURN_IF_ERROR(addActivation(attrs, /*silentSilu=*/true)); // hybrid.moe's default
  if (latentSize) {
    HYBRID_ASSIGN_OR_RETURN(WeightAttr down, weight("moe", "latent_down_proj", layer));
    HYBRID_ASSIGN_OR_RETURN(WeightAttr up, weight("moe", "latent_up_proj", layer));
    // The op verifier checks the experts against the projections; the config's width here.
    if (down.getType().getRank() != 2 || down.getShape()[0] != *latentSize)
      return Status::error(checkpoint_.pathOf(*checkpoint_.find(down.getName().str())) +
                           ": tensor '" + down.getName().str() + "' has shape " +
                           shapeText(down.getShape()) + ", expected [" +
                           std::to_string(*latentSize) + ", " + std::to_string(hidden_) + "] (" +
                           config_.describe("moe.latent_size") + " = " +
                           std::to_string(*latentSize) + ")");
    attrs.push_back(builder_.getNamedAttr("routed_expert_down_proj", down));
    attrs.push_back(builder_.getNamedAttr("routed_expert_up_proj", up));
    HYBRID_ASSIGN_OR_RETURN(bool latentNorm, config_.getBool("moe.latent_norm"));
    if (latentNorm) {
      HYBRID_ASSIGN_OR_RETURN(WeightAttr norm, weight("moe", "latent_norm", layer));
      attrs.push_back(builder_.getNamedAttr("routed_expert_norm", norm));
      attrs.push_back(f64("routed_expert_norm_epsilon", rmsNormEps_));
    }
  }
  return builder_
      .create<MoeOp>(layerLoc(layer, "moe"), TypeRange{input.getType()}, ValueRange{input}, attrs)
      .getResult();
}

StatusOr<OwningOpRef<ModuleOp>> ModelImporter::run() {
  HYBRID_ASSIGN_OR_RETURN(hidden_, config_.getInt("hidden_size"));
  HYBRID_ASSIGN_OR_RETURN(int64_t vocab, config_.getInt("vocab_size"));
  HYBRID_ASSIGN_OR_RETURN(numLayers_, config_.getInt("num_layers"));
  HYBRID_ASSIGN_OR_RETURN(rmsNormEps_, config_.getDouble("rms_norm_eps"));
  HYBRID_ASSIGN_OR_RETURN(std::string dtype, config_.getString("activation_dtype"));
  if (hidden_ <= 0 || vocab <= 0 || numLayers_ <= 0)
    return Status::error(config_.path() +
                         ": hidden_size, vocab_size and num_hidden_layers must be positive");
  if (dtype == "bfloat16")
    activationType_ = builder_.getBF16Type();
  else if (dtype == "float16")
    activationType_ = builder_.getF16Type();
  else if (dtype == "float32")
    activationType_ = builder_.getF32Type();
  else
    return Status::error(config_.path() + ": torch_dtype '" + dtype +
                         "' is not an activation dtype (bfloat16, float16 or float32)");
  HYBRID_ASSIGN_OR_RETURN(std::vector<std::string> mixers,
                          config_.layerKinds(mapping_.mixerRules, numLayers_, "mixer"));
  HYBRID_ASSIGN_OR_RETURN(std::vector<std::string> ffns,
                          config_.layerKinds(mapping_.ffnRules, numLayers_, "feed-forward"));
  std::optional<int64_t> attnResBlock;
  if (mapping_.config.count("attn_res.block_size")) {
    HYBRID_ASSIGN_OR_RETURN(attnResBlock, config_.getOptionalInt("attn_res.block_size"));
    if (attnResBlock && *attnResBlock <= 0)
      return Status::error(config_.path() + ": attn_res_block_size must be positive");
  }

  const Location modelLoc = NameLoc::get(builder_.getStringAttr("model"));
  OwningOpRef<ModuleOp> module = ModuleOp::create(UnknownLoc::get(&context_));
  builder_.setInsertionPointToEnd(module->getBody());
  auto model = builder_.create<ModelOp>(
      modelLoc, builder_.getStringAttr(mapping_.modelType),
      builder_.getStringAttr(mapping_.modelType), builder_.getI64IntegerAttr(hidden_),
      builder_.getI64IntegerAttr(vocab), builder_.getI64IntegerAttr(numLayers_),
      /*fp8_activation_scale=*/nullptr, /*fp8_weight_block=*/nullptr);
  Block *body = builder_.createBlock(&model.getBody());
  Value ids = body->addArgument(
      RankedTensorType::get({ShapedType::kDynamic}, builder_.getI64Type()), modelLoc);

  HYBRID_ASSIGN_OR_RETURN(WeightAttr embedWeight, weight("model", "embed"));
  Value h = builder_
                .create<EmbedOp>(NameLoc::get(builder_.getStringAttr("model.embed_tokens")),
                                 activations(hidden_), ids, embedWeight)
                .getResult();

  // Block AttnRes (MODEL_SPEC 6.2, K3 form): completed blocks + a running partial sum replace
  // the residual stream.
  SmallVector<Value> blocks;
  for (int64_t layer = 0; layer < numLayers_; ++layer) {
    const Location normLoc = layerLoc(layer, "input_layernorm");
    if (!attnResBlock) {
      HYBRID_ASSIGN_OR_RETURN(Value x, buildRmsNorm(h, "layer", "input_norm", layer, rmsNormEps_,
                                                    normLoc));
      HYBRID_ASSIGN_OR_RETURN(Value mixed, buildMixer(mixers[layer], layer, x));
      h = builder_.create<AddOp>(layerLoc(layer, "attn_residual"), h, mixed).getResult();
      HYBRID_ASSIGN_OR_RETURN(Value y, buildRmsNorm(h, "layer", "post_attention_norm", layer,
                                                    rmsNormEps_,
                                                    layerLoc(layer, "post_attention_layernorm")));
      HYBRID_ASSIGN_OR_RETURN(Value ffn, buildFfn(ffns[layer], layer, y));
      h = builder_.create<AddOp>(layerLoc(layer, "mlp_residual"), h, ffn).getResult();
      continue;
    }
    // Layer 0 has no completed block yet: its attention-side mix is the identity, kept so the
    // checkpoint's weights for it stay referenced.
    Value partial = h;
    HYBRID_ASSIGN_OR_RETURN(h, buildAttnRes(blocks, partial, "layer", "attn_res_norm",
                                            "attn_res_proj", layer,
                                            layerLoc(layer, "self_attention_res")));
    if (layer % *attnResBlock == 0) {
      blocks.push_back(partial);
      partial = Value();
    }
    HYBRID_ASSIGN_OR_RETURN(Value x, buildRmsNorm(h, "layer", "input_norm", layer, rmsNormEps_,
                                                  normLoc));
    HYBRID_ASSIGN_OR_RETURN(Value mixed, buildMixer(mixers[layer], layer, x));
    partial = partial ? builder_.create<AddOp>(layerLoc(layer, "attn_partial"), partial, mixed)
                            .getResult()
                      : mixed;
    HYBRID_ASSIGN_OR_RETURN(h, buildAttnRes(blocks, partial, "layer", "mlp_res_norm",
                                            "mlp_res_proj", layer, layerLoc(layer, "mlp_res")));
    HYBRID_ASSIGN_OR_RETURN(Value y, buildRmsNorm(h, "layer", "post_attention_norm", layer,
                                                  rmsNormEps_,
                                                  layerLoc(layer, "post_attention_layernorm")));
    HYBRID_ASSIGN_OR_RETURN(Value ffn, buildFfn(ffns[layer], layer, y));
    h = builder_.create<AddOp>(layerLoc(layer, "mlp_partial"), partial, ffn).getResult();
  }
  if (attnResBlock) {
    HYBRID_ASSIGN_OR_RETURN(h, buildAttnRes(blocks, h, "model", "output_attn_res_norm",
                                            "output_attn_res_proj", -1,
                                            NameLoc::get(builder_.getStringAttr("model.output_attn_res"))));
  }
  HYBRID_ASSIGN_OR_RETURN(Value normed,
                          buildRmsNorm(h, "model", "final_norm", -1, rmsNormEps_,
                                       NameLoc::get(builder_.getStringAttr("model.norm"))));
  HYBRID_ASSIGN_OR_RETURN(WeightAttr head, weight("model", "lm_head"));
  auto logitsType = RankedTensorType::get({ShapedType::kDynamic, vocab}, builder_.getF32Type());
  Value logits = builder_
                     .create<LmHeadOp>(NameLoc::get(builder_.getStringAttr("lm_head")), logitsType,
                                       normed, head)
                     .getResult();
  builder_.create<ReturnOp>(modelLoc, logits);
  HYBRID_RETURN_IF_ERROR(buildMtp(model, embedWeight, head));

  if (hasFp8Weights_) {
    HYBRID_ASSIGN_OR_RETURN(std::string scale, fp8ActivationScale());
    model.setFp8ActivationScale(scale);
    HYBRID_ASSIGN_OR_RETURN(std::optional<std::vector<int64_t>> block, fp8WeightBlock());
    if (block)
      model.setFp8WeightBlock(*block);
  }
  HYBRID_RETURN_IF_ERROR(checkAllTensorsUsed());
  HYBRID_RETURN_IF_ERROR(verify(*module));
  return module;
}

StatusOr<std::string> ModelImporter::extraLayerKind(const std::vector<llvm::json::Object> &rules,
                                                    int64_t layer, const std::string &what) {
  std::vector<llvm::json::Object> computed;
  for (const llvm::json::Object &rule : rules)
    if (!rule.getString("per_layer"))
      computed.push_back(rule);
  if (computed.empty())
    return Status::error(mapping_.source + ": no " + what + " rule gives the kind of layer " +
                         std::to_string(layer) + " past num_hidden_layers (the MTP layer)");
  HYBRID_ASSIGN_OR_RETURN(std::vector<std::string> kinds,
                          config_.layerKinds(computed, layer + 1, what));
  return kinds.back();
}

Status ModelImporter::buildMtp(ModelOp model, WeightAttr embedWeight, WeightAttr lmHead) {
  if (!mapping_.config.count("mtp.num_layers"))
    return Status::ok();
  HYBRID_ASSIGN_OR_RETURN(int64_t mtpLayers, config_.getInt("mtp.num_layers"));
  if (mtpLayers == 0)
    return Status::ok();
  if (mtpLayers != 1)
    return Status::error(config_.path() + ": num_nextn_predict_layers = " +
                         std::to_string(mtpLayers) +
                         ": one multi-token-prediction layer is supported (DeepSeek-V3 ships one)");
  const int64_t layer = numLayers_;
  HYBRID_ASSIGN_OR_RETURN(std::string mixer, extraLayerKind(mapping_.mixerRules, layer, "mixer"));
  HYBRID_ASSIGN_OR_RETURN(std::string ffn, extraLayerKind(mapping_.ffnRules, layer, "feed-forward"));
  if (mixer == "kda")
    return Status::error(config_.path() + ": the MTP layer " + std::to_string(layer) +
                         " would be a KDA layer; drafts roll back only attention caches");

  OpBuilder::InsertionGuard guard(builder_);
  const Location loc = layerLoc(layer, "mtp");
  Block *block = builder_.createBlock(&model.getMtp());
  Value next = block->addArgument(RankedTensorType::get({ShapedType::kDynamic},
                                                        builder_.getI64Type()),
                                  loc);
  Value previous = block->addArgument(activations(hidden_), loc);
  // The embedding is the main model's (the checkpoint's copy under the MTP layer is identical and
  // only marked as read).
  Value embedded =
      builder_.create<EmbedOp>(layerLoc(layer, "embed_tokens"), activations(hidden_), next, embedWeight)
          .getResult();
  HYBRID_RETURN_IF_ERROR(weight("mtp", "embed_tokens", layer, -1, /*required=*/false).status());
  HYBRID_ASSIGN_OR_RETURN(WeightAttr enorm, weight("mtp", "enorm", layer));
  HYBRID_ASSIGN_OR_RETURN(WeightAttr hnorm, weight("mtp", "hnorm", layer));
  HYBRID_ASSIGN_OR_RETURN(WeightAttr ehProj, weight("mtp", "eh_proj", layer));
  Value h = builder_
                .create<MtpInputOp>(layerLoc(layer, "eh_proj"), activations(hidden_), embedded,
                                    previous, builder_.getF64FloatAttr(rmsNormEps_), enorm, hnorm,
                                    ehProj)
                .getResult();
  // The decoder block at index `layer`, as in the main model.
  HYBRID_ASSIGN_OR_RETURN(Value x, buildRmsNorm(h, "layer", "input_norm", layer, rmsNormEps_,
                                                layerLoc(layer, "input_layernorm")));
  HYBRID_ASSIGN_OR_RETURN(Value mixed, buildMixer(mixer, layer, x));
  h = builder_.create<AddOp>(layerLoc(layer, "attn_residual"), h, mixed).getResult();
  HYBRID_ASSIGN_OR_RETURN(Value y, buildRmsNorm(h, "layer", "post_attention_norm", layer,
                                                rmsNormEps_,
                                                layerLoc(layer, "post_attention_layernorm")));
  HYBRID_ASSIGN_OR_RETURN(Value ffnOut, buildFfn(ffn, layer, y));
  h = builder_.create<AddOp>(layerLoc(layer, "mlp_residual"), h, ffnOut).getResult();
  HYBRID_ASSIGN_OR_RETURN(Value normed, buildRmsNorm(h, "mtp", "shared_head_norm", layer,
                                                     rmsNormEps_,
                                                     layerLoc(layer, "shared_head.norm")));
  // shared_head.head is a copy of lm_head in the published checkpoints; absent, lm_head serves.
  HYBRID_ASSIGN_OR_RETURN(WeightAttr head,
                          weight("mtp", "shared_head", layer, -1, /*required=*/false));
  auto logitsType = RankedTensorType::get({ShapedType::kDynamic, lmHead.getShape()[0]},
                                          builder_.getF32Type());
  Value logits = builder_
                     .create<LmHeadOp>(layerLoc(layer, "shared_head.head"), logitsType, normed,
                                       head ? head : lmHead)
                     .getResult();
  builder_.create<ReturnOp>(loc, logits);
  mtpImported_ = true;
  return Status::ok();
}

Status ModelImporter::checkAllTensorsUsed() {
  int64_t extraLayers = 0;
  if (!mapping_.extraLayersSetting.empty()) {
    HYBRID_ASSIGN_OR_RETURN(extraLayers, config_.getInt(mapping_.extraLayersSetting));
  }
  std::vector<llvm::Regex> patterns;
  for (const std::string &pattern : mapping_.unreferencedPatterns)
    patterns.emplace_back(pattern);
  for (const auto &[name, tensor] : checkpoint_.tensors()) {
    if (referencedBy_.count(name))
      continue;
    // Layers past num_hidden_layers (DeepSeek's multi-token-prediction layers) that were not
    // compiled into the `mtp` region are not read.
    llvm::StringRef rest(name);
    if (!mapping_.extraLayerPrefix.empty() && rest.consume_front(mapping_.extraLayerPrefix)) {
      int64_t index = -1;
      if (!rest.consumeInteger(10, index) && index >= numLayers_ + (mtpImported_ ? 1 : 0) &&
          index < numLayers_ + extraLayers)
        continue;
    }
    if (llvm::any_of(patterns, [&](const llvm::Regex &re) { return re.match(name); }))
      continue;
    return Status::error(checkpoint_.pathOf(tensor) + ": tensor '" + name + "' is not used by the " +
                         mapping_.modelType + " layout described by " + config_.path() +
                         " (does the config match the checkpoint?)");
  }
  return Status::ok();
}

Status ModelImporter::verify(ModuleOp module) const {
  // Op verifiers name the checkpoint tensor in "... weight 'NAME' ..."; point at its shard.
  std::string first;
  ScopedDiagnosticHandler handler(&context_, [&](Diagnostic &diag) {
    if (first.empty() && diag.getSeverity() == DiagnosticSeverity::Error)
      first = diag.str();
    return success();
  });
  if (succeeded(mlir::verify(module)))
    return Status::ok();
  llvm::StringRef message(first);
  size_t at = message.find("weight '");
  if (at != llvm::StringRef::npos) {
    llvm::StringRef name = message.drop_front(at + 8).take_until([](char c) { return c == '\''; });
    if (const CheckpointTensor *tensor = checkpoint_.find(name.str()))
      return Status::error(checkpoint_.pathOf(*tensor) + ": tensor '" + name.str() +
                           "' does not fit " + config_.path() + ": " + first);
  }
  return Status::error(config_.path() + ": " + first);
}

} // namespace

StatusOr<OwningOpRef<ModuleOp>> importCheckpoint(MLIRContext &context, const std::string &dir,
                                                 const ImportOptions &options) {
  context.getOrLoadDialect<HybridDialect>();
  HYBRID_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint,
                          options.syntheticSeed ? Checkpoint::openSynthetic(dir, *options.syntheticSeed)
                                                : Checkpoint::open(dir));
  std::optional<llvm::StringRef> modelType = checkpoint->config().getString("model_type");
  if (!modelType && options.mappingPath.empty())
    return Status::error(checkpoint->configPath() + ": field 'model_type' missing or not a string");

  StatusOr<ArchitectureMapping> mapping =
      options.mappingPath.empty() ? ArchitectureMapping::builtin(modelType->str())
                                  : ArchitectureMapping::load(options.mappingPath);
  if (!mapping)
    return options.mappingPath.empty()
               ? Status(mapping.status()).withContext(checkpoint->configPath())
               : mapping.status();
  if (modelType && mapping->modelType != *modelType)
    return Status::error(checkpoint->configPath() + ": model_type '" + modelType->str() +
                         "' does not match the mapping " + mapping->source + " ('" +
                         mapping->modelType + "')");
  ModelImporter importer(context, *checkpoint, *mapping);
  return importer.run();
}

} // namespace hybrid::import
