// The DSA benchmarks' verdicts against the targets: pure functions, no GPU needed.
#include "hybrid/kernels/cuda/DsaBench.h"

#include <gtest/gtest.h>

namespace hybrid::kernels::cuda {
namespace {

TEST(DsaTargets, IndexerAgainstSeventyPercentOfTheKeyFloor) {
  IndexerBenchResult r;
  r.floorMicroseconds = 258.7;
  r.microseconds = 1208.5;
  EXPECT_EQ(indexerTargetVerdict(r), "misses: 21.4% of the floor, needs 3.3x");
  r.microseconds = 300.0;
  EXPECT_EQ(indexerTargetVerdict(r), "meets >= 70% of the floor (86%)");
}

TEST(DsaTargets, SparseMlaAgainstSixtyPercentOfHbm) {
  SparseMlaBenchResult r;
  r.floorMicroseconds = 28.5;
  r.microseconds = 609.5;
  EXPECT_EQ(sparseMlaTargetVerdict(r), "misses: 4.7% of HBM, needs 12.8x");
  r.microseconds = 47.5; // exactly 60%
  EXPECT_EQ(sparseMlaTargetVerdict(r), "meets >= 60% of HBM (60%)");
}

} // namespace
} // namespace hybrid::kernels::cuda
