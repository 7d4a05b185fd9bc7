// Context parallelism's KDA half (issue 10): sequence-parallel prefill of one KDA layer across the
// ranks of a communicator. The recurrence is affine in the state (MODEL_SPEC's KDA section;
// ref::kdaSegmentScan), so each rank summarizes its own segment of the sequence as (M, B) from
// its tokens alone, an all-gather hands every rank every summary, each rank composes the
// summaries of the segments before its own into its true initial state, and then computes its
// outputs. The ranks' segments are contiguous and in rank order.
#pragma once

#include "hybrid/kernels/ref/Kda.h"
#include "hybrid/kernels/ref/Moe.h"
#include "hybrid/runtime/Communicator.h"
#include "hybrid/runtime/Status.h"

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace hybrid::parallel {

// `segment` holds this rank's tokens (q, k, v, g, beta and out for its range; numTokens may be
// 0); every rank passes the same heads and dims, and in `segment.state` the sequence's state
// before its first token (zero for a fresh prompt). On return `out` holds this rank's outputs
// and `state` the sequence's state after its last token, the same bits on every rank. Host
// buffers (the cpu device; the loopback backend).
Status kdaSequenceParallel(comm::Communicator &communicator,
                           const kernels::ref::KdaParams &segment);

// ---- Zigzag context parallelism for causal DSA prefill.
//
// A sequence of T tokens is cut into 2N chunks (chunk c: tokens [T c / 2N, T (c + 1) / 2N)); rank
// i takes chunks i and 2N - 1 - i, so an early (cheap) and a late (expensive) chunk pair up and
// every rank scores about the same number of causal (query, key) pairs.

// The global positions rank `rank` of `worldSize` holds, ascending: its two chunks.
std::vector<int64_t> zigzagPositions(int64_t tokens, int rank, int worldSize);
// Causal pairs the indexer scores for those positions: sum of (position + 1).
int64_t zigzagIndexerWork(int64_t tokens, int rank, int worldSize);

// One rank's share of a DSA layer's attention core (MODEL_SPEC 4): its tokens' index queries,
// head weights and absorbed attention queries, and the index keys, latents and rope keys its
// tokens wrote, all in zigzagPositions order.
struct ZigzagDsaShard {
  int64_t tokens = 0;          // the sequence's length
  int64_t indexHeads = 0, indexDim = 0, topK = 0;
  int64_t heads = 0, latentDim = 0, ropeDim = 0;
  float softmaxScale = 0.0f;
  const float *indexQueries = nullptr; // [own, indexHeads, indexDim]
  const float *headWeights = nullptr;  // [own, indexHeads]
  const float *indexKeys = nullptr;    // [own, indexDim]
  const float *queries = nullptr;      // [own, heads, latentDim + ropeDim], absorbed
  const float *latents = nullptr;      // [own, latentDim]
  const float *ropeKeys = nullptr;     // [own, ropeDim]
  float *out = nullptr;                // [own, heads, latentDim]: o^ of its tokens
  int32_t *selected = nullptr;         // [own, topK]: the indexer's positions (may be null)
};

// All-gathers the keys, latents and rope keys (padded to the longest shard), restores sequence
// order, then runs the indexer and the sparse latent attention for this rank's tokens against the
// whole sequence: the rows a single rank computes for those positions, bit for bit.
Status dsaZigzagPrefill(comm::Communicator &communicator, const ZigzagDsaShard &shard);

// ---- Expert parallelism for the routed experts of an MoE layer.
//
// The experts are split evenly over the ranks (rank r holds experts [r E / N, (r + 1) E / N));
// every rank routes its own tokens (the router is replicated), sends each (token, choice) row to
// the rank holding its expert (an all-to-all, padded to the largest count, after an all-gather of
// the counts), runs the experts it holds on what it received, returns the results (a second
// all-to-all) and combines its tokens' weighted expert outputs in ascending expert order, as
// ref::moeExperts does: the same bits as one rank holding every expert.
struct ExpertParallelShard {
  int64_t tokens = 0;     // this rank's tokens
  int64_t hidden = 0;
  int64_t topK = 0;
  int64_t numExperts = 0; // all ranks' together: a multiple of the world size
  const float *x = nullptr;              // [tokens, hidden]
  const int32_t *expertIds = nullptr;    // [tokens, topK], global ids
  const float *expertWeights = nullptr;  // [tokens, topK]
  std::span<const kernels::ref::SwiGluWeights> localExperts; // this rank's numExperts / N
  float *out = nullptr;                  // [tokens, hidden]: the routed experts' sum
};
Status moeExpertParallel(comm::Communicator &communicator, const ExpertParallelShard &shard);

// Experts over the context ranks (cp=N,ep=N): context rank `rank` of `world` holds experts
// [rank E / N, (rank + 1) E / N) and no other. An error when the experts do not split over the
// ranks, or naming the first expert whose weights (`held(e)`: present in the dispatch) disagree;
// both devices check their dispatch with it.
Status checkExpertsOfContextRank(int64_t numExperts, int rank, int world,
                                 const std::function<bool(int64_t)> &held);

// ---- Tensor parallelism for a dense SwiGLU MLP (the pattern TP uses for every projection pair).
//
// Rank r of N holds rows [r I / N, (r + 1) I / N) of gate and up (column-parallel: its slice of
// the intermediate activations needs no communication) and the same columns of down (row-
// parallel: its product is a partial sum), so one all-reduce gives every rank the whole output.
// `slice` is this rank's: gate/up [I_r, hidden], down [hidden, I_r]. Sums differ from one rank's
// in rounding only (the intermediate dimension is added in N pieces).
Status mlpTensorParallel(comm::Communicator &communicator, std::span<const float> x,
                         int64_t tokens, const kernels::ref::SwiGluWeights &slice,
                         std::span<float> out);
// The rows of an intermediate dimension of `size` rank `rank` of `worldSize` holds.
struct RowRange {
  int64_t begin = 0, end = 0;
};
RowRange tensorParallelRows(int64_t size, int rank, int worldSize);

} // namespace hybrid::parallel
