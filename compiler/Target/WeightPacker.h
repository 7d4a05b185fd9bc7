// Writes the weight archive a plan reads, from the checkpoint: every plan weight at its planned
// offset (the shared layout rule), bytes copied as stored (row-major, checkpoint dtype) until the
// layout and quantization passes (issue 4) decide otherwise.
#pragma once

#include "dialects/Plan/IR/PlanDialect.h"
#include "hybrid/runtime/Status.h"
#include "hybrid/runtime/WeightArchive.h"

#include <optional>
#include <span>
#include <string>
#include <vector>

namespace hybrid::target {

// One weight as the plan places it in the archive.
struct WeightPlacement {
  std::string name;
  plan::fb::DType dtype = plan::fb::DType::F32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;
  uint64_t size = 0;
  bool nzTiled = false;
  std::vector<int32_t> tile; // nzTiled: [rows, cols]
  int32_t scale = -1;
  // A sharded plan's part of the checkpoint tensor: [axis, begin]; `shape` is the part's.
  std::vector<int64_t> slice;
};

std::vector<WeightPlacement> weightPlacements(plan::PlanOp planOp);
// From a serialized plan (a cache hit never rebuilds the plan IR).
std::vector<WeightPlacement> weightPlacements(const plan::fb::Plan &plan);

// The archive key the plan names: a hash of the weight placements. It depends on structure and
// layout decisions only, never on weight values.
ArchiveKey weightLayoutKey(std::span<const WeightPlacement> placements);

// A fingerprint of the checkpoint's weight files (every shard's size, modification time and
// header), cheap to compute on a terabyte checkpoint. With a synthetic seed: of config.json and
// the seed (no weight file is read).
StatusOr<std::string> checkpointFingerprint(const std::string &checkpointDir,
                                            std::optional<uint64_t> syntheticSeed = {});

struct PackResult {
  bool reused = false; // an archive of the same layout from the same checkpoint was already there
  uint64_t bytes = 0;
  size_t entries = 0;
};

// Writes `archivePath` (atomically) unless it already holds this layout packed from a checkpoint
// with this fingerprint (recorded in `archivePath + ".source"`). With a synthetic seed the archive
// is a synthetic one (docs/weight-archive.md, format version 2): one generator descriptor per
// weight (synth::syntheticValuesFor, in the plan's layout), no data; its file is a few pages.
StatusOr<PackResult> packWeights(std::span<const WeightPlacement> placements,
                                 const std::string &checkpointDir,
                                 const std::string &archivePath,
                                 std::optional<uint64_t> syntheticSeed = {});

} // namespace hybrid::target
