// MLIR element types <-> plan.fbs dtypes.
#pragma once

#include "runtime/schema/plan_generated.h"

#include "mlir/IR/BuiltinTypes.h"

namespace hybrid::target {

inline plan::fb::DType toPlanDType(mlir::Type type) {
  if (type.isF32())
    return plan::fb::DType::F32;
  if (type.isBF16())
    return plan::fb::DType::BF16;
  if (type.isF16())
    return plan::fb::DType::F16;
  if (mlir::isa<mlir::Float8E4M3FNType>(type))
    return plan::fb::DType::F8_E4M3;
  if (type.isInteger(32))
    return plan::fb::DType::I32;
  return plan::fb::DType::I64;
}

} // namespace hybrid::target
