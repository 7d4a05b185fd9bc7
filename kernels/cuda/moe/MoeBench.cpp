#include "hybrid/kernels/cuda/MoeBench.h"

#include "../common/bench_support.h"
#include "hybrid/kernels/cuda/KdaBench.h" // kH200CopyTbPerSecond
#include "hybrid/kernels/cuda/Linear.h"   // linearFp8WeightScaleStride
#include "hybrid/kernels/cuda/Moe.h"

#include <algorithm>
#include <cuda_runtime.h>
#include <numeric>
#include <random>
#include <set>

namespace hybrid::kernels::cuda {
using namespace bench;

namespace {
constexpr int kDistinctMatrices = 4; // random sources copied into every expert's weights
constexpr double kTargetTbPerSecond = 3.5;
} // namespace

std::vector<MoeBenchResult> benchMoeDecode(const std::vector<int32_t> &tokenCounts, int32_t experts,
                                           int32_t topK, int32_t hidden, int32_t intermediate,
                                           bool fp8, int32_t layers, int32_t iterations,
                                           std::string &error) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    error = "no CUDA device";
    return {};
  }
  if (topK > experts) {
    error = "top-k " + std::to_string(topK) + " is more than the " + std::to_string(experts) +
            " experts";
    return {};
  }
  std::mt19937 rng(13);
  const size_t matrix = size_t(hidden) * intermediate; // every projection has this many weights
  const size_t matrixBytes = matrix * (fp8 ? 1 : 2);
  // Every expert's three matrices apart in device memory (so nothing is read twice from L2),
  // filled from a few random sources.
  DeviceAllocations held; // the experts' buffers, freed on every way out
  std::vector<void *> sources, weights;
  for (int i = 0; i < kDistinctMatrices; ++i) {
    void *source = held.keep(fp8 ? deviceRandomFp8(matrix, rng, error)
                                 : deviceRandomBf16(matrix, 0.02f, 0.0f, rng, error));
    if (!source)
      return {};
    sources.push_back(source);
  }
  for (int i = 0; i < 3 * experts; ++i) {
    auto *device = held.allocate<uint8_t>(matrixBytes);
    if (!device || cudaMemcpy(device, sources[size_t(i % kDistinctMatrices)], matrixBytes,
                              cudaMemcpyDeviceToDevice) != cudaSuccess) {
      error = "cannot allocate " + std::to_string(3 * experts) + " expert matrices";
      return {};
    }
    weights.push_back(device);
  }
  std::vector<const void *> gate, up, down;
  for (int e = 0; e < experts; ++e) {
    gate.push_back(weights[size_t(3 * e)]);
    up.push_back(weights[size_t(3 * e + 1)]);
    down.push_back(weights[size_t(3 * e + 2)]);
  }
  auto pointerArray = [](const std::vector<const void *> &host) {
    std::vector<uint64_t> bits(host.size());
    std::transform(host.begin(), host.end(), bits.begin(),
                   [](const void *p) { return reinterpret_cast<uint64_t>(p); });
    return deviceCopy(bits);
  };
  uint64_t *dGate = held.keep(pointerArray(gate)), *dUp = held.keep(pointerArray(up)),
           *dDown = held.keep(pointerArray(down));
  // FP8: every expert's gate and up share one block-scale table, the downs another (small,
  // read from L2 after the first expert; their bytes are counted all the same).
  const int64_t gateUpScaleFloats = (intermediate + 127) / 128 * linearFp8WeightScaleStride(hidden);
  const int64_t downScaleFloats = (hidden + 127) / 128 * linearFp8WeightScaleStride(intermediate);
  uint64_t *dGateUpScales = nullptr, *dDownScales = nullptr;
  if (fp8) {
    const std::vector<float> gateUpScales =
        randomFp8BlockScales(static_cast<size_t>(gateUpScaleFloats), rng);
    const std::vector<float> downScales =
        randomFp8BlockScales(static_cast<size_t>(downScaleFloats), rng);
    const float *gateUpTable = held.keep(deviceCopy(gateUpScales));
    const float *downTable = held.keep(deviceCopy(downScales));
    dGateUpScales =
        held.keep(pointerArray(std::vector<const void *>(size_t(experts), gateUpTable)));
    dDownScales = held.keep(pointerArray(std::vector<const void *>(size_t(experts), downTable)));
    if (!gateUpTable || !downTable || !dGateUpScales || !dDownScales) {
      error = "cannot allocate the experts' FP8 block scales";
      return {};
    }
  }
  std::vector<MoeBenchResult> results;
  for (int32_t tokens : tokenCounts) {
    // Each layer its own random choice, input and output: a graph of several layers reads what
    // a decode step's successive MoE layers read (other experts each layer), not the same
    // experts again from L2.
    DeviceAllocations step; // this token count's buffers
    std::vector<MoeExpertsParams> launches;
    double distinctExperts = 0;
    bool ready = dGate && dUp && dDown;
    for (int32_t layer = 0; layer < layers && ready; ++layer) {
      std::vector<int32_t> ids;
      std::vector<float> routing;
      std::set<int32_t> distinct;
      for (int32_t t = 0; t < tokens; ++t) {
        std::vector<int32_t> order(static_cast<size_t>(experts));
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        for (int32_t k = 0; k < topK; ++k) {
          ids.push_back(order[size_t(k)]);
          routing.push_back(1.0f / float(topK));
          distinct.insert(order[size_t(k)]);
        }
      }
      distinctExperts += double(distinct.size()) / layers;
      MoeExpertsParams p;
      p.tokens = tokens;
      p.hidden = hidden;
      p.intermediate = intermediate;
      p.experts = experts;
      p.topK = topK;
      p.ids = step.keep(deviceCopy(ids));
      p.weights = step.keep(deviceCopy(routing));
      p.x = step.keep(deviceRandom(size_t(tokens) * hidden, 1.0f, 0.0f, rng, error));
      p.gate = reinterpret_cast<const void *const *>(dGate);
      p.up = reinterpret_cast<const void *const *>(dUp);
      p.down = reinterpret_cast<const void *const *>(dDown);
      p.type = WeightType::BF16;
      if (fp8) {
        setFp8Experts(p, reinterpret_cast<const float *const *>(dGateUpScales),
                      reinterpret_cast<const float *const *>(dGateUpScales),
                      reinterpret_cast<const float *const *>(dDownScales));
        p.activationScale = Fp8ActivationScale::DeepSeekLinear;
      }
      p.out = step.allocate<float>(size_t(tokens) * hidden);
      p.workspace = step.allocate<unsigned char>(
          moeExpertsWorkspaceBytes(tokens, topK, hidden, intermediate));
      ready = p.ids && p.weights && p.x && p.out && p.workspace;
      launches.push_back(p);
    }
    MoeBenchResult r;
    r.tokens = tokens;
    r.experts = experts;
    r.topK = topK;
    r.hidden = hidden;
    r.intermediate = intermediate;
    r.layers = layers;
    r.fp8 = fp8;
    r.microseconds = ready ? graphMicroseconds(iterations,
                                               [&](cudaStream_t s) {
                                                 for (const MoeExpertsParams &p : launches)
                                                   if (int status = launchMoeExpertsPerToken(p, s))
                                                     return status;
                                                 return 0;
                                               }) /
                                 layers
                           : -1;
    if (r.microseconds < 0) {
      error = "the MoE launch failed for " + std::to_string(tokens) + " tokens";
      break;
    }
    r.weightBytes =
        distinctExperts * (3.0 * double(matrixBytes) +
                           (fp8 ? double(2 * gateUpScaleFloats + downScaleFloats) * 4.0 : 0.0));
    r.floorMicroseconds = r.weightBytes / (kH200CopyTbPerSecond * 1e12) * 1e6;
    r.terabytesPerSecond = r.weightBytes / (r.microseconds * 1e-6) / 1e12;
    results.push_back(r);
  }
  return error.empty() ? results : std::vector<MoeBenchResult>{};
}

std::string moeTargetVerdict(const MoeBenchResult &r) {
  if (r.fp8)
    return "-- (the target is bf16's)";
  return floorShareVerdict(r.terabytesPerSecond / kTargetTbPerSecond, 1.0, "3.5 TB/s");
}

} // namespace hybrid::kernels::cuda
