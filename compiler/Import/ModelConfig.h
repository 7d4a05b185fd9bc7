// An architecture mapping (data, one JSON file per model_type) and config.json seen through it.
//
// A mapping names, for one `model_type`: where each canonical setting lives in config.json (with
// the alternative spellings of older and newer writers, which must agree when both are present),
// how to tell each layer's mixer and feed-forward kind, and the checkpoint tensor name of every
// op weight. A new hybrid layout is a new mapping file, not new importer code
// (docs/importer.md describes the format).
#pragma once

#include "hybrid/runtime/Status.h"

#include "llvm/Support/JSON.h"

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace hybrid::import {

struct ConfigField {
  std::vector<std::string> paths; // dotted paths into config.json, in order of preference
  bool hasDefault = false;
  llvm::json::Value defaultValue = nullptr; // null: the setting is absent by default
};

struct ArchitectureMapping {
  std::string modelType;
  std::string source; // where the mapping came from, for error messages
  std::map<std::string, ConfigField> config;
  std::vector<llvm::json::Object> mixerRules;
  std::vector<llvm::json::Object> ffnRules;
  // group ("model", "layer", "kda", ...) -> role -> name template with {layer} / {expert}
  std::map<std::string, std::map<std::string, std::string>> tensors;
  std::string fp8ScaleSuffix;
  // Tensors allowed to stay unreferenced: the multi-token-prediction layers that follow the
  // decoder (`extraLayerPrefix` + index in [num_layers, num_layers + the `extraLayersSetting`
  // count)) and the given regular expressions.
  std::string extraLayerPrefix;
  std::string extraLayersSetting;
  std::vector<std::string> unreferencedPatterns;

  static StatusOr<ArchitectureMapping> parse(const llvm::json::Value &json, std::string source);
  static StatusOr<ArchitectureMapping> load(const std::string &path);
  // The mappings compiled into the binary (compiler/Import/mappings/*.json).
  static StatusOr<ArchitectureMapping> builtin(const std::string &modelType);
  static std::vector<std::string> builtinModelTypes();

  // The tensor name template of `group.role`; empty when the mapping has none.
  std::string tensorTemplate(const std::string &group, const std::string &role) const;
};

class ModelConfig {
public:
  ModelConfig(const llvm::json::Object &config, const ArchitectureMapping &mapping,
              std::string configPath)
      : config_(config), mapping_(mapping), configPath_(std::move(configPath)) {}

  // The value of a canonical setting; nullopt when absent (or null) and the default is null.
  StatusOr<std::optional<llvm::json::Value>> get(const std::string &name) const;

  StatusOr<int64_t> getInt(const std::string &name) const;
  StatusOr<std::optional<int64_t>> getOptionalInt(const std::string &name) const;
  StatusOr<double> getDouble(const std::string &name) const;
  StatusOr<std::optional<double>> getOptionalDouble(const std::string &name) const;
  StatusOr<bool> getBool(const std::string &name) const;
  StatusOr<std::string> getString(const std::string &name) const;
  StatusOr<std::optional<std::string>> getOptionalString(const std::string &name) const;

  // The kind of every layer (e.g. "kda", "mla", "mla_dsa" / "mlp", "moe") from the mapping's
  // rules; every applicable rule must agree.
  StatusOr<std::vector<std::string>> layerKinds(const std::vector<llvm::json::Object> &rules,
                                                int64_t numLayers, const std::string &what) const;

  const std::string &path() const { return configPath_; }
  // The config path a canonical setting was read from, for messages.
  std::string describe(const std::string &name) const;

private:
  const llvm::json::Value *lookup(const std::string &dottedPath) const;
  Status error(const std::string &message) const { return Status::error(configPath_ + ": " + message); }

  const llvm::json::Object &config_;
  const ArchitectureMapping &mapping_;
  std::string configPath_;
};

} // namespace hybrid::import
