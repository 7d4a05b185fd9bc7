// The execution order a program guarantees: steps run in program order on their stream, and a
// step that waits for an event runs after the latest earlier step that signals it. Everything else
// may overlap. Memory planning and the contract verifier reason with this relation, so arena
// slots are reused only when no stream can still be using them.
#pragma once

#include "dialects/Plan/IR/PlanDialect.h"

#include "llvm/ADT/BitVector.h"
#include "llvm/ADT/SmallVector.h"

namespace hybrid {

class StepOrder {
public:
  explicit StepOrder(plan::ProgramOp program);

  size_t numSteps() const { return steps_.size(); }
  mlir::Operation *step(size_t index) const { return steps_[index]; }
  // Values a step reads and writes (a copy reads its source and writes its destination).
  llvm::ArrayRef<int32_t> reads(size_t index) const { return reads_[index]; }
  llvm::ArrayRef<int32_t> writes(size_t index) const { return writes_[index]; }
  // True when step `before` finishes before step `after` starts in every execution.
  bool happensBefore(size_t before, size_t after) const {
    return after < predecessors_.size() && predecessors_[after].test(before);
  }

  // Value lifetimes: the step writing each value (-1 for values the host fills before the
  // program, such as the token ids) and the steps reading it.
  int64_t writer(int32_t value) const { return writer_[value]; }
  llvm::ArrayRef<int64_t> readers(int32_t value) const { return readers_[value]; }
  // True when every use of `value` (its write and reads) happens before step `step` starts, so
  // `step` may overwrite its bytes.
  bool deadBefore(int32_t value, size_t step) const;

private:
  llvm::SmallVector<mlir::Operation *> steps_;
  llvm::SmallVector<llvm::SmallVector<int32_t>> reads_, writes_;
  llvm::SmallVector<llvm::BitVector> predecessors_; // transitive
  llvm::SmallVector<int64_t> writer_;
  llvm::SmallVector<llvm::SmallVector<int64_t>> readers_;
};

} // namespace hybrid
