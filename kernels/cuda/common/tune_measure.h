// What every family's candidate measurement shares (Tune.h, docs/autotune.md): reading an output
// back, the relative RMS of two outputs, a bucket's dimension, and the loop over candidates (the
// defaults first: each candidate set, launched once with its output kept or compared with the
// defaults', then timed by graph replays). Host code of the .cpp measurements; needs cudart.
#pragma once

#include "hybrid/kernels/cuda/Tune.h"
#include "bench_support.h"

#include <cuda_runtime.h>

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace hybrid::kernels::cuda::tune_measure {

inline std::string cudaText(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

template <typename T> StatusOr<std::vector<T>> download(const T *device, size_t count) {
  std::vector<T> host(count);
  if (cudaError_t status = cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost);
      status != cudaSuccess)
    return Status::error(std::string("reading the output back: ") + cudaGetErrorString(status));
  return host;
}

// ||a - b|| / ||b||, over the finite values (a NaN or an infinity in either is a mismatch).
inline double relativeRms(const std::vector<float> &a, const std::vector<float> &b, bool &finite) {
  double difference = 0, reference = 0;
  finite = true;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i]))
      finite = false;
    difference += double(a[i] - b[i]) * double(a[i] - b[i]);
    reference += double(b[i]) * double(b[i]);
  }
  return reference > 0 ? std::sqrt(difference / reference) : std::sqrt(difference);
}

// "" when a is within `bound` relative RMS of b, else how far it is.
inline std::string relativeRmsMismatch(const std::vector<float> &a, const std::vector<float> &b,
                                       double bound, const char *what = "output") {
  bool finite = true;
  const double error = relativeRms(a, b, finite);
  if (finite && error <= bound)
    return "";
  return std::string(what) + " differs from the defaults' by a relative RMS of " +
         std::to_string(error) + (finite ? "" : " (not finite)");
}

inline int64_t dimension(const cache::ShapeBucket &shape, const char *name) {
  auto found = shape.find(name);
  return found == shape.end() ? -1 : found->second;
}

// One candidate after another: `prepare` (the inputs a launch overwrites set back, so every
// candidate's warm-up starts from the same data), apply, launch once (warm-up, and the output
// compared with the defaults'), then time graph replays. `compare` returns "" or how the output
// differs.
template <typename Params, typename Output, typename Compare, typename Prepare>
StatusOr<std::vector<tuning::CandidateTiming>>
measureEach(const Params &base, const std::vector<cache::TuningConfig> &configs,
            tuning::Clock::time_point deadline, int32_t iterations,
            int (*launch)(const Params &, void *), Output &&output, Compare &&compare,
            Prepare &&prepare) {
  std::vector<tuning::CandidateTiming> timings;
  std::optional<std::decay_t<decltype(*output())>> reference; // the defaults' output
  for (size_t i = 0; i < configs.size(); ++i) {
    if (tuning::Clock::now() >= deadline)
      break;
    Params p = base;
    tuning::applyConfig(configs[i], p);
    HYBRID_RETURN_IF_ERROR(prepare());
    const int status = launch(p, nullptr);
    const cudaError_t synced = status == 0 ? cudaDeviceSynchronize() : cudaSuccess;
    if (status != 0 || synced != cudaSuccess) {
      const std::string why = "launch failed: " + cudaText(status != 0 ? status : int(synced));
      if (i == 0)
        return Status::error("the defaults: " + why);
      timings.push_back({.microseconds = 0, .mismatch = why});
      continue;
    }
    auto produced = output();
    if (!produced.isOk())
      return produced.status();
    tuning::CandidateTiming timing;
    if (i == 0)
      reference = std::move(*produced);
    else
      timing.mismatch = compare(*produced, *reference);
    timing.microseconds =
        bench::graphMicroseconds(iterations, [&](cudaStream_t stream) { return launch(p, stream); });
    if (timing.microseconds < 0) {
      if (i == 0)
        return Status::error("the defaults: the graph capture failed");
      timing.microseconds = 0;
      timing.mismatch = "the graph capture failed";
    }
    timings.push_back(std::move(timing));
  }
  return timings;
}

// Launches that overwrite none of their inputs: nothing to set back.
template <typename Params, typename Output, typename Compare>
StatusOr<std::vector<tuning::CandidateTiming>>
measureEach(const Params &base, const std::vector<cache::TuningConfig> &configs,
            tuning::Clock::time_point deadline, int32_t iterations,
            int (*launch)(const Params &, void *), Output &&output, Compare &&compare) {
  return measureEach(base, configs, deadline, iterations, launch, output, compare,
                     [] { return Status::ok(); });
}

} // namespace hybrid::kernels::cuda::tune_measure
