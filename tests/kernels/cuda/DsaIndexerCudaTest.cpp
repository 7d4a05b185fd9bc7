// The DSA lightning indexer on CUDA (DsaIndexer.h) against the cpu reference (ref::indexerScores,
// ref::topKIndices) on keys packed into scattered pages by the reference packers (every key
// format): scores to fp32 rounding, top-k sets equal up to near-ties, contexts shorter than k,
// decode rows and causal prefill rows in one launch. Labelled `gpu`; skipped without a GPU.
#include "CudaTestSupport.h"
#include "hybrid/kernels/cuda/DsaIndexer.h"
#include "hybrid/kernels/ref/Dsa.h"
#include "hybrid/kernels/ref/PagedCacheLayout.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <string>
#include <vector>

namespace hybrid::kernels {
namespace {

using cuda::IndexKeyType;

ref::IndexKeyFormat refFormat(IndexKeyType type) {
  return type == IndexKeyType::F32     ? ref::IndexKeyFormat::F32
         : type == IndexKeyType::Mxfp8 ? ref::IndexKeyFormat::Mxfp8
                                       : ref::IndexKeyFormat::Fp8PerKey;
}

// Sequences of the given lengths in a pool whose pages are handed out in a shuffled order, so a
// sequence's pages are neither contiguous nor in order. keys[b] holds what a kernel reading
// sequence b's pages sees (the unpacked values).
struct PagedKeys {
  ref::PagedCacheLayout layout;
  std::vector<uint8_t> pool;
  std::vector<int32_t> blockTables; // [sequences, maxPages]
  int32_t maxPages = 0;
  std::vector<std::vector<float>> keys;

  PagedKeys(IndexKeyType type, int dim, int pageTokens, const std::vector<int> &lengths,
            std::mt19937 &rng, bool identicalKeys = false) {
    layout.pageTokens = pageTokens;
    layout.latentDim = 64;
    layout.ropeDim = 32;
    layout.indexDim = dim;
    layout.indexFormat = refFormat(type);
    EXPECT_TRUE(layout.valid());
    int totalPages = 3; // spares nobody uses
    for (int length : lengths) {
      maxPages = std::max(maxPages, (length + pageTokens - 1) / pageTokens);
      totalPages += (length + pageTokens - 1) / pageTokens;
    }
    std::vector<int32_t> physical(size_t(totalPages), 0);
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), rng);
    const auto pageBytes = size_t(layout.indexPageBytes());
    pool.assign(size_t(totalPages) * pageBytes, 0xEE);
    blockTables.assign(lengths.size() * size_t(maxPages), -1);
    size_t next = 0;
    const std::vector<float> same = random(size_t(dim), rng, 1.0f);
    for (size_t b = 0; b < lengths.size(); ++b) {
      std::vector<float> &values = keys.emplace_back(size_t(lengths[b]) * dim);
      for (int s = 0; s < lengths[b]; ++s) {
        if (s % pageTokens == 0)
          blockTables[b * maxPages + s / pageTokens] = physical[next++];
        const std::vector<float> key = identicalKeys ? same : random(size_t(dim), rng, 1.0f);
        std::span<uint8_t> page(pool.data() + blockTables[b * maxPages + s / pageTokens] * pageBytes,
                                pageBytes);
        EXPECT_TRUE(ref::packIndexKeyToken(layout, page, s % pageTokens, key));
        EXPECT_TRUE(ref::unpackIndexKeyToken(layout, page, s % pageTokens,
                                             std::span<float>(values).subspan(size_t(s) * dim, dim)));
      }
    }
  }
};

