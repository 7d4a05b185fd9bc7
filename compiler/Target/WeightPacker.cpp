#include "compiler/Target/DType.h"
#include "compiler/Target/WeightPacker.h"

#include "compiler/Import/Checkpoint.h"
#include "hybrid/cache/Key.h"
#include "hybrid/kernels/ref/TiledLayout.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <set>

namespace hybrid::target {
namespace {

using namespace mlir;

ArchiveKey toArchiveKey(const cache::CacheKey &key) {
  ArchiveKey bytes{};
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<uint8_t>(key.high >> (56 - 8 * i));
    bytes[8 + i] = static_cast<uint8_t>(key.low >> (56 - 8 * i));
  }
  return bytes;
}

std::string readSmallFile(const std::string &path) {
  auto buffer = llvm::MemoryBuffer::getFile(path);
  return buffer ? (*buffer)->getBuffer().str() : std::string();
}

struct TiledWeight {
  std::vector<int64_t> shape; // padded to whole tiles
  std::vector<std::byte> bytes;
};

// Row-major checkpoint bytes -> the tiled layout the plan names (kernels/ref/TiledLayout.h).
StatusOr<TiledWeight> retile(const WeightPlacement &weight, std::span<const std::byte> rowMajor) {
  const int64_t elementBytes = static_cast<int64_t>(dtypeByteSize(weight.dtype));
  if (weight.shape.size() != 2 || weight.tile.size() != 2 || weight.tile[0] <= 0 ||
      weight.tile[1] <= 0 || (elementBytes != 1 && elementBytes != 2 && elementBytes != 4))
    return Status::error("weight '" + weight.name + "' cannot be tiled (needs a 2-D shape, a "
                                                    "2-D tile and 1-, 2- or 4-byte elements)");
  kernels::ref::TiledLayout layout{weight.shape[0], weight.shape[1],
                                   {weight.tile[0], weight.tile[1]}};
  if (static_cast<int64_t>(rowMajor.size()) != weight.shape[0] * weight.shape[1] * elementBytes ||
      static_cast<uint64_t>(layout.tiledBytes(elementBytes)) != weight.size)
    return Status::error("weight '" + weight.name + "': tiled size does not match the plan");
  TiledWeight tiled{{layout.paddedRows(), layout.paddedCols()},
                    std::vector<std::byte>(static_cast<size_t>(weight.size))};
  kernels::ref::packTiled(rowMajor, tiled.bytes, layout, elementBytes);
  return tiled;
}

// A sharded plan's part of a row-major tensor of shape `full`: `weight.shape` entries starting at
// `begin` along `axis`, i.e. `outer` runs of part[axis] x `inner` elements, each run starting
// full[axis] x `inner` elements after the previous one.
struct SliceGeometry {
  int64_t axis = 0;
  int64_t begin = 0;
  int64_t outer = 1; // product of the dimensions before the axis
  int64_t inner = 1; // product of the dimensions after it (elements)
};

StatusOr<SliceGeometry> sliceGeometry(const WeightPlacement &weight,
                                      const std::vector<int64_t> &full, const std::string &path) {
  const std::string what = path + ": tensor '" + weight.name + "'";
  if (weight.slice.size() != 2 || weight.shape.size() != full.size())
    return Status::error(what + ": the plan's slice needs [axis, begin] and the tensor's rank");
  SliceGeometry slice{.axis = weight.slice[0], .begin = weight.slice[1]};
  if (slice.axis < 0 || slice.axis >= static_cast<int64_t>(full.size()) || slice.begin < 0 ||
      slice.begin + weight.shape[slice.axis] > full[slice.axis])
    return Status::error(what + ": slice [" + std::to_string(slice.axis) + ", " +
                         std::to_string(slice.begin) + "] of " +
                         std::to_string(weight.shape[slice.axis]) +
                         " entries is outside the tensor");
  for (size_t d = 0; d < full.size(); ++d)
    if (static_cast<int64_t>(d) != slice.axis && weight.shape[d] != full[d])
      return Status::error(what + " does not match the plan's shape off the sliced axis");
  for (int64_t d = 0; d < slice.axis; ++d)
    slice.outer *= full[d];
  for (size_t d = static_cast<size_t>(slice.axis) + 1; d < full.size(); ++d)
    slice.inner *= full[d];
  return slice;
}

// The bytes of a sharded plan's part of a row-major checkpoint tensor (sliceGeometry).
StatusOr<std::vector<std::byte>> cutSlice(const WeightPlacement &weight,
                                          const std::vector<int64_t> &full,
                                          std::span<const std::byte> data,
                                          const std::string &path) {
  HYBRID_ASSIGN_OR_RETURN(SliceGeometry slice, sliceGeometry(weight, full, path));
  const int64_t inner = slice.inner * static_cast<int64_t>(dtypeByteSize(weight.dtype));
  if (static_cast<int64_t>(data.size()) != slice.outer * full[slice.axis] * inner)
    return Status::error(path + ": tensor '" + weight.name +
                         "' does not match its dtype and shape");
  const int64_t run = weight.shape[slice.axis] * inner; // contiguous bytes per outer index
  std::vector<std::byte> part(static_cast<size_t>(slice.outer * run));
  for (int64_t o = 0; o < slice.outer; ++o)
    std::copy_n(data.data() + (o * full[slice.axis] + slice.begin) * inner, run,
                part.data() + o * run);
  return part;
}

// A synthetic weight's descriptor in the plan's layout: the logical matrix is the weight's 2-D
// shape (other ranks: one row), stored row-major or in the plan's tiles. A sharded plan's slice
// (`slice` set, `full` the tensor's shape) draws the values the whole tensor has there: its
// logical matrix is [outer, part[axis] x inner] (a 2-D weight's own shape either way), each row
// part[axis] x inner elements of the seeded stream starting begin x inner into a run of
// full[axis] x inner. Nothing is generated here; the runtime generates only this rank's part.
Status addSyntheticWeight(WeightArchiveWriter &writer, const WeightPlacement &weight,
                          const synth::SyntheticSpec &spec, const synth::SyntheticTensor &tensor,
                          const std::optional<SliceGeometry> &slice,
                          const std::vector<int64_t> &full) {
  const synth::SyntheticValues values = synth::syntheticValuesFor(spec, tensor);
  SyntheticWeight synthetic{.kind = values.kind, .key = values.key, .a = values.a, .b = values.b};
  std::vector<int64_t> stored = weight.shape;
  if (slice && slice->axis == 0) {
    // Whole rows of the [full[0], inner] matrix: consecutive in the stream.
    synthetic.rows = weight.shape[0];
    synthetic.cols = slice->inner;
    synthetic.sourceOffset = slice->begin * slice->inner;
  } else if (slice) {
    synthetic.rows = slice->outer;
    synthetic.cols = weight.shape[slice->axis] * slice->inner;
    synthetic.sourceRowStride = full[slice->axis] * slice->inner;
    synthetic.sourceOffset = slice->begin * slice->inner;
  } else if (weight.shape.size() == 2) {
    synthetic.rows = weight.shape[0];
    synthetic.cols = weight.shape[1];
  } else {
    synthetic.rows = 1;
    synthetic.cols = 1;
    for (int64_t dim : weight.shape)
      synthetic.cols *= dim;
  }
  if (weight.nzTiled) {
    if (weight.shape.size() != 2 || weight.tile.size() != 2 || weight.tile[0] <= 0 ||
        weight.tile[1] <= 0)
      return Status::error("weight '" + weight.name + "' cannot be tiled (needs a 2-D shape and "
                                                      "a 2-D tile)");
    kernels::ref::TiledLayout layout{synthetic.rows, synthetic.cols,
                                     {weight.tile[0], weight.tile[1]}};
    synthetic.tileRows = weight.tile[0];
    synthetic.tileCols = weight.tile[1];
    stored = {layout.paddedRows(), layout.paddedCols()};
  }
  HYBRID_RETURN_IF_ERROR(writer.addSynthetic(weight.name, weight.dtype, stored, synthetic));
  if (writer.entries().back().size != weight.size)
    return Status::error("weight '" + weight.name + "': the synthetic entry's " +
                         std::to_string(writer.entries().back().size) +
                         " bytes do not match the plan's " + std::to_string(weight.size));
  return Status::ok();
}

} // namespace

