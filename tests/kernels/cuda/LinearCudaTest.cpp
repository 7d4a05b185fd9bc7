// The linear layer (cuBLASLt, or the decode kernel at <= 8 rows) against the reference GEMM: x
// rounded to bf16 as the kernel does, so only the fp32 accumulation order differs; odd shapes,
// padded strides, accumulation, and the error path. Labelled `gpu`; skipped where no GPU is present.
#include "hybrid/kernels/cuda/Linear.h"
#include "hybrid/kernels/ref/Linear.h"
#include "hybrid/kernels/ref/Quant.h"
#include "CudaTestSupport.h"

#include <cuda_runtime.h>

#include <bit>
#include <cstdio>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <utility>
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
                                         // Tensor cores (6-8 rows): past one wave of the deep
                                         // stages' blocks (2 chunks a stage), and within it
                                         // (7 x 2304 -> 512, 8 x 11264 -> 64: 8 a stage).
                                         Shape{8, 4096, 2304, 0, 0, 8, true, true},
                                         Shape{6, 2304, 4100, 0, 8, 0, false},
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

// runGroup: a layer's projections in one launch. Members of one shared x writing interleaved
// columns of one y (as KDA's q/k/v), one reading another x, odd widths, accumulation: the group
// must equal the members' own runs bit for bit, and the reference up to summation order. At 9
// rows, or with a member the decode kernel does not take (in % 8 != 0), it runs them one by one.
struct GroupCase {
  int64_t rows;
  bool split;
  int64_t otherIn; // the last member's in: 40 (the decode kernel), 36 (not), or wide
};

class LinearCudaGroup : public testing::TestWithParam<GroupCase> {};

