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

struct Slot {
  int64_t offset;
  int64_t bytes;
};

// Free slots, kept sorted and coalesced so freed neighbours form one larger slot.
class FreeList {
public:
  void release(Slot slot) {
    slots_.push_back(slot);
    std::sort(slots_.begin(), slots_.end(),
              [](const Slot &a, const Slot &b) { return a.offset < b.offset; });
    SmallVector<Slot> merged;
    for (const Slot &s : slots_) {
      if (!merged.empty() && merged.back().offset + merged.back().bytes == s.offset)
        merged.back().bytes += s.bytes;
      else
        merged.push_back(s);
    }
    slots_ = std::move(merged);
  }
  // Best fit; nullopt when no free slot is large enough.
  std::optional<int64_t> take(int64_t bytes) {
    int best = -1;
    for (auto [i, slot] : llvm::enumerate(slots_))
      if (slot.bytes >= bytes && (best < 0 || slot.bytes < slots_[best].bytes))
        best = static_cast<int>(i);
    if (best < 0)
      return std::nullopt;
    int64_t offset = slots_[best].offset;
    slots_[best].offset += bytes;
    slots_[best].bytes -= bytes;
    if (slots_[best].bytes == 0)
      slots_.erase(slots_.begin() + best);
    return offset;
  }

private:
  SmallVector<Slot> slots_;
};

void planProgram(plan::ProgramOp program) {
  Builder builder(program.getContext());
  SmallVector<plan::ValueOp> values(program.getBodyBlock().getOps<plan::ValueOp>());
  StepOrder order(program);
  const int64_t rows = program.getMaxTokens();
  auto bytesOf = [&](plan::ValueOp value) {
    int64_t elementBytes = std::max<int64_t>(1, value.getDtype().getIntOrFloatBitWidth() / 8);
    return alignUp(rows * value.getRowElements() * elementBytes);
  };

  SmallVector<int64_t> offsets(values.size(), 0);
  SmallVector<int32_t> live; // allocated, not yet reclaimed
  FreeList free;
  int64_t arenaEnd = 0;
  auto allocate = [&](int32_t v) {
    const int64_t bytes = bytesOf(values[v]);
    if (std::optional<int64_t> offset = free.take(bytes)) {
      offsets[v] = *offset;
    } else {
      offsets[v] = arenaEnd;
      arenaEnd += bytes;
    }
    live.push_back(v);
  };

  // Values the host writes before the program runs (the token ids) come first.
  for (auto [v, value] : llvm::enumerate(values))
    if (order.writer(static_cast<int32_t>(v)) < 0 && !order.readers(v).empty())
      allocate(static_cast<int32_t>(v));
  const int32_t logits = static_cast<int32_t>(program.getLogits());
  for (size_t step = 0; step < order.numSteps(); ++step) {
    // Reclaim what no stream can still touch when this step starts; the host reads the logits
    // after the program, so they stay.
    llvm::erase_if(live, [&](int32_t v) {
      if (v == logits || !order.deadBefore(v, step))
        return false;
      free.release({offsets[v], bytesOf(values[v])});
      return true;
    });
    for (int32_t v : order.writes(step))
      allocate(v);
  }

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
