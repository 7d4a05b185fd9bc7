#include "hybrid/kernels/Tuner.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <set>

namespace hybrid::kernels::tuning {

namespace {

double secondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// Searches one (kernel, bucket) with no stored result.
TuneOutcome search(cache::CacheStore &store, const cache::CacheKey &key, const TuneRequest &request,
                   const MeasureFn &measure, const TuneOptions &options,
                   Clock::time_point deadline) {
  const TunableKernel &kernel = *request.kernel;
  TuneOutcome outcome;
  outcome.request = request;
  const Clock::time_point start = options.now();
  cache::CandidateSet candidates = cache::enumerateCandidates(kernel, request.shape);
  outcome.rejected = static_cast<int32_t>(candidates.rejected.size());
  const TuningConfig defaults = kernel.defaults();
  std::vector<TuningConfig> configs{defaults}; // the reference first
  for (TuningConfig &config : candidates.valid)
    if (config != defaults)
      configs.push_back(std::move(config));
  if (std::find(candidates.valid.begin(), candidates.valid.end(), defaults) ==
          candidates.valid.end() &&
      kernel.constraint)
    if (auto reason = kernel.constraint(defaults, request.shape)) {
      outcome.note = "the defaults cannot run at this bucket: " + *reason;
      return outcome;
    }

  auto timings = measure(kernel, request.shape, configs, deadline);
  if (!timings.isOk()) {
    outcome.note = timings.status().message();
    return outcome;
  }
  if (timings->empty() || timings->size() < configs.size()) {
    outcome.state = TuneOutcome::State::OutOfBudget;
    outcome.note = "budget spent after " + std::to_string(timings->size()) + " of " +
                   std::to_string(configs.size()) + " candidates; not stored";
    return outcome;
  }
  if (timings->size() > configs.size() || !(*timings)[0].mismatch.empty() ||
      !((*timings)[0].microseconds > 0)) {
    outcome.note = "the measurement returned no usable timing of the defaults";
    return outcome;
  }
  const double defaultTime = (*timings)[0].microseconds;
  size_t best = 0;
  for (size_t i = 1; i < configs.size(); ++i) {
    const CandidateTiming &timing = (*timings)[i];
    if (!timing.mismatch.empty()) {
      ++outcome.mismatched;
      continue;
    }
    if (timing.microseconds > 0 && timing.microseconds < (*timings)[best].microseconds)
      best = i;
  }
  if (best != 0 && (*timings)[best].microseconds > defaultTime * (1.0 - options.minGain))
    best = 0; // within the noise of the defaults
  outcome.result = cache::TuningResult{
      .config = configs[best],
      .microseconds = (*timings)[best].microseconds,
      .defaultMicroseconds = defaultTime,
      .candidates = static_cast<int32_t>(configs.size()),
      .tuningSeconds = secondsBetween(start, options.now())};
  if (Status stored = cache::storeTuning(store, key, outcome.result); !stored) {
    outcome.note = "measured, but the cache refused the result: " + stored.message();
    return outcome;
  }
  outcome.state = TuneOutcome::State::Tuned;
  return outcome;
}

} // namespace

TuneReport tune(cache::CacheStore &store, const cache::TuningDevice &device,
                const std::vector<TuneRequest> &requests, const MeasureFn &measure,
                const TuneOptions &options) {
  TuneReport report;
  const Clock::time_point start = options.now();
  const Clock::time_point deadline =
      start + std::chrono::duration_cast<Clock::duration>(
                  std::chrono::duration<double>(std::max(0.0, options.budgetSeconds)));
  for (const TuneRequest &request : requests) {
    TuneOutcome outcome;
    outcome.request = request;
    const cache::CacheKey key = cache::tuningKey(*request.kernel, request.shape, device);
    if (!options.retune) {
      std::string why;
      auto stored = cache::lookupTuning(store, key, *request.kernel, &why);
      if (!stored.isOk()) {
        outcome.note = stored.status().message();
        report.outcomes.push_back(std::move(outcome));
        ++report.failed;
        continue;
      }
      if (stored->has_value()) {
        outcome.state = TuneOutcome::State::Cached;
        outcome.result = **stored;
        report.outcomes.push_back(std::move(outcome));
        ++report.cached;
        continue;
      }
    }
    if (options.now() >= deadline) {
      outcome.state = TuneOutcome::State::OutOfBudget;
      outcome.note = "budget spent before it started";
    } else {
      outcome = search(store, key, request, measure, options, deadline);
    }
    switch (outcome.state) {
    case TuneOutcome::State::Tuned:
      ++report.tuned;
      break;
    case TuneOutcome::State::OutOfBudget:
      ++report.outOfBudget;
      break;
    default:
      ++report.failed;
      break;
    }
    report.outcomes.push_back(std::move(outcome));
  }
  report.seconds = secondsBetween(start, options.now());
  return report;
}

std::string formatTuneReport(const TuneReport &report, const cache::TuningDevice &device) {
  std::string text = "tuning on " + device.gpu + ", " + std::to_string(device.smCount) +
                     " SMs, driver " + std::to_string(device.driverVersion) + ", " +
                     device.compiler + "\n";
  char line[512];
  std::snprintf(line, sizeof line, "%-20s %-64s %-12s %-20s %10s %10s %7s %s\n", "kernel",
                "bucket", "state", "config", "us", "default", "gain", "candidates");
  text += line;
  for (const TuneOutcome &o : report.outcomes) {
    const char *state = o.state == TuneOutcome::State::Cached        ? "cached"
                        : o.state == TuneOutcome::State::Tuned       ? "tuned"
                        : o.state == TuneOutcome::State::OutOfBudget ? "out-of-budget"
                                                                     : "failed";
    const bool measured =
        o.state == TuneOutcome::State::Cached || o.state == TuneOutcome::State::Tuned;
    if (measured) {
      const double gain = o.result.microseconds > 0
                              ? o.result.defaultMicroseconds / o.result.microseconds
                              : 0.0;
      std::snprintf(line, sizeof line, "%-20s %-64s %-12s %-20s %10.2f %10.2f %6.3fx %d measured",
                    o.request.kernel->name.c_str(), formatShape(o.request.shape).c_str(), state,
                    formatConfig(o.result.config).c_str(), o.result.microseconds,
                    o.result.defaultMicroseconds, gain, o.result.candidates);
      text += line;
      if (o.state == TuneOutcome::State::Tuned)
        text += ", " + std::to_string(o.rejected) + " rejected by the constraint, " +
                std::to_string(o.mismatched) + " with another output";
    } else {
      std::snprintf(line, sizeof line, "%-20s %-64s %-12s %s", o.request.kernel->name.c_str(),
                    formatShape(o.request.shape).c_str(), state, o.note.c_str());
      text += line;
    }
    text += "\n";
  }
  std::snprintf(line, sizeof line,
                "%d tuned, %d reused from the cache, %d left for lack of budget, %d failed, in "
                "%.1f s\n",
                report.tuned, report.cached, report.outOfBudget, report.failed, report.seconds);
  text += line;
  return text;
}

namespace {

TuneRequest indexerRequest(int64_t rows, int64_t maxKeys) {
  // DeepSeek-V3.2's indexer: 64 heads of 128, MXFP8 keys in 64-token pages, MXFP8 queries
  // (the warpgroup scores).
  kernels::cuda::IndexerParams p;
  p.rows = static_cast<int32_t>(rows);
  p.heads = 64;
  p.headDim = 128;
  p.keyType = kernels::cuda::IndexKeyType::Mxfp8;
  p.mxfp8Queries = true;
  p.pageTokens = 64;
  p.maxKeys = static_cast<int32_t>(maxKeys);
  return {.kernel = &indexerScoresKernel(), .shape = indexerScoresShape(p)};
}

TuneRequest sparseMlaRequest(int64_t rows, int64_t heads, int64_t topK, bool causal) {
  kernels::cuda::SparseMlaDecodeParams p;
  p.rows = static_cast<int32_t>(rows);
  p.heads = static_cast<int32_t>(heads);
  p.latentDim = 512;
  p.ropeDim = 64;
  p.topK = static_cast<int32_t>(topK);
  static const int32_t someIndices = 0; // only whether there are indices matters to the bucket
  p.indices = causal ? nullptr : &someIndices;
  return {.kernel = &sparseMlaDecodeKernel(), .shape = sparseMlaDecodeShape(p)};
}

// bf16 experts (the grouped tensor-core form runs only for them: DeepSeek-V3.2's FP8 experts run
// per token whatever the threshold) at a decode step's or a short prefill's token count.
TuneRequest moeRequest(int64_t tokens, int64_t experts, int64_t topK, int64_t hidden,
                       int64_t intermediate) {
  kernels::cuda::MoeExpertsParams p;
  p.tokens = static_cast<int32_t>(tokens);
  p.experts = static_cast<int32_t>(experts);
  p.topK = static_cast<int32_t>(topK);
  p.hidden = static_cast<int32_t>(hidden);
  p.intermediate = static_cast<int32_t>(intermediate);
  p.type = kernels::cuda::WeightType::BF16;
  return {.kernel = &moeExpertsKernel(), .shape = moeExpertsShape(p)};
}

TuneRequest kdaDecodeRequest(int64_t batch, int64_t heads, int64_t headDim) {
  kernels::cuda::KdaDecodeParams p;
  p.batch = static_cast<int32_t>(batch);
  p.heads = static_cast<int32_t>(heads);
  p.headDim = static_cast<int32_t>(headDim);
  p.stateType = kernels::cuda::KdaStateType::F32;
  return {.kernel = &kdaDecodeKernel(), .shape = kdaDecodeShape(p)};
}

// The token counts of the MoE buckets: decode batches and the per-token/grouped crossover.
constexpr int64_t kMoeTokenCounts[] = {1, 8, 16, 32, 64};

} // namespace

std::vector<std::string> presetNames() { return {"deepseek-v32", "kimi-linear-48b"}; }

StatusOr<std::vector<TuneRequest>> presetRequests(std::string_view preset) {
  std::vector<TuneRequest> requests;
  if (preset == "deepseek-v32") {
    for (int64_t context : {8192, 32768, 131072})
      for (int64_t batch : {1, 8, 64})
        requests.push_back(indexerRequest(batch, context));
    // 128 heads unsharded, 16 for a TP=8 rank; the top 2048 positions.
    for (int64_t heads : {128, 16})
      for (int64_t batch : {1, 8, 64})
        requests.push_back(sparseMlaRequest(batch, heads, 2048, false));
    // Its routed experts: 256 of hidden 7168, intermediate 2048, top 8.
    for (int64_t tokens : kMoeTokenCounts)
      requests.push_back(moeRequest(tokens, 256, 8, 7168, 2048));
    return requests;
  }
  if (preset == "kimi-linear-48b") {
    // Its MLA layers (32 heads, 512 + 64) attend causally to the whole context.
    for (int64_t context : {8192, 32768})
      for (int64_t batch : {1, 8, 64})
        requests.push_back(sparseMlaRequest(batch, 32, context, true));
    // Its routed experts (256 of hidden 2304, intermediate 1024, top 8) and its KDA layers'
    // decode step (32 heads of 128, fp32 state).
    for (int64_t tokens : kMoeTokenCounts)
      requests.push_back(moeRequest(tokens, 256, 8, 2304, 1024));
    for (int64_t batch : {1, 8, 64})
      requests.push_back(kdaDecodeRequest(batch, 32, 128));
    return requests;
  }
  std::string names;
  for (const std::string &name : presetNames())
    names += (names.empty() ? "" : ", ") + name;
  return Status::error("unknown preset '" + std::string(preset) + "' (known: " + names + ")");
}

StatusOr<TuneRequest> parseRequest(std::string_view kernelName, std::string_view text) {
  const TunableKernel *kernel = findTunableKernel(kernelName);
  if (!kernel) {
    std::string names;
    for (const TunableKernel *k : tunableKernels())
      names += (names.empty() ? "" : ", ") + k->name;
    return Status::error("unknown tunable kernel '" + std::string(kernelName) + "' (known: " +
                         names + ")");
  }
  const std::vector<std::string> dimensions = shapeDimensions(*kernel);
  ShapeBucket shape;
  size_t at = 0;
  while (at < text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string_view item = text.substr(at, comma - at);
    at = comma + 1;
    const size_t equals = item.find('=');
    int64_t value = 0;
    const char *end = item.data() + item.size();
    if (equals == std::string_view::npos ||
        std::from_chars(item.data() + equals + 1, end, value).ptr != end || equals + 1 == item.size())
      return Status::error(kernel->name + " shape: '" + std::string(item) +
                           "' is not dimension=integer");
    const std::string dimension(item.substr(0, equals));
    if (std::find(dimensions.begin(), dimensions.end(), dimension) == dimensions.end())
      return Status::error(kernel->name + " shape: no dimension '" + dimension + "'");
    if (value < 0)
      return Status::error(kernel->name + " shape: " + dimension + " is negative");
    shape[dimension] = value;
  }
  for (const std::string &dimension : dimensions)
    if (!shape.count(dimension))
      return Status::error(kernel->name + " shape: '" + std::string(text) + "' has no '" +
                           dimension + "'");
  // The runtime's bucketing, so the stored key is the one a launch of this shape looks up.
  if (kernel->name == kIndexerScores) {
    kernels::cuda::IndexerParams p;
    p.rows = static_cast<int32_t>(shape["rows"]);
    p.heads = static_cast<int32_t>(shape["heads"]);
    p.headDim = static_cast<int32_t>(shape["head_dim"]);
    p.maxKeys = static_cast<int32_t>(shape["max_keys"]);
    if (shape["key_type"] > 2)
      return Status::error(kernel->name + " shape: key_type " +
                           std::to_string(shape["key_type"]) +
                           " is none of 0 (fp8 per key), 1 (mxfp8), 2 (f32)");
    p.keyType = static_cast<kernels::cuda::IndexKeyType>(shape["key_type"]);
    ShapeBucket bucketed = indexerScoresShape(p);
    if (shape["score_form"] > 3)
      return Status::error(kernel->name + " shape: score_form " +
                           std::to_string(shape["score_form"]) + " is not 0..3");
    bucketed["score_form"] = shape["score_form"];
    return TuneRequest{.kernel = kernel, .shape = std::move(bucketed)};
  }
  if (kernel->name == kMoeExperts) {
    if (shape["weight_type"] > 2)
      return Status::error(kernel->name + " shape: weight_type " +
                           std::to_string(shape["weight_type"]) +
                           " is none of 0 (f32), 1 (bf16), 2 (fp8 with block scales)");
    kernels::cuda::MoeExpertsParams p;
    p.tokens = static_cast<int32_t>(shape["tokens"]);
    p.topK = static_cast<int32_t>(shape["top_k"]);
    p.experts = static_cast<int32_t>(shape["experts"]);
    p.hidden = static_cast<int32_t>(shape["hidden"]);
    p.intermediate = static_cast<int32_t>(shape["intermediate"]);
    p.type = static_cast<kernels::cuda::WeightType>(shape["weight_type"]);
    return TuneRequest{.kernel = kernel, .shape = moeExpertsShape(p)};
  }
  if (kernel->name == kKdaDecode) {
    if (shape["state_type"] > 1)
      return Status::error(kernel->name + " shape: state_type " +
                           std::to_string(shape["state_type"]) + " is none of 0 (f32), 1 (bf16)");
    kernels::cuda::KdaDecodeParams p;
    p.batch = static_cast<int32_t>(shape["batch"]);
    p.heads = static_cast<int32_t>(shape["heads"]);
    p.headDim = static_cast<int32_t>(shape["head_dim"]);
    p.stateType = static_cast<kernels::cuda::KdaStateType>(shape["state_type"]);
    return TuneRequest{.kernel = kernel, .shape = kdaDecodeShape(p)};
  }
  kernels::cuda::SparseMlaDecodeParams p;
  p.rows = static_cast<int32_t>(shape["rows"]);
  p.heads = static_cast<int32_t>(shape["heads"]);
  p.latentDim = static_cast<int32_t>(shape["latent_dim"]);
  p.ropeDim = static_cast<int32_t>(shape["rope_dim"]);
  p.topK = static_cast<int32_t>(shape["top_k"]);
  static const int32_t someIndices = 0;
  p.indices = shape["causal"] ? nullptr : &someIndices;
  return TuneRequest{.kernel = kernel, .shape = sparseMlaDecodeShape(p)};
}

} // namespace hybrid::kernels::tuning
