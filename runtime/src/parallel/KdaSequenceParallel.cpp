#include "hybrid/runtime/ContextParallel.h"

#include <vector>

namespace hybrid::parallel {

namespace ref = kernels::ref;

Status kdaSequenceParallel(comm::Communicator &communicator, const ref::KdaParams &segment) {
  const int64_t H = segment.numHeads, K = segment.keyDim, V = segment.valueDim;
  if (H <= 0 || K <= 0 || V <= 0 || segment.numTokens < 0 || !segment.state ||
      (segment.numTokens > 0 && (!segment.q || !segment.k || !segment.v || !segment.g ||
                                 !segment.beta || !segment.out)))
    return Status::error("KDA sequence parallel: rank " + std::to_string(communicator.rank()) +
                         " passed an incomplete segment (" + std::to_string(segment.numTokens) +
                         " tokens, " + std::to_string(H) + " heads, " + std::to_string(K) + "x" +
                         std::to_string(V) + ")");
  // This segment's summary [M | B]; the all-gather checks that every rank's has the same size.
  const size_t transitionFloats = size_t(H * K * K), summaryFloats = transitionFloats + size_t(H * K * V);
  std::vector<float> mine(summaryFloats);
  ref::kdaSegmentSummary(segment, mine.data(), mine.data() + transitionFloats);
  const int world = communicator.worldSize();
  std::vector<float> all(summaryFloats * size_t(world));
  HYBRID_RETURN_IF_ERROR(communicator.allGather(mine.data(), all.data(), summaryFloats));

  // The state before each segment, composed in rank order from the sequence's initial state.
  std::vector<float> state(segment.state, segment.state + H * K * V), next(state.size());
  std::vector<float> initial;
  for (int r = 0; r < world; ++r) {
    if (r == communicator.rank())
      initial = state;
    const float *summary = all.data() + size_t(r) * summaryFloats;
    ref::kdaApplySummary(H, K, V, summary, summary + transitionFloats, state.data(), next.data());
    state.swap(next);
  }
  ref::KdaParams own = segment;
  own.state = initial.data();
  if (own.numTokens > 0)
    ref::kdaRecurrent(own);
  std::copy(state.begin(), state.end(), segment.state); // after the last segment, on every rank
  return Status::ok();
}

} // namespace hybrid::parallel
