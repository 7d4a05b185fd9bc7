#include "hybrid/kernels/ref/Parallel.h"

#include <atomic>
#include <gtest/gtest.h>
#include <vector>

namespace hybrid::kernels::ref {
namespace {

TEST(Parallel, CoversEveryIndexOnce) {
  for (int64_t count : {0, 1, 7, 1000}) {
    std::vector<std::atomic<int>> hits(count);
    parallelFor(count, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        hits[i]++;
    });
    for (int64_t i = 0; i < count; ++i)
      EXPECT_EQ(hits[i].load(), 1) << i;
  }
}

// Back-to-back jobs whose chunk counts alternate between few and many: a worker waking late
// for one job must never take work of (or count work towards) the next. Each job covers every
// index exactly once; the pool used to run a chunk twice here and then wait forever.
TEST(Parallel, BackToBackJobsOfDifferentSizesStayExact) {
  std::vector<std::atomic<int>> hits(256);
  for (int job = 0; job < 20000; ++job) {
    const int64_t count = job % 2 == 0 ? 2 : 256;
    for (int64_t i = 0; i < count; ++i)
      hits[i] = 0;
    parallelFor(count, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        hits[i]++;
    });
    for (int64_t i = 0; i < count; ++i)
      ASSERT_EQ(hits[i].load(), 1) << "job " << job << " index " << i;
  }
}

TEST(Parallel, NestedCallsRunInline) {
  std::atomic<int64_t> total{0};
  parallelFor(16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      parallelFor(10, [&](int64_t b, int64_t e) { total += e - b; });
  });
  EXPECT_EQ(total.load(), 160);
}

} // namespace
} // namespace hybrid::kernels::ref
