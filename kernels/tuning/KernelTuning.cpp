#include "hybrid/kernels/KernelTuning.h"

#include <cstdio>

namespace hybrid::kernels::tuning {
namespace kc = hybrid::kernels::cuda;

namespace {

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Which score kernel an unfused launch runs, as launchIndexerTopK picks it: 0 CUDA cores (fp32
// keys, not tiled), 1 bf16 mma.sync, 2 FP8 mma.sync, 3 warpgroup MMAs.
int64_t indexerScoreForm(const kc::IndexerParams &p) {
  using Kind = kc::IndexerParams::ScoreKernel;
  if (p.keyType == kc::IndexKeyType::F32)
    return 0;
  const bool mxfp8Tiles = p.mxfp8Queries && p.pageTokens % kc::kIndexerTileKeys == 0;
  if (mxfp8Tiles && (p.scoreKernel == Kind::Auto || p.scoreKernel == Kind::Warpgroup))
    return 3;
  if (mxfp8Tiles && p.scoreKernel == Kind::Fp8)
    return 2;
  return 1;
}

TunableKernel makeIndexerScores() {
  TunableKernel kernel;
  kernel.name = std::string(kIndexerScores);
  kernel.parameters = {{.name = "tiles_per_block",
                        .values = {0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512},
                        .defaultValue = 0}};
  kernel.constraint = [](const TuningConfig &config,
                         const ShapeBucket &shape) -> std::optional<std::string> {
    const int64_t perBlock = config.at("tiles_per_block");
    if (perBlock == 0)
      return std::nullopt;
    if (shape.at("score_form") == 0)
      return "fp32 keys are scored on CUDA cores, which take no tiles_per_block";
    const int64_t tiles = ceilDiv(shape.at("max_keys"), kc::kIndexerTileKeys);
    if (perBlock > tiles)
      return "tiles_per_block " + std::to_string(perBlock) + " > the row's " +
             std::to_string(tiles) + " tiles";
    if (ceilDiv(tiles, perBlock) > 65535)
      return "tiles_per_block " + std::to_string(perBlock) + " needs " +
             std::to_string(ceilDiv(tiles, perBlock)) + " blocks a row, the grid holds 65535";
    return std::nullopt;
  };
  return kernel;
}

TunableKernel makeSparseMlaDecode() {
  TunableKernel kernel;
  kernel.name = std::string(kSparseMlaDecode);
  kernel.parameters = {{.name = "splits",
                        .values = {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32},
                        .defaultValue = 0}};
  kernel.constraint = [](const TuningConfig &config,
                         const ShapeBucket &shape) -> std::optional<std::string> {
    const int64_t splits = config.at("splits");
    if (splits == 0)
      return std::nullopt;
    const int64_t tileKeys = kc::sparseMlaTileKeys(static_cast<int32_t>(shape.at("heads")));
    const int64_t tiles = ceilDiv(shape.at("top_k"), tileKeys);
    const int64_t maxTiles = kc::kSparseMlaMaxPositionsPerBlock / tileKeys;
    if (splits > tiles)
      return "splits " + std::to_string(splits) + " > the row's " + std::to_string(tiles) +
             " tiles of " + std::to_string(tileKeys) + " positions";
    const int64_t perSplit = ceilDiv(tiles, splits);
    if (perSplit > maxTiles)
      return "splits " + std::to_string(splits) + " leave " + std::to_string(perSplit * tileKeys) +
             " positions a block, at most " +
             std::to_string(kc::kSparseMlaMaxPositionsPerBlock) + " fit";
    if (const int64_t used = ceilDiv(tiles, perSplit); used != splits)
      return "splits " + std::to_string(splits) + " launch as splits " + std::to_string(used) +
             " (" + std::to_string(perSplit) + " tiles each)";
    return std::nullopt;
  };
  return kernel;
}

} // namespace

const TunableKernel &indexerScoresKernel() {
  static const TunableKernel kernel = makeIndexerScores();
  return kernel;
}

const TunableKernel &sparseMlaDecodeKernel() {
  static const TunableKernel kernel = makeSparseMlaDecode();
  return kernel;
}

std::vector<const TunableKernel *> tunableKernels() {
  return {&indexerScoresKernel(), &sparseMlaDecodeKernel()};
}

const TunableKernel *findTunableKernel(std::string_view name) {
  for (const TunableKernel *kernel : tunableKernels())
    if (kernel->name == name)
      return kernel;
  return nullptr;
}

ShapeBucket indexerScoresShape(const kc::IndexerParams &p) {
  return {{"rows", cache::bucketSize(p.rows)},
          {"heads", p.heads},
          {"head_dim", p.headDim},
          {"max_keys", cache::bucketSize(p.maxKeys)},
          {"key_type", static_cast<int64_t>(p.keyType)},
          {"score_form", indexerScoreForm(p)}};
}

ShapeBucket sparseMlaDecodeShape(const kc::SparseMlaDecodeParams &p) {
  return {{"rows", cache::bucketSize(p.rows)},
          {"heads", p.heads},
          {"latent_dim", p.latentDim},
          {"rope_dim", p.ropeDim},
          {"top_k", cache::bucketSize(p.topK)},
          {"causal", p.indices ? 0 : 1}};
}

std::vector<std::string> shapeDimensions(const TunableKernel &kernel) {
  if (kernel.name == kIndexerScores)
    return {"rows", "heads", "head_dim", "max_keys", "key_type", "score_form"};
  if (kernel.name == kSparseMlaDecode)
    return {"rows", "heads", "latent_dim", "rope_dim", "top_k", "causal"};
  return {};
}

void applyConfig(const TuningConfig &config, kc::IndexerParams &params) {
  if (auto found = config.find("tiles_per_block"); found != config.end())
    params.tilesPerBlock = static_cast<int32_t>(found->second);
}

void applyConfig(const TuningConfig &config, kc::SparseMlaDecodeParams &params) {
  if (auto found = config.find("splits"); found != config.end())
    params.splits = static_cast<int32_t>(found->second);
}

TuningTable::TuningTable(cache::CacheStore store, cache::TuningDevice device)
    : store_(std::move(store)), device_(std::move(device)) {}

std::optional<TuningConfig> TuningTable::lookup(const TunableKernel &kernel,
                                                const ShapeBucket &shape) {
  if (!store_)
    return std::nullopt;
  std::lock_guard lock(mutex_);
  for (const Entry &entry : entries_)
    if (entry.kernel == kernel.name && entry.shape == shape)
      return entry.config;
  Entry entry{.kernel = kernel.name, .shape = shape, .config = std::nullopt, .note = ""};
  std::string why;
  auto found = cache::lookupTuning(*store_, cache::tuningKey(kernel, shape, device_), kernel, &why);
  if (!found.isOk()) {
    entry.note = "defaults: the tuning cache cannot be read: " + found.status().message();
  } else if (!found->has_value()) {
    entry.note = why.empty() ? "defaults: not tuned" : "defaults: " + why;
  } else {
    // A stored winner the constraint no longer admits at this bucket (the constraint changed
    // since it was measured) is not run.
    if (kernel.constraint)
      if (auto reason = kernel.constraint((*found)->config, shape)) {
        entry.note = "defaults: the stored configuration is no longer valid: " + *reason;
        entries_.push_back(entry);
        return std::nullopt;
      }
    entry.config = (*found)->config;
    char timing[96];
    std::snprintf(timing, sizeof timing, "tuned: %.2f us against %.2f us by default",
                  (*found)->microseconds, (*found)->defaultMicroseconds);
    entry.note = timing;
  }
  entries_.push_back(entry);
  return entry.config;
}

std::string TuningTable::report() const {
  std::lock_guard lock(mutex_);
  std::string text;
  for (const Entry &entry : entries_)
    text += entry.kernel + " " + formatShape(entry.shape) + ": " +
            (entry.config ? formatConfig(*entry.config) + " (" + entry.note + ")" : entry.note) +
            "\n";
  return text;
}

std::string formatConfig(const TuningConfig &config) {
  std::string text;
  for (const auto &[name, value] : config)
    text += (text.empty() ? "" : ",") + name + "=" + std::to_string(value);
  return text;
}

std::string formatShape(const ShapeBucket &shape) { return formatConfig(shape); }

} // namespace hybrid::kernels::tuning