// One launch of the indexer on the device: its inputs uploaded, its outputs downloaded.
struct IndexerRun {
  std::vector<float> scores;    // [rows, maxKeys]
  std::vector<int32_t> indices; // [rows, topK]
};
IndexerRun
runIndexer(const PagedKeys &paged, IndexKeyType type, int heads, int dim,
           const std::vector<float> &q, const std::vector<float> &w,
           const std::vector<int32_t> &positions, const std::vector<int32_t> &sequences,
           int maxKeys, int topK, bool fused = false, bool mxfp8Queries = false,
           cuda::IndexerParams::ScoreKernel scoreKernel = cuda::IndexerParams::ScoreKernel::Auto,
           cuda::IndexerParams::SelectForm selectForm = cuda::IndexerParams::SelectForm::Auto,
           bool fp8HeadQueries = false) {
  const int rows = int(positions.size());
  DeviceBuffer<float> dQ(q), dW(w), dScores{std::vector<float>(size_t(rows) * maxKeys, 0.0f)};
  DeviceBuffer<int32_t> dPositions(positions), dSequences(sequences), dTables(paged.blockTables),
      dIndices{std::vector<int32_t>(size_t(rows) * topK, -7)};
  DeviceBuffer<uint8_t> dPool(paged.pool);
  // Garbage in the select workspace: the launch must not depend on its contents.
  DeviceBuffer<uint8_t> dSelect{
      std::vector<uint8_t>(cuda::indexerSelectWorkspaceBytes(rows, maxKeys, selectForm), 0xA5)};
  cuda::IndexerParams p;
  p.rows = rows;
  p.heads = heads;
  p.headDim = dim;
  p.q = dQ.data;
  p.mxfp8Queries = mxfp8Queries;
  p.fp8HeadQueries = fp8HeadQueries;
  p.scoreKernel = scoreKernel;
  p.selectForm = selectForm;
  p.headWeights = dW.data;
  p.positions = dPositions.data;
  p.sequences = dSequences.data;
  p.keyPages = dPool.data;
  p.keyType = type;
  p.pageTokens = int32_t(paged.layout.pageTokens);
  p.blockTables = dTables.data;
  p.maxPages = paged.maxPages;
  p.scores = fused ? nullptr : dScores.data; // fused: no workspace, the scores stay on chip
  p.maxKeys = maxKeys;
  p.topK = topK;
  p.indices = dIndices.data;
  p.selectWorkspace = fused ? nullptr : dSelect.data;
  EXPECT_EQ(cuda::indexerPageBytes(type, p.pageTokens, dim), paged.layout.indexPageBytes());
  EXPECT_EQ(cuda::launchIndexerTopK(p, nullptr), 0);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {dScores.download(), dIndices.download()};
}

// Queries as the quantization policy leaves them: MXFP8-rounded in rows of `dim` values.
bool roundToMxfp8(std::vector<float> &q, int dim) {
  return ref::roundTripMxfp8(q, int64_t(q.size()) / dim, dim, ref::MxScaleRule::RoundUp);
}

// Queries as DeepSeek-V3.2's FP8 indexer leaves them: E4M3 codes times one power of two a head
// (act_quant over the head, ue8m0 scale; MODEL_SPEC 4.3).
bool roundToFp8PerHead(std::vector<float> &q, int dim) {
  return ref::roundTripFp8Tiles(q, int64_t(q.size()) / dim, dim, dim,
                                ref::Fp8ScaleRule::DeepSeekUe8m0);
}

// Hopper's FP8 warpgroup MMAs add their products in reduced precision (about 13 mantissa bits:
// DeepSeek-V3's report, section 3.3.2), and a head's dot chains its four 32-code steps in the
// tensor core's accumulator, as DeepGEMM's fp8_mqa_logits does: each head's dot may be off by
// up to four truncations to 13 bits of the sum of its products' magnitudes. Per key: that bound
// carried through the weighted head sum (every other form sums its exact products in fp32).
std::vector<float> fp8AccumulationSlack(const float *q, const float *keys, const float *w,
                                        int heads, int dim, int n) {
  const double weightScale = 1.0 / (std::sqrt(double(heads)) * std::sqrt(double(dim)));
  constexpr double kTruncation = 4.0 / 8192.0; // 4 x 2^-13
  std::vector<float> slack(static_cast<size_t>(n));
  for (int s = 0; s < n; ++s) {
    double bound = 0.0;
    for (int h = 0; h < heads; ++h) {
      double magnitudes = 0.0;
      for (int j = 0; j < dim; ++j)
        magnitudes += std::abs(double(q[size_t(h) * dim + j]) * keys[size_t(s) * dim + j]);
      bound += std::abs(double(w[h])) * weightScale * magnitudes;
    }
    slack[size_t(s)] = float(kTruncation * bound);
  }
  return slack;
}

