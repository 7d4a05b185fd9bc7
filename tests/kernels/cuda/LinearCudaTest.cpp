// The linear layer (cuBLASLt, or the decode kernel at <= 8 rows) against the reference GEMM: x
// rounded to bf16 as the kernel does, so only the fp32 accumulation order differs; odd shapes,
// padded strides, accumulation, and the error path. Labelled `gpu`; skipped where no GPU is present.
#include "hybrid/kernels/cuda/Linear.h"
#include "hybrid/kernels/ref/Linear.h"
#include "hybrid/kernels/ref/Quant.h"
#include "CudaTestSupport.h"

#include <cuda_runtime.h>

#include <string>
#include <vector>

namespace hybrid::kernels {
namespace {

struct Shape {
  int64_t rows, in, out, xPad, weightPad, yPad;
  bool accumulate;
  bool split = false; // x as two bf16 halves: compared with the unrounded x
};

class LinearCuda : public testing::TestWithParam<Shape> {};

TEST_P(LinearCuda, MatchesReferenceOnBf16Operands) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const Shape s = GetParam();
  const int64_t xStride = s.in + s.xPad, wStride = s.in + s.weightPad, yStride = s.out + s.yPad;
  std::mt19937 rng(int(s.rows * 131 + s.in * 7 + s.out));
  std::vector<float> x = random(size_t(s.rows * xStride), rng, 1.0f);
  std::vector<float> weight = roundedToBf16(random(size_t(s.out * wStride), rng, 0.05f));
  std::vector<float> y = random(size_t(s.rows * yStride), rng, 1.0f);

  // Reference on the operands the kernel multiplies: x rounded to bf16, the bf16 weight.
  std::vector<float> xRows(size_t(s.rows * s.in)), wRows(size_t(s.out * s.in));
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t k = 0; k < s.in; ++k)
      xRows[r * s.in + k] = x[r * xStride + k];
  for (int64_t n = 0; n < s.out; ++n)
    for (int64_t k = 0; k < s.in; ++k)
      wRows[n * s.in + k] = weight[n * wStride + k];
  std::vector<float> product(size_t(s.rows * s.out));
  // Split inputs carry ~16 significant bits: the reference takes x as it is.
  ref::linear(s.split ? xRows : roundedToBf16(xRows), wRows, product, s.rows, s.in, s.out);
  std::vector<float> expected = y;
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t n = 0; n < s.out; ++n)
      expected[r * yStride + n] = product[r * s.out + n] + (s.accumulate ? y[r * yStride + n] : 0);

  DeviceBuffer<float> dX(x), dY(y);
  DeviceBuffer<uint16_t> dW(bf16Bits(weight)), scratch(std::vector<uint16_t>(2 * s.rows * s.in));
  DeviceBuffer<float> splitOutput(std::vector<float>(size_t(2 * s.rows * s.out)));
  cuda::LinearContext context;
  ASSERT_EQ(context.init(), 0);
  cuda::LinearParams p;
  p.rows = s.rows;
  p.in = s.in;
  p.out = s.out;
  p.x = dX.data;
  p.xStride = xStride;
  p.weight = dW.data;
  p.weightStride = wStride;
  p.y = dY.data;
  p.yStride = yStride;
  p.accumulate = s.accumulate;
  p.xScratch = scratch.data;
  p.splitInput = s.split;
  p.splitOutput = splitOutput.data;
  // bf16 inputs: only the summation order differs. Split inputs: x - hi - lo is below 2^-18 |x|.
  const double bound = s.split ? 2e-5 : 1e-5;
  for (int call = 0; call < 2; ++call) { // the second call reuses the cached algorithm
    if (call == 1) {
      ASSERT_EQ(cudaMemcpy(dY.data, y.data(), y.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    }
    const int code = context.run(p, nullptr);
    ASSERT_EQ(code, 0) << cuda::linearErrorText(code);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // Padding columns of y are untouched; the rest matches up to fp32 summation order.
    EXPECT_LT(relativeRms(dY.download(), expected), bound) << "call " << call;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearCuda,
                         testing::Values(Shape{1, 64, 96, 0, 0, 0, false},
                                         Shape{7, 2304, 512, 8, 0, 16, false},
                                         Shape{64, 128, 4096, 0, 8, 0, true},
                                         Shape{3, 72, 40, 4, 8, 4, true},
                                         Shape{1, 256, 128, 0, 0, 0, false, true},
                                         Shape{9, 2304, 512, 8, 0, 16, true, true},
                                         // The decode kernel (<= 8 rows, in % 8 == 0): a row
                                         // count between its templates, an out that is not a
                                         // multiple of its 4 outputs per block, a long k.
                                         Shape{5, 2304, 1001, 4, 8, 3, false},
                                         Shape{8, 11264, 64, 0, 0, 0, true, true},
                                         Shape{2, 4096, 2304, 0, 0, 0, true},
                                         // in % 8 != 0 at decode rows: cuBLASLt after all.
                                         Shape{2, 36, 40, 0, 4, 0, false}),
                         [](const testing::TestParamInfo<Shape> &info) {
                           const Shape &s = info.param;
                           std::string name = std::to_string(s.rows);
                           name += "x";
                           name += std::to_string(s.in);
                           name += "x";
                           name += std::to_string(s.out);
                           name += s.xPad || s.weightPad || s.yPad ? "_strided" : "";
                           name += s.accumulate ? "_accumulate" : "";
                           name += s.split ? "_split" : "";
                           return name;
                         });

TEST(LinearCudaErrors, RejectsBadShapesAndUninitializedContext) {
  cuda::LinearContext context;
  cuda::LinearParams p;
  float dummy = 0;
  p.rows = 1;
  p.in = 4;
  p.out = 4;
  p.x = p.y = &dummy;
  p.weight = p.xScratch = &dummy;
  EXPECT_EQ(context.run(p, nullptr), int(cudaErrorInvalidValue)) << "not initialized";
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(context.init(), 0);
  p.xStride = 3; // narrower than a row
  EXPECT_EQ(context.run(p, nullptr), int(cudaErrorInvalidValue));
  p.xStride = 0;
  p.out = 0;
  EXPECT_EQ(context.run(p, nullptr), int(cudaErrorInvalidValue));
  EXPECT_STRNE(cuda::linearErrorText(1000 + 7), "");
}

} // namespace
} // namespace hybrid::kernels
