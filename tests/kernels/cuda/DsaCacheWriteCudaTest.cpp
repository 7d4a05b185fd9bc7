// The DSA cache writers on CUDA (DsaCacheWrite.h) against the reference packers: every token of
// several sequences written into shuffled pages, the whole pool compared byte for byte with the
// pool ref::packLatentToken / ref::packIndexKeyToken write (untouched bytes included), on values
// from 1e-3 to 1e3, exact zeros, a zero tile and a non-finite MXFP8 block. Labelled `gpu`.
#include "hybrid/kernels/cuda/DsaCacheWrite.h"
#include "hybrid/kernels/cuda/SparseMla.h"
#include "hybrid/kernels/ref/PagedCacheLayout.h"
#include "CudaTestSupport.h"

#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace hybrid::kernels {
namespace {

// Tokens of the given sequence lengths over a shuffled pool: where each goes, and its values.
struct Step {
  std::vector<int32_t> positions, sequences, tables;
  int32_t maxPages = 0, pages = 0;

  Step(const std::vector<int> &lengths, int pageTokens, std::mt19937 &rng) {
    for (int length : lengths) {
      maxPages = std::max(maxPages, (length + pageTokens - 1) / pageTokens);
      pages += (length + pageTokens - 1) / pageTokens;
    }
    pages += 2;
    std::vector<int32_t> physical(static_cast<size_t>(pages));
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), rng);
    tables.assign(lengths.size() * size_t(maxPages), -1);
    size_t next = 0;
    for (size_t b = 0; b < lengths.size(); ++b)
      for (int s = 0; s < lengths[b]; ++s) {
        if (s % pageTokens == 0)
          tables[b * maxPages + s / pageTokens] = physical[next++];
        positions.push_back(s);
        sequences.push_back(int32_t(b));
      }
  }
  int tokens() const { return int(positions.size()); }
  // Token t's page and its bytes in a host pool of such pages.
  std::span<uint8_t> page(std::vector<uint8_t> &pool, int t, int pageTokens, size_t pageBytes) const {
    const int32_t physical = tables[size_t(sequences[t]) * maxPages + positions[t] / pageTokens];
    return {pool.data() + physical * pageBytes, pageBytes};
  }
};

// The step's placement on the device, as the writers take it.
struct DeviceStep {
  DeviceBuffer<int32_t> positions, sequences, tables;
  cuda::PagedTokens where;
  DeviceStep(const Step &step, int pageTokens)
      : positions(step.positions), sequences(step.sequences), tables(step.tables),
        where{step.tokens(), positions.data, sequences.data, tables.data, step.maxPages,
              pageTokens} {}
};

void expectIdenticalPools(const std::vector<uint8_t> &got, const std::vector<uint8_t> &expected) {
  ASSERT_EQ(got.size(), expected.size());
  size_t differing = 0, first = got.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != expected[i] && differing++ == 0)
      first = i;
  EXPECT_EQ(differing, 0u) << "first differing byte " << first;
}

// Rows of `width` values whose magnitude varies by row (1e-3 .. 1e3), with zeros mixed in and
// row 1's first `zeroRun` values all zero.
std::vector<float> values(int rows, int width, std::mt19937 &rng, int zeroRun) {
  std::vector<float> v = random(size_t(rows) * width, rng, 1.0f);
  for (int r = 0; r < rows; ++r) {
    const float magnitude = std::pow(10.0f, float(r % 7) - 3.0f);
    for (int i = 0; i < width; ++i) {
      float &x = v[size_t(r) * width + i];
      x = (i % 13 == 5 || (r == 1 && i < zeroRun)) ? 0.0f : x * magnitude;
    }
  }
  return v;
}

struct LatentCase {
  std::string name;
  int latent, rope, pageTokens;
};
class WriteLatentRowsCuda : public testing::TestWithParam<LatentCase> {};

