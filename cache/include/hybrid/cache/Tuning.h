// Kernel tuning results in the compilation cache (issue 14). A kernel family declares its tunable
// parameters (each with the values worth trying and a default) and a constraint that rejects,
// with a reason, the combinations it cannot run at a shape; `hybrid-compile --autotune` measures
// the valid candidates per shape bucket on the GPU and stores the winner under a key of the
// kernel, its parameter space, the shape bucket, the GPU model, SM count, driver and compiler;
// plans then run the stored configuration, or the defaults on a miss.
#pragma once

#include "hybrid/cache/Key.h"
#include "hybrid/cache/Store.h"
#include "hybrid/runtime/Status.h"

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace hybrid::cache {

using TuningConfig = std::map<std::string, int64_t>; // parameter -> value
using ShapeBucket = std::map<std::string, int64_t>;  // dimension -> bucketed size

struct TunableParameter {
  std::string name;
  std::vector<int64_t> values; // tried in this order
  int64_t defaultValue = 0;    // one of values
};

struct TunableKernel {
  std::string name; // e.g. "dsa-indexer-scores"
  // The kernels' sources as built (a hash): a result measured on other code is another key, so a
  // rewritten kernel is re-tuned instead of running a configuration chosen for its predecessor.
  std::string revision;
  std::vector<TunableParameter> parameters;
  // A reason when `config` cannot run at `shape`; nullopt when it can. Empty: no constraint.
  std::function<std::optional<std::string>(const TuningConfig &, const ShapeBucket &)> constraint;

  TuningConfig defaults() const;
};

// A size rounded up to a power of two (at least 1): nearby shapes share one tuning.
int64_t bucketSize(int64_t size);

struct CandidateSet {
  std::vector<TuningConfig> valid;                             // in enumeration order
  std::vector<std::pair<TuningConfig, std::string>> rejected; // with the constraint's reason
};
// Every combination of the parameters' values, split by the constraint.
CandidateSet enumerateCandidates(const TunableKernel &kernel, const ShapeBucket &shape);

struct TuningDevice {
  std::string gpu;          // "NVIDIA H200"
  int32_t smCount = 0;
  int32_t driverVersion = 0; // cudaDriverGetVersion
  std::string compiler;     // the CUDA toolkit the kernels were built with
};

// The key of a tuning result; `canonicalText` (when given) receives the fields for explanations.
CacheKey tuningKey(const TunableKernel &kernel, const ShapeBucket &shape,
                   const TuningDevice &device, std::string *canonicalText = nullptr);

struct TuningResult {
  TuningConfig config;
  double microseconds = 0;        // the winner's median time
  double defaultMicroseconds = 0; // the defaults' at the same shape
  int32_t candidates = 0;         // measured
  double tuningSeconds = 0;       // the whole search for this key
};

// A result as an entry payload ("name=value" lines), and back: decoding refuses a parameter the
// kernel does not declare, a missing one or a value outside its list (a space that changed since
// the result was stored), naming it.
std::vector<std::byte> encodeTuningResult(const TuningResult &result);
StatusOr<TuningResult> decodeTuningResult(std::span<const std::byte> payload,
                                          const TunableKernel &kernel);

Status storeTuning(CacheStore &store, const CacheKey &key, const TuningResult &result);
// The stored result, or nullopt on a miss; an entry that no longer decodes for `kernel` is a
// miss too (removed, its reason in `whyRejected` when given).
StatusOr<std::optional<TuningResult>> lookupTuning(CacheStore &store, const CacheKey &key,
                                                   const TunableKernel &kernel,
                                                   std::string *whyRejected = nullptr);

} // namespace hybrid::cache
