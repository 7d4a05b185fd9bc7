// DSA — the lightning indexer of DeepSeek Sparse Attention (MODEL_SPEC §4.2), fp32 (no FP8 yet).
#pragma once

#include <cstdint>
#include <span>

namespace hybrid::kernels::ref {

// I[t, s] = Σ_j (w[t, j] · numHeads^−1/2) · ReLU(headDim^−1/2 · q[t, j]·k[s])  for s ≤
// queryPositions[t], −inf otherwise. q and k come with RoPE applied (half-split on their first
// ropeDim values) and k through the LayerNorm; w = weights_proj(x) raw.
struct IndexerParams {
  int64_t numQueries = 0;
  int64_t numKeys = 0;
  int64_t numHeads = 0;
  int64_t headDim = 0;
  const float *queries = nullptr;          // [numQueries, numHeads, headDim]
  const float *keys = nullptr;             // [numKeys, headDim]
  const float *headWeights = nullptr;      // [numQueries, numHeads]
  const int64_t *queryPositions = nullptr; // [numQueries]
  float *scores = nullptr;                 // [numQueries, numKeys]
};

void indexerScores(const IndexerParams &params);

// Per row of scores [numQueries, numKeys]: the positions of the topK largest finite scores, best
// first (ties: lower position first), padded with −1 when a row has fewer finite scores (early
// tokens: every causal position is selected). indices [numQueries, topK].
void topKIndices(std::span<const float> scores, int64_t numQueries, int64_t numKeys, int64_t topK,
                 std::span<int32_t> indices);

} // namespace hybrid::kernels::ref
