#include "compiler/Target/DType.h"
#include "compiler/Target/PlanWriter.h"

#include "runtime/schema/plan_generated.h"

#include "flatbuffers/idl.h"
#include "mlir/IR/BuiltinAttributes.h"

namespace hybrid::target {
namespace {

#include "compiler/Target/PlanSchema.inc" // kPlanSchemaText: runtime/schema/plan.fbs

namespace fb = plan::fb;
using namespace mlir;

class ParamReader {
public:
  ParamReader(DictionaryAttr params) : params_(params) {}
  int32_t i32(StringRef name) const {
    auto attr = params_.getAs<IntegerAttr>(name);
    return attr ? static_cast<int32_t>(attr.getInt()) : 0;
  }
  int64_t i64(StringRef name) const {
    auto attr = params_.getAs<IntegerAttr>(name);
    return attr ? attr.getInt() : 0;
  }
  double real(StringRef name) const {
    auto attr = params_.getAs<FloatAttr>(name);
    return attr ? attr.getValueAsDouble() : 0.0;
  }
  bool flag(StringRef name) const {
    auto attr = params_.getAs<BoolAttr>(name);
    return attr && attr.getValue();
  }
  StringRef text(StringRef name) const {
    auto attr = params_.getAs<StringAttr>(name);
    return attr ? attr.getValue() : StringRef();
  }
  DictionaryAttr dict(StringRef name) const {
    auto attr = params_.getAs<DictionaryAttr>(name);
    return attr ? attr : DictionaryAttr::get(params_.getContext());
  }

private:
  DictionaryAttr params_;
};

flatbuffers::Offset<fb::Rope> writeRope(flatbuffers::FlatBufferBuilder &b, DictionaryAttr dict) {
  ParamReader rope(dict);
  fb::RopeKind kind = rope.text("kind") == "yarn"    ? fb::RopeKind::Yarn
                      : rope.text("kind") == "plain" ? fb::RopeKind::Plain
                                                     : fb::RopeKind::None;
  fb::RopePairing pairing = rope.text("pairing") == "half_split" ? fb::RopePairing::HalfSplit
                                                                 : fb::RopePairing::Interleaved;
  return fb::CreateRope(b, kind, pairing, rope.real("theta"), rope.real("factor"),
                        rope.i64("original_max_position"), rope.real("beta_fast"),
                        rope.real("beta_slow"), rope.real("mscale"), rope.real("mscale_all_dim"));
}

fb::Activation writeActivation(const ParamReader &p) {
  return p.text("activation") == "situ" ? fb::Activation::Situ : fb::Activation::Silu;
}

// The params table of a dispatch, typed by its kernel.
std::pair<fb::KernelParams, flatbuffers::Offset<void>>
writeParams(flatbuffers::FlatBufferBuilder &b, plan::DispatchOp dispatch) {
  ParamReader p(dispatch.getParams());
  switch (dispatch.getKernel()) {
  case plan::KernelId::embed:
    return {fb::KernelParams::EmbedParams, fb::CreateEmbedParams(b).Union()};
  case plan::KernelId::rms_norm:
  case plan::KernelId::add_rms_norm:
    return {fb::KernelParams::RmsNormParams,
            fb::CreateRmsNormParams(b, static_cast<float>(p.real("epsilon"))).Union()};
  case plan::KernelId::linear:
    return {fb::KernelParams::LinearParams, fb::CreateLinearParams(b).Union()};
  case plan::KernelId::add:
    return {fb::KernelParams::AddParams, fb::CreateAddParams(b).Union()};
  case plan::KernelId::kda_chunk_prefill:
  case plan::KernelId::kda_recurrent_decode:
  case plan::KernelId::kda_context_summary:
    return {fb::KernelParams::KdaParams,
            fb::CreateKdaParams(
                b, p.i32("num_heads"), p.i32("head_dim"), p.i32("conv_kernel"),
                p.text("gate") == "lower_bound" ? fb::KdaGate::LowerBound : fb::KdaGate::Softplus,
                static_cast<float>(p.real("gate_lower_bound")),
                static_cast<float>(p.real("norm_epsilon")),
                p.text("state_layout") == "v_major" ? fb::StateLayout::VMajor
                                                    : fb::StateLayout::KMajor,
                p.i32("state_slot"))
                .Union()};
  case plan::KernelId::mla_prefill:
  case plan::KernelId::mla_decode:
  case plan::KernelId::sparse_mla_prefill:
  case plan::KernelId::sparse_mla_decode:
  case plan::KernelId::mla_cache_rows: {
    auto rope = writeRope(b, p.dict("rope"));
    return {fb::KernelParams::MlaParams,
            fb::CreateMlaParams(b, p.i32("num_heads"), p.i32("q_lora_rank"), p.i32("kv_lora_rank"),
                                p.i32("qk_nope_head_dim"), p.i32("qk_rope_head_dim"),
                                p.i32("v_head_dim"), rope,
                                static_cast<float>(p.real("softmax_scale")),
                                static_cast<float>(p.real("latent_norm_epsilon")),
                                p.i32("kv_slot"))
                .Union()};
  }
  case plan::KernelId::dsa_indexer:
  case plan::KernelId::indexer_query:
  case plan::KernelId::indexer_key: {
    auto rope = writeRope(b, p.dict("rope"));
    return {fb::KernelParams::DsaIndexerParams,
            fb::CreateDsaIndexerParams(b, p.i32("index_heads"), p.i32("index_head_dim"),
                                       p.i32("top_k"), p.i32("rope_head_dim"), rope,
                                       static_cast<float>(p.real("norm_epsilon")), p.i32("kv_slot"),
                                       p.text("quantize") == "mxfp8" ? fb::ActivationQuant::Mxfp8
                                       : p.text("quantize") == "fp8"
                                           ? fb::ActivationQuant::Fp8PerRow
                                           : fb::ActivationQuant::None)
                .Union()};
  }
  case plan::KernelId::attn_res:
  case plan::KernelId::attn_res_rms_norm:
    return {fb::KernelParams::AttnResParams,
            fb::CreateAttnResParams(b, p.i32("block_size"), static_cast<float>(p.real("epsilon")),
                                    static_cast<float>(p.real("output_norm_epsilon")))
                .Union()};
  case plan::KernelId::mlp:
    return {fb::KernelParams::MlpParams,
            fb::CreateMlpParams(b, writeActivation(p), static_cast<float>(p.real("situ_beta")),
                                static_cast<float>(p.real("situ_linear_beta")))
                .Union()};
  case plan::KernelId::moe_experts:
  case plan::KernelId::router_topk:
    return {fb::KernelParams::MoeParams,
            fb::CreateMoeParams(b, p.i32("num_experts"), p.i32("top_k"), p.i32("num_groups"),
                                p.i32("topk_groups"),
                                p.text("score_function") == "softmax" ? fb::ScoreFunction::Softmax
                                                                      : fb::ScoreFunction::Sigmoid,
                                p.flag("renormalize"),
                                static_cast<float>(p.real("routed_scaling_factor")),
                                p.i32("intermediate_size"), p.i32("num_shared_experts"),
                                writeActivation(p), static_cast<float>(p.real("situ_beta")),
                                static_cast<float>(p.real("situ_linear_beta")),
                                p.flag("all_to_all"))
                .Union()};
  case plan::KernelId::lm_head:
    return {fb::KernelParams::LmHeadParams, fb::CreateLmHeadParams(b).Union()};
  case plan::KernelId::all_reduce_sum:
  case plan::KernelId::all_gather_rows: {
    const fb::CollectiveGroup group = p.text("group") == "expert_parallel"
                                          ? fb::CollectiveGroup::ExpertParallel
                                      : p.text("group") == "context_parallel"
                                          ? fb::CollectiveGroup::ContextParallel
                                          : fb::CollectiveGroup::TensorParallel;
    return {fb::KernelParams::CollectiveParams,
            fb::CreateCollectiveParams(b, group, p.i32("tail_rows")).Union()};
  }
  }
  return {fb::KernelParams::NONE, 0};
}

FailureOr<fb::ValueRows> valueRows(plan::ValueOp value) {
  const StringRef rows = value.getRows();
  if (rows == "step")
    return fb::ValueRows::Step;
  if (rows == "context_shard")
    return fb::ValueRows::ContextShard;
  if (rows == "context_chunks")
    return fb::ValueRows::ContextChunks;
  if (rows == "all_context_chunks")
    return fb::ValueRows::AllContextChunks;
  return value.emitOpError() << "rows \"" << rows
                             << "\" is not step, context_shard, context_chunks or "
                                "all_context_chunks";
}

std::vector<int32_t> toVector(ArrayRef<int32_t> values) {
  return std::vector<int32_t>(values.begin(), values.end());
}

} // namespace

FailureOr<std::vector<uint8_t>> serializePlan(plan::PlanOp planOp) {
  if (std::optional<StringRef> scale = planOp.getFp8ActivationScale();
      scale && *scale != "amax" && *scale != "ue8m0")
    return planOp.emitOpError() << "fp8_activation_scale must be \"amax\" or \"ue8m0\", got \""
                                << *scale << "\"";
  flatbuffers::FlatBufferBuilder b(1 << 16);
  Block &body = planOp.getBodyBlock();

  std::vector<flatbuffers::Offset<fb::Weight>> weights;
  for (plan::WeightOp weight : body.getOps<plan::WeightOp>()) {
    auto type = cast<RankedTensorType>(weight.getType());
    std::vector<int64_t> shape(type.getShape().begin(), type.getShape().end());
    std::vector<int32_t> block, tile;
    if (auto dims = weight.getBlock())
      block = toVector(*dims);
    if (auto dims = weight.getTile())
      tile = toVector(*dims);
    const int32_t scale = static_cast<int32_t>(weight.getScale());
    const bool quantized = scale >= 0;
    std::vector<int64_t> slice;
    if (auto part = weight.getSlice())
      slice.assign(part->begin(), part->end());
    weights.push_back(fb::CreateWeightDirect(
        b, weight.getName().str().c_str(), toPlanDType(type.getElementType()), &shape,
        static_cast<uint64_t>(weight.getOffset()), static_cast<uint64_t>(weight.getSize()),
        weight.getNzTiled() ? fb::Layout::NzTiled : fb::Layout::RowMajor,
        quantized ? fb::QuantKind::Fp8Block : fb::QuantKind::None, quantized ? &block : nullptr,
        scale, weight.getNzTiled() ? &tile : nullptr, slice.empty() ? nullptr : &slice));
  }

  std::vector<flatbuffers::Offset<fb::KvCacheLayer>> kv;
  for (plan::KvCacheLayerOp layer : body.getOps<plan::KvCacheLayerOp>())
    kv.push_back(fb::CreateKvCacheLayer(
        b, layer.getLayer(), layer.getLatentDim(), layer.getRopeDim(),
        toPlanDType(layer.getDtype()), layer.getIndexKeyDim(),
        layer.getQuant() == "fp8_tiles" ? fb::KvQuant::Fp8Tiles : fb::KvQuant::None,
        layer.getQuantTile()));
  std::vector<flatbuffers::Offset<fb::RecurrentStateLayer>> recurrent;
  for (plan::RecurrentStateLayerOp layer : body.getOps<plan::RecurrentStateLayerOp>())
    recurrent.push_back(fb::CreateRecurrentStateLayer(
        b, layer.getLayer(), layer.getNumHeads(), layer.getHeadKDim(), layer.getHeadVDim(),
        layer.getVMajor() ? fb::StateLayout::VMajor : fb::StateLayout::KMajor,
        layer.getConvChannels(), layer.getConvKernel()));
  auto cache = fb::CreateCacheSpecDirect(b, planOp.getPageSize(), &kv, &recurrent);

  std::vector<flatbuffers::Offset<fb::Program>> programs;
  for (plan::ProgramOp program : body.getOps<plan::ProgramOp>()) {
    std::vector<flatbuffers::Offset<fb::Value>> values;
    std::vector<flatbuffers::Offset<fb::Step>> steps;
    for (Operation &op : program.getBodyBlock()) {
      if (auto value = dyn_cast<plan::ValueOp>(op)) {
        FailureOr<fb::ValueRows> rows = valueRows(value);
        if (failed(rows))
          return failure();
        values.push_back(fb::CreateValueDirect(b, toPlanDType(value.getDtype()),
                                               value.getRowElements(),
                                               static_cast<uint64_t>(value.getOffset()),
                                               value.getName().str().c_str(), *rows));
      } else if (auto dispatch = dyn_cast<plan::DispatchOp>(op)) {
        auto [paramsType, params] = writeParams(b, dispatch);
        if (paramsType == fb::KernelParams::NONE)
          return dispatch.emitOpError() << "has no params table for its kernel";
        std::vector<int32_t> inputs = toVector(dispatch.getInputs());
        std::vector<int32_t> outputs = toVector(dispatch.getOutputs());
        std::vector<int32_t> weightIds = toVector(dispatch.getWeights());
        std::vector<int32_t> waits = toVector(dispatch.getWaitEvents());
        auto step = fb::CreateDispatchDirect(
            b, static_cast<fb::KernelId>(dispatch.getKernel()), paramsType, params, &inputs,
            &outputs, &weightIds, dispatch.getStream(), &waits, dispatch.getSignalEvent(),
            dispatch.getLayer());
        steps.push_back(fb::CreateStep(b, fb::StepOp::Dispatch, step.Union()));
      } else if (auto copy = dyn_cast<plan::CopyOp>(op)) {
        auto step = fb::CreateCopy(b, copy.getSource(), copy.getDestination(), copy.getStream());
        steps.push_back(fb::CreateStep(b, fb::StepOp::Copy, step.Union()));
      }
    }
    std::vector<int32_t> layerOutputs = toVector(program.getLayerOutputs());
    programs.push_back(fb::CreateProgramDirect(
        b, program.getName().str().c_str(), program.getMaxTokens(), &values, &steps,
        static_cast<uint64_t>(program.getArenaBytes()), program.getTokenIds(),
        program.getLogits(), &layerOutputs, program.getNumStreams(), program.getNumEvents(),
        program.getHiddenInput()));
  }

  ArrayRef<int32_t> version = planOp.getVersion();
  fb::Version planVersion(static_cast<uint16_t>(version.size() > 0 ? version[0] : 0),
                          static_cast<uint16_t>(version.size() > 1 ? version[1] : 0));
  auto target = fb::CreateTargetDirect(
      b, planOp.getDevice().str().c_str(), planOp.getArch().str().c_str(), planOp.getWorldSize(),
      static_cast<int32_t>(planOp.getRank().value_or(0)),
      static_cast<int32_t>(planOp.getTensorParallel().value_or(1)),
      static_cast<int32_t>(planOp.getExpertParallel().value_or(1)),
      static_cast<int32_t>(planOp.getContextParallel().value_or(1)));
  auto root = fb::CreatePlanDirect(
      b, &planVersion, planOp.getCompiler().str().c_str(), planOp.getModelType().str().c_str(),
      target, planOp.getHiddenSize(), planOp.getVocabSize(), planOp.getNumLayers(), &weights,
      planOp.getWeightArchiveKey().str().c_str(),
      static_cast<uint64_t>(planOp.getWeightArchiveBytes()), cache, &programs,
      planOp.getFp8ActivationScale() == "ue8m0" ? fb::Fp8ActivationScale::Ue8m0
                                                : fb::Fp8ActivationScale::Amax);
  fb::FinishPlanBuffer(b, root);
  return std::vector<uint8_t>(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize());
}

FailureOr<std::string> planToJson(std::span<const uint8_t> plan, std::string &error) {
  flatbuffers::IDLOptions options;
  options.strict_json = true;
  options.output_default_scalars_in_json = true;
  flatbuffers::Parser parser(options);
  if (!parser.Parse(kPlanSchemaText)) {
    error = "the built-in plan schema does not parse: " + parser.error_;
    return failure();
  }
  flatbuffers::Verifier verifier(plan.data(), plan.size());
  if (!fb::VerifyPlanBuffer(verifier)) {
    error = "the plan is not a valid FlatBuffer";
    return failure();
  }
  std::string json;
  if (!flatbuffers::GenerateText(parser, plan.data(), &json)) {
    error = "cannot render the plan as JSON";
    return failure();
  }
  return json;
}

} // namespace hybrid::target
