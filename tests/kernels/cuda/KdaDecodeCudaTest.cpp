// The fused KDA decode kernel against the cpu reference (kernels/ref), several steps with the
// recurrent and conv state carried across calls. Labelled `gpu`; skipped where no GPU is present.
#include "CudaTestSupport.h"
#include "hybrid/kernels/cuda/KdaDecode.h"
#include "hybrid/kernels/cuda/Linear.h"
#include "hybrid/kernels/ref/Kda.h"
#include "hybrid/kernels/ref/Norm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <limits>
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

struct LowRankCase {
  int batch, heads, headDim, rank;
  bool roundInputToBf16, forgetLowRank, gateLowRank;
};

// The gates' low-rank second halves computed in the fused kernel (forgetLowRank, gateLowRank)
// give exactly what the decode GEMV launch (LinearContext::runGroup, as the runtime runs it)
// feeding the kernel gives: outputs, states and conv states, bit for bit, over carried steps.
// The inputs the kernel computes itself are NaN in its run: reading them would show.
TEST(KdaDecodeCudaLowRank, GatesComputedInTheKernelGiveTheGemvLaunchBits) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  cuda::LinearContext linear;
  ASSERT_EQ(linear.init(), 0);
  for (const LowRankCase &c :
       {LowRankCase{1, 32, 128, 128, true, true, true},
        LowRankCase{3, 4, 128, 128, false, true, true},
        LowRankCase{8, 5, 128, 64, true, true, false}, LowRankCase{2, 6, 64, 64, true, false, true},
        LowRankCase{5, 3, 64, 128, false, true, true},
        LowRankCase{4, 2, 128, 8, true, true, true}}) {
    const auto [B, H, D, rank, roundInput, forgetLowRank, gateLowRank] = c;
    SCOPED_TRACE("batch " + std::to_string(B) + ", heads " + std::to_string(H) + ", dim " +
                 std::to_string(D) + ", rank " + std::to_string(rank) +
                 (roundInput ? ", bf16 inputs" : ", fp32 inputs") +
                 (forgetLowRank ? ", forget" : "") + (gateLowRank ? ", gate" : ""));
    const int P = H * D, W = 4;
    const int64_t inStride = rank + 8; // rows apart, as in the runtime's scratch
    std::mt19937 rng(B * 17 + H * 5 + D + rank);
    const DeviceBuffer<float> weights[4] = {
        DeviceBuffer<float>(random(size_t(3) * P * W, rng, 0.5f)),
        DeviceBuffer<float>(random(H, rng, 0.3f, 0.5f)), DeviceBuffer<float>(random(P, rng, 0.5f)),
        DeviceBuffer<float>(random(D, rng, 0.1f, 1.0f))};
    const DeviceBuffer<uint16_t> forgetUp(bf16Bits(random(size_t(P) * rank, rng, 0.2f)));
    const DeviceBuffer<uint16_t> gateUp(bf16Bits(random(size_t(P) * rank, rng, 0.2f)));
    const std::vector<float> state = random(size_t(B) * H * D * D, rng, 0.05f);
    const std::vector<float> convState = random(size_t(B) * 3 * (W - 1) * P, rng, 1.0f);
    DeviceBuffer<float> statesOf[2] = {DeviceBuffer<float>(state), DeviceBuffer<float>(state)};
    DeviceBuffer<float> convOf[2] = {DeviceBuffer<float>(convState),
                                     DeviceBuffer<float>(convState)};
    for (int step = 0; step < 2; ++step) {
      const DeviceBuffer<float> lowRankIn[2] = {
          DeviceBuffer<float>(random(size_t(B) * inStride, rng, 1.0f)),
          DeviceBuffer<float>(random(size_t(B) * inStride, rng, 1.0f))};
      const std::vector<float> fullForget = random(size_t(B) * P, rng, 1.0f);
      const std::vector<float> fullGate = random(size_t(B) * P, rng, 1.0f);
      const std::vector<float> qkv = random(size_t(B) * 3 * P, rng, 1.0f);
      const std::vector<float> betaLogits = random(size_t(B) * H, rng, 1.0f);
      std::vector<float> outs[2];
      for (int inKernel = 0; inKernel < 2; ++inKernel) {
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::vector<float> forget = fullForget, gate = fullGate;
        if (inKernel && forgetLowRank)
          forget.assign(forget.size(), nan);
        if (inKernel && gateLowRank)
          gate.assign(gate.size(), nan);
        const DeviceBuffer<float> inputs[4] = {
            DeviceBuffer<float>(qkv), DeviceBuffer<float>(forget), DeviceBuffer<float>(betaLogits),
            DeviceBuffer<float>(gate)};
        DeviceBuffer<float> dOut(std::vector<float>(size_t(B) * P));
        DeviceBuffer<uint16_t> xScratch(std::vector<uint16_t>(size_t(2 * B) * rank));
        DeviceBuffer<float> splitOutput(std::vector<float>(size_t(2 * B) * P));
        cuda::KdaDecodeParams params = decodeParams(B, H, D, W, weights, inputs);
        params.state = statesOf[inKernel].data;
        params.convState = convOf[inKernel].data;
        params.out = dOut.data;
        params.path = cuda::KdaDecodePath::Fused;
        // The low-rank projections: in the kernel, or by the GEMV into the gate inputs.
        cuda::LinearParams launches[2];
        int count = 0;
        for (int which = 0; which < 2; ++which) {
          if (!(which == 0 ? forgetLowRank : gateLowRank))
            continue;
          const void *up = which == 0 ? static_cast<const void *>(forgetUp.data) : gateUp.data;
          if (inKernel) {
            cuda::KdaLowRankGate &g = which == 0 ? params.forgetLowRank : params.gateLowRank;
            g = {lowRankIn[which].data, inStride, up, rank, rank};
          } else {
            cuda::LinearParams &l = launches[count++];
            l.rows = B;
            l.in = rank;
            l.out = P;
            l.x = lowRankIn[which].data;
            l.xStride = inStride;
            l.weight = up;
            l.y = const_cast<float *>(which == 0 ? inputs[1].data : inputs[3].data);
            l.xScratch = xScratch.data;
            l.splitInput = !roundInput;
            l.splitOutput = splitOutput.data;
            ASSERT_TRUE(linear.runsDecodeKernel(l));
          }
        }
        params.lowRankRoundInputToBf16 = roundInput;
        if (count > 0)
          ASSERT_EQ(linear.runGroup(launches, count, nullptr), 0);
        ASSERT_EQ(cuda::launchKdaFusedDecode(params, nullptr), 0);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        outs[inKernel] = dOut.download();
      }
      EXPECT_EQ(differingBits(outs[1], outs[0]), 0u) << "outputs, step " << step;
      EXPECT_EQ(differingBits(statesOf[1].download(), statesOf[0].download()), 0u)
          << "states, step " << step;
      EXPECT_EQ(differingBits(convOf[1].download(), convOf[0].download()), 0u)
          << "conv states, step " << step;
    }
  }
}

