// MoE on CUDA (Moe.h) against the reference: the router (sigmoid and softmax scores, correction
// bias, grouped top-k, exact ties) and the routed experts per (token, expert) in bf16 and fp32,
// plus the grouped forms (tensor cores; the host-grouped form's gather / scatter-add), and every
// form skipping the experts an expert-parallel rank does not hold. Labelled `gpu`; skipped
// without a GPU.
#include "CudaTestSupport.h"
#include "MoeCudaTestSupport.h"
#include "hybrid/kernels/cuda/Linear.h" // linearFp8WeightScaleStride
#include "hybrid/kernels/cuda/Moe.h"
#include "hybrid/kernels/ref/Moe.h"
#include "hybrid/kernels/ref/Quant.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

namespace hybrid::kernels {
namespace {

struct RouterCase {
  std::string name;
  int tokens, experts, topK, groups, topKGroups;
  bool softmax, bias, ties;
};

class MoeRouterCuda : public testing::TestWithParam<RouterCase> {};

TEST_P(MoeRouterCuda, MatchesReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const RouterCase c = GetParam();
  std::mt19937 rng(3);
  std::vector<float> logits = random(size_t(c.tokens) * c.experts, rng, 2.0f);
  if (c.ties) // whole blocks of equal logits: ties broken by the lower expert id
    for (size_t i = 0; i < logits.size(); ++i)
      logits[i] = float(int(i % c.experts) / 4 % 3);
  const std::vector<float> bias = c.bias ? random(size_t(c.experts), rng, 0.1f) : std::vector<float>{};
  ref::RouterParams r;
  r.numExperts = c.experts;
  r.topK = c.topK;
  r.numGroups = c.groups;
  r.topKGroups = c.topKGroups;
  r.scoring = c.softmax ? ref::RouterScoring::Softmax : ref::RouterScoring::Sigmoid;
  r.correctionBias = bias;
  r.renormalize = true;
  r.routedScalingFactor = 2.5f;
  std::vector<int32_t> ids(size_t(c.tokens) * c.topK);
  std::vector<float> weights(ids.size());
  ref::routeTokens(logits, c.tokens, r, ids, weights);

  DeviceBuffer<float> dLogits(logits), dBias(c.bias ? bias : std::vector<float>{0.0f});
  DeviceBuffer<int32_t> dIds{std::vector<int32_t>(ids.size(), -9)};
  DeviceBuffer<float> dWeights{std::vector<float>(ids.size(), -9.0f)};
  cuda::MoeRouterParams p;
  p.tokens = c.tokens;
  p.experts = c.experts;
  p.topK = c.topK;
  p.groups = c.groups;
  p.topKGroups = c.topKGroups;
  p.softmax = c.softmax;
  p.logits = dLogits.data;
  p.correctionBias = c.bias ? dBias.data : nullptr;
  p.renormalize = true;
  p.routedScalingFactor = 2.5f;
  p.ids = dIds.data;
  p.weights = dWeights.data;
  ASSERT_EQ(cuda::launchMoeRouter(p, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(dIds.download(), ids) << "the same experts in the same order";
  const std::vector<float> got = dWeights.download();
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], weights[i], 1e-6f * std::max(1.0f, std::fabs(weights[i]))) << i;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MoeRouterCuda,
    testing::Values(
        // Kimi-Linear-48B: 256 experts, top 8, sigmoid, bias, no groups.
        RouterCase{"kimi_linear", 5, 256, 8, 1, 1, false, true, false},
        // DeepSeek-V3.2: 256 experts in 8 groups, 4 groups kept, top 8.
        RouterCase{"deepseek_v32_groups", 7, 256, 8, 8, 4, false, true, false},
        // The tiny goldens: 8 experts, 2 groups, 1 kept, top 2.
        RouterCase{"tiny", 3, 8, 2, 2, 1, false, true, false},
        RouterCase{"softmax_no_bias", 4, 64, 6, 1, 1, true, false, false},
        RouterCase{"exact_ties", 2, 64, 8, 4, 2, false, false, true},
        // Group scores by warps: 64 groups of 4 (a warp takes 8 groups, most lanes empty), 16
        // groups of 64 among 1024 experts (two experts a lane), groups of tied logits.
        RouterCase{"sixty_four_groups", 4, 256, 8, 64, 8, false, true, false},
        RouterCase{"sixteen_wide_groups", 3, 1024, 8, 16, 4, false, true, false},
        RouterCase{"group_ties", 3, 256, 8, 8, 4, false, false, true},
        // One group with sigmoid scores takes the warp-per-token kernel: ties, the other register
        // widths (up to 512 and 1024 experts, the last lanes partly empty), a batch of tokens.
        RouterCase{"one_group_ties", 9, 64, 8, 1, 1, false, false, true},
        RouterCase{"one_group_384_experts", 6, 384, 8, 1, 1, false, true, false},
        RouterCase{"one_group_1000_experts", 5, 1000, 16, 1, 1, false, true, false},
        RouterCase{"kimi_linear_batch_64", 64, 256, 8, 1, 1, false, true, false}),
    [](const testing::TestParamInfo<RouterCase> &info) { return info.param.name; });

// The routed experts per (token, expert), against ref::moeExperts on the same weights.
TEST(MoeExpertsCuda, PerTokenMatchesReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(4);
  struct Shape { int tokens, hidden, intermediate, experts, topK; };
  for (Shape s : {Shape{3, 256, 64, 8, 2}, Shape{4, 2304, 1024, 16, 8}})
    for (auto [bf16, situ] : {std::pair{true, false}, {false, false}, {true, true}}) {
      SCOPED_TRACE(std::string(bf16 ? "bf16" : "fp32") + (situ ? " SiTU" : " SiLU") + " hidden " +
                   std::to_string(s.hidden));
      const std::vector<float> x = random(size_t(s.tokens) * s.hidden, rng, 1.0f);
      std::vector<std::vector<float>> matrices; // per expert: gate, up, down
      for (int e = 0; e < s.experts; ++e)
        for (int m = 0; m < 3; ++m) {
          std::vector<float> w = random(size_t(s.hidden) * s.intermediate, rng, 0.05f);
          matrices.push_back(bf16 ? roundedToBf16(w) : w);
        }
      const auto [ids, weights] = randomRouting(s.tokens, s.experts, s.topK, 0.1f, 0.2f, rng);
      std::vector<ref::SwiGluWeights> experts;
      for (int e = 0; e < s.experts; ++e)
        experts.push_back({matrices[size_t(3 * e)], matrices[size_t(3 * e + 1)],
                           matrices[size_t(3 * e + 2)], s.hidden, s.intermediate, std::nullopt,
                           situ ? ref::GatedActivation{ref::GatedActivation::Kind::Situ, 4.0f, 25.0f}
                                : ref::GatedActivation{}});
      std::vector<float> expected(size_t(s.tokens) * s.hidden);
      ref::moeExperts(x, s.tokens, s.hidden, ids, weights, s.topK, experts, {}, expected);

      std::vector<std::unique_ptr<DeviceBuffer<float>>> f32;
      std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> b16;
      std::vector<const void *> pointers[3];
      for (size_t m = 0; m < matrices.size(); ++m) {
        const void *device = nullptr;
        if (bf16) {
          b16.push_back(std::make_unique<DeviceBuffer<uint16_t>>(bf16Bits(matrices[m])));
          device = b16.back()->data;
        } else {
          f32.push_back(std::make_unique<DeviceBuffer<float>>(matrices[m]));
          device = f32.back()->data;
        }
        pointers[m % 3].push_back(device);
      }
      auto pointerArray = [](const std::vector<const void *> &host) {
        std::vector<uint64_t> bits;
        for (const void *p : host)
          bits.push_back(reinterpret_cast<uint64_t>(p));
        return std::make_unique<DeviceBuffer<uint64_t>>(bits);
      };
      auto gate = pointerArray(pointers[0]), up = pointerArray(pointers[1]),
           down = pointerArray(pointers[2]);
      DeviceBuffer<float> dX(x), dWeights(weights), dOut{std::vector<float>(expected.size(), -3.0f)};
      DeviceBuffer<int32_t> dIds(ids);
      DeviceBuffer<uint8_t> dWorkspace{std::vector<uint8_t>(
          cuda::moeExpertsWorkspaceBytes(s.tokens, s.topK, s.hidden, s.intermediate))};
      cuda::MoeExpertsParams p =
          expertsParams(s.tokens, s.hidden, s.intermediate, s.experts, s.topK, dX.data, dIds.data,
                        dWeights.data, gate->data, up->data, down->data, dWorkspace.data);
      p.type = bf16 ? cuda::WeightType::BF16 : cuda::WeightType::F32;
      if (situ)
        p.activation = {cuda::GatedActivation::Kind::Situ, 4.0f, 25.0f};
      p.out = dOut.data;
      ASSERT_EQ(cuda::launchMoeExpertsPerToken(p, nullptr), 0);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_LT(relativeRms(dOut.download(), expected), 1e-5);
    }
}

// The per-token form's outputs are the same bits run to run and whatever else the step holds:
// a token alone (8 pairs) gives the bits it gets among 12 tokens (96 pairs), whatever the
// workspace held before. Guards any kernel choice by the step's size (a decode-only form would
// have to sum as the other does).
TEST(MoeExpertsCuda, PerTokenIsDeterministicAndBatchInvariant) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(7);
  const int tokens = 12, hidden = 768, inner = 256, experts = 16, topK = 8;
  const std::vector<float> x = random(size_t(tokens) * hidden, rng, 1.0f);
  const auto [ids, weights] = randomRouting(tokens, experts, topK, 0.05f, 0.1f, rng);
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> matrices;
  std::vector<uint64_t> pointers[3];
  for (int m = 0; m < 3 * experts; ++m) {
    matrices.push_back(std::make_unique<DeviceBuffer<uint16_t>>(
        bf16Bits(random(size_t(hidden) * inner, rng, 0.05f))));
    pointers[m % 3].push_back(reinterpret_cast<uint64_t>(matrices.back()->data));
  }
  DeviceBuffer<uint64_t> gate(pointers[0]), up(pointers[1]), down(pointers[2]);
  DeviceBuffer<float> dX(x), dWeights(weights);
  DeviceBuffer<int32_t> dIds(ids);
  auto run = [&](int first, int count) {
    DeviceBuffer<uint8_t> workspace{std::vector<uint8_t>(
        cuda::moeExpertsWorkspaceBytes(count, topK, hidden, inner), uint8_t(0xA5))};
    DeviceBuffer<float> out{std::vector<float>(size_t(count) * hidden, -3.0f)};
    cuda::MoeExpertsParams p = expertsParams(
        count, hidden, inner, experts, topK, dX.data + size_t(first) * hidden,
        dIds.data + size_t(first) * topK, dWeights.data + size_t(first) * topK, gate.data, up.data,
        down.data, workspace.data);
    p.out = out.data;
    EXPECT_EQ(cuda::launchMoeExpertsPerToken(p, nullptr), 0);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return out.download();
  };
  const std::vector<float> all = run(0, tokens);
  EXPECT_EQ(run(0, tokens), all);
  for (int t = 0; t < tokens; ++t)
    EXPECT_EQ(run(t, 1), std::vector<float>(all.begin() + size_t(t) * hidden,
                                            all.begin() + size_t(t + 1) * hidden))
        << "token " << t;
}

// Steps of up to 16 pairs stream bf16 experts' rows through shared memory where the scalar
// kernels read them with loads: the same values as fp32 weights take the scalar kernels, and
// every output must be the same bits (each dot product and the combine sum in one order).
// Kimi-Linear's widths and others the streamed form takes (8 to 16 pairs), a step above its
// pairs and widths it does not take (not multiples of 256: bf16 on the scalar kernels), invalid
// and absent experts. PerTokenIsDeterministicAndBatchInvariant compares the two forms too.
TEST(MoeExpertsCuda, StreamedBf16GivesTheScalarFormsBits) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(11);
  struct Shape {
    int tokens, hidden, intermediate, experts, topK;
  };
  for (Shape s : {Shape{1, 2304, 1024, 32, 8}, Shape{2, 2304, 1024, 32, 8},
                  Shape{2, 768, 256, 16, 8}, Shape{2, 1536, 512, 16, 6}, Shape{3, 768, 256, 16, 8},
                  Shape{2, 264, 72, 8, 4}, Shape{2, 262, 72, 8, 4}}) {
    SCOPED_TRACE("tokens " + std::to_string(s.tokens) + " hidden " + std::to_string(s.hidden));
    const std::vector<float> x = random(size_t(s.tokens) * s.hidden, rng, 1.0f);
    std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> b16;
    std::vector<std::unique_ptr<DeviceBuffer<float>>> f32;
    std::vector<uint64_t> bf16Pointers[3], f32Pointers[3];
    for (int e = 0; e < s.experts; ++e)
      for (int m = 0; m < 3; ++m) {
        if (e == 1) { // absent: an expert-parallel rank's expert held elsewhere
          bf16Pointers[m].push_back(0);
          f32Pointers[m].push_back(0);
          continue;
        }
        const std::vector<float> w =
            roundedToBf16(random(size_t(s.hidden) * s.intermediate, rng, 0.05f));
        b16.push_back(std::make_unique<DeviceBuffer<uint16_t>>(bf16Bits(w)));
        f32.push_back(std::make_unique<DeviceBuffer<float>>(w));
        bf16Pointers[m].push_back(reinterpret_cast<uint64_t>(b16.back()->data));
        f32Pointers[m].push_back(reinterpret_cast<uint64_t>(f32.back()->data));
      }
    auto [ids, weights] = randomRouting(s.tokens, s.experts, s.topK, 0.05f, 0.1f, rng);
    ids[1] = -1; // token 0's second: an invalid id adds nothing
    DeviceBuffer<float> dX(x), dWeights(weights);
    DeviceBuffer<int32_t> dIds(ids);
    auto run = [&](const std::vector<uint64_t>(&pointers)[3], cuda::WeightType type) {
      DeviceBuffer<uint64_t> gate(pointers[0]), up(pointers[1]), down(pointers[2]);
      DeviceBuffer<uint8_t> workspace{std::vector<uint8_t>(
          cuda::moeExpertsWorkspaceBytes(s.tokens, s.topK, s.hidden, s.intermediate),
          uint8_t(0xA5))};
      DeviceBuffer<float> out{std::vector<float>(size_t(s.tokens) * s.hidden, -3.0f)};
      cuda::MoeExpertsParams p =
          expertsParams(s.tokens, s.hidden, s.intermediate, s.experts, s.topK, dX.data, dIds.data,
                        dWeights.data, gate.data, up.data, down.data, workspace.data);
      p.type = type;
      p.out = out.data;
      EXPECT_EQ(cuda::launchMoeExpertsPerToken(p, nullptr), 0);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      return out.download();
    };
    const std::vector<float> scalar = run(f32Pointers, cuda::WeightType::F32);
    const std::vector<float> streamed = run(bf16Pointers, cuda::WeightType::BF16);
    ASSERT_EQ(streamed.size(), scalar.size());
    EXPECT_EQ(differingBits(streamed, scalar), 0u) << "of " << scalar.size() << " outputs";
    EXPECT_TRUE(std::any_of(scalar.begin(), scalar.end(), [](float v) { return v != 0.0f; }));
  }
}

