// --hybrid-shard: one plan per rank for tensor, expert and context parallelism (see Passes.td
// and docs/parallelism.md).
#include "compiler/Transforms/Passes.h"

#include "hybrid/runtime/WeightArchive.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/SetVector.h"

#include <map>
#include <optional>
#include <string>

namespace hybrid {
#define GEN_PASS_DEF_SHARD
#include "compiler/Transforms/Passes.h.inc"
} // namespace hybrid

using namespace mlir;

namespace hybrid {
namespace {

int64_t elementBytes(Type type) { return std::max<int64_t>(1, type.getIntOrFloatBitWidth() / 8); }
// The unsigned accessors of I32 attributes, as the signed values they hold (-1: none).
int32_t scaleOf(plan::WeightOp weight) { return static_cast<int32_t>(weight.getScale()); }
int32_t layerOf(plan::DispatchOp dispatch) { return static_cast<int32_t>(dispatch.getLayer()); }

// A rank's part of a weight: `size` entries from `begin` along `axis` of the checkpoint tensor.
struct Slice {
  int64_t axis = 0, begin = 0, size = 0;
  bool operator==(const Slice &other) const {
    return axis == other.axis && begin == other.begin && size == other.size;
  }
};

// How a layer divides an axis among the tensor ranks: `units` groups (heads, or an MLP's
// intermediate rows) of `unitSize` entries, split by the head rule (a tp dividing the heads, or
// a multiple of them: one head per rank) or, for an MLP, by any tp dividing the rows. Kept for
// every slice so that a refused split can name the tp values that would work.
struct SplitRule {
  int64_t units = 0, unitSize = 1;
  bool headCopies = false;
};

// A slice of a weight along one axis under a rule, with the block its scales cover along that
// axis (1 for a weight without block scales).
struct RecordedSplit {
  SplitRule rule;
  int64_t block = 1, full = 0;
};

// The entries a rank holds along the axis at tensor-parallel size `tp`, or none when the rule
// cannot split over tp ranks.
std::optional<int64_t> partEntries(const SplitRule &rule, int64_t tp) {
  if (rule.units % tp == 0)
    return rule.units / tp * rule.unitSize;
  if (rule.headCopies && tp % rule.units == 0)
    return rule.unitSize;
  return std::nullopt;
}

// A block-quantized weight's slice whose boundary falls inside one of its scale blocks.
struct MisalignedSlice {
  plan::DispatchOp dispatch;
  int32_t weight = -1;
  Slice slice;
  int64_t block = 0;
};

// The heads a rank runs, [first, first + count), and whether its partial output joins the sum.
// With more ranks than heads each head runs on tp / heads ranks and only the first one adds its
// part (the others' copies are dropped), so the sum still counts every head once.
struct HeadShare {
  int64_t first = 0, count = 0;
  bool contributes = true;
};

// A dispatch whose output is this rank's part of a sum over the group: an all-reduce follows it.
struct PartialOutput {
  plan::DispatchOp dispatch;
  bool contributes;
  StringRef group;
};

// Whether the routed experts are spread over the context ranks (ep = cp, tp = 1): those hold
// different tokens in the prefill, which exchanges them by an all-to-all (docs/parallelism.md).
bool expertsOverContext(int64_t tp, int64_t ep, int64_t cp) {
  return tp == 1 && cp > 1 && ep == cp;
}

// Ranks are numbered tensor-parallel first (plan.fbs CollectiveGroup): world rank r is tensor
// rank r % tp of context rank r / tp.
class RankSharder {
public:
  RankSharder(plan::PlanOp planOp, int64_t tp, int64_t ep, int64_t cp, int64_t rank)
      : plan_(planOp), tp_(tp), ep_(ep), cp_(cp), rank_(rank % tp), contextRank_(rank / tp),
        builder_(planOp.getContext()) {}

  LogicalResult run() {
    Block &body = plan_.getBodyBlock();
    weights_.assign(body.getOps<plan::WeightOp>().begin(), body.getOps<plan::WeightOp>().end());
    for (plan::ProgramOp program : body.getOps<plan::ProgramOp>()) {
      if (failed(shardProgram(program)))
        return failure();
      // Context parallelism splits the prompt: only the prefill's tokens are cut among ranks.
      if (cp_ > 1 && program.getName() == "prefill")
        shardContext(program);
    }
    if (misaligned_)
      return refuseMisaligned();
    if (failed(resizeStateLayers()))
      return failure();
    return rewriteWeights();
  }

private:
  FailureOr<HeadShare> shareHeads(plan::DispatchOp dispatch, StringRef kind, int64_t heads) {
    if (heads > 0 && heads % tp_ == 0)
      return HeadShare{rank_ * (heads / tp_), heads / tp_, true};
    if (heads > 0 && tp_ % heads == 0) {
      const int64_t copies = tp_ / heads;
      return HeadShare{rank_ / copies, 1, rank_ % copies == 0};
    }
    return dispatch.emitOpError() << "layer " << layerOf(dispatch) << ": " << heads << " "
                                  << kind << " heads cannot be split over tp=" << tp_
                                  << " ranks (one must divide the other)";
  }

