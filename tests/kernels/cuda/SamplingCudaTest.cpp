// The GPU token choice against ref::sampleToken on the same logits and uniform numbers: greedy,
// temperatures, top-k (small, large, ties), top-p (narrow, wide), both together, at a small and
// at Kimi's 163,840-word vocabulary, NaN and infinite logits. The ids must be equal (the
// definition's sums are fp64 on both). Labelled `gpu`; skipped without a GPU.
#include "hybrid/kernels/cuda/Sampling.h"
#include "hybrid/kernels/ref/Sampling.h"
#include "CudaTestSupport.h"

#include <cstring>
#include <string>
#include <vector>

namespace hybrid::kernels {
namespace {

struct Case {
  std::string name;
  int64_t vocab;
  float temperature;
  int32_t topK;
  float topP;
};

class SamplingCuda : public testing::TestWithParam<Case> {};

TEST_P(SamplingCuda, ChoosesTheReferenceToken) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const Case c = GetParam();
  const int rows = 48;
  std::mt19937 rng(uint32_t(c.vocab + c.topK * 7 + int(c.topP * 100)));
  // Logits spread like a model's (a few large, a long tail), some rows with exact ties.
  std::vector<float> logits = random(size_t(rows) * size_t(c.vocab), rng, 4.0f);
  for (int r = 0; r < rows; r += 6)
    for (int64_t i = 0; i < c.vocab; i += 3)
      logits[size_t(r * c.vocab + i)] = 2.5f; // a third of the row tied
  logits[size_t(5 * c.vocab + 3)] = NAN;
  std::vector<cuda::SamplingRow> parameters(rows);
  std::vector<int64_t> expected(rows);
  for (int r = 0; r < rows; ++r) {
    ref::SamplingParams p;
    p.temperature = c.temperature;
    p.topK = c.topK;
    p.topP = c.topP;
    const float uniform = ref::samplingUniform(uint64_t(r) + 11, uint64_t(r));
    parameters[size_t(r)] = {p.temperature, p.topK, p.topP, uniform};
    expected[size_t(r)] = ref::sampleToken(
        std::span<const float>(logits).subspan(size_t(r) * size_t(c.vocab), size_t(c.vocab)), p,
        uniform);
  }
  std::vector<uint8_t> rowBytes(parameters.size() * sizeof(cuda::SamplingRow));
  std::memcpy(rowBytes.data(), parameters.data(), rowBytes.size());
  DeviceBuffer<float> dLogits(logits);
  DeviceBuffer<uint8_t> dRows(rowBytes);
  // Without a workspace (one block a row) and with one (the argmax over parts first).
  for (const bool parts : {false, true}) {
    SCOPED_TRACE(parts ? "argmax in parts" : "one block a row");
    DeviceBuffer<int64_t> dTokens{std::vector<int64_t>(rows, -7)};
    DeviceBuffer<uint8_t> dWorkspace{
        std::vector<uint8_t>(parts ? cuda::sampleRowsWorkspaceBytes(rows, c.vocab) : 0, 0xAB)};
    cuda::SampleRowsParams p;
    p.rows = rows;
    p.vocab = c.vocab;
    p.logits = dLogits.data;
    p.samplingRows = reinterpret_cast<const cuda::SamplingRow *>(dRows.data);
    p.tokens = dTokens.data;
    p.workspace = parts ? dWorkspace.data : nullptr;
    ASSERT_EQ(cuda::launchSampleRows(p, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(dTokens.download(), expected);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rows, SamplingCuda,
    testing::Values(Case{"greedy", 1000, 0.0f, 0, 1.0f}, Case{"greedy_kimi", 163840, 0.0f, 0, 1.0f},
                    Case{"greedy_partial_part", 2 * 4096 + 77, 0.0f, 0, 1.0f},
                    Case{"temperature", 1000, 0.7f, 0, 1.0f},
                    Case{"temperature_kimi", 163840, 1.0f, 0, 1.0f},
                    Case{"top_k", 1000, 1.0f, 20, 1.0f}, Case{"top_k_wide", 1000, 1.3f, 700, 1.0f},
                    Case{"top_k_kimi", 163840, 0.8f, 50, 1.0f}, Case{"top_p", 1000, 1.0f, 0, 0.5f},
                    Case{"top_p_kimi", 163840, 0.9f, 0, 0.95f},
                    Case{"top_k_and_p", 163840, 0.6f, 40, 0.8f}),
    [](const testing::TestParamInfo<Case> &info) { return info.param.name; });

// Host arithmetic, no GPU needed: a part's best (16 bytes) for every 4096 ids of each row.
TEST(SamplingWorkspace, HoldsAPartEvery4096Ids) {
  EXPECT_EQ(cuda::sampleRowsWorkspaceBytes(1, 163840), size_t(40 * 16));
  EXPECT_EQ(cuda::sampleRowsWorkspaceBytes(3, 4097), size_t(3 * 2 * 16));
  EXPECT_EQ(cuda::sampleRowsWorkspaceBytes(0, 1000), size_t(0));
  EXPECT_EQ(cuda::sampleRowsWorkspaceBytes(2, 0), size_t(0));
}

TEST(SamplingCudaErrors, RejectsBadShapes) {
  cuda::SampleRowsParams p; // nothing set
  EXPECT_EQ(cuda::launchSampleRows(p, nullptr), int(cudaErrorInvalidValue));
  // A workspace off its 16-byte alignment is refused before anything runs (the pointers are
  // never read).
  p.rows = 1;
  p.vocab = 10;
  p.logits = reinterpret_cast<const float *>(uintptr_t(256));
  p.samplingRows = reinterpret_cast<const cuda::SamplingRow *>(uintptr_t(256));
  p.tokens = reinterpret_cast<int64_t *>(uintptr_t(256));
  p.workspace = reinterpret_cast<void *>(uintptr_t(260));
  EXPECT_EQ(cuda::launchSampleRows(p, nullptr), int(cudaErrorInvalidValue));
}

} // namespace
} // namespace hybrid::kernels
