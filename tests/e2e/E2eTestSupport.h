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

// Submits every prompt (greedy, maxNewTokens each) to `scheduler` and steps it until idle; a
// request's error fails the test. Each prompt's tokens, in prompt order.
inline std::vector<std::vector<int64_t>>
runToCompletion(Scheduler &scheduler, const std::vector<std::vector<int64_t>> &prompts,
                int64_t maxNewTokens) {
  std::map<uint64_t, size_t> promptOf;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto id = scheduler.submit(
        {.prompt = prompts[i], .maxNewTokens = maxNewTokens, .stopTokens = {}, .sampling = {}});
    EXPECT_TRUE(id.isOk()) << id.status().message();
    if (id.isOk())
      promptOf[*id] = i;
  }
  std::vector<std::vector<int64_t>> tokens(prompts.size());
  for (int step = 0; step < 100000 && !scheduler.idle(); ++step)
    for (const TokenEvent &event : scheduler.step()) {
      EXPECT_TRUE(event.error.empty()) << event.error;
      tokens[promptOf[event.request]].push_back(event.token);
    }
  EXPECT_TRUE(scheduler.idle()) << "the scheduler did not finish";
  return tokens;
}

// Each prompt's tokens equal greedy decoding of it alone (maxNewTokens each).
inline void expectGreedyTokens(Model &model, const std::vector<std::vector<int64_t>> &prompts,
                               const std::vector<std::vector<int64_t>> &tokens,
                               int64_t maxNewTokens) {
  ASSERT_EQ(tokens.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationOptions plain;
    plain.maxNewTokens = maxNewTokens;
    auto reference = generateGreedy(model, prompts[i], plain);
    ASSERT_TRUE(reference.isOk()) << reference.status().message();
    EXPECT_EQ(tokens[i], reference->generated) << "prompt " << i;
  }
}

} // namespace hybrid::e2etest
