// The search behind `hybrid-bench tune` (issue 14, docs/autotune.md): for each (kernel, shape
// bucket) asked for, a stored result is reused; otherwise the candidates the kernel's constraint
// admits are measured (by a MeasureFn: on the GPU, kernels/cuda/Tune.h), those whose output
// differs from the defaults' are dropped, and the fastest is stored in the cache, unless it beats
// the defaults by less than the noise margin, then the defaults are. The whole search is bounded
// by a budget in seconds. CUDA-free: the tests drive it with a synthetic MeasureFn.
#pragma once

#include "hybrid/kernels/KernelTuning.h"

#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace hybrid::kernels::tuning {

struct TuneRequest {
  const TunableKernel *kernel = nullptr;
  ShapeBucket shape;
};

struct CandidateTiming {
  double microseconds = 0; // median of the timed replays
  std::string mismatch;    // empty: the output matches the defaults'; else how it differs
};

using Clock = std::chrono::steady_clock;
// Times `configs` (configs[0] is the defaults) at `shape`, one timing per configuration in order,
// stopping early (fewer timings) once `deadline` has passed. An error when the defaults themselves
// cannot run: nothing to compare against.
using MeasureFn = std::function<StatusOr<std::vector<CandidateTiming>>(
    const TunableKernel &kernel, const ShapeBucket &shape, const std::vector<TuningConfig> &configs,
    Clock::time_point deadline)>;

struct TuneOptions {
  double budgetSeconds = 600; // the whole search; what is left untuned is reported
  bool retune = false;        // measure again even where a result is stored
  // A candidate replaces the defaults only when it is this much faster (timing noise must not
  // store a "winner" that is not one).
  double minGain = 0.02;
  std::function<Clock::time_point()> now = [] { return Clock::now(); };
};

struct TuneOutcome {
  TuneRequest request;
  enum class State { Cached, Tuned, OutOfBudget, Failed } state = State::Failed;
  cache::TuningResult result; // Cached and Tuned
  int32_t rejected = 0;       // candidates the constraint refused at this bucket
  int32_t mismatched = 0;     // measured, dropped: the output differed from the defaults'
  std::string note;           // Failed: why; OutOfBudget: how far it got
};

struct TuneReport {
  std::vector<TuneOutcome> outcomes;
  double seconds = 0;
  int32_t tuned = 0, cached = 0, outOfBudget = 0, failed = 0;
};

TuneReport tune(cache::CacheStore &store, const cache::TuningDevice &device,
                const std::vector<TuneRequest> &requests, const MeasureFn &measure,
                const TuneOptions &options);

// The table `hybrid-bench tune` prints: a row per request (kernel, bucket, state, the chosen
// configuration, its time against the defaults', candidates) and a summary line.
std::string formatTuneReport(const TuneReport &report, const cache::TuningDevice &device);

// The shapes of a model's decode steps, by name: "deepseek-v32" (the indexer and sparse MLA at
// batch 1, 8, 64 and 8K..128K contexts), "kimi-linear-48b" (its MLA layers' causal decode).
StatusOr<std::vector<TuneRequest>> presetRequests(std::string_view preset);
std::vector<std::string> presetNames();
// One request from a kernel name and "dim=value,..." naming every dimension of its bucket
// (values are bucketed as the runtime buckets them).
StatusOr<TuneRequest> parseRequest(std::string_view kernel, std::string_view shape);

} // namespace hybrid::kernels::tuning
