// The compiler's passes (one file each, registered for hybrid-opt and used by hybrid-compile).
#pragma once

#include "dialects/Hybrid/IR/HybridDialect.h"
#include "dialects/Plan/IR/PlanDialect.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

#include <memory>

namespace hybrid {

#define GEN_PASS_DECL
#include "compiler/Transforms/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/Transforms/Passes.h.inc"

} // namespace hybrid
