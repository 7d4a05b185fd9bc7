// Candidate measurements of the DSA families (Tune.h): the indexer's tiles per block and sparse
// MLA decode's splits, on random data at a bucket's sizes.
#include "hybrid/kernels/cuda/Tune.h"
#include "../common/bench_support.h"
#include "../common/tune_measure.h"
#include "dsa_bench_pages.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <random>

namespace hybrid::kernels::cuda {
using namespace bench;
using namespace tune_measure;
using tuning::CandidateTiming;

namespace {

constexpr int32_t kPageTokens = 64;
constexpr int32_t kDistinctPages = 64; // random pages, copied over the whole pool on the device

} // namespace

StatusOr<std::vector<CandidateTiming>>
measureIndexerScores(const cache::ShapeBucket &shape, const std::vector<cache::TuningConfig> &configs,
                     tuning::Clock::time_point deadline, int32_t iterations) {
  const int64_t rows = dimension(shape, "rows"), heads = dimension(shape, "heads"),
                headDim = dimension(shape, "head_dim"), maxKeys = dimension(shape, "max_keys"),
                keyType = dimension(shape, "key_type"), form = dimension(shape, "score_form");
  if (rows < 1 || rows > 65535 || heads < 1 || heads > kIndexerMaxHeads ||
      (headDim != 64 && headDim != 128) || maxKeys < 1 || maxKeys > (int64_t(1) << 24) ||
      keyType < 0 || keyType > 2 || form < 0 || form > 3 || (form == 0) != (keyType == 2))
    return Status::error("dsa-indexer-scores: cannot measure bucket " + tuning::formatShape(shape) +
                         " (rows 1..65535, heads 1..64, head_dim 64 or 128, max_keys up to 2^24, "
                         "score_form 0 exactly for key_type 2)");
  const auto type = static_cast<IndexKeyType>(keyType);
  const int32_t context = static_cast<int32_t>(maxKeys), batch = static_cast<int32_t>(rows);
  const int32_t pagesPerSequence = (context + kPageTokens - 1) / kPageTokens;
  const int64_t pages = int64_t(batch) * pagesPerSequence;
  const int64_t pageBytes = indexerPageBytes(type, kPageTokens, static_cast<int32_t>(headDim));
  std::mt19937 rng(14);
  std::vector<int32_t> tables(static_cast<size_t>(pages));
  std::iota(tables.begin(), tables.end(), 0);
  std::shuffle(tables.begin(), tables.end(), rng);
  std::vector<int32_t> positions(static_cast<size_t>(batch), context - 1),
      sequences(static_cast<size_t>(batch));
  std::iota(sequences.begin(), sequences.end(), 0);
  const int32_t topK = std::min(2048, context);

  DeviceAllocations held;
  unsigned char *pool = held.keep(devicePagePool(pages, pageBytes, kDistinctPages, [&] {
    return randomIndexKeyPage(type, static_cast<int32_t>(headDim), kPageTokens, rng);
  }));
  std::vector<float> q(size_t(batch) * heads * headDim);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (float &v : q)
    v = normal(rng);
  // The policy's MXFP8 queries: exact in bf16.
  if (type != IndexKeyType::F32 &&
      !ref::roundTripMxfp8(q, int64_t(q.size() / headDim), headDim, ref::MxScaleRule::RoundUp))
    return Status::error("dsa-indexer-scores: the query quantization failed");
  std::string error;
  IndexerParams p;
  p.rows = batch;
  p.heads = static_cast<int32_t>(heads);
  p.headDim = static_cast<int32_t>(headDim);
  p.q = held.keep(deviceCopy(q));
  p.mxfp8Queries = form >= 2;
  p.scoreKernel = form == 1 ? IndexerParams::ScoreKernel::Bf16
                  : form == 2 ? IndexerParams::ScoreKernel::Fp8
                              : IndexerParams::ScoreKernel::Auto;
  p.headWeights = held.keep(deviceRandom(size_t(batch) * heads, 1.0f, 0, rng, error));
  p.positions = held.keep(deviceCopy(positions));
  p.sequences = held.keep(deviceCopy(sequences));
  p.keyPages = pool;
  p.keyType = type;
  p.pageTokens = kPageTokens;
  p.blockTables = held.keep(deviceCopy(tables));
  p.maxPages = pagesPerSequence;
  p.scores = held.allocate<float>(size_t(batch) * context);
  p.maxKeys = context;
  p.topK = topK;
  p.indices = held.allocate<int32_t>(size_t(batch) * topK);
  p.selectWorkspace = held.allocate<unsigned char>(indexerSelectWorkspaceBytes(batch, context));
  if (!pool || !p.q || !p.headWeights || !p.positions || !p.sequences || !p.blockTables ||
      !p.scores || !p.indices || !p.selectWorkspace)
    return Status::error("dsa-indexer-scores: cannot allocate bucket " +
                         tuning::formatShape(shape) + " on the device" +
                         (error.empty() ? "" : ": " + error));

  struct Output {
    std::vector<float> scores;
    std::vector<int32_t> indices;
  };
  auto output = [&]() -> StatusOr<Output> {
    HYBRID_ASSIGN_OR_RETURN(std::vector<float> scores,
                            download(p.scores, size_t(batch) * context));
    HYBRID_ASSIGN_OR_RETURN(std::vector<int32_t> indices,
                            download(p.indices, size_t(batch) * topK));
    return Output{.scores = std::move(scores), .indices = std::move(indices)};
  };
  // Tiles per block only regroups the keys over blocks: each key's score is computed the same
  // way, so scores and the selection must match the defaults' (up to 1e-6 of the largest score).
  auto compare = [](const Output &candidate, const Output &reference) -> std::string {
    float largest = 0, worst = 0;
    for (size_t i = 0; i < reference.scores.size(); ++i) {
      largest = std::max(largest, std::fabs(reference.scores[i]));
      const float difference = std::fabs(candidate.scores[i] - reference.scores[i]);
      worst = std::isfinite(candidate.scores[i]) ? std::max(worst, difference) : INFINITY;
    }
    if (!(worst <= 1e-6f * largest))
      return "scores differ by up to " + std::to_string(worst) + " (largest " +
             std::to_string(largest) + ")";
    const size_t differing = size_t(std::inner_product(
        candidate.indices.begin(), candidate.indices.end(), reference.indices.begin(), size_t(0),
        std::plus<>(), std::not_equal_to<>()));
    return differing ? std::to_string(differing) + " selected positions differ" : std::string();
  };
  return measureEach(p, configs, deadline, iterations, launchIndexerTopK, output, compare);
}

StatusOr<std::vector<CandidateTiming>>
measureSparseMlaDecode(const cache::ShapeBucket &shape,
                       const std::vector<cache::TuningConfig> &configs,
                       tuning::Clock::time_point deadline, int32_t iterations) {
  const int64_t rows = dimension(shape, "rows"), heads = dimension(shape, "heads"),
                latent = dimension(shape, "latent_dim"), rope = dimension(shape, "rope_dim"),
                topK = dimension(shape, "top_k"), causal = dimension(shape, "causal");
  if (rows < 1 || rows > 65535 || heads < 1 || heads > 1024 ||
      !((latent == 512 && rope == 64) || (latent == 64 && rope == 32)) || topK < 1 ||
      topK > sparseMlaMaxCausalPositions() || (causal != 0 && causal != 1))
    return Status::error("sparse-mla-decode: cannot measure bucket " + tuning::formatShape(shape) +
                         " (rows 1..65535, heads 1..1024, latent_dim/rope_dim 512/64 or 64/32, "
                         "top_k up to " + std::to_string(sparseMlaMaxCausalPositions()) +
                         ", causal 0 or 1)");
  const int32_t batch = static_cast<int32_t>(rows), k = static_cast<int32_t>(topK);
  const int32_t L = static_cast<int32_t>(latent), R = static_cast<int32_t>(rope);
  // Sparse rows pick k distinct positions of twice as many cached; causal rows attend to all k.
  const int32_t context = causal ? k : 2 * k;
  const int32_t pagesPerSequence = (context + kPageTokens - 1) / kPageTokens;
  const int64_t pages = int64_t(batch) * pagesPerSequence;
  const int64_t pageBytes = kPageTokens * sparseMlaRowBytes(L, R);
  std::mt19937 rng(15);
  std::vector<int32_t> tables(static_cast<size_t>(pages));
  std::iota(tables.begin(), tables.end(), 0);
  std::shuffle(tables.begin(), tables.end(), rng);
  std::vector<int32_t> sequences(static_cast<size_t>(batch)), indices,
      positions(static_cast<size_t>(batch), context - 1);
  std::iota(sequences.begin(), sequences.end(), 0);
  if (!causal) {
    std::vector<int32_t> all(static_cast<size_t>(context));
    std::iota(all.begin(), all.end(), 0);
    for (int32_t b = 0; b < batch; ++b) {
      std::shuffle(all.begin(), all.end(), rng);
      indices.insert(indices.end(), all.begin(), all.begin() + k);
    }
  }
  DeviceAllocations held;
  std::string error;
  unsigned char *pool = held.keep(devicePagePool(pages, pageBytes, kDistinctPages,
                                                 [&] { return randomLatentPage(L, R, kPageTokens, rng); }));
  SparseMlaDecodeParams p;
  p.rows = batch;
  p.heads = static_cast<int32_t>(heads);
  p.latentDim = L;
  p.ropeDim = R;
  p.softmaxScale = 1.0f / std::sqrt(float(L + R));
  p.q = held.keep(deviceRandom(size_t(batch) * heads * (L + R), 0.3f, 0.0f, rng, error));
  p.indices = causal ? nullptr : held.keep(deviceCopy(indices));
  p.topK = k;
  p.positions = causal ? held.keep(deviceCopy(positions)) : nullptr;
  p.sequences = held.keep(deviceCopy(sequences));
  p.latentPages = pool;
  p.pageTokens = kPageTokens;
  p.blockTables = held.keep(deviceCopy(tables));
  p.maxPages = pagesPerSequence;
  const size_t outFloats = size_t(batch) * heads * L;
  p.out = held.allocate<float>(outFloats);
  p.workspace = held.allocate<unsigned char>(sparseMlaWorkspaceBytes(batch, p.heads, L, k));
  if (!pool || !p.q || !(p.indices || p.positions) || !p.sequences || !p.blockTables || !p.out ||
      !p.workspace)
    return Status::error("sparse-mla-decode: cannot allocate bucket " + tuning::formatShape(shape) +
                         " on the device" + (error.empty() ? "" : ": " + error));
  auto output = [&] { return download(p.out, outFloats); };
  // Splits change where the softmax is rescaled and its weights rounded to bf16, so the outputs
  // differ in rounding only: a relative RMS of 2e-3 (a wrong merge of splits is off by O(1)).
  auto compare = [](const std::vector<float> &candidate, const std::vector<float> &reference) {
    return relativeRmsMismatch(candidate, reference, 2e-3);
  };
  return measureEach(p, configs, deadline, iterations, launchSparseMlaDecode, output, compare);
}

} // namespace hybrid::kernels::cuda