// A low-rank gate the fused kernel cannot take is refused before anything runs: on the split
// path (checked before its workspace), a rank past kKdaDecodeMaxLowRank or not a multiple of 8,
// a missing input.
TEST(KdaDecodeCudaErrors, LowRankGateOutsideItsLimits) {
  alignas(16) static const float in[256] = {};
  alignas(16) static const uint16_t weight[256] = {};
  cuda::KdaDecodeParams params;
  params.batch = 1;
  params.heads = 1;
  params.headDim = 128;
  params.path = cuda::KdaDecodePath::Split;
  params.forgetLowRank = {in, 128, weight, 128, 128};
  EXPECT_EQ(cuda::launchKdaFusedDecode(params, nullptr), int(cudaErrorInvalidValue));
  params.path = cuda::KdaDecodePath::Fused;
  for (int32_t rank : {cuda::kKdaDecodeMaxLowRank + 8, 12, 0}) {
    params.gateLowRank = {in, 256, weight, 256, rank};
    EXPECT_EQ(cuda::launchKdaFusedDecode(params, nullptr), int(cudaErrorInvalidValue))
        << "rank " << rank;
  }
  params.gateLowRank = {nullptr, 128, weight, 128, 128};
  EXPECT_EQ(cuda::launchKdaFusedDecode(params, nullptr), int(cudaErrorInvalidValue));
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