  // Records that weight `index` is read as `slice` (the same weight read by the prefill and the
  // decode program must be cut the same way).
  // A block-quantized weight (FP8 with `weight_scale_inv`) is cut at whole blocks and its scale
  // grid by the same blocks; a cut inside a block is recorded and refused once the whole plan is
  // seen (the refusal names the tp values that would keep every block whole).
  LogicalResult addSlice(plan::DispatchOp dispatch, int32_t index, Slice slice, SplitRule rule) {
    if (index < 0)
      return success();
    if (index >= static_cast<int32_t>(weights_.size()))
      return dispatch.emitOpError() << "reads weight " << index << " of " << weights_.size();
    plan::WeightOp weight = weights_[index];
    auto type = cast<RankedTensorType>(weight.getType());
    if (slice.axis >= type.getRank() || slice.begin + slice.size > type.getDimSize(slice.axis))
      return dispatch.emitOpError()
             << "layer " << layerOf(dispatch) << ": weight '" << weight.getName()
             << "' " << type << " has no entries [" << slice.begin << ", "
             << slice.begin + slice.size << ") along axis " << slice.axis;
    const int64_t full = type.getDimSize(slice.axis);
    int64_t block = 1;
    if (scaleOf(weight) >= 0) {
      std::optional<ArrayRef<int32_t>> blocks = weight.getBlock();
      if (!blocks || static_cast<int64_t>(blocks->size()) != type.getRank() ||
          (*blocks)[slice.axis] <= 0)
        return dispatch.emitOpError() << "layer " << layerOf(dispatch) << ": weight '"
                                      << weight.getName() << "' " << type
                                      << " has block scales but no block along axis "
                                      << slice.axis;
      block = (*blocks)[slice.axis];
    }
    splits_.push_back({rule, block, full});
    if (slice.size == full)
      return success(); // the whole axis: nothing to cut
    sliceReaders_.insert({dispatch.getOperation(), index});
    auto [it, inserted] = slices_.insert({index, slice});
    if (!inserted && !(it->second == slice))
      return dispatch.emitOpError() << "weight '" << weight.getName()
                                    << "' is read as two different slices";
    if (block == 1)
      return success();
    const int64_t end = slice.begin + slice.size;
    if (slice.begin % block != 0 || (end % block != 0 && end != full)) {
      if (!misaligned_)
        misaligned_ = MisalignedSlice{dispatch, index, slice, block};
      return success();
    }
    // The scales of the blocks the slice holds: the same axis, in blocks (the last one may be
    // a partial block of the tensor, as in the checkpoint).
    const int32_t scale = scaleOf(weight);
    if (scale >= static_cast<int32_t>(weights_.size()))
      return dispatch.emitOpError() << "weight '" << weight.getName() << "' has scale weight "
                                    << scale << " of " << weights_.size();
    const Slice scaleSlice{slice.axis, slice.begin / block,
                           (end + block - 1) / block - slice.begin / block};
    auto [scaleIt, scaleInserted] = slices_.insert({scale, scaleSlice});
    if (!scaleInserted && !(scaleIt->second == scaleSlice))
      return dispatch.emitOpError() << "scale weight '" << weights_[scale].getName()
                                    << "' is read as two different slices";
    return success();
  }

  // The refusal of a cut inside a scale block, with the tensor-parallel sizes that would split
  // every layer and cut every block-quantized weight at whole blocks.
  LogicalResult refuseMisaligned() {
    MisalignedSlice bad = *misaligned_;
    plan::WeightOp weight = weights_[bad.weight];
    int64_t largest = 1;
    for (const RecordedSplit &split : splits_)
      largest = std::max(largest, split.rule.units);
    std::string working;
    for (int64_t tp = 1; tp <= std::min<int64_t>(largest, 1 << 16); ++tp) {
      const bool splitsWhole = llvm::all_of(splits_, [&](const RecordedSplit &split) {
        std::optional<int64_t> part = partEntries(split.rule, tp);
        return part && (*part % split.block == 0 || *part == split.full);
      });
      if (splitsWhole)
        working += (working.empty() ? "" : ", ") + std::to_string(tp);
    }
    const char *what = bad.slice.axis == 0 ? "rows" : bad.slice.axis == 1 ? "columns" : "entries";
    InFlightDiagnostic error = bad.dispatch.emitOpError();
    error << "layer " << layerOf(bad.dispatch) << ": block-quantized weight '" << weight.getName()
          << "' " << weight.getType() << " cannot be sliced for tp=" << tp_ << ": this rank's "
          << what << " [" << bad.slice.begin << ", " << bad.slice.begin + bad.slice.size
          << ") cut through its " << bad.block << "-entry scale blocks along axis "
          << bad.slice.axis;
    const int32_t scale = scaleOf(weight);
    if (scale >= 0 && scale < static_cast<int32_t>(weights_.size()))
      error << " ('" << weights_[scale].getName() << "')";
    error << "; tp=" << working << " keep every block whole";
    return error;
  }

