// RMSNorm (+ add), the embedding gather, add and silu(gate) * up on CUDA against the cpu
// reference, fp32 throughout. Labelled `gpu`; skipped where no GPU is present.
#include "hybrid/kernels/cuda/Elementwise.h"
#include "hybrid/kernels/cuda/Norm.h"
#include "hybrid/kernels/ref/Moe.h" // GatedActivation
#include "hybrid/kernels/ref/Norm.h"
#include "hybrid/kernels/ref/Quant.h"
#include "CudaTestSupport.h"

#include <cmath>
#include <string>
#include <vector>

namespace hybrid::kernels {
namespace {

struct NormCase {
  int64_t rows, dim;
  bool add, weighted, inPlace;
};

class RmsNormCuda : public testing::TestWithParam<NormCase> {};

TEST_P(RmsNormCuda, MatchesReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const NormCase c = GetParam();
  std::mt19937 rng(int(c.rows * 17 + c.dim));
  const size_t n = size_t(c.rows * c.dim);
  std::vector<float> x = random(n, rng, 2.0f), addend = random(n, rng, 1.0f);
  std::vector<float> weight = random(size_t(c.dim), rng, 0.1f, 1.0f);
  std::vector<float> sum = x;
  if (c.add)
    for (size_t i = 0; i < n; ++i)
      sum[i] = x[i] + addend[i];
  std::vector<float> expected(n);
  ref::rmsNorm(sum, c.weighted ? weight : std::vector<float>(), expected, c.rows, c.dim, 1e-6f);

  DeviceBuffer<float> dX(x), dAddend(addend), dWeight(weight), dSum{std::vector<float>(n)},
      dY{std::vector<float>(n)};
  cuda::RmsNormParams p;
  p.rows = c.rows;
  p.dim = c.dim;
  p.epsilon = 1e-6f;
  p.x = dX.data;
  p.addend = c.add ? dAddend.data : nullptr;
  p.sum = c.add ? (c.inPlace ? dX.data : dSum.data) : nullptr;
  p.weight = c.weighted ? dWeight.data : nullptr;
  p.y = c.inPlace ? dX.data : dY.data;
  ASSERT_EQ(cuda::launchRmsNorm(p, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_LT(relativeRms(c.inPlace ? dX.download() : dY.download(), expected), 1e-6);
  if (c.add && !c.inPlace) {
    EXPECT_LT(relativeRms(dSum.download(), sum), 1e-7);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RmsNormCuda,
    testing::Values(NormCase{3, 2304, false, true, false}, NormCase{1, 7, true, true, false},
                    NormCase{5, 1000, true, false, false}, NormCase{2, 7168, false, true, true},
                    NormCase{4, 300, true, true, true}, NormCase{2, 4096, true, true, true},
                    // both cached sizes and the loop kernel, with adds
                    NormCase{2, 7168, true, true, false}, NormCase{1, 9000, true, true, false}),
    [](const testing::TestParamInfo<NormCase> &info) {
      const NormCase &c = info.param;
      std::string name = "rows";
      name += std::to_string(c.rows);
      name += "_dim";
      name += std::to_string(c.dim);
      name += c.add ? "_add" : "";
      name += c.weighted ? "_weighted" : "";
      name += c.inPlace ? "_in_place" : "";
      return name;
    });

// A folded add (the plan's three-input add_rms_norm): sum = x + (addend + secondAddend), the
// bits of the two adds it replaces (the add first, then the residual add), in every kernel
// (rows up to 4096 and up to 8192 values cached, longer ones looped).
TEST(RmsNormCuda, SecondAddendGivesTheTwoAddsBits) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  for (const int64_t dim : {int64_t(2304), int64_t(7), int64_t(7168), int64_t(9000)}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    const int64_t rows = 3;
    const size_t n = size_t(rows * dim);
    std::mt19937 rng{uint32_t(dim)};
    const std::vector<float> x = random(n, rng, 2.0f), a = random(n, rng, 1.0f),
                             b = random(n, rng, 1.0f),
                             weight = random(size_t(dim), rng, 0.1f, 1.0f);
    std::vector<float> added(n);
    for (size_t i = 0; i < n; ++i)
      added[i] = a[i] + b[i];
    DeviceBuffer<float> dX(x), dA(a), dB(b), dAdded(added), dWeight(weight);
    DeviceBuffer<float> twoSum{std::vector<float>(n)}, twoY{std::vector<float>(n)};
    DeviceBuffer<float> oneSum{std::vector<float>(n)}, oneY{std::vector<float>(n)};
    cuda::RmsNormParams p;
    p.rows = rows;
    p.dim = dim;
    p.x = dX.data;
    p.weight = dWeight.data;
    p.addend = dAdded.data; // the two launches: the add's sum, then the residual add
    p.sum = twoSum.data;
    p.y = twoY.data;
    ASSERT_EQ(cuda::launchRmsNorm(p, nullptr), 0);
    p.addend = dA.data; // folded
    p.secondAddend = dB.data;
    p.sum = oneSum.data;
    p.y = oneY.data;
    ASSERT_EQ(cuda::launchRmsNorm(p, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(differingBits(oneSum.download(), twoSum.download()), 0u);
    EXPECT_EQ(differingBits(oneY.download(), twoY.download()), 0u);
  }
}

// DeepSeek-V3.2's 7168-wide rows: a decode's few rows run the register-cached form, a prefill's
// many the loop kernel; a row gets the same bits from either (sums and outputs).
TEST(RmsNormCuda, LongRowsGiveTheSameBitsCachedOrLooped) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const int64_t dim = 7168, many = 100, few = 3;
  std::mt19937 rng(71);
  const size_t n = size_t(many * dim);
  const std::vector<float> x = random(n, rng, 2.0f), addend = random(n, rng, 1.0f),
                           weight = random(size_t(dim), rng, 0.1f, 1.0f);
  DeviceBuffer<float> dX(x), dAddend(addend), dWeight(weight);
  std::vector<float> sums[2], outputs[2];
  for (const int64_t rows : {many, few}) {
    DeviceBuffer<float> dSum{std::vector<float>(n)}, dY{std::vector<float>(n)};
    cuda::RmsNormParams p;
    p.rows = rows;
    p.dim = dim;
    p.epsilon = 1e-6f;
    p.x = dX.data;
    p.addend = dAddend.data;
    p.sum = dSum.data;
    p.weight = dWeight.data;
    p.y = dY.data;
    ASSERT_EQ(cuda::launchRmsNorm(p, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> sum = dSum.download(), y = dY.download();
    sum.resize(size_t(few * dim));
    y.resize(size_t(few * dim));
    sums[rows == few] = sum;
    outputs[rows == few] = y;
  }
  EXPECT_EQ(differingBits(sums[1], sums[0]), 0u);
  EXPECT_EQ(differingBits(outputs[1], outputs[0]), 0u);
}

TEST(RmsNormCudaErrors, RejectsBadShapes) {
  cuda::RmsNormParams p;
  float dummy = 0;
  p.x = p.y = &dummy;
  p.rows = 0;
  p.dim = 4;
  EXPECT_EQ(cuda::launchRmsNorm(p, nullptr), int(cudaErrorInvalidValue));
  p.rows = 1;
  p.addend = &dummy; // an add needs somewhere to put the sum
  EXPECT_EQ(cuda::launchRmsNorm(p, nullptr), int(cudaErrorInvalidValue));
  p.addend = nullptr; // a second addend only with a first
  p.secondAddend = &dummy;
  p.sum = &dummy;
  EXPECT_EQ(cuda::launchRmsNorm(p, nullptr), int(cudaErrorInvalidValue));
}

TEST(ElementwiseCuda, EmbedGathersRowsOfBothTableTypes) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const int64_t vocab = 50, width = 36, rows = 5;
  std::mt19937 rng(3);
  std::vector<float> table = random(size_t(vocab * width), rng, 1.0f);
  std::vector<uint16_t> bits(table.size());
  for (size_t i = 0; i < table.size(); ++i)
    bits[i] = ref::floatToBf16(table[i]);
  const std::vector<int64_t> ids = {0, 49, 7, 7, 23};
  DeviceBuffer<int64_t> dIds(ids);
  DeviceBuffer<float> dTable(table), out(std::vector<float>(size_t(rows * width)));
  DeviceBuffer<uint16_t> dBits(bits);
  for (auto type : {cuda::TableType::F32, cuda::TableType::BF16}) {
    const void *source = type == cuda::TableType::F32 ? static_cast<const void *>(dTable.data)
                                                       : static_cast<const void *>(dBits.data);
    ASSERT_EQ(cuda::launchEmbed(dIds.data, rows, source, type, vocab, width, out.data, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = out.download();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < width; ++i) {
        const float value = table[ids[r] * width + i];
        const float expected = type == cuda::TableType::F32
                                   ? value
                                   : ref::bf16ToFloat(ref::floatToBf16(value));
        ASSERT_EQ(got[r * width + i], expected) << "row " << r << " column " << i;
      }
  }
  EXPECT_EQ(cuda::launchEmbed(dIds.data, 0, dTable.data, cuda::TableType::F32, vocab, width,
                              out.data, nullptr),
            int(cudaErrorInvalidValue));
}

TEST(ElementwiseCuda, AddAndSiluMulMatchTheReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const int64_t rows = 3, width = 1000, stride = 2 * width; // gate and up: halves of one row
  std::mt19937 rng(9);
  std::vector<float> a = random(size_t(rows * stride), rng, 3.0f), b = random(a.size(), rng, 1.0f);
  std::vector<float> sum(a.size()), product(size_t(rows * width));
  for (size_t i = 0; i < a.size(); ++i)
    sum[i] = a[i] + b[i];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < width; ++i) {
      const float g = a[r * stride + i], u = a[r * stride + width + i];
      product[r * width + i] = g / (1.0f + std::exp(-g)) * u;
    }
  DeviceBuffer<float> dA(a), dB(b), dSum(std::vector<float>(a.size())),
      dProduct(std::vector<float>(product.size()));
  ASSERT_EQ(cuda::launchAdd(dA.data, dB.data, dSum.data, int64_t(a.size()), nullptr), 0);
  ASSERT_EQ(cuda::launchSiluMul(dA.data, dA.data + width, rows, width, stride, dProduct.data,
                                nullptr),
            0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(relativeRms(dSum.download(), sum), 0.0);
  EXPECT_LT(relativeRms(dProduct.download(), product), 1e-6);
  EXPECT_EQ(cuda::launchSiluMul(dA.data, dA.data, rows, width, width - 1, dProduct.data, nullptr),
            int(cudaErrorInvalidValue));
}

// Kimi K3's SiTU against ref::gatedActivation (K3's betas 4 and 25, and an uncapped linear half);
// SiLU through launchGatedActivation is launchSiluMul bit for bit; bad betas are refused.
TEST(ElementwiseCuda, GatedActivationsMatchTheReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const int64_t rows = 4, width = 777, stride = 2 * width;
  std::mt19937 rng(21);
  const std::vector<float> a = random(size_t(rows * stride), rng, 40.0f); // past both caps
  DeviceBuffer<float> dA(a), dOut(std::vector<float>(size_t(rows * width))),
      dSilu(std::vector<float>(size_t(rows * width)));
  for (float linearBeta : {25.0f, 0.0f}) {
    SCOPED_TRACE("linear beta " + std::to_string(linearBeta));
    const cuda::GatedActivation situ{cuda::GatedActivation::Kind::Situ, 4.0f, linearBeta};
    const ref::GatedActivation reference{ref::GatedActivation::Kind::Situ, 4.0f, linearBeta};
    std::vector<float> expected(size_t(rows * width));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < width; ++i)
        expected[size_t(r * width + i)] =
            ref::gatedActivation(reference, a[size_t(r * stride + i)], a[size_t(r * stride + width + i)]);
    ASSERT_EQ(cuda::launchGatedActivation(dA.data, dA.data + width, rows, width, stride, dOut.data,
                                          situ, nullptr),
              0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(relativeRms(dOut.download(), expected), 1e-6);
  }
  ASSERT_EQ(cuda::launchGatedActivation(dA.data, dA.data + width, rows, width, stride, dOut.data,
                                        cuda::GatedActivation{}, nullptr),
            0);
  ASSERT_EQ(cuda::launchSiluMul(dA.data, dA.data + width, rows, width, stride, dSilu.data, nullptr),
            0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(dOut.download(), dSilu.download());
  const cuda::GatedActivation noBeta{cuda::GatedActivation::Kind::Situ, 0.0f, 25.0f};
  EXPECT_EQ(cuda::launchGatedActivation(dA.data, dA.data + width, rows, width, stride, dOut.data,
                                        noBeta, nullptr),
            int(cudaErrorInvalidValue));
}

} // namespace
} // namespace hybrid::kernels