// FP8 experts (DeepSeek-V3.2's): E4M3 codes with 128 x 128 block scales in the FP8 GEMM's padded
// layout, each projection's input rounded to E4M3 per 128 values first, against ref::moeExperts
// on the dequantized weights with the same activation rule.
// An FP8 expert matrix: E4M3 codes with random 128 x 128 block scales.
struct Fp8Matrix {
  std::vector<uint8_t> codes;
  std::vector<float> padded, values; // scales in the GEMM's layout; dequantized weights
};

Fp8Matrix randomFp8Matrix(int rows, int cols, std::mt19937 &rng) {
  Fp8Matrix m;
  const int blockRows = (rows + 127) / 128, blockCols = (cols + 127) / 128;
  const int stride = int(cuda::linearFp8WeightScaleStride(cols));
  std::uniform_real_distribution<float> scale(0.001f, 0.004f);
  std::vector<float> scales(size_t(blockRows) * blockCols);
  for (float &v : scales)
    v = scale(rng);
  m.padded.assign(size_t(blockRows) * stride, 0.0f);
  for (int r = 0; r < blockRows; ++r)
    for (int c = 0; c < blockCols; ++c)
      m.padded[size_t(r) * stride + c] = scales[size_t(r) * blockCols + c];
  m.codes.resize(size_t(rows) * cols);
  m.values.resize(m.codes.size());
  for (size_t i = 0; i < m.codes.size(); ++i) {
    m.codes[i] = uint8_t(rng() % 0x7E) | uint8_t((rng() & 1u) << 7); // never NaN
    const int r = int(i / cols), c = int(i % cols);
    m.values[i] = ref::e4m3ToFloat(m.codes[i]) * scales[size_t(r / 128) * blockCols + c / 128];
  }
  return m;
}

