// The compiler's reading of config.json (compiler/Import/ModelConfig): the input parsed as JSON,
// then every canonical setting of its model type's built-in mapping read the way the importer
// reads it (int, double, bool, string, optional forms) and the per-layer mixer and feed-forward
// kinds derived from the mapping's rules. Any bytes give values or errors.
#include "compiler/Import/ModelConfig.h"

#include "llvm/Support/JSON.h"

#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  using namespace hybrid::import;
  llvm::Expected<llvm::json::Value> json =
      llvm::json::parse(llvm::StringRef(reinterpret_cast<const char *>(data), size));
  if (!json) {
    llvm::consumeError(json.takeError());
    return 0;
  }
  const llvm::json::Object *root = json->getAsObject();
  if (!root)
    return 0;
  for (const std::string &modelType : ArchitectureMapping::builtinModelTypes()) {
    auto mapping = ArchitectureMapping::builtin(modelType);
    if (!mapping)
      continue;
    const ModelConfig config(*root, *mapping, "config.json");
    for (const auto &[name, field] : mapping->config) {
      (void)config.get(name);
      (void)config.getInt(name);
      (void)config.getOptionalInt(name);
      (void)config.getDouble(name);
      (void)config.getOptionalDouble(name);
      (void)config.getBool(name);
      (void)config.getString(name);
      (void)config.getOptionalString(name);
    }
    auto layers = config.getInt("num_layers");
    if (layers && *layers >= 0 && *layers <= 4096) { // the layer lists are allocated per layer
      (void)config.layerKinds(mapping->mixerRules, *layers, "mixer");
      (void)config.layerKinds(mapping->ffnRules, *layers, "feed-forward");
    }
  }
  return 0;
}
