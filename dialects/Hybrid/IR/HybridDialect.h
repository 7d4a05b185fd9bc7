// The `hybrid` dialect: one op per layer family of hybrid-attention LLMs.
#pragma once

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/DialectImplementation.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/SymbolTable.h"
#include "mlir/Interfaces/InferTypeOpInterface.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include "llvm/ADT/bit.h"

namespace hybrid {
// A real-valued attribute parameter (RoPE settings): hashable, printed so that it round-trips.
struct Real {
  double value = 0;
  bool operator==(const Real &) const = default;
  operator double() const { return value; }
};
inline llvm::hash_code hash_value(Real real) {
  return llvm::hash_value(llvm::bit_cast<uint64_t>(real.value));
}
inline mlir::AsmPrinter &operator<<(mlir::AsmPrinter &printer, Real real) {
  printer.printFloat(llvm::APFloat(real.value));
  return printer;
}
} // namespace hybrid

namespace mlir {
template <> struct FieldParser<hybrid::Real> {
  static FailureOr<hybrid::Real> parse(AsmParser &parser) {
    double value = 0;
    if (parser.parseFloat(value))
      return failure();
    return hybrid::Real{value};
  }
};
} // namespace mlir

#include "dialects/Hybrid/IR/HybridDialect.h.inc"
#include "dialects/Hybrid/IR/HybridEnums.h.inc"

#define GET_ATTRDEF_CLASSES
#include "dialects/Hybrid/IR/HybridAttrs.h.inc"

#define GET_OP_CLASSES
#include "dialects/Hybrid/IR/HybridOps.h.inc"

namespace hybrid {
// The decoder layer an op belongs to, from its `model.layers.<i>.…` name location (the importer
// names every op after its checkpoint module); -1 for model-level ops.
int32_t layerOf(mlir::Operation *op);
} // namespace hybrid
