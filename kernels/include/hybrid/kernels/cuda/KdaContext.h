// Context parallelism's KDA pieces on CUDA (docs/parallelism.md, MODEL_SPEC's KDA section): a
// token's update is affine in the state, S' = A_t S + b_t, so a segment of tokens is summarized
// alone as (M, B) = (A_last ... A_first, its final state from zero) (ref::kdaSegmentSummary), and
// the state before a segment is the earlier summaries composed onto the state before the first
// (ref::kdaApplySummary). CUDA-free header.
#pragma once

#include "hybrid/kernels/cuda/KdaPrefill.h"

#include <cstddef>
#include <cstdint>

namespace hybrid::kernels::cuda {

// Summaries of a varlen batch of segments (KdaLayerCall's rows: the segments' tokens, packed).
// Each segment's conv history is its own ([sequences, 3, W - 1, heads * headDim] in convState,
// read only), its state is not read. Segment s's summary is written to summaries + s *
// summaryStride: M [heads, K, K], then B [heads, K, V] (K = V = headDim); an empty segment gets
// (I, 0). The same prefill kernels compute both (the prefill's math, so the summary composes
// exactly as the prefill would run): B from a zero state, M as the recurrence with v = 0 from
// S = I. `state`, `stateType` and `out` of the base are ignored.
struct KdaSegmentSummaryParams : KdaLayerCall {
  int32_t sequences = 0;
  const int32_t *cuSeqlens = nullptr; // device [sequences + 1]
  int32_t tokens = 0;                 // cuSeqlens[sequences], as the host knows it
  float *summaries = nullptr;
  int64_t summaryStride = 0; // floats between segments' summaries, at least 2 heads K K
  void *workspace = nullptr; // kdaSegmentSummaryWorkspaceBytes, 256-byte aligned
  KdaPrefillPath path = KdaPrefillPath::Auto;
};
size_t kdaSegmentSummaryWorkspaceBytes(const KdaSegmentSummaryParams &params);
// 0 or a CUDA error code; bad shapes, a short stride or a missing workspace give
// cudaErrorInvalidValue (1).
int launchKdaSegmentSummary(const KdaSegmentSummaryParams &params, void *stream);

// The state after the first `count` summaries: S = stateBefore; for s < count: S = M_s S + B_s,
// written to stateAfter in its type. Summaries as KdaSegmentSummaryParams lays them out. fp32
// arithmetic whatever the storage types. stateAfter may be stateBefore (same type): each element
// is read once, by the thread that writes it.
struct KdaComposeParams {
  int32_t heads = 0;
  int32_t headDim = 0; // K = V, at most 128
  int32_t count = 0;
  const float *summaries = nullptr;
  int64_t summaryStride = 0;
  const void *stateBefore = nullptr; // [heads, K, V]
  KdaStateType beforeType = KdaStateType::F32;
  void *stateAfter = nullptr; // [heads, K, V]
  KdaStateType afterType = KdaStateType::F32;
};
int launchKdaComposeSummaries(const KdaComposeParams &params, void *stream);

} // namespace hybrid::kernels::cuda
