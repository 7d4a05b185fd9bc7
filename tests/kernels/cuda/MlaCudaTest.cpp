// The MLA pieces on CUDA (Mla.h) and the small kernels the DSA prolog needs (LayerNorm, MXFP8
// round trip, sigmoid gate) against the reference: RoPE in both pairings, the cache rows of a
// step, absorption / expansion through kv_b_proj in bf16 and fp32, and the CUDA-core latent
// attention over scattered pages in both row formats, sparse and dense causal. Labelled `gpu`;
// skipped without a GPU.
#include "CudaTestSupport.h"
#include "hybrid/kernels/cuda/DsaCacheWrite.h"
#include "hybrid/kernels/cuda/Elementwise.h"
#include "hybrid/kernels/cuda/Linear.h"
#include "hybrid/kernels/cuda/Mla.h"
#include "hybrid/kernels/cuda/Norm.h"
#include "hybrid/kernels/ref/Mla.h"
#include "hybrid/kernels/ref/Norm.h"
#include "hybrid/kernels/ref/PagedCacheLayout.h"
#include "hybrid/kernels/ref/Quant.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <numeric>
#include <vector>

namespace hybrid::kernels {
namespace {

#define SKIP_WITHOUT_GPU()                                                                         \
  if (!gpuPresent())                                                                               \
  GTEST_SKIP() << "no CUDA device"

double maxAbsDiff(const std::vector<float> &a, const std::vector<float> &b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  return worst;
}

// A RoPE launch over `x` [rows, heads, headDim] on the device: dims rotated dimensions from
// `offset` in each head, one position a row; the rounding fields are the test's to set.
struct RopeOnDevice {
  DeviceBuffer<float> x, frequencies;
  DeviceBuffer<int32_t> positions;
  cuda::RopeParams params;
  RopeOnDevice(const std::vector<float> &values, const std::vector<float> &inverseFrequencies,
               const std::vector<int32_t> &rowPositions, int heads, int headDim, int offset,
               int dims, cuda::RopePairing pairing)
      : x(values), frequencies(inverseFrequencies), positions(rowPositions) {
    params.rows = int32_t(rowPositions.size());
    params.heads = heads;
    params.rowStride = heads * headDim;
    params.headStride = headDim;
    params.offset = offset;
    params.dims = dims;
    params.pairing = pairing;
    params.inverseFrequencies = frequencies.data;
    params.positions = positions.data;
    params.x = x.data;
  }
  // The launch's values, or empty where it or the synchronization failed (a test failure).
  std::vector<float> run() {
    const int status = cuda::launchRope(params, nullptr);
    EXPECT_EQ(status, 0);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return status == 0 ? x.download() : std::vector<float>{};
  }
};

// The reference's rotation of the same values.
std::vector<float> referenceRope(std::vector<float> x, const std::vector<float> &frequencies,
                                 const std::vector<int32_t> &positions, int heads, int headDim,
                                 int offset, int dims, ref::RopeLayout layout) {
  for (size_t r = 0; r < positions.size(); ++r)
    for (int h = 0; h < heads; ++h)
      ref::applyRope({x.data() + (r * heads + h) * headDim + offset, size_t(dims)}, positions[r],
                     frequencies, layout);
  return x;
}

TEST(MlaCuda, RopeMatchesTheReferenceInBothPairings) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  const int rows = 5, heads = 19, headDim = 48, offset = 16, dims = 32; // 3 groups of heads
  const std::vector<float> frequencies = ref::ropeInverseFrequencies(dims, 10000.0);
  const std::vector<int32_t> positions = {0, 1, 17, 4095, 131071};
  for (auto [pairing, layout] : {std::pair{cuda::RopePairing::Interleaved, ref::RopeLayout::Interleaved},
                                 {cuda::RopePairing::HalfSplit, ref::RopeLayout::HalfSplit}}) {
    const std::vector<float> x = random(size_t(rows) * heads * headDim, rng, 1.0f);
    RopeOnDevice rope(x, frequencies, positions, heads, headDim, offset, dims, pairing);
    const std::vector<float> got = rope.run();
    ASSERT_EQ(got.size(), x.size());
    // cosf/sinf of the same fp32 angles: a few ulp of the values.
    EXPECT_LT(maxAbsDiff(got, referenceRope(x, frequencies, positions, heads, headDim, offset,
                                            dims, layout)),
              1e-5);
  }
}

// The indexer's prolog: RoPE on each head's leading dims, then the whole row rounded to MXFP8, in
// one launch, bit for bit the reference's rounding of the rotated values.
TEST(MlaCuda, RopeThenMxfp8InOneLaunch) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  const int rows = 3, heads = 20, headDim = 64, dims = 32; // heads in groups, the last short
  const std::vector<float> frequencies = ref::ropeInverseFrequencies(dims, 10000.0);
  const std::vector<int32_t> positions = {0, 7, 9000};
  const std::vector<float> x = random(size_t(rows) * heads * headDim, rng, 2.0f);
  RopeOnDevice rope(x, frequencies, positions, heads, headDim, 0, dims,
                    cuda::RopePairing::HalfSplit);
  rope.params.mxfp8Width = heads * headDim;
  const std::vector<float> got = rope.run();
  ASSERT_EQ(got.size(), x.size());
  // The reference rounding of the GPU's rotated values must give the GPU's values back: the
  // rounding is idempotent, and a rotation differing from the reference's by an ulp would still
  // round to a representable neighbour, so also compare with the reference pipeline closely.
  std::vector<float> expected =
      referenceRope(x, frequencies, positions, heads, headDim, 0, dims, ref::RopeLayout::HalfSplit);
  std::vector<float> again = got;
  ASSERT_TRUE(ref::roundTripMxfp8(expected, rows * heads, headDim, ref::MxScaleRule::RoundUp));
  ASSERT_TRUE(ref::roundTripMxfp8(again, rows * heads, headDim, ref::MxScaleRule::RoundUp));
  EXPECT_EQ(again, got) << "every value is an MXFP8 value";
  EXPECT_LT(relativeRms(got, expected), 1e-3); // a rotated value off by an ulp may round apart
  size_t same = 0;
  for (size_t i = 0; i < got.size(); ++i)
    same += got[i] == expected[i];
  EXPECT_GE(same, got.size() * 99 / 100);
  rope.params.mxfp8Width = 33; // not whole blocks
  EXPECT_EQ(cuda::launchRope(rope.params, nullptr), int(cudaErrorInvalidValue));
}

