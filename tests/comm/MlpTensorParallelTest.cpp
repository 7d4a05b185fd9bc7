// Tensor-parallel SwiGLU MLP (ContextParallel.h: mlpTensorParallel) over loopback ranks: with gate
// and up split by rows and down by the same columns, every rank's output equals one rank's full
// MLP within fp32 rounding (world sizes 1-4, an intermediate size that does not divide evenly),
// the same bits on every rank; a slice that does not fit is an error naming the rank.
#include "hybrid/runtime/ContextParallel.h"

#include "RankThreads.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace hybrid::parallel {
namespace {

namespace ref = kernels::ref;
constexpr int64_t kHidden = 16, kIntermediate = 22, kTokens = 5;

std::vector<float> normal(std::mt19937 &rng, int64_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float &x : v)
    x = d(rng);
  return v;
}

class MlpTensorParallelRanks : public testing::TestWithParam<int> {};

TEST_P(MlpTensorParallelRanks, EqualsTheFullMlp) {
  const int world = GetParam();
  std::mt19937 rng(9);
  const auto gate = normal(rng, kIntermediate * kHidden, 0.3f);
  const auto up = normal(rng, kIntermediate * kHidden, 0.3f);
  const auto down = normal(rng, kHidden * kIntermediate, 0.3f);
  const auto x = normal(rng, kTokens * kHidden, 1.0f);
  ref::SwiGluWeights full{gate, up, down, kHidden, kIntermediate, std::nullopt};
  std::vector<float> expected(static_cast<size_t>(kTokens * kHidden));
  ref::swiGluMlp(x, kTokens, full, expected);

  // Each rank's slices: gate/up rows, down columns [begin, end).
  std::vector<std::vector<float>> gates, ups, downs;
  for (int r = 0; r < world; ++r) {
    const RowRange rows = tensorParallelRows(kIntermediate, r, world);
    gates.emplace_back(gate.begin() + rows.begin * kHidden, gate.begin() + rows.end * kHidden);
    ups.emplace_back(up.begin() + rows.begin * kHidden, up.begin() + rows.end * kHidden);
    std::vector<float> columns;
    for (int64_t h = 0; h < kHidden; ++h)
      columns.insert(columns.end(), down.begin() + h * kIntermediate + rows.begin,
                     down.begin() + h * kIntermediate + rows.end);
    downs.push_back(std::move(columns));
  }
  std::vector<std::vector<float>> outs(static_cast<size_t>(world),
                                       std::vector<float>(expected.size(), NAN));
  const auto statuses = comm::rankthreads::onEveryRank(world, [&](int r, comm::Communicator &c) {
    const RowRange rows = tensorParallelRows(kIntermediate, r, world);
    const ref::SwiGluWeights slice{gates[size_t(r)], ups[size_t(r)], downs[size_t(r)], kHidden,
                                   rows.end - rows.begin, std::nullopt};
    return mlpTensorParallel(c, x, kTokens, slice, outs[size_t(r)]);
  });
  for (const Status &s : statuses)
    ASSERT_TRUE(s) << s.message();
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(outs[size_t(r)], outs[0]) << "rank " << r;
    for (size_t i = 0; i < expected.size(); ++i)
      ASSERT_NEAR(outs[size_t(r)][i], expected[i], 1e-5f * (1.0f + std::fabs(expected[i])))
          << "rank " << r << " element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, MlpTensorParallelRanks, testing::Values(1, 2, 3, 4));

TEST(MlpTensorParallel, RowsCoverTheDimensionOnce) {
  int64_t covered = 0;
  for (int r = 0; r < 3; ++r) {
    const RowRange rows = tensorParallelRows(22, r, 3);
    EXPECT_EQ(rows.begin, covered);
    covered = rows.end;
  }
  EXPECT_EQ(covered, 22);
  EXPECT_EQ(tensorParallelRows(22, 3, 3).end, 0); // outside the world: empty
}

TEST(MlpTensorParallel, ASliceThatDoesNotFitIsAnError) {
  auto group = comm::makeLoopbackGroup(1);
  ASSERT_TRUE(group);
  const std::vector<float> x(kTokens * kHidden, 1.0f), wrong(3);
  std::vector<float> out(kTokens * kHidden);
  const ref::SwiGluWeights slice{wrong, wrong, wrong, kHidden, kIntermediate, std::nullopt};
  const Status status = mlpTensorParallel(*(*group)[0], x, kTokens, slice, out);
  ASSERT_FALSE(status);
  EXPECT_NE(status.message().find("rank 0"), std::string::npos) << status.message();
}

} // namespace
} // namespace hybrid::parallel
