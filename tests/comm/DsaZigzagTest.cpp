// Zigzag context parallelism for DSA prefill (ContextParallel.h) over loopback ranks: each rank's
// attention rows and indexer selections equal a single rank's for the same positions bit for bit
// (world sizes 1-4, lengths not divisible by 2N), every position is owned once, and the indexer's
// causal work per rank is within 5% of the mean (counted, the criterion).
#include "hybrid/runtime/ContextParallel.h"

#include "hybrid/kernels/ref/Dsa.h"
#include "hybrid/kernels/ref/Mla.h"

#include "RankThreads.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace hybrid::parallel {
namespace {

namespace ref = kernels::ref;
constexpr int64_t kIndexHeads = 4, kIndexDim = 32, kTopK = 24, kHeads = 2, kLatent = 16,
                  kRope = 8;

struct Layer {
  int64_t tokens;
  std::vector<float> indexQueries, headWeights, indexKeys, queries, latents, ropeKeys;
};

Layer makeLayer(int64_t T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  auto values = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float &x : v)
      x = d(rng);
    return v;
  };
  return {T,
          values(T * kIndexHeads * kIndexDim),
          values(T * kIndexHeads),
          values(T * kIndexDim),
          values(T * kHeads * (kLatent + kRope)),
          values(T * kLatent),
          values(T * kRope)};
}

// Rows `positions` of a [T, width] tensor.
std::vector<float> rows(const std::vector<float> &all, const std::vector<int64_t> &positions,
                        int64_t width) {
  std::vector<float> out;
  for (int64_t p : positions)
    out.insert(out.end(), all.begin() + p * width, all.begin() + (p + 1) * width);
  return out;
}

TEST(Zigzag, EveryPositionOnceAndBalancedWork) {
  for (int world : {1, 2, 4, 8})
    for (int64_t T : {int64_t(1), int64_t(37), int64_t(4096), int64_t(131072)}) {
      std::vector<int64_t> owned;
      int64_t total = 0;
      for (int r = 0; r < world; ++r) {
        const auto positions = zigzagPositions(T, r, world);
        EXPECT_TRUE(std::is_sorted(positions.begin(), positions.end()));
        owned.insert(owned.end(), positions.begin(), positions.end());
        total += zigzagIndexerWork(T, r, world);
      }
      std::sort(owned.begin(), owned.end());
      std::vector<int64_t> expected(static_cast<size_t>(T));
      std::iota(expected.begin(), expected.end(), 0);
      ASSERT_EQ(owned, expected) << "world " << world << ", " << T << " tokens";
      EXPECT_EQ(total, T * (T + 1) / 2);
      if (T >= 4096) // the criterion: within 5% of the mean
        for (int r = 0; r < world; ++r) {
          const double mean = double(total) / world;
          EXPECT_LE(std::fabs(zigzagIndexerWork(T, r, world) - mean), 0.05 * mean)
              << "rank " << r << " of " << world << ", " << T << " tokens";
        }
    }
  // What zigzag avoids: contiguous quarters of 4096 tokens give the last rank 7x the first's work.
  auto contiguous = [](int64_t begin, int64_t end) { return (end * (end + 1) - begin * (begin + 1)) / 2; };
  EXPECT_GT(double(contiguous(3072, 4096)) / double(contiguous(0, 1024)), 6.9);
  EXPECT_LT(double(zigzagIndexerWork(4096, 3, 4)) / double(zigzagIndexerWork(4096, 0, 4)), 1.01);
}

class DsaZigzagRanks : public testing::TestWithParam<int> {};

