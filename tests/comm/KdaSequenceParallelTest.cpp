// Sequence-parallel KDA prefill (ContextParallel.h) over loopback ranks against the token-by-token
// recurrence on one rank: every rank's outputs and the final state agree within fp32 rounding, at
// world sizes 1-4, with a non-zero initial state (a prefix-cache hit), ranks without tokens, and
// the same bits on every run; an incomplete segment is an error on every rank.
#include "hybrid/runtime/ContextParallel.h"

#include "hybrid/kernels/ref/Kda.h"
#include "hybrid/kernels/ref/Norm.h"

#include "RankThreads.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace hybrid::parallel {
namespace {

namespace ref = kernels::ref;
constexpr int64_t kHeads = 2, kKeyDim = 32, kValueDim = 16; // K != V catches transposed indexing

struct Sequence {
  int64_t tokens;
  std::vector<float> q, k, v, g, beta, state;
};

std::vector<float> normal(std::mt19937 &rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float &x : v)
    x = d(rng);
  return v;
}

Sequence makeSequence(int64_t T, uint32_t seed) {
  std::mt19937 rng(seed);
  Sequence s{T, normal(rng, size_t(T * kHeads * kKeyDim)), normal(rng, size_t(T * kHeads * kKeyDim)),
             normal(rng, size_t(T * kHeads * kValueDim)), {}, {},
             normal(rng, size_t(kHeads * kKeyDim * kValueDim), 0.1f)};
  ref::l2NormalizeRows(s.q, T * kHeads, kKeyDim);
  ref::l2NormalizeRows(s.k, T * kHeads, kKeyDim);
  std::uniform_real_distribution<float> decay(-0.5f, -0.001f), beta(0.05f, 0.95f);
  for (size_t i = 0; i < size_t(T * kHeads * kKeyDim); ++i)
    s.g.push_back(decay(rng)); // log-decays: long and short memory
  for (size_t i = 0; i < size_t(T * kHeads); ++i)
    s.beta.push_back(beta(rng));
  return s;
}

ref::KdaParams paramsFor(Sequence &s, int64_t begin, int64_t end, float *state, float *out) {
  ref::KdaParams p;
  p.numTokens = end - begin;
  p.numHeads = kHeads;
  p.keyDim = kKeyDim;
  p.valueDim = kValueDim;
  p.q = s.q.data() + begin * kHeads * kKeyDim;
  p.k = s.k.data() + begin * kHeads * kKeyDim;
  p.v = s.v.data() + begin * kHeads * kValueDim;
  p.g = s.g.data() + begin * kHeads * kKeyDim;
  p.beta = s.beta.data() + begin * kHeads;
  p.state = state;
  p.out = out + begin * kHeads * kValueDim;
  return p;
}

// Runs the sequence split over `world` loopback ranks; returns the outputs of all tokens (each
// from its rank) and every rank's final state.
void runParallel(Sequence &s, int world, std::vector<float> &out,
                 std::vector<std::vector<float>> &states) {
  out.assign(size_t(s.tokens * kHeads * kValueDim), NAN);
  states.assign(size_t(world), s.state);
  const auto statuses = comm::rankthreads::onEveryRank(world, [&](int r, comm::Communicator &c) {
    const int64_t begin = s.tokens * r / world, end = s.tokens * (r + 1) / world;
    return kdaSequenceParallel(c, paramsFor(s, begin, end, states[size_t(r)].data(), out.data()));
  });
  for (const Status &st : statuses)
    ASSERT_TRUE(st) << st.message();
}

float maxAbsDiff(const std::vector<float> &a, const std::vector<float> &b) {
  float worst = 0.0f;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}

class KdaSequenceParallelRanks : public testing::TestWithParam<int> {};

TEST_P(KdaSequenceParallelRanks, EqualsTheRecurrenceOnOneRank) {
  const int world = GetParam();
  for (int64_t T : {int64_t(97), int64_t(3)}) { // 3 tokens over 4 ranks: a rank without tokens
    Sequence s = makeSequence(T, 5 + uint32_t(T));
    std::vector<float> expectedOut(size_t(T * kHeads * kValueDim)), expectedState = s.state;
    ref::kdaRecurrent(paramsFor(s, 0, T, expectedState.data(), expectedOut.data()));

    std::vector<float> out;
    std::vector<std::vector<float>> states;
    runParallel(s, world, out, states);
    EXPECT_LT(maxAbsDiff(out, expectedOut), 2e-5f) << "world " << world << ", " << T << " tokens";
    for (int r = 0; r < world; ++r) {
      EXPECT_LT(maxAbsDiff(states[size_t(r)], expectedState), 2e-5f) << "rank " << r;
      EXPECT_EQ(states[size_t(r)], states[0]) << "every rank ends with the same state";
    }
    // And again: the same bits.
    std::vector<float> again;
    std::vector<std::vector<float>> againStates;
    runParallel(s, world, again, againStates);
    EXPECT_EQ(again, out);
    EXPECT_EQ(againStates, states);
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, KdaSequenceParallelRanks, testing::Values(1, 2, 3, 4));

TEST(KdaSequenceParallel, AnIncompleteSegmentIsAnError) {
  auto group = comm::makeLoopbackGroup(1);
  ASSERT_TRUE(group);
  ref::KdaParams p; // no dims, no buffers
  const Status missing = kdaSequenceParallel(*(*group)[0], p);
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.message().find("incomplete segment"), std::string::npos) << missing.message();
}

} // namespace
} // namespace hybrid::parallel