TEST_P(LinearCudaGroup, MatchesMembersRunAloneBitForBit) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const GroupCase c = GetParam();
  const int64_t rows = c.rows, in = 256, xStride = in + 8;
  struct Member {
    int64_t in, out, yOffset;
    bool accumulate, otherX;
  };
  // y: [rows, yStride] holding the shared-x members side by side, then the other x's member.
  const Member members[] = {{in, 96, 0, false, false},  {in, 130, 96, false, false},
                            {in, 8, 226, true, false},  {in, 64, 234, false, false},
                            {c.otherIn, 72, 298, true, true}};
  const int count = int(std::size(members));
  const int64_t yStride = 298 + 72 + 2;
  std::mt19937 rng(int(rows * 17 + c.otherIn + c.split));
  std::vector<float> x = random(size_t(rows * xStride), rng, 1.0f);
  std::vector<float> otherX = random(size_t(rows * c.otherIn), rng, 1.0f);
  std::vector<float> y = random(size_t(rows * yStride), rng, 1.0f);
  std::vector<std::vector<float>> weights;
  for (const Member &m : members)
    weights.push_back(roundedToBf16(random(size_t(m.out * m.in), rng, 0.05f)));

  // The reference: each member's product on the operands the kernels multiply.
  std::vector<float> expected = y;
  for (const Member &m : members) {
    std::vector<float> xRows(size_t(rows * m.in));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < m.in; ++k)
        xRows[r * m.in + k] = m.otherX ? otherX[r * m.in + k] : x[r * xStride + k];
    std::vector<float> product(size_t(rows * m.out));
    ref::linear(c.split ? xRows : roundedToBf16(xRows), weights[&m - members], product, rows,
                m.in, m.out);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < m.out; ++n) {
        float &target = expected[r * yStride + m.yOffset + n];
        target = product[r * m.out + n] + (m.accumulate ? target : 0.0f);
      }
  }

  DeviceBuffer<float> dX(x), dOtherX(otherX), dY(y);
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> dWeights;
  for (const std::vector<float> &w : weights)
    dWeights.push_back(std::make_unique<DeviceBuffer<uint16_t>>(bf16Bits(w)));
  DeviceBuffer<uint16_t> scratch(std::vector<uint16_t>(size_t(2 * rows * in)));
  DeviceBuffer<float> splitOutput(std::vector<float>(size_t(2 * rows * 130)));
  cuda::LinearContext context;
  ASSERT_EQ(context.init(), 0);
  std::vector<cuda::LinearParams> params(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    const Member &m = members[i];
    cuda::LinearParams &p = params[size_t(i)];
    p.rows = rows;
    p.in = m.in;
    p.out = m.out;
    p.x = m.otherX ? dOtherX.data : dX.data;
    p.xStride = m.otherX ? m.in : xStride;
    p.weight = dWeights[size_t(i)]->data;
    p.y = dY.data + m.yOffset;
    p.yStride = yStride;
    p.accumulate = m.accumulate;
    p.xScratch = scratch.data;
    p.splitInput = c.split;
    p.splitOutput = splitOutput.data;
  }
  for (const cuda::LinearParams &p : params) {
    const int code = context.run(p, nullptr);
    ASSERT_EQ(code, 0) << cuda::linearErrorText(code);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> alone = dY.download();
  ASSERT_EQ(cudaMemcpy(dY.data, y.data(), y.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  const int code = context.runGroup(params.data(), count, nullptr);
  ASSERT_EQ(code, 0) << cuda::linearErrorText(code);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> grouped = dY.download();
  for (size_t i = 0; i < grouped.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(grouped[i]), std::bit_cast<uint32_t>(alone[i]))
        << "element " << i << " (row " << i / size_t(yStride) << ")";
  EXPECT_LT(relativeRms(grouped, expected), c.split ? 2e-5 : 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Groups, LinearCudaGroup,
    testing::Values(GroupCase{1, false, 40}, GroupCase{1, true, 40}, GroupCase{3, false, 40},
                    GroupCase{8, true, 40}, GroupCase{9, false, 40}, GroupCase{2, false, 36},
                    // a wide member on tensor cores beside narrow ones
                    GroupCase{8, true, 2304}, GroupCase{6, false, 512}),
    [](const testing::TestParamInfo<GroupCase> &info) {
      const GroupCase &c = info.param;
      return std::to_string(c.rows) + "rows" + (c.split ? "_split" : "") +
             (c.otherIn % 8 || c.otherIn > 256 ? "_in" + std::to_string(c.otherIn) : "");
    });

// A random problem of up to `mostRows` rows on the device for the batch-invariance tests: the
// first `kept` rows of a `rows`-row call (split or bf16 inputs), and how many floats two such
// results differ in by bits.
struct BatchInvarianceProblem {
  int64_t in, out;
  bool split;
  DeviceBuffer<float> x;
  DeviceBuffer<uint16_t> weight, scratch;
  DeviceBuffer<float> splitOutput;
  BatchInvarianceProblem(int64_t mostRows, int64_t in, int64_t out, bool split, std::mt19937 &rng)
      : in(in), out(out), split(split), x(random(size_t(mostRows * in), rng, 1.0f)),
        weight(bf16Bits(roundedToBf16(random(size_t(out * in), rng, 0.05f)))),
        scratch(std::vector<uint16_t>(size_t(2 * mostRows * in))),
        splitOutput(std::vector<float>(size_t(2 * mostRows * out))) {}
  std::vector<float> firstRows(cuda::LinearContext &context, int64_t rows, int64_t kept) {
    DeviceBuffer<float> y(std::vector<float>(size_t(rows * out), 0.0f));
    cuda::LinearParams p;
    p.rows = rows;
    p.in = in;
    p.out = out;
    p.x = x.data;
    p.weight = weight.data;
    p.y = y.data;
    p.xScratch = scratch.data;
    p.splitInput = split;
    p.splitOutput = splitOutput.data;
    const int code = context.run(p, nullptr);
    EXPECT_EQ(code, 0) << cuda::linearErrorText(code);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> values = y.download();
    values.resize(size_t(kept * out));
    return values;
  }
};

// The decode kernel's two forms keep a row's bits within their row counts: calls of 1 to 5 rows
// (the scalar form: a batch-1 decode step and its 5-row verification passes) give their first
// row the same bits, and so do calls of kGemvTensorCoreMinRows (6) to 8 rows (tensor cores),
// with bf16 and split inputs; the two forms agree to fp32 summation order.
TEST(LinearCudaDecodeKernel, RowsGiveTheSameBitsWithinEachForm) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  for (const bool split : {false, true}) {
    std::mt19937 rng(int(split) + 5);
    BatchInvarianceProblem problem(8, 2304, 1040, split, rng);
    cuda::LinearContext context;
    ASSERT_EQ(context.init(), 0);
    const std::vector<float> scalar = problem.firstRows(context, 1, 1);
    const std::vector<float> tensor = problem.firstRows(context, 8, 1);
    for (int64_t rows = 2; rows <= 8; ++rows)
      EXPECT_EQ(differingBits(problem.firstRows(context, rows, 1), rows < 6 ? scalar : tensor), 0u)
          << rows << " rows" << (split ? ", split input" : ", bf16 input");
    EXPECT_LT(relativeRms(tensor, scalar), 1e-6) << (split ? "split input" : "bf16 input");
  }
}

// Batch invariance (LinearContext::setBatchInvariantRows): the first rows of a call give the
// same bits whether 32, 40 or 160 rows share it, as a decode step of B rows and a verification
// pass of B x (k + 1) rows must (issue 9); bf16 and split inputs, Kimi-Linear's projection
// shapes. The heuristic's own pick per row count is what the default does; whether it differs
// is printed, not asserted (it may or may not on a given cuBLASLt).
TEST(LinearCudaBatchInvariance, RowsGiveTheSameBitsWhateverTheRowsOfTheCall) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  constexpr int64_t kMostRows = 160;
  for (const auto &[in, out] : {std::pair<int64_t, int64_t>{2304, 4096}, {4096, 2304}})
    for (const bool split : {false, true}) {
      std::mt19937 rng(int(in + out + split));
      BatchInvarianceProblem problem(kMostRows, in, out, split, rng);
      const std::string what = std::to_string(in) + " -> " + std::to_string(out) +
                               (split ? ", split input" : ", bf16 input");
      cuda::LinearContext invariant, heuristic;
      ASSERT_EQ(invariant.init(), 0);
      ASSERT_EQ(heuristic.init(), 0);
      invariant.setBatchInvariantRows(256);
      const std::vector<float> at32 = problem.firstRows(invariant, 32, 32);
      for (const int64_t rows : {int64_t(40), kMostRows}) {
        const size_t differing = differingBits(at32, problem.firstRows(invariant, rows, 32));
        EXPECT_EQ(differing, 0u) << what << ": the first 32 rows of a " << rows << "-row call";
        const std::vector<float> plain32 = problem.firstRows(heuristic, 32, 32);
        const size_t plainDiffering =
            differingBits(plain32, problem.firstRows(heuristic, rows, 32));
        std::printf("%s, 32 vs %lld rows: %zu of %zu outputs differ with the heuristic's pick per "
                    "row count, %zu with one algorithm\n",
                    what.c_str(), static_cast<long long>(rows), plainDiffering, plain32.size(),
                    differing);
      }
    }
}

// With the decode-size kernel off as well (LoadOptions::batchInvariant), calls of 1, 5 and 8
// rows (a batch-1 decode step, a 5-row verification pass) give their rows the bits a 160-row call
// gives them (in 64-row parts with the 64-row reference): a sequence's tokens then come out the
// same whatever batch it decodes in.
TEST(LinearCudaBatchInvariance, DecodeRowsOnTheSameAlgorithmGiveTheSameBits) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  constexpr int64_t kMostRows = 160, in = 2304, out = 4096;
  for (const int64_t reference : {int64_t(64), int64_t(256)})
    for (const bool split : {false, true}) {
      std::mt19937 rng(int(reference + split));
      BatchInvarianceProblem problem(kMostRows, in, out, split, rng);
      cuda::LinearContext context;
      ASSERT_EQ(context.init(), 0);
      context.setBatchInvariantRows(reference);
      context.setDecodeKernel(false);
      const std::vector<float> all = problem.firstRows(context, kMostRows, kMostRows);
      for (const int64_t rows : {int64_t(1), int64_t(5), int64_t(8)}) {
        const std::vector<float> few = problem.firstRows(context, rows, rows);
        EXPECT_EQ(differingBits(few, std::vector<float>(all.begin(), all.begin() + rows * out)), 0u)
            << rows << " rows vs the first rows of " << kMostRows << " (reference " << reference
            << " rows" << (split ? ", split input)" : ", bf16 input)");
      }
    }
}

