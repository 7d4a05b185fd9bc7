// --hybrid-lower-to-plan: hybrid.model -> plan.plan (see Passes.td).
#include "compiler/Transforms/Passes.h"

#include "hybrid/runtime/Plan.h"
#include "hybrid/runtime/WeightArchive.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/MapVector.h"

#include <map>

namespace hybrid {
#define GEN_PASS_DEF_LOWERTOPLAN
#include "compiler/Transforms/Passes.h.inc"
} // namespace hybrid

using namespace mlir;

namespace hybrid {
namespace {

int64_t elementBytes(Type type) { return std::max<int64_t>(1, type.getIntOrFloatBitWidth() / 8); }

std::string locationName(Operation *op) {
  if (auto name = dyn_cast<NameLoc>(op->getLoc()))
    return name.getName().str();
  return op->getName().getStringRef().str();
}

// The plan-wide tables shared by every program: weights and cache slots.
struct PlanTables {
  llvm::MapVector<StringRef, WeightAttr> weights; // name -> weight, in first-use order
  llvm::DenseMap<StringRef, int32_t> weightIndex;
  SmallVector<std::string> allWeightNames;         // weights and scales, in plan order
  llvm::DenseMap<Operation *, int32_t> kvSlot;     // mla / sparse_mla / dsa_indexer -> slot
  llvm::DenseMap<Operation *, int32_t> stateSlot;  // kda -> slot
};

// The values and steps of one program while it is being built.
class ProgramBuilder {
public:
  struct ValueSpec {
    Type dtype;
    int64_t rowElements;
    std::string name;
  };
  struct StepSpec {
    plan::KernelId kernel;
    DictionaryAttr params;
    SmallVector<int32_t> inputs, outputs, weights;
    int32_t layer;
    Location loc;
  };

  ProgramBuilder(OpBuilder &builder, bool fp32Activations)
      : builder_(builder), fp32Activations_(fp32Activations) {}

  int32_t addValue(Type dtype, int64_t rowElements, std::string name) {
    values_.push_back({dtype, rowElements, std::move(name)});
    return static_cast<int32_t>(values_.size() - 1);
  }
  void bind(Value value, int32_t index) { index_[value] = index; }
  int32_t valueOf(Value value) const { return index_.lookup(value); }
  // A plan value for an op result, named after the op.
  int32_t resultOf(Value result) {
    int32_t index = addValue(activationType(result), rowElementsOf(result),
                             locationName(result.getDefiningOp()));
    bind(result, index);
    return index;
  }
  // Activations are fp32, or keep the model dtype when fp32Activations is off.
  Type activationType(Value value) const {
    Type element = cast<RankedTensorType>(value.getType()).getElementType();
    return isa<FloatType>(element) && fp32Activations_ ? Type(builder_.getF32Type()) : element;
  }
  int64_t rowElementsOf(Value value) const {
    auto type = cast<RankedTensorType>(value.getType());
    return type.getRank() == 1 ? 1 : type.getDimSize(1);
  }
  void addStep(StepSpec step) { steps_.push_back(std::move(step)); }
  ArrayRef<ValueSpec> values() const { return values_; }
  ArrayRef<StepSpec> steps() const { return steps_; }

private:
  OpBuilder &builder_;
  bool fp32Activations_;
  SmallVector<ValueSpec> values_;
  SmallVector<StepSpec> steps_;
  llvm::DenseMap<Value, int32_t> index_;
};

class ModelLowering {
public:
  ModelLowering(ModelOp model, const LowerToPlanOptions &options)
      : model_(model), options_(options), builder_(model.getContext()) {}

  LogicalResult run();

private:
  void collectWeights();
  void collectCacheSlots();
  LogicalResult emitHeader(plan::PlanOp planOp);
  // Lowers `block` (the model's body, or its `mtp` region) into the program `name`.
  LogicalResult emitProgram(plan::PlanOp planOp, StringRef name, int64_t maxTokens, bool decode,
                            Block &block);

  // Dispatch construction.
  SmallVector<int32_t> weightList(ArrayRef<WeightAttr> weights);
  SmallVector<int32_t> weightList(Operation *op, ArrayRef<StringRef> roles);
  DictionaryAttr ropeParams(RopeAttr rope);
  // activation = silu | situ, plus SiTU's situ_beta / situ_linear_beta when set.
  SmallVector<NamedAttribute> activationParams(Activation activation, std::optional<APFloat> beta,
                                               std::optional<APFloat> linearBeta);
  // Appends the dispatches computing `op` (one or several) to `program`.
  LogicalResult expand(Operation *op, bool decode, ProgramBuilder &program);