TEST_P(WriteLatentRowsCuda, BitIdenticalToTheReferencePacker) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const LatentCase c = GetParam();
  std::mt19937 rng(31);
  const Step step({70, 1, 130}, c.pageTokens, rng);
  ref::PagedCacheLayout layout;
  layout.pageTokens = c.pageTokens;
  layout.latentDim = c.latent;
  layout.ropeDim = c.rope;
  layout.indexDim = 64;
  const auto pageBytes = size_t(layout.latentPageBytes());
  const std::vector<float> latent = values(step.tokens(), c.latent, rng, 128);
  const std::vector<float> rope = values(step.tokens(), c.rope, rng, 0);
  std::vector<uint8_t> expected(size_t(step.pages) * pageBytes, 0xEE);
  for (int t = 0; t < step.tokens(); ++t) {
    ASSERT_TRUE(ref::packLatentToken(
        layout, step.page(expected, t, c.pageTokens, pageBytes), step.positions[t] % c.pageTokens,
        std::span<const float>(latent).subspan(size_t(t) * c.latent, size_t(c.latent)),
        std::span<const float>(rope).subspan(size_t(t) * c.rope, size_t(c.rope))));
  }
  DeviceBuffer<float> dLatent(latent), dRope(rope);
  const DeviceStep placed(step, c.pageTokens);
  DeviceBuffer<uint8_t> dPages{std::vector<uint8_t>(expected.size(), 0xEE)};
  cuda::LatentWriteParams p;
  p.where = placed.where;
  p.latentDim = c.latent;
  p.ropeDim = c.rope;
  p.latent = dLatent.data;
  p.rope = dRope.data;
  p.pages = dPages.data;
  ASSERT_EQ(cuda::launchWriteLatentRows(p, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expectIdenticalPools(dPages.download(), expected);
}

INSTANTIATE_TEST_SUITE_P(Shapes, WriteLatentRowsCuda,
                         testing::Values(LatentCase{"v32", 512, 64, 64},
                                         LatentCase{"tiny_model", 64, 32, 16}),
                         [](const auto &info) { return info.param.name; });

struct KeyCase {
  std::string name;
  cuda::IndexKeyType type;
  cuda::IndexKeyScale scale;
  int dim, pageTokens;
};
class WriteIndexKeysCuda : public testing::TestWithParam<KeyCase> {};

TEST_P(WriteIndexKeysCuda, BitIdenticalToTheReferencePacker) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const KeyCase c = GetParam();
  std::mt19937 rng(32);
  const Step step({70, 1, 130}, c.pageTokens, rng);
  ref::PagedCacheLayout layout;
  layout.pageTokens = c.pageTokens;
  layout.latentDim = 64;
  layout.ropeDim = 32;
  layout.indexDim = c.dim;
  layout.indexFormat = c.type == cuda::IndexKeyType::F32     ? ref::IndexKeyFormat::F32
                       : c.type == cuda::IndexKeyType::Mxfp8 ? ref::IndexKeyFormat::Mxfp8
                                                             : ref::IndexKeyFormat::Fp8PerKey;
  const ref::Fp8ScaleRule rule = c.scale == cuda::IndexKeyScale::DeepSeekUe8m0
                                     ? ref::Fp8ScaleRule::DeepSeekUe8m0
                                     : ref::Fp8ScaleRule::DeepSeekLinear;
  const auto pageBytes = size_t(layout.indexPageBytes());
  ASSERT_EQ(int64_t(pageBytes), cuda::indexerPageBytes(c.type, c.pageTokens, c.dim));
  std::vector<float> keys = values(step.tokens(), c.dim, rng, 32);
  if (c.type == cuda::IndexKeyType::Mxfp8) // a non-finite block: NaN codes and scale
    keys[size_t(2) * c.dim + 3] = std::numeric_limits<float>::infinity();
  std::vector<uint8_t> expected(size_t(step.pages) * pageBytes, 0xEE);
  for (int t = 0; t < step.tokens(); ++t) {
    ASSERT_TRUE(ref::packIndexKeyToken(
        layout, step.page(expected, t, c.pageTokens, pageBytes), step.positions[t] % c.pageTokens,
        std::span<const float>(keys).subspan(size_t(t) * c.dim, size_t(c.dim)), rule));
  }
  DeviceBuffer<float> dKeys(keys);
  const DeviceStep placed(step, c.pageTokens);
  DeviceBuffer<uint8_t> dPages{std::vector<uint8_t>(expected.size(), 0xEE)};
  cuda::IndexKeyWriteParams p;
  p.where = placed.where;
  p.dim = c.dim;
  p.type = c.type;
  p.scale = c.scale;
  p.keys = dKeys.data;
  p.pages = dPages.data;
  ASSERT_EQ(cuda::launchWriteIndexKeys(p, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expectIdenticalPools(dPages.download(), expected);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, WriteIndexKeysCuda,
    testing::Values(
        KeyCase{"mxfp8_128", cuda::IndexKeyType::Mxfp8, cuda::IndexKeyScale::DeepSeekUe8m0, 128, 64},
        KeyCase{"mxfp8_64_small_pages", cuda::IndexKeyType::Mxfp8,
                cuda::IndexKeyScale::DeepSeekUe8m0, 64, 16},
        KeyCase{"fp8_ue8m0", cuda::IndexKeyType::Fp8PerKey, cuda::IndexKeyScale::DeepSeekUe8m0,
                128, 64},
        KeyCase{"fp8_linear", cuda::IndexKeyType::Fp8PerKey, cuda::IndexKeyScale::DeepSeekLinear,
                128, 64},
        KeyCase{"f32", cuda::IndexKeyType::F32, cuda::IndexKeyScale::DeepSeekUe8m0, 64, 16}),
    [](const auto &info) { return info.param.name; });

TEST(DsaCacheWriteCudaErrors, RejectsBadShapes) {
  cuda::LatentWriteParams latent;
  EXPECT_EQ(cuda::launchWriteLatentRows(latent, nullptr), int(cudaErrorInvalidValue));
  cuda::IndexKeyWriteParams keys;
  EXPECT_EQ(cuda::launchWriteIndexKeys(keys, nullptr), int(cudaErrorInvalidValue));
}

} // namespace
} // namespace hybrid::kernels
