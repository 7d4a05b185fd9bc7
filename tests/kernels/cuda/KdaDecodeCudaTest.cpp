// The fused KDA decode kernel against the cpu reference (kernels/ref), several steps with the
// recurrent and conv state carried across calls. Labelled `gpu`; skipped where no GPU is present.
#include "hybrid/kernels/cuda/KdaDecode.h"
#include "hybrid/kernels/ref/Kda.h"
#include "hybrid/kernels/ref/Norm.h"
#include "CudaTestSupport.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace hybrid::kernels {
namespace {

struct Case {
  int batch, heads, headDim;
  bool lowerBound;
  int convKernel = 4;
};

// A decode step's shapes, weights and per-row inputs (device buffers: qkv, forget, beta logits,
// output gate); the states, the output and the path are the caller's.
cuda::KdaDecodeParams decodeParams(int batch, int heads, int headDim, int convKernel,
                                   const DeviceBuffer<float> (&weights)[4],
                                   const DeviceBuffer<float> (&inputs)[4]) {
  cuda::KdaDecodeParams params;
  params.batch = batch;
  params.heads = heads;
  params.headDim = headDim;
  params.convKernel = convKernel;
  params.weights.convWeight = weights[0].data;
  params.weights.aLog = weights[1].data;
  params.weights.dtBias = weights[2].data;
  params.weights.normWeight = weights[3].data;
  params.qkv = inputs[0].data;
  params.forget = inputs[1].data;
  params.betaLogits = inputs[2].data;
  params.outputGate = inputs[3].data;
  return params;
}

// A bf16 state is rounded once per step when stored, after fp32 arithmetic: each reference step
// starts from the kernel's bf16 state of the step before (so one step's error is measured, not
// rounding differences compounding) and rounds its result. The two fp32 computations differ in
// summation order and exp approximation, so an element near a rounding boundary may land one
// bf16 ulp (2^-8 relative) apart; the bound allows a few such elements, far below what a wrong
// type or position would give (order 1). Outputs are computed before the rounding: fp32 bounds.
constexpr double kBf16StateError = 1e-4;

// Runs 3 carried steps on `path` and on the cpu reference from the same random start.
void expectMatchesReference(const Case &shape, cuda::KdaDecodePath path, bool bf16State) {
  const auto [B, H, D, lowerBound, W] = shape;
  const int P = H * D;
  std::mt19937 rng(B * 131 + H * 7 + D);
  std::vector<float> convWeight = random(size_t(3) * P * W, rng, 0.5f);
  std::vector<float> aLog = random(H, rng, 0.3f, 0.5f);
  std::vector<float> dtBias = random(P, rng, 0.5f);
  std::vector<float> normWeight = random(D, rng, 0.1f, 1.0f);
  std::vector<float> convState(size_t(B) * 3 * (W - 1) * P, 0.0f);
  std::vector<float> state = random(size_t(B) * H * D * D, rng, 0.05f);
  if (bf16State)
    state = roundedToBf16(state);

  const DeviceBuffer<float> weights[4] = {DeviceBuffer<float>(convWeight), DeviceBuffer<float>(aLog),
                                          DeviceBuffer<float>(dtBias),
                                          DeviceBuffer<float>(normWeight)};
  DeviceBuffer<float> dConvState(convState);
  DeviceState dState(state, bf16State);
  std::vector<float> refConv = convState, refState = state;

  for (int step = 0; step < 3; ++step) {
    if (bf16State)
      refState = dState.download(); // exactly representable: the kernel's state before the step
    std::vector<float> qkv = random(size_t(B) * 3 * P, rng, 1.0f);
    std::vector<float> forget = random(size_t(B) * P, rng, 1.0f);
    std::vector<float> betaLogits = random(size_t(B) * H, rng, 1.0f);
    std::vector<float> gate = random(size_t(B) * P, rng, 1.0f);
    const DeviceBuffer<float> inputs[4] = {DeviceBuffer<float>(qkv), DeviceBuffer<float>(forget),
                                           DeviceBuffer<float>(betaLogits),
                                           DeviceBuffer<float>(gate)};
    DeviceBuffer<float> dOut(std::vector<float>(size_t(B) * P));
    cuda::KdaDecodeParams params = decodeParams(B, H, D, W, weights, inputs);
    params.weights.normEpsilon = 1e-5f;
    params.weights.lowerBoundGate = lowerBound;
    params.weights.lowerBound = -5.0f;
    params.convState = dConvState.data;
    params.state = dState.data();
    params.stateType = bf16State ? cuda::KdaStateType::BF16 : cuda::KdaStateType::F32;
    params.out = dOut.data;
    params.path = path;
    DeviceBuffer<unsigned char> workspace(
        std::vector<unsigned char>(cuda::kdaDecodeWorkspaceBytes(params), 0xff));
    params.workspace = workspace.data;
    ASSERT_EQ(cuda::launchKdaFusedDecode(params, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    // The cpu reference, sequence by sequence.
    std::vector<float> refOut(size_t(B) * P);
    for (int b = 0; b < B; ++b) {
      std::vector<float> q(P), k(P), v(P);
      float *outs[3] = {q.data(), k.data(), v.data()};
      for (int projection = 0; projection < 3; ++projection) {
        std::vector<float> taps(convWeight.begin() + size_t(projection) * P * W,
                                convWeight.begin() + size_t(projection + 1) * P * W);
        std::span<float> history(refConv.data() + (size_t(b) * 3 + projection) * (W - 1) * P,
                                 size_t(W - 1) * P);
        ref::shortConvSilu({qkv.data() + (size_t(b) * 3 + projection) * P, size_t(P)}, taps,
                           history, {outs[projection], size_t(P)}, 1, P, W);
      }
      ref::l2NormalizeRows(q, H, D);
      ref::l2NormalizeRows(k, H, D);
      std::vector<float> g(P), beta(betaLogits.begin() + b * H, betaLogits.begin() + (b + 1) * H);
      std::optional<float> bound;
      if (lowerBound)
        bound = -5.0f;
      ref::kdaGate({forget.data() + size_t(b) * P, size_t(P)}, aLog, dtBias, g, 1, H, D, bound);
      ref::kdaBeta(beta);
      std::vector<float> o(P);
      ref::KdaParams core{1,        H,        D,           D,
                          0.0f,     q.data(), k.data(),    v.data(),
                          g.data(), beta.data(), refState.data() + size_t(b) * H * D * D,
                          o.data()};
      ref::kdaRecurrent(core);
      ref::gatedRmsNorm(o, {gate.data() + size_t(b) * P, size_t(P)}, normWeight,
                        {refOut.data() + size_t(b) * P, size_t(P)}, H, D, 1e-5f);
    }
    if (bf16State)
      refState = roundedToBf16(refState);
    EXPECT_LT(relativeRms(dOut.download(), refOut), 1e-5) << "output, step " << step;
    EXPECT_LT(relativeRms(dState.download(), refState), bf16State ? kBf16StateError : 1e-5)
        << "state, step " << step;
    EXPECT_LT(relativeRms(dConvState.download(), refConv), 1e-6) << "conv state, step " << step;
  }
}

class KdaDecodeCuda : public testing::TestWithParam<Case> {};

// Every shape on both paths, whichever Auto would pick.
TEST_P(KdaDecodeCuda, MatchesReferenceOverSteps) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  for (auto path : {cuda::KdaDecodePath::Fused, cuda::KdaDecodePath::Split})
    for (bool bf16State : {false, true}) {
      SCOPED_TRACE(path == cuda::KdaDecodePath::Fused ? "fused path" : "split path");
      SCOPED_TRACE(bf16State ? "bf16 state" : "fp32 state");
      expectMatchesReference(GetParam(), path, bf16State);
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, KdaDecodeCuda,
                         testing::Values(Case{1, 2, 128, false}, Case{3, 4, 128, true},
                                         Case{5, 3, 64, false}, Case{2, 32, 128, false},
                                         // larger: several waves of blocks on either path
                                         Case{16, 32, 128, false}, Case{9, 64, 64, true},
                                         // shorter convolutions, on both paths
                                         Case{2, 3, 128, false, 2}, Case{8, 64, 128, true, 3},
                                         Case{3, 5, 64, false, 1}),
                         [](const testing::TestParamInfo<Case> &info) {
                           const Case &c = info.param;
                           // appends only: GCC 12 warns falsely on "literal" + std::string
                           std::string name = "B";
                           name += std::to_string(c.batch);
                           name += "_H";
                           name += std::to_string(c.heads);
                           name += "_D";
                           name += std::to_string(c.headDim);
                           name += c.lowerBound ? "_lower_bound" : "_softplus";
                           if (c.convKernel != 4) {
                             name += "_W";
                             name += std::to_string(c.convKernel);
                           }
                           return name;
                         });

// Rows whose states sit in a pool's slots (stateIndices, padded strides) get exactly what the
// same sequences packed densely get, on both paths; the slots of no row stay as they were.
TEST(KdaDecodeCudaPool, IndexedSlotsEqualDenseStates) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const int B = 3, H = 4, D = 128, W = 4, P = H * D, slots = 5;
  const std::vector<int32_t> slotOfRow = {2, 0, 4};
  const int64_t denseState = int64_t(H) * D * D, denseConv = int64_t(3) * (W - 1) * P;
  const int64_t stateStride = denseState + 96, convStride = denseConv + 32; // not packed
  std::mt19937 rng(11);
  std::vector<float> convWeight = random(size_t(3) * P * W, rng, 0.5f);
  std::vector<float> aLog = random(H, rng, 0.3f, 0.5f), dtBias = random(P, rng, 0.5f);
  std::vector<float> normWeight = random(D, rng, 0.1f, 1.0f);
  std::vector<float> poolState = random(size_t(slots * stateStride), rng, 0.05f);
  std::vector<float> poolConv = random(size_t(slots * convStride), rng, 1.0f);
  std::vector<float> denseStates(size_t(B * denseState)), denseConvs(size_t(B * denseConv));
  for (int b = 0; b < B; ++b) {
    std::copy_n(poolState.begin() + slotOfRow[b] * stateStride, denseState,
                denseStates.begin() + b * denseState);
    std::copy_n(poolConv.begin() + slotOfRow[b] * convStride, denseConv,
                denseConvs.begin() + b * denseConv);
  }
  const DeviceBuffer<float> weights[4] = {DeviceBuffer<float>(convWeight), DeviceBuffer<float>(aLog),
                                          DeviceBuffer<float>(dtBias),
                                          DeviceBuffer<float>(normWeight)};
  const DeviceBuffer<float> inputs[4] = {DeviceBuffer<float>(random(size_t(B) * 3 * P, rng, 1.0f)),
                                         DeviceBuffer<float>(random(size_t(B) * P, rng, 1.0f)),
                                         DeviceBuffer<float>(random(size_t(B) * H, rng, 1.0f)),
                                         DeviceBuffer<float>(random(size_t(B) * P, rng, 1.0f))};
  DeviceBuffer<int32_t> dSlots(slotOfRow);
  for (auto path : {cuda::KdaDecodePath::Fused, cuda::KdaDecodePath::Split}) {
    SCOPED_TRACE(path == cuda::KdaDecodePath::Fused ? "fused path" : "split path");
    DeviceBuffer<float> dPoolState(poolState), dPoolConv(poolConv), dDenseState(denseStates),
        dDenseConv(denseConvs), dOutPool(std::vector<float>(size_t(B) * P)),
        dOutDense(std::vector<float>(size_t(B) * P));
    auto run = [&](bool pooled) {
      cuda::KdaDecodeParams params = decodeParams(B, H, D, W, weights, inputs);
      params.path = path;
      params.state = pooled ? dPoolState.data : dDenseState.data;
      params.convState = pooled ? dPoolConv.data : dDenseConv.data;
      params.out = pooled ? dOutPool.data : dOutDense.data;
      if (pooled) {
        params.stateIndices = dSlots.data;
        params.stateStride = stateStride;
        params.convStateStride = convStride;
      }
      DeviceBuffer<unsigned char> workspace(
          std::vector<unsigned char>(cuda::kdaDecodeWorkspaceBytes(params), 0xff));
      params.workspace = workspace.data;
      ASSERT_EQ(cuda::launchKdaFusedDecode(params, nullptr), 0);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    };
    run(false);
    run(true);
    EXPECT_EQ(dOutPool.download(), dOutDense.download());
    const std::vector<float> pool = dPoolState.download(), conv = dPoolConv.download();
    const std::vector<float> dense = dDenseState.download(), denseConvOut = dDenseConv.download();
    for (int slot = 0; slot < slots; ++slot) {
      const auto row = std::find(slotOfRow.begin(), slotOfRow.end(), slot);
      const std::vector<float> got(pool.begin() + slot * stateStride,
                                   pool.begin() + (slot + 1) * stateStride);
      const std::vector<float> gotConv(conv.begin() + slot * convStride,
                                       conv.begin() + (slot + 1) * convStride);
      std::vector<float> want(poolState.begin() + slot * stateStride,
                              poolState.begin() + (slot + 1) * stateStride);
      std::vector<float> wantConv(poolConv.begin() + slot * convStride,
                                  poolConv.begin() + (slot + 1) * convStride);
      if (row != slotOfRow.end()) { // the row's new states; the padding untouched
        const int64_t b = row - slotOfRow.begin();
        std::copy_n(dense.begin() + b * denseState, denseState, want.begin());
        std::copy_n(denseConvOut.begin() + b * denseConv, denseConv, wantConv.begin());
      }
      EXPECT_EQ(got, want) << "state of slot " << slot;
      EXPECT_EQ(gotConv, wantConv) << "conv state of slot " << slot;
    }
  }
}

TEST(KdaDecodeCudaErrors, UnsupportedHeadDim) {
  cuda::KdaDecodeParams params;
  params.batch = 1;
  params.heads = 1;
  params.headDim = 96;
  EXPECT_EQ(cuda::launchKdaFusedDecode(params, nullptr), int(cudaErrorInvalidValue));
}

TEST(KdaDecodeCudaErrors, ConvolutionLongerThanSupported) {
  cuda::KdaDecodeParams params;
  params.batch = 1;
  params.heads = 1;
  params.headDim = 128;
  params.convKernel = cuda::kKdaMaxConvKernel + 1;
  EXPECT_EQ(cuda::launchKdaFusedDecode(params, nullptr), int(cudaErrorInvalidValue));
}

// A path a tuning entry set (kda-decode) that is none of the enum's is refused, never run.
TEST(KdaDecodeCudaErrors, PathOutsideTheEnum) {
  cuda::KdaDecodeParams params;
  params.batch = 1;
  params.heads = 1;
  params.headDim = 128;
  params.path = static_cast<cuda::KdaDecodePath>(3);
  EXPECT_EQ(cuda::launchKdaFusedDecode(params, nullptr), int(cudaErrorInvalidValue));
}

TEST(KdaDecodeCudaErrors, SplitPathNeedsWorkspace) {
  cuda::KdaDecodeParams params;
  params.batch = int32_t(cuda::kKdaDecodeSplitPairs);
  params.heads = 1;
  params.headDim = 128;
  EXPECT_GT(cuda::kdaDecodeWorkspaceBytes(params), 0u);
  EXPECT_EQ(cuda::launchKdaFusedDecode(params, nullptr), int(cudaErrorInvalidValue));
  params.batch = 1;
  EXPECT_EQ(cuda::kdaDecodeWorkspaceBytes(params), 0u); // the fused path needs none
}

} // namespace
} // namespace hybrid::kernels