struct IndexerCase {
  std::string name;
  IndexKeyType type;
  int heads, dim, pageTokens, topK;
  std::vector<int> lengths;
  int prefillRows; // extra rows of the last sequence at earlier positions (causal prefill)
  bool mxfp8Queries = false; // queries rounded to MXFP8 as the policy leaves them
  // Which scores: with mxfp8Queries, Auto is the warpgroup form; Fp8 the E4M3 mma.sync form.
  cuda::IndexerParams::ScoreKernel scoreKernel = cuda::IndexerParams::ScoreKernel::Auto;
  // Queries one E4M3 scale a head (DeepSeek's FP8 indexer): with Fp8PerKey keys at head dim 128,
  // Auto is the FP8 warpgroup form.
  bool fp8HeadQueries = false;

  bool scoresOnFp8Mma() const { // the dispatch rule of DsaIndexer.h
    using Kind = cuda::IndexerParams::ScoreKernel;
    return fp8HeadQueries && type == IndexKeyType::Fp8PerKey && dim == 128 &&
           pageTokens % 64 == 0 && (scoreKernel == Kind::Auto || scoreKernel == Kind::Fp8Warpgroup);
  }
};

class DsaIndexerCuda : public testing::TestWithParam<IndexerCase> {};

TEST_P(DsaIndexerCuda, MatchesReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const IndexerCase c = GetParam();
  std::mt19937 rng(11);
  const PagedKeys paged(c.type, c.dim, c.pageTokens, c.lengths, rng);
  // One decode row per sequence (its last position), then prefill rows of the last sequence.
  std::vector<int32_t> positions, sequences;
  for (size_t b = 0; b < c.lengths.size(); ++b) {
    positions.push_back(c.lengths[b] - 1);
    sequences.push_back(int32_t(b));
  }
  for (int i = 0; i < c.prefillRows; ++i) {
    positions.push_back(int32_t((int64_t(c.lengths.back()) * (i + 1)) / (c.prefillRows + 2)));
    sequences.push_back(int32_t(c.lengths.size() - 1));
  }
  const int rows = int(positions.size());
  const int maxKeys = *std::max_element(c.lengths.begin(), c.lengths.end());
  std::vector<float> q = random(size_t(rows) * c.heads * c.dim, rng, 0.5f);
  if (c.mxfp8Queries) {
    ASSERT_TRUE(roundToMxfp8(q, c.dim));
  }
  if (c.fp8HeadQueries) {
    ASSERT_TRUE(roundToFp8PerHead(q, c.dim));
  }
  const bool exactQueries = c.mxfp8Queries || c.fp8HeadQueries;
  const std::vector<float> w = random(size_t(rows) * c.heads, rng, 1.0f);

  const IndexerRun run = runIndexer(paged, c.type, c.heads, c.dim, q, w, positions, sequences,
                                    maxKeys, c.topK, /*fused=*/false, c.mxfp8Queries, c.scoreKernel,
                                    cuda::IndexerParams::SelectForm::Auto, c.fp8HeadQueries);
  const std::vector<float> &scores = run.scores;
  const std::vector<int32_t> &indices = run.indices;
  // The select's other forms after the warpgroup scores (Auto took the one cooperative launch
  // here, where every shape fits on the GPU): the same positions.
  if (exactQueries && c.scoreKernel == cuda::IndexerParams::ScoreKernel::Auto) {
    for (auto form :
         {cuda::IndexerParams::SelectForm::Gathered, cuda::IndexerParams::SelectForm::Passes,
          cuda::IndexerParams::SelectForm::Cluster}) {
      const IndexerRun other =
          runIndexer(paged, c.type, c.heads, c.dim, q, w, positions, sequences, maxKeys, c.topK,
                     /*fused=*/false, c.mxfp8Queries, c.scoreKernel, form, c.fp8HeadQueries);
      EXPECT_EQ(other.indices, indices)
          << "the one-launch select and the "
          << (form == cuda::IndexerParams::SelectForm::Passes    ? "per-digit"
              : form == cuda::IndexerParams::SelectForm::Cluster ? "cluster"
                                                                 : "three-launch")
          << " select differ";
    }
  }
  // The fused form computes the same scores (bf16 MMAs: the FP8 ones may differ in the last bits)
  // and selects by the same rule: the same positions.
  if (!exactQueries && cuda::indexerFusedSupported(c.type, c.dim, maxKeys)) {
    const IndexerRun fused = runIndexer(paged, c.type, c.heads, c.dim, q, w, positions, sequences,
                                        maxKeys, c.topK, /*fused=*/true);
    EXPECT_EQ(fused.indices, indices) << "fused and unfused selections differ";
  } else if (!exactQueries) {
    EXPECT_EQ(c.type, IndexKeyType::F32) << "the fused form takes every FP8 case here";
  }

  for (int r = 0; r < rows; ++r) {
    SCOPED_TRACE("row " + std::to_string(r) + ", position " + std::to_string(positions[r]));
    const int n = positions[r] + 1;
    std::vector<float> expected(static_cast<size_t>(n));
    const int64_t position = positions[r];
    ref::indexerScores({1, n, c.heads, c.dim, q.data() + size_t(r) * c.heads * c.dim,
                        paged.keys[size_t(sequences[r])].data(), w.data() + size_t(r) * c.heads,
                        &position, expected.data()});
    float largest = 0.0f;
    for (float v : expected)
      largest = std::max(largest, std::abs(v));
    std::vector<float> tolerance(static_cast<size_t>(n), 1e-5f * std::max(1.0f, largest));
    if (c.scoresOnFp8Mma()) {
      const std::vector<float> slack = fp8AccumulationSlack(
          q.data() + size_t(r) * c.heads * c.dim, paged.keys[size_t(sequences[r])].data(),
          w.data() + size_t(r) * c.heads, c.heads, c.dim, n);
      for (int s = 0; s < n; ++s)
        tolerance[size_t(s)] += slack[size_t(s)];
    }
    for (int s = 0; s < n; ++s)
      ASSERT_NEAR(scores[size_t(r) * maxKeys + s], expected[size_t(s)], tolerance[size_t(s)])
          << "key " << s;

    // Top-k: the same set, except where the reference's k-th score has near-ties.
    std::vector<int32_t> chosen(size_t(c.topK));
    ref::topKIndices(expected, 1, n, c.topK, chosen);
    const std::vector<int32_t> got(indices.begin() + size_t(r) * c.topK,
                                   indices.begin() + size_t(r + 1) * c.topK);
    const int selected = std::min(n, c.topK);
    std::set<int32_t> gotSet, chosenSet(chosen.begin(), chosen.begin() + selected);
    for (int i = 0; i < c.topK; ++i) {
      if (i >= selected) {
        EXPECT_EQ(chosen[size_t(i)], -1);
        continue;
      }
      ASSERT_GE(got[size_t(i)], 0) << "slot " << i;
      ASSERT_LT(got[size_t(i)], n) << "slot " << i;
      EXPECT_TRUE(gotSet.insert(got[size_t(i)]).second) << "position " << got[size_t(i)] << " twice";
    }
    EXPECT_EQ(std::count(got.begin(), got.end(), -1), c.topK - selected);
    EXPECT_TRUE(std::is_sorted(got.begin(), got.begin() + selected))
        << "positions in ascending order (the same bits for whoever sums over them)";
    EXPECT_TRUE(std::all_of(got.begin() + selected, got.end(), [](int32_t v) { return v == -1; }))
        << "the -1s last";
    const int32_t kthKey = chosen[size_t(selected - 1)];
    const float kth = expected[size_t(kthKey)];
    for (int32_t s : gotSet) {
      if (!chosenSet.count(s)) {
        EXPECT_GE(expected[size_t(s)], kth - tolerance[size_t(s)] - tolerance[size_t(kthKey)])
            << "position " << s;
      }
    }
    for (int32_t s : chosenSet) {
      if (!gotSet.count(s)) {
        EXPECT_LE(expected[size_t(s)], kth + tolerance[size_t(s)] + tolerance[size_t(kthKey)])
            << "position " << s;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DsaIndexerCuda,
    testing::Values(
        // DeepSeek-V3.2's indexer (64 heads x 128, k = 2048): contexts shorter and longer than k.
        IndexerCase{"v32_f32", IndexKeyType::F32, 64, 128, 64, 2048, {1, 700, 5000}, 4},
        IndexerCase{"v32_mxfp8", IndexKeyType::Mxfp8, 64, 128, 64, 2048, {2100, 4133}, 3},
        IndexerCase{"v32_fp8_per_key", IndexKeyType::Fp8PerKey, 64, 128, 64, 512, {3000}, 2},
        // A top-k above the keys' capacity (a short context limit): every key, then -1s.
        // clang-format off
        IndexerCase{"v32_mxfp8_topk_above_capacity", IndexKeyType::Mxfp8, 64, 128, 64, 2048, {1, 700, 1030}, 3},
        IndexerCase{"v32_mxfp8_topk_above_capacity_warpgroup", IndexKeyType::Mxfp8, 64, 128, 64, 2048, {700, 1030}, 2, true},
        // clang-format on
        // The tiny test model's shape (4 heads x 64), small pages.
        IndexerCase{"tiny_mxfp8", IndexKeyType::Mxfp8, 4, 64, 16, 32, {1, 17, 100, 300}, 5},
        IndexerCase{"tiny_f32_odd_heads", IndexKeyType::F32, 3, 64, 16, 7, {40, 9}, 2},
        // MXFP8 queries (64-token pages) on the warpgroup MMAs and on the FP8 mma.sync form:
        // both key formats, both dims, fewer than 64 heads (zero query rows / idle warps).
        // clang-format off
        IndexerCase{"v32_mxfp8_warpgroup", IndexKeyType::Mxfp8, 64, 128, 64, 2048, {1, 2100, 4133}, 3, true},
        // Many 2048-key chunks a row: 16 and 35 (the one-launch select's candidates gathered from
        // as many blocks, its chunk places set by up to 35 threads).
        IndexerCase{"v32_mxfp8_warpgroup_32k", IndexKeyType::Mxfp8, 64, 128, 64, 2048, {20000, 32768}, 2, true},
        IndexerCase{"v32_mxfp8_warpgroup_long", IndexKeyType::Mxfp8, 64, 128, 64, 2048, {70000}, 1, true},
        IndexerCase{"v32_fp8_per_key_warpgroup", IndexKeyType::Fp8PerKey, 64, 128, 64, 512, {3000}, 2, true},
        IndexerCase{"tiny_mxfp8_warpgroup", IndexKeyType::Mxfp8, 20, 64, 64, 32, {1, 17, 100, 300}, 5, true},
        IndexerCase{"v32_mxfp8_fp8mma", IndexKeyType::Mxfp8, 64, 128, 64, 2048, {1, 2100, 4133}, 3, true,
                    cuda::IndexerParams::ScoreKernel::Fp8},
        IndexerCase{"v32_fp8_per_key_fp8mma", IndexKeyType::Fp8PerKey, 64, 128, 64, 512, {3000}, 2, true,
                    cuda::IndexerParams::ScoreKernel::Fp8},
        IndexerCase{"tiny_mxfp8_fp8mma", IndexKeyType::Mxfp8, 20, 64, 64, 32, {1, 17, 100, 300}, 5, true,
                    cuda::IndexerParams::ScoreKernel::Fp8},
        // DeepSeek's FP8 indexer (queries one scale a head, keys one a key) on the FP8 warpgroup
        // MMAs: contexts around k, many chunks, 128-token pages, fewer heads; and the same
        // queries on the f16 warpgroup kernel.
        IndexerCase{"v32_fp8_per_head_fp8_warpgroup", IndexKeyType::Fp8PerKey, 64, 128, 64, 2048, {1, 2100, 4133}, 3, false,
                    cuda::IndexerParams::ScoreKernel::Auto, true},
        IndexerCase{"v32_fp8_per_head_fp8_warpgroup_long", IndexKeyType::Fp8PerKey, 64, 128, 64, 2048, {70000}, 1, false,
                    cuda::IndexerParams::ScoreKernel::Auto, true},
        IndexerCase{"v32_fp8_per_head_fp8_warpgroup_pages128", IndexKeyType::Fp8PerKey, 64, 128, 128, 512, {3000, 77}, 2, false,
                    cuda::IndexerParams::ScoreKernel::Auto, true},
        IndexerCase{"fp8_per_head_fp8_warpgroup_20_heads", IndexKeyType::Fp8PerKey, 20, 128, 64, 32, {1, 17, 100, 300}, 5, false,
                    cuda::IndexerParams::ScoreKernel::Fp8Warpgroup, true},
        IndexerCase{"v32_fp8_per_head_f16_warpgroup", IndexKeyType::Fp8PerKey, 64, 128, 64, 2048, {1, 2100, 4133}, 3, false,
                    cuda::IndexerParams::ScoreKernel::Warpgroup, true}),
    // clang-format on
    [](const testing::TestParamInfo<IndexerCase> &info) { return info.param.name; });

// Every key the same: all scores tie, and the lowest positions win (ref::topKIndices' rule).
TEST(DsaIndexerCudaTies, LowestPositionsWin) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  const int n = 3000, k = 100;
  const PagedKeys paged(IndexKeyType::Mxfp8, 128, 64, {n}, rng, /*identicalKeys=*/true);
  std::vector<int32_t> got = runIndexer(paged, IndexKeyType::Mxfp8, 64, 128,
                                        random(64 * 128, rng, 0.5f), random(64, rng, 1.0f),
                                        {n - 1}, {0}, n, k)
                                 .indices;
  std::vector<int32_t> lowest(k);
  std::iota(lowest.begin(), lowest.end(), 0);
  EXPECT_EQ(got, lowest);
  // The fused form across a cluster: with k = 2000 the ties taken run over two blocks' slices
  // (1536 keys each for 3000 keys, 2560 for 40000), the lowest positions first.
  std::vector<int32_t> lowest2000(2000);
  std::iota(lowest2000.begin(), lowest2000.end(), 0);
  for (int maxKeys : {n, 40000})
    for (int topK : {k, 2000}) {
      const std::vector<int32_t> fused =
          runIndexer(paged, IndexKeyType::Mxfp8, 64, 128, random(64 * 128, rng, 0.5f),
                     random(64, rng, 1.0f), {n - 1}, {0}, maxKeys, topK, /*fused=*/true)
              .indices;
      EXPECT_EQ(fused, topK == k ? lowest : lowest2000) << "maxKeys " << maxKeys << ", k " << topK;
    }
  // The unfused select: every chunk of 2048 keys publishes its ties; with k = 2048 the first
  // chunk takes all of them and the second none. Three rows of the same sequence, so the chunks
  // of several rows wait on their predecessors in one launch.
  std::vector<int32_t> lowest2048(2048);
  std::iota(lowest2048.begin(), lowest2048.end(), 0);
  std::vector<int32_t> expected;
  for (int r = 0; r < 3; ++r)
    expected.insert(expected.end(), lowest2048.begin(), lowest2048.end());
  EXPECT_EQ(runIndexer(paged, IndexKeyType::Mxfp8, 64, 128, random(3 * 64 * 128, rng, 0.5f),
                       random(3 * 64, rng, 1.0f), {n - 1, n - 1, n - 2}, {0, 0, 0}, n, 2048)
                .indices,
            expected);
  // The same after the warpgroup scores (MXFP8 queries), in every select form: every key is in
  // the first digit's bin, so the gathered forms rank all 3000 of each row in shared memory, and
  // all 5000 of a longer row from global memory (more than the shared memory holds).
  std::vector<float> q = random(3 * 64 * 128, rng, 0.5f);
  ASSERT_TRUE(roundToMxfp8(q, 128));
  using Form = cuda::IndexerParams::SelectForm;
  for (auto [form, name] :
       {std::pair{Form::OneLaunch, "one launch"}, std::pair{Form::Gathered, "three launches"},
        std::pair{Form::Passes, "passes"}, std::pair{Form::Cluster, "cluster"}})
    EXPECT_EQ(runIndexer(paged, IndexKeyType::Mxfp8, 64, 128, q, random(3 * 64, rng, 1.0f),
                         {n - 1, n - 1, n - 2}, {0, 0, 0}, n, 2048, /*fused=*/false,
                         /*mxfp8Queries=*/true, cuda::IndexerParams::ScoreKernel::Auto, form)
                  .indices,
              expected)
        << name;
  const int longer = 5000;
  const PagedKeys pagedLonger(IndexKeyType::Mxfp8, 128, 64, {longer}, rng, /*identicalKeys=*/true);
  for (auto [form, name] :
       {std::pair{Form::OneLaunch, "one launch"}, std::pair{Form::Gathered, "three launches"},
        std::pair{Form::Passes, "passes"}, std::pair{Form::Cluster, "cluster"}})
    EXPECT_EQ(runIndexer(pagedLonger, IndexKeyType::Mxfp8, 64, 128,
                         std::vector<float>(q.begin(), q.begin() + 64 * 128), random(64, rng, 1.0f),
                         {longer - 1}, {0}, longer, 2048, /*fused=*/false,
                         /*mxfp8Queries=*/true, cuda::IndexerParams::ScoreKernel::Auto, form)
                  .indices,
              lowest2048)
        << name << ", " << longer << " tied keys";
}

// The gathered candidates take a word a key of the capacity: for every row only where the
// three-launch form asks; else for the rows a one-launch grid may take (1024 chunks of 2048 keys),
// so Auto's workspace does not double the scores'. Host arithmetic: no GPU needed.
TEST(DsaIndexerWorkspace, CandidatesOnlyForTheRowsAFormGathers) {
  using Form = cuda::IndexerParams::SelectForm;
  const int32_t maxKeys = 163840; // DeepSeek-V3.2's context: 80 chunks, 12 rows a one-launch grid
  EXPECT_EQ(cuda::indexerSelectWorkspaceBytes(64, maxKeys, Form::Gathered) -
                cuda::indexerSelectWorkspaceBytes(64, maxKeys, Form::Auto),
            size_t(64 - 12) * maxKeys * sizeof(uint32_t));
  EXPECT_EQ(cuda::indexerSelectWorkspaceBytes(12, maxKeys, Form::Gathered),
            cuda::indexerSelectWorkspaceBytes(12, maxKeys, Form::Auto));
  // The bytes for more rows hold any launch of fewer (the runtime sizes for its largest).
  for (Form form : {Form::Auto, Form::Gathered, Form::Passes})
    for (int rows = 1; rows < 40; ++rows)
      EXPECT_LE(cuda::indexerSelectWorkspaceBytes(rows, maxKeys, form),
                cuda::indexerSelectWorkspaceBytes(rows + 1, maxKeys, form))
          << rows << " rows";
  EXPECT_EQ(cuda::indexerSelectWorkspaceBytes(0, maxKeys), 0u);
}

TEST(DsaIndexerCudaErrors, RejectsBadShapes) {
  cuda::IndexerParams p; // nothing set
  EXPECT_EQ(cuda::launchIndexerTopK(p, nullptr), int(cudaErrorInvalidValue));
}

} // namespace
} // namespace hybrid::kernels
