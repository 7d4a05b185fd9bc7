#include "hybrid/kernels/cuda/DsaBench.h"
#include "hybrid/kernels/cuda/KdaBench.h" // kH200CopyTbPerSecond
#include "../common/bench_support.h"
#include "dsa_bench_pages.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>

namespace hybrid::kernels::cuda {
using namespace bench;

namespace {

constexpr int32_t kPageTokens = 64, kLatent = 512, kRope = 64;
constexpr int32_t kDistinctPages = 64; // random pages, copied over the whole pool on the device


} // namespace

std::vector<SparseMlaBenchResult> benchSparseMla(const std::vector<int32_t> &batches,
                                                 const std::vector<int32_t> &headCounts,
                                                 int32_t topK, int32_t context, bool prefill,
                                                 const std::vector<int32_t> &splitCounts,
                                                 bool halfTiles, int32_t iterations,
                                                 std::string &error) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    error = "no CUDA device";
    return {};
  }
  topK = std::min(topK, context);
  std::vector<SparseMlaBenchResult> results;
  std::mt19937 rng(13);
  const int64_t rowBytes = sparseMlaRowBytes(kLatent, kRope), pageBytes = kPageTokens * rowBytes;
  for (int32_t heads : headCounts)
    for (int32_t batch : batches) {
      // Prefill rows all read one sequence's pages (its cache stays in L2 at these sizes);
      // decode rows each their own.
      const int32_t pagesPerSequence = (context + kPageTokens - 1) / kPageTokens;
      const int64_t pages = int64_t(prefill ? 1 : batch) * pagesPerSequence;
      std::vector<int32_t> tables(static_cast<size_t>(pages));
      std::iota(tables.begin(), tables.end(), 0);
      std::shuffle(tables.begin(), tables.end(), rng);
      std::vector<int32_t> sequences(static_cast<size_t>(batch), 0), indices;
      if (!prefill)
        std::iota(sequences.begin(), sequences.end(), 0);
      std::vector<int32_t> positions(static_cast<size_t>(context));
      std::iota(positions.begin(), positions.end(), 0);
      for (int32_t b = 0; b < batch; ++b) { // distinct random positions per row
        std::shuffle(positions.begin(), positions.end(), rng);
        indices.insert(indices.end(), positions.begin(), positions.begin() + topK);
      }
      DeviceAllocations held; // this shape's buffers, freed on every way out
      auto fail = [&](const char *what) {
        error = (error.empty() ? "" : error + ": ") + what + " failed for batch " +
                std::to_string(batch) + ", " + std::to_string(heads) + " heads";
        return std::vector<SparseMlaBenchResult>{};
      };
      unsigned char *pool = held.keep(
          devicePagePool(pages, pageBytes, kDistinctPages, [&] { return randomLatentPage(kLatent, kRope, kPageTokens, rng); }));
      if (!pool)
        return fail("the page pool");
      const size_t qFloats = size_t(batch) * heads * (kLatent + kRope);
      int32_t *dTables = held.keep(deviceCopy(tables));
      int32_t *dSequences = held.keep(deviceCopy(sequences));
      int32_t *dIndices = held.keep(deviceCopy(indices));
      auto *dOut = held.allocate<float>(size_t(batch) * heads * kLatent);
      auto *dWorkspace = held.allocate<unsigned char>(sparseMlaWorkspaceBytes(batch, heads, kLatent, topK));
      if (!dTables || !dSequences || !dIndices || !dOut || !dWorkspace)
        return fail("the table and output allocation");
      float *dQ = held.keep(deviceRandom(qFloats, 0.3f, 0.0f, rng, error));
      if (!dQ)
        return fail("the query upload");
      SparseMlaDecodeParams p;
      p.rows = batch;
      p.heads = heads;
      p.latentDim = kLatent;
      p.ropeDim = kRope;
      p.softmaxScale = 0.1352338f;
      p.q = dQ;
      p.indices = dIndices;
      p.topK = topK;
      p.sequences = dSequences;
      p.latentPages = pool;
      p.pageTokens = kPageTokens;
      p.blockTables = dTables;
      p.maxPages = pagesPerSequence;
      p.out = dOut;
      p.workspace = dWorkspace;
      p.halfTiles = halfTiles;
      for (int32_t splits : splitCounts) {
        p.splits = splits;
        SparseMlaBenchResult r;
        r.batch = batch;
        r.heads = heads;
        r.topK = topK;
        r.context = context;
        r.splits = splits;
        r.prefill = prefill;
        if (const int code = launchSparseMlaDecode(p, nullptr); code != 0) {
          if (splits > 0 && code == int(cudaErrorInvalidValue)) { // outside the kernel's range
            cudaGetLastError();
            r.refused = true;
            results.push_back(r);
            continue;
          }
          return fail("the sparse MLA launch");
        }
        if (cudaDeviceSynchronize() != cudaSuccess)
          return fail("the sparse MLA launch");
        r.microseconds = graphMicroseconds(
            iterations, [&](cudaStream_t s) { return launchSparseMlaDecode(p, s); });
        if (r.microseconds < 0)
          return fail("the graph capture");
        // Decode reads every selected row; prefill at least the sequence's cache once.
        r.bytes = (prefill ? double(pages) * double(pageBytes)
                           : double(batch) * topK * double(rowBytes)) +
                  double(qFloats) * 4 + double(batch) * heads * kLatent * 4 +
                  double(batch) * topK * 4;
        r.floorMicroseconds = r.bytes / (kH200CopyTbPerSecond * 1e12) * 1e6;
        r.tflops = 2.0 * batch * heads * topK * double(kLatent + kRope + kLatent) /
                   (r.microseconds * 1e-6) / 1e12;
        results.push_back(r);
      }
    }
  return results;
}

std::string sparseMlaTargetVerdict(const SparseMlaBenchResult &r) {
  if (r.prefill) {
    char text[96];
    std::snprintf(text, sizeof text, "reported: %.0f%% of FlashMLA's %.0f TFLOP/s (H800)",
                  100.0 * r.tflops / kFlashMlaSparsePrefillTflops, kFlashMlaSparsePrefillTflops);
    return text;
  }
  return floorShareVerdict(r.floorMicroseconds / r.microseconds, 0.6, "HBM");
}

} // namespace hybrid::kernels::cuda