  // The one axis of `index` whose size is `heads` x `unit` (per-head vectors such as A_log
  // [1, 1, H, 1] or dt_bias [H K]).
  FailureOr<int64_t> headAxis(plan::DispatchOp dispatch, int32_t index, int64_t extent) {
    auto type = cast<RankedTensorType>(weights_[index].getType());
    for (int64_t axis = 0; axis < type.getRank(); ++axis)
      if (type.getDimSize(axis) == extent)
        return axis;
    return dispatch.emitOpError() << "layer " << layerOf(dispatch) << ": weight '"
                                  << weights_[index].getName() << "' " << type
                                  << " has no axis of " << extent << " (one entry per head)";
  }

  LogicalResult setHeads(plan::DispatchOp dispatch, int64_t count) {
    NamedAttrList params(dispatch.getParams());
    params.set("num_heads", builder_.getI32IntegerAttr(static_cast<int32_t>(count)));
    dispatch.setParamsAttr(params.getDictionary(dispatch.getContext()));
    return success();
  }

  int64_t intParam(plan::DispatchOp dispatch, StringRef name) {
    auto attr = dispatch.getParams().getAs<IntegerAttr>(name);
    return attr ? attr.getInt() : 0;
  }

  // MLA: queries, kv_b_proj and the output gate by heads (rows), o_proj by the same columns.
  // The latent projection and its norm stay whole: the latent cache is shared by all heads.
  LogicalResult shardMla(plan::DispatchOp dispatch) {
    const int64_t heads = intParam(dispatch, "num_heads");
    FailureOr<HeadShare> share = shareHeads(dispatch, "MLA", heads);
    if (failed(share))
      return failure();
    partials_.push_back({dispatch, share->contributes, "tensor_parallel"});
    if (!share->contributes)
      return success();
    const int64_t qk = intParam(dispatch, "qk_nope_head_dim") + intParam(dispatch, "qk_rope_head_dim");
    const int64_t kvb = intParam(dispatch, "qk_nope_head_dim") + intParam(dispatch, "v_head_dim");
    const int64_t dv = intParam(dispatch, "v_head_dim");
    ArrayRef<int32_t> w = dispatch.getWeights();
    auto rows = [&](int64_t perHead) { return Slice{0, share->first * perHead, share->count * perHead}; };
    auto byHead = [&](int64_t perHead) { return SplitRule{heads, perHead, true}; };
    if (failed(addSlice(dispatch, w[0], rows(qk), byHead(qk))) ||
        failed(addSlice(dispatch, w[1], rows(qk), byHead(qk))) ||
        failed(addSlice(dispatch, w[4], rows(kvb), byHead(kvb))) ||
        failed(addSlice(dispatch, w[5], rows(dv), byHead(dv))) ||
        failed(addSlice(dispatch, w[6], Slice{1, share->first * dv, share->count * dv}, byHead(dv))))
      return failure();
    return setHeads(dispatch, share->count);
  }

  // KDA: every per-head projection, conv channel, gate and beta by heads; o_proj by the same
  // columns. The low-rank gate inputs (f_a_proj, g_a_proj) and the per-dim o_norm stay whole.
  LogicalResult shardKda(plan::DispatchOp dispatch) {
    const int64_t heads = intParam(dispatch, "num_heads"), dim = intParam(dispatch, "head_dim");
    FailureOr<HeadShare> share = shareHeads(dispatch, "KDA", heads);
    if (failed(share))
      return failure();
    // A dropped copy's state stays allocated (the slot numbering is shared), at its share's size.
    const int64_t slot = intParam(dispatch, "state_slot");
    auto [it, inserted] = stateHeads_.insert({slot, share->count});
    if (!inserted && it->second != share->count)
      return dispatch.emitOpError() << "state slot " << slot << " is split two ways";
    partials_.push_back({dispatch, share->contributes, "tensor_parallel"});
    if (!share->contributes)
      return success();
    ArrayRef<int32_t> w = dispatch.getWeights();
    auto rows = [&](int64_t perHead) { return Slice{0, share->first * perHead, share->count * perHead}; };
    auto byHead = [&](int64_t perHead) { return SplitRule{heads, perHead, true}; };
    for (int role : {0, 1, 2, 3, 4, 5, 7, 12, 13})
      if (failed(addSlice(dispatch, w[role], rows(dim), byHead(dim))))
        return failure();
    if (failed(addSlice(dispatch, w[10], rows(1), byHead(1))) ||
        failed(addSlice(dispatch, w[15], Slice{1, share->first * dim, share->count * dim},
                        byHead(dim))))
      return failure();
    for (auto [role, unit] : {std::pair{8, int64_t{1}}, {9, dim}}) { // A_log, dt_bias
      FailureOr<int64_t> axis = headAxis(dispatch, w[role], heads * unit);
      if (failed(axis) ||
          failed(addSlice(dispatch, w[role], Slice{*axis, share->first * unit, share->count * unit},
                          byHead(unit))))
        return failure();
    }
    return setHeads(dispatch, share->count);
  }

