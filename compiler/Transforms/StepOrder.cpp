#include "compiler/Transforms/StepOrder.h"

#include "llvm/ADT/DenseMap.h"

namespace hybrid {

StepOrder::StepOrder(plan::ProgramOp program) {
  const size_t numValues = llvm::range_size(program.getBodyBlock().getOps<plan::ValueOp>());
  writer_.assign(numValues, -1);
  readers_.resize(numValues);

  llvm::DenseMap<int32_t, size_t> lastOnStream, lastSignal;
  for (mlir::Operation &op : program.getBodyBlock()) {
    int32_t stream = 0;
    llvm::SmallVector<int32_t> reads, writes, waits;
    int32_t signal = -1;
    if (auto dispatch = llvm::dyn_cast<plan::DispatchOp>(op)) {
      stream = static_cast<int32_t>(dispatch.getStream());
      reads.assign(dispatch.getInputs().begin(), dispatch.getInputs().end());
      writes.assign(dispatch.getOutputs().begin(), dispatch.getOutputs().end());
      waits.assign(dispatch.getWaitEvents().begin(), dispatch.getWaitEvents().end());
      signal = static_cast<int32_t>(dispatch.getSignalEvent());
    } else if (auto copy = llvm::dyn_cast<plan::CopyOp>(op)) {
      stream = static_cast<int32_t>(copy.getStream());
      reads.push_back(static_cast<int32_t>(copy.getSource()));
      writes.push_back(static_cast<int32_t>(copy.getDestination()));
    } else {
      continue;
    }
    const size_t index = steps_.size();
    llvm::BitVector before(index + 1);
    auto inherit = [&](size_t predecessor) {
      before.set(predecessor);
      llvm::BitVector transitive = predecessors_[predecessor];
      transitive.resize(index + 1);
      before |= transitive;
    };
    if (auto it = lastOnStream.find(stream); it != lastOnStream.end())
      inherit(it->second);
    for (int32_t event : waits)
      if (auto it = lastSignal.find(event); it != lastSignal.end())
        inherit(it->second);
    lastOnStream[stream] = index;
    if (signal >= 0)
      lastSignal[signal] = index;

    for (int32_t value : reads)
      if (value >= 0 && static_cast<size_t>(value) < numValues)
        readers_[value].push_back(static_cast<int64_t>(index));
    for (int32_t value : writes)
      if (value >= 0 && static_cast<size_t>(value) < numValues)
        writer_[value] = static_cast<int64_t>(index);
    steps_.push_back(&op);
    reads_.push_back(std::move(reads));
    writes_.push_back(std::move(writes));
    predecessors_.push_back(std::move(before));
  }
  for (llvm::BitVector &bits : predecessors_)
    bits.resize(steps_.size());
}

bool StepOrder::deadBefore(int32_t value, size_t step) const {
  const int64_t write = writer_[value];
  if (write >= 0 && (static_cast<size_t>(write) >= step || !happensBefore(write, step)))
    return false;
  for (int64_t read : readers_[value])
    if (static_cast<size_t>(read) >= step || !happensBefore(read, step))
      return false;
  return true;
}

} // namespace hybrid