// DeepSeek-V3.2's own indexer prolog: RoPE, then each head's values rounded to FP8 with one ue8m0
// scale a head (the queries; a key is a row of one head), bit for bit the reference's rounding of
// the rotated values; a NaN stays NaN without moving its head's scale.
TEST(MlaCuda, RopeThenFp8PerHeadInOneLaunch) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(12);
  for (const int heads : {64, 1}) {
    SCOPED_TRACE(std::to_string(heads) + " heads");
    const int rows = 3, headDim = 128, dims = 64;
    const std::vector<float> frequencies = ref::ropeInverseFrequencies(dims, 10000.0);
    const std::vector<int32_t> positions = {0, 5, 70000};
    std::vector<float> x = random(size_t(rows) * heads * headDim, rng, 3.0f);
    x[size_t(headDim) + 100] = std::nanf(""); // row 0: head 1 (a key row: row 0's key)
    RopeOnDevice rope(x, frequencies, positions, heads, headDim, 0, dims,
                      cuda::RopePairing::HalfSplit);
    rope.params.fp8Width = heads * headDim;
    rope.params.fp8Group = headDim;
    const std::vector<float> got = rope.run();
    ASSERT_EQ(got.size(), x.size());
    const int64_t groups = int64_t(rows) * heads;
    std::vector<float> expected = referenceRope(x, frequencies, positions, heads, headDim, 0, dims,
                                                ref::RopeLayout::HalfSplit);
    std::vector<float> again = got;
    ASSERT_TRUE(ref::roundTripFp8Tiles(expected, groups, headDim, headDim,
                                       ref::Fp8ScaleRule::DeepSeekUe8m0));
    ASSERT_TRUE(
        ref::roundTripFp8Tiles(again, groups, headDim, headDim, ref::Fp8ScaleRule::DeepSeekUe8m0));
    size_t same = 0, nans = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      nans += std::isnan(got[i]);
      same += got[i] == expected[i] || (std::isnan(got[i]) && std::isnan(expected[i]));
      if (!std::isnan(got[i])) {
        EXPECT_EQ(again[i], got[i]) << "value " << i << " is not an FP8-per-head value";
      }
    }
    EXPECT_EQ(nans, 1u);
    EXPECT_GE(same, got.size() * 99 / 100); // a rotated value off by an ulp may round apart
  }
}

