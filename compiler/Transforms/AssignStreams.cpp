// --hybrid-assign-streams: independent work on separate streams, joined by events (Passes.td).
#include "compiler/Transforms/Passes.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/BitVector.h"
#include "llvm/ADT/DenseMap.h"

namespace hybrid {
#define GEN_PASS_DEF_ASSIGNSTREAMS
#include "compiler/Transforms/Passes.h.inc"
} // namespace hybrid

using namespace mlir;

namespace hybrid {
namespace {

// The cache or state a step reads and writes besides its values (attention and the fused
// indexer on their KV slot, KDA on its state): steps touching the same one keep program order.
SmallVector<std::pair<StringRef, int64_t>> sideEffects(plan::DispatchOp dispatch) {
  switch (dispatch.getKernel()) {
  case plan::KernelId::kda_chunk_prefill:
  case plan::KernelId::kda_recurrent_decode:
  case plan::KernelId::mla_prefill:
  case plan::KernelId::mla_decode:
  case plan::KernelId::sparse_mla_prefill:
  case plan::KernelId::sparse_mla_decode:
  case plan::KernelId::dsa_indexer:
  case plan::KernelId::kda_context_summary: // reads the state the prefill then replaces
    break;
  default:
    return {};
  }
  SmallVector<std::pair<StringRef, int64_t>> effects;
  for (StringRef slot : {"kv_slot", "state_slot"})
    if (auto attr = dispatch.getParams().getAs<IntegerAttr>(slot))
      effects.push_back({slot, attr.getInt()});
  return effects;
}

void assignProgram(plan::ProgramOp program, int32_t maxStreams) {
  Builder builder(program.getContext());
  SmallVector<plan::DispatchOp> steps(program.getBodyBlock().getOps<plan::DispatchOp>());
  const size_t n = steps.size();

  // Direct dependencies: the writer of every input, and the previous step on the same cache slot.
  llvm::DenseMap<int32_t, size_t> writerOf;
  llvm::DenseMap<std::pair<StringRef, int64_t>, size_t> lastEffect;
  SmallVector<SmallVector<size_t>> dependencies(n);
  SmallVector<llvm::BitVector> ancestors(n);
  for (size_t s = 0; s < n; ++s) {
    ancestors[s].resize(n);
    auto depend = [&](size_t on) {
      if (llvm::is_contained(dependencies[s], on))
        return;
      dependencies[s].push_back(on);
      ancestors[s].set(on);
      ancestors[s] |= ancestors[on];
    };
    for (int32_t value : steps[s].getInputs())
      if (auto it = writerOf.find(value); it != writerOf.end())
        depend(it->second);
    for (auto effect : sideEffects(steps[s])) {
      if (auto it = lastEffect.find(effect); it != lastEffect.end())
        depend(it->second);
      lastEffect[effect] = s;
    }
    for (int32_t value : steps[s].getOutputs())
      writerOf[value] = s;
  }

  // Streams: a step continues the lowest stream whose last step it depends on anyway (no false
  // serialization); work independent of every stream's tail opens a new stream.
  // Collectives (a sharded plan's all-reduces and gathers, and the routed experts that exchange
  // rows by an all-to-all) go on a stream of their own, after the compute streams, in program
  // order: every rank then issues them in the same order, and compute that does not need a sum
  // can overlap it.
  constexpr int32_t kCollectiveStream = -2;
  SmallVector<int64_t> tail; // last step per stream
  SmallVector<int32_t> streamOf(n, 0);
  bool anyCollective = false;
  auto communicates = [](plan::DispatchOp step) {
    auto allToAll = step.getParams().getAs<BoolAttr>("all_to_all");
    return step.getKernel() == plan::KernelId::all_reduce_sum ||
           step.getKernel() == plan::KernelId::all_gather_rows ||
           (step.getKernel() == plan::KernelId::moe_experts && allToAll && allToAll.getValue());
  };
  for (size_t s = 0; s < n; ++s) {
    if (communicates(steps[s])) {
      streamOf[s] = kCollectiveStream;
      anyCollective = true;
      continue;
    }
    int32_t chosen = -1;
    for (auto [k, last] : llvm::enumerate(tail))
      if (ancestors[s].test(static_cast<size_t>(last))) {
        chosen = static_cast<int32_t>(k);
        break;
      }
    if (chosen < 0) {
      if (tail.empty() || static_cast<int32_t>(tail.size()) < maxStreams) {
        chosen = static_cast<int32_t>(tail.size());
        tail.push_back(-1);
      } else {
        chosen = 0; // every stream busy with unrelated work: serialize behind stream 0
      }
    }
    streamOf[s] = chosen;
    tail[chosen] = static_cast<int64_t>(s);
  }
  if (tail.empty())
    tail.push_back(-1);
  const int32_t collectiveStream = static_cast<int32_t>(tail.size());
  for (int32_t &stream : streamOf)
    if (stream == kCollectiveStream)
      stream = collectiveStream;

  // Events: a dependency on another stream that the order does not already imply gets an event
  // recorded after the producer and waited for by the consumer.
  SmallVector<llvm::BitVector> ordered(n); // happens-before under streams + events so far
  llvm::DenseMap<int32_t, size_t> lastOnStream;
  SmallVector<int32_t> eventOf(n, -1);
  int32_t numEvents = 0;
  for (size_t s = 0; s < n; ++s) {
    ordered[s].resize(n);
    auto inherit = [&](size_t p) {
      ordered[s].set(p);
      ordered[s] |= ordered[p];
    };
    if (auto it = lastOnStream.find(streamOf[s]); it != lastOnStream.end())
      inherit(it->second);
    SmallVector<int32_t> waits;
    for (size_t p : dependencies[s]) {
      if (ordered[s].test(p))
        continue;
      if (eventOf[p] < 0)
        eventOf[p] = numEvents++;
      waits.push_back(eventOf[p]);
      inherit(p);
    }
    lastOnStream[streamOf[s]] = s;
    steps[s].setStreamAttr(builder.getI32IntegerAttr(streamOf[s]));
    steps[s].setWaitEventsAttr(builder.getDenseI32ArrayAttr(waits));
  }
  for (size_t s = 0; s < n; ++s)
    steps[s].setSignalEventAttr(builder.getI32IntegerAttr(eventOf[s]));
  program.setNumStreamsAttr(builder.getI32IntegerAttr(collectiveStream + (anyCollective ? 1 : 0)));
  program.setNumEventsAttr(builder.getI32IntegerAttr(numEvents));
}

struct AssignStreamsPass : impl::AssignStreamsBase<AssignStreamsPass> {
  using AssignStreamsBase::AssignStreamsBase;
  void runOnOperation() override {
    if (maxStreams < 1) {
      getOperation().emitError() << "max-streams must be at least 1, got "
                                 << static_cast<int64_t>(maxStreams);
      return signalPassFailure();
    }
    getOperation().walk([&](plan::ProgramOp program) { assignProgram(program, maxStreams); });
  }
};

} // namespace
} // namespace hybrid