  // SwiGLU (dense MLP, shared expert): gate and up by intermediate rows, down by the same columns.
  LogicalResult shardMlp(plan::DispatchOp dispatch) {
    ArrayRef<int32_t> w = dispatch.getWeights();
    auto gate = cast<RankedTensorType>(weights_[w[0]].getType());
    const int64_t width = gate.getDimSize(0);
    if (width % tp_ != 0)
      return dispatch.emitOpError() << "layer " << layerOf(dispatch) << ": the MLP's "
                                    << width << " intermediate rows cannot be split over tp="
                                    << tp_ << " ranks";
    const int64_t part = width / tp_, begin = rank_ * part;
    const SplitRule byRow{width, 1, false};
    if (failed(addSlice(dispatch, w[0], Slice{0, begin, part}, byRow)) ||
        failed(addSlice(dispatch, w[1], Slice{0, begin, part}, byRow)) ||
        failed(addSlice(dispatch, w[2], Slice{1, begin, part}, byRow)))
      return failure();
    partials_.push_back({dispatch, true, "tensor_parallel"});
    return success();
  }

  // Routed experts: rank r of the expert group holds experts [r E / ep, (r + 1) E / ep); the
  // others' weights are absent (-1) and the kernel skips their choices, so its output is this
  // rank's part of the sum. The group is the tensor-parallel ranks, or with ep = cp (tp = 1) the
  // context ranks: their prefill holds different rows, so there the dispatch exchanges them
  // (`all_to_all`: its output is already the whole sum of this rank's rows), while their decode
  // runs the same rows everywhere and sums the parts over the context group.
  LogicalResult shardExperts(plan::DispatchOp dispatch, bool contextPrefill) {
    const int64_t experts = intParam(dispatch, "num_experts");
    if (experts % ep_ != 0)
      return dispatch.emitOpError() << "layer " << layerOf(dispatch) << ": " << experts
                                    << " experts cannot be split over ep=" << ep_ << " ranks";
    const bool overContext = expertsOverContext(tp_, ep_, cp_);
    const int64_t part = experts / ep_, group = (overContext ? contextRank_ : rank_) % ep_;
    SmallVector<int32_t> w(dispatch.getWeights());
    for (int64_t e = 0; e < experts; ++e)
      if (e / part != group)
        for (int role = 0; role < 3; ++role)
          w[3 * e + role] = -1;
    dispatch.setWeightsAttr(builder_.getDenseI32ArrayAttr(w));
    if (overContext && contextPrefill) {
      NamedAttrList params(dispatch.getParams());
      params.set("all_to_all", builder_.getBoolAttr(true));
      dispatch.setParamsAttr(params.getDictionary(dispatch.getContext()));
      return success();
    }
    partials_.push_back({dispatch, true, overContext ? "context_parallel" : "expert_parallel"});
    return success();
  }

  LogicalResult shardProgram(plan::ProgramOp program) {
    partials_.clear();
    // The program whose rows shardContext cuts among the context ranks.
    const bool contextPrefill = cp_ > 1 && program.getName() == "prefill";
    SmallVector<plan::DispatchOp> dispatches(program.getBodyBlock().getOps<plan::DispatchOp>());
    for (plan::DispatchOp dispatch : dispatches) {
      LogicalResult result = success();
      if (dispatch.getKernel() == plan::KernelId::all_reduce_sum ||
          dispatch.getKernel() == plan::KernelId::all_gather_rows)
        return dispatch.emitOpError() << "is already a sharded plan's step";
      if (tp_ == 1 && dispatch.getKernel() != plan::KernelId::moe_experts)
        continue; // context parallelism alone: every rank keeps every head
      switch (dispatch.getKernel()) {
      case plan::KernelId::mla_prefill:
      case plan::KernelId::mla_decode:
      case plan::KernelId::sparse_mla_prefill:
      case plan::KernelId::sparse_mla_decode:
        result = shardMla(dispatch);
        break;
      case plan::KernelId::kda_chunk_prefill:
      case plan::KernelId::kda_recurrent_decode:
        result = shardKda(dispatch);
        break;
      case plan::KernelId::mlp:
        result = shardMlp(dispatch);
        break;
      case plan::KernelId::moe_experts:
        if (ep_ > 1)
          result = shardExperts(dispatch, contextPrefill);
        break;
      default:
        break;
      }
      if (failed(result))
        return failure();
    }
    insertAllReduces(program);
    return success();
  }

