// --hybrid-verify-plan-contract: the checks the plan writer and the runtime rely on (see Passes.td).
#include "compiler/Transforms/Passes.h"

#include "compiler/Transforms/StepOrder.h"
#include "runtime/schema/kernel_signatures.h"

#include "llvm/ADT/DenseSet.h"

namespace hybrid {
#define GEN_PASS_DEF_VERIFYPLANCONTRACT
#include "compiler/Transforms/Passes.h.inc"
} // namespace hybrid

using namespace mlir;

namespace hybrid {
namespace {

constexpr int64_t kWeightPageSize = 4096;

int64_t elementBytes(Type type) { return std::max<int64_t>(1, type.getIntOrFloatBitWidth() / 8); }

// The params each kernel's table needs (plan.fbs field names).
ArrayRef<StringRef> requiredParams(plan::KernelId kernel) {
  static const StringRef kda[] = {"num_heads", "head_dim", "conv_kernel", "gate",
                                  "gate_lower_bound", "norm_epsilon", "state_layout", "state_slot"};
  static const StringRef mla[] = {"num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                  "qk_rope_head_dim", "v_head_dim", "rope", "softmax_scale",
                                  "latent_norm_epsilon", "kv_slot"};
  static const StringRef indexer[] = {"index_heads", "index_head_dim", "top_k", "rope_head_dim",
                                      "rope", "norm_epsilon", "kv_slot"};
  static const StringRef moe[] = {"num_experts", "top_k", "num_groups", "topk_groups",
                                  "score_function", "renormalize", "routed_scaling_factor",
                                  "intermediate_size", "num_shared_experts"};
  static const StringRef norm[] = {"epsilon"};
  static const StringRef mix[] = {"block_size", "epsilon"};
  static const StringRef mixNorm[] = {"block_size", "epsilon", "output_norm_epsilon"};
  static const StringRef mlp[] = {"activation"};
  static const StringRef collective[] = {"group"};
  switch (kernel) {
  case plan::KernelId::all_reduce_sum:
  case plan::KernelId::all_gather_rows:
    return collective;
  case plan::KernelId::rms_norm:
  case plan::KernelId::add_rms_norm:
    return norm;
  case plan::KernelId::attn_res_rms_norm:
    return mixNorm;
  case plan::KernelId::kda_chunk_prefill:
  case plan::KernelId::kda_recurrent_decode:
  case plan::KernelId::kda_context_summary:
    return kda;
  case plan::KernelId::mla_prefill:
  case plan::KernelId::mla_decode:
  case plan::KernelId::sparse_mla_prefill:
  case plan::KernelId::sparse_mla_decode:
  case plan::KernelId::mla_cache_rows:
    return mla;
  case plan::KernelId::dsa_indexer:
  case plan::KernelId::indexer_query:
  case plan::KernelId::indexer_key:
    return indexer;
  case plan::KernelId::attn_res:
    return mix;
  case plan::KernelId::mlp:
    return mlp;
  case plan::KernelId::moe_experts:
  case plan::KernelId::router_topk:
    return moe;
  default:
    return {};
  }
}

LogicalResult verifyWeights(plan::PlanOp planOp, SmallVectorImpl<plan::WeightOp> &weights) {
  int64_t previousEnd = 0;
  for (plan::WeightOp weight : planOp.getBodyBlock().getOps<plan::WeightOp>())
    weights.push_back(weight);
  for (auto [index, weight] : llvm::enumerate(weights)) {
    auto type = cast<RankedTensorType>(weight.getType());
    int64_t expectedSize = type.getNumElements() * elementBytes(type.getElementType());
    if (weight.getNzTiled()) { // stored padded to whole tiles
      auto tile = weight.getTile();
      if (type.getRank() != 2 || !tile || tile->size() != 2 || (*tile)[0] <= 0 || (*tile)[1] <= 0)
        return weight.emitOpError() << "is nz_tiled without a 2-D shape and a positive 2-D tile";
      auto padded = [](int64_t dim, int64_t t) { return (dim + t - 1) / t * t; };
      expectedSize = padded(type.getDimSize(0), (*tile)[0]) *
                     padded(type.getDimSize(1), (*tile)[1]) * elementBytes(type.getElementType());
    }
    if (static_cast<int64_t>(weight.getSize()) != expectedSize)
      return weight.emitOpError() << "size " << weight.getSize() << " does not match "
                                  << type << " (" << expectedSize << " bytes)";
    const int64_t offset = static_cast<int64_t>(weight.getOffset());
    if (offset % kWeightPageSize != 0 || offset < previousEnd || offset < kWeightPageSize)
      return weight.emitOpError() << "offset " << weight.getOffset()
                                  << " is not page aligned after the previous weight (ends at "
                                  << previousEnd << ")";
    previousEnd = offset + static_cast<int64_t>(weight.getSize());
    int32_t scale = weight.getScale();
    if (scale < 0)
      continue;
    if (scale >= static_cast<int32_t>(weights.size()) || !weight.getBlock())
      return weight.emitOpError() << "scale index " << scale << " out of range or no block";
    auto scaleType = cast<RankedTensorType>(weights[scale].getType());
    ArrayRef<int32_t> block = *weight.getBlock();
    if (!scaleType.getElementType().isF32() || scaleType.getRank() != type.getRank() ||
        static_cast<int64_t>(block.size()) != type.getRank())
      return weight.emitOpError() << "scale weight " << scale << " is not an f32 block grid";
    for (int64_t d = 0; d < type.getRank(); ++d)
      if (block[d] <= 0 || (type.getDimSize(d) + block[d] - 1) / block[d] != scaleType.getDimSize(d))
        return weight.emitOpError() << "scale grid " << scaleType << " does not cover " << type
                                    << " in blocks of " << block[d] << " along dim " << d;
  }
  if (previousEnd > static_cast<int64_t>(planOp.getWeightArchiveBytes()))
    return planOp.emitOpError() << "weights end at " << previousEnd
                                << " past weight_archive_bytes = " << planOp.getWeightArchiveBytes();
  return success();
}

LogicalResult verifyProgram(plan::PlanOp planOp, plan::ProgramOp program, int64_t numWeights,
                            int64_t numKvLayers, int64_t numStateLayers) {
  SmallVector<plan::ValueOp> values(program.getBodyBlock().getOps<plan::ValueOp>());
  const int64_t numValues = values.size();
  auto inRange = [&](int64_t v) { return v >= 0 && v < numValues; };
  if (!inRange(program.getTokenIds()) || !inRange(program.getLogits()))
    return program.emitOpError() << "token_ids or logits is not a value index";
  if (static_cast<int32_t>(program.getHiddenInput()) != -1 && !inRange(program.getHiddenInput()))
    return program.emitOpError() << "hidden_input " << program.getHiddenInput()
                                 << " is not a value index";
  for (int32_t v : program.getLayerOutputs())
    if (!inRange(v))
      return program.emitOpError() << "layer output " << v << " is not a value index";

  // Rows other than the step's only in a context-parallel plan (plan.fbs ValueRows).
  const bool contextParallel = planOp.getContextParallel().value_or(1) > 1;
  for (plan::ValueOp value : values) {
    const StringRef rows = value.getRows();
    if (rows != "step" && rows != "context_shard" && rows != "context_chunks" &&
        rows != "all_context_chunks")
      return value.emitOpError() << "rows \"" << rows << "\" is not step, context_shard, "
                                 << "context_chunks or all_context_chunks";
    if (rows != "step" && !contextParallel)
      return value.emitOpError() << "rows \"" << rows << "\" in a plan without context "
                                 << "parallelism";
  }

  // Definitions before uses in program order.
  SmallVector<int64_t> definedAt(numValues, -1);
  definedAt[program.getTokenIds()] = 0;
  if (static_cast<int32_t>(program.getHiddenInput()) != -1)
    definedAt[program.getHiddenInput()] = 0;
  int64_t step = 0;
  for (Operation &op : program.getBodyBlock()) {
    auto dispatch = dyn_cast<plan::DispatchOp>(op);
    if (!dispatch) {
      if (auto copy = dyn_cast<plan::CopyOp>(op)) {
        if (!inRange(copy.getSource()) || !inRange(copy.getDestination()))
          return copy.emitOpError() << "copies a value index out of range";
        definedAt[copy.getDestination()] = ++step;
      }
      continue;
    }
    ++step;
    const plan::KernelSignature *signature =
        plan::kernelSignature(static_cast<plan::fb::KernelId>(dispatch.getKernel()));
    if (!signature)
      return dispatch.emitOpError() << "unknown kernel";
    int64_t inputs = dispatch.getInputs().size();
    if (inputs < signature->minInputs ||
        (signature->maxInputs >= 0 && inputs > signature->maxInputs) ||
        static_cast<int>(dispatch.getOutputs().size()) != signature->numOutputs)
      return dispatch.emitOpError() << signature->name << " takes " << signature->minInputs
                                    << ".." << signature->maxInputs << " inputs and "
                                    << signature->numOutputs << " outputs, got " << inputs
                                    << " and " << dispatch.getOutputs().size();
    for (int32_t v : dispatch.getInputs()) {
      if (!inRange(v) || definedAt[v] < 0)
        return dispatch.emitOpError() << "reads value " << v << " before it is written";
    }
    for (int32_t v : dispatch.getOutputs()) {
      if (!inRange(v) || definedAt[v] >= 0)
        return dispatch.emitOpError() << "writes value " << v << " that is out of range or "
                                      << "already written";
      definedAt[v] = step;
    }

    // Weights in role order.
    ArrayRef<int32_t> weights = dispatch.getWeights();
    int64_t expected = signature->fixedWeights;
    if (signature->perExpertWeights) {
      auto experts = dispatch.getParams().getAs<IntegerAttr>("num_experts");
      if (!experts)
        return dispatch.emitOpError() << "moe params need num_experts";
      expected += 3 * experts.getInt();
    }
    if (static_cast<int64_t>(weights.size()) != expected)
      return dispatch.emitOpError() << signature->name << " needs " << expected
                                    << " weights, got " << weights.size();
    // Expert parallelism: the routed experts other ranks hold are absent from this rank's plan.
    const bool expertsElsewhere = signature->perExpertWeights &&
                                  planOp.getExpertParallel().value_or(1) > 1;
    for (auto [role, w] : llvm::enumerate(weights)) {
      bool optional = role < 32 && (signature->optionalWeights >> role) & 1;
      if (w == -1 && expertsElsewhere && static_cast<int64_t>(role) >= signature->fixedWeights)
        continue;
      if (w == -1 && optional)
        continue;
      if (w < 0 || w >= numWeights)
        return dispatch.emitOpError() << signature->name << " weight role "
                                      << (role < signature->weightRoles.size() &&
                                                  !signature->weightRoles[role].empty()
                                              ? signature->weightRoles[role]
                                              : std::string_view("expert"))
                                      << " has index " << w << " (of " << numWeights << ")";
    }
    // A gather turns this rank's rows into everyone's: shard -> step, chunks -> all chunks.
    if (dispatch.getKernel() == plan::KernelId::all_gather_rows) {
      const StringRef from = values[dispatch.getInputs()[0]].getRows();
      const StringRef to = values[dispatch.getOutputs()[0]].getRows();
      if (!((from == "context_shard" && to == "step") ||
            (from == "context_chunks" && to == "all_context_chunks")))
        return dispatch.emitOpError() << "all_gather_rows gathers " << from << " rows into "
                                      << to << " rows (context_shard -> step or "
                                      << "context_chunks -> all_context_chunks)";
      auto group = dispatch.getParams().getAs<StringAttr>("group");
      if (!group || group.getValue() != "context_parallel")
        return dispatch.emitOpError() << "all_gather_rows runs over the context_parallel group";
    }
    // Experts spread over the context ranks (ep = cp, tp = 1): the prefill exchanges its rows
    // inside moe_experts (all_to_all), the decode sums the experts' parts over the context group.
    const int64_t tp = planOp.getTensorParallel().value_or(1),
                  ep = planOp.getExpertParallel().value_or(1),
                  cp = planOp.getContextParallel().value_or(1);
    const bool expertsOverContext = tp == 1 && cp > 1 && ep == cp;
    if (auto allToAll = dispatch.getParams().getAs<BoolAttr>("all_to_all");
        allToAll && allToAll.getValue()) {
      if (dispatch.getKernel() != plan::KernelId::moe_experts || !expertsOverContext ||
          values[dispatch.getInputs()[0]].getRows() != "context_shard")
        return dispatch.emitOpError()
               << "all_to_all: only moe_experts on a context-parallel prefill's rows, in a plan "
               << "whose experts are spread over the context ranks (expert_parallel = "
               << "context_parallel, tensor_parallel 1; this plan has tensor_parallel " << tp
               << ", expert_parallel " << ep << ", context_parallel " << cp << ")";
    }
    if (dispatch.getKernel() == plan::KernelId::all_reduce_sum) {
      auto group = dispatch.getParams().getAs<StringAttr>("group");
      if (group && group.getValue() == "context_parallel" &&
          (!expertsOverContext || values[dispatch.getOutputs()[0]].getRows() != "step"))
        return dispatch.emitOpError()
               << "all_reduce_sum over the context_parallel group: only the decode's routed "
               << "experts in a plan whose experts are spread over the context ranks "
               << "(expert_parallel = context_parallel, tensor_parallel 1)";
    }
    for (StringRef param : requiredParams(dispatch.getKernel()))
      if (!dispatch.getParams().get(param))
        return dispatch.emitOpError() << signature->name << " needs param '" << param << "'";
    if (auto slot = dispatch.getParams().getAs<IntegerAttr>("kv_slot"))
      if (slot.getInt() < 0 || slot.getInt() >= numKvLayers)
        return dispatch.emitOpError() << "kv_slot " << slot.getInt() << " out of range";
    if (auto slot = dispatch.getParams().getAs<IntegerAttr>("state_slot"))
      if (slot.getInt() < 0 || slot.getInt() >= numStateLayers)
        return dispatch.emitOpError() << "state_slot " << slot.getInt() << " out of range";
  }
  if (definedAt[program.getLogits()] < 0)
    return program.emitOpError() << "never writes the logits";

  // Every read happens after its write in every execution, not just in program order.
  StepOrder order(program);
  for (size_t s = 0; s < order.numSteps(); ++s)
    for (int32_t v : order.reads(s)) {
      const int64_t writer = order.writer(v);
      if (writer >= 0 && !order.happensBefore(writer, s))
        return order.step(s)->emitOpError()
               << "reads value " << v << " which another stream may not have written yet "
               << "(no event orders it after step " << writer << ")";
    }

  // Arena: inside arena_bytes, and no two values share bytes unless one is dead (under the
  // stream and event order) before the other is written. The logits live to the end.
  SmallVector<std::pair<int64_t, int64_t>> ranges(numValues);
  for (auto [v, value] : llvm::enumerate(values)) {
    const int64_t offset = static_cast<int64_t>(value.getOffset());
    const int64_t rows =
        value.plannedRows(program.getMaxTokens(), planOp.getContextParallel().value_or(1));
    const int64_t bytes = static_cast<int64_t>(rows * value.getRowElements()) *
                          elementBytes(value.getDtype());
    ranges[v] = {offset, offset + bytes};
    if (offset < 0 || ranges[v].second > static_cast<int64_t>(program.getArenaBytes()))
      return value.emitOpError() << "slot [" << ranges[v].first << ", " << ranges[v].second
                                 << ") exceeds arena_bytes = " << program.getArenaBytes();
  }
  const int32_t logits = static_cast<int32_t>(program.getLogits());
  auto used = [&](int64_t v) { return order.writer(v) >= 0 || !order.readers(v).empty(); };
  // True when `first`'s bytes may be reused by `second`'s writer.
  auto retiredBefore = [&](int32_t first, int32_t second) {
    const int64_t writer = order.writer(second);
    return first != logits && writer >= 0 && order.deadBefore(first, writer);
  };
  for (int32_t a = 0; a < numValues; ++a)
    for (int32_t b = a + 1; b < numValues; ++b) {
      if (!used(a) || !used(b))
        continue;
      bool overlap = ranges[a].first < ranges[b].second && ranges[b].first < ranges[a].second;
      if (overlap && !retiredBefore(a, b) && !retiredBefore(b, a))
        return values[b].emitOpError() << "shares arena bytes with value " << a
                                       << " while both are live";
    }
  return success();
}

struct VerifyPlanContractPass : impl::VerifyPlanContractBase<VerifyPlanContractPass> {
  void runOnOperation() override {
    for (plan::PlanOp planOp : getOperation().getOps<plan::PlanOp>()) {
      SmallVector<plan::WeightOp> weights;
      if (failed(verifyWeights(planOp, weights)))
        return signalPassFailure();
      Block &body = planOp.getBodyBlock();
      int64_t kv = llvm::range_size(body.getOps<plan::KvCacheLayerOp>());
      int64_t states = llvm::range_size(body.getOps<plan::RecurrentStateLayerOp>());
      int64_t programs = 0;
      for (plan::ProgramOp program : body.getOps<plan::ProgramOp>()) {
        ++programs;
        if (failed(verifyProgram(planOp, program, weights.size(), kv, states)))
          return signalPassFailure();
      }
      if (programs == 0) {
        planOp.emitOpError() << "has no program";
        return signalPassFailure();
      }
    }
  }
};

} // namespace
} // namespace hybrid