TEST_P(DsaZigzagRanks, RowsEqualASingleRanksBitForBit) {
  const int world = GetParam();
  const int64_t T = 203; // not a multiple of 2N: uneven chunks, padded all-gather
  Layer layer = makeLayer(T, 11);

  // One rank over the whole sequence, straight from the reference.
  std::vector<int64_t> positions(static_cast<size_t>(T));
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<float> scores(static_cast<size_t>(T * T));
  ref::IndexerParams indexer;
  indexer.numQueries = T;
  indexer.numKeys = T;
  indexer.numHeads = kIndexHeads;
  indexer.headDim = kIndexDim;
  indexer.queries = layer.indexQueries.data();
  indexer.keys = layer.indexKeys.data();
  indexer.headWeights = layer.headWeights.data();
  indexer.queryPositions = positions.data();
  indexer.scores = scores.data();
  ref::indexerScores(indexer);
  std::vector<int32_t> selected(static_cast<size_t>(T * kTopK));
  ref::topKIndices(scores, T, T, kTopK, selected);
  std::vector<float> expected(static_cast<size_t>(T * kHeads * kLatent));
  ref::LatentAttentionParams attention;
  attention.numQueries = T;
  attention.numKeys = T;
  attention.numHeads = kHeads;
  attention.latentDim = kLatent;
  attention.ropeDim = kRope;
  attention.softmaxScale = 0.25f;
  attention.queries = layer.queries.data();
  attention.queryPositions = positions.data();
  attention.latents = layer.latents.data();
  attention.ropeKeys = layer.ropeKeys.data();
  attention.sparseIndices = selected.data();
  attention.topK = kTopK;
  attention.out = expected.data();
  ref::latentAttention(attention);

  std::vector<std::vector<float>> outs(static_cast<size_t>(world));
  std::vector<std::vector<int32_t>> picks(static_cast<size_t>(world));
  const auto statuses = comm::rankthreads::onEveryRank(world, [&](int r, comm::Communicator &comm) {
      const auto own = zigzagPositions(T, r, world);
      const auto iq = rows(layer.indexQueries, own, kIndexHeads * kIndexDim);
      const auto hw = rows(layer.headWeights, own, kIndexHeads);
      const auto ik = rows(layer.indexKeys, own, kIndexDim);
      const auto q = rows(layer.queries, own, kHeads * (kLatent + kRope));
      const auto c = rows(layer.latents, own, kLatent);
      const auto kr = rows(layer.ropeKeys, own, kRope);
      outs[size_t(r)].assign(own.size() * kHeads * kLatent, NAN);
      picks[size_t(r)].assign(own.size() * kTopK, -7);
      ZigzagDsaShard shard;
      shard.tokens = T;
      shard.indexHeads = kIndexHeads;
      shard.indexDim = kIndexDim;
      shard.topK = kTopK;
      shard.heads = kHeads;
      shard.latentDim = kLatent;
      shard.ropeDim = kRope;
      shard.softmaxScale = 0.25f;
      shard.indexQueries = iq.data();
      shard.headWeights = hw.data();
      shard.indexKeys = ik.data();
      shard.queries = q.data();
      shard.latents = c.data();
      shard.ropeKeys = kr.data();
      shard.out = outs[size_t(r)].data();
      shard.selected = picks[size_t(r)].data();
      return dsaZigzagPrefill(comm, shard);
    });
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(statuses[size_t(r)]) << statuses[size_t(r)].message();
    const auto own = zigzagPositions(T, r, world);
    EXPECT_EQ(outs[size_t(r)], rows(expected, own, kHeads * kLatent)) << "rank " << r;
    std::vector<int32_t> expectedPicks;
    for (int64_t p : own)
      expectedPicks.insert(expectedPicks.end(), selected.begin() + p * kTopK,
                           selected.begin() + (p + 1) * kTopK);
    EXPECT_EQ(picks[size_t(r)], expectedPicks) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, DsaZigzagRanks, testing::Values(1, 2, 3, 4));

TEST(DsaZigzag, AnIncompleteShardIsAnError) {
  auto group = comm::makeLoopbackGroup(1);
  ASSERT_TRUE(group);
  ZigzagDsaShard shard;
  shard.tokens = 8; // no dims, no buffers
  const Status missing = dsaZigzagPrefill(*(*group)[0], shard);
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.message().find("incomplete shard"), std::string::npos) << missing.message();
}

} // namespace
} // namespace hybrid::parallel