  // After each partial output: a new value holding the sum over the group, read by everything
  // that read the partial one. A rank that holds no part (a dropped head copy) adds zeros.
  void insertAllReduces(plan::ProgramOp program) {
    Block &block = program.getBodyBlock();
    SmallVector<plan::DispatchOp> dropped;
    for (const PartialOutput &partial : partials_) {
      plan::DispatchOp dispatch = partial.dispatch;
      const int32_t output = dispatch.getOutputs().front();
      SmallVector<plan::ValueOp> values(block.getOps<plan::ValueOp>());
      plan::ValueOp source = values[output];
      builder_.setInsertionPointAfter(values.back());
      builder_.create<plan::ValueOp>(source.getLoc(), source.getDtypeAttr(),
                                     source.getRowElementsAttr(), builder_.getI64IntegerAttr(-1),
                                     builder_.getStringAttr(source.getName() + ".sum"),
                                     source.getRowsAttr());
      const int32_t sum = static_cast<int32_t>(values.size());

      builder_.setInsertionPointAfter(dispatch);
      SmallVector<int32_t> inputs;
      if (partial.contributes)
        inputs.push_back(output);
      NamedAttribute group = builder_.getNamedAttr("group", builder_.getStringAttr(partial.group));
      auto reduce = builder_.create<plan::DispatchOp>(
          dispatch.getLoc(),
          plan::KernelIdAttr::get(builder_.getContext(), plan::KernelId::all_reduce_sum),
          builder_.getDenseI32ArrayAttr(inputs), builder_.getDenseI32ArrayAttr({sum}),
          builder_.getDenseI32ArrayAttr({}), builder_.getDictionaryAttr({group}),
          builder_.getI32IntegerAttr(0), builder_.getDenseI32ArrayAttr({}),
          builder_.getI32IntegerAttr(-1), dispatch.getLayerAttr());
      replaceReads(program, output, sum, reduce);
      if (!partial.contributes)
        dropped.push_back(dispatch);
    }
    eraseDropped(program, dropped);
  }

  static SmallVector<int32_t> replaced(ArrayRef<int32_t> list, int32_t from, int32_t to) {
    SmallVector<int32_t> out(list);
    std::replace(out.begin(), out.end(), from, to);
    return out;
  }

  void replaceReads(plan::ProgramOp program, int32_t from, int32_t to, Operation *except) {
    for (Operation &op : program.getBodyBlock()) {
      if (&op == except)
        continue;
      if (auto dispatch = dyn_cast<plan::DispatchOp>(op)) {
        if (llvm::is_contained(dispatch.getInputs(), from))
          dispatch.setInputsAttr(
              builder_.getDenseI32ArrayAttr(replaced(dispatch.getInputs(), from, to)));
      } else if (auto copy = dyn_cast<plan::CopyOp>(op)) {
        if (static_cast<int32_t>(copy.getSource()) == from)
          copy.setSourceAttr(builder_.getI32IntegerAttr(to));
      }
    }
    if (static_cast<int32_t>(program.getLogits()) == from)
      program.setLogitsAttr(builder_.getI32IntegerAttr(to));
    program.setLayerOutputsAttr(
        builder_.getDenseI32ArrayAttr(replaced(program.getLayerOutputs(), from, to)));
  }

  // Removes the dropped head copies and then every step that only fed them (a DSA indexer and
  // its prologs feed just their sparse attention).
  void eraseDropped(plan::ProgramOp program, ArrayRef<plan::DispatchOp> dropped) {
    SmallVector<int32_t> orphans;
    for (plan::DispatchOp dispatch : dropped) {
      orphans.append(dispatch.getInputs().begin(), dispatch.getInputs().end());
      dispatch.erase();
    }
    while (!orphans.empty()) {
      const int32_t value = orphans.pop_back_val();
      if (value == static_cast<int32_t>(program.getLogits()) ||
          value == static_cast<int32_t>(program.getTokenIds()) ||
          llvm::is_contained(program.getLayerOutputs(), value))
        continue;
      plan::DispatchOp writer;
      bool read = false;
      for (Operation &op : program.getBodyBlock()) {
        if (auto dispatch = dyn_cast<plan::DispatchOp>(op)) {
          read |= llvm::is_contained(dispatch.getInputs(), value);
          if (llvm::is_contained(dispatch.getOutputs(), value))
            writer = dispatch;
        } else if (auto copy = dyn_cast<plan::CopyOp>(op)) {
          read |= static_cast<int32_t>(copy.getSource()) == value;
        }
      }
      if (read || !writer)
        continue;
      // The writer goes when none of its outputs is read any more.
      bool otherOutputRead = false;
      for (int32_t output : writer.getOutputs())
        for (plan::DispatchOp other : program.getBodyBlock().getOps<plan::DispatchOp>())
          otherOutputRead |= output != value && llvm::is_contained(other.getInputs(), output);
      if (otherOutputRead)
        continue;
      orphans.append(writer.getInputs().begin(), writer.getInputs().end());
      writer.erase();
    }
  }

