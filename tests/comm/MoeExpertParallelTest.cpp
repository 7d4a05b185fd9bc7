// Expert parallelism (ContextParallel.h: moeExpertParallel) over loopback ranks: every rank's
// routed-expert output equals ref::moeExperts with all experts on one rank, bit for bit, at world
// sizes 1, 2, 4 with uneven token counts, repeated experts across tokens, a -1 (no) choice and a
// rank with no tokens; bad shards are errors on the rank that passes them.
#include "hybrid/runtime/ContextParallel.h"

#include "RankThreads.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace hybrid::parallel {
namespace {

namespace ref = kernels::ref;
constexpr int64_t kExperts = 8, kHidden = 16, kIntermediate = 8, kTopK = 3;

struct Experts {
  std::vector<std::vector<float>> gate, up, down;
  std::vector<ref::SwiGluWeights> weights;
};

Experts makeExperts(std::mt19937 &rng) {
  std::normal_distribution<float> d(0.0f, 0.3f);
  Experts e;
  auto values = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float &x : v)
      x = d(rng);
    return v;
  };
  for (int64_t i = 0; i < kExperts; ++i) {
    e.gate.push_back(values(kIntermediate * kHidden));
    e.up.push_back(values(kIntermediate * kHidden));
    e.down.push_back(values(kHidden * kIntermediate));
  }
  for (int64_t i = 0; i < kExperts; ++i) {
    ref::SwiGluWeights w;
    w.gateProj = e.gate[size_t(i)];
    w.upProj = e.up[size_t(i)];
    w.downProj = e.down[size_t(i)];
    w.hiddenSize = kHidden;
    w.intermediateSize = kIntermediate;
    e.weights.push_back(w);
  }
  return e;
}

struct Tokens {
  int64_t count = 0;
  std::vector<float> x, weights;
  std::vector<int32_t> ids;
};

Tokens makeTokens(std::mt19937 &rng, int64_t count) {
  Tokens t;
  t.count = count;
  std::normal_distribution<float> d;
  std::uniform_real_distribution<float> w(0.1f, 1.0f);
  for (int64_t i = 0; i < count * kHidden; ++i)
    t.x.push_back(d(rng));
  for (int64_t i = 0; i < count; ++i) {
    std::vector<int32_t> experts(static_cast<size_t>(kExperts));
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int64_t k = 0; k < kTopK; ++k) {
      t.ids.push_back(i == 1 && k == 2 ? -1 : experts[size_t(k)]); // one token chose only two
      t.weights.push_back(w(rng));
    }
  }
  return t;
}

// A shard of `t`'s tokens holding `local` experts, writing into `out`.
ExpertParallelShard shardOf(const Tokens &t, std::span<const ref::SwiGluWeights> local,
                            std::vector<float> &out) {
  out.assign(size_t(t.count * kHidden), NAN);
  ExpertParallelShard shard;
  shard.tokens = t.count;
  shard.hidden = kHidden;
  shard.topK = kTopK;
  shard.numExperts = kExperts;
  shard.x = t.x.data();
  shard.expertIds = t.ids.data();
  shard.expertWeights = t.weights.data();
  shard.localExperts = local;
  shard.out = out.data();
  return shard;
}

class MoeExpertParallelRanks : public testing::TestWithParam<int> {};

TEST_P(MoeExpertParallelRanks, EqualsOneRankWithEveryExpert) {
  const int world = GetParam();
  std::mt19937 rng(3);
  const Experts experts = makeExperts(rng);
  std::vector<Tokens> tokens;
  for (int r = 0; r < world; ++r)
    tokens.push_back(makeTokens(rng, r == 1 ? 0 : 5 + 4 * r)); // rank 1 (if any): no tokens

  std::vector<std::vector<float>> outs(static_cast<size_t>(world));
  const int64_t perRank = kExperts / world;
  const auto statuses = comm::rankthreads::onEveryRank(world, [&](int r, comm::Communicator &comm) {
      const std::span<const ref::SwiGluWeights> local(experts.weights.data() + r * perRank,
                                                      size_t(perRank));
      return moeExpertParallel(comm, shardOf(tokens[size_t(r)], local, outs[size_t(r)]));
    });
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(statuses[size_t(r)]) << statuses[size_t(r)].message();
    const Tokens &t = tokens[size_t(r)];
    std::vector<float> expected(size_t(t.count * kHidden));
    ref::moeExperts(t.x, t.count, kHidden, t.ids, t.weights, kTopK, experts.weights, {}, expected);
    EXPECT_EQ(outs[size_t(r)], expected) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, MoeExpertParallelRanks, testing::Values(1, 2, 4));

TEST(MoeExpertParallel, BadShardsAreErrors) {
  std::mt19937 rng(1);
  const Experts experts = makeExperts(rng);
  Tokens t = makeTokens(rng, 2);
  auto group = comm::makeLoopbackGroup(1);
  ASSERT_TRUE(group);
  std::vector<float> out;
  ExpertParallelShard shard =
      shardOf(t, std::span<const ref::SwiGluWeights>(experts.weights.data(), 3), out);
  Status wrongCount = moeExpertParallel(*(*group)[0], shard);
  ASSERT_FALSE(wrongCount);
  EXPECT_NE(wrongCount.message().find("holds 3 experts, not 8"), std::string::npos)
      << wrongCount.message();
  shard.localExperts = experts.weights;
  t.ids[0] = 9;
  Status outside = moeExpertParallel(*(*group)[0], shard);
  ASSERT_FALSE(outside);
  EXPECT_NE(outside.message().find("chose expert 9 of 8"), std::string::npos) << outside.message();
  auto three = comm::makeLoopbackGroup(3);
  ASSERT_TRUE(three);
  t.ids[0] = 0;
  Status uneven = moeExpertParallel(*(*three)[0], shard); // checked before any collective
  ASSERT_FALSE(uneven);
  EXPECT_NE(uneven.message().find("do not split evenly over 3 ranks"), std::string::npos)
      << uneven.message();
}

} // namespace
} // namespace hybrid::parallel
