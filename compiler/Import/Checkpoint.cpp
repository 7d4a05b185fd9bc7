#include "compiler/Import/Checkpoint.h"

#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/FileSystem.h"

namespace hybrid::import {

StatusOr<llvm::json::Value> readJsonFile(const std::string &path) {
  auto buffer = llvm::MemoryBuffer::getFile(path, /*IsText=*/true);
  if (!buffer)
    return Status::error(path + ": cannot read: " + buffer.getError().message());
  llvm::Expected<llvm::json::Value> value = llvm::json::parse((*buffer)->getBuffer());
  if (!value)
    return Status::error(path + ": malformed JSON: " + llvm::toString(value.takeError()));
  return std::move(*value);
}

StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::open(const std::string &dir) {
  auto checkpoint = std::unique_ptr<Checkpoint>(new Checkpoint());
  checkpoint->dir_ = dir;
  if (!llvm::sys::fs::is_directory(dir))
    return Status::error(dir + ": not a checkpoint directory");

  StatusOr<llvm::json::Value> config = readJsonFile(checkpoint->configPath());
  if (!config)
    return config.status();
  if (!config->getAsObject())
    return Status::error(checkpoint->configPath() + ": top level must be a JSON object");
  checkpoint->config_ = std::move(*config->getAsObject());

  // Which shard holds which tensor: from the index, or the single-file layout.
  const std::string indexPath = dir + "/model.safetensors.index.json";
  std::map<std::string, std::string> shardOf; // tensor -> shard file name
  std::vector<std::string> shardNames;
  if (llvm::sys::fs::exists(indexPath)) {
    StatusOr<llvm::json::Value> index = readJsonFile(indexPath);
    if (!index)
      return index.status();
    const llvm::json::Object *root = index->getAsObject();
    const llvm::json::Object *weightMap = root ? root->getObject("weight_map") : nullptr;
    if (!weightMap)
      return Status::error(indexPath + ": field 'weight_map' missing or not an object");
    for (const auto &[name, shardValue] : *weightMap) {
      std::optional<llvm::StringRef> shard = shardValue.getAsString();
      if (!shard)
        return Status::error(indexPath + ": weight_map entry '" + name.str() +
                             "' is not a file name");
      if (shard->contains('/') || *shard == "." || *shard == "..")
        return Status::error(indexPath + ": weight_map entry '" + name.str() + "' names shard '" +
                             shard->str() + "' outside the checkpoint directory");
      if (std::find(shardNames.begin(), shardNames.end(), shard->str()) == shardNames.end())
        shardNames.push_back(shard->str());
      shardOf[name.str()] = shard->str();
    }
    std::sort(shardNames.begin(), shardNames.end());
  } else if (llvm::sys::fs::exists(dir + "/model.safetensors")) {
    shardNames.push_back("model.safetensors");
  } else {
    return Status::error(dir + ": no model.safetensors.index.json and no model.safetensors");
  }

  for (const std::string &shardName : shardNames) {
    const std::string shardPath = dir + "/" + shardName;
    if (!llvm::sys::fs::exists(shardPath)) {
      std::string example;
      for (const auto &[tensor, shard] : shardOf)
        if (shard == shardName) {
          example = tensor;
          break;
        }
      return Status::error(indexPath + ": shard '" + shardName + "' (holding '" + example +
                           "') does not exist");
    }
    StatusOr<safetensors::File> file = safetensors::File::open(shardPath);
    if (!file)
      return file.status();
    checkpoint->shards_.push_back(std::make_unique<safetensors::File>(std::move(*file)));
    const safetensors::File &shard = *checkpoint->shards_.back();
    for (const safetensors::TensorInfo &info : shard.tensors()) {
      if (!shardOf.empty()) {
        auto it = shardOf.find(info.name);
        if (it == shardOf.end() || it->second != shardName)
          return Status::error(shardPath + ": tensor '" + info.name + "' is not listed for this shard in " +
                               indexPath);
      }
      if (!checkpoint->tensors_.emplace(info.name, CheckpointTensor{&shard, &info}).second)
        return Status::error(shardPath + ": tensor '" + info.name + "' also appears in another shard");
    }
  }
  for (const auto &[tensor, shard] : shardOf)
    if (!checkpoint->tensors_.count(tensor))
      return Status::error(dir + "/" + shard + ": tensor '" + tensor + "' listed in " + indexPath +
                           " is missing from the shard");
  return checkpoint;
}

StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::openSynthetic(const std::string &dir,
                                                                uint64_t seed) {
  auto checkpoint = std::unique_ptr<Checkpoint>(new Checkpoint());
  checkpoint->dir_ = dir;
  if (!llvm::sys::fs::is_directory(dir))
    return Status::error(dir + ": not a model directory");
  const std::string configPath = checkpoint->configPath();
  auto text = llvm::MemoryBuffer::getFile(configPath, /*IsText=*/true);
  if (!text)
    return Status::error(configPath + ": cannot read: " + text.getError().message());
  HYBRID_ASSIGN_OR_RETURN(synth::SyntheticSpec spec,
                          synth::specFromConfigJson((*text)->getBuffer().str(), configPath, seed));
  StatusOr<llvm::json::Value> config = readJsonFile(configPath);
  if (!config)
    return config.status();
  checkpoint->config_ = std::move(*config->getAsObject()); // specFromConfigJson saw an object

  checkpoint->syntheticTensors_ = synth::listSyntheticTensors(spec);
  checkpoint->synthetic_ = std::move(spec);
  checkpoint->syntheticInfos_.reserve(checkpoint->syntheticTensors_.size());
  for (const synth::SyntheticTensor &tensor : checkpoint->syntheticTensors_) {
    safetensors::TensorInfo &info = checkpoint->syntheticInfos_.emplace_back();
    info.name = tensor.name;
    info.dtype = tensor.dtype;
    info.shape = tensor.shape;
    info.end = tensor.byteSize();
    checkpoint->tensors_.emplace(tensor.name, CheckpointTensor{nullptr, &info, &tensor});
  }
  return checkpoint;
}

const CheckpointTensor *Checkpoint::find(const std::string &name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

} // namespace hybrid::import
