// A summary of a compiled plan: per program the steps, fused kernels, streams, events and arena
// size; the weight bytes per dtype; the cache sizes. Printed by `hybrid-compile --report`.
#pragma once

#include "runtime/schema/plan_generated.h"

#include <ostream>
#include <string>

namespace hybrid {

void printPlanReport(const plan::fb::Plan &plan, std::ostream &os);

// "1.5 MiB": a byte count with a binary unit and one decimal.
std::string formatBytes(double count);

} // namespace hybrid