std::vector<WeightPlacement> weightPlacements(plan::PlanOp planOp) {
  std::vector<WeightPlacement> placements;
  for (plan::WeightOp weight : planOp.getBodyBlock().getOps<plan::WeightOp>()) {
    auto type = cast<RankedTensorType>(weight.getType());
    std::vector<int32_t> tile;
    if (auto dims = weight.getTile())
      tile.assign(dims->begin(), dims->end());
    std::vector<int64_t> slice;
    if (auto part = weight.getSlice())
      slice.assign(part->begin(), part->end());
    placements.push_back({weight.getName().str(), toPlanDType(type.getElementType()),
                          std::vector<int64_t>(type.getShape().begin(), type.getShape().end()),
                          static_cast<uint64_t>(weight.getOffset()),
                          static_cast<uint64_t>(weight.getSize()), weight.getNzTiled(),
                          std::move(tile), static_cast<int32_t>(weight.getScale()),
                          std::move(slice)});
  }
  return placements;
}

std::vector<WeightPlacement> weightPlacements(const plan::fb::Plan &plan) {
  std::vector<WeightPlacement> placements;
  if (!plan.weights())
    return placements;
  for (const plan::fb::Weight *weight : *plan.weights()) {
    WeightPlacement placement;
    placement.name = weight->name() ? weight->name()->str() : std::string();
    placement.dtype = weight->dtype();
    if (weight->shape())
      placement.shape.assign(weight->shape()->begin(), weight->shape()->end());
    placement.offset = weight->offset();
    placement.size = weight->size();
    placement.nzTiled = weight->layout() == plan::fb::Layout::NzTiled;
    if (weight->tile())
      placement.tile.assign(weight->tile()->begin(), weight->tile()->end());
    placement.scale = weight->scale();
    if (weight->slice())
      placement.slice.assign(weight->slice()->begin(), weight->slice()->end());
    placements.push_back(std::move(placement));
  }
  return placements;
}