  NamedAttribute i32(StringRef name, int64_t value) {
    return builder_.getNamedAttr(name, builder_.getI32IntegerAttr(static_cast<int32_t>(value)));
  }
  NamedAttribute f32(StringRef name, double value) {
    return builder_.getNamedAttr(name, builder_.getF32FloatAttr(static_cast<float>(value)));
  }
  NamedAttribute str(StringRef name, StringRef value) {
    return builder_.getNamedAttr(name, builder_.getStringAttr(value));
  }

  ModelOp model_;
  const LowerToPlanOptions &options_;
  OpBuilder builder_;
  PlanTables tables_;
};

void ModelLowering::collectWeights() {
  auto add = [&](WeightAttr weight) {
    if (!tables_.weights.count(weight.getName()))
      tables_.weights.insert({weight.getName(), weight});
  };
  model_.walk([&](Operation *op) {
    for (NamedAttribute attr : op->getAttrs()) {
      if (auto weight = dyn_cast<WeightAttr>(attr.getValue()))
        add(weight);
      else if (auto list = dyn_cast<ArrayAttr>(attr.getValue()))
        for (Attribute element : list)
          if (auto weight = dyn_cast<WeightAttr>(element))
            add(weight);
    }
  });
  // Plan order: each weight, then its scale right after it.
  for (auto &[name, weight] : tables_.weights) {
    tables_.weightIndex[name] = static_cast<int32_t>(tables_.allWeightNames.size());
    tables_.allWeightNames.push_back(name.str());
    if (!weight.getScaleName().empty())
      tables_.allWeightNames.push_back(weight.getScaleName().str());
  }
}

void ModelLowering::collectCacheSlots() {
  int32_t kv = 0, state = 0;
  model_.walk([&](Operation *op) {
    if (isa<MlaOp, SparseMlaOp>(op))
      tables_.kvSlot[op] = kv++;
    else if (isa<KdaOp>(op))
      tables_.stateSlot[op] = state++;
  });
  // The indexer keeps its keys in the slot of the sparse MLA it selects for.
  model_.walk([&](SparseMlaOp op) {
    if (Operation *indexer = op.getIndices().getDefiningOp())
      tables_.kvSlot[indexer] = tables_.kvSlot[op];
  });
}

LogicalResult ModelLowering::emitHeader(plan::PlanOp planOp) {
  builder_.setInsertionPointToEnd(&planOp.getBodyBlock());
  Location loc = planOp.getLoc();

  // Offsets follow the archive's layout rule so plan and archive agree by construction.
  SmallVector<uint64_t> sizes;
  SmallVector<std::pair<std::string, RankedTensorType>> entries;
  for (auto &[name, weight] : tables_.weights) {
    entries.push_back({name.str(), weight.getType()});
    if (!weight.getScaleName().empty())
      entries.push_back({weight.getScaleName().str(), weight.getScaleType()});
  }
  for (auto &[name, type] : entries)
    sizes.push_back(type.getNumElements() * elementBytes(type.getElementType()));
  std::vector<uint64_t> offsets = hybrid::planWeightOffsets(sizes);

  for (auto [i, entry] : llvm::enumerate(entries)) {
    auto &[name, type] = entry;
    auto op = builder_.create<plan::WeightOp>(
        loc, builder_.getStringAttr(name), TypeAttr::get(type),
        builder_.getI64IntegerAttr(static_cast<int64_t>(offsets[i])),
        builder_.getI64IntegerAttr(static_cast<int64_t>(sizes[i])), builder_.getBoolAttr(false),
        DenseI32ArrayAttr(), builder_.getI32IntegerAttr(-1), DenseI32ArrayAttr(),
        DenseI64ArrayAttr());
    auto weight = tables_.weights.lookup(name);
    if (weight && !weight.getScaleName().empty()) {
      // Block dims: how many weight elements one scale covers along each axis, as the
      // checkpoint's weight_block_size says (a 576-row weight has blocks of 128 and a last one of
      // 64), else inferred from the scale grid.
      SmallVector<int32_t> block;
      std::optional<ArrayRef<int64_t>> declared = model_.getFp8WeightBlock();
      for (auto [axis, sizes] :
           llvm::enumerate(llvm::zip(weight.getShape(), weight.getScaleType().getShape()))) {
        auto [dim, scaleDim] = sizes;
        int64_t size = (dim + scaleDim - 1) / scaleDim;
        if (declared && declared->size() == weight.getShape().size()) {
          size = (*declared)[axis];
          if ((dim + size - 1) / size != scaleDim)
            return model_.emitOpError()
                   << "weight '" << name << "' has " << scaleDim << " block scales along axis "
                   << axis << " (" << dim << " elements); weight_block_size " << size
                   << " needs " << (dim + size - 1) / size;
        }
        block.push_back(static_cast<int32_t>(size));
      }
      op.setBlockAttr(builder_.getDenseI32ArrayAttr(block));
      op.setScaleAttr(builder_.getI32IntegerAttr(static_cast<int32_t>(i + 1)));
    }
  }
  uint64_t archiveBytes = offsets.empty() ? 0 : offsets.back() + sizes.back();
  planOp.setWeightArchiveBytesAttr(builder_.getI64IntegerAttr(static_cast<int64_t>(archiveBytes)));

  // Cache specs, in slot order. The CPU reference keeps caches in fp32.
  Type cacheType = builder_.getF32Type();
  SmallVector<Operation *> kvOps(tables_.kvSlot.size()), stateOps(tables_.stateSlot.size());
  for (auto [op, slot] : tables_.kvSlot)
    if (isa<MlaOp, SparseMlaOp>(op))
      kvOps[slot] = op;
  for (auto [op, slot] : tables_.stateSlot)
    stateOps[slot] = op;
  for (Operation *op : kvOps) {
    if (!op)
      continue;
    int64_t latent = 0, rope = 0, indexKey = 0;
    if (auto mla = dyn_cast<MlaOp>(op)) {
      latent = mla.getKvLoraRank();
      rope = mla.getQkRopeHeadDim();
    } else {
      auto sparse = cast<SparseMlaOp>(op);
      latent = sparse.getKvLoraRank();
      rope = sparse.getQkRopeHeadDim();
      if (auto indexer = sparse.getIndices().getDefiningOp<DsaIndexerOp>())
        indexKey = indexer.getIndexHeadDim();
    }
    builder_.create<plan::KvCacheLayerOp>(
        op->getLoc(), builder_.getI32IntegerAttr(layerOf(op)),
        builder_.getI32IntegerAttr(static_cast<int32_t>(latent)),
        builder_.getI32IntegerAttr(static_cast<int32_t>(rope)), TypeAttr::get(cacheType),
        builder_.getI32IntegerAttr(static_cast<int32_t>(indexKey)), builder_.getStringAttr("none"),
        builder_.getI32IntegerAttr(128));
  }
  for (Operation *op : stateOps) {
    auto kda = cast<KdaOp>(op);
    int64_t channels = 3 * kda.getNumHeads() * kda.getHeadDim();
    builder_.create<plan::RecurrentStateLayerOp>(
        op->getLoc(), builder_.getI32IntegerAttr(layerOf(op)),
        builder_.getI32IntegerAttr(static_cast<int32_t>(kda.getNumHeads())),
        builder_.getI32IntegerAttr(static_cast<int32_t>(kda.getHeadDim())),
        builder_.getI32IntegerAttr(static_cast<int32_t>(kda.getHeadDim())),
        builder_.getBoolAttr(kda.getStateLayout() == StateLayout::v_major),
        builder_.getI32IntegerAttr(static_cast<int32_t>(channels)),
        builder_.getI32IntegerAttr(static_cast<int32_t>(kda.getConvKernel())));
  }
  return success();
}

SmallVector<int32_t> ModelLowering::weightList(ArrayRef<WeightAttr> weights) {
  SmallVector<int32_t> indices;
  for (WeightAttr weight : weights)
    indices.push_back(weight ? tables_.weightIndex.lookup(weight.getName()) : -1);
  return indices;
}

SmallVector<int32_t> ModelLowering::weightList(Operation *op, ArrayRef<StringRef> roles) {
  SmallVector<WeightAttr> weights;
  for (StringRef role : roles)
    weights.push_back(dyn_cast_or_null<WeightAttr>(op->getAttr(role)));
  return weightList(weights);
}

SmallVector<NamedAttribute> ModelLowering::activationParams(Activation activation,
                                                            std::optional<APFloat> beta,
                                                            std::optional<APFloat> linearBeta) {
  SmallVector<NamedAttribute> params = {str("activation", stringifyActivation(activation))};
  if (beta)
    params.push_back(f32("situ_beta", beta->convertToDouble()));
  if (linearBeta)
    params.push_back(f32("situ_linear_beta", linearBeta->convertToDouble()));
  return params;
}

DictionaryAttr ModelLowering::ropeParams(RopeAttr rope) {
  StringRef kind = stringifyRopeKind(rope.getKind());
  StringRef pairing = stringifyRopePairing(rope.getPairing());
  NamedAttribute attrs[] = {
      str("kind", kind),
      str("pairing", pairing),
      builder_.getNamedAttr("theta", builder_.getF64FloatAttr(rope.getTheta())),
      builder_.getNamedAttr("factor", builder_.getF64FloatAttr(rope.getFactor())),
      builder_.getNamedAttr("original_max_position",
                            builder_.getI64IntegerAttr(rope.getOriginalMaxPosition())),
      builder_.getNamedAttr("beta_fast", builder_.getF64FloatAttr(rope.getBetaFast())),
      builder_.getNamedAttr("beta_slow", builder_.getF64FloatAttr(rope.getBetaSlow())),
      builder_.getNamedAttr("mscale", builder_.getF64FloatAttr(rope.getMscale())),
      builder_.getNamedAttr("mscale_all_dim", builder_.getF64FloatAttr(rope.getMscaleAllDim()))};
  return builder_.getDictionaryAttr(attrs);
}

LogicalResult ModelLowering::expand(Operation *op, bool decode, ProgramBuilder &program) {
  SmallVector<NamedAttribute> params;
  const int32_t layer = layerOf(op);
  const std::string name = locationName(op);
  auto inputsOf = [&]() {
    SmallVector<int32_t> inputs;
    for (Value operand : op->getOperands())
      inputs.push_back(program.valueOf(operand));
    return inputs;
  };
  // The common case: one dispatch reading the op's operands and writing its result.
  auto single = [&](plan::KernelId kernel, SmallVector<int32_t> weights) {
    program.addStep({kernel, builder_.getDictionaryAttr(params), inputsOf(),
                     {program.resultOf(op->getResult(0))}, std::move(weights), layer, op->getLoc()});
    return success();
  };
  auto mlaParams = [&](auto mla) {
    params = {i32("num_heads", mla.getNumHeads()),
              i32("q_lora_rank", mla.getQLoraRank().value_or(0)),
              i32("kv_lora_rank", mla.getKvLoraRank()),
              i32("qk_nope_head_dim", mla.getQkNopeHeadDim()),
              i32("qk_rope_head_dim", mla.getQkRopeHeadDim()),
              i32("v_head_dim", mla.getVHeadDim()),
              builder_.getNamedAttr("rope", ropeParams(mla.getRope())),
              f32("softmax_scale", mla.getSoftmaxScale().convertToDouble()),
              f32("latent_norm_epsilon", mla.getLatentNormEpsilon().convertToDouble()),
              i32("kv_slot", tables_.kvSlot.lookup(mla))};
    return weightList(op, {"q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                           "kv_b_proj", "g_proj", "o_proj"});
  };

  if (auto embed = dyn_cast<EmbedOp>(op))
    return single(plan::KernelId::embed, weightList({embed.getWeight()}));
  if (auto norm = dyn_cast<RmsNormOp>(op)) {
    params = {f32("epsilon", norm.getEpsilon().convertToDouble())};
    return single(plan::KernelId::rms_norm, weightList({norm.getWeight()}));
  }
  if (auto linear = dyn_cast<LinearOp>(op))
    return single(plan::KernelId::linear, weightList({linear.getWeight()}));
  if (auto mtpInput = dyn_cast<MtpInputOp>(op)) {
    // enorm(e), hnorm(h), then eh_proj over their concatenation: a two-input linear.
    DictionaryAttr norm = builder_.getDictionaryAttr(
        {f32("epsilon", mtpInput.getEpsilon().convertToDouble())});
    const int64_t width = program.rowElementsOf(mtpInput.getResult());
    Type activation = program.activationType(mtpInput.getResult());
    int32_t embedded = program.addValue(activation, width, name + ".enorm");
    int32_t previous = program.addValue(activation, width, name + ".hnorm");
    program.addStep({plan::KernelId::rms_norm, norm, {program.valueOf(mtpInput.getEmbedding())},
                     {embedded}, weightList({mtpInput.getEnorm()}), layer, op->getLoc()});
    program.addStep({plan::KernelId::rms_norm, norm, {program.valueOf(mtpInput.getHidden())},
                     {previous}, weightList({mtpInput.getHnorm()}), layer, op->getLoc()});
    program.addStep({plan::KernelId::linear, builder_.getDictionaryAttr({}), {embedded, previous},
                     {program.resultOf(mtpInput.getResult())}, weightList({mtpInput.getEhProj()}),
                     layer, op->getLoc()});
    return success();
  }
  if (isa<AddOp>(op))
    return single(plan::KernelId::add, {});
  if (auto head = dyn_cast<LmHeadOp>(op))
    return single(plan::KernelId::lm_head, weightList({head.getWeight()}));
  if (auto kda = dyn_cast<KdaOp>(op)) {
    params = {i32("num_heads", kda.getNumHeads()), i32("head_dim", kda.getHeadDim()),
              i32("conv_kernel", kda.getConvKernel()),
              str("gate", stringifyKdaGateKind(kda.getGateKind())),
              f32("gate_lower_bound",
                  kda.getGateLowerBound() ? kda.getGateLowerBound()->convertToDouble() : 0.0),
              f32("norm_epsilon", kda.getNormEpsilon().convertToDouble()),
              str("state_layout", stringifyStateLayout(kda.getStateLayout())),
              i32("state_slot", tables_.stateSlot.lookup(op))};
    return single(decode ? plan::KernelId::kda_recurrent_decode
                         : plan::KernelId::kda_chunk_prefill,
                  weightList(op, {"q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d",
                                  "v_conv1d", "f_a_proj", "f_b_proj", "A_log", "dt_bias",
                                  "b_proj", "g_a_proj", "g_b_proj", "g_proj", "o_norm",
                                  "o_proj"}));
  }
  if (auto mla = dyn_cast<MlaOp>(op)) {
    SmallVector<int32_t> weights = mlaParams(mla);
    return single(decode ? plan::KernelId::mla_decode : plan::KernelId::mla_prefill, weights);
  }
  if (auto sparse = dyn_cast<SparseMlaOp>(op)) {
    SmallVector<int32_t> weights = mlaParams(sparse);
    return single(decode ? plan::KernelId::sparse_mla_decode : plan::KernelId::sparse_mla_prefill,
                  weights);
  }
  if (auto mix = dyn_cast<AttnResOp>(op)) {
    params = {i32("block_size", mix.getBlockSize()),
              f32("epsilon", mix.getEpsilon().convertToDouble())};
    return single(plan::KernelId::attn_res, weightList({mix.getNorm(), mix.getProj()}));
  }
  if (auto mlp = dyn_cast<MlpOp>(op)) {
    params = activationParams(mlp.getActivation(), mlp.getSituBeta(), mlp.getSituLinearBeta());
    return single(plan::KernelId::mlp,
                  weightList({mlp.getGateProj(), mlp.getUpProj(), mlp.getDownProj()}));
  }

  if (auto indexer = dyn_cast<DsaIndexerOp>(op)) {
    // Three independent prologs (query from the latent, key from the input, head weights from
    // the input), then one fused kernel scoring every cached key, weighting heads and taking the
    // top-k: the scores [tokens, context] never materialize.
    const int64_t heads = indexer.getIndexHeads(), headDim = indexer.getIndexHeadDim();
    SmallVector<NamedAttribute> common = {
        i32("index_heads", heads), i32("index_head_dim", headDim),
        i32("top_k", indexer.getTopK()), i32("rope_head_dim", indexer.getRopeHeadDim()),
        builder_.getNamedAttr("rope", ropeParams(indexer.getRope())),
        f32("norm_epsilon", indexer.getNormEpsilon().convertToDouble()),
        i32("kv_slot", tables_.kvSlot.lookup(op))};
    DictionaryAttr shared = builder_.getDictionaryAttr(common);
    Type f32Type = builder_.getF32Type();
    Type activation = program.activationType(indexer.getInput());
    int32_t query = program.addValue(activation, heads * headDim, name + ".query");
    int32_t key = program.addValue(activation, headDim, name + ".key");
    int32_t headWeights = program.addValue(f32Type, heads, name + ".head_weights");
    int32_t x = program.valueOf(indexer.getInput());
    program.addStep({plan::KernelId::indexer_query, shared,
                     {program.valueOf(indexer.getQLatent())}, {query},
                     weightList({indexer.getWqB()}), layer, op->getLoc()});
    program.addStep({plan::KernelId::indexer_key, shared, {x}, {key},
                     weightList({indexer.getWk(), indexer.getKNorm(), indexer.getKNormBias()}),
                     layer, op->getLoc()});
    program.addStep({plan::KernelId::linear, builder_.getDictionaryAttr({}), {x}, {headWeights},
                     weightList({indexer.getWeightsProj()}), layer, op->getLoc()});
    program.addStep({plan::KernelId::dsa_indexer, shared, {query, key, headWeights},
                     {program.resultOf(indexer.getResult())}, {}, layer, op->getLoc()});
    return success();
  }

  if (auto moe = dyn_cast<MoeOp>(op)) {
    // Router + grouped top-k, the routed experts, and the always-on shared expert as a separate
    // SwiGLU so it can overlap the routed ones; their sum is the layer's output.
    params = {i32("num_experts", moe.getNumExperts()), i32("top_k", moe.getTopK()),
              i32("num_groups", moe.getNumGroups()), i32("topk_groups", moe.getTopkGroups()),
              str("score_function", stringifyScoreFunction(moe.getScoreFunction())),
              builder_.getNamedAttr("renormalize", builder_.getBoolAttr(moe.getRenormalize())),
              f32("routed_scaling_factor", moe.getRoutedScalingFactor().convertToDouble()),
              i32("intermediate_size", moe.getIntermediateSize()),
              i32("num_shared_experts", moe.getNumSharedExperts())};
    SmallVector<NamedAttribute> activation =
        activationParams(moe.getActivation().value_or(Activation::silu), moe.getSituBeta(),
                         moe.getSituLinearBeta());
    params.append(activation.begin(), activation.end());
    DictionaryAttr moeParams = builder_.getDictionaryAttr(params);
    const int64_t topK = moe.getTopK();
    int32_t x = program.valueOf(moe.getInput());
    int32_t expertIds = program.addValue(builder_.getI32Type(), topK, name + ".expert_ids");
    int32_t expertWeights =
        program.addValue(builder_.getF32Type(), topK, name + ".expert_weights");
    program.addStep({plan::KernelId::router_topk, moeParams, {x}, {expertIds, expertWeights},
                     weightList(op, {"router", "correction_bias"}), layer, op->getLoc()});
    SmallVector<int32_t> expertWeightIds;
    for (int64_t e = 0; e < static_cast<int64_t>(moe.getNumExperts()); ++e) {
      SmallVector<int32_t> expert = weightList({cast<WeightAttr>(moe.getExpertsGateProj()[e]),
                                                cast<WeightAttr>(moe.getExpertsUpProj()[e]),
                                                cast<WeightAttr>(moe.getExpertsDownProj()[e])});
      expertWeightIds.append(expert.begin(), expert.end());
    }
    const int32_t output = program.resultOf(moe.getResult());
    Type valueType = program.activationType(moe.getInput());
    const int64_t width = program.rowElementsOf(moe.getInput());
    const bool shared = moe.getNumSharedExperts() > 0;
    const int32_t routed =
        shared ? program.addValue(valueType, width, name + ".routed") : output;
    if (auto down = moe.getRoutedExpertDownProj()) {
      // Latent MoE as existing kernels: project down, the experts in the latent width, the
      // optional RMSNorm of their weighted sum, project up.
      const int64_t latent = down->getShape()[0];
      int32_t latentIn = program.addValue(valueType, latent, name + ".latent_in");
      int32_t latentOut = program.addValue(valueType, latent, name + ".latent_out");
      DictionaryAttr none = builder_.getDictionaryAttr({});
      program.addStep({plan::KernelId::linear, none, {x}, {latentIn}, weightList({*down}), layer,
                       op->getLoc()});
      program.addStep({plan::KernelId::moe_experts, moeParams,
                       {latentIn, expertIds, expertWeights}, {latentOut}, expertWeightIds, layer,
                       op->getLoc()});
      if (auto norm = moe.getRoutedExpertNorm()) {
        int32_t normed = program.addValue(valueType, latent, name + ".latent_normed");
        program.addStep(
            {plan::KernelId::rms_norm,
             builder_.getDictionaryAttr(
                 {f32("epsilon", moe.getRoutedExpertNormEpsilon()->convertToDouble())}),
             {latentOut}, {normed}, weightList({*norm}), layer, op->getLoc()});
        latentOut = normed;
      }
      program.addStep({plan::KernelId::linear, none, {latentOut}, {routed},
                       weightList({*moe.getRoutedExpertUpProj()}), layer, op->getLoc()});
    } else {
      program.addStep({plan::KernelId::moe_experts, moeParams, {x, expertIds, expertWeights},
                       {routed}, expertWeightIds, layer, op->getLoc()});
    }
    if (!shared)
      return success();
    int32_t sharedOut = program.addValue(valueType, width, name + ".shared");
    program.addStep({plan::KernelId::mlp, builder_.getDictionaryAttr(activation), {x},
                     {sharedOut},
                     weightList(op, {"shared_gate_proj", "shared_up_proj", "shared_down_proj"}),
                     layer, op->getLoc()});
    program.addStep({plan::KernelId::add, builder_.getDictionaryAttr({}), {routed, sharedOut},
                     {output}, {}, layer, op->getLoc()});
    return success();
  }
  return op->emitOpError() << "has no kernel in the plan";
}

LogicalResult ModelLowering::emitProgram(plan::PlanOp planOp, StringRef name, int64_t maxTokens,
                                         bool decode, Block &modelBlock) {
  builder_.setInsertionPointToEnd(&planOp.getBodyBlock());
  Location loc = model_.getLoc();
  auto program = builder_.create<plan::ProgramOp>(
      loc, builder_.getStringAttr(name), builder_.getI64IntegerAttr(maxTokens),
      builder_.getI64IntegerAttr(0), builder_.getI32IntegerAttr(0), builder_.getI32IntegerAttr(0),
      builder_.getDenseI32ArrayAttr({}), builder_.getI32IntegerAttr(1),
      builder_.getI32IntegerAttr(0), builder_.getI32IntegerAttr(-1));
  Block *body = builder_.createBlock(&program.getBody());

  // The token ids first (then the mtp region's hidden-state input), then the ops' results and
  // the intermediates their expansions need.
  // fp32 activations on both devices for now: the cuda device runs the dispatches it has no GPU
  // kernel for yet (MLA, DSA, MoE, AttnRes) with the cpu reference on the same values.
  ProgramBuilder values(builder_, /*fp32Activations=*/true);
  const int32_t tokenIds = values.addValue(builder_.getI64Type(), 1, "input_ids");
  values.bind(modelBlock.getArgument(0), tokenIds);
  int32_t hiddenInput = -1;
  if (modelBlock.getNumArguments() > 1) {
    hiddenInput = values.addValue(builder_.getF32Type(), model_.getHiddenSize(), "hidden_input");
    values.bind(modelBlock.getArgument(1), hiddenInput);
  }
  for (Operation &op : modelBlock.without_terminator())
    if (failed(expand(&op, decode, values)))
      return failure();

  // Values, then steps; --hybrid-plan-memory gives the values arena offsets (-1: not yet).
  builder_.setInsertionPointToEnd(body);
  for (const ProgramBuilder::ValueSpec &value : values.values())
    builder_.create<plan::ValueOp>(loc, TypeAttr::get(value.dtype),
                                   builder_.getI64IntegerAttr(value.rowElements),
                                   builder_.getI64IntegerAttr(-1),
                                   builder_.getStringAttr(value.name),
                                   builder_.getStringAttr("step"));
  // The residual stream after each layer is the last value the layer writes.
  auto returnOp = cast<ReturnOp>(modelBlock.getTerminator());
  std::map<int32_t, int32_t> layerOutput;
  for (const ProgramBuilder::StepSpec &step : values.steps()) {
    builder_.create<plan::DispatchOp>(
        step.loc, plan::KernelIdAttr::get(builder_.getContext(), step.kernel),
        builder_.getDenseI32ArrayAttr(step.inputs), builder_.getDenseI32ArrayAttr(step.outputs),
        builder_.getDenseI32ArrayAttr(step.weights), step.params, builder_.getI32IntegerAttr(0),
        builder_.getDenseI32ArrayAttr({}), builder_.getI32IntegerAttr(-1),
        builder_.getI32IntegerAttr(step.layer));
    if (step.layer >= 0)
      layerOutput[step.layer] = step.outputs.back();
  }
  Operation *head = returnOp.getLogits().getDefiningOp();
  // The residual stream's start: the embedding, or in the mtp region the input projection.
  Operation *embed = nullptr;
  for (Operation &op : modelBlock)
    if (isa<EmbedOp>(op) || isa<MtpInputOp>(op))
      embed = &op;
  if (!embed || !head)
    return model_.emitOpError() << "needs an embedding and an LM head to lower";
  SmallVector<int32_t> layerOutputs = {values.valueOf(embed->getResult(0))};
  // The main model's layers, or the mtp region's one decoder block (index num_layers).
  const bool mtp = hiddenInput >= 0;
  const int32_t firstLayer = mtp ? static_cast<int32_t>(model_.getNumLayers()) : 0;
  const int32_t endLayer = static_cast<int32_t>(model_.getNumLayers()) + (mtp ? 1 : 0);
  for (int32_t layer = firstLayer; layer < endLayer; ++layer) {
    auto it = layerOutput.find(layer);
    if (it == layerOutput.end())
      return model_.emitOpError() << "layer " << layer << " has no ops";
    layerOutputs.push_back(it->second);
  }
  layerOutputs.push_back(values.valueOf(head->getOperand(0)));

  program.setTokenIdsAttr(builder_.getI32IntegerAttr(tokenIds));
  program.setLogitsAttr(builder_.getI32IntegerAttr(values.valueOf(returnOp.getLogits())));
  program.setLayerOutputsAttr(builder_.getDenseI32ArrayAttr(layerOutputs));
  program.setHiddenInputAttr(builder_.getI32IntegerAttr(hiddenInput));
  return success();
}

LogicalResult ModelLowering::run() {
  if (options_.device != "cpu" && options_.device != "cuda")
    return model_.emitOpError() << "unknown target device '" << options_.device
                                << "' (cpu or cuda)";
  collectWeights();
  collectCacheSlots();

  builder_.setInsertionPoint(model_);
  auto planOp = builder_.create<plan::PlanOp>(
      model_.getLoc(), model_.getSymNameAttr(), builder_.getDenseI32ArrayAttr({kPlanVersionMajor, kPlanVersionMinor}),
      builder_.getStringAttr(options_.compilerId), model_.getModelTypeAttr(),
      builder_.getStringAttr(options_.device), builder_.getStringAttr(options_.arch),
      builder_.getI32IntegerAttr(1), model_.getHiddenSizeAttr(), model_.getVocabSizeAttr(),
      builder_.getI32IntegerAttr(static_cast<int32_t>(model_.getNumLayers())),
      builder_.getStringAttr(""), builder_.getI64IntegerAttr(0),
      builder_.getI32IntegerAttr(options_.pageSize), model_.getFp8ActivationScaleAttr(),
      IntegerAttr(), IntegerAttr(), IntegerAttr(), IntegerAttr()); // one rank: --hybrid-shard sets them
  builder_.createBlock(&planOp.getBody());
  if (failed(emitHeader(planOp)))
    return failure();
  if (failed(emitProgram(planOp, "prefill", options_.prefillTokens, /*decode=*/false,
                         model_.getBodyBlock())) ||
      failed(emitProgram(planOp, "decode", options_.decodeTokens, /*decode=*/true,
                         model_.getBodyBlock())))
    return failure();
  // The multi-token-prediction layer: rows of (next token, main hidden state) at consecutive
  // positions, prefill kernels like a verification pass (docs/mtp.md).
  if (Block *mtp = model_.getMtpBlock())
    if (failed(emitProgram(planOp, "mtp", options_.prefillTokens, /*decode=*/false, *mtp)))
      return failure();
  model_.erase();
  return success();
}

struct LowerToPlanPass : impl::LowerToPlanBase<LowerToPlanPass> {
  using LowerToPlanBase::LowerToPlanBase;

  void runOnOperation() override {
    LowerToPlanOptions options{device, arch, prefillTokens, decodeTokens, pageSize,
                                     compilerId};
    SmallVector<ModelOp> models(getOperation().getOps<ModelOp>());
    for (ModelOp model : models) {
      ModelLowering lowering(model, options);
      if (failed(lowering.run()))
        return signalPassFailure();
    }
  }
};

} // namespace
} // namespace hybrid
