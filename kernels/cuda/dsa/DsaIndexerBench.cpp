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

constexpr int32_t kPageTokens = 64;
constexpr int32_t kDistinctPages = 64; // random pages, copied over the whole pool on the device


} // namespace

std::vector<IndexerBenchResult>
benchIndexerDecode(const std::vector<int32_t> &batches, const std::vector<int32_t> &contexts,
                   int32_t heads, int32_t headDim, int32_t topK, IndexKeyType keyType, bool fused,
                   IndexerParams::ScoreKernel scoreKernel, IndexerParams::SelectForm selectForm,
                   int32_t iterations, std::string &error) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    error = "no CUDA device";
    return {};
  }
  std::vector<IndexerBenchResult> results;
  std::mt19937 rng(9);
  const int64_t pageBytes = indexerPageBytes(keyType, kPageTokens, headDim);
  for (int32_t context : contexts)
    for (int32_t batch : batches) {
      const int32_t pagesPerSequence = (context + kPageTokens - 1) / kPageTokens;
      const int64_t pages = int64_t(batch) * pagesPerSequence;
      // Sequences' pages scattered over the pool (a random permutation).
      std::vector<int32_t> tables(static_cast<size_t>(pages));
      std::iota(tables.begin(), tables.end(), 0);
      std::shuffle(tables.begin(), tables.end(), rng);
      std::vector<int32_t> positions(static_cast<size_t>(batch), context - 1),
          sequences(static_cast<size_t>(batch));
      std::iota(sequences.begin(), sequences.end(), 0);

      DeviceAllocations held; // this shape's buffers, freed on every way out
      auto fail = [&](const char *what) {
        error = std::string(what) + " failed for batch " + std::to_string(batch) + ", context " +
                std::to_string(context);
        return std::vector<IndexerBenchResult>{};
      };
      unsigned char *pool = held.keep(devicePagePool(
          pages, pageBytes, kDistinctPages, [&] { return randomIndexKeyPage(keyType, headDim, kPageTokens, rng); }));
      if (!pool)
        return fail("the page pool");
      int32_t *dTables = held.keep(deviceCopy(tables));
      int32_t *dPositions = held.keep(deviceCopy(positions));
      int32_t *dSequences = held.keep(deviceCopy(sequences));
      auto *dIndices = held.allocate<int32_t>(size_t(batch) * topK);
      auto *dScores = held.allocate<float>(size_t(batch) * context);
      auto *dSelect =
          held.allocate<unsigned char>(indexerSelectWorkspaceBytes(batch, context, selectForm));
      if (!dTables || !dPositions || !dSequences || !dIndices || !dScores || !dSelect)
        return fail("the table and workspace allocation");
      IndexerParams p;
      p.rows = batch;
      p.heads = heads;
      p.headDim = headDim;
      // Queries as the quantization policy leaves them: MXFP8-rounded with MXFP8 keys, one
      // E4M3 scale a head with Fp8PerKey keys (DeepSeek-V3.2's FP8 indexer, MODEL_SPEC 4.3),
      // fp32 with fp32 keys.
      std::vector<float> q(size_t(batch) * heads * headDim);
      std::normal_distribution<float> normal(0.0f, 0.5f);
      for (float &v : q)
        v = normal(rng);
      const int64_t headRows = int64_t(q.size() / headDim);
      const bool rounded =
          keyType == IndexKeyType::Mxfp8
              ? ref::roundTripMxfp8(q, headRows, headDim, ref::MxScaleRule::RoundUp)
          : keyType == IndexKeyType::Fp8PerKey
              ? ref::roundTripFp8Tiles(q, headRows, headDim, headDim,
                                       ref::Fp8ScaleRule::DeepSeekUe8m0)
              : true;
      if (!rounded)
        return fail("the query quantization");
      p.q = held.keep(deviceCopy(q));
      p.mxfp8Queries = keyType == IndexKeyType::Mxfp8;
      p.fp8HeadQueries = keyType == IndexKeyType::Fp8PerKey;
      p.scoreKernel = scoreKernel;
      p.selectForm = selectForm;
      p.headWeights = held.keep(deviceRandom(size_t(batch) * heads, 1.0f, 0, rng, error));
      if (!p.q || !p.headWeights)
        return fail("the query upload");
      p.positions = dPositions;
      p.sequences = dSequences;
      p.keyPages = pool;
      p.keyType = keyType;
      p.pageTokens = kPageTokens;
      p.blockTables = dTables;
      p.maxPages = pagesPerSequence;
      const bool oneLaunch = fused && indexerFusedSupported(keyType, headDim, context);
      p.scores = oneLaunch ? nullptr : dScores;
      p.maxKeys = context;
      p.topK = std::min(topK, context);
      p.indices = dIndices;
      p.selectWorkspace = oneLaunch ? nullptr : dSelect;
      if (launchIndexerTopK(p, nullptr) != 0 || cudaDeviceSynchronize() != cudaSuccess)
        return fail("the indexer launch");
      IndexerBenchResult r;
      r.batch = batch;
      r.context = context;
      r.heads = heads;
      r.headDim = headDim;
      r.topK = p.topK;
      r.keyType = keyType;
      r.fused = oneLaunch;
      // Replayed from a CUDA graph, as a decode step runs it: the launches cost no host time.
      r.microseconds =
          graphMicroseconds(iterations, [&](cudaStream_t s) { return launchIndexerTopK(p, s); });
      if (r.microseconds < 0)
        return fail("the graph capture");
      r.keyBytes = double(batch) * context * double(pageBytes) / kPageTokens;
      r.floorMicroseconds = r.keyBytes / (kH200CopyTbPerSecond * 1e12) * 1e6;
      results.push_back(r);
    }
  return results;
}

std::string indexerTargetVerdict(const IndexerBenchResult &r) {
  return floorShareVerdict(r.floorMicroseconds / r.microseconds, 0.7, "the floor");
}

} // namespace hybrid::kernels::cuda
