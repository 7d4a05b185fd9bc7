// A summary of a compiled plan: per program the steps, fused kernels, streams, events and arena
// size; the weight bytes per dtype; the cache sizes. Printed by `hybrid-compile --report`.
#pragma once

#include "runtime/schema/plan_generated.h"

#include <ostream>

namespace hybrid {

void printPlanReport(const plan::fb::Plan &plan, std::ostream &os);

} // namespace hybrid
