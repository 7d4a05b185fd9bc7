// Shared by the e2e test executables that run compiled plans (hybrid_e2e_tests,
// hybrid_serve_tests, hybrid_mtp_tests; HYBRID_E2E_DIR and HYBRID_TEST_DATA_DIR defined): where
// a compiled plan lives, a golden file and its prompt, a model loaded or the test failed.
#pragma once

#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Generate.h" // readInputIds

#include <gtest/gtest.h>

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

} // namespace hybrid::e2etest
