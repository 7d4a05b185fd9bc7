// plan dialect -> the FlatBuffers plan file (runtime/schema/plan.fbs), and the file -> JSON for
// `--emit=plan-json`. The input has passed --hybrid-verify-plan-contract, so the writer is a plain walk.
#pragma once

#include "dialects/Plan/IR/PlanDialect.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace hybrid::target {

// Serializes one plan; fails (with a diagnostic on the op) only on params of the wrong kind.
mlir::FailureOr<std::vector<uint8_t>> serializePlan(plan::PlanOp planOp);

// Renders a serialized plan as JSON through the schema compiled into the binary.
mlir::FailureOr<std::string> planToJson(std::span<const uint8_t> plan, std::string &error);

} // namespace hybrid::target
