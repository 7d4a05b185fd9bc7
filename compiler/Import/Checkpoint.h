// A Hugging Face checkpoint directory: config.json plus one or more safetensors shards
// (model.safetensors.index.json maps tensor names to shards). Opening it validates every shard
// header and the index against the shards, so the importer can trust every tensor it looks up.
// A synthetic checkpoint (hybrid-compile --synthetic-weights) is config.json alone: its tensors
// are the ones the config implies (synth::listSyntheticTensors), with no bytes.
#pragma once

#include "hybrid/runtime/Safetensors.h"
#include "hybrid/runtime/Status.h"
#include "hybrid/runtime/SyntheticCheckpoint.h"

#include "llvm/Support/JSON.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace hybrid::import {

struct CheckpointTensor {
  const safetensors::File *shard = nullptr; // null in a synthetic checkpoint
  const safetensors::TensorInfo *info = nullptr;
  const synth::SyntheticTensor *synthetic = nullptr; // set in a synthetic checkpoint
};

class Checkpoint {
public:
  // Reads `dir/config.json`, then `dir/model.safetensors.index.json` and its shards, or a single
  // `dir/model.safetensors`.
  static StatusOr<std::unique_ptr<Checkpoint>> open(const std::string &dir);
  // Reads `dir/config.json` only (no weight file is opened, none needs to exist) and lists the
  // tensors it implies for a kimi_linear, deepseek_v32 or hybrid model, values to come from `seed`.
  static StatusOr<std::unique_ptr<Checkpoint>> openSynthetic(const std::string &dir,
                                                             uint64_t seed);

  const std::string &dir() const { return dir_; }
  std::string configPath() const { return dir_ + "/config.json"; }
  const llvm::json::Object &config() const { return config_; }

  const CheckpointTensor *find(const std::string &name) const;
  // Where a tensor comes from, for messages: its shard, or config.json for a synthetic one.
  std::string pathOf(const CheckpointTensor &tensor) const {
    return tensor.shard ? tensor.shard->path() : configPath();
  }
  // The spec of a synthetic checkpoint; null for files.
  const synth::SyntheticSpec *syntheticSpec() const { return synthetic_ ? &*synthetic_ : nullptr; }
  // Every tensor, sorted by name.
  const std::map<std::string, CheckpointTensor> &tensors() const { return tensors_; }

private:
  std::string dir_;
  llvm::json::Object config_;
  std::vector<std::unique_ptr<safetensors::File>> shards_;
  std::map<std::string, CheckpointTensor> tensors_;
  // A synthetic checkpoint's spec and tensors (their infos point into syntheticInfos_).
  std::optional<synth::SyntheticSpec> synthetic_;
  std::vector<synth::SyntheticTensor> syntheticTensors_;
  std::vector<safetensors::TensorInfo> syntheticInfos_;
};

// Reads and parses a JSON file; errors name the file and the parser's position.
StatusOr<llvm::json::Value> readJsonFile(const std::string &path);

} // namespace hybrid::import
