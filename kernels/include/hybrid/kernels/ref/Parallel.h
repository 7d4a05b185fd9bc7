// A tiny process-wide thread pool for the reference kernels: enough to spread the big loops (rows
// of a linear layer, heads of attention / KDA, tokens) over all cores, nothing more.
#pragma once

#include <cstdint>
#include <functional>

namespace hybrid::kernels::ref {

// Threads parallelFor uses: HYBRID_NUM_THREADS when set (>= 1), else
// std::thread::hardware_concurrency.
int numThreads();

// Calls body(begin, end) on disjoint contiguous ranges covering [0, count), possibly concurrently,
// and returns when all are done. Ranges hold at least minGrain items (except the last). A call made
// from inside a body runs inline on the calling thread (no nested parallelism, no deadlock).
void parallelFor(int64_t count, const std::function<void(int64_t begin, int64_t end)> &body,
                 int64_t minGrain = 1);

} // namespace hybrid::kernels::ref
