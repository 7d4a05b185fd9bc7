#include "dialects/Hybrid/IR/HybridDialect.h"

#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace hybrid;

#include "dialects/Hybrid/IR/HybridDialect.cpp.inc"
#include "dialects/Hybrid/IR/HybridEnums.cpp.inc"

#define GET_ATTRDEF_CLASSES
#include "dialects/Hybrid/IR/HybridAttrs.cpp.inc"

void HybridDialect::initialize() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "dialects/Hybrid/IR/HybridAttrs.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "dialects/Hybrid/IR/HybridOps.cpp.inc"
      >();
}