TEST(MoeExpertsCuda, Fp8ExpertsMatchReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  // Widths of whole 16-byte chunks (the kernels' chunked form: fewer chunks than lanes, several
  // chunks a lane with a partial last tile) and not (2-byte pairs).
  struct Shape {
    int hidden, inner;
  };
  for (Shape shape : {Shape{384, 192}, Shape{1040, 528}, Shape{392, 200}}) {
    SCOPED_TRACE("hidden " + std::to_string(shape.hidden) + " inner " +
                 std::to_string(shape.inner));
    const int tokens = 3, hidden = shape.hidden, inner = shape.inner, experts = 6, topK = 2;
    const std::vector<float> x = random(size_t(tokens) * hidden, rng, 1.0f);
    using Matrix = Fp8Matrix;
    auto makeMatrix = [&](int rows, int cols) { return randomFp8Matrix(rows, cols, rng); };
    std::vector<Matrix> matrices;
    for (int e = 0; e < experts; ++e) {
      matrices.push_back(makeMatrix(inner, hidden)); // gate
      matrices.push_back(makeMatrix(inner, hidden)); // up
      matrices.push_back(makeMatrix(hidden, inner)); // down
    }
    const std::vector<int32_t> ids = {4, 1, 0, 5, 2, 4};
    const std::vector<float> weights = {0.7f, 0.3f, 0.5f, 0.5f, 0.9f, 0.1f};
    for (auto rule :
         {cuda::Fp8ActivationScale::DeepSeekUe8m0, cuda::Fp8ActivationScale::DeepSeekLinear}) {
      const ref::Fp8ScaleRule refRule = rule == cuda::Fp8ActivationScale::DeepSeekUe8m0
                                            ? ref::Fp8ScaleRule::DeepSeekUe8m0
                                            : ref::Fp8ScaleRule::DeepSeekLinear;
      std::vector<ref::SwiGluWeights> reference;
      for (int e = 0; e < experts; ++e)
        reference.push_back({matrices[size_t(3 * e)].values, matrices[size_t(3 * e + 1)].values,
                             matrices[size_t(3 * e + 2)].values, hidden, inner, refRule});
      std::vector<float> expected(size_t(tokens) * hidden);
      ref::moeExperts(x, tokens, hidden, ids, weights, topK, reference, {}, expected);

      std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> codes;
      std::vector<std::unique_ptr<DeviceBuffer<float>>> scales;
      std::vector<uint64_t> pointers[3], scalePointers[3];
      for (size_t m = 0; m < matrices.size(); ++m) {
        codes.push_back(std::make_unique<DeviceBuffer<uint8_t>>(matrices[m].codes));
        scales.push_back(std::make_unique<DeviceBuffer<float>>(matrices[m].padded));
        pointers[m % 3].push_back(reinterpret_cast<uint64_t>(codes.back()->data));
        scalePointers[m % 3].push_back(reinterpret_cast<uint64_t>(scales.back()->data));
      }
      DeviceBuffer<uint64_t> gate(pointers[0]), up(pointers[1]), down(pointers[2]);
      DeviceBuffer<uint64_t> gateScales(scalePointers[0]), upScales(scalePointers[1]),
          downScales(scalePointers[2]);
      DeviceBuffer<float> dX(x), dWeights(weights), dOut{std::vector<float>(expected.size())};
      DeviceBuffer<int32_t> dIds(ids);
      DeviceBuffer<uint8_t> dWorkspace{
          std::vector<uint8_t>(cuda::moeExpertsWorkspaceBytes(tokens, topK, hidden, inner))};
      cuda::MoeExpertsParams p =
          expertsParams(tokens, hidden, inner, experts, topK, dX.data, dIds.data, dWeights.data,
                        gate.data, up.data, down.data, dWorkspace.data);
      setFp8Experts(p, gateScales.data, upScales.data, downScales.data);
      p.activationScale = rule;
      p.out = dOut.data;
      ASSERT_EQ(cuda::launchMoeExpertsPerToken(p, nullptr), 0);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      // The same rounded activations and weights; fp32 sums in another order (a rounding of the
      // hidden activation may land one E4M3 step apart where the gate's sum is on a boundary).
      EXPECT_LT(relativeRms(dOut.download(), expected), 1e-4);
    }
  }
}