TEST(MlaCuda, LatentRowsAreTheNormalisedLatentAndTheRotatedKey) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(6);
  const int rows = 4, latentDim = 512, ropeDim = 64;
  const std::vector<float> kvA = random(size_t(rows) * (latentDim + ropeDim), rng, 2.0f);
  const std::vector<float> weight = random(latentDim, rng, 0.1f, 1.0f);
  const std::vector<float> frequencies = ref::ropeInverseFrequencies(ropeDim, 10000.0);
  const std::vector<int32_t> positions = {3, 0, 900, 65};
  std::vector<float> latent(size_t(rows) * latentDim), rope(size_t(rows) * ropeDim);
  for (int r = 0; r < rows; ++r) {
    const float *row = kvA.data() + r * (latentDim + ropeDim);
    ref::rmsNorm({row, size_t(latentDim)}, weight, {latent.data() + r * latentDim, size_t(latentDim)},
                 1, latentDim, 1e-6f);
    std::copy_n(row + latentDim, ropeDim, rope.data() + r * ropeDim);
    ref::applyRope({rope.data() + r * ropeDim, size_t(ropeDim)}, positions[size_t(r)], frequencies,
                   ref::RopeLayout::Interleaved);
  }
  DeviceBuffer<float> dKvA(kvA), dWeight(weight), dFrequencies(frequencies);
  DeviceBuffer<int32_t> dPositions(positions);
  DeviceBuffer<float> dLatent{std::vector<float>(latent.size())}, dRope{std::vector<float>(rope.size())};
  cuda::MlaLatentRowsParams p;
  p.rows = rows;
  p.latentDim = latentDim;
  p.ropeDim = ropeDim;
  p.epsilon = 1e-6f;
  p.kvA = dKvA.data;
  p.normWeight = dWeight.data;
  p.inverseFrequencies = dFrequencies.data;
  p.positions = dPositions.data;
  p.latent = dLatent.data;
  p.rope = dRope.data;
  ASSERT_EQ(cuda::launchMlaLatentRows(p, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_LT(relativeRms(dLatent.download(), latent), 1e-6);
  EXPECT_LT(maxAbsDiff(dRope.download(), rope), 1e-5);
  // NoPE: the key part is copied as it is.
  p.inverseFrequencies = nullptr;
  ASSERT_EQ(cuda::launchMlaLatentRows(p, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> raw = dRope.download();
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < ropeDim; ++i)
      EXPECT_EQ(raw[size_t(r * ropeDim + i)], kvA[size_t(r * (latentDim + ropeDim) + latentDim + i)]);
}

// kv_b_proj [rows, columns] as DeepSeek-V3.2 stores it: E4M3 codes with one scale per 128 x 128
// block (in the FP8 GEMM's padded layout), and the values the cpu reads (code times scale).
struct Fp8Rows {
  std::vector<uint8_t> codes;
  std::vector<float> scales, values;
  int64_t scaleStride = 0;
};
Fp8Rows quantizedFp8Rows(const std::vector<float> &dense, int64_t rows, int64_t columns) {
  Fp8Rows q;
  q.scaleStride = cuda::linearFp8WeightScaleStride(columns);
  const int64_t blockRows = (rows + 127) / 128, blockColumns = (columns + 127) / 128;
  q.scales.assign(size_t(blockRows * q.scaleStride), 0.0f);
  q.codes.resize(dense.size());
  q.values.resize(dense.size());
  for (int64_t br = 0; br < blockRows; ++br)
    for (int64_t bc = 0; bc < blockColumns; ++bc) {
      float amax = 0.0f;
      for (int64_t r = br * 128; r < std::min(rows, (br + 1) * 128); ++r)
        for (int64_t c = bc * 128; c < std::min(columns, (bc + 1) * 128); ++c)
          amax = std::max(amax, std::fabs(dense[size_t(r * columns + c)]));
      const float scale = amax > 0.0f ? amax / ref::kE4M3Max : 1.0f;
      q.scales[size_t(br * q.scaleStride + bc)] = scale;
      for (int64_t r = br * 128; r < std::min(rows, (br + 1) * 128); ++r)
        for (int64_t c = bc * 128; c < std::min(columns, (bc + 1) * 128); ++c) {
          const size_t i = size_t(r * columns + c);
          q.codes[i] = ref::floatToE4M3(dense[i] / scale);
          q.values[i] = ref::e4m3ToFloat(q.codes[i]) * scale;
        }
    }
  return q;
}

// Absorption and expansion against ref::absorbMlaQueries / expandLatentOutputs, with kv_b_proj
// stored in bf16 (the reference reads the same rounded values), fp32, or FP8 codes with block
// scales (the reference reads code times scale).
TEST(MlaCuda, AbsorptionAndExpansionMatchTheReference) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  struct Shape { int heads, nope, rope, value, latent, rows; };
  // Decode rows (<= 8) of bf16 weights take the column-sliced absorption and the batched decode
  // linear kernel; 320 latent columns leave the second 256-column slice part empty; 3 heads of
  // 192 nope dims over 144 latent columns, 9 rows (two row blocks).
  for (Shape s : {Shape{16, 128, 64, 128, 512, 11}, Shape{2, 64, 32, 64, 64, 3},
                  Shape{32, 128, 64, 128, 512, 1}, Shape{4, 128, 64, 128, 320, 8},
                  Shape{3, 192, 32, 64, 144, 9}})
    for (cuda::WeightType type :
         {cuda::WeightType::BF16, cuda::WeightType::F32, cuda::WeightType::Fp8Block}) {
      const bool bf16 = type == cuda::WeightType::BF16;
      std::vector<float> kvB = random(size_t(s.heads) * (s.nope + s.value) * s.latent, rng, 0.05f);
      if (bf16)
        kvB = roundedToBf16(kvB);
      const Fp8Rows fp8 = quantizedFp8Rows(kvB, int64_t(s.heads) * (s.nope + s.value), s.latent);
      if (type == cuda::WeightType::Fp8Block)
        kvB = fp8.values;
      const std::vector<float> queries = random(size_t(s.rows) * s.heads * (s.nope + s.rope), rng, 1.0f);
      const std::vector<float> latentOut = random(size_t(s.rows) * s.heads * s.latent, rng, 1.0f);
      ref::MlaAttentionParams m;
      m.numQueries = s.rows;
      m.numHeads = s.heads;
      m.nopeDim = s.nope;
      m.ropeDim = s.rope;
      m.valueDim = s.value;
      m.latentDim = s.latent;
      m.queries = queries.data();
      m.kvBProj = kvB.data();
      std::vector<float> absorbed(size_t(s.rows) * s.heads * (s.latent + s.rope));
      std::vector<float> expanded(size_t(s.rows) * s.heads * s.value);
      ref::absorbMlaQueries(m, absorbed.data());
      ref::expandLatentOutputs(m, latentOut.data(), expanded.data());

      const std::vector<uint16_t> bits = bf16Bits(kvB);
      DeviceBuffer<float> dKvB32(kvB);
      DeviceBuffer<uint16_t> dKvB16(bits);
      DeviceBuffer<uint8_t> dKvB8(fp8.codes);
      DeviceBuffer<float> dScales(fp8.scales);
      DeviceBuffer<float> dQueries(queries), dLatentOut(latentOut);
      DeviceBuffer<float> dAbsorbed{std::vector<float>(absorbed.size())};
      DeviceBuffer<float> dExpanded{std::vector<float>(expanded.size())};
      cuda::MlaHeadWeights w;
      w.heads = s.heads;
      w.nopeDim = s.nope;
      w.valueDim = s.value;
      w.latentDim = s.latent;
      w.kvB = bf16                                 ? static_cast<const void *>(dKvB16.data)
              : type == cuda::WeightType::Fp8Block ? static_cast<const void *>(dKvB8.data)
                                                   : dKvB32.data;
      w.type = type;
      w.kvBScales = dScales.data;
      w.kvBScaleStride = fp8.scaleStride;
      ASSERT_EQ(cuda::launchMlaAbsorbQueries(w, s.rows, s.rope, dQueries.data, dAbsorbed.data, nullptr), 0);
      ASSERT_EQ(cuda::launchMlaExpandOutputs(w, s.rows, dLatentOut.data, dExpanded.data, nullptr), 0);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_LT(relativeRms(dAbsorbed.download(), absorbed), 1e-6)
          << "heads " << s.heads << ", type " << int(type);
      EXPECT_LT(relativeRms(dExpanded.download(), expanded), 1e-6)
          << "heads " << s.heads << ", type " << int(type);
    }
}

// Batch invariance (LoadOptions::batchInvariant): with rowInvariant, the expansion of a row has
// the same bits in calls of 1, 5 and 12 rows (without it, decode rows take the GEMV and 12 rows
// the other kernel), and so has the absorption, which has one form for every row count; FP8
// kv_b_proj has one form of each for every row count.
class MlaRowInvariance : public testing::TestWithParam<cuda::WeightType> {};

TEST_P(MlaRowInvariance, AbsorptionAndExpansionGiveTheSameBitsAtAnyRows) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(9);
  constexpr int heads = 32, nope = 128, rope = 64, value = 128, latent = 512, most = 12;
  const std::vector<float> kvB =
      roundedToBf16(random(size_t(heads) * (nope + value) * latent, rng, 0.05f));
  const std::vector<float> queries = random(size_t(most) * heads * (nope + rope), rng, 1.0f);
  const std::vector<float> latentOut = random(size_t(most) * heads * latent, rng, 1.0f);
  const Fp8Rows fp8 = quantizedFp8Rows(kvB, int64_t(heads) * (nope + value), latent);
  DeviceBuffer<uint16_t> dKvB(bf16Bits(kvB));
  DeviceBuffer<uint8_t> dKvB8(fp8.codes);
  DeviceBuffer<float> dScales(fp8.scales);
  DeviceBuffer<float> dQueries(queries), dLatentOut(latentOut);
  cuda::MlaHeadWeights w;
  w.heads = heads;
  w.nopeDim = nope;
  w.valueDim = value;
  w.latentDim = latent;
  w.type = GetParam();
  w.kvB = w.type == cuda::WeightType::Fp8Block ? static_cast<const void *>(dKvB8.data)
                                               : static_cast<const void *>(dKvB.data);
  w.kvBScales = dScales.data;
  w.kvBScaleStride = fp8.scaleStride;
  auto run = [&](int rows) {
    DeviceBuffer<float> absorbed{std::vector<float>(size_t(rows) * heads * (latent + rope))};
    DeviceBuffer<float> expanded{std::vector<float>(size_t(rows) * heads * value)};
    EXPECT_EQ(cuda::launchMlaAbsorbQueries(w, rows, rope, dQueries.data, absorbed.data, nullptr),
              0);
    EXPECT_EQ(cuda::launchMlaExpandOutputs(w, rows, dLatentOut.data, expanded.data, nullptr,
                                           /*rowInvariant=*/true),
              0);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return std::pair(absorbed.download(), expanded.download());
  };
  const auto [allAbsorbed, allExpanded] = run(most);
  for (int rows : {1, 5}) {
    const auto [absorbed, expanded] = run(rows);
    EXPECT_TRUE(std::equal(
        absorbed.begin(), absorbed.end(), allAbsorbed.begin(),
        [](float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }))
        << "absorption, " << rows << " rows vs " << most;
    EXPECT_TRUE(std::equal(
        expanded.begin(), expanded.end(), allExpanded.begin(),
        [](float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }))
        << "expansion, " << rows << " rows vs " << most;
  }
}