  // ---- Context parallelism (docs/parallelism.md): the prefill's every value holds this rank's
  // zigzag share of the step's tokens, except what an attention needs from every position and
  // the logits. The gathers are explicit steps over the context_parallel group.

  // A new value after the program's values; returns its index.
  int32_t addValue(plan::ProgramOp program, Type dtype, int64_t rowElements, StringRef rows,
                   const Twine &name) {
    Block &block = program.getBodyBlock();
    SmallVector<plan::ValueOp> values(block.getOps<plan::ValueOp>());
    builder_.setInsertionPointAfter(values.back());
    builder_.create<plan::ValueOp>(
        values.back().getLoc(), TypeAttr::get(dtype), builder_.getI64IntegerAttr(rowElements),
        builder_.getI64IntegerAttr(-1), builder_.getStringAttr(name), builder_.getStringAttr(rows));
    return static_cast<int32_t>(values.size());
  }

  plan::DispatchOp addDispatch(plan::DispatchOp before, plan::KernelId kernel,
                               ArrayRef<int32_t> inputs, int32_t output, ArrayRef<int32_t> weights,
                               DictionaryAttr params) {
    builder_.setInsertionPoint(before);
    return builder_.create<plan::DispatchOp>(
        before.getLoc(), plan::KernelIdAttr::get(builder_.getContext(), kernel),
        builder_.getDenseI32ArrayAttr(inputs), builder_.getDenseI32ArrayAttr({output}),
        builder_.getDenseI32ArrayAttr(weights), params, builder_.getI32IntegerAttr(0),
        builder_.getDenseI32ArrayAttr({}), builder_.getI32IntegerAttr(-1), before.getLayerAttr());
  }

  // Before `before`: every context rank's rows of `from` into a new value of `rows` rows.
  int32_t gather(plan::ProgramOp program, plan::DispatchOp before, int32_t from, StringRef rows,
                 int64_t tailRows, StringRef suffix) {
    plan::ValueOp source = SmallVector<plan::ValueOp>(
        program.getBodyBlock().getOps<plan::ValueOp>())[from];
    const int32_t to = addValue(program, source.getDtype(), source.getRowElements(), rows,
                                source.getName() + suffix);
    SmallVector<NamedAttribute> params = {
        builder_.getNamedAttr("group", builder_.getStringAttr("context_parallel"))};
    if (tailRows > 0)
      params.push_back(builder_.getNamedAttr("tail_rows", builder_.getI32IntegerAttr(
                                                              static_cast<int32_t>(tailRows))));
    addDispatch(before, plan::KernelId::all_gather_rows, {from}, to, {},
                builder_.getDictionaryAttr(params));
    return to;
  }

  void shardContext(plan::ProgramOp program) {
    for (plan::ValueOp value : program.getBodyBlock().getOps<plan::ValueOp>())
      value.setRowsAttr(builder_.getStringAttr("context_shard"));
    SmallVector<plan::ValueOp> values(program.getBodyBlock().getOps<plan::ValueOp>());
    values[program.getLogits()].setRowsAttr(builder_.getStringAttr("step"));
    SmallVector<plan::DispatchOp> dispatches(program.getBodyBlock().getOps<plan::DispatchOp>());
    for (plan::DispatchOp dispatch : dispatches) {
      SmallVector<int32_t> inputs(dispatch.getInputs());
      switch (dispatch.getKernel()) {
      case plan::KernelId::lm_head: // the order is restored before the logits
        inputs[0] = gather(program, dispatch, inputs[0], "step", 0, ".gathered");
        break;
      case plan::KernelId::dsa_indexer: // scores this rank's queries against every key
        inputs[1] = gather(program, dispatch, inputs[1], "step", 0, ".gathered");
        break;
      case plan::KernelId::mla_prefill:
      case plan::KernelId::sparse_mla_prefill: {
        // This rank's tokens' cache rows, gathered: every rank appends the whole step.
        const int64_t width =
            intParam(dispatch, "kv_lora_rank") + intParam(dispatch, "qk_rope_head_dim");
        plan::ValueOp x = values[inputs[0]];
        const int32_t own = addValue(program, x.getDtype(), width, "context_shard",
                                     values[dispatch.getOutputs()[0]].getName() + ".cache_rows");
        ArrayRef<int32_t> w = dispatch.getWeights();
        addDispatch(dispatch, plan::KernelId::mla_cache_rows, {inputs[0]}, own, {w[2], w[3]},
                    dispatch.getParams());
        inputs.push_back(gather(program, dispatch, own, "step", 0, ".gathered"));
        break;
      }
      case plan::KernelId::kda_chunk_prefill: {
        // The state-passing scan: every chunk's conv history (its last conv_kernel - 1 input
        // rows), then every chunk's summary, then this rank's outputs.
        const int64_t history = std::max<int64_t>(1, intParam(dispatch, "conv_kernel") - 1);
        const int64_t heads = intParam(dispatch, "num_heads"), dim = intParam(dispatch, "head_dim");
        const int32_t tails = gather(program, dispatch, inputs[0], "step", history, ".conv_tails");
        const int32_t summaries =
            addValue(program, builder_.getF32Type(), heads * dim * 2 * dim, "context_chunks",
                     values[dispatch.getOutputs()[0]].getName() + ".summaries");
        plan::DispatchOp summary =
            addDispatch(dispatch, plan::KernelId::kda_context_summary, {inputs[0], tails},
                        summaries, dispatch.getWeights(), dispatch.getParams());
        for (int32_t index : dispatch.getWeights()) // cut the same way as the layer's
          if (sliceReaders_.contains({dispatch.getOperation(), index}))
            sliceReaders_.insert({summary.getOperation(), index});
        const int32_t all = gather(program, dispatch, summaries, "all_context_chunks", 0, ".all");
        inputs.push_back(tails);
        inputs.push_back(all);
        break;
      }
      default:
        continue;
      }
      dispatch.setInputsAttr(builder_.getDenseI32ArrayAttr(inputs));
    }
  }

