// Hugging Face checkpoint directory -> verified `hybrid` IR.
#pragma once

#include "hybrid/runtime/Status.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OwningOpRef.h"

#include <cstdint>
#include <optional>
#include <string>

namespace hybrid::import {

struct ImportOptions {
  // An architecture mapping file to use instead of the built-in one for the config's model_type.
  std::string mappingPath;
  // Synthetic weights (hybrid-compile --synthetic-weights=SEED): the tensors come from config.json
  // alone (Checkpoint::openSynthetic), no weight file is read; the built-in mappings only.
  std::optional<uint64_t> syntheticSeed;
};

// Reads config.json and every shard, maps the layers through the architecture mapping of the
// config's model_type and returns a verified module holding one `hybrid.model`. Every checkpoint
// tensor is referenced exactly once (multi-token-prediction layers past num_hidden_layers aside).
// Errors are one line naming the file and the field or tensor.
StatusOr<mlir::OwningOpRef<mlir::ModuleOp>>
importCheckpoint(mlir::MLIRContext &context, const std::string &dir,
                 const ImportOptions &options = {});

} // namespace hybrid::import