// The grouped form on tensor cores: experts with several 64-row tiles (the last one partial),
// experts nobody chose, an invalid id (its pair skipped), and both input precisions against a
// reference that rounds exactly where the kernel does (x and h to bf16, or neither when split).
TEST(MoeExpertsCuda, GroupedOnTensorCoresMatchesReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(11);
  const int tokens = 150, hidden = 512, inner = 128, experts = 16, topK = 4;
  const std::vector<float> x = random(size_t(tokens) * hidden, rng, 1.0f);
  std::vector<std::vector<float>> matrices; // per expert: gate, up, down
  for (int e = 0; e < experts; ++e)
    for (int m = 0; m < 3; ++m)
      matrices.push_back(roundedToBf16(random(size_t(hidden) * inner, rng, 0.05f)));
  std::vector<int32_t> ids;
  std::vector<float> weights;
  for (int t = 0; t < tokens; ++t) {
    // Experts 0-9 only, skewed toward 0-2 so that those get several tiles; 10-15 stay unused.
    std::vector<int32_t> pool = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    std::shuffle(pool.begin() + 3, pool.end(), rng);
    for (int k = 0; k < topK; ++k) {
      ids.push_back(t % 2 ? pool[size_t(k)] : pool[size_t(9 - k)]);
      weights.push_back(0.1f + 0.2f * float(k));
    }
  }
  ids[17] = -1; // an invalid choice contributes nothing
  auto bf16 = [](double v) { return double(roundedToBf16(std::vector<float>{float(v)})[0]); };
  ref::GatedActivation activation; // SiLU, then Kimi K3's SiTU
  auto expected = [&](bool split) {
    std::vector<float> out(size_t(tokens) * hidden, 0.0f);
    for (int t = 0; t < tokens; ++t) {
      std::vector<int> order(topK);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        return ids[size_t(t * topK + a)] < ids[size_t(t * topK + b)];
      });
      std::vector<double> sum(size_t(hidden), 0.0);
      for (int k : order) {
        const int e = ids[size_t(t * topK + k)];
        if (e < 0)
          continue;
        const std::vector<float> &gate = matrices[size_t(3 * e)], &up = matrices[size_t(3 * e + 1)],
                                 &down = matrices[size_t(3 * e + 2)];
        std::vector<double> h(static_cast<size_t>(inner));
        for (int n = 0; n < inner; ++n) {
          double g = 0, u = 0;
          for (int c = 0; c < hidden; ++c) {
            const double v = split ? x[size_t(t * hidden + c)] : bf16(x[size_t(t * hidden + c)]);
            g += v * gate[size_t(n * hidden + c)];
            u += v * up[size_t(n * hidden + c)];
          }
          const double value = ref::gatedActivation(activation, float(g), float(u));
          h[size_t(n)] = split ? value : bf16(value);
        }
        for (int c = 0; c < hidden; ++c) {
          double y = 0;
          for (int n = 0; n < inner; ++n)
            y += h[size_t(n)] * down[size_t(c * inner + n)];
          sum[size_t(c)] += weights[size_t(t * topK + k)] * y;
        }
      }
      for (int c = 0; c < hidden; ++c)
        out[size_t(t * hidden + c)] = float(sum[size_t(c)]);
    }
    return out;
  };

  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> b16;
  std::vector<uint64_t> pointers[3];
  for (size_t m = 0; m < matrices.size(); ++m) {
    b16.push_back(std::make_unique<DeviceBuffer<uint16_t>>(bf16Bits(matrices[m])));
    pointers[m % 3].push_back(reinterpret_cast<uint64_t>(b16.back()->data));
  }
  DeviceBuffer<uint64_t> gate(pointers[0]), up(pointers[1]), down(pointers[2]);
  DeviceBuffer<float> dX(x), dWeights(weights);
  DeviceBuffer<int32_t> dIds(ids);
  DeviceBuffer<uint8_t> dWorkspace{std::vector<uint8_t>(
      cuda::moeGroupedWorkspaceBytes(tokens, topK, hidden, inner, experts))};
  cuda::MoeExpertsParams p =
      expertsParams(tokens, hidden, inner, experts, topK, dX.data, dIds.data, dWeights.data,
                    gate.data, up.data, down.data, dWorkspace.data);
  ASSERT_TRUE(cuda::moeGroupedSupports(p));
  for (auto kind : {ref::GatedActivation::Kind::Silu, ref::GatedActivation::Kind::Situ})
  for (bool split : {true, false}) {
    SCOPED_TRACE(std::string(split ? "split inputs" : "bf16 inputs") +
                 (kind == ref::GatedActivation::Kind::Situ ? ", SiTU" : ", SiLU"));
    activation = {kind, 4.0f, 25.0f};
    p.activation = {kind == ref::GatedActivation::Kind::Situ ? cuda::GatedActivation::Kind::Situ
                                                             : cuda::GatedActivation::Kind::Silu,
                    4.0f, 25.0f};
    DeviceBuffer<float> dOut{std::vector<float>(size_t(tokens) * hidden, -3.0f)};
    p.out = dOut.data;
    ASSERT_EQ(cuda::launchMoeExpertsGrouped(p, split, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // Products exact in fp32 on the tensor cores; fp32 sums in another order. Without the split
    // a bf16 rounding of h may land one step apart from the reference's.
    EXPECT_LT(relativeRms(dOut.download(), expected(split)), split ? 2e-5 : 2e-4);
  }
  p.hidden = 100; // not a multiple of 64
  EXPECT_FALSE(cuda::moeGroupedSupports(p));
  EXPECT_EQ(cuda::launchMoeExpertsGrouped(p, true, nullptr), int(cudaErrorInvalidValue));
}

// launchMoeExperts (the cuda device's launch): per token up to moePerTokenMaxPairs pairs (64, or
// a tuned threshold), grouped on tensor cores above; each form's output exactly as its own
// launch gives it, the two within the split inputs' rounding of each other.
TEST(MoeExpertsCuda, TheThresholdPicksTheForm) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(14);
  const int tokens = 10, hidden = 128, inner = 64, experts = 8, topK = 4; // 40 pairs
  const std::vector<float> x = random(size_t(tokens) * hidden, rng, 1.0f);
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> b16;
  std::vector<uint64_t> pointers[3];
  for (int m = 0; m < 3 * experts; ++m) {
    b16.push_back(std::make_unique<DeviceBuffer<uint16_t>>(
        bf16Bits(roundedToBf16(random(size_t(hidden) * inner, rng, 0.05f)))));
    pointers[m % 3].push_back(reinterpret_cast<uint64_t>(b16.back()->data));
  }
  std::vector<int32_t> ids;
  std::vector<float> weights;
  for (int t = 0; t < tokens; ++t)
    for (int k = 0; k < topK; ++k) {
      ids.push_back((t + 3 * k) % experts);
      weights.push_back(0.1f + 0.2f * float(k));
    }
  DeviceBuffer<uint64_t> gate(pointers[0]), up(pointers[1]), down(pointers[2]);
  DeviceBuffer<float> dX(x), dWeights(weights);
  DeviceBuffer<int32_t> dIds(ids);
  DeviceBuffer<uint8_t> dWorkspace{std::vector<uint8_t>(
      std::max(cuda::moeExpertsWorkspaceBytes(tokens, topK, hidden, inner),
               cuda::moeGroupedWorkspaceBytes(tokens, topK, hidden, inner, experts)))};
  cuda::MoeExpertsParams p =
      expertsParams(tokens, hidden, inner, experts, topK, dX.data, dIds.data, dWeights.data,
                    gate.data, up.data, down.data, dWorkspace.data);
  p.type = cuda::WeightType::BF16;
  auto run = [&](auto launch) {
    DeviceBuffer<float> dOut{std::vector<float>(size_t(tokens) * hidden, -3.0f)};
    p.out = dOut.data;
    EXPECT_EQ(launch(), 0);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return dOut.download();
  };
  const std::vector<float> perToken = run([&] { return cuda::launchMoeExpertsPerToken(p, nullptr); });
  const std::vector<float> grouped =
      run([&] { return cuda::launchMoeExpertsGrouped(p, true, nullptr); });
  EXPECT_LT(relativeRms(grouped, perToken), 2e-5);

  EXPECT_FALSE(cuda::moeLaunchesGrouped(p)) << "40 pairs: per token by default";
  EXPECT_EQ(cuda::moeExpertsLaunchWorkspaceBytes(p),
            cuda::moeExpertsWorkspaceBytes(tokens, topK, hidden, inner));
  EXPECT_EQ(run([&] { return cuda::launchMoeExperts(p, true, nullptr); }), perToken);
  p.perTokenMaxPairs = 32; // tuned: grouped above 32 pairs
  EXPECT_TRUE(cuda::moeLaunchesGrouped(p));
  EXPECT_EQ(cuda::moeExpertsLaunchWorkspaceBytes(p),
            cuda::moeGroupedWorkspaceBytes(tokens, topK, hidden, inner, experts));
  EXPECT_EQ(run([&] { return cuda::launchMoeExperts(p, true, nullptr); }), grouped);
  p.perTokenMaxPairs = 40; // at or below the threshold: per token
  EXPECT_EQ(run([&] { return cuda::launchMoeExperts(p, true, nullptr); }), perToken);
  // FP32 experts have no grouped form: per token whatever the threshold.
  p.type = cuda::WeightType::F32;
  p.perTokenMaxPairs = 1;
  EXPECT_FALSE(cuda::moeLaunchesGrouped(p));
  p.type = cuda::WeightType::BF16;
  // A threshold past what the runtime sizes its per-token workspace for is refused.
  p.perTokenMaxPairs = cuda::kMoeTunedMaxPairs + 1;
  EXPECT_EQ(cuda::launchMoeExperts(p, true, nullptr), int(cudaErrorInvalidValue));
  p.perTokenMaxPairs = -1;
  EXPECT_EQ(cuda::launchMoeExperts(p, true, nullptr), int(cudaErrorInvalidValue));
}

