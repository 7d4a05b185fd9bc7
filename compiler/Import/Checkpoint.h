// A Hugging Face checkpoint directory: config.json plus one or more safetensors shards
// (model.safetensors.index.json maps tensor names to shards). Opening it validates every shard
// header and the index against the shards, so the importer can trust every tensor it looks up.
#pragma once

#include "hybrid/runtime/Safetensors.h"
#include "hybrid/runtime/Status.h"

#include "llvm/Support/JSON.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace hybrid::import {

struct CheckpointTensor {
  const safetensors::File *shard = nullptr;
  const safetensors::TensorInfo *info = nullptr;
};

class Checkpoint {
public:
  // Reads `dir/config.json`, then `dir/model.safetensors.index.json` and its shards, or a single
  // `dir/model.safetensors`.
  static StatusOr<std::unique_ptr<Checkpoint>> open(const std::string &dir);

  const std::string &dir() const { return dir_; }
  std::string configPath() const { return dir_ + "/config.json"; }
  const llvm::json::Object &config() const { return config_; }

  const CheckpointTensor *find(const std::string &name) const;
  // Every tensor, sorted by name.
  const std::map<std::string, CheckpointTensor> &tensors() const { return tensors_; }

private:
  std::string dir_;
  llvm::json::Object config_;
  std::vector<std::unique_ptr<safetensors::File>> shards_;
  std::map<std::string, CheckpointTensor> tensors_;
};

// Reads and parses a JSON file; errors name the file and the parser's position.
StatusOr<llvm::json::Value> readJsonFile(const std::string &path);

} // namespace hybrid::import
