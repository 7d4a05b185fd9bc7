// The kda-decode family's candidate measurement (Tune.h): the fused or split decode step on
// random inputs and states at a bucket's sizes, the way KdaDecodeBench.cpp builds them. A step
// overwrites its states, so both are set back before each candidate's checked launch.
#include "hybrid/kernels/cuda/KdaDecode.h"
#include "hybrid/kernels/cuda/Tune.h"
#include "../common/bench_support.h"
#include "../common/tune_measure.h"
#include "kda_decode_inputs.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>

namespace hybrid::kernels::cuda {
using namespace bench;
using namespace tune_measure;

StatusOr<std::vector<tuning::CandidateTiming>>
measureKdaDecode(const cache::ShapeBucket &shape, const std::vector<cache::TuningConfig> &configs,
                 tuning::Clock::time_point deadline, int32_t iterations) {
  const int64_t batch = dimension(shape, "batch"), heads = dimension(shape, "heads"),
                headDim = dimension(shape, "head_dim"), stateType = dimension(shape, "state_type");
  if (batch < 1 || batch > 65535 || heads < 1 || heads > 65535 ||
      (headDim != 64 && headDim != 128) || (stateType != 0 && stateType != 1))
    return Status::error("kda-decode: cannot measure bucket " + tuning::formatShape(shape) +
                         " (batch and heads 1..65535, head_dim 64 or 128, state_type 0 or 1)");
  std::mt19937 rng(17);
  std::string error;
  DeviceAllocations held;
  const size_t P = size_t(heads) * size_t(headDim), W = kDecodeConvKernel;
  auto make = [&](size_t n, float scale, float offset = 0.0f) {
    return held.keep(deviceRandom(n, scale, offset, rng, error));
  };
  KdaDecodeParams p;
  randomDecodeInputs(p, static_cast<int32_t>(batch), static_cast<int32_t>(heads),
                     static_cast<int32_t>(headDim), make);
  const size_t convFloats = size_t(batch) * 3 * (W - 1) * P;
  const float *initialConv = make(convFloats, 1.0f);
  p.convState = held.allocate<float>(convFloats);
  const bool bf16State = stateType == 1;
  const size_t stateElements = size_t(batch) * P * size_t(headDim);
  const size_t stateBytes = stateElements * (bf16State ? 2 : 4);
  p.stateType = bf16State ? KdaStateType::BF16 : KdaStateType::F32;
  const void *initialState =
      bf16State ? held.keep(deviceRandomBf16(stateElements, 0.05f, 0.0f, rng, error))
                : static_cast<void *>(make(stateElements, 0.05f));
  p.state = held.allocate<unsigned char>(stateBytes);
  p.out = held.allocate<float>(size_t(batch) * P);
  KdaDecodeParams split = p; // the largest workspace a candidate may need: the split path's
  split.path = KdaDecodePath::Split;
  p.workspace = held.allocate<unsigned char>(kdaDecodeWorkspaceBytes(split));
  if (!error.empty() || !p.qkv || !p.weights.convWeight || !p.forget || !p.weights.aLog ||
      !p.weights.dtBias || !p.betaLogits || !p.outputGate || !p.weights.normWeight ||
      !initialConv || !p.convState || !initialState || !p.state || !p.out || !p.workspace)
    return Status::error("kda-decode: cannot allocate bucket " + tuning::formatShape(shape) +
                         " on the device" + (error.empty() ? "" : ": " + error));
  // Every candidate's checked launch starts from the same states.
  auto reset = [&]() -> Status {
    if (cudaMemcpy(p.convState, initialConv, convFloats * sizeof(float),
                   cudaMemcpyDeviceToDevice) != cudaSuccess ||
        cudaMemcpy(p.state, initialState, stateBytes, cudaMemcpyDeviceToDevice) != cudaSuccess)
      return Status::error("kda-decode: cannot reset the states");
    return Status::ok();
  };
  struct Output {
    std::vector<float> out, state; // the state as fp32 (a bf16 state widened)
  };
  auto output = [&]() -> StatusOr<Output> {
    HYBRID_ASSIGN_OR_RETURN(std::vector<float> out, download(p.out, size_t(batch) * P));
    std::vector<float> state;
    if (bf16State) {
      HYBRID_ASSIGN_OR_RETURN(std::vector<uint16_t> bits,
                              download(static_cast<const uint16_t *>(p.state), stateElements));
      state.resize(bits.size());
      std::transform(bits.begin(), bits.end(), state.begin(), [](uint16_t b) {
        const uint32_t word = uint32_t(b) << 16;
        float value;
        std::memcpy(&value, &word, sizeof value);
        return value;
      });
    } else {
      HYBRID_ASSIGN_OR_RETURN(state, download(static_cast<const float *>(p.state), stateElements));
    }
    return Output{.out = std::move(out), .state = std::move(state)};
  };
  // Both paths compute in fp32 from the same prepared values; they differ in the order of the
  // column sums and the norm's reduction (and, for a bf16 state, in the roundings that order
  // moves across a half-way point: a few values one bf16 step, 2^-8, apart). 1e-4 relative RMS
  // of the output and of an fp32 state, 2e-3 of a bf16 one, hold that; a wrong state or gate is
  // off by O(1).
  const double bound = bf16State ? 2e-3 : 1e-4;
  auto compare = [bound](const Output &candidate, const Output &reference) {
    std::string why = relativeRmsMismatch(candidate.out, reference.out, 1e-4);
    return why.empty() ? relativeRmsMismatch(candidate.state, reference.state, bound, "state")
                       : why;
  };
  return measureEach(p, configs, deadline, iterations, launchKdaFusedDecode, output, compare,
                     reset);
}

} // namespace hybrid::kernels::cuda