ArchiveKey weightLayoutKey(std::span<const WeightPlacement> placements) {
  cache::KeyBuilder key;
  key.add("record", "hybrid weight layout v1");
  for (const WeightPlacement &weight : placements) {
    key.add("name", weight.name);
    key.add("dtype", static_cast<int64_t>(weight.dtype));
    for (int64_t dim : weight.shape)
      key.add("dim", dim);
    key.add("offset", weight.offset);
    key.add("size", weight.size);
    key.add("nz_tiled", weight.nzTiled);
    for (int32_t dim : weight.tile)
      key.add("tile", static_cast<int64_t>(dim));
    key.add("scale", static_cast<int64_t>(weight.scale));
    for (int64_t part : weight.slice)
      key.add("slice", part);
  }
  return toArchiveKey(key.finish());
}

StatusOr<std::string> checkpointFingerprint(const std::string &checkpointDir,
                                            std::optional<uint64_t> syntheticSeed) {
  if (syntheticSeed) {
    const std::string configPath = checkpointDir + "/config.json";
    auto config = llvm::MemoryBuffer::getFile(configPath, /*IsText=*/true);
    if (!config)
      return Status::error(configPath + ": cannot read: " + config.getError().message());
    cache::KeyBuilder key;
    key.add("record", "hybrid synthetic checkpoint fingerprint v1");
    key.add("config", (*config)->getBuffer().str());
    key.add("seed", *syntheticSeed);
    return key.finish().hex();
  }
  HYBRID_ASSIGN_OR_RETURN(std::unique_ptr<import::Checkpoint> checkpoint,
                          import::Checkpoint::open(checkpointDir));
  cache::KeyBuilder key;
  key.add("record", "hybrid checkpoint fingerprint v1");
  key.add("config", readSmallFile(checkpoint->configPath()));
  std::set<std::string> shards;
  for (const auto &[name, tensor] : checkpoint->tensors()) {
    key.add("tensor", name);
    key.add("dtype", std::string(safetensors::dtypeName(tensor.info->dtype)));
    for (int64_t dim : tensor.info->shape)
      key.add("dim", dim);
    key.add("begin", tensor.info->begin);
    shards.insert(tensor.shard->path());
  }
  for (const std::string &shard : shards) {
    llvm::sys::fs::file_status status;
    if (std::error_code error = llvm::sys::fs::status(shard, status))
      return Status::error(shard + ": cannot stat: " + error.message());
    key.add("shard", llvm::sys::path::filename(shard).str());
    key.add("size", static_cast<uint64_t>(status.getSize()));
    key.add("mtime_ns", static_cast<int64_t>(
                            status.getLastModificationTime().time_since_epoch().count()));
  }
  return key.finish().hex();
}