// Expert parallelism: a rank holds some experts and the others' pointers are null. Each form
// (per token in bf16 and FP8, grouped on tensor cores) then gives, bit for bit, what it gives
// with those experts' choices made invalid (-1, as the cpu reference is handed them); the two
// halves' outputs add up to every expert's output (the plan's all-reduce); a rank holding none
// of the chosen experts writes zeros. Against ref::moeExperts with the absent choices at -1 too.
TEST(MoeExpertsCuda, AbsentExpertsAddNothing) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(21);
  const int hidden = 512, inner = 128, experts = 16, topK = 4;
  enum class Form { PerTokenBf16, PerTokenFp8, Grouped };
  for (Form form : {Form::PerTokenBf16, Form::PerTokenFp8, Form::Grouped}) {
    const bool fp8 = form == Form::PerTokenFp8;
    // Grouped: several tiles per expert. FP8: few pairs, as a sum on an E4M3 rounding boundary
    // may land one step apart from the reference's (Fp8ExpertsMatchReference).
    const int tokens = form == Form::Grouped ? 150 : fp8 ? 3 : 5;
    SCOPED_TRACE(form == Form::Grouped ? "grouped" : fp8 ? "per token, FP8" : "per token, bf16");
    const std::vector<float> x = random(size_t(tokens) * hidden, rng, 1.0f);
    // Per matrix (gate, up, down of each expert): its device bytes, block scales and the values
    // the reference multiplies by.
    std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> codes;
    std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> b16;
    std::vector<std::unique_ptr<DeviceBuffer<float>>> scales;
    std::vector<std::vector<float>> values;
    std::vector<uint64_t> matrix, scale;
    for (int e = 0; e < experts; ++e)
      for (int m = 0; m < 3; ++m) {
        const int rows = m == 2 ? hidden : inner, cols = m == 2 ? inner : hidden;
        if (fp8) {
          Fp8Matrix w = randomFp8Matrix(rows, cols, rng);
          codes.push_back(std::make_unique<DeviceBuffer<uint8_t>>(w.codes));
          scales.push_back(std::make_unique<DeviceBuffer<float>>(w.padded));
          matrix.push_back(reinterpret_cast<uint64_t>(codes.back()->data));
          scale.push_back(reinterpret_cast<uint64_t>(scales.back()->data));
          values.push_back(w.values);
        } else {
          values.push_back(roundedToBf16(random(size_t(rows) * cols, rng, 0.05f)));
          b16.push_back(std::make_unique<DeviceBuffer<uint16_t>>(bf16Bits(values.back())));
          matrix.push_back(reinterpret_cast<uint64_t>(b16.back()->data));
        }
      }
    const auto [ids, weights] = randomRouting(tokens, experts, topK, 0.1f, 0.2f, rng);
    // Runs the form with the experts `held` says present (the others' pointers null) on `chosen`.
    auto run = [&](const std::function<bool(int)> &held, const std::vector<int32_t> &chosen) {
      std::vector<uint64_t> pointers[6];
      for (int e = 0; e < experts; ++e)
        for (int m = 0; m < 3; ++m) {
          const size_t i = size_t(3 * e + m);
          pointers[m].push_back(held(e) ? matrix[i] : 0);
          pointers[3 + m].push_back(held(e) && fp8 ? scale[i] : 0);
        }
      DeviceBuffer<uint64_t> gate(pointers[0]), up(pointers[1]), down(pointers[2]),
          gateScales(pointers[3]), upScales(pointers[4]), downScales(pointers[5]);
      DeviceBuffer<float> dX(x), dWeights(weights);
      DeviceBuffer<float> dOut{std::vector<float>(size_t(tokens) * hidden, -3.0f)};
      DeviceBuffer<int32_t> dIds(chosen);
      const size_t workspace =
          form == Form::Grouped
              ? cuda::moeGroupedWorkspaceBytes(tokens, topK, hidden, inner, experts)
              : cuda::moeExpertsWorkspaceBytes(tokens, topK, hidden, inner);
      DeviceBuffer<uint8_t> dWorkspace{std::vector<uint8_t>(workspace)};
      cuda::MoeExpertsParams p =
          expertsParams(tokens, hidden, inner, experts, topK, dX.data, dIds.data, dWeights.data,
                        gate.data, up.data, down.data, dWorkspace.data);
      p.out = dOut.data;
      if (fp8)
        setFp8Experts(p, gateScales.data, upScales.data, downScales.data);
      EXPECT_EQ(form == Form::Grouped ? cuda::launchMoeExpertsGrouped(p, true, nullptr)
                                      : cuda::launchMoeExpertsPerToken(p, nullptr),
                0);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      return dOut.download();
    };
    auto all = [](int) { return true; };
    auto lowHalf = [&](int e) { return e < experts / 2; };
    auto highHalf = [&](int e) { return e >= experts / 2; };
    auto onlyHeld = [&](const std::function<bool(int)> &held) {
      std::vector<int32_t> chosen = ids;
      for (int32_t &id : chosen)
        if (!held(id))
          id = -1;
      return chosen;
    };
    const std::vector<float> whole = run(all, ids);
    const std::vector<float> low = run(lowHalf, ids), high = run(highHalf, ids);
    EXPECT_EQ(low, run(all, onlyHeld(lowHalf)));
    EXPECT_EQ(high, run(all, onlyHeld(highHalf)));
    std::vector<float> summed(whole.size());
    for (size_t i = 0; i < summed.size(); ++i)
      summed[i] = low[i] + high[i];
    EXPECT_LT(relativeRms(summed, whole), 1e-6); // one sum against two partial sums added
    EXPECT_EQ(run([](int) { return false; }, ids), std::vector<float>(whole.size(), 0.0f));

    // The reference, handed the low half's choices only (the grouped form rounds its inputs to
    // bf16 hi + lo, the per-token forms multiply in fp32).
    std::vector<ref::SwiGluWeights> reference;
    for (int e = 0; e < experts; ++e)
      reference.push_back({values[size_t(3 * e)], values[size_t(3 * e + 1)],
                           values[size_t(3 * e + 2)], hidden, inner,
                           fp8 ? std::optional(ref::Fp8ScaleRule::DeepSeekLinear) : std::nullopt});
    std::vector<float> expected(size_t(tokens) * hidden);
    ref::moeExperts(x, tokens, hidden, onlyHeld(lowHalf), weights, topK, reference, {}, expected);
    EXPECT_LT(relativeRms(low, expected), fp8 ? 1e-4 : 2e-5);
  }
}

