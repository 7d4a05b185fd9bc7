#include "hybrid/kernels/KernelTuning.h"

#include <cstdio>

namespace hybrid::kernels::tuning {
namespace kc = hybrid::kernels::cuda;

namespace {

// The hashes of each family's kernel sources (kernels/CMakeLists.txt); "unknown" where a build
// did not define them (a tuned entry then matches any build, as before revisions existed).
#ifndef HYBRID_TUNING_REVISION_DSA_INDEXER
#define HYBRID_TUNING_REVISION_DSA_INDEXER "unknown"
#endif
#ifndef HYBRID_TUNING_REVISION_SPARSE_MLA
#define HYBRID_TUNING_REVISION_SPARSE_MLA "unknown"
#endif
#ifndef HYBRID_TUNING_REVISION_MOE
#define HYBRID_TUNING_REVISION_MOE "unknown"
#endif
#ifndef HYBRID_TUNING_REVISION_KDA_DECODE
#define HYBRID_TUNING_REVISION_KDA_DECODE "unknown"
#endif

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
  kernel.revision = HYBRID_TUNING_REVISION_DSA_INDEXER;
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
  kernel.revision = HYBRID_TUNING_REVISION_SPARSE_MLA;
  kernel.parameters = {{.name = "splits",
                        .values = {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128},
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
    const int32_t rows = static_cast<int32_t>(shape.at("rows"));
    const int64_t allowed =
        kc::sparseMlaMaxSplitsForRows(static_cast<int32_t>(shape.at("top_k")), rows);
    if (splits > allowed)
      return "splits " + std::to_string(splits) + " > the " + std::to_string(allowed) +
             " a launch of " + std::to_string(rows) + " rows takes";
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

// The per-token threshold's values: 0 the default, then the thresholds worth trying.
const std::vector<int64_t> kMoeThresholds = {0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512};

// The (token, expert) pairs of the launches in a MoE bucket: tokens in (bucket / 2, bucket].
int64_t moeFewestPairs(const ShapeBucket &shape) {
  const int64_t tokens = shape.at("tokens");
  return (tokens <= 1 ? 1 : tokens / 2 + 1) * shape.at("top_k");
}
int64_t moeMostPairs(const ShapeBucket &shape) { return shape.at("tokens") * shape.at("top_k"); }

// What a threshold runs over a bucket's launches: every one per token, every one grouped, or
// some each way.
enum class MoeForms { PerToken, Grouped, Both };
MoeForms moeForms(int64_t threshold, const ShapeBucket &shape) {
  if (threshold >= moeMostPairs(shape))
    return MoeForms::PerToken;
  if (threshold < moeFewestPairs(shape))
    return MoeForms::Grouped;
  return MoeForms::Both;
}
const char *moeFormsName(MoeForms forms) {
  return forms == MoeForms::PerToken ? "per token" : forms == MoeForms::Grouped ? "grouped" : "both";
}

TunableKernel makeMoeExperts() {
  TunableKernel kernel;
  kernel.name = std::string(kMoeExperts);
  kernel.revision = HYBRID_TUNING_REVISION_MOE;
  kernel.parameters = {
      {.name = "per_token_max_pairs", .values = kMoeThresholds, .defaultValue = 0}};
  kernel.constraint = [](const TuningConfig &config,
                         const ShapeBucket &shape) -> std::optional<std::string> {
    const int64_t threshold = config.at("per_token_max_pairs");
    if (threshold == 0)
      return std::nullopt;
    const std::string name = "per_token_max_pairs " + std::to_string(threshold);
    if (!kc::moeGroupedShape(static_cast<kc::WeightType>(shape.at("weight_type")),
                             shape.at("hidden"), shape.at("intermediate")))
      return name + ": only the per-token form runs here (the grouped form takes bf16 experts, "
                    "hidden and intermediate multiples of " +
             std::to_string(kc::kMoeGroupedTileK) + ")";
    if (threshold > kc::kMoeTunedMaxPairs)
      return name + " > " + std::to_string(kc::kMoeTunedMaxPairs) +
             ", the most pairs the per-token workspace is sized for";
    const std::string pairs = std::to_string(moeFewestPairs(shape)) + ".." +
                              std::to_string(moeMostPairs(shape)) + " pairs";
    const MoeForms forms = moeForms(threshold, shape);
    if (forms == MoeForms::Both)
      return name + " splits the bucket's launches of " + pairs + " between the forms";
    if (forms == moeForms(kc::kMoePerTokenMaxPairs, shape))
      return name + " runs the default's form (" + moeFormsName(forms) + ") at " + pairs;
    // One threshold of each form is measured: the smallest that runs every launch per token,
    // the largest that groups every launch.
    int64_t chosen = 0;
    for (int64_t value : kMoeThresholds)
      if (value > 0 && value <= kc::kMoeTunedMaxPairs && moeForms(value, shape) == forms &&
          (chosen == 0 || forms == MoeForms::Grouped))
        chosen = value;
    if (chosen != threshold)
      return name + " launches as per_token_max_pairs " + std::to_string(chosen) + " (" +
             moeFormsName(forms) + ") at " + pairs;
    return std::nullopt;
  };
  return kernel;
}

TunableKernel makeKdaDecode() {
  TunableKernel kernel;
  kernel.name = std::string(kKdaDecode);
  kernel.revision = HYBRID_TUNING_REVISION_KDA_DECODE;
  kernel.parameters = {{.name = "path", .values = {0, 1, 2}, .defaultValue = 0}};
  kernel.constraint = [](const TuningConfig &config,
                         const ShapeBucket &shape) -> std::optional<std::string> {
    const int64_t path = config.at("path");
    if (path == 0)
      return std::nullopt;
    const int64_t headDim = shape.at("head_dim"), heads = shape.at("heads");
    if (headDim != 64 && headDim != 128)
      return "the decode kernels take head_dim 64 or 128, not " + std::to_string(headDim);
    // The default's choice at the bucket's smallest and largest batch: a path it takes at both
    // is not measured twice.
    const int64_t most = shape.at("batch"), fewest = most <= 1 ? 1 : most / 2 + 1;
    const bool split = path == 2;
    if (kc::kdaDecodeUsesSplit(kc::KdaDecodePath::Auto, fewest, heads, headDim) == split &&
        kc::kdaDecodeUsesSplit(kc::KdaDecodePath::Auto, most, heads, headDim) == split)
      return "path " + std::to_string(path) + (split ? " (split)" : " (fused)") +
             " is the default's at " + std::to_string(fewest) + ".." + std::to_string(most) +
             " x " + std::to_string(heads) + " (sequence, head) pairs";
    return std::nullopt;
  };
  return kernel;
}

} // namespace

const TunableKernel &moeExpertsKernel() {
  static const TunableKernel kernel = makeMoeExperts();
  return kernel;
}

const TunableKernel &kdaDecodeKernel() {
  static const TunableKernel kernel = makeKdaDecode();
  return kernel;
}

const TunableKernel &indexerScoresKernel() {
  static const TunableKernel kernel = makeIndexerScores();
  return kernel;
}

const TunableKernel &sparseMlaDecodeKernel() {
  static const TunableKernel kernel = makeSparseMlaDecode();
  return kernel;
}

std::vector<const TunableKernel *> tunableKernels() {
  return {&indexerScoresKernel(), &sparseMlaDecodeKernel(), &moeExpertsKernel(),
          &kdaDecodeKernel()};
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

ShapeBucket moeExpertsShape(const kc::MoeExpertsParams &p) {
  return {{"tokens", cache::bucketSize(p.tokens)},
          {"top_k", p.topK},
          {"experts", p.experts},
          {"hidden", p.hidden},
          {"intermediate", p.intermediate},
          {"weight_type", static_cast<int64_t>(p.type)}};
}

ShapeBucket kdaDecodeShape(const kc::KdaDecodeParams &p) {
  return {{"batch", cache::bucketSize(p.batch)},
          {"heads", p.heads},
          {"head_dim", p.headDim},
          {"state_type", static_cast<int64_t>(p.stateType)}};
}

std::vector<std::string> shapeDimensions(const TunableKernel &kernel) {
  if (kernel.name == kIndexerScores)
    return {"rows", "heads", "head_dim", "max_keys", "key_type", "score_form"};
  if (kernel.name == kSparseMlaDecode)
    return {"rows", "heads", "latent_dim", "rope_dim", "top_k", "causal"};
  if (kernel.name == kMoeExperts)
    return {"tokens", "top_k", "experts", "hidden", "intermediate", "weight_type"};
  if (kernel.name == kKdaDecode)
    return {"batch", "heads", "head_dim", "state_type"};
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

void applyConfig(const TuningConfig &config, kc::MoeExpertsParams &params) {
  if (auto found = config.find("per_token_max_pairs"); found != config.end())
    params.perTokenMaxPairs = static_cast<int32_t>(found->second);
}

void applyConfig(const TuningConfig &config, kc::KdaDecodeParams &params) {
  if (auto found = config.find("path"); found != config.end())
    params.path = static_cast<kc::KdaDecodePath>(found->second);
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
