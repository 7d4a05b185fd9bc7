// Sparse MLA decode on CUDA (SparseMla.h) against ref::latentAttention on the values a kernel
// reading the paged FP8 latent cache sees (rows packed into scattered pages by
// ref::packLatentToken): DeepSeek-V3.2's 512 + 64 and the tiny model's 64 + 32; 128 and 16 heads
// (a TP=8 shard) and counts that fill a block's 64, 32 or 16 heads partly; positions split over
// blocks and not; top-k not a multiple of the tile, -1 padding, a row with no position; causal
// rows past 64K positions; scales that are not powers of two (8 heads).
// Labelled `gpu`; skipped without a GPU.
#include "hybrid/kernels/cuda/SparseMla.h"
#include "hybrid/kernels/ref/Mla.h"
#include "hybrid/kernels/ref/PagedCacheLayout.h"
#include "CudaTestSupport.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

namespace hybrid::kernels {
namespace {

struct SparseMlaCase {
  std::string name;
  int latent, rope, heads, topK, pageTokens;
  std::vector<int> lengths; // one decode row per sequence
  bool causal = false;      // no indices: each row attends to all its positions (topK: capacity)
  // Every third row's scales times 3 (not powers of two, as no packer writes them): the kernels'
  // general conversion next to the bit moves.
  bool oddScales = false;
  bool halfTiles = false; // SparseMlaDecodeParams::halfTiles (64-head blocks)
};

class SparseMlaDecodeCuda : public testing::TestWithParam<SparseMlaCase> {};

TEST_P(SparseMlaDecodeCuda, MatchesReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const SparseMlaCase c = GetParam();
  std::mt19937 rng(21);
  ref::PagedCacheLayout layout;
  layout.pageTokens = c.pageTokens;
  layout.latentDim = c.latent;
  layout.ropeDim = c.rope;
  layout.indexDim = 64;
  ASSERT_EQ(cuda::sparseMlaRowBytes(c.latent, c.rope), layout.latentRowBytes());

  // Every sequence's rows in pages handed out in a shuffled order; latents/rope as unpacked.
  int maxPages = 0, totalPages = 2;
  for (int length : c.lengths) {
    maxPages = std::max(maxPages, (length + c.pageTokens - 1) / c.pageTokens);
    totalPages += (length + c.pageTokens - 1) / c.pageTokens;
  }
  std::vector<int32_t> physical(size_t(totalPages), 0);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  const auto pageBytes = size_t(layout.latentPageBytes());
  std::vector<uint8_t> pool(size_t(totalPages) * pageBytes, 0xEE);
  std::vector<int32_t> tables(c.lengths.size() * size_t(maxPages), -1);
  std::vector<std::vector<float>> latents, ropes;
  size_t next = 0;
  for (size_t b = 0; b < c.lengths.size(); ++b) {
    std::vector<float> &latent = latents.emplace_back(size_t(c.lengths[b]) * c.latent);
    std::vector<float> &rope = ropes.emplace_back(size_t(c.lengths[b]) * c.rope);
    for (int s = 0; s < c.lengths[b]; ++s) {
      if (s % c.pageTokens == 0)
        tables[b * maxPages + s / c.pageTokens] = physical[next++];
      std::span<uint8_t> page(pool.data() + tables[b * maxPages + s / c.pageTokens] * pageBytes,
                              pageBytes);
      const auto values = random(size_t(c.latent), rng, 1.0f);
      const auto ropeValues = random(size_t(c.rope), rng, 1.0f);
      ASSERT_TRUE(ref::packLatentToken(layout, page, s % c.pageTokens, values, ropeValues));
      if (c.oddScales && s % 3 == 0) {
        auto *scales = reinterpret_cast<float *>(
            page.data() + layout.latentRowOffset(s % c.pageTokens) + c.latent);
        for (int tile = 0; tile < (c.latent + 127) / 128; ++tile)
          scales[tile] *= 3.0f;
      }
      ASSERT_TRUE(ref::unpackLatentToken(
          layout, page, s % c.pageTokens,
          std::span<float>(latent).subspan(size_t(s) * c.latent, size_t(c.latent)),
          std::span<float>(rope).subspan(size_t(s) * c.rope, size_t(c.rope))));
    }
  }
  // Each row: distinct random positions of its sequence (fewer than topK when short), -1s mixed
  // in; the last row of a one-token sequence selects nothing at all.
  const int rows = int(c.lengths.size());
  std::vector<int32_t> indices(size_t(rows) * c.topK, -1), sequences(static_cast<size_t>(rows));
  for (int r = 0; r < rows && !c.causal; ++r) {
    sequences[size_t(r)] = r;
    std::vector<int32_t> positions(size_t(c.lengths[size_t(r)]));
    std::iota(positions.begin(), positions.end(), 0);
    std::shuffle(positions.begin(), positions.end(), rng);
    const int kept = c.lengths[size_t(r)] == 1 ? 0 : std::min<int>(c.topK - 3, int(positions.size()));
    for (int j = 0; j < kept; ++j)
      indices[size_t(r) * c.topK + size_t(j + (j % 7 == 3 ? 1 : 0)) % c.topK] = positions[size_t(j)];
  }
  std::vector<int32_t> lastPositions(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    sequences[size_t(r)] = r;
    lastPositions[size_t(r)] = c.lengths[size_t(r)] - 1;
  }
  const int wide = c.latent + c.rope;
  const std::vector<float> q = random(size_t(rows) * c.heads * wide, rng, 0.3f);
  const float scale = 1.0f / std::sqrt(float(192));

  std::vector<float> expected(size_t(rows) * c.heads * c.latent);
  for (int r = 0; r < rows; ++r) {
    ref::LatentAttentionParams l;
    l.numQueries = 1;
    l.numKeys = c.lengths[size_t(r)];
    l.numHeads = c.heads;
    l.latentDim = c.latent;
    l.ropeDim = c.rope;
    l.softmaxScale = scale;
    l.queries = q.data() + size_t(r) * c.heads * wide;
    l.latents = latents[size_t(r)].data();
    l.ropeKeys = ropes[size_t(r)].data();
    const int64_t queryPosition = c.lengths[size_t(r)] - 1;
    if (c.causal) {
      l.queryPositions = &queryPosition;
    } else {
      l.sparseIndices = indices.data() + size_t(r) * c.topK;
      l.topK = c.topK;
    }
    l.out = expected.data() + size_t(r) * c.heads * c.latent;
    ref::latentAttention(l);
  }

  DeviceBuffer<float> dQ(q), dOut{std::vector<float>(expected.size(), -9.0f)};
  DeviceBuffer<int32_t> dIndices(indices), dSequences(sequences), dTables(tables);
  DeviceBuffer<int32_t> dPositions(lastPositions);
  DeviceBuffer<uint8_t> dPool(pool);
  DeviceBuffer<uint8_t> dWorkspace{
      std::vector<uint8_t>(cuda::sparseMlaWorkspaceBytes(rows, c.heads, c.latent, c.topK), 0xA5)};
  cuda::SparseMlaDecodeParams p;
  p.rows = rows;
  p.heads = c.heads;
  p.latentDim = c.latent;
  p.ropeDim = c.rope;
  p.softmaxScale = scale;
  p.q = dQ.data;
  p.indices = c.causal ? nullptr : dIndices.data;
  p.positions = c.causal ? dPositions.data : nullptr;
  p.topK = c.topK;
  p.sequences = dSequences.data;
  p.latentPages = dPool.data;
  p.pageTokens = c.pageTokens;
  p.blockTables = dTables.data;
  p.maxPages = maxPages;
  p.out = dOut.data;
  p.workspace = dWorkspace.data;
  p.halfTiles = c.halfTiles;
  ASSERT_EQ(cuda::launchSparseMlaDecode(p, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = dOut.download();
  // bf16 queries and softmax weights (FlashMLA's precision): per row and head, relative RMS
  // (measured on H200: 1.6e-3 to 2.2e-3 worst).
  double worst = 0;
  for (size_t item = 0; item < got.size() / size_t(c.latent); ++item) {
    const std::vector<float> a(got.begin() + item * c.latent, got.begin() + (item + 1) * c.latent);
    const std::vector<float> b(expected.begin() + item * c.latent,
                               expected.begin() + (item + 1) * c.latent);
    if (std::all_of(b.begin(), b.end(), [](float v) { return v == 0.0f; })) {
      EXPECT_TRUE(std::all_of(a.begin(), a.end(), [](float v) { return v == 0.0f; }))
          << "row/head " << item << " has no position and must be zero";
      continue;
    }
    worst = std::max(worst, relativeRms(a, b));
  }
  EXPECT_LT(worst, 5e-3) << "worst row/head relative RMS error";
  RecordProperty("worst_relative_rms", std::to_string(worst));
  std::printf("worst row/head relative RMS error: %.3g\n", worst);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SparseMlaDecodeCuda,
    testing::Values(
        SparseMlaCase{"v32_128_heads", 512, 64, 128, 2048, 64, {3000, 1, 700}},
        SparseMlaCase{"v32_16_heads_odd_topk", 512, 64, 16, 100, 64, {300, 90}},
        SparseMlaCase{"v32_40_heads", 512, 64, 40, 2048, 64, {2500, 64}},
        SparseMlaCase{"v32_32_heads", 512, 64, 32, 300, 64, {400, 250}},
        // Enough blocks that the positions are not split (one block per row and 16 heads).
        SparseMlaCase{"v32_16_heads_unsplit", 512, 64, 16, 256, 64, std::vector<int>(270, 300)},
        SparseMlaCase{"v32_8_heads_odd_scales", 512, 64, 8, 500, 64, {900, 450}, false, true},
        SparseMlaCase{"tiny_model", 64, 32, 4, 32, 16, {50, 1, 33, 7}},
        SparseMlaCase{"tiny_shape_48_heads", 64, 32, 48, 100, 16, {150, 33}},
        SparseMlaCase{"tiny_shape_20_heads", 64, 32, 20, 40, 16, {70, 2}},
        // Dense causal rows (MLA layers without an indexer): every position up to the row's.
        SparseMlaCase{"v32_causal_32_heads", 512, 64, 32, 8192, 64, {3000, 1, 700, 65}, true},
        SparseMlaCase{"v32_causal_64_heads", 512, 64, 64, 4096, 64, {4000, 129}, true},
        SparseMlaCase{"v32_causal_16_heads", 512, 64, 16, 2048, 64, {2000, 64}, true},
        SparseMlaCase{"tiny_shape_causal", 64, 32, 4, 256, 16, {50, 1, 33}, true},
        // Longer than kSparseMlaMaxSplits blocks of 2048 positions hold (Kimi's dense layers at
        // 128K context): more splits than the cost model's range, partials sized for them.
        SparseMlaCase{"tiny_shape_causal_128k", 64, 32, 4, 131136, 64, {131100, 70000, 2}, true},
        SparseMlaCase{"v32_causal_32_heads_100k", 512, 64, 32, 102400, 64, {100000}, true},
        // 64-head blocks in 32-position halves: split and unsplit rows, padded heads, odd
        // scales, causal rows ending inside a half.
        // clang-format off
        SparseMlaCase{"v32_128_heads_halves", 512, 64, 128, 2048, 64, {3000, 1, 700}, false, false, true},
        SparseMlaCase{"v32_40_heads_halves_odd_scales", 512, 64, 40, 2048, 64, {2500, 64, 33}, false, true, true},
        SparseMlaCase{"v32_128_heads_halves_unsplit", 512, 64, 128, 256, 64, std::vector<int>(140, 300), false, false, true},
        SparseMlaCase{"v32_causal_64_heads_halves", 512, 64, 64, 4096, 64, {4000, 129, 17}, true, false, true}),
    // clang-format on
    [](const testing::TestParamInfo<SparseMlaCase> &info) { return info.param.name; });

// Host arithmetic, no GPU needed: a workspace sized for `rows` holds the partials of any launch
// of fewer rows at the most splits those may take (a few rows split further than many), so a
// device that sizes it once for its largest step never runs out.
TEST(SparseMlaDecodeWorkspace, HoldsEveryLaunchOfAtMostItsRows) {
  const int32_t heads = 32, latent = 512;
  for (const int32_t topK : {64, 2048, 8227, 70000, 262144})
    for (int32_t rows = 1; rows <= 40; ++rows) {
      const size_t bytes = cuda::sparseMlaWorkspaceBytes(rows, heads, latent, topK);
      for (int32_t fewer = 1; fewer <= rows; ++fewer) {
        const size_t partials = size_t(fewer) * heads *
                                size_t(cuda::sparseMlaMaxSplitsForRows(topK, fewer)) *
                                (size_t(latent) + 2) * sizeof(float);
        EXPECT_GE(bytes, partials)
            << "topK " << topK << ", sized for " << rows << ", " << fewer << " rows";
      }
    }
  EXPECT_EQ(cuda::sparseMlaMaxSplitsForRows(8227, cuda::kSparseMlaFewRows),
            cuda::kSparseMlaMaxLongSplits);
  EXPECT_EQ(cuda::sparseMlaMaxSplitsForRows(8227, cuda::kSparseMlaFewRows + 1),
            cuda::kSparseMlaMaxSplits);
}

TEST(SparseMlaDecodeCudaErrors, RejectsUnsupportedShapes) {
  cuda::SparseMlaDecodeParams p; // nothing set
  EXPECT_EQ(cuda::launchSparseMlaDecode(p, nullptr), int(cudaErrorInvalidValue));
}

} // namespace
} // namespace hybrid::kernels
