// The moe-experts family's candidate measurement (Tune.h): the per-token/grouped threshold of
// launchMoeExperts on random bf16 experts and routing at a bucket's sizes, the way
// MoeBench.cpp builds them (every expert's matrices apart in device memory).
#include "hybrid/kernels/cuda/Moe.h"
#include "hybrid/kernels/cuda/Tune.h"
#include "../common/bench_support.h"
#include "../common/tune_measure.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <random>

namespace hybrid::kernels::cuda {
using namespace bench;
using namespace tune_measure;

namespace {
constexpr int kDistinctMatrices = 4; // random sources copied into every expert's weights

// The runtime's launch (CudaMoe.cpp): split bf16 inputs, its default (LoadOptions::
// bf16GemmInputs off).
int launchAsTheRuntime(const MoeExpertsParams &p, void *stream) {
  return launchMoeExperts(p, true, stream);
}
} // namespace

StatusOr<std::vector<tuning::CandidateTiming>>
measureMoeExperts(const cache::ShapeBucket &shape, const std::vector<cache::TuningConfig> &configs,
                  tuning::Clock::time_point deadline, int32_t iterations) {
  const int64_t tokens = dimension(shape, "tokens"), topK = dimension(shape, "top_k"),
                experts = dimension(shape, "experts"), hidden = dimension(shape, "hidden"),
                inner = dimension(shape, "intermediate"), type = dimension(shape, "weight_type");
  if (tokens < 1 || tokens > 65536 || topK < 1 || topK > kMoeMaxTopK || experts < topK ||
      experts > kMoeMaxExperts || hidden < 1 || hidden > kMoeMaxHidden || inner < 1 ||
      inner > kMoeMaxHidden ||
      type != static_cast<int64_t>(WeightType::BF16) || !moeGroupedShape(WeightType::BF16, hidden, inner))
    return Status::error("moe-experts: cannot measure bucket " + tuning::formatShape(shape) +
                         " (bf16 experts, weight_type 1; tokens 1..65536, top_k up to " +
                         std::to_string(kMoeMaxTopK) + " of up to " +
                         std::to_string(kMoeMaxExperts) + " experts; hidden and intermediate "
                         "multiples of 64 up to " + std::to_string(kMoeMaxHidden) + ")");
  std::mt19937 rng(16);
  std::string error;
  const size_t matrix = size_t(hidden) * size_t(inner); // every projection has this many weights
  DeviceAllocations held;
  std::vector<void *> sources;
  for (int i = 0; i < kDistinctMatrices; ++i)
    sources.push_back(held.keep(deviceRandomBf16(matrix, 0.02f, 0.0f, rng, error)));
  std::vector<uint64_t> gate, up, down; // device pointers, as the runtime's arrays hold them
  for (int64_t i = 0; i < 3 * experts && error.empty(); ++i) {
    auto *weights = held.allocate<uint16_t>(matrix);
    if (!weights || !sources[size_t(i % kDistinctMatrices)] ||
        cudaMemcpy(weights, sources[size_t(i % kDistinctMatrices)], matrix * 2,
                   cudaMemcpyDeviceToDevice) != cudaSuccess) {
      error = "cannot allocate " + std::to_string(3 * experts) + " expert matrices";
      break;
    }
    (i % 3 == 0 ? gate : i % 3 == 1 ? up : down).push_back(reinterpret_cast<uint64_t>(weights));
  }
  // Each token's top_k distinct experts, equal weights (a router's renormalized choice).
  std::vector<int32_t> ids;
  std::vector<int32_t> order(static_cast<size_t>(experts));
  std::iota(order.begin(), order.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(order.begin(), order.end(), rng);
    ids.insert(ids.end(), order.begin(), order.begin() + topK);
  }
  const std::vector<float> routing(ids.size(), 1.0f / float(topK));

  MoeExpertsParams p;
  p.tokens = static_cast<int32_t>(tokens);
  p.hidden = static_cast<int32_t>(hidden);
  p.intermediate = static_cast<int32_t>(inner);
  p.experts = static_cast<int32_t>(experts);
  p.topK = static_cast<int32_t>(topK);
  p.type = WeightType::BF16;
  p.x = held.keep(deviceRandom(size_t(tokens) * hidden, 1.0f, 0.0f, rng, error));
  p.ids = held.keep(deviceCopy(ids));
  p.weights = held.keep(deviceCopy(routing));
  if (error.empty()) {
    p.gate = reinterpret_cast<const void *const *>(held.keep(deviceCopy(gate)));
    p.up = reinterpret_cast<const void *const *>(held.keep(deviceCopy(up)));
    p.down = reinterpret_cast<const void *const *>(held.keep(deviceCopy(down)));
  }
  const size_t outFloats = size_t(tokens) * hidden;
  p.out = held.allocate<float>(outFloats);
  // Either form may run: the larger of their workspaces.
  p.workspace = held.allocate<unsigned char>(std::max(
      moeExpertsWorkspaceBytes(p.tokens, p.topK, p.hidden, p.intermediate),
      moeGroupedWorkspaceBytes(p.tokens, p.topK, p.hidden, p.intermediate, p.experts)));
  if (!error.empty() || !p.x || !p.ids || !p.weights || !p.gate || !p.up || !p.down || !p.out ||
      !p.workspace)
    return Status::error("moe-experts: cannot allocate bucket " + tuning::formatShape(shape) +
                         " on the device" + (error.empty() ? "" : ": " + error));
  auto output = [&] { return download(p.out, outFloats); };
  // The forms round differently: per token multiplies fp32 activations by the bf16 weights, the
  // grouped form rounds them to bf16 hi + lo (about 16 bits) for the tensor cores and sums in
  // another order. A relative RMS of 1e-2 holds that (and plain bf16 inputs) with room; a pair
  // dropped or added is off by about 1 / sqrt(top_k) (0.35 at top 8).
  auto compare = [](const std::vector<float> &candidate, const std::vector<float> &reference) {
    return relativeRmsMismatch(candidate, reference, 1e-2);
  };
  return measureEach(p, configs, deadline, iterations, launchAsTheRuntime, output, compare);
}

} // namespace hybrid::kernels::cuda
