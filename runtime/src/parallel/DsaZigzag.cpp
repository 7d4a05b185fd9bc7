#include "hybrid/runtime/ContextParallel.h"

#include "hybrid/kernels/ref/Dsa.h"
#include "hybrid/kernels/ref/Mla.h"

#include <algorithm>

namespace hybrid::parallel {

namespace ref = kernels::ref;

std::vector<int64_t> zigzagPositions(int64_t tokens, int rank, int worldSize) {
  std::vector<int64_t> positions;
  if (tokens <= 0 || worldSize <= 0 || rank < 0 || rank >= worldSize)
    return positions;
  const int64_t chunks = 2 * int64_t(worldSize);
  auto chunkBegin = [&](int64_t c) { return tokens * c / chunks; };
  for (int64_t chunk : {int64_t(rank), chunks - 1 - rank})
    for (int64_t p = chunkBegin(chunk); p < chunkBegin(chunk + 1); ++p)
      positions.push_back(p);
  return positions;
}

int64_t zigzagIndexerWork(int64_t tokens, int rank, int worldSize) {
  int64_t work = 0;
  for (int64_t position : zigzagPositions(tokens, rank, worldSize))
    work += position + 1;
  return work;
}

Status dsaZigzagPrefill(comm::Communicator &communicator, const ZigzagDsaShard &s) {
  const int world = communicator.worldSize(), rank = communicator.rank();
  const std::vector<int64_t> own = zigzagPositions(s.tokens, rank, world);
  const int64_t n = int64_t(own.size());
  if (s.tokens <= 0 || s.indexHeads <= 0 || s.indexDim <= 0 || s.topK <= 0 || s.heads <= 0 ||
      s.latentDim <= 0 || s.ropeDim < 0 ||
      (n > 0 && (!s.indexQueries || !s.headWeights || !s.indexKeys || !s.queries || !s.latents ||
                 (s.ropeDim > 0 && !s.ropeKeys) || !s.out)))
    return Status::error("DSA zigzag prefill: rank " + std::to_string(rank) +
                         " passed an incomplete shard (" + std::to_string(n) + " of " +
                         std::to_string(s.tokens) + " tokens)");
  // Each rank's keys, latents and rope keys in one row per token, padded to the longest shard.
  int64_t longest = 0;
  for (int r = 0; r < world; ++r)
    longest = std::max<int64_t>(longest, int64_t(zigzagPositions(s.tokens, r, world).size()));
  const int64_t row = s.indexDim + s.latentDim + s.ropeDim;
  std::vector<float> mine(size_t(longest * row), 0.0f), all(size_t(world) * mine.size());
  for (int64_t i = 0; i < n; ++i) {
    float *to = mine.data() + i * row;
    std::copy_n(s.indexKeys + i * s.indexDim, s.indexDim, to);
    std::copy_n(s.latents + i * s.latentDim, s.latentDim, to + s.indexDim);
    std::copy_n(s.ropeKeys + i * s.ropeDim, s.ropeDim, to + s.indexDim + s.latentDim);
  }
  HYBRID_RETURN_IF_ERROR(communicator.allGather(mine.data(), all.data(), mine.size()));

  // The whole sequence's keys in position order.
  std::vector<float> keys(size_t(s.tokens * s.indexDim)), latents(size_t(s.tokens * s.latentDim)),
      ropeKeys(size_t(s.tokens * s.ropeDim));
  for (int r = 0; r < world; ++r) {
    const std::vector<int64_t> positions = zigzagPositions(s.tokens, r, world);
    for (size_t i = 0; i < positions.size(); ++i) {
      const float *from = all.data() + (size_t(r) * size_t(longest) + i) * size_t(row);
      const int64_t p = positions[i];
      std::copy_n(from, s.indexDim, keys.data() + p * s.indexDim);
      std::copy_n(from + s.indexDim, s.latentDim, latents.data() + p * s.latentDim);
      std::copy_n(from + s.indexDim + s.latentDim, s.ropeDim, ropeKeys.data() + p * s.ropeDim);
    }
  }
  if (n == 0)
    return Status::ok();

  // This rank's queries against every earlier position: indexer, top-k, sparse attention.
  std::vector<float> scores(size_t(n * s.tokens));
  ref::IndexerParams indexer;
  indexer.numQueries = n;
  indexer.numKeys = s.tokens;
  indexer.numHeads = s.indexHeads;
  indexer.headDim = s.indexDim;
  indexer.queries = s.indexQueries;
  indexer.keys = keys.data();
  indexer.headWeights = s.headWeights;
  indexer.queryPositions = own.data();
  indexer.scores = scores.data();
  ref::indexerScores(indexer);
  std::vector<int32_t> selected(size_t(n * s.topK));
  ref::topKIndices(scores, n, s.tokens, s.topK, selected);
  if (s.selected)
    std::copy(selected.begin(), selected.end(), s.selected);

  ref::LatentAttentionParams attention;
  attention.numQueries = n;
  attention.numKeys = s.tokens;
  attention.numHeads = s.heads;
  attention.latentDim = s.latentDim;
  attention.ropeDim = s.ropeDim;
  attention.softmaxScale = s.softmaxScale;
  attention.queries = s.queries;
  attention.queryPositions = own.data();
  attention.latents = latents.data();
  attention.ropeKeys = ropeKeys.data();
  attention.sparseIndices = selected.data();
  attention.topK = s.topK;
  attention.out = s.out;
  ref::latentAttention(attention);
  return Status::ok();
}

} // namespace hybrid::parallel