StatusOr<PackResult> packWeights(std::span<const WeightPlacement> placements,
                                 const std::string &checkpointDir,
                                 const std::string &archivePath,
                                 std::optional<uint64_t> syntheticSeed) {
  const ArchiveKey layoutKey = weightLayoutKey(placements);
  HYBRID_ASSIGN_OR_RETURN(std::string fingerprint,
                          checkpointFingerprint(checkpointDir, syntheticSeed));
  const std::string sourcePath = archivePath + ".source";
  const std::string source = "layout " + formatArchiveKey(layoutKey) + "\ncheckpoint " +
                             fingerprint + "\n";

  // Reuse an archive packed from the same checkpoint with the same layout, if it still opens.
  PackResult result;
  if (readSmallFile(sourcePath) == source) {
    StatusOr<WeightArchive> existing = WeightArchive::open(archivePath);
    if (existing && existing->key() == layoutKey) {
      result.reused = true;
      result.entries = existing->entries().size();
      result.bytes = existing->fileSize();
      return result;
    }
  }

  HYBRID_ASSIGN_OR_RETURN(std::unique_ptr<import::Checkpoint> checkpoint,
                          syntheticSeed
                              ? import::Checkpoint::openSynthetic(checkpointDir, *syntheticSeed)
                              : import::Checkpoint::open(checkpointDir));
  HYBRID_ASSIGN_OR_RETURN(WeightArchiveWriter writer,
                          WeightArchiveWriter::create(archivePath, layoutKey));
  for (const WeightPlacement &weight : placements) {
    const import::CheckpointTensor *tensor = checkpoint->find(weight.name);
    if (!tensor)
      return Status::error(checkpointDir + ": tensor '" + weight.name +
                           "' the plan needs is not in the checkpoint");
    if (!weight.slice.empty() && tensor->synthetic) {
      // One rank's part of a tensor that exists nowhere: its descriptor names the window of the
      // seeded tensor, and the runtime generates only that.
      HYBRID_ASSIGN_OR_RETURN(SliceGeometry slice,
                              sliceGeometry(weight, tensor->info->shape,
                                            checkpoint->pathOf(*tensor)));
      HYBRID_RETURN_IF_ERROR(addSyntheticWeight(writer, weight, *checkpoint->syntheticSpec(),
                                                *tensor->synthetic, slice, tensor->info->shape));
      ++result.entries;
      continue;
    }
    if (!weight.slice.empty()) {
      // One rank's part of the tensor, cut here so each rank's archive holds only what it reads.
      HYBRID_ASSIGN_OR_RETURN(std::vector<std::byte> part,
                              cutSlice(weight, tensor->info->shape,
                                       tensor->shard->bytes(*tensor->info),
                                       checkpoint->pathOf(*tensor)));
      if (weight.nzTiled) {
        HYBRID_ASSIGN_OR_RETURN(TiledWeight tiled, retile(weight, part));
        HYBRID_RETURN_IF_ERROR(writer.add(weight.name, weight.dtype, tiled.shape, tiled.bytes));
      } else {
        HYBRID_RETURN_IF_ERROR(writer.add(weight.name, weight.dtype, weight.shape, part));
      }
      ++result.entries;
      continue;
    }
    if (weight.shape != tensor->info->shape)
      return Status::error(checkpoint->pathOf(*tensor) + ": tensor '" + weight.name +
                           "' does not match the plan's shape");
    if (tensor->synthetic) {
      HYBRID_RETURN_IF_ERROR(addSyntheticWeight(writer, weight, *checkpoint->syntheticSpec(),
                                                *tensor->synthetic, std::nullopt,
                                                tensor->info->shape));
      ++result.entries;
      continue;
    }
    std::span<const std::byte> data = tensor->shard->bytes(*tensor->info);
    if (!weight.nzTiled) {
      if (weight.size != data.size())
        return Status::error(tensor->shard->path() + ": tensor '" + weight.name +
                             "' does not match the plan's size");
      HYBRID_RETURN_IF_ERROR(writer.add(weight.name, weight.dtype, weight.shape, data));
    } else {
      // Re-tiled once, here; the runtime reads the tiles as stored.
      HYBRID_ASSIGN_OR_RETURN(TiledWeight tiled, retile(weight, data));
      HYBRID_RETURN_IF_ERROR(writer.add(weight.name, weight.dtype, tiled.shape, tiled.bytes));
    }
    ++result.entries;
  }
  HYBRID_RETURN_IF_ERROR(writer.finish());

  std::error_code error;
  llvm::raw_fd_ostream sourceFile(sourcePath, error);
  if (error)
    return Status::error(sourcePath + ": cannot write: " + error.message());
  sourceFile << source;
  llvm::sys::fs::file_status status;
  if (!llvm::sys::fs::status(archivePath, status))
    result.bytes = status.getSize();
  return result;
}

} // namespace hybrid::target
