// --hybrid-lower-to-plan: hybrid.model -> plan.plan (see Passes.td).
#include "compiler/Transforms/Passes.h"

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

// "model.layers.3.self_attn" -> 3; -1 for model-level ops.
int32_t layerOf(Operation *op) {
  auto name = dyn_cast<NameLoc>(op->getLoc());
  if (!name)
    return -1;
  StringRef rest = name.getName().getValue();
  int32_t layer = -1;
  if (!rest.consume_front("model.layers.") || rest.consumeInteger(10, layer))
    return -1;
  return layer;
}

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

class ModelLowering {
public:
  ModelLowering(ModelOp model, const LowerToPlanOptions &options)
      : model_(model), options_(options), builder_(model.getContext()) {}

  LogicalResult run();

private:
  void collectWeights();
  void collectCacheSlots();
  void emitHeader(plan::PlanOp planOp);
  LogicalResult emitProgram(plan::PlanOp planOp, StringRef name, int64_t maxTokens, bool decode);

  // Dispatch construction.
  SmallVector<int32_t> weightList(ArrayRef<WeightAttr> weights);
  SmallVector<int32_t> weightList(Operation *op, ArrayRef<StringRef> roles);
  DictionaryAttr ropeParams(RopeAttr rope);
  FailureOr<std::pair<plan::KernelId, DictionaryAttr>> kernelFor(Operation *op, bool decode,
                                                                 SmallVector<int32_t> &weights);

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

void ModelLowering::emitHeader(plan::PlanOp planOp) {
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
        DenseI32ArrayAttr(), builder_.getI32IntegerAttr(-1));
    auto weight = tables_.weights.lookup(name);
    if (weight && !weight.getScaleName().empty()) {
      // Block dims: how many weight elements one scale covers along each axis.
      SmallVector<int32_t> block;
      for (auto [dim, scaleDim] : llvm::zip(weight.getShape(), weight.getScaleType().getShape()))
        block.push_back(static_cast<int32_t>((dim + scaleDim - 1) / scaleDim));
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
        builder_.getI32IntegerAttr(static_cast<int32_t>(indexKey)));
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

FailureOr<std::pair<plan::KernelId, DictionaryAttr>>
ModelLowering::kernelFor(Operation *op, bool decode, SmallVector<int32_t> &weights) {
  SmallVector<NamedAttribute> params;
  plan::KernelId kernel;
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
    weights = weightList(op, {"q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                              "kv_b_proj", "g_proj", "o_proj"});
  };

  if (auto embed = dyn_cast<EmbedOp>(op)) {
    kernel = plan::KernelId::embed;
    weights = weightList({embed.getWeight()});
  } else if (auto norm = dyn_cast<RmsNormOp>(op)) {
    kernel = plan::KernelId::rms_norm;
    params = {f32("epsilon", norm.getEpsilon().convertToDouble())};
    weights = weightList({norm.getWeight()});
  } else if (auto linear = dyn_cast<LinearOp>(op)) {
    kernel = plan::KernelId::linear;
    weights = weightList({linear.getWeight()});
  } else if (isa<AddOp>(op)) {
    kernel = plan::KernelId::add;
  } else if (auto kda = dyn_cast<KdaOp>(op)) {
    kernel = decode ? plan::KernelId::kda_recurrent_decode : plan::KernelId::kda_chunk_prefill;
    params = {i32("num_heads", kda.getNumHeads()), i32("head_dim", kda.getHeadDim()),
              i32("conv_kernel", kda.getConvKernel()),
              str("gate", stringifyKdaGateKind(kda.getGateKind())),
              f32("gate_lower_bound",
                  kda.getGateLowerBound() ? kda.getGateLowerBound()->convertToDouble() : 0.0),
              f32("norm_epsilon", kda.getNormEpsilon().convertToDouble()),
              str("state_layout", stringifyStateLayout(kda.getStateLayout())),
              i32("state_slot", tables_.stateSlot.lookup(op))};
    weights = weightList(op, {"q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d",
                              "f_a_proj", "f_b_proj", "A_log", "dt_bias", "b_proj", "g_a_proj",
                              "g_b_proj", "g_proj", "o_norm", "o_proj"});
  } else if (auto mla = dyn_cast<MlaOp>(op)) {
    kernel = decode ? plan::KernelId::mla_decode : plan::KernelId::mla_prefill;
    mlaParams(mla);
  } else if (auto sparse = dyn_cast<SparseMlaOp>(op)) {
    kernel = decode ? plan::KernelId::sparse_mla_decode : plan::KernelId::sparse_mla_prefill;
    mlaParams(sparse);
  } else if (auto indexer = dyn_cast<DsaIndexerOp>(op)) {
    kernel = plan::KernelId::dsa_indexer;
    params = {i32("index_heads", indexer.getIndexHeads()),
              i32("index_head_dim", indexer.getIndexHeadDim()), i32("top_k", indexer.getTopK()),
              i32("rope_head_dim", indexer.getRopeHeadDim()),
              builder_.getNamedAttr("rope", ropeParams(indexer.getRope())),
              f32("norm_epsilon", indexer.getNormEpsilon().convertToDouble()),
              i32("kv_slot", tables_.kvSlot.lookup(op))};
    weights = weightList({indexer.getWqB(), indexer.getWk(), indexer.getKNorm(),
                          indexer.getKNormBias(), indexer.getWeightsProj()});
  } else if (auto mix = dyn_cast<AttnResOp>(op)) {
    kernel = plan::KernelId::attn_res;
    params = {i32("block_size", mix.getBlockSize()),
              f32("epsilon", mix.getEpsilon().convertToDouble())};
    weights = weightList({mix.getNorm(), mix.getProj()});
  } else if (auto mlp = dyn_cast<MlpOp>(op)) {
    kernel = plan::KernelId::mlp;
    params = {str("activation", stringifyActivation(mlp.getActivation()))};
    weights = weightList({mlp.getGateProj(), mlp.getUpProj(), mlp.getDownProj()});
  } else if (auto moe = dyn_cast<MoeOp>(op)) {
    kernel = plan::KernelId::moe;
    params = {i32("num_experts", moe.getNumExperts()), i32("top_k", moe.getTopK()),
              i32("num_groups", moe.getNumGroups()), i32("topk_groups", moe.getTopkGroups()),
              str("score_function", stringifyScoreFunction(moe.getScoreFunction())),
              builder_.getNamedAttr("renormalize", builder_.getBoolAttr(moe.getRenormalize())),
              f32("routed_scaling_factor", moe.getRoutedScalingFactor().convertToDouble()),
              i32("intermediate_size", moe.getIntermediateSize()),
              i32("num_shared_experts", moe.getNumSharedExperts())};
    weights = weightList(op, {"router", "correction_bias", "shared_gate_proj", "shared_up_proj",
                              "shared_down_proj"});
    for (int64_t e = 0; e < static_cast<int64_t>(moe.getNumExperts()); ++e) {
      SmallVector<int32_t> expert =
          weightList({cast<WeightAttr>(moe.getExpertsGateProj()[e]),
                      cast<WeightAttr>(moe.getExpertsUpProj()[e]),
                      cast<WeightAttr>(moe.getExpertsDownProj()[e])});
      weights.append(expert.begin(), expert.end());
    }
  } else if (auto head = dyn_cast<LmHeadOp>(op)) {
    kernel = plan::KernelId::lm_head;
    weights = weightList({head.getWeight()});
  } else {
    return op->emitOpError() << "has no kernel in the plan";
  }
  return std::make_pair(kernel, builder_.getDictionaryAttr(params));
}

LogicalResult ModelLowering::emitProgram(plan::PlanOp planOp, StringRef name, int64_t maxTokens,
                                         bool decode) {
  builder_.setInsertionPointToEnd(&planOp.getBodyBlock());
  Location loc = model_.getLoc();
  auto program = builder_.create<plan::ProgramOp>(
      loc, builder_.getStringAttr(name), builder_.getI64IntegerAttr(maxTokens),
      builder_.getI64IntegerAttr(0), builder_.getI32IntegerAttr(0), builder_.getI32IntegerAttr(0),
      builder_.getDenseI32ArrayAttr({}), builder_.getI32IntegerAttr(1),
      builder_.getI32IntegerAttr(0));
  Block *body = builder_.createBlock(&program.getBody());

  // Values: the token ids, then every op result, in program order.
  Block &modelBlock = model_.getBodyBlock();
  llvm::DenseMap<Value, int32_t> valueIndex;
  SmallVector<Value> values;
  auto addValue = [&](Value v) {
    valueIndex[v] = static_cast<int32_t>(values.size());
    values.push_back(v);
  };
  addValue(modelBlock.getArgument(0));
  SmallVector<Operation *> steps;
  for (Operation &op : modelBlock.without_terminator()) {
    steps.push_back(&op);
    for (Value result : op.getResults())
      addValue(result);
  }

  auto returnOp = cast<ReturnOp>(modelBlock.getTerminator());
  auto rowBytesOf = [&](Value v) {
    auto type = cast<RankedTensorType>(v.getType());
    Type element = type.getElementType();
    if (isa<FloatType>(element) && options_.device == "cpu")
      element = builder_.getF32Type(); // the CPU reference computes in fp32
    int64_t rowElements = type.getRank() == 1 ? 1 : type.getDimSize(1);
    return std::make_pair(rowElements, element);
  };

  // Emit values; --hybrid-plan-memory gives them arena offsets (-1: not planned yet).
  builder_.setInsertionPointToEnd(body);
  for (auto [v, value] : llvm::enumerate(values)) {
    auto [rowElements, element] = rowBytesOf(value);
    std::string valueName = v == 0 ? std::string("input_ids") : locationName(value.getDefiningOp());
    builder_.create<plan::ValueOp>(loc, TypeAttr::get(element),
                                   builder_.getI64IntegerAttr(rowElements),
                                   builder_.getI64IntegerAttr(-1),
                                   builder_.getStringAttr(valueName));
  }

  // Emit steps; the residual stream after each layer is the result of the layer's last op.
  std::map<int32_t, int32_t> layerOutput;
  int32_t embedOutput = -1, finalNormOutput = -1;
  for (Operation *op : steps) {
    SmallVector<int32_t> weights;
    FailureOr<std::pair<plan::KernelId, DictionaryAttr>> kernel = kernelFor(op, decode, weights);
    if (failed(kernel))
      return failure();
    SmallVector<int32_t> inputs, outputs;
    for (Value operand : op->getOperands())
      inputs.push_back(valueIndex[operand]);
    for (Value result : op->getResults())
      outputs.push_back(valueIndex[result]);
    int32_t layer = layerOf(op);
    builder_.create<plan::DispatchOp>(
        op->getLoc(), plan::KernelIdAttr::get(builder_.getContext(), kernel->first),
        builder_.getDenseI32ArrayAttr(inputs), builder_.getDenseI32ArrayAttr(outputs),
        builder_.getDenseI32ArrayAttr(weights), kernel->second, builder_.getI32IntegerAttr(0),
        builder_.getDenseI32ArrayAttr({}), builder_.getI32IntegerAttr(-1),
        builder_.getI32IntegerAttr(layer));
    if (layer >= 0)
      layerOutput[layer] = outputs.front();
    if (isa<EmbedOp>(op))
      embedOutput = outputs.front();
    if (isa<RmsNormOp>(op) && returnOp.getLogits().getDefiningOp() &&
        returnOp.getLogits().getDefiningOp()->getOperand(0) == op->getResult(0))
      finalNormOutput = outputs.front();
  }
  SmallVector<int32_t> layerOutputs = {embedOutput};
  for (int32_t layer = 0; layer < static_cast<int32_t>(model_.getNumLayers()); ++layer) {
    auto it = layerOutput.find(layer);
    if (it == layerOutput.end())
      return model_.emitOpError() << "layer " << layer << " has no ops";
    layerOutputs.push_back(it->second);
  }
  layerOutputs.push_back(finalNormOutput);

  program.setTokenIdsAttr(builder_.getI32IntegerAttr(0));
  program.setLogitsAttr(builder_.getI32IntegerAttr(valueIndex[returnOp.getLogits()]));
  program.setLayerOutputsAttr(builder_.getDenseI32ArrayAttr(layerOutputs));
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
      model_.getLoc(), model_.getSymNameAttr(), builder_.getDenseI32ArrayAttr({1, 0}),
      builder_.getStringAttr(options_.compilerId), model_.getModelTypeAttr(),
      builder_.getStringAttr(options_.device), builder_.getStringAttr(options_.arch),
      builder_.getI32IntegerAttr(1), model_.getHiddenSizeAttr(), model_.getVocabSizeAttr(),
      builder_.getI32IntegerAttr(static_cast<int32_t>(model_.getNumLayers())),
      builder_.getStringAttr(""), builder_.getI64IntegerAttr(0),
      builder_.getI32IntegerAttr(options_.pageSize));
  builder_.createBlock(&planOp.getBody());
  emitHeader(planOp);
  if (failed(emitProgram(planOp, "prefill", options_.prefillTokens, /*decode=*/false)) ||
      failed(emitProgram(planOp, "decode", options_.decodeTokens, /*decode=*/true)))
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
