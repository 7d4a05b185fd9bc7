#include "Tune.h"

#include "hybrid/kernels/Tuner.h"
#ifdef HYBRID_BENCH_KDA
#include "hybrid/kernels/cuda/Tune.h"
#endif

#include <cstdio>
#include <iostream>

namespace kt = hybrid::kernels::tuning;
namespace cache = hybrid::cache;

void addTuneOptions(CLI::App *tune, TuneCommandOptions &o) {
  std::string presets;
  for (const std::string &name : kt::presetNames())
    presets += (presets.empty() ? "" : ", ") + name;
  tune->add_option("--preset", o.presets, "Shapes of a model's decode steps: " + presets)
      ->delimiter(',');
  tune->add_option("--shape", o.shapes,
                   "One bucket: KERNEL:dim=value,... naming every dimension of the kernel's "
                   "bucket (see docs/autotune.md), e.g. sparse-mla-decode:rows=8,heads=128,"
                   "latent_dim=512,rope_dim=64,top_k=2048,causal=0");
  tune->add_option("--cache", o.cacheDir,
                   "Cache folder the results go to (default: $HYBRID_CACHE_DIR, else "
                   "$XDG_CACHE_HOME/hybrid or ~/.cache/hybrid; the cuda device reads the same)");
  tune->add_option("--budget", o.budgetSeconds,
                   "Seconds for the whole search; buckets left over are reported, not stored")
      ->check(CLI::Range(0.0, 86400.0));
  tune->add_option("--iterations", o.iterations, "Graph replays per timing")
      ->check(CLI::Range(1, 100000));
  tune->add_option("--min-gain", o.minGain,
                   "A candidate replaces the defaults only when this much faster")
      ->check(CLI::Range(0.0, 0.5));
  tune->add_flag("--retune", o.retune, "Measure again where a result is stored");
  tune->add_flag("--dry-run", o.dryRun,
                 "List each bucket's candidates (and those its constraint rejects, with the "
                 "reason) and whether a result is stored; measure nothing (no GPU needed)");
}

namespace {

// Without a GPU no stored result can be this machine's: a dry run then only lists candidates.
cache::TuningDevice noDevice() {
  return {.gpu = "no CUDA device", .smCount = 0, .driverVersion = 0, .compiler = ""};
}

int dryRun(cache::CacheStore &store, const cache::TuningDevice &device,
           const std::vector<kt::TuneRequest> &requests) {
  for (const kt::TuneRequest &request : requests) {
    const cache::CandidateSet set = cache::enumerateCandidates(*request.kernel, request.shape);
    std::string why;
    auto stored = cache::lookupTuning(store, cache::tuningKey(*request.kernel, request.shape, device),
                                      *request.kernel, &why);
    std::printf("%s %s: %zu candidates, %zu rejected; %s\n", request.kernel->name.c_str(),
                kt::formatShape(request.shape).c_str(), set.valid.size(), set.rejected.size(),
                !stored.isOk()            ? ("cache unreadable: " + stored.status().message()).c_str()
                : stored->has_value()     ? ("stored: " + kt::formatConfig((*stored)->config)).c_str()
                : why.empty()             ? "not tuned"
                                          : ("not tuned: " + why).c_str());
    for (const cache::TuningConfig &config : set.valid)
      std::printf("  try    %s\n", kt::formatConfig(config).c_str());
    for (const auto &[config, reason] : set.rejected)
      std::printf("  reject %s: %s\n", kt::formatConfig(config).c_str(), reason.c_str());
  }
  return 0;
}

} // namespace

int runTune(const TuneCommandOptions &o) {
  std::vector<kt::TuneRequest> requests;
  for (const std::string &preset : o.presets) {
    auto found = kt::presetRequests(preset);
    if (!found.isOk()) {
      std::cerr << "error: tune: --preset: " << found.status().message() << "\n";
      return 1;
    }
    requests.insert(requests.end(), found->begin(), found->end());
  }
  for (const std::string &text : o.shapes) {
    const size_t colon = text.find(':');
    auto request = colon == std::string::npos
                       ? hybrid::StatusOr<kt::TuneRequest>(hybrid::Status::error(
                             "'" + text + "' is not KERNEL:dim=value,..."))
                       : kt::parseRequest(text.substr(0, colon), text.substr(colon + 1));
    if (!request.isOk()) {
      std::cerr << "error: tune: --shape: " << request.status().message() << "\n";
      return 1;
    }
    requests.push_back(std::move(*request));
  }
  if (requests.empty()) {
    std::cerr << "error: tune: nothing to tune: give --preset or --shape\n";
    return 1;
  }
  auto dir = o.cacheDir.empty() ? cache::defaultCacheDir()
                                : hybrid::StatusOr<std::string>(o.cacheDir);
  auto store = dir.isOk() ? cache::CacheStore::open(*dir)
                          : hybrid::StatusOr<cache::CacheStore>(dir.status());
  if (!store.isOk()) {
    std::cerr << "error: tune: --cache: " << store.status().message() << "\n";
    return 1;
  }
#ifdef HYBRID_BENCH_KDA
  auto device = hybrid::kernels::cuda::cudaTuningDevice();
  if (!device.isOk() && !o.dryRun) {
    std::cerr << "error: tune: " << device.status().message() << "\n";
    return 1;
  }
  if (o.dryRun)
    return dryRun(*store, device.isOk() ? *device : noDevice(),
                  requests);
  kt::TuneOptions options;
  options.budgetSeconds = o.budgetSeconds;
  options.retune = o.retune;
  options.minGain = o.minGain;
  const kt::TuneReport report =
      kt::tune(*store, *device, requests, hybrid::kernels::cuda::cudaMeasure(o.iterations), options);
  std::printf("%s", kt::formatTuneReport(report, *device).c_str());
  std::printf("cache: %s\n", dir.isOk() ? dir->c_str() : o.cacheDir.c_str());
  return report.failed > 0 ? 1 : 0;
#else
  if (o.dryRun)
    return dryRun(*store, noDevice(), requests);
  std::cerr << "error: tune: this hybrid-bench was built without CUDA (HYBRID_ENABLE_CUDA); "
               "--dry-run lists the candidates\n";
  return 1;
#endif
}
