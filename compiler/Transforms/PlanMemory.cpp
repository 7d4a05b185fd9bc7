// --hybrid-plan-memory: arena offsets for every program value, from liveness under the program's
// stream and event order (see Passes.td).
#include "compiler/Transforms/Passes.h"
#include "compiler/Transforms/StepOrder.h"

#include "mlir/IR/Builders.h"

#include <algorithm>

namespace hybrid {
#define GEN_PASS_DEF_PLANMEMORY
#include "compiler/Transforms/Passes.h.inc"
} // namespace hybrid

using namespace mlir;

namespace hybrid {
namespace {

constexpr int64_t kArenaAlignment = 64; // one cache line; every vector load stays aligned

int64_t alignUp(int64_t value) {
  return (value + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
}

void planProgram(plan::ProgramOp program) {
  Builder builder(program.getContext());
  SmallVector<plan::ValueOp> values(program.getBodyBlock().getOps<plan::ValueOp>());
  StepOrder order(program);
  const int64_t tokens = program.getMaxTokens();
  // Per-chunk values of a context-parallel prefill hold 2 or 2 x context_parallel rows.
  auto plan = program->getParentOfType<plan::PlanOp>();
  const int64_t contextParallel = plan ? plan.getContextParallel().value_or(1) : 1;
  auto bytesOf = [&](plan::ValueOp value) {
    int64_t elementBytes = std::max<int64_t>(1, value.getDtype().getIntOrFloatBitWidth() / 8);
    return alignUp(value.plannedRows(tokens, contextParallel) * value.getRowElements() *
                   elementBytes);
  };

  SmallVector<int64_t> offsets(values.size(), 0);
  SmallVector<int32_t> placed; // values with a slot, in placement order
  int64_t arenaEnd = 0;
  const int32_t logits = static_cast<int32_t>(program.getLogits());

  // Places `v`, written by step `step` (or by the host before the program when step < 0), in the
  // best-fitting gap between the slots still in use. A slot is in use when the step might overlap
  // any of its value's uses: freedom is relative to the writing step's stream and events, so it is
  // decided per allocation, not once for all later steps. The logits stay in use to the end.
  auto place = [&](int32_t v, int64_t step) {
    SmallVector<std::pair<int64_t, int64_t>> busy;
    for (int32_t other : placed) {
      bool free = step >= 0 && other != logits && order.deadBefore(other, step);
      if (!free)
        busy.push_back({offsets[other], offsets[other] + bytesOf(values[other])});
    }
    llvm::sort(busy);
    const int64_t bytes = bytesOf(values[v]);
    int64_t best = -1, bestGap = 0, cursor = 0;
    for (auto [begin, end] : busy) {
      if (begin - cursor >= bytes && (best < 0 || begin - cursor < bestGap)) {
        best = cursor;
        bestGap = begin - cursor;
      }
      cursor = std::max(cursor, end);
    }
    if (best < 0 && arenaEnd - cursor >= bytes)
      best = cursor;
    offsets[v] = best >= 0 ? best : cursor;
    arenaEnd = std::max(arenaEnd, offsets[v] + bytes);
    placed.push_back(v);
  };

  // Values the host writes before the program runs (the token ids) come first.
  for (auto [v, value] : llvm::enumerate(values))
    if (order.writer(static_cast<int32_t>(v)) < 0 && !order.readers(v).empty())
      place(static_cast<int32_t>(v), -1);
  for (size_t step = 0; step < order.numSteps(); ++step)
    for (int32_t v : order.writes(step))
      place(v, static_cast<int64_t>(step));

  for (auto [v, value] : llvm::enumerate(values))
    value.setOffsetAttr(builder.getI64IntegerAttr(offsets[v]));
  program.setArenaBytesAttr(builder.getI64IntegerAttr(arenaEnd));
}

struct PlanMemoryPass : impl::PlanMemoryBase<PlanMemoryPass> {
  void runOnOperation() override {
    getOperation().walk([](plan::ProgramOp program) { planProgram(program); });
  }
};

} // namespace
} // namespace hybrid
