// Context parallelism's KDA half (issue 10): sequence-parallel prefill of one KDA layer across the
// ranks of a communicator. The recurrence is affine in the state (MODEL_SPEC's KDA section;
// ref::kdaSegmentScan), so each rank summarizes its own segment of the sequence as (M, B) from
// its tokens alone, an all-gather hands every rank every summary, each rank composes the
// summaries of the segments before its own into its true initial state, and then computes its
// outputs. The ranks' segments are contiguous and in rank order.
#pragma once

#include "hybrid/kernels/ref/Kda.h"
#include "hybrid/runtime/Communicator.h"
#include "hybrid/runtime/Status.h"

namespace hybrid::parallel {

// `segment` holds this rank's tokens (q, k, v, g, beta and out for its range; numTokens may be
// 0); every rank passes the same heads and dims, and in `segment.state` the sequence's state
// before its first token (zero for a fresh prompt). On return `out` holds this rank's outputs
// and `state` the sequence's state after its last token, the same bits on every rank. Host
// buffers (the cpu device; the loopback backend).
Status kdaSequenceParallel(comm::Communicator &communicator,
                           const kernels::ref::KdaParams &segment);

} // namespace hybrid::parallel