  LogicalResult resizeStateLayers() {
    SmallVector<plan::RecurrentStateLayerOp> layers(
        plan_.getBodyBlock().getOps<plan::RecurrentStateLayerOp>());
    for (auto [slot, heads] : stateHeads_) {
      if (slot < 0 || slot >= static_cast<int64_t>(layers.size()))
        return plan_.emitOpError() << "state slot " << slot << " out of range";
      plan::RecurrentStateLayerOp layer = layers[slot];
      layer.setNumHeadsAttr(builder_.getI32IntegerAttr(static_cast<int32_t>(heads)));
      layer.setConvChannelsAttr(
          builder_.getI32IntegerAttr(static_cast<int32_t>(3 * heads * layer.getHeadKDim())));
    }
    return success();
  }

  // Keeps the weights this rank reads (and their scales), renumbered in plan order, cuts the
  // slices and lays the archive out again.
  LogicalResult rewriteWeights() {
    Block &body = plan_.getBodyBlock();
    // A weight cut for one kernel must not be read whole by another.
    WalkResult wholeReads = body.walk([&](plan::DispatchOp dispatch) {
      for (int32_t index : dispatch.getWeights())
        if (index >= 0 && slices_.count(index) &&
            !sliceReaders_.contains({dispatch.getOperation(), index})) {
          dispatch.emitOpError() << "layer " << layerOf(dispatch) << " reads weight '"
                                 << weights_[index].getName()
                                 << "' whole, which another kernel reads as this rank's slice";
          return WalkResult::interrupt();
        }
      return WalkResult::advance();
    });
    if (wholeReads.wasInterrupted())
      return failure();
    llvm::SetVector<int32_t> used;
    body.walk([&](plan::DispatchOp dispatch) {
      for (int32_t index : dispatch.getWeights())
        if (index >= 0) {
          used.insert(index);
          if (scaleOf(weights_[index]) >= 0)
            used.insert(scaleOf(weights_[index]));
        }
    });
    SmallVector<int32_t> renumber(weights_.size(), -1);
    int32_t next = 0;
    for (auto [index, weight] : llvm::enumerate(weights_))
      if (used.contains(static_cast<int32_t>(index)))
        renumber[index] = next++;
    body.walk([&](plan::DispatchOp dispatch) {
      SmallVector<int32_t> w(dispatch.getWeights());
      for (int32_t &index : w)
        index = index >= 0 ? renumber[index] : -1;
      dispatch.setWeightsAttr(builder_.getDenseI32ArrayAttr(w));
    });

    SmallVector<plan::WeightOp> kept;
    for (auto [index, weight] : llvm::enumerate(weights_)) {
      if (renumber[index] < 0) {
        weight.erase();
        continue;
      }
      if (scaleOf(weight) >= 0)
        weight.setScaleAttr(builder_.getI32IntegerAttr(renumber[scaleOf(weight)]));
      auto it = slices_.find(static_cast<int32_t>(index));
      if (it != slices_.end()) {
        if (weight.getNzTiled())
          return weight.emitOpError()
                 << "cannot be sliced for tp=" << tp_ << ": it is tiled already (run "
                 << "--hybrid-shard before --hybrid-assign-weight-layout, which tiles each "
                 << "rank's part)";
        auto type = cast<RankedTensorType>(weight.getType());
        SmallVector<int64_t> shape(type.getShape());
        shape[it->second.axis] = it->second.size;
        auto part = RankedTensorType::get(shape, type.getElementType());
        weight.setTypeAttr(TypeAttr::get(part));
        weight.setSliceAttr(builder_.getDenseI64ArrayAttr({it->second.axis, it->second.begin}));
        weight.setSizeAttr(builder_.getI64IntegerAttr(part.getNumElements() *
                                                      elementBytes(part.getElementType())));
      }
      kept.push_back(weight);
    }
    SmallVector<uint64_t> sizes;
    for (plan::WeightOp weight : kept)
      sizes.push_back(static_cast<uint64_t>(weight.getSize()));
    std::vector<uint64_t> offsets = planWeightOffsets(sizes);
    for (auto [weight, offset] : llvm::zip(kept, offsets))
      weight.setOffsetAttr(builder_.getI64IntegerAttr(static_cast<int64_t>(offset)));
    plan_.setWeightArchiveBytesAttr(builder_.getI64IntegerAttr(
        offsets.empty() ? 0 : static_cast<int64_t>(offsets.back() + sizes.back())));
    return success();
  }

