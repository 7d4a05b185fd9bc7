// A serving benchmark (hybrid-bench serve): a fixed number of streaming completion requests from
// `concurrency` client threads over loopback HTTP to a hybrid-serve endpoint, random token-id
// prompts; reports throughput and the percentiles of time to first token and inter-token latency,
// like the serving benchmarks of the popular engines. Stops by itself.
#pragma once

#include "hybrid/runtime/Status.h"

#include <cstdint>
#include <string>

namespace hybrid {

struct LoadGeneratorOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string apiKey;
  int32_t requests = 64;
  int32_t concurrency = 8;
  int32_t promptTokens = 128;
  int32_t maxTokens = 64;
  int64_t vocabSize = 256; // prompts draw ids from [0, vocabSize)
  uint64_t seed = 1;
  int32_t timeoutSeconds = 600; // per request
};

struct Percentiles {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
};

struct LoadReport {
  int32_t completed = 0;
  int32_t failed = 0;
  std::string firstError;
  double seconds = 0;
  int64_t outputTokens = 0;
  double outputTokensPerSecond = 0;
  double requestsPerSecond = 0;
  Percentiles timeToFirstToken;  // seconds
  Percentiles interTokenLatency; // seconds
};

// Runs the load; an error only when nothing could run (bad options). Failed requests are counted.
StatusOr<LoadReport> runLoad(const LoadGeneratorOptions &options);

// The report as a table and as JSON.
std::string formatLoadReport(const LoadGeneratorOptions &options, const LoadReport &report);
std::string loadReportJson(const LoadGeneratorOptions &options, const LoadReport &report);

} // namespace hybrid
