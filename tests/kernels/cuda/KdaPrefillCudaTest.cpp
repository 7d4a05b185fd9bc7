// The KDA prefill kernels (recurrent and chunked) against the cpu reference on varlen batches: empty
// and 1-token sequences, odd lengths, partial and many chunks, strong decay, nonzero initial
// recurrent and conv states, final states checked. Labelled `gpu`; skipped where no GPU is present.
#include "hybrid/kernels/cuda/KdaDecode.h"
#include "hybrid/kernels/cuda/KdaPrefill.h"
#include "hybrid/kernels/ref/Kda.h"
#include "hybrid/kernels/ref/Norm.h"
#include "CudaTestSupport.h"

#include <array>
#include <optional>
#include <utility>
#include <string>
#include <vector>

namespace hybrid::kernels {
namespace {

enum class Path { Recurrent, Chunked };

struct Case {
  std::vector<int32_t> lengths;
  int heads, headDim, convKernel;
  bool lowerBound;
  Path path = Path::Recurrent;
  float aLogOffset = 0.5f; // 2.0: e^2 = 7.4x stronger softplus decay, ~5 nats per token
  bool bf16State = false;  // the state stored as bf16 (KdaStateType::BF16)
};

// Relative RMS error bounds. The recurrent kernel is fp32 throughout. The chunked kernel feeds the
// tensor cores bf16 operands (unit roundoff 2^-9 = 2e-3) with fp32 accumulation and an fp32 state,
// as fla's chunk_kda and FlashKDA do; its errors are rounding errors of a few such products.
constexpr double kRecurrentOutputError = 1e-5, kRecurrentStateError = 1e-5;
constexpr double kChunkedOutputError = 1e-2, kChunkedStateError = 1e-2;
// A bf16 state is rounded once, when the final state is stored; the reference rounds its final
// state the same way. Different fp32 summation orders can put an element near a rounding
// boundary one bf16 ulp (2^-8 relative) apart: a few such elements stay far below this bound.
constexpr double kRecurrentBf16StateError = 1e-4;

// 36 sequences of 70, 1, 0 and 20 tokens in turn: with 16 heads, 4 x 16 x 36 = 2304 chain blocks,
// more than 4 per SM on any GPU of this generation, so the chunked path takes its one-role chain
// form (the other cases take the two-role form).
std::vector<int32_t> manySequences() {
  std::vector<int32_t> lengths;
  for (int i = 0; i < 36; ++i)
    lengths.push_back(std::array<int32_t, 4>{70, 1, 0, 20}[i % 4]);
  return lengths;
}

class KdaPrefillCuda : public testing::TestWithParam<Case> {};

TEST_P(KdaPrefillCuda, MatchesReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const Case &c = GetParam();
  const int N = int(c.lengths.size()), H = c.heads, D = c.headDim, W = c.convKernel, P = H * D;
  std::vector<int32_t> cuSeqlens = {0};
  for (int32_t length : c.lengths)
    cuSeqlens.push_back(cuSeqlens.back() + length);
  const int T = cuSeqlens.back();
  std::mt19937 rng(T * 31 + H * 7 + D + W);
  std::vector<float> qkv = random(size_t(T) * 3 * P, rng, 1.0f);
  std::vector<float> convWeight = random(size_t(3) * P * W, rng, 0.5f);
  std::vector<float> forget = random(size_t(T) * P, rng, 1.0f);
  std::vector<float> aLog = random(H, rng, 0.3f, c.aLogOffset);
  std::vector<float> dtBias = random(P, rng, 0.5f);
  std::vector<float> betaLogits = random(size_t(T) * H, rng, 1.0f);
  std::vector<float> gate = random(size_t(T) * P, rng, 1.0f);
  std::vector<float> normWeight = random(D, rng, 0.1f, 1.0f);
  std::vector<float> convState = random(size_t(N) * 3 * (W - 1) * P, rng, 1.0f);
  std::vector<float> state = random(size_t(N) * H * D * D, rng, 0.05f);
  if (c.bf16State)
    state = roundedToBf16(state);

  DeviceBuffer<int32_t> dCu(cuSeqlens);
  DeviceBuffer<float> dQkv(qkv), dConvWeight(convWeight), dForget(forget), dALog(aLog),
      dDtBias(dtBias), dBeta(betaLogits), dGate(gate), dNorm(normWeight), dConvState(convState),
      dOut(std::vector<float>(size_t(T) * P, -7.0f));
  DeviceState dState(state, c.bf16State);
  cuda::KdaPrefillParams params;
  params.sequences = N;
  params.heads = H;
  params.headDim = D;
  params.convKernel = W;
  params.cuSeqlens = dCu.data;
  params.qkv = dQkv.data;
  params.weights.convWeight = dConvWeight.data;
  params.forget = dForget.data;
  params.weights.aLog = dALog.data;
  params.weights.dtBias = dDtBias.data;
  params.betaLogits = dBeta.data;
  params.outputGate = dGate.data;
  params.weights.normWeight = dNorm.data;
  params.weights.lowerBoundGate = c.lowerBound;
  params.convState = dConvState.data;
  params.state = dState.data();
  params.stateType = c.bf16State ? cuda::KdaStateType::BF16 : cuda::KdaStateType::F32;
  params.out = dOut.data;
  params.tokens = T;
  const bool chunked = c.path == Path::Chunked;
  DeviceBuffer<unsigned char> workspace(std::vector<unsigned char>(
      chunked ? cuda::kdaChunkedPrefillWorkspaceBytes(params) : 0, 0xff));
  params.workspace = workspace.data;
  ASSERT_EQ(chunked ? cuda::launchKdaChunkedPrefill(params, nullptr)
                    : cuda::launchKdaRecurrentPrefill(params, nullptr),
            0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // The cpu reference, sequence by sequence, on the same packed layout.
  std::vector<float> refOut(size_t(T) * P, 0.0f), refConv = convState, refState = state;
  for (int b = 0; b < N; ++b) {
    const int begin = cuSeqlens[b], L = c.lengths[b];
    if (L == 0)
      continue;
    std::vector<float> projected[3];
    for (int projection = 0; projection < 3; ++projection) {
      std::vector<float> in(size_t(L) * P);
      for (int t = 0; t < L; ++t)
        std::copy_n(qkv.begin() + (size_t(begin + t) * 3 + projection) * P, P,
                    in.begin() + size_t(t) * P);
      std::vector<float> taps(convWeight.begin() + size_t(projection) * P * W,
                              convWeight.begin() + size_t(projection + 1) * P * W);
      std::span<float> history(refConv.data() + (size_t(b) * 3 + projection) * (W - 1) * P,
                               size_t(W - 1) * P);
      projected[projection].resize(size_t(L) * P);
      ref::shortConvSilu(in, taps, history, projected[projection], L, P, W);
    }
    ref::l2NormalizeRows(projected[0], int64_t(L) * H, D);
    ref::l2NormalizeRows(projected[1], int64_t(L) * H, D);
    std::vector<float> g(size_t(L) * P);
    std::optional<float> bound;
    if (c.lowerBound)
      bound = -5.0f;
    ref::kdaGate({forget.data() + size_t(begin) * P, size_t(L) * P}, aLog, dtBias, g, L, H, D,
                 bound);
    std::vector<float> beta(betaLogits.begin() + size_t(begin) * H,
                            betaLogits.begin() + size_t(begin + L) * H);
    ref::kdaBeta(beta);
    std::vector<float> o(size_t(L) * P);
    ref::KdaParams core{L,           H,           D,           D,
                        0.0f,        projected[0].data(), projected[1].data(), projected[2].data(),
                        g.data(),    beta.data(), refState.data() + size_t(b) * H * D * D,
                        o.data()};
    ref::kdaRecurrent(core);
    ref::gatedRmsNorm(o, {gate.data() + size_t(begin) * P, size_t(L) * P}, normWeight,
                      {refOut.data() + size_t(begin) * P, size_t(L) * P}, int64_t(L) * H, D,
                      1e-5f);
  }
  if (c.bf16State)
    refState = roundedToBf16(refState);
  const std::vector<float> out = dOut.download(), finalState = dState.download();
  // In the XML report (--gtest_output=xml), so the achieved accuracy is on record.
  RecordProperty("output_relative_rms", std::to_string(relativeRms(out, refOut)));
  RecordProperty("state_relative_rms", std::to_string(relativeRms(finalState, refState)));
  EXPECT_LT(relativeRms(out, refOut), chunked ? kChunkedOutputError : kRecurrentOutputError)
      << "output";
  EXPECT_LT(relativeRms(finalState, refState),
            chunked ? kChunkedStateError
                    : (c.bf16State ? kRecurrentBf16StateError : kRecurrentStateError))
      << "final state";
  EXPECT_LT(relativeRms(dConvState.download(), refConv), 1e-6) << "final conv state";
  // Per sequence too, so a wrong short sequence cannot hide behind a long one.
  for (int b = 0; b < N; ++b) {
    const size_t first = size_t(cuSeqlens[b]) * P, last = size_t(cuSeqlens[b + 1]) * P;
    if (first == last)
      continue;
    EXPECT_LT(relativeRms({out.begin() + first, out.begin() + last},
                          {refOut.begin() + first, refOut.begin() + last}),
              chunked ? kChunkedOutputError : kRecurrentOutputError)
        << "output of sequence " << b;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Varlen, KdaPrefillCuda,
    testing::Values(Case{{5, 0, 1, 17, 67}, 3, 128, 4, false}, Case{{1}, 2, 128, 4, true},
                    Case{{0, 33, 0, 2}, 4, 64, 3, true}, Case{{9, 130}, 2, 64, 1, false},
                    Case{{5, 0, 1, 17, 67}, 3, 128, 4, false, Path::Chunked},
                    Case{{1}, 2, 128, 4, true, Path::Chunked},
                    Case{{0, 64, 0, 2, 65, 130}, 2, 128, 3, true, Path::Chunked},
                    Case{{300, 63, 128}, 2, 128, 2, false, Path::Chunked},
                    Case{{200, 7}, 2, 128, 4, false, Path::Chunked, 2.0f},
                    Case{{129, 16}, 3, 128, 1, true, Path::Chunked, 2.0f},
                    Case{manySequences(), 16, 128, 4, false, Path::Chunked},
                    // bf16 state: both kernels, both chain forms
                    Case{{5, 0, 1, 17, 67}, 3, 128, 4, false, Path::Recurrent, 0.5f, true},
                    Case{{0, 33, 0, 2}, 4, 64, 3, true, Path::Recurrent, 0.5f, true},
                    Case{{0, 64, 0, 2, 65, 130}, 2, 128, 3, true, Path::Chunked, 0.5f, true},
                    Case{manySequences(), 16, 128, 4, false, Path::Chunked, 0.5f, true}),
    [](const testing::TestParamInfo<Case> &info) {
      // appends only: GCC 12 warns falsely on "literal" + std::string
      std::string name = info.param.path == Path::Chunked ? "chunked" : "recurrent";
      name += std::to_string(info.index);
      name += "_D";
      name += std::to_string(info.param.headDim);
      name += "_W";
      name += std::to_string(info.param.convKernel);
      if (info.param.bf16State)
        name += "_bf16_state";
      return name;
    });

// Prefill of all but the last token, then one decode step (either path), equals prefill of
// every token: the two kernels hand the recurrent and conv state over exactly.
TEST(KdaPrefillCudaComposition, PrefillThenDecodeEqualsPrefill) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const std::vector<int32_t> lengths = {4, 9, 1, 6};
  const int N = int(lengths.size()), H = 4, D = 128, W = 4, P = H * D;
  std::vector<int32_t> full = {0}, shorter = {0};
  for (int32_t length : lengths) {
    full.push_back(full.back() + length);
    shorter.push_back(shorter.back() + length - 1);
  }
  const int T = full.back();
  std::mt19937 rng(5);
  // Per-token inputs, in packed token order: {values per token, tensor}.
  std::vector<std::pair<int, std::vector<float>>> tokens = {
      {3 * P, random(size_t(T) * 3 * P, rng, 1.0f)}, // qkv
      {P, random(size_t(T) * P, rng, 1.0f)},         // forget
      {H, random(size_t(T) * H, rng, 1.0f)},         // beta logits
      {P, random(size_t(T) * P, rng, 1.0f)}};        // output gate
  std::vector<float> convWeight = random(size_t(3) * P * W, rng, 0.5f);
  std::vector<float> aLog = random(H, rng, 0.3f, 0.5f), dtBias = random(P, rng, 0.5f);
  std::vector<float> normWeight = random(D, rng, 0.1f, 1.0f);
  std::vector<float> convState = random(size_t(N) * 3 * (W - 1) * P, rng, 1.0f);
  std::vector<float> state = random(size_t(N) * H * D * D, rng, 0.05f);
  // Rows [first, first + count) of every sequence, packed.
  auto gather = [&](const std::pair<int, std::vector<float>> &tensor, bool lastOnly) {
    std::vector<float> rows;
    for (int b = 0; b < N; ++b) {
      const int first = lastOnly ? full[b + 1] - 1 : full[b];
      const int count = lastOnly ? 1 : lengths[b] - 1;
      rows.insert(rows.end(), tensor.second.begin() + size_t(first) * tensor.first,
                  tensor.second.begin() + size_t(first + count) * tensor.first);
    }
    return rows;
  };
  DeviceBuffer<float> dConvWeight(convWeight), dALog(aLog), dDtBias(dtBias), dNorm(normWeight);
  cuda::KdaLayerWeights weights;
  weights.convWeight = dConvWeight.data;
  weights.aLog = dALog.data;
  weights.dtBias = dDtBias.data;
  weights.normWeight = dNorm.data;
  // What both kernels take: the layer and its tensors (inputs: qkv, forget, beta, gate).
  auto layerCall = [&](const DeviceBuffer<float> (&inputs)[4], DeviceBuffer<float> &dConvState,
                       DeviceBuffer<float> &dState, DeviceBuffer<float> &dOut) {
    cuda::KdaLayerCall call;
    call.heads = H;
    call.headDim = D;
    call.convKernel = W;
    call.weights = weights;
    call.qkv = inputs[0].data;
    call.forget = inputs[1].data;
    call.betaLogits = inputs[2].data;
    call.outputGate = inputs[3].data;
    call.convState = dConvState.data;
    call.state = dState.data;
    call.out = dOut.data;
    return call;
  };
  auto prefill = [&](const std::vector<int32_t> &cuSeqlens, const std::vector<float> *inputs,
                     DeviceBuffer<float> &dConvState, DeviceBuffer<float> &dState,
                     DeviceBuffer<float> &dOut) {
    DeviceBuffer<int32_t> dCu(cuSeqlens);
    const DeviceBuffer<float> dInputs[4] = {DeviceBuffer<float>(inputs[0]),
                                            DeviceBuffer<float>(inputs[1]),
                                            DeviceBuffer<float>(inputs[2]),
                                            DeviceBuffer<float>(inputs[3])};
    cuda::KdaPrefillParams params;
    static_cast<cuda::KdaLayerCall &>(params) = layerCall(dInputs, dConvState, dState, dOut);
    params.sequences = N;
    params.cuSeqlens = dCu.data;
    ASSERT_EQ(cuda::launchKdaRecurrentPrefill(params, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  };

  std::vector<float> allInputs[4];
  for (int i = 0; i < 4; ++i)
    allInputs[i] = tokens[i].second;
  DeviceBuffer<float> wholeConv(convState), wholeState(state),
      wholeOut(std::vector<float>(size_t(T) * P));
  prefill(full, allInputs, wholeConv, wholeState, wholeOut);
  std::vector<float> lastOfWhole;
  {
    const std::vector<float> out = wholeOut.download();
    for (int b = 0; b < N; ++b)
      lastOfWhole.insert(lastOfWhole.end(), out.begin() + size_t(full[b + 1] - 1) * P,
                         out.begin() + size_t(full[b + 1]) * P);
  }

  for (auto path : {cuda::KdaDecodePath::Fused, cuda::KdaDecodePath::Split}) {
    SCOPED_TRACE(path == cuda::KdaDecodePath::Fused ? "fused decode" : "split decode");
    std::vector<float> headInputs[4], lastInputs[4];
    for (int i = 0; i < 4; ++i) {
      headInputs[i] = gather(tokens[i], false);
      lastInputs[i] = gather(tokens[i], true);
    }
    DeviceBuffer<float> conv(convState), recurrent(state),
        headOut(std::vector<float>(size_t(shorter.back()) * P));
    prefill(shorter, headInputs, conv, recurrent, headOut);
    const DeviceBuffer<float> dInputs[4] = {
        DeviceBuffer<float>(lastInputs[0]), DeviceBuffer<float>(lastInputs[1]),
        DeviceBuffer<float>(lastInputs[2]), DeviceBuffer<float>(lastInputs[3])};
    DeviceBuffer<float> dOut(std::vector<float>(size_t(N) * P));
    cuda::KdaDecodeParams step;
    static_cast<cuda::KdaLayerCall &>(step) = layerCall(dInputs, conv, recurrent, dOut);
    step.batch = N;
    step.path = path;
    DeviceBuffer<unsigned char> workspace(
        std::vector<unsigned char>(cuda::kdaDecodeWorkspaceBytes(step), 0));
    step.workspace = workspace.data;
    ASSERT_EQ(cuda::launchKdaFusedDecode(step, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(relativeRms(dOut.download(), lastOfWhole), 1e-6) << "last token's output";
    EXPECT_LT(relativeRms(recurrent.download(), wholeState.download()), 1e-6) << "state";
    EXPECT_LT(relativeRms(conv.download(), wholeConv.download()), 1e-7) << "conv state";
  }
}

// Auto: the chunked kernel for long calls of 128-wide heads; the recurrent one (the decode
// step's arithmetic) for short calls such as speculative verifications, and for 64-wide heads.
TEST(KdaPrefillCudaPath, AutoTakesTheRecurrentKernelForShortCalls) {
  cuda::KdaPrefillParams params;
  params.sequences = 1;
  params.heads = 4;
  params.headDim = 128;
  params.tokens = cuda::kKdaRecurrentPrefillMaxTokens;
  EXPECT_EQ(cuda::resolveKdaPrefillPath(params), cuda::KdaPrefillPath::Recurrent);
  params.tokens = cuda::kKdaRecurrentPrefillMaxTokens + 1;
  EXPECT_EQ(cuda::resolveKdaPrefillPath(params), cuda::KdaPrefillPath::Chunked);
  params.headDim = 64;
  EXPECT_EQ(cuda::resolveKdaPrefillPath(params), cuda::KdaPrefillPath::Recurrent);
  params.headDim = 128;
  params.tokens = 5;
  params.path = cuda::KdaPrefillPath::Chunked; // forced
  EXPECT_EQ(cuda::resolveKdaPrefillPath(params), cuda::KdaPrefillPath::Chunked);
}

TEST(KdaPrefillCudaErrors, RejectsBadShapes) {
  cuda::KdaPrefillParams params;
  params.sequences = 1;
  params.heads = 1;
  params.headDim = 96;
  int32_t cuSeqlens[2] = {0, 1};
  params.cuSeqlens = cuSeqlens;
  EXPECT_EQ(cuda::launchKdaRecurrentPrefill(params, nullptr), int(cudaErrorInvalidValue));
  params.headDim = 128;
  params.convKernel = cuda::kKdaMaxConvKernel + 1;
  EXPECT_EQ(cuda::launchKdaRecurrentPrefill(params, nullptr), int(cudaErrorInvalidValue));
  params.convKernel = 4;
  params.cuSeqlens = nullptr;
  EXPECT_EQ(cuda::launchKdaRecurrentPrefill(params, nullptr), int(cudaErrorInvalidValue));
}

TEST(KdaPrefillCudaErrors, ChunkedRejectsBadShapesAndMissingWorkspace) {
  cuda::KdaPrefillParams params;
  params.sequences = 1;
  params.heads = 1;
  params.headDim = 64; // the chunked path is compiled for 128 only
  int32_t cuSeqlens[2] = {0, 1};
  params.cuSeqlens = cuSeqlens;
  params.tokens = 1;
  EXPECT_EQ(cuda::launchKdaChunkedPrefill(params, nullptr), int(cudaErrorInvalidValue));
  params.headDim = 128;
  EXPECT_EQ(cuda::launchKdaChunkedPrefill(params, nullptr), int(cudaErrorInvalidValue))
      << "no workspace";
  params.tokens = -1;
  EXPECT_EQ(cuda::launchKdaChunkedPrefill(params, nullptr), int(cudaErrorInvalidValue));
  params.tokens = 130;
  params.sequences = 3;
  // 130 / 64 + 3 = 5 chunks of (w, u, qg, kg^T: 16 KiB; Aqk: 8 KiB; e^G: 512 B) per head.
  EXPECT_EQ(cuda::kdaChunkedPrefillWorkspaceBytes(params), size_t(5) * (4 * 16384 + 8192 + 512));
}

} // namespace
} // namespace hybrid::kernels
