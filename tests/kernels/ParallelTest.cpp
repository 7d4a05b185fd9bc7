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