// One row of `in` x 4 over a dummy buffer: a problem the checks judge before touching memory.
cuda::LinearParams oneRowParams(int64_t in, float &dummy) {
  cuda::LinearParams p;
  p.rows = 1;
  p.in = in;
  p.out = 4;
  p.x = p.y = &dummy;
  p.weight = p.xScratch = &dummy;
  return p;
}

TEST(LinearCudaErrors, RejectsBadGroups) {
  cuda::LinearContext context;
  float dummy = 0;
  cuda::LinearParams p = oneRowParams(8, dummy);
  EXPECT_EQ(context.runGroup(&p, 1, nullptr), int(cudaErrorInvalidValue)) << "not initialized";
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(context.init(), 0);
  EXPECT_EQ(context.runGroup(&p, 0, nullptr), int(cudaErrorInvalidValue)) << "no members";
  cuda::LinearParams pair[2] = {p, p};
  pair[1].xStride = 3; // narrower than a row: nothing launched
  EXPECT_EQ(context.runGroup(pair, 2, nullptr), int(cudaErrorInvalidValue));
}

TEST(LinearCudaErrors, RejectsBadShapesAndUninitializedContext) {
  cuda::LinearContext context;
  float dummy = 0;
  cuda::LinearParams p = oneRowParams(4, dummy);
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