INSTANTIATE_TEST_SUITE_P(Weights, MlaRowInvariance,
                         testing::Values(cuda::WeightType::BF16, cuda::WeightType::Fp8Block));

struct AttentionCase {
  std::string name;
  cuda::LatentCacheType type;
  bool sparse;
  int latent, rope, heads, pageTokens, topK;
  std::vector<int> lengths;
};

class LatentAttentionCuda : public testing::TestWithParam<AttentionCase> {};

// Rows written by the cache writer into shuffled pages; the reference attends over the values the
// pages hold (for FP8 rows: unpacked by ref::unpackLatentToken).
TEST_P(LatentAttentionCuda, MatchesReference) {
  SKIP_WITHOUT_GPU();
  const AttentionCase c = GetParam();
  std::mt19937 rng(8);
  const bool fp8 = c.type == cuda::LatentCacheType::Fp8Tiles;
  const int64_t rowBytes = cuda::latentRowBytes(c.type, c.latent, c.rope);
  int maxPages = 0, totalPages = 1;
  for (int length : c.lengths) {
    maxPages = std::max(maxPages, (length + c.pageTokens - 1) / c.pageTokens);
    totalPages += (length + c.pageTokens - 1) / c.pageTokens;
  }
  std::vector<int32_t> physical(static_cast<size_t>(totalPages));
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  std::vector<int32_t> tables(c.lengths.size() * size_t(maxPages), 0);
  // Every sequence's rows written in one call of the writer: positions, sequences, values.
  std::vector<int32_t> writePositions, writeSequences;
  std::vector<float> latents, ropes;
  size_t next = 0;
  for (size_t b = 0; b < c.lengths.size(); ++b)
    for (int s = 0; s < c.lengths[b]; ++s) {
      if (s % c.pageTokens == 0)
        tables[b * maxPages + s / c.pageTokens] = physical[next++];
      writePositions.push_back(s);
      writeSequences.push_back(int32_t(b));
    }
  latents = random(writePositions.size() * c.latent, rng, 1.0f);
  ropes = random(writePositions.size() * c.rope, rng, 1.0f);
  DeviceBuffer<uint8_t> dPool{std::vector<uint8_t>(size_t(totalPages) * c.pageTokens * rowBytes, 0)};
  DeviceBuffer<int32_t> dTables(tables), dWritePositions(writePositions), dWriteSequences(writeSequences);
  DeviceBuffer<float> dLatents(latents), dRopes(ropes);
  cuda::LatentWriteParams write;
  write.where.tokens = int32_t(writePositions.size());
  write.where.positions = dWritePositions.data;
  write.where.sequences = dWriteSequences.data;
  write.where.blockTables = dTables.data;
  write.where.maxPages = maxPages;
  write.where.pageTokens = c.pageTokens;
  write.latentDim = c.latent;
  write.ropeDim = c.rope;
  write.latent = dLatents.data;
  write.rope = dRopes.data;
  write.type = c.type;
  write.pages = dPool.data;
  ASSERT_EQ(cuda::launchWriteLatentRows(write, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (fp8) { // what the pages hold
    ref::PagedCacheLayout layout;
    layout.pageTokens = c.pageTokens;
    layout.latentDim = c.latent;
    layout.ropeDim = c.rope;
    layout.indexDim = 64;
    for (size_t t = 0; t < writePositions.size(); ++t) {
      std::vector<uint8_t> page(size_t(layout.latentPageBytes()));
      ASSERT_TRUE(ref::packLatentToken(layout, page, 0,
                                       std::span(latents).subspan(t * c.latent, size_t(c.latent)),
                                       std::span(ropes).subspan(t * c.rope, size_t(c.rope))));
      ASSERT_TRUE(ref::unpackLatentToken(layout, page, 0,
                                         std::span(latents).subspan(t * c.latent, size_t(c.latent)),
                                         std::span(ropes).subspan(t * c.rope, size_t(c.rope))));
    }
  }

  // Decode-style rows (the last position of each sequence) plus, for the first sequence, a
  // causal prefill row in the middle.
  std::vector<int32_t> positions, sequences;
  for (size_t b = 0; b < c.lengths.size(); ++b) {
    positions.push_back(c.lengths[b] - 1);
    sequences.push_back(int32_t(b));
  }
  positions.push_back(c.lengths[0] / 2);
  sequences.push_back(0);
  const int rows = int(positions.size()), wide = c.latent + c.rope;
  std::vector<int32_t> indices;
  if (c.sparse) {
    indices.assign(size_t(rows) * c.topK, -1);
    for (int r = 0; r < rows; ++r) {
      std::vector<int32_t> candidates(size_t(positions[size_t(r)]) + 1);
      std::iota(candidates.begin(), candidates.end(), 0);
      std::shuffle(candidates.begin(), candidates.end(), rng);
      for (int j = 0; j < std::min<int>(c.topK - 1, int(candidates.size())); ++j)
        indices[size_t(r) * c.topK + size_t(j)] = candidates[size_t(j)];
    }
  }
  const std::vector<float> q = random(size_t(rows) * c.heads * wide, rng, 0.3f);
  const float scale = 0.125f;
  std::vector<float> expected(size_t(rows) * c.heads * c.latent);
  size_t first = 0;
  std::vector<size_t> firstRow;
  for (int length : c.lengths) {
    firstRow.push_back(first);
    first += size_t(length);
  }
  for (int r = 0; r < rows; ++r) {
    const size_t b = size_t(sequences[size_t(r)]);
    const int64_t position = positions[size_t(r)];
    ref::LatentAttentionParams l;
    l.numQueries = 1;
    l.numKeys = c.lengths[b];
    l.numHeads = c.heads;
    l.latentDim = c.latent;
    l.ropeDim = c.rope;
    l.softmaxScale = scale;
    l.queries = q.data() + size_t(r) * c.heads * wide;
    l.queryPositions = &position;
    l.latents = latents.data() + firstRow[b] * c.latent;
    l.ropeKeys = ropes.data() + firstRow[b] * c.rope;
    l.sparseIndices = c.sparse ? indices.data() + size_t(r) * c.topK : nullptr;
    l.topK = c.topK;
    l.out = expected.data() + size_t(r) * c.heads * c.latent;
    ref::latentAttention(l);
  }
  DeviceBuffer<float> dQ(q), dOut{std::vector<float>(expected.size(), -7.0f)};
  DeviceBuffer<int32_t> dPositions(positions), dSequences(sequences);
  DeviceBuffer<int32_t> dIndices(c.sparse ? indices : std::vector<int32_t>{0});
  cuda::LatentAttentionParams p;
  p.rows = rows;
  p.heads = c.heads;
  p.latentDim = c.latent;
  p.ropeDim = c.rope;
  p.softmaxScale = scale;
  p.q = dQ.data;
  p.indices = c.sparse ? dIndices.data : nullptr;
  p.topK = c.topK;
  p.positions = dPositions.data;
  p.sequences = dSequences.data;
  p.latentPages = dPool.data;
  p.cacheType = c.type;
  p.pageTokens = c.pageTokens;
  p.blockTables = dTables.data;
  p.maxPages = maxPages;
  p.out = dOut.data;
  ASSERT_EQ(cuda::launchLatentAttention(p, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // fp32 arithmetic on the same values, online softmax: summation order only.
  EXPECT_LT(relativeRms(dOut.download(), expected), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, LatentAttentionCuda,
    testing::Values(
        AttentionCase{"f32_sparse_tiny", cuda::LatentCacheType::F32, true, 64, 32, 2, 16, 8, {40, 3, 17}},
        AttentionCase{"f32_causal_tiny", cuda::LatentCacheType::F32, false, 64, 32, 2, 16, 0, {40, 1, 17}},
        AttentionCase{"f32_causal_v32", cuda::LatentCacheType::F32, false, 512, 64, 20, 64, 0, {300, 70}},
        AttentionCase{"fp8_sparse_v32", cuda::LatentCacheType::Fp8Tiles, true, 512, 64, 16, 64, 100, {500, 90}},
        AttentionCase{"fp8_causal_tiny", cuda::LatentCacheType::Fp8Tiles, false, 64, 32, 3, 16, 0, {33, 9}}),
    [](const testing::TestParamInfo<AttentionCase> &info) { return info.param.name; });

TEST(MlaCuda, LayerNormMatchesTheReference) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(9);
  const int rows = 6, dim = 128;
  const std::vector<float> x = random(size_t(rows) * dim, rng, 3.0f, 0.5f);
  const std::vector<float> weight = random(dim, rng, 0.2f, 1.0f), bias = random(dim, rng, 0.1f);
  std::vector<float> expected(x.size());
  ref::layerNorm(x, weight, bias, expected, rows, dim, 1e-6f);
  DeviceBuffer<float> dX(x), dWeight(weight), dBias(bias);
  cuda::LayerNormParams p;
  p.rows = rows;
  p.dim = dim;
  p.epsilon = 1e-6f;
  p.x = dX.data;
  p.weight = dWeight.data;
  p.bias = dBias.data;
  p.y = dX.data; // in place
  ASSERT_EQ(cuda::launchLayerNorm(p, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_LT(relativeRms(dX.download(), expected), 1e-6);
}

// Bit for bit the reference's quantize-then-dequantize, including a block with a NaN.
TEST(MlaCuda, Mxfp8RoundTripIsTheReferenceBitForBit) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(10);
  const int rows = 7, cols = 128;
  std::vector<float> x = random(size_t(rows) * cols, rng, 4.0f);
  x[5] = 1e-30f;
  x[40] = 3e5f;
  x[3 * cols + 33] = std::numeric_limits<float>::quiet_NaN();
  for (int i = 0; i < 32; ++i)
    x[size_t(4 * cols + 64 + i)] = 0.0f; // an all-zero block
  std::vector<uint8_t> codes(x.size()), scales(x.size() / 32);
  std::vector<float> expected(x.size());
  ASSERT_TRUE(ref::quantizeMxfp8(x, rows, cols, codes, scales, ref::MxScaleRule::RoundUp));
  ASSERT_TRUE(ref::dequantizeMxfp8(codes, scales, rows, cols, expected));
  DeviceBuffer<float> dX(x);
  ASSERT_EQ(cuda::launchMxfp8RoundTrip(dX.data, int64_t(x.size()), nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = dX.download();
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(expected[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
      continue;
    }
    uint32_t a, b;
    std::memcpy(&a, &got[i], 4);
    std::memcpy(&b, &expected[i], 4);
    EXPECT_EQ(a, b) << "value " << i << " (" << x[i] << ")";
  }
  EXPECT_EQ(cuda::launchMxfp8RoundTrip(dX.data, 33, nullptr), int(cudaErrorInvalidValue));
}

TEST(MlaCuda, SigmoidGateAndBadShapes) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> x = {1.0f, -2.0f, 3.0f}, gate = {0.0f, 2.0f, -40.0f};
  DeviceBuffer<float> dX(x), dGate(gate);
  ASSERT_EQ(cuda::launchSigmoidGate(dX.data, dGate.data, 3, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = dX.download();
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_NEAR(got[i], x[i] / (1.0f + std::exp(-gate[i])), 1e-6f);
  cuda::LatentAttentionParams attention; // nothing set
  EXPECT_EQ(cuda::launchLatentAttention(attention, nullptr), int(cudaErrorInvalidValue));
  cuda::MlaHeadWeights w;
  EXPECT_EQ(cuda::launchMlaAbsorbQueries(w, 1, 0, dX.data, dX.data, nullptr),
            int(cudaErrorInvalidValue));
  w = {2, 64, 64, 1024, dX.data, cuda::WeightType::F32}; // latent wider than the kernels hold
  EXPECT_EQ(cuda::launchMlaExpandOutputs(w, 1, dX.data, dX.data, nullptr), int(cudaErrorInvalidValue));
  cuda::RopeParams rope;
  rope.rows = 1;
  rope.dims = 3;
  EXPECT_EQ(cuda::launchRope(rope, nullptr), int(cudaErrorInvalidValue));
}

} // namespace
} // namespace hybrid::kernels
