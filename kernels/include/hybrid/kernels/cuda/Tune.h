// The tuner's GPU half (issue 14, docs/autotune.md): the identity tuning keys carry and the
// measurements of each tunable family's candidates (random data at the bucket's sizes, a warm-up
// launch, CUDA events around graph replays, the median; each candidate's output compared with
// the defaults'). CUDA-free header; hybrid-bench tune and the cuda device include it.
#pragma once

#include "hybrid/kernels/Tuner.h"

namespace hybrid::kernels::cuda {

// The current GPU's model, SM count and driver, and the CUDA toolkit this library was built
// with; "no CUDA device" where there is none.
StatusOr<cache::TuningDevice> cudaTuningDevice();

// Measures any tunable family on the current GPU, `iterations` graph replays per timing.
tuning::MeasureFn cudaMeasure(int32_t iterations);

// The measurements behind cudaMeasure, one per family.
StatusOr<std::vector<tuning::CandidateTiming>>
measureIndexerScores(const cache::ShapeBucket &shape, const std::vector<cache::TuningConfig> &configs,
                     tuning::Clock::time_point deadline, int32_t iterations);
StatusOr<std::vector<tuning::CandidateTiming>>
measureSparseMlaDecode(const cache::ShapeBucket &shape,
                       const std::vector<cache::TuningConfig> &configs,
                       tuning::Clock::time_point deadline, int32_t iterations);
StatusOr<std::vector<tuning::CandidateTiming>>
measureMoeExperts(const cache::ShapeBucket &shape, const std::vector<cache::TuningConfig> &configs,
                  tuning::Clock::time_point deadline, int32_t iterations);
StatusOr<std::vector<tuning::CandidateTiming>>
measureKdaDecode(const cache::ShapeBucket &shape, const std::vector<cache::TuningConfig> &configs,
                 tuning::Clock::time_point deadline, int32_t iterations);

} // namespace hybrid::kernels::cuda
