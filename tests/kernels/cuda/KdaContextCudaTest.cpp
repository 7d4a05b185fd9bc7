// Context parallelism's KDA kernels (KdaContext.h) against the cpu reference: segment summaries
// of a varlen batch (empty and 1-token segments, nonzero conv histories) against
// ref::kdaSegmentSummary on the same prolog, and the composition of summaries onto a state (fp32
// and bf16 storage, in place) against ref::kdaApplySummary; and the end-to-end property the
// runtime relies on: composing the summaries of a sequence's segments gives the state a prefill
// of the whole sequence ends with. Labelled `gpu`; skipped where no GPU is present.
#include "hybrid/kernels/cuda/KdaContext.h"
#include "hybrid/kernels/ref/Kda.h"
#include "hybrid/kernels/ref/Norm.h"
#include "CudaTestSupport.h"

#include <optional>
#include <span>
#include <vector>

namespace hybrid::kernels {
namespace {

// Relative RMS bounds: the recurrent path is fp32 throughout (kKdaPrefill's own bounds), the
// composition is K fp32 FMAs per element per summary.
constexpr double kSummaryError = 1e-5, kComposeError = 1e-6, kBf16ComposeError = 1e-2;

struct Inputs {
  int H, D, W, P;
  std::vector<int32_t> cuSeqlens;
  std::vector<float> qkv, convWeight, forget, aLog, dtBias, betaLogits, gate, normWeight, conv;
};

Inputs makeInputs(const std::vector<int32_t> &lengths, int H, int D, int W, unsigned seed) {
  Inputs in{H, D, W, H * D, {0}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  for (int32_t length : lengths)
    in.cuSeqlens.push_back(in.cuSeqlens.back() + length);
  const size_t T = size_t(in.cuSeqlens.back()), P = size_t(in.P);
  std::mt19937 rng(seed);
  in.qkv = random(T * 3 * P, rng, 1.0f);
  in.convWeight = random(3 * P * size_t(W), rng, 0.5f);
  in.forget = random(T * P, rng, 1.0f);
  in.aLog = random(size_t(H), rng, 0.3f, 0.5f);
  in.dtBias = random(P, rng, 0.5f);
  in.betaLogits = random(T * size_t(H), rng, 1.0f);
  in.gate = random(T * P, rng, 1.0f);
  in.normWeight = random(size_t(D), rng, 0.1f, 1.0f);
  in.conv = random(lengths.size() * 3 * size_t(W - 1) * P, rng, 1.0f);
  return in;
}

// Segment b's prolog on the cpu (conv from its own history, SiLU, L2 norms, gate, beta), as the
// prefill kernels compute it.
struct Prolog {
  std::vector<float> q, k, v, g, beta;
};
Prolog prologOf(const Inputs &in, int b) {
  const int begin = in.cuSeqlens[size_t(b)], L = in.cuSeqlens[size_t(b) + 1] - begin;
  const size_t P = size_t(in.P), W = size_t(in.W);
  Prolog out;
  std::vector<float> *projected[3] = {&out.q, &out.k, &out.v};
  for (size_t projection = 0; projection < 3; ++projection) {
    std::vector<float> x(size_t(L) * P);
    for (int t = 0; t < L; ++t)
      std::copy_n(in.qkv.begin() + (size_t(begin + t) * 3 + projection) * P, P,
                  x.begin() + size_t(t) * P);
    std::vector<float> taps(in.convWeight.begin() + projection * P * W,
                            in.convWeight.begin() + (projection + 1) * P * W);
    std::vector<float> history(in.conv.begin() + (size_t(b) * 3 + projection) * (W - 1) * P,
                               in.conv.begin() + (size_t(b) * 3 + projection + 1) * (W - 1) * P);
    projected[projection]->resize(size_t(L) * P);
    ref::shortConvSilu(x, taps, history, *projected[projection], L, int64_t(P), int64_t(W));
  }
  ref::l2NormalizeRows(out.q, int64_t(L) * in.H, in.D);
  ref::l2NormalizeRows(out.k, int64_t(L) * in.H, in.D);
  out.g.resize(size_t(L) * P);
  ref::kdaGate({in.forget.data() + size_t(begin) * P, size_t(L) * P}, in.aLog, in.dtBias, out.g,
               L, in.H, in.D, std::nullopt);
  out.beta.assign(in.betaLogits.begin() + size_t(begin) * in.H,
                  in.betaLogits.begin() + size_t(begin + L) * in.H);
  ref::kdaBeta(out.beta);
  return out;
}

// Runs launchKdaSegmentSummary on `in`; the summaries, each [M | B], stride 2 H K K + 64 (a
// stride wider than the summary, as a plan value's row may be).
std::vector<float> gpuSummaries(const Inputs &in, cuda::KdaPrefillPath path) {
  const int S = int(in.cuSeqlens.size()) - 1;
  const int64_t stride = 2 * int64_t(in.H) * in.D * in.D + 64;
  DeviceBuffer<int32_t> dCu(in.cuSeqlens);
  DeviceBuffer<float> dQkv(in.qkv), dConvWeight(in.convWeight), dForget(in.forget),
      dALog(in.aLog), dDtBias(in.dtBias), dBeta(in.betaLogits), dGate(in.gate),
      dNorm(in.normWeight), dConv(in.conv),
      dSummaries(std::vector<float>(size_t(S) * size_t(stride), -3.0f));
  cuda::KdaSegmentSummaryParams p;
  p.heads = in.H;
  p.headDim = in.D;
  p.convKernel = in.W;
  p.weights.convWeight = dConvWeight.data;
  p.weights.aLog = dALog.data;
  p.weights.dtBias = dDtBias.data;
  p.weights.normWeight = dNorm.data;
  p.qkv = dQkv.data;
  p.forget = dForget.data;
  p.betaLogits = dBeta.data;
  p.outputGate = dGate.data;
  p.convState = dConv.data;
  p.sequences = S;
  p.cuSeqlens = dCu.data;
  p.tokens = in.cuSeqlens.back();
  p.summaries = dSummaries.data;
  p.summaryStride = stride;
  p.path = path;
  DeviceBuffer<unsigned char> workspace(
      std::vector<unsigned char>(cuda::kdaSegmentSummaryWorkspaceBytes(p), 0xff));
  p.workspace = workspace.data;
  EXPECT_EQ(cuda::launchKdaSegmentSummary(p, nullptr), 0);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // The conv histories are read only.
  EXPECT_EQ(dConv.download(), in.conv);
  return dSummaries.download();
}

TEST(KdaContextCuda, SegmentSummariesMatchTheReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  for (const auto &[lengths, D, W] :
       {std::tuple{std::vector<int32_t>{37, 0, 1, 70}, 64, 4},
        std::tuple{std::vector<int32_t>{5, 130}, 128, 3},
        std::tuple{std::vector<int32_t>{0, 0}, 64, 2}}) {
    const Inputs in = makeInputs(lengths, 2, D, W, unsigned(D + W));
    const std::vector<float> summaries = gpuSummaries(in, cuda::KdaPrefillPath::Recurrent);
    const size_t transition = size_t(in.H) * size_t(D) * size_t(D);
    const size_t stride = 2 * transition + 64;
    for (size_t b = 0; b < lengths.size(); ++b) {
      const Prolog prolog = prologOf(in, int(b));
      std::vector<float> M(transition), B(transition);
      ref::KdaParams segment;
      segment.numTokens = lengths[b];
      segment.numHeads = in.H;
      segment.keyDim = segment.valueDim = D;
      segment.q = prolog.q.data();
      segment.k = prolog.k.data();
      segment.v = prolog.v.data();
      segment.g = prolog.g.data();
      segment.beta = prolog.beta.data();
      ref::kdaSegmentSummary(segment, M.data(), B.data());
      const std::vector<float> gotM(summaries.begin() + b * stride,
                                    summaries.begin() + b * stride + transition);
      const std::vector<float> gotB(summaries.begin() + b * stride + transition,
                                    summaries.begin() + b * stride + 2 * transition);
      EXPECT_LT(relativeRms(gotM, M), kSummaryError) << "M of segment " << b << " (D " << D << ")";
      if (lengths[b] > 0)
        EXPECT_LT(relativeRms(gotB, B), kSummaryError)
            << "B of segment " << b << " (D " << D << ")";
      else
        EXPECT_EQ(gotB, B) << "an empty segment's B is zero";
      EXPECT_EQ(summaries[b * stride + 2 * transition], -3.0f) << "wrote past the summary";
    }
  }
}

TEST(KdaContextCuda, ComposedSummariesMatchTheReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const int H = 3, count = 4;
  for (int D : {64, 128})
    for (bool bf16 : {false, true}) {
      std::mt19937 rng(unsigned(D) + (bf16 ? 1u : 0u));
      const size_t transition = size_t(H) * size_t(D) * size_t(D);
      const int64_t stride = int64_t(2 * transition);
      std::vector<float> summaries = random(size_t(count) * 2 * transition, rng, 0.1f);
      std::vector<float> before = random(transition, rng, 0.5f);
      if (bf16)
        before = roundedToBf16(before);
      std::vector<float> expected = before, next(transition);
      for (int s = 0; s < count; ++s) {
        const float *M = summaries.data() + size_t(s) * 2 * transition;
        ref::kdaApplySummary(H, D, D, M, M + transition, expected.data(), next.data());
        expected = next;
      }
      DeviceBuffer<float> dSummaries(summaries);
      DeviceState state(before, bf16), composed(std::vector<float>(transition, 0.0f), false);
      cuda::KdaComposeParams p;
      p.heads = H;
      p.headDim = D;
      p.count = count;
      p.summaries = dSummaries.data;
      p.summaryStride = stride;
      p.stateBefore = state.data();
      p.beforeType = bf16 ? cuda::KdaStateType::BF16 : cuda::KdaStateType::F32;
      p.stateAfter = composed.data(); // into fp32
      ASSERT_EQ(cuda::launchKdaComposeSummaries(p, nullptr), 0);
      p.stateAfter = state.data(); // and in place, in the state's own type
      p.afterType = p.beforeType;
      ASSERT_EQ(cuda::launchKdaComposeSummaries(p, nullptr), 0);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_LT(relativeRms(composed.download(), expected), kComposeError) << "D " << D;
      EXPECT_LT(relativeRms(state.download(), bf16 ? roundedToBf16(expected) : expected),
                bf16 ? kBf16ComposeError : kComposeError)
          << "in place, D " << D << (bf16 ? " bf16" : "");
      p.count = 0; // no summary: a copy
      p.stateBefore = composed.data();
      p.beforeType = cuda::KdaStateType::F32;
      DeviceState copy(std::vector<float>(transition, 1.0f), false);
      p.stateAfter = copy.data();
      p.afterType = cuda::KdaStateType::F32;
      ASSERT_EQ(cuda::launchKdaComposeSummaries(p, nullptr), 0);
      EXPECT_EQ(copy.download(), composed.download());
    }
}

// What context parallelism relies on: a sequence cut into segments, each summarized from the conv
// history it really starts from, composes (from a nonzero state) to the state the prefill of the
// whole sequence ends with.
TEST(KdaContextCuda, ComposedSegmentsEqualTheWholePrefill) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  for (cuda::KdaPrefillPath path : {cuda::KdaPrefillPath::Recurrent, cuda::KdaPrefillPath::Chunked}) {
    const int H = 2, D = 128, W = 4, n = W - 1;
    const std::vector<int32_t> cuts = {0, 50, 51, 51, 180}; // segments of 50, 1, 0, 129
    Inputs whole = makeInputs({cuts.back()}, H, D, W, 7);
    const int P = whole.P;
    std::mt19937 rng(11);
    const std::vector<float> state0 = random(size_t(H) * D * D, rng, 0.05f);
    // The whole prefill.
    DeviceBuffer<int32_t> dCu(whole.cuSeqlens);
    DeviceBuffer<float> dQkv(whole.qkv), dConvWeight(whole.convWeight), dForget(whole.forget),
        dALog(whole.aLog), dDtBias(whole.dtBias), dBeta(whole.betaLogits), dGate(whole.gate),
        dNorm(whole.normWeight), dConv(whole.conv), dState(state0),
        dOut(std::vector<float>(size_t(cuts.back()) * P));
    cuda::KdaPrefillParams prefill;
    prefill.heads = H;
    prefill.headDim = D;
    prefill.convKernel = W;
    prefill.weights.convWeight = dConvWeight.data;
    prefill.weights.aLog = dALog.data;
    prefill.weights.dtBias = dDtBias.data;
    prefill.weights.normWeight = dNorm.data;
    prefill.qkv = dQkv.data;
    prefill.forget = dForget.data;
    prefill.betaLogits = dBeta.data;
    prefill.outputGate = dGate.data;
    prefill.convState = dConv.data;
    prefill.state = dState.data;
    prefill.out = dOut.data;
    prefill.sequences = 1;
    prefill.cuSeqlens = dCu.data;
    prefill.tokens = cuts.back();
    prefill.path = path;
    DeviceBuffer<unsigned char> prefillWorkspace(
        std::vector<unsigned char>(cuda::kdaPrefillWorkspaceBytes(prefill) + 1, 0));
    prefill.workspace = prefillWorkspace.data;
    ASSERT_EQ(cuda::launchKdaPrefill(prefill, nullptr), 0);

    // The segments: each one's conv history from the tokens before it (or the initial history).
    Inputs segments = whole;
    segments.cuSeqlens = cuts;
    segments.conv.assign(size_t(cuts.size() - 1) * 3 * n * P, 0.0f);
    for (size_t s = 0; s + 1 < cuts.size(); ++s)
      for (int projection = 0; projection < 3; ++projection)
        for (int j = 0; j < n; ++j) {
          const int position = cuts[s] - n + j;
          const float *from =
              position >= 0 ? whole.qkv.data() + (size_t(position) * 3 + projection) * P
                            : whole.conv.data() + (size_t(projection) * n + n + position) * P;
          std::copy_n(from, P, segments.conv.data() + ((s * 3 + projection) * n + j) * P);
        }
    const std::vector<float> summaries = gpuSummaries(segments, path);
    DeviceBuffer<float> dSummaries(summaries), dBefore(state0),
        dComposed(std::vector<float>(state0.size()));
    cuda::KdaComposeParams compose;
    compose.heads = H;
    compose.headDim = D;
    compose.count = int32_t(cuts.size() - 1);
    compose.summaries = dSummaries.data;
    compose.summaryStride = 2 * int64_t(H) * D * D + 64;
    compose.stateBefore = dBefore.data;
    compose.stateAfter = dComposed.data;
    ASSERT_EQ(cuda::launchKdaComposeSummaries(compose, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(relativeRms(dComposed.download(), dState.download()),
              path == cuda::KdaPrefillPath::Chunked ? 1e-2 : kSummaryError)
        << (path == cuda::KdaPrefillPath::Chunked ? "chunked" : "recurrent");
  }
}

TEST(KdaContextCuda, RejectsBadParameters) {
  cuda::KdaSegmentSummaryParams summary;
  summary.heads = 2;
  summary.headDim = 96; // neither 64 nor 128
  EXPECT_EQ(cuda::launchKdaSegmentSummary(summary, nullptr), int(cudaErrorInvalidValue));
  summary.headDim = 64;
  summary.sequences = 1;
  float placeholder = 0;
  int32_t cu[2] = {0, 0};
  summary.cuSeqlens = cu;
  summary.summaries = &placeholder;
  summary.workspace = &placeholder;
  summary.convKernel = 1;
  summary.summaryStride = 2 * 2 * 64 * 64 - 1; // one float short
  EXPECT_EQ(cuda::launchKdaSegmentSummary(summary, nullptr), int(cudaErrorInvalidValue));
  cuda::KdaComposeParams compose;
  compose.heads = 1;
  compose.headDim = 64;
  compose.count = 1;
  compose.stateBefore = compose.stateAfter = &placeholder;
  EXPECT_EQ(cuda::launchKdaComposeSummaries(compose, nullptr), int(cudaErrorInvalidValue))
      << "summaries missing";
}

} // namespace
} // namespace hybrid::kernels
