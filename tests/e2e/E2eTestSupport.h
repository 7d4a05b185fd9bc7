// Shared by the e2e test executables that run compiled plans (hybrid_e2e_tests,
// hybrid_serve_tests, hybrid_mtp_tests; HYBRID_E2E_DIR and HYBRID_TEST_DATA_DIR defined): where
// a compiled plan lives, a golden file and its prompt, a model loaded or the test failed.
#pragma once

#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Generate.h" // readInputIds, generateGreedy
#include "hybrid/runtime/Scheduler.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace hybrid::e2etest {

inline std::string compiledDir(const std::string &model) {
  return std::string(HYBRID_E2E_DIR) + "/" + model;
}

inline std::string goldenFile(const std::string &model) {
  return std::string(HYBRID_TEST_DATA_DIR) + "/" + model + "/golden.safetensors";
}

inline std::vector<int64_t> goldenPrompt(const std::string &model) {
  auto ids = readInputIds(goldenFile(model));
  EXPECT_TRUE(ids.isOk()) << ids.status().message();
  return ids.isOk() ? *ids : std::vector<int64_t>{};
}

inline std::unique_ptr<Model> loadOrDie(const std::string &dir, LoadOptions options = {}) {
  auto model = Model::load(dir, options);
  EXPECT_TRUE(model.isOk()) << model.status().message();
  return model.isOk() ? std::move(*model) : nullptr;
}

// What a scheduler produced until idle: each request's tokens and errors, and the steps taken.
struct SchedulerRun {
  std::map<uint64_t, std::vector<int64_t>> tokens;
  std::map<uint64_t, std::string> errors;
  int steps = 0;
};

inline SchedulerRun runToIdle(Scheduler &scheduler, int maxSteps = 2000) {
  SchedulerRun run;
  while (!scheduler.idle() && run.steps < maxSteps) {
    ++run.steps;
    for (const TokenEvent &event : scheduler.step()) {
      if (!event.error.empty())
        run.errors[event.request] = event.error;
      else
        run.tokens[event.request].push_back(event.token);
    }
  }
  EXPECT_TRUE(scheduler.idle()) << "still busy after " << maxSteps << " steps";
  return run;
}

// The greedy tokens of `prompt` decoded alone.
inline std::vector<int64_t> greedyIds(Model &model, const std::vector<int64_t> &prompt,
                                      int64_t count) {
  GenerationOptions options;
  options.maxNewTokens = count;
  auto result = generateGreedy(model, prompt, options);
  EXPECT_TRUE(result.isOk()) << result.status().message();
  return result.isOk() ? result->generated : std::vector<int64_t>{};
}

// Submits every prompt as a greedy request of maxNewTokens: request id -> its prompt.
inline std::map<uint64_t, std::vector<int64_t>>
submitGreedy(Scheduler &scheduler, const std::vector<std::vector<int64_t>> &prompts,
             int64_t maxNewTokens) {
  std::map<uint64_t, std::vector<int64_t>> promptOf;
  for (const std::vector<int64_t> &prompt : prompts) {
    auto id = scheduler.submit(
        {.prompt = prompt, .maxNewTokens = maxNewTokens, .stopTokens = {}, .sampling = {}});
    EXPECT_TRUE(id.isOk()) << id.status().message();
    if (id.isOk())
      promptOf[*id] = prompt;
  }
  return promptOf;
}

} // namespace hybrid::e2etest
