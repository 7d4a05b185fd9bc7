// A human-readable summary of an imported model: layer kinds, parameters, cache and state sizes.
#pragma once

#include "dialects/Hybrid/IR/HybridDialect.h"

#include "llvm/Support/raw_ostream.h"

namespace hybrid::analysis {

void printModelSummary(ModelOp model, llvm::raw_ostream &os);

} // namespace hybrid::analysis