TEST(MoeExpertsCuda, GatherAndScatterAddRows) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  const std::vector<float> x = {0, 1, 2, 10, 11, 12, 20, 21, 22}; // 3 rows of 3
  const std::vector<int32_t> rows = {2, 0};
  DeviceBuffer<float> dX(x), dGathered{std::vector<float>(6)};
  DeviceBuffer<int32_t> dRows(rows);
  ASSERT_EQ(cuda::launchGatherRows(dX.data, 3, dRows.data, 2, dGathered.data, nullptr), 0);
  const std::vector<float> scales = {2.0f, -1.0f};
  DeviceBuffer<float> dScales(scales), dOut{std::vector<float>(9, 1.0f)};
  ASSERT_EQ(cuda::launchScatterAddRows(dGathered.data, 3, dRows.data, dScales.data, 2, dOut.data,
                                       nullptr),
            0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(dGathered.download(), (std::vector<float>{20, 21, 22, 0, 1, 2}));
  EXPECT_EQ(dOut.download(), (std::vector<float>{1, 0, -1, 1, 1, 1, 41, 43, 45}));
  cuda::MoeRouterParams router; // nothing set
  EXPECT_EQ(cuda::launchMoeRouter(router, nullptr), int(cudaErrorInvalidValue));
  cuda::MoeExpertsParams experts;
  EXPECT_EQ(cuda::launchMoeExpertsPerToken(experts, nullptr), int(cudaErrorInvalidValue));
}

} // namespace
} // namespace hybrid::kernels