  plan::PlanOp plan_;
  int64_t tp_, ep_, cp_, rank_, contextRank_; // rank_: the tensor rank
  OpBuilder builder_;
  SmallVector<plan::WeightOp> weights_;
  std::map<int32_t, Slice> slices_; // the weights this rank cuts, block scales included
  SmallVector<RecordedSplit> splits_;  // every slice's rule, for naming the tp values that work
  std::optional<MisalignedSlice> misaligned_; // the first cut inside a scale block
  llvm::DenseSet<std::pair<Operation *, int32_t>> sliceReaders_; // (dispatch, weight) cut reads
  std::map<int64_t, int64_t> stateHeads_; // state slot -> heads on this rank
  SmallVector<PartialOutput> partials_;
};

struct ShardPass : impl::ShardBase<ShardPass> {
  using ShardBase::ShardBase;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    // Plain copies: pass options do not print as numbers in diagnostics.
    const int64_t tp = this->tp, ep = this->ep, cp = this->cp;
    if (tp < 1 || ep < 1 || cp < 1) {
      module.emitError() << "--hybrid-shard: tp, ep and cp must be at least 1 (tp=" << tp
                         << " ep=" << ep << " cp=" << cp << ")";
      return signalPassFailure();
    }
    const int64_t world = tp * cp;
    // Experts go over the tensor-parallel ranks (the same tokens: an all-reduce combines them)
    // or, without tensor parallelism, over the context ranks (an all-to-all in the prefill).
    if (ep != 1 && ep != tp && !expertsOverContext(tp, ep, cp)) {
      InFlightDiagnostic error = module.emitError();
      error << "--hybrid-shard: ep=" << ep << " must be 1" << (tp == 1 && cp > 1 ? ", " : " or ")
            << "tp=" << tp;
      if (tp == 1 && cp > 1)
        error << " or cp=" << cp;
      error << ": experts are spread over the tensor-parallel ranks, which hold the same "
            << "tokens, or with tp=1 over the context-parallel ranks (an all-to-all in the "
            << "prefill)";
      if (tp > 1 && cp > 1)
        error << "; experts over both the tensor and the context ranks (ep=" << world
              << ") are not built";
      return signalPassFailure();
    }
    if (world == 1)
      return; // one rank: the plan as it is

    SmallVector<plan::PlanOp> plans(module.getOps<plan::PlanOp>());
    for (plan::PlanOp planOp : plans) {
      if (planOp.getWorldSize() != 1) {
        planOp.emitOpError() << "is already sharded (world_size " << planOp.getWorldSize() << ")";
        return signalPassFailure();
      }
      WalkResult placed = planOp.walk([&](plan::ValueOp value) {
        if (static_cast<int64_t>(value.getOffset()) >= 0) {
          value.emitOpError() << "has an arena offset: run --hybrid-shard before "
                                 "--hybrid-plan-memory";
          return WalkResult::interrupt();
        }
        return WalkResult::advance();
      });
      if (placed.wasInterrupted())
        return signalPassFailure();
      if (cp > 1)
        for (plan::ProgramOp program : planOp.getBodyBlock().getOps<plan::ProgramOp>())
          if (program.getName() == "mtp") {
            program.emitOpError() << "cp=" << cp << ": context parallelism with a "
                                  << "multi-token-prediction layer is not built (its program "
                                  << "reads every prompt row's final hidden state)";
            return signalPassFailure();
          }
      OpBuilder builder(planOp);
      for (int64_t rank = 0; rank < world; ++rank) {
        auto copy = cast<plan::PlanOp>(builder.clone(*planOp));
        copy.setSymName((planOp.getSymName() + "_rank" + std::to_string(rank)).str());
        copy.setWorldSizeAttr(builder.getI32IntegerAttr(static_cast<int32_t>(world)));
        copy.setRankAttr(builder.getI32IntegerAttr(static_cast<int32_t>(rank)));
        copy.setTensorParallelAttr(builder.getI32IntegerAttr(static_cast<int32_t>(tp)));
        copy.setExpertParallelAttr(builder.getI32IntegerAttr(static_cast<int32_t>(ep)));
        copy.setContextParallelAttr(builder.getI32IntegerAttr(static_cast<int32_t>(cp)));
        if (failed(RankSharder(copy, tp, ep, cp, rank).run()))
          return signalPassFailure();
      }
      planOp.erase();
    }
  }
};

} // namespace
} // namespace hybrid
