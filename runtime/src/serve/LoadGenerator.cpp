#include "hybrid/runtime/LoadGenerator.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace hybrid {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

Percentiles percentilesOf(std::vector<double> values) {
  Percentiles result;
  if (values.empty())
    return result;
  std::sort(values.begin(), values.end());
  auto at = [&](double q) {
    const size_t index = std::min(values.size() - 1, static_cast<size_t>(q * (values.size() - 1) + 0.5));
    return values[index];
  };
  result.p50 = at(0.50);
  result.p90 = at(0.90);
  result.p99 = at(0.99);
  double sum = 0;
  for (double value : values)
    sum += value;
  result.mean = sum / static_cast<double>(values.size());
  return result;
}

// One streaming request: appends its time to first token and inter-token gaps; the tokens it got,
// or -1 with `error` set.
int64_t streamOne(const LoadGeneratorOptions &options, const std::vector<int64_t> &prompt,
                  std::vector<double> &firstToken, std::vector<double> &gaps, std::string &error) {
  httplib::Client client(options.host, options.port);
  client.set_read_timeout(options.timeoutSeconds);
  httplib::Headers headers;
  if (!options.apiKey.empty())
    headers.emplace("Authorization", "Bearer " + options.apiKey);
  const json body = {{"prompt", prompt}, {"max_tokens", options.maxTokens}, {"stream", true}};
  const auto start = Clock::now();
  auto last = start;
  int64_t tokens = 0;
  std::string buffer;
  httplib::Request request;
  request.method = "POST";
  request.path = "/v1/completions";
  request.headers = headers;
  request.headers.emplace("Content-Type", "application/json");
  request.body = body.dump();
  // Read the events as they arrive (the time of each token is the point of the benchmark).
  request.content_receiver = [&](const char *data, size_t length, uint64_t, uint64_t) {
    buffer.append(data, length);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]")
        continue;
      const json chunk = json::parse(event.substr(6), nullptr, false);
      if (chunk.is_discarded() || chunk.contains("error")) {
        error = chunk.is_discarded() ? "a stream chunk is not JSON"
                                     : chunk["error"].value("message", "error");
        return false;
      }
      const auto now = Clock::now();
      if (tokens == 0)
        firstToken.push_back(std::chrono::duration<double>(now - start).count());
      else
        gaps.push_back(std::chrono::duration<double>(now - last).count());
      last = now;
      ++tokens;
    }
    return true;
  };
  httplib::Response response;
  httplib::Error failure = httplib::Error::Success;
  const bool sent = client.send(request, response, failure);
  if (!sent) {
    if (error.empty())
      error = "HTTP request failed: " + httplib::to_string(failure);
    return -1;
  }
  if (response.status != 200) {
    // The body of an error answer went to the receiver, which kept what was not an event.
    const json body = json::parse(response.body.empty() ? buffer : response.body, nullptr, false);
    error = "HTTP " + std::to_string(response.status) +
            (body.is_object() && body.contains("error")
                 ? ": " + body["error"].value("message", std::string())
                 : std::string());
    return -1;
  }
  return error.empty() ? tokens : -1;
}

} // namespace

StatusOr<LoadReport> runLoad(const LoadGeneratorOptions &options) {
  if (options.requests < 1 || options.concurrency < 1 || options.promptTokens < 1 ||
      options.maxTokens < 1 || options.vocabSize < 1)
    return Status::error("serve benchmark: requests, concurrency, prompt tokens, max tokens and "
                         "the vocabulary size must all be positive");
  // Prompts drawn up front, so the load is the same for every run with this seed.
  std::mt19937_64 rng(options.seed);
  std::uniform_int_distribution<int64_t> token(0, options.vocabSize - 1);
  std::vector<std::vector<int64_t>> prompts(static_cast<size_t>(options.requests));
  for (auto &prompt : prompts)
    for (int32_t i = 0; i < options.promptTokens; ++i)
      prompt.push_back(token(rng));

  std::atomic<int32_t> next{0};
  std::mutex mutex;
  LoadReport report;
  std::vector<double> firstTokens, gaps;
  const auto start = Clock::now();
  std::vector<std::thread> clients;
  for (int32_t c = 0; c < std::min(options.concurrency, options.requests); ++c)
    clients.emplace_back([&] {
      for (int32_t index; (index = next.fetch_add(1)) < options.requests;) {
        std::vector<double> first, between;
        std::string error;
        const int64_t tokens = streamOne(options, prompts[static_cast<size_t>(index)], first,
                                         between, error);
        std::lock_guard<std::mutex> lock(mutex);
        if (tokens < 0) {
          ++report.failed;
          if (report.firstError.empty())
            report.firstError = error;
          continue;
        }
        ++report.completed;
        report.outputTokens += tokens;
        firstTokens.insert(firstTokens.end(), first.begin(), first.end());
        gaps.insert(gaps.end(), between.begin(), between.end());
      }
    });
  for (std::thread &client : clients)
    client.join();
  report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  report.outputTokensPerSecond = report.outputTokens / std::max(report.seconds, 1e-9);
  report.requestsPerSecond = report.completed / std::max(report.seconds, 1e-9);
  report.timeToFirstToken = percentilesOf(firstTokens);
  report.interTokenLatency = percentilesOf(gaps);
  return report;
}

std::string formatLoadReport(const LoadGeneratorOptions &options, const LoadReport &report) {
  char text[1024];
  std::snprintf(
      text, sizeof text,
      "requests %d (concurrency %d, %d prompt + %d new tokens): %d completed, %d failed%s%s\n"
      "duration %.2f s, %.1f output tokens/s, %.2f requests/s\n"
      "time to first token  ms: p50 %.1f  p90 %.1f  p99 %.1f  mean %.1f\n"
      "inter-token latency  ms: p50 %.1f  p90 %.1f  p99 %.1f  mean %.1f\n",
      options.requests, options.concurrency, options.promptTokens, options.maxTokens,
      report.completed, report.failed, report.firstError.empty() ? "" : " (first: ",
      report.firstError.empty() ? "" : (report.firstError + ")").c_str(), report.seconds,
      report.outputTokensPerSecond, report.requestsPerSecond, 1e3 * report.timeToFirstToken.p50,
      1e3 * report.timeToFirstToken.p90, 1e3 * report.timeToFirstToken.p99,
      1e3 * report.timeToFirstToken.mean, 1e3 * report.interTokenLatency.p50,
      1e3 * report.interTokenLatency.p90, 1e3 * report.interTokenLatency.p99,
      1e3 * report.interTokenLatency.mean);
  return text;
}

std::string loadReportJson(const LoadGeneratorOptions &options, const LoadReport &report) {
  auto percentiles = [](const Percentiles &p) {
    return json{{"p50", p.p50}, {"p90", p.p90}, {"p99", p.p99}, {"mean", p.mean}};
  };
  const json result = {{"requests", options.requests},
                       {"concurrency", options.concurrency},
                       {"prompt_tokens", options.promptTokens},
                       {"max_tokens", options.maxTokens},
                       {"completed", report.completed},
                       {"failed", report.failed},
                       {"first_error", report.firstError},
                       {"seconds", report.seconds},
                       {"output_tokens", report.outputTokens},
                       {"output_tokens_per_s", report.outputTokensPerSecond},
                       {"requests_per_s", report.requestsPerSecond},
                       {"time_to_first_token_s", percentiles(report.timeToFirstToken)},
                       {"inter_token_latency_s", percentiles(report.interTokenLatency)}};
  return result.dump(2) + "\n";
}

} // namespace hybrid
