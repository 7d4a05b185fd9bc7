// Synthetic checkpoint generator: plans the tensor list of a spec, cuts it into shards, then
// generates and writes one shard at a time into a staging folder that is renamed into place.
#include "hybrid/runtime/SyntheticCheckpoint.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numbers>
#include <span>
#include <thread>
#include <unistd.h>
#include <utility>

namespace hybrid::synth {
namespace {

namespace fs = std::filesystem;
using safetensors::DType;
using Json = nlohmann::json; // sorted keys, like the configs transformers writes

constexpr int64_t kFp8BlockSize = 128;   // DeepSeek's weight_block_size [128, 128]
constexpr float kFp8E4M3Max = 448.0f;    // largest finite E4M3 "fn" value
constexpr double kNormWeightNoise = 0.1; // norm weights are 1 + N(0, this)
constexpr const char *kScaleSuffix = "_scale_inv";
// KDA's decay initialisation (fla): A = U(1, 16), dt log-uniform in [1e-3, 1e-1].
constexpr double kDecayMin = 1.0, kDecayMax = 16.0;
constexpr double kDecayTimeMin = 1e-3, kDecayTimeMax = 1e-1;

//===------------------------------------------------------------------------------------------===//
// Deterministic random numbers.
//===------------------------------------------------------------------------------------------===//

// splitmix64 (Steele, Lea, Flood 2014) in counter form: output n of the stream keyed `key` is
// mix(key + (n+1) * golden gamma), so any position is computable directly. Tensors are therefore
// generated in independent pieces on many threads with the same result as one sequential pass.
// Integer arithmetic only, unlike std::normal_distribution, whose output differs between
// standard libraries.
using kernels::splitMix64At;

// Uniform in the open interval (0, 1), so log() below never sees 0.
double unitInterval(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; }

// FNV-1a: each tensor gets its own stream, independent of the order tensors are generated in.
uint64_t hashName(std::string_view name) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (char c : name) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

uint64_t tensorKey(uint64_t seed, std::string_view name) {
  return splitMix64At(seed, 0) ^ hashName(name);
}

//===------------------------------------------------------------------------------------------===//
// The tensor plan.
//===------------------------------------------------------------------------------------------===//

struct PlannedTensor {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::BF16; // F8_E4M3 implies a block scale tensor written right after it
  ValueKind kind = ValueKind::Weight;

  bool isFp8() const { return dtype == DType::F8_E4M3; }
  int64_t numElements() const {
    int64_t count = 1;
    for (int64_t dim : shape)
      count *= dim;
    return count;
  }
  std::vector<int64_t> scaleShape() const {
    return {(shape[0] + kFp8BlockSize - 1) / kFp8BlockSize,
            (shape[1] + kFp8BlockSize - 1) / kFp8BlockSize};
  }
  uint64_t dataBytes() const {
    return static_cast<uint64_t>(numElements()) * safetensors::dtypeSize(dtype);
  }
  uint64_t scaleBytes() const {
    if (!isFp8())
      return 0;
    std::vector<int64_t> grid = scaleShape();
    return static_cast<uint64_t>(grid[0] * grid[1]) * sizeof(float);
  }
  // A weight and its scale always share a shard, so the pair is generated together.
  uint64_t totalBytes() const { return dataBytes() + scaleBytes(); }
};

// Lists the tensors of a checkpoint in module order, the order of the golden checkpoints.
class TensorPlanner {
public:
  explicit TensorPlanner(const SyntheticSpec &spec) : spec_(spec) {}

  std::vector<PlannedTensor> plan() {
    const int64_t d = spec_.hiddenSize;
    weight("model.embed_tokens.weight", {spec_.vocabSize, d});
    for (int64_t layer = 0; layer < spec_.numLayers; ++layer)
      addLayer(layer);
    for (int64_t i = 0; i < spec_.numNextnPredictLayers; ++i)
      addMtpLayer(spec_.numLayers + i);
    if (spec_.attnResBlockSize) {
      norm("model.output_attn_res_norm.weight", d);
      weight("model.output_attn_res_proj.weight", {1, d});
    }
    norm("model.norm.weight", d);
    weight("lm_head.weight", {spec_.vocabSize, d});
    return std::move(tensors_);
  }

private:
  enum class Fp8 { Allowed, Never };

  void add(std::string name, std::vector<int64_t> shape, DType dtype, ValueKind kind) {
    tensors_.push_back({std::move(name), std::move(shape), dtype, kind});
  }
  void weight(std::string name, std::vector<int64_t> shape) {
    add(std::move(name), std::move(shape), DType::BF16, ValueKind::Weight);
  }
  // An nn.Linear weight [out, in]; DeepSeek ships the big ones as block-scaled FP8.
  void linear(std::string name, int64_t out, int64_t in, Fp8 fp8 = Fp8::Allowed) {
    DType dtype = spec_.fp8Weights && fp8 == Fp8::Allowed ? DType::F8_E4M3 : DType::BF16;
    add(std::move(name), {out, in}, dtype, ValueKind::Weight);
  }
  void norm(std::string name, int64_t size) {
    add(std::move(name), {size}, DType::BF16, ValueKind::NormWeight);
  }

  void addLayer(int64_t layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".";
    const int64_t d = spec_.hiddenSize;
    const std::string mixer = spec_.mixerKind(layer);
    if (mixer == "kda")
      addKda(prefix + "self_attn.");
    else
      addMla(prefix + "self_attn.");
    if (mixer == "mla_dsa")
      addIndexer(prefix + "self_attn.indexer.");

    if (spec_.isMoeLayer(layer))
      addMoe(prefix + (spec_.isKimi() ? "block_sparse_moe." : "mlp."));
    else
      addSwiGlu(prefix + "mlp.", spec_.intermediateSize);

    norm(prefix + "input_layernorm.weight", d);
    norm(prefix + "post_attention_layernorm.weight", d);
    if (spec_.attnResBlockSize) {
      norm(prefix + "self_attention_res_norm.weight", d);
      weight(prefix + "self_attention_res_proj.weight", {1, d});
      norm(prefix + "mlp_res_norm.weight", d);
      weight(prefix + "mlp_res_proj.weight", {1, d});
    }
  }

  // DeepSeek-V3's multi-token-prediction layer: the decoder block of `layer` plus its input
  // projection and output head, in the published checkpoint's names.
  void addMtpLayer(int64_t layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".";
    const int64_t d = spec_.hiddenSize;
    addLayer(layer);
    weight(prefix + "embed_tokens.weight", {spec_.vocabSize, d});
    norm(prefix + "enorm.weight", d);
    norm(prefix + "hnorm.weight", d);
    linear(prefix + "eh_proj.weight", d, 2 * d);
    norm(prefix + "shared_head.norm.weight", d);
    weight(prefix + "shared_head.head.weight", {spec_.vocabSize, d});
  }

  void addKda(const std::string &prefix) {
    const int64_t d = spec_.hiddenSize;
    const int64_t heads = spec_.kdaNumHeads;
    const int64_t headDim = spec_.kdaHeadDim;
    const int64_t projected = heads * headDim;
    for (const char *name : {"q_proj", "k_proj", "v_proj"})
      linear(prefix + name + ".weight", projected, d);
    for (const char *name : {"q_conv1d", "k_conv1d", "v_conv1d"})
      weight(prefix + name + ".weight", {projected, 1, spec_.shortConvKernelSize});
    add(prefix + "dt_bias", {projected}, DType::F32, ValueKind::DecayTimeBias);
    add(prefix + "A_log", {1, 1, heads, 1}, DType::F32, ValueKind::DecayLog);
    linear(prefix + "f_a_proj.weight", headDim, d);
    linear(prefix + "f_b_proj.weight", projected, headDim);
    linear(prefix + "b_proj.weight", heads, d);
    if (spec_.kdaFullRankOutputGate) {
      linear(prefix + "g_proj.weight", projected, d);
    } else {
      linear(prefix + "g_a_proj.weight", headDim, d);
      linear(prefix + "g_b_proj.weight", projected, headDim);
    }
    norm(prefix + "o_norm.weight", headDim);
    linear(prefix + "o_proj.weight", d, projected);
  }

  void addMla(const std::string &prefix) {
    const int64_t d = spec_.hiddenSize;
    const int64_t heads = spec_.numAttentionHeads;
    const int64_t qkHeadDim = spec_.qkNopeHeadDim + spec_.qkRopeHeadDim;
    if (spec_.qLoraRank) {
      linear(prefix + "q_a_proj.weight", *spec_.qLoraRank, d);
      norm(prefix + "q_a_layernorm.weight", *spec_.qLoraRank);
      linear(prefix + "q_b_proj.weight", heads * qkHeadDim, *spec_.qLoraRank);
    } else {
      linear(prefix + "q_proj.weight", heads * qkHeadDim, d);
    }
    linear(prefix + "kv_a_proj_with_mqa.weight", spec_.kvLoraRank + spec_.qkRopeHeadDim, d);
    norm(prefix + "kv_a_layernorm.weight", spec_.kvLoraRank);
    linear(prefix + "kv_b_proj.weight", heads * (spec_.qkNopeHeadDim + spec_.vHeadDim),
           spec_.kvLoraRank);
    if (spec_.mlaOutputGate)
      linear(prefix + "g_proj.weight", heads * spec_.vHeadDim, d);
    linear(prefix + "o_proj.weight", d, heads * spec_.vHeadDim);
  }

  void addIndexer(const std::string &prefix) {
    const int64_t d = spec_.hiddenSize;
    linear(prefix + "wq_b.weight", spec_.indexNumHeads * spec_.indexHeadDim,
           spec_.qLoraRank.value_or(0)); // validate() requires q_lora_rank with an indexer
    linear(prefix + "wk.weight", spec_.indexHeadDim, d);
    norm(prefix + "k_norm.weight", spec_.indexHeadDim);
    add(prefix + "k_norm.bias", {spec_.indexHeadDim}, DType::BF16, ValueKind::Bias);
    // Stays bf16 in the published checkpoint (the reference keeps it in fp32 at runtime).
    linear(prefix + "weights_proj.weight", spec_.indexNumHeads, d, Fp8::Never);
  }

  void addSwiGlu(const std::string &prefix, int64_t intermediate) {
    linear(prefix + "gate_proj.weight", intermediate, spec_.hiddenSize);
    linear(prefix + "up_proj.weight", intermediate, spec_.hiddenSize);
    linear(prefix + "down_proj.weight", spec_.hiddenSize, intermediate);
  }

  void addMoe(const std::string &prefix) {
    const int64_t d = spec_.hiddenSize;
    const int64_t inter = spec_.moeIntermediateSize;
    // Kimi keeps Mixtral's w1 (gate) / w3 (up) / w2 (down) names for routed experts.
    const bool kimi = spec_.isKimi();
    auto expertPrefix = [&](int64_t expert) {
      return prefix + "experts." + std::to_string(expert) + ".";
    };
    // All gate/up pairs, then all down projections: the golden checkpoints' order (transformers
    // holds the experts as one fused gate_up tensor and one down tensor).
    // Latent MoE: the routed experts read and write the latent width.
    const int64_t expertWidth = spec_.latentMoeSize.value_or(d);
    for (int64_t expert = 0; expert < spec_.numExperts; ++expert) {
      linear(expertPrefix(expert) + (kimi ? "w1" : "gate_proj") + ".weight", inter, expertWidth);
      linear(expertPrefix(expert) + (kimi ? "w3" : "up_proj") + ".weight", inter, expertWidth);
    }
    for (int64_t expert = 0; expert < spec_.numExperts; ++expert)
      linear(expertPrefix(expert) + (kimi ? "w2" : "down_proj") + ".weight", expertWidth, inter);
    linear(prefix + "gate.weight", spec_.numExperts, d, Fp8::Never);
    add(prefix + "gate.e_score_correction_bias", {spec_.numExperts}, DType::F32, ValueKind::Bias);
    if (spec_.latentMoeSize) {
      linear(prefix + "routed_expert_down_proj.weight", expertWidth, d);
      linear(prefix + "routed_expert_up_proj.weight", d, expertWidth);
      if (spec_.latentMoeNorm)
        norm(prefix + "routed_expert_norm.weight", expertWidth);
    }
    if (spec_.numSharedExperts > 0)
      addSwiGlu(prefix + "shared_experts.", inter * spec_.numSharedExperts);
  }

  const SyntheticSpec &spec_;
  std::vector<PlannedTensor> tensors_;
};

// Consecutive tensors fill a shard until the next would pass the limit.
std::vector<std::vector<size_t>> assignShards(const std::vector<PlannedTensor> &tensors,
                                              uint64_t maxShardBytes) {
  std::vector<std::vector<size_t>> shards;
  uint64_t currentBytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    uint64_t bytes = tensors[i].totalBytes();
    if (shards.empty() || (!shards.back().empty() && currentBytes + bytes > maxShardBytes)) {
      shards.emplace_back();
      currentBytes = 0;
    }
    shards.back().push_back(i);
    currentBytes += bytes;
  }
  return shards;
}

std::string shardFileName(size_t index, size_t count) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

//===------------------------------------------------------------------------------------------===//
// Value generation.
//===------------------------------------------------------------------------------------------===//

// The values of one tensor in row-major order, from any starting element. Element e of a normal
// tensor is the cosine (even e) or sine (odd e) half of the Box-Muller pair e/2, drawn from
// stream positions 2*(e/2) and 2*(e/2)+1; a uniform tensor uses position e. log/cos/sin may
// differ in the last bit between math libraries; that changes a stored value only when the sample
// lies within a double ulp of a rounding boundary of the stored type (about 2^-44 per bf16 value,
// 2^-29 per fp32 value, and only a few thousand values are fp32).
class ValueStream {
public:
  ValueStream(const SyntheticSpec &spec, const PlannedTensor &tensor, int64_t firstElement)
      : key_(tensorKey(spec.seed, tensor.name)), kind_(tensor.kind), std_(spec.weightStd),
        element_(firstElement) {}

  double next() {
    switch (kind_) {
    case ValueKind::Weight:
    case ValueKind::Bias:
      return std_ * standardNormal();
    case ValueKind::NormWeight:
      return 1.0 + kNormWeightNoise * standardNormal();
    case ValueKind::DecayLog:
      return std::log(kDecayMin + (kDecayMax - kDecayMin) * uniform());
    case ValueKind::BlockScale: // written by fillFp8Rows, never drawn
      return 0.0;
    case ValueKind::DecayTimeBias: {
      const double logMin = std::log(kDecayTimeMin), logMax = std::log(kDecayTimeMax);
      double dt = std::max(std::exp(logMin + (logMax - logMin) * uniform()), 1e-4);
      return dt + std::log(-std::expm1(-dt)); // inverse softplus
    }
    }
    return 0.0;
  }

private:
  double uniform() { return unitInterval(splitMix64At(key_, element_++)); }

  double standardNormal() {
    const int64_t pair = element_ / 2;
    if (pair != cachedPair_) {
      const uint64_t position = 2 * static_cast<uint64_t>(pair);
      const double radius = std::sqrt(-2.0 * std::log(unitInterval(splitMix64At(key_, position))));
      const double angle = 2.0 * std::numbers::pi * unitInterval(splitMix64At(key_, position + 1));
      pairCos_ = radius * std::cos(angle);
      pairSin_ = radius * std::sin(angle);
      cachedPair_ = pair;
    }
    return element_++ % 2 == 0 ? pairCos_ : pairSin_;
  }

  uint64_t key_;
  ValueKind kind_;
  double std_;
  int64_t element_;
  // Box-Muller yields pairs; the one of the current element is kept for its partner.
  int64_t cachedPair_ = -1;
  double pairCos_ = 0.0;
  double pairSin_ = 0.0;
};

float roundToBf16(double value) {
  return safetensors::bf16ToFloat(safetensors::floatToBf16(static_cast<float>(value)));
}

template <typename T> void storeAt(std::vector<std::byte> &bytes, int64_t index, T value) {
  std::memcpy(bytes.data() + index * static_cast<int64_t>(sizeof(T)), &value, sizeof(T));
}

struct GeneratedTensor {
  std::vector<std::byte> data;
  std::vector<std::byte> scales; // fp8 only
};

// A slice of one tensor that a worker generates on its own: elements [begin, end) in row-major
// order. Pieces of an fp8 tensor hold whole 128-row bands, since a block scale needs its block.
struct Piece {
  size_t tensor = 0; // index into the shard's tensors
  int64_t begin = 0;
  int64_t end = 0;
};

// Enough work to amortise the hand-out, small enough to spread one big tensor over all threads.
constexpr int64_t kPieceElements = int64_t{1} << 22;

void fillElements(const SyntheticSpec &spec, const PlannedTensor &tensor, const Piece &piece,
                  GeneratedTensor &out) {
  ValueStream values(spec, tensor, piece.begin);
  if (tensor.dtype == DType::F32) {
    for (int64_t i = piece.begin; i < piece.end; ++i)
      storeAt(out.data, i, static_cast<float>(values.next()));
  } else {
    for (int64_t i = piece.begin; i < piece.end; ++i)
      storeAt(out.data, i, safetensors::floatToBf16(static_cast<float>(values.next())));
  }
}

// Block-quantizes the rows of a piece of a [rows, cols] weight of random bf16 values: one fp32
// scale amax/448 per 128x128 block, codes rounded to nearest E4M3. One band of 128 rows exists in
// fp32 at a time.
void fillFp8Rows(const SyntheticSpec &spec, const PlannedTensor &tensor, const Piece &piece,
                 GeneratedTensor &out) {
  const int64_t rows = tensor.shape[0], cols = tensor.shape[1];
  const int64_t blockCols = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
  ValueStream values(spec, tensor, piece.begin);
  std::vector<float> band(static_cast<size_t>(std::min(rows, kFp8BlockSize) * cols));
  for (int64_t rowStart = piece.begin / cols; rowStart < piece.end / cols;
       rowStart += kFp8BlockSize) {
    const int64_t bandRows = std::min(kFp8BlockSize, rows - rowStart);
    for (int64_t i = 0; i < bandRows * cols; ++i)
      band[i] = roundToBf16(values.next());
    for (int64_t block = 0; block < blockCols; ++block) {
      const int64_t colStart = block * kFp8BlockSize;
      const int64_t colEnd = std::min(cols, colStart + kFp8BlockSize);
      float amax = 0.0f;
      for (int64_t r = 0; r < bandRows; ++r)
        for (int64_t c = colStart; c < colEnd; ++c)
          amax = std::max(amax, std::fabs(band[r * cols + c]));
      const float scale = amax > 0.0f ? amax / kFp8E4M3Max : 1.0f;
      storeAt(out.scales, (rowStart / kFp8BlockSize) * blockCols + block, scale);
      for (int64_t r = 0; r < bandRows; ++r)
        for (int64_t c = colStart; c < colEnd; ++c)
          storeAt(out.data, (rowStart + r) * cols + c, floatToF8E4M3(band[r * cols + c] / scale));
    }
  }
}

std::vector<Piece> splitIntoPieces(const std::vector<PlannedTensor> &tensors,
                                   const std::vector<size_t> &shard) {
  std::vector<Piece> pieces;
  for (size_t i = 0; i < shard.size(); ++i) {
    const PlannedTensor &tensor = tensors[shard[i]];
    const int64_t count = tensor.numElements();
    int64_t step = kPieceElements;
    if (tensor.isFp8()) {
      const int64_t bandElements = kFp8BlockSize * tensor.shape[1];
      step = std::max<int64_t>(1, kPieceElements / bandElements) * bandElements;
    }
    for (int64_t begin = 0; begin < count; begin += step)
      pieces.push_back({i, begin, std::min(count, begin + step)});
  }
  return pieces;
}

// Generates the tensors of one shard on `threads` workers, each taking the next piece. Pieces
// write disjoint bytes and every value depends only on its position, so the result does not
// depend on the scheduling.
Status generateShard(const SyntheticSpec &spec, const std::vector<PlannedTensor> &tensors,
                     const std::vector<size_t> &shard, int threads,
                     std::vector<GeneratedTensor> &generated) {
  generated.assign(shard.size(), {});
  for (size_t i = 0; i < shard.size(); ++i) {
    generated[i].data.resize(tensors[shard[i]].dataBytes());
    generated[i].scales.resize(tensors[shard[i]].scaleBytes());
  }
  const std::vector<Piece> pieces = splitIntoPieces(tensors, shard);

  std::atomic<size_t> nextPiece{0};
  std::mutex errorMutex;
  std::optional<std::string> firstError;
  auto work = [&] {
    for (size_t p = nextPiece++; p < pieces.size(); p = nextPiece++) {
      const Piece &piece = pieces[p];
      const PlannedTensor &tensor = tensors[shard[piece.tensor]];
      try {
        if (tensor.isFp8())
          fillFp8Rows(spec, tensor, piece, generated[piece.tensor]);
        else
          fillElements(spec, tensor, piece, generated[piece.tensor]);
      } catch (const std::exception &error) {
        std::lock_guard lock(errorMutex);
        if (!firstError)
          firstError = "tensor '" + tensor.name + "': " + error.what();
        nextPiece = pieces.size();
      }
    }
  };
  const size_t workers = std::min<size_t>(std::max(threads, 1), pieces.size());
  {
    std::vector<std::jthread> pool;
    for (size_t w = 1; w < workers; ++w)
      pool.emplace_back(work);
    work();
  }
  if (firstError)
    return Status::error(*firstError);
  return Status::ok();
}

//===------------------------------------------------------------------------------------------===//
// config.json and the index.
//===------------------------------------------------------------------------------------------===//

Json ropeScalingJson(const SyntheticSpec &spec) {
  if (!spec.ropeScaling)
    return nullptr;
  const YarnRopeScaling &yarn = *spec.ropeScaling;
  return {{"type", "yarn"},
          {"factor", yarn.factor},
          {"original_max_position_embeddings", yarn.originalMaxPositionEmbeddings},
          {"beta_fast", yarn.betaFast},
          {"beta_slow", yarn.betaSlow},
          {"mscale", yarn.mscale},
          {"mscale_all_dim", yarn.mscaleAllDim}};
}

// Fields both published configs spell the same way.
Json commonConfig(const SyntheticSpec &spec) {
  Json config = {
      {"model_type", spec.modelType},
      {"torch_dtype", "bfloat16"},
      {"vocab_size", spec.vocabSize},
      {"hidden_size", spec.hiddenSize},
      {"intermediate_size", spec.intermediateSize},
      {"moe_intermediate_size", spec.moeIntermediateSize},
      {"num_hidden_layers", spec.numLayers},
      {"num_nextn_predict_layers", spec.numNextnPredictLayers},
      {"num_attention_heads", spec.numAttentionHeads},
      {"num_key_value_heads", spec.numAttentionHeads},
      {"q_lora_rank", spec.qLoraRank ? Json(*spec.qLoraRank) : Json(nullptr)},
      {"kv_lora_rank", spec.kvLoraRank},
      {"qk_nope_head_dim", spec.qkNopeHeadDim},
      {"qk_rope_head_dim", spec.qkRopeHeadDim},
      {"v_head_dim", spec.vHeadDim},
      {"hidden_act", "silu"},
      {"rms_norm_eps", spec.rmsNormEps},
      {"rope_theta", spec.ropeTheta},
      {"rope_scaling", ropeScalingJson(spec)},
      {"first_k_dense_replace", spec.firstKDenseReplace},
      {"moe_layer_freq", spec.moeLayerFreq},
      {"routed_scaling_factor", spec.routedScalingFactor},
      {"topk_group", spec.topkGroup},
      {"tie_word_embeddings", false},
      {"use_cache", true},
      {"bos_token_id", spec.bosTokenId},
      {"eos_token_id", spec.eosTokenId},
  };
  if (spec.padTokenId)
    config["pad_token_id"] = *spec.padTokenId;
  return config;
}

// Kimi K3's feed-forward fields (SiTU, latent MoE), for kimi_linear and hybrid.
void addK3FeedForwardFields(const SyntheticSpec &spec, Json &config) {
  if (spec.situBeta) {
    config["hidden_act"] = "situ";
    config["activation_situ_beta"] = *spec.situBeta;
    if (spec.situLinearBeta)
      config["activation_situ_linear_beta"] = *spec.situLinearBeta;
  }
  if (spec.latentMoeSize) {
    config["routed_expert_hidden_size"] = *spec.latentMoeSize;
    config["latent_moe_use_norm"] = spec.latentMoeNorm;
  }
}

Json kimiConfig(const SyntheticSpec &spec) {
  Json config = commonConfig(spec);
  // The published config lists layers only through these 1-based lists.
  Json kdaLayers = Json::array(), fullAttnLayers = Json::array();
  for (int64_t layer = 0; layer < spec.numLayers; ++layer)
    (spec.isFullAttentionLayer(layer) ? fullAttnLayers : kdaLayers).push_back(layer + 1);
  config.update({
      {"architectures", Json::array({"KimiLinearForCausalLM"})},
      // hidden / heads as published; unused by KDA and MLA.
      {"head_dim", spec.numAttentionHeads > 0 ? spec.hiddenSize / spec.numAttentionHeads : 0},
      {"model_max_length", spec.maxPositionEmbeddings},
      {"mla_use_nope", spec.mlaUseNope},
      {"linear_attn_config",
       {{"kda_layers", kdaLayers},
        {"full_attn_layers", fullAttnLayers},
        {"num_heads", spec.kdaNumHeads},
        {"head_dim", spec.kdaHeadDim},
        {"short_conv_kernel_size", spec.shortConvKernelSize}}},
      {"num_experts", spec.numExperts},
      {"num_experts_per_token", spec.numExpertsPerToken},
      {"num_shared_experts", spec.numSharedExperts},
      {"moe_renormalize", spec.renormalize},
      {"moe_router_activation_func", spec.scoringFunction},
      {"use_grouped_topk", true},
      {"num_expert_group", spec.numExpertGroups},
  });
  if (spec.kdaGateLowerBound)
    config["linear_attn_config"]["gate_lower_bound"] = *spec.kdaGateLowerBound;
  if (spec.kdaFullRankOutputGate)
    config["linear_attn_config"]["use_full_rank_gate"] = true;
  if (spec.mlaOutputGate)
    config["mla_use_output_gate"] = true;
  if (spec.attnResBlockSize)
    config["attn_res_block_size"] = *spec.attnResBlockSize;
  addK3FeedForwardFields(spec, config);
  return config;
}

// The generic hybrid layout (docs/generic-hybrid.md): per-layer lists instead of patterns, the
// sections of the mixers present, DeepSeek's MoE spelling.
Json hybridConfig(const SyntheticSpec &spec) {
  Json config = commonConfig(spec);
  config["architectures"] = Json::array({"HybridForCausalLM"});
  config["max_position_embeddings"] = spec.maxPositionEmbeddings;
  config["layer_types"] = spec.layerTypes;
  config["mla_use_nope"] = spec.mlaUseNope;
  if (spec.mlaOutputGate)
    config["mla_use_output_gate"] = true;
  if (!spec.mlpLayerTypes.empty()) {
    // The list decides; the importer would otherwise check the prefix rule against it.
    config["mlp_layer_types"] = spec.mlpLayerTypes;
    config.erase("first_k_dense_replace");
    config.erase("moe_layer_freq");
  }
  auto uses = [&](const char *kind) {
    return std::find(spec.layerTypes.begin(), spec.layerTypes.end(), kind) != spec.layerTypes.end();
  };
  if (uses("kda")) {
    Json linear = {{"num_heads", spec.kdaNumHeads},
                   {"head_dim", spec.kdaHeadDim},
                   {"short_conv_kernel_size", spec.shortConvKernelSize}};
    if (spec.kdaGateLowerBound)
      linear["gate_lower_bound"] = *spec.kdaGateLowerBound;
    if (spec.kdaFullRankOutputGate)
      linear["use_full_rank_gate"] = true;
    config["linear_attn_config"] = std::move(linear);
  }
  if (uses("mla_dsa"))
    config.update({{"index_n_heads", spec.indexNumHeads},
                   {"index_head_dim", spec.indexHeadDim},
                   {"index_topk", spec.indexTopK}});
  if (spec.numExperts > 0)
    config.update({{"num_experts", spec.numExperts},
                   {"num_experts_per_tok", spec.numExpertsPerToken},
                   {"n_shared_experts", spec.numSharedExperts},
                   {"n_group", spec.numExpertGroups},
                   {"norm_topk_prob", spec.renormalize},
                   {"scoring_func", spec.scoringFunction}});
  if (spec.attnResBlockSize)
    config["attn_res_block_size"] = *spec.attnResBlockSize;
  addK3FeedForwardFields(spec, config);
  return config;
}

Json deepseekConfig(const SyntheticSpec &spec) {
  Json config = commonConfig(spec);
  config.update({
      {"architectures", Json::array({"DeepseekV32ForCausalLM"})},
      {"max_position_embeddings", spec.maxPositionEmbeddings},
      {"n_routed_experts", spec.numExperts},
      {"num_experts_per_tok", spec.numExpertsPerToken},
      {"n_shared_experts", spec.numSharedExperts},
      {"n_group", spec.numExpertGroups},
      {"norm_topk_prob", spec.renormalize},
      {"scoring_func", spec.scoringFunction},
      {"topk_method", "noaux_tc"},
      {"ep_size", 1},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"index_n_heads", spec.indexNumHeads},
      {"index_head_dim", spec.indexHeadDim},
      {"index_topk", spec.indexTopK},
  });
  if (spec.fp8Weights)
    config["quantization_config"] = {
        {"quant_method", "fp8"},
        {"fmt", "e4m3"},
        {"activation_scheme", "dynamic"},
        {"weight_block_size", Json::array({kFp8BlockSize, kFp8BlockSize})},
        {"scale_fmt", "ue8m0"}}; // as DeepSeek-V3.2 ships (MODEL_SPEC 1.3)
  return config;
}

//===------------------------------------------------------------------------------------------===//
// Files and folders.
//===------------------------------------------------------------------------------------------===//

Status writeTextFile(const fs::path &path, const std::string &text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  if (!out)
    return Status::error(path.string() + ": cannot write");
  return Status::ok();
}

bool holdsCheckpoint(const fs::path &dir) {
  std::error_code ignored;
  return fs::exists(dir / "config.json", ignored) ||
         fs::exists(dir / "model.safetensors.index.json", ignored);
}

// Removes the staging folder unless it was renamed into place.
class StagingDir {
public:
  explicit StagingDir(fs::path path) : path_(std::move(path)) {}
  StagingDir(const StagingDir &) = delete;
  StagingDir &operator=(const StagingDir &) = delete;
  ~StagingDir() {
    if (!committed_) {
      std::error_code ignored;
      fs::remove_all(path_, ignored);
    }
  }
  const fs::path &path() const { return path_; }
  void commit() { committed_ = true; }

private:
  fs::path path_;
  bool committed_ = false;
};

// Absolute, normalized target without a trailing separator.
StatusOr<fs::path> resolveTarget(const std::string &dir) {
  if (dir.empty())
    return Status::error("no output directory given");
  std::error_code error;
  fs::path target = fs::weakly_canonical(fs::absolute(dir, error), error);
  if (error)
    return Status::error(dir + ": " + error.message());
  if (!target.has_filename())
    target = target.parent_path();
  if (target == target.root_path())
    return Status::error(dir + ": refusing to write a checkpoint over the file system root");
  return target;
}

// Checks that `target` may be (re)placed: absent, an empty folder, or (with overwrite) a folder
// that holds a checkpoint.
Status checkTarget(const fs::path &target, bool overwrite) {
  std::error_code error;
  fs::file_status status = fs::status(target, error);
  if (!fs::exists(status))
    return Status::ok();
  if (!fs::is_directory(status))
    return Status::error(target.string() + ": exists and is not a directory");
  bool empty = fs::is_empty(target, error);
  if (error)
    return Status::error(target.string() + ": " + error.message());
  if (empty)
    return Status::ok();
  if (!overwrite)
    return Status::error(target.string() +
                         ": directory exists and is not empty (overwrite it with --force)");
  if (!holdsCheckpoint(target))
    return Status::error(target.string() +
                         ": not replacing a non-empty directory that holds no checkpoint "
                         "(no config.json or model.safetensors.index.json)");
  return Status::ok();
}

// Moves the finished staging folder to `target`, replacing an existing one.
Status moveIntoPlace(StagingDir &staging, const fs::path &target) {
  std::error_code error;
  const std::string pid = std::to_string(::getpid());
  fs::path previous;
  if (fs::exists(target, error)) {
    previous = target.parent_path() / ("." + target.filename().string() + ".synth-old-" + pid);
    fs::remove_all(previous, error);
    fs::rename(target, previous, error);
    if (error)
      return Status::error(target.string() +
                           ": cannot move the old directory aside: " + error.message());
  }
  fs::rename(staging.path(), target, error);
  if (error) {
    std::error_code ignored;
    if (!previous.empty())
      fs::rename(previous, target, ignored);
    return Status::error(target.string() +
                         ": cannot rename the staging directory into place: " + error.message());
  }
  staging.commit();
  if (!previous.empty())
    fs::remove_all(previous, error);
  return Status::ok();
}

Status writeCheckpoint(const SyntheticSpec &spec, const std::string &dir,
                       const SyntheticWriteOptions &options, SyntheticWriteSummary &summary) {
  HYBRID_RETURN_IF_ERROR(spec.validate());
  HYBRID_ASSIGN_OR_RETURN(fs::path target, resolveTarget(dir));
  HYBRID_RETURN_IF_ERROR(checkTarget(target, options.overwrite));

  std::error_code error;
  fs::create_directories(target.parent_path(), error);
  if (error)
    return Status::error(target.parent_path().string() + ": cannot create: " + error.message());
  StagingDir staging(target.parent_path() / ("." + target.filename().string() + ".synth-staging-" +
                                             std::to_string(::getpid())));
  fs::remove_all(staging.path(), error);
  fs::create_directory(staging.path(), error);
  if (error)
    return Status::error(staging.path().string() + ": cannot create: " + error.message());

  const std::vector<PlannedTensor> tensors = TensorPlanner(spec).plan();
  const std::vector<std::vector<size_t>> shards = assignShards(tensors, spec.maxShardBytes);
  int threads =
      options.threads > 0 ? options.threads : static_cast<int>(std::thread::hardware_concurrency());

  Json weightMap = Json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file = shardFileName(s, shards.size());
    std::vector<GeneratedTensor> generated;
    if (Status status = generateShard(spec, tensors, shards[s], threads, generated); !status)
      return std::move(status).withContext(file);

    SyntheticShardSummary shardSummary{file, 0, 0};
    std::vector<safetensors::TensorView> views;
    auto addView = [&](std::string name, DType dtype, std::vector<int64_t> shape,
                       const std::vector<std::byte> &bytes) {
      weightMap[name] = file;
      ++shardSummary.numTensors;
      shardSummary.tensorBytes += bytes.size();
      views.push_back({std::move(name), dtype, std::move(shape), std::span(bytes)});
    };
    for (size_t i = 0; i < shards[s].size(); ++i) {
      const PlannedTensor &tensor = tensors[shards[s][i]];
      addView(tensor.name, tensor.dtype, tensor.shape, generated[i].data);
      if (tensor.isFp8())
        addView(tensor.name + kScaleSuffix, DType::F32, tensor.scaleShape(), generated[i].scales);
    }
    const fs::path path = staging.path() / file;
    HYBRID_RETURN_IF_ERROR(
        safetensors::write(path.string(), views, {{"format", "pt"}}).withContext(path.string()));
    summary.numTensors += shardSummary.numTensors;
    summary.totalTensorBytes += shardSummary.tensorBytes;
    summary.shards.push_back(std::move(shardSummary));
  }

  Json index = {{"metadata", {{"total_size", summary.totalTensorBytes}}},
                {"weight_map", std::move(weightMap)}};
  HYBRID_RETURN_IF_ERROR(
      writeTextFile(staging.path() / "model.safetensors.index.json", index.dump(2) + "\n"));
  HYBRID_RETURN_IF_ERROR(writeTextFile(staging.path() / "config.json", syntheticConfigJson(spec)));
  return moveIntoPlace(staging, target);
}

//===------------------------------------------------------------------------------------------===//
// Presets.
//===------------------------------------------------------------------------------------------===//

// `spec` (a family's base) at the widths both families' tiny presets share: a 256-token
// vocabulary (ids 0..2 for pad, bos, eos), hidden and dense MLP 256, 2 MLA heads (kv_lora 64,
// q 64 + rope 32, v 64) and 8 routed experts of 64 (top 2) plus one shared.
SyntheticSpec withTinyWidths(SyntheticSpec spec) {
  spec.hiddenSize = 256;
  spec.vocabSize = 256;
  spec.intermediateSize = 256;
  spec.bosTokenId = 1;
  spec.eosTokenId = 2;
  spec.padTokenId = 0;
  spec.numAttentionHeads = 2;
  spec.kvLoraRank = 64;
  spec.qkNopeHeadDim = 64;
  spec.qkRopeHeadDim = 32;
  spec.vHeadDim = 64;
  spec.numExperts = 8;
  spec.numExpertsPerToken = 2;
  spec.numSharedExperts = 1;
  spec.moeIntermediateSize = 64;
  return spec;
}

// The Kimi family's base, from Kimi-Linear-48B's published config: the tokenizer's vocabulary
// and ids, norms and positions, MLA and KDA head widths, the short conv, three KDA layers per MLA
// layer and a dense first layer. The full-size presets keep all of it; the tiny ones narrow the
// vocabulary, ids and MLA widths (withTinyWidths).
SyntheticSpec kimiLinearBase() {
  SyntheticSpec spec;
  spec.modelType = "kimi_linear";
  spec.vocabSize = 163840;
  spec.rmsNormEps = 1e-5;
  spec.maxPositionEmbeddings = 1048576;
  spec.bosTokenId = 163584;
  spec.eosTokenId = 163586;
  spec.padTokenId = 163839;
  spec.kvLoraRank = 512;
  spec.qkNopeHeadDim = 128;
  spec.qkRopeHeadDim = 64;
  spec.vHeadDim = 128;
  spec.mlaUseNope = true;
  spec.kdaHeadDim = 128;
  spec.shortConvKernelSize = 4;
  spec.fullAttentionPeriod = 4;
  spec.firstKDenseReplace = 1;
  return spec;
}

// tests/data/kimi_linear_tiny: 4 layers (KDA, KDA, KDA, NoPE MLA), dense layer 0, 8 experts.
SyntheticSpec kimiLinearTiny() {
  SyntheticSpec spec = withTinyWidths(kimiLinearBase());
  spec.numLayers = 4;
  spec.kdaNumHeads = 2;
  spec.routedScalingFactor = 2.446;
  return spec;
}

// MODEL_SPEC 1.2: Kimi-Linear-48B-A3B.
SyntheticSpec kimiLinear48b() {
  SyntheticSpec spec = kimiLinearBase();
  spec.hiddenSize = 2304;
  spec.numLayers = 27;
  spec.intermediateSize = 9216;
  spec.numAttentionHeads = 32;
  spec.kdaNumHeads = 32;
  spec.numExperts = 256;
  spec.numExpertsPerToken = 8;
  spec.numSharedExperts = 1;
  spec.moeIntermediateSize = 1024;
  spec.routedScalingFactor = 2.446;
  return spec;
}

// What every DeepSeek-V3.2 preset shares: norms, positions, the routed experts' scale.
SyntheticSpec deepseekV32Base() {
  SyntheticSpec spec;
  spec.modelType = "deepseek_v32";
  spec.rmsNormEps = 1e-6;
  spec.maxPositionEmbeddings = 163840;
  spec.routedScalingFactor = 2.5;
  return spec;
}

// tests/data/deepseek_v32_tiny: 3 layers of MLA + indexer, dense layer 0, 8 experts in 2 groups.
SyntheticSpec deepseekV32Tiny() {
  SyntheticSpec spec = withTinyWidths(deepseekV32Base());
  spec.numLayers = 3;
  spec.qLoraRank = 96;
  spec.indexNumHeads = 4;
  spec.indexHeadDim = 64;
  spec.indexTopK = 8;
  spec.firstKDenseReplace = 1;
  spec.numExpertGroups = 2;
  spec.topkGroup = 1;
  return spec;
}

// deepseek-v32-tiny with widths whose tp=2 slices hold whole 128x128 FP8 blocks (with --fp8),
// as DeepSeek-V3.2's do: 8 heads of q 64 + 32 rope (4 per rank: 384 query rows), kv_b 64 + 64
// (512 rows) and v 64 (256 o_proj columns); dense MLP 256 rows; shared experts 2 x 128.
SyntheticSpec deepseekV32ShardTiny() {
  SyntheticSpec spec = deepseekV32Tiny();
  spec.numAttentionHeads = 8;
  spec.moeIntermediateSize = 128;
  spec.numSharedExperts = 2;
  return spec;
}

// MODEL_SPEC 1.3: DeepSeek-V3.2 (the 61 main layers; the MTP layer is not generated).
SyntheticSpec deepseekV32_671b() {
  SyntheticSpec spec = deepseekV32Base();
  spec.hiddenSize = 7168;
  spec.vocabSize = 129280;
  spec.numLayers = 61;
  spec.intermediateSize = 18432;
  spec.bosTokenId = 0;
  spec.eosTokenId = 1;
  spec.numAttentionHeads = 128;
  spec.qLoraRank = 1536;
  spec.kvLoraRank = 512;
  spec.qkNopeHeadDim = 128;
  spec.qkRopeHeadDim = 64;
  spec.vHeadDim = 128;
  spec.ropeScaling = YarnRopeScaling{};
  spec.indexNumHeads = 64;
  spec.indexHeadDim = 128;
  spec.indexTopK = 2048;
  spec.firstKDenseReplace = 3;
  spec.numExperts = 256;
  spec.numExpertsPerToken = 8;
  spec.numSharedExperts = 1;
  spec.moeIntermediateSize = 2048;
  spec.numExpertGroups = 8;
  spec.topkGroup = 4;
  return spec;
}

// The generic hybrid of docs/generic-hybrid.md at tiny sizes: KDA, MLA with the DSA indexer, KDA,
// plain q-LoRA MLA; a dense first layer then MoE (8 experts in 2 groups); Block AttnRes with
// blocks of 2 layers, so the mixes see 1, 2 and 3 candidates and block boundaries at layers 0, 2.
SyntheticSpec hybridTiny() {
  SyntheticSpec spec = deepseekV32Tiny();
  spec.modelType = "hybrid";
  spec.numLayers = 4;
  spec.layerTypes = {"kda", "mla_dsa", "kda", "mla"};
  spec.mlpLayerTypes = {"dense", "moe", "moe", "moe"};
  spec.kdaNumHeads = 2;
  spec.kdaHeadDim = 128;
  spec.shortConvKernelSize = 4;
  spec.attnResBlockSize = 2;
  return spec;
}

// Kimi K3's layout (MODEL_SPEC 6.2, 7.4) at tiny sizes and 8 layers: 3 KDA : 1 NoPE q-LoRA MLA
// with the sigmoid output gate, the lower-bound ("safe") KDA gate and the full-rank KDA output
// gate, SiTU activations (betas 4 and 25), a dense first layer then latent MoE (latent width half
// the hidden size, with its norm) with 2 shared experts, Block AttnRes in blocks of 3 layers (the
// last block partial, as K3's 93 = 7 * 12 + 9).
SyntheticSpec kimiK3Tiny() {
  SyntheticSpec spec = kimiLinearTiny();
  spec.numLayers = 8;
  spec.qLoraRank = 96;
  spec.kdaGateLowerBound = -5.0;
  spec.kdaFullRankOutputGate = true;
  spec.mlaOutputGate = true;
  spec.numExperts = 16;
  spec.numExpertsPerToken = 4;
  spec.numSharedExperts = 2;
  spec.latentMoeSize = 128; // K3: 3584 = hidden / 2
  spec.latentMoeNorm = true;
  spec.situBeta = 4.0;
  spec.situLinearBeta = 25.0;
  spec.attnResBlockSize = 3;
  return spec;
}

// Kimi K3's widths (MODEL_SPEC 7.4 and its config: hidden 7168, 96 KDA heads of 128, 96 MLA
// heads with q_lora 1536 / kv_lora 512, dense intermediate 33792, experts of 3072 in a 3584-wide
// latent space, 2 shared, top 16, AttnRes blocks of 12) in its first 12 layers, with 64 instead
// of 896 experts so the weights (about 60 GB) fit one GPU: the shapes for timing a decode step,
// e.g. with and without AttnRes (hybrid-synth --attn-res-block-size 0). SiLU instead of SiTU, as
// the AttnRes overhead in docs/performance.md (2026-11-30) was timed; the two cost the same on
// the cuda device, which has both.
SyntheticSpec kimiK3Slice() {
  SyntheticSpec spec = kimiLinearBase();
  spec.hiddenSize = 7168;
  spec.numLayers = 12;
  spec.intermediateSize = 33792;
  spec.numAttentionHeads = 96;
  spec.qLoraRank = 1536;
  spec.mlaOutputGate = true;
  spec.kdaNumHeads = 96;
  spec.kdaGateLowerBound = -5.0;
  spec.kdaFullRankOutputGate = true;
  spec.numExperts = 64;
  spec.numExpertsPerToken = 16;
  spec.numSharedExperts = 2;
  spec.moeIntermediateSize = 3072;
  spec.latentMoeSize = 3584;
  spec.latentMoeNorm = true;
  spec.routedScalingFactor = 2.5;
  spec.attnResBlockSize = 12;
  return spec;
}

Status requirePositive(std::string_view field, int64_t value) {
  if (value > 0)
    return Status::ok();
  return Status::error("synthetic spec: '" + std::string(field) + "' must be positive, got " +
                       std::to_string(value));
}

} // namespace

//===------------------------------------------------------------------------------------------===//
// Public API.
//===------------------------------------------------------------------------------------------===//

StatusOr<SyntheticSpec> SyntheticSpec::preset(const std::string &name) {
  if (name == "kimi-linear-tiny")
    return kimiLinearTiny();
  if (name == "kimi-attnres-tiny") {
    SyntheticSpec spec = kimiLinearTiny();
    spec.attnResBlockSize = 2;
    return spec;
  }
  if (name == "kimi-linear-48b")
    return kimiLinear48b();
  if (name == "deepseek-v32-tiny")
    return deepseekV32Tiny();
  if (name == "deepseek-v32-shard-tiny")
    return deepseekV32ShardTiny();
  if (name == "deepseek-v32-671b")
    return deepseekV32_671b();
  if (name == "hybrid-tiny")
    return hybridTiny();
  if (name == "kimi-k3-tiny")
    return kimiK3Tiny();
  if (name == "kimi-k3-slice")
    return kimiK3Slice();
  std::string known;
  for (const std::string &preset : presetNames())
    known += (known.empty() ? "" : ", ") + preset;
  return Status::error("unknown preset '" + name + "' (known: " + known + ")");
}

std::vector<std::string> SyntheticSpec::presetNames() {
  return {"kimi-linear-tiny", "kimi-attnres-tiny", "deepseek-v32-tiny", "deepseek-v32-shard-tiny",
          "hybrid-tiny",      "kimi-k3-tiny",      "kimi-linear-48b",   "deepseek-v32-671b",
          "kimi-k3-slice"};
}

std::string SyntheticSpec::mixerKind(int64_t layer) const {
  if (isHybrid())
    return layer >= 0 && layer < static_cast<int64_t>(layerTypes.size()) ? layerTypes[layer] : "";
  if (!isKimi())
    return "mla_dsa";
  if (!fullAttentionLayers.empty())
    return std::find(fullAttentionLayers.begin(), fullAttentionLayers.end(), layer) !=
                   fullAttentionLayers.end()
               ? "mla"
               : "kda";
  const int64_t oneBased = layer + 1;
  return oneBased % fullAttentionPeriod == 0 || oneBased == numLayers ? "mla" : "kda";
}

void SyntheticSpec::setNumLayers(int64_t layers) {
  if (isHybrid() && layers > 0) {
    const std::vector<std::string> pattern = layerTypes;
    layerTypes.resize(static_cast<size_t>(layers));
    for (size_t i = pattern.size(); i < layerTypes.size() && !pattern.empty(); ++i)
      layerTypes[i] = pattern[i % pattern.size()];
    if (!mlpLayerTypes.empty())
      mlpLayerTypes.resize(static_cast<size_t>(layers), mlpLayerTypes.back());
  }
  numLayers = layers;
}

bool SyntheticSpec::isMoeLayer(int64_t layer) const {
  if (isHybrid() && !mlpLayerTypes.empty())
    return layer >= 0 && layer < static_cast<int64_t>(mlpLayerTypes.size()) &&
           (mlpLayerTypes[layer] == "moe" || mlpLayerTypes[layer] == "latent_moe");
  return numExperts > 0 && layer >= firstKDenseReplace && layer % moeLayerFreq == 0;
}

Status SyntheticSpec::validate() const {
  const bool kimi = isKimi(), hybrid = isHybrid();
  if (!kimi && !hybrid && modelType != "deepseek_v32")
    return Status::error("synthetic spec: unknown model type '" + modelType +
                         "' (kimi_linear, deepseek_v32 or hybrid)");
  if (hybrid) {
    if (static_cast<int64_t>(layerTypes.size()) != numLayers)
      return Status::error("synthetic spec: 'layer_types' lists " +
                           std::to_string(layerTypes.size()) + " layers but num_hidden_layers = " +
                           std::to_string(numLayers));
    for (size_t i = 0; i < layerTypes.size(); ++i)
      if (layerTypes[i] != "kda" && layerTypes[i] != "mla" && layerTypes[i] != "mla_dsa")
        return Status::error("synthetic spec: 'layer_types'[" + std::to_string(i) + "] = '" +
                             layerTypes[i] + "' is not a mixer kind (kda, mla, mla_dsa)");
    if (!mlpLayerTypes.empty() && static_cast<int64_t>(mlpLayerTypes.size()) != numLayers)
      return Status::error("synthetic spec: 'mlp_layer_types' lists " +
                           std::to_string(mlpLayerTypes.size()) +
                           " layers but num_hidden_layers = " + std::to_string(numLayers));
    for (size_t i = 0; i < mlpLayerTypes.size(); ++i) {
      if (mlpLayerTypes[i] != "dense" && mlpLayerTypes[i] != "moe" &&
          mlpLayerTypes[i] != "latent_moe")
        return Status::error("synthetic spec: 'mlp_layer_types'[" + std::to_string(i) + "] = '" +
                             mlpLayerTypes[i] +
                             "' is not a feed-forward kind (dense, moe, latent_moe)");
      if (mlpLayerTypes[i] == "latent_moe" && !latentMoeSize)
        return Status::error("synthetic spec: 'mlp_layer_types'[" + std::to_string(i) +
                             "] is latent_moe but 'routed_expert_hidden_size' is not set");
      if (mlpLayerTypes[i] != "dense" && numExperts <= 0)
        return Status::error("synthetic spec: 'mlp_layer_types'[" + std::to_string(i) +
                             "] is moe but the number of experts is not positive");
    }
  } else if (!layerTypes.empty() || !mlpLayerTypes.empty()) {
    return Status::error("synthetic spec: per-layer 'layer_types' / 'mlp_layer_types' are a "
                         "hybrid option");
  }
  bool anyKda = false, anyIndexer = false;
  for (int64_t layer = 0; layer < numLayers; ++layer) {
    anyKda |= mixerKind(layer) == "kda";
    anyIndexer |= mixerKind(layer) == "mla_dsa";
  }
  const std::pair<std::string_view, int64_t> positiveFields[] = {
      {"hidden_size", hiddenSize},
      {"vocab_size", vocabSize},
      {"num_hidden_layers", numLayers},
      {"intermediate_size", intermediateSize},
      {"num_attention_heads", numAttentionHeads},
      {"kv_lora_rank", kvLoraRank},
      {"qk_nope_head_dim", qkNopeHeadDim},
      {"qk_rope_head_dim", qkRopeHeadDim},
      {"v_head_dim", vHeadDim},
      {"max_position_embeddings", maxPositionEmbeddings},
      {"moe_layer_freq", moeLayerFreq}};
  for (auto [field, value] : positiveFields)
    HYBRID_RETURN_IF_ERROR(requirePositive(field, value));
  if (qLoraRank)
    HYBRID_RETURN_IF_ERROR(requirePositive("q_lora_rank", *qLoraRank));
  if (kimi)
    HYBRID_RETURN_IF_ERROR(requirePositive("full attention period", fullAttentionPeriod));
  if (anyKda) {
    HYBRID_RETURN_IF_ERROR(requirePositive("linear_attn_config.num_heads", kdaNumHeads));
    HYBRID_RETURN_IF_ERROR(requirePositive("linear_attn_config.head_dim", kdaHeadDim));
    HYBRID_RETURN_IF_ERROR(
        requirePositive("linear_attn_config.short_conv_kernel_size", shortConvKernelSize));
  }
  if (kdaGateLowerBound && !(std::isfinite(*kdaGateLowerBound) && *kdaGateLowerBound < 0))
    return Status::error("synthetic spec: 'linear_attn_config.gate_lower_bound' must be negative");
  if ((kdaGateLowerBound || kdaFullRankOutputGate || mlaOutputGate || situBeta || latentMoeSize) &&
      !kimi && !hybrid)
    return Status::error("synthetic spec: the Kimi K3 options are kimi_linear and hybrid options");
  if (situBeta && !(std::isfinite(*situBeta) && *situBeta > 0))
    return Status::error("synthetic spec: 'activation_situ_beta' must be positive");
  if (situLinearBeta && (!situBeta || !(std::isfinite(*situLinearBeta) && *situLinearBeta > 0)))
    return Status::error("synthetic spec: 'activation_situ_linear_beta' must be positive and "
                         "needs activation_situ_beta");
  if (latentMoeSize)
    HYBRID_RETURN_IF_ERROR(requirePositive("routed_expert_hidden_size", *latentMoeSize));
  if (latentMoeNorm && !latentMoeSize)
    return Status::error("synthetic spec: 'latent_moe_use_norm' needs routed_expert_hidden_size");
  if (anyIndexer) {
    if (!qLoraRank)
      return Status::error("synthetic spec: layers with the DSA indexer need 'q_lora_rank' (the "
                           "indexer reads the query latent)");
    HYBRID_RETURN_IF_ERROR(requirePositive("index_n_heads", indexNumHeads));
    HYBRID_RETURN_IF_ERROR(requirePositive("index_head_dim", indexHeadDim));
    HYBRID_RETURN_IF_ERROR(requirePositive("index_topk", indexTopK));
  }
  if (firstKDenseReplace < 0)
    return Status::error("synthetic spec: 'first_k_dense_replace' must not be negative");
  if (numExperts < 0)
    return Status::error("synthetic spec: the number of experts must not be negative");
  if (numExperts > 0) {
    HYBRID_RETURN_IF_ERROR(requirePositive("moe_intermediate_size", moeIntermediateSize));
    HYBRID_RETURN_IF_ERROR(requirePositive("experts per token", numExpertsPerToken));
    HYBRID_RETURN_IF_ERROR(requirePositive("expert groups", numExpertGroups));
    HYBRID_RETURN_IF_ERROR(requirePositive("topk_group", topkGroup));
    if (numExpertsPerToken > numExperts)
      return Status::error("synthetic spec: " + std::to_string(numExpertsPerToken) +
                           " experts per token but only " + std::to_string(numExperts) +
                           " experts");
    if (numExperts % numExpertGroups != 0 || topkGroup > numExpertGroups)
      return Status::error("synthetic spec: " + std::to_string(numExperts) + " experts in " +
                           std::to_string(numExpertGroups) + " groups, top " +
                           std::to_string(topkGroup) + " groups: not a valid grouping");
    if (numSharedExperts < 0)
      return Status::error("synthetic spec: the number of shared experts must not be negative");
  }
  if (scoringFunction != "sigmoid" && scoringFunction != "softmax")
    return Status::error("synthetic spec: unknown scoring function '" + scoringFunction +
                         "' (sigmoid or softmax)");
  for (size_t i = 0; i < fullAttentionLayers.size(); ++i)
    if (fullAttentionLayers[i] < 0 || fullAttentionLayers[i] >= numLayers ||
        (i > 0 && fullAttentionLayers[i] <= fullAttentionLayers[i - 1]))
      return Status::error("synthetic spec: full attention layer " +
                           std::to_string(fullAttentionLayers[i] + 1) +
                           " (1-based) is not an increasing layer number of the " +
                           std::to_string(numLayers) + " layers");
  if (attnResBlockSize) {
    if (!kimi && !hybrid)
      return Status::error("synthetic spec: attn_res_block_size is a kimi_linear and hybrid option");
    HYBRID_RETURN_IF_ERROR(requirePositive("attn_res_block_size", *attnResBlockSize));
  }
  if (numNextnPredictLayers < 0 || (numNextnPredictLayers > 0 && (kimi || hybrid)))
    return Status::error("synthetic spec: 'num_nextn_predict_layers' must not be negative and is "
                         "a deepseek_v32 option");
  if (fp8Weights && (kimi || hybrid))
    return Status::error("synthetic spec: fp8 weights are a deepseek_v32 option (Kimi-Linear "
                         "ships bf16 weights)");
  if (!(std::isfinite(weightStd) && weightStd > 0))
    return Status::error("synthetic spec: the weight std must be positive");
  if (!(std::isfinite(rmsNormEps) && rmsNormEps > 0))
    return Status::error("synthetic spec: 'rms_norm_eps' must be positive");
  if (maxShardBytes == 0)
    return Status::error("synthetic spec: the shard size limit must be positive");
  return Status::ok();
}

uint64_t SyntheticTensor::byteSize() const {
  uint64_t count = 1;
  for (int64_t dim : shape)
    count *= static_cast<uint64_t>(dim);
  return count * safetensors::dtypeSize(dtype);
}

std::vector<SyntheticTensor> listSyntheticTensors(const SyntheticSpec &spec) {
  std::vector<SyntheticTensor> list;
  for (const PlannedTensor &tensor : TensorPlanner(spec).plan()) {
    list.push_back({tensor.name, tensor.dtype, tensor.shape, tensor.kind});
    if (tensor.isFp8())
      list.push_back(
          {tensor.name + kScaleSuffix, DType::F32, tensor.scaleShape(), ValueKind::BlockScale});
  }
  return list;
}

std::string syntheticConfigJson(const SyntheticSpec &spec) {
  const Json config = spec.isKimi()     ? kimiConfig(spec)
                      : spec.isHybrid() ? hybridConfig(spec)
                                        : deepseekConfig(spec);
  return config.dump(2) + "\n";
}

namespace {

// Reads config.json fields for specFromConfigJson; every error names the file and the field.
class ConfigReader {
public:
  ConfigReader(const Json &root, std::string path) : root_(root), path_(std::move(path)) {}

  const Json *find(std::string_view dotted) const {
    const Json *node = &root_;
    while (node->is_object()) {
      const size_t dot = dotted.find('.');
      auto it = node->find(std::string(dotted.substr(0, dot)));
      if (it == node->end())
        return nullptr;
      node = &*it;
      if (dot == std::string_view::npos)
        return node;
      dotted.remove_prefix(dot + 1);
    }
    return nullptr;
  }
  StatusOr<int64_t> integer(std::string_view field) const {
    const Json *value = find(field);
    if (!value || !value->is_number_integer())
      return missing(field, "an integer");
    return value->get<int64_t>();
  }
  StatusOr<int64_t> integer(std::string_view field, int64_t fallback) const {
    const Json *value = find(field);
    return !value || value->is_null() ? StatusOr<int64_t>(fallback) : integer(field);
  }
  StatusOr<std::optional<int64_t>> optionalInteger(std::string_view field) const {
    const Json *value = find(field);
    if (!value || value->is_null())
      return std::optional<int64_t>();
    HYBRID_ASSIGN_OR_RETURN(int64_t number, integer(field));
    return std::optional<int64_t>(number);
  }
  StatusOr<double> number(std::string_view field, double fallback) const {
    const Json *value = find(field);
    if (!value || value->is_null())
      return fallback;
    if (!value->is_number())
      return missing(field, "a number");
    return value->get<double>();
  }
  StatusOr<bool> boolean(std::string_view field, bool fallback) const {
    const Json *value = find(field);
    if (!value || value->is_null())
      return fallback;
    if (!value->is_boolean())
      return missing(field, "true or false");
    return value->get<bool>();
  }
  StatusOr<std::string> string(std::string_view field, std::string fallback) const {
    const Json *value = find(field);
    if (!value || value->is_null())
      return fallback;
    if (!value->is_string())
      return missing(field, "a string");
    return value->get<std::string>();
  }
  Status missing(std::string_view field, const char *what) const {
    return Status::error(path_ + ": field '" + std::string(field) + "' missing or not " + what);
  }
  const std::string &path() const { return path_; }

private:
  const Json &root_;
  std::string path_;
};

// MODEL_SPEC 1.2's K3 fields: the lower-bound KDA gate, the full-rank KDA output gate and the MLA
// output gate.
Status readKimiK3Fields(const ConfigReader &config, SyntheticSpec &spec) {
  if (const Json *bound = config.find("linear_attn_config.gate_lower_bound");
      bound && !bound->is_null()) {
    if (!bound->is_number())
      return config.missing("linear_attn_config.gate_lower_bound", "a number");
    spec.kdaGateLowerBound = bound->get<double>();
  }
  HYBRID_ASSIGN_OR_RETURN(spec.kdaFullRankOutputGate,
                          config.boolean("linear_attn_config.use_full_rank_gate", false));
  HYBRID_ASSIGN_OR_RETURN(spec.mlaOutputGate, config.boolean("mla_use_output_gate", false));
  HYBRID_ASSIGN_OR_RETURN(std::string activation, config.string("hidden_act", "silu"));
  if (activation == "situ") {
    HYBRID_ASSIGN_OR_RETURN(double beta, config.number("activation_situ_beta", 0.0));
    spec.situBeta = beta;
    if (const Json *linear = config.find("activation_situ_linear_beta");
        linear && !linear->is_null()) {
      HYBRID_ASSIGN_OR_RETURN(double linearBeta, config.number("activation_situ_linear_beta", 0.0));
      spec.situLinearBeta = linearBeta;
    }
  }
  HYBRID_ASSIGN_OR_RETURN(spec.latentMoeSize, config.optionalInteger("routed_expert_hidden_size"));
  HYBRID_ASSIGN_OR_RETURN(spec.latentMoeNorm, config.boolean("latent_moe_use_norm", false));
  return Status::ok();
}

Status readKimiFields(const ConfigReader &config, SyntheticSpec &spec) {
  HYBRID_ASSIGN_OR_RETURN(spec.kdaNumHeads, config.integer("linear_attn_config.num_heads"));
  HYBRID_ASSIGN_OR_RETURN(spec.kdaHeadDim, config.integer("linear_attn_config.head_dim"));
  HYBRID_ASSIGN_OR_RETURN(spec.shortConvKernelSize,
                          config.integer("linear_attn_config.short_conv_kernel_size"));
  HYBRID_ASSIGN_OR_RETURN(spec.maxPositionEmbeddings,
                          config.integer("model_max_length", int64_t{1} << 20));
  HYBRID_ASSIGN_OR_RETURN(spec.mlaUseNope, config.boolean("mla_use_nope", false));
  if (const Json *layers = config.find("linear_attn_config.full_attn_layers")) {
    if (!layers->is_array())
      return config.missing("linear_attn_config.full_attn_layers", "a list of layer numbers");
    for (const Json &layer : *layers) {
      if (!layer.is_number_integer())
        return config.missing("linear_attn_config.full_attn_layers", "a list of layer numbers");
      spec.fullAttentionLayers.push_back(layer.get<int64_t>() - 1); // 1-based in the config
    }
  }
  HYBRID_ASSIGN_OR_RETURN(spec.numExperts, config.integer("num_experts", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.numExpertsPerToken, config.integer("num_experts_per_token", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.numSharedExperts, config.integer("num_shared_experts", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.numExpertGroups, config.integer("num_expert_group", 1));
  HYBRID_ASSIGN_OR_RETURN(spec.renormalize, config.boolean("moe_renormalize", true));
  HYBRID_ASSIGN_OR_RETURN(spec.scoringFunction,
                          config.string("moe_router_activation_func", "sigmoid"));
  HYBRID_ASSIGN_OR_RETURN(spec.attnResBlockSize, config.optionalInteger("attn_res_block_size"));
  return readKimiK3Fields(config, spec);
}

// Per-layer lists of strings (`layer_types`, `mlp_layer_types`).
StatusOr<std::vector<std::string>> readStringList(const ConfigReader &config,
                                                  std::string_view field, bool required) {
  std::vector<std::string> list;
  const Json *value = config.find(field);
  if (!value || value->is_null()) {
    if (required)
      return config.missing(field, "a list of strings");
    return list;
  }
  if (!value->is_array())
    return config.missing(field, "a list of strings");
  for (const Json &entry : *value) {
    if (!entry.is_string())
      return config.missing(field, "a list of strings");
    list.push_back(entry.get<std::string>());
  }
  return list;
}

Status readHybridFields(const ConfigReader &config, SyntheticSpec &spec) {
  HYBRID_ASSIGN_OR_RETURN(spec.layerTypes, readStringList(config, "layer_types", true));
  HYBRID_ASSIGN_OR_RETURN(spec.mlpLayerTypes, readStringList(config, "mlp_layer_types", false));
  HYBRID_ASSIGN_OR_RETURN(spec.maxPositionEmbeddings,
                          config.integer("max_position_embeddings", int64_t{1} << 20));
  HYBRID_ASSIGN_OR_RETURN(spec.mlaUseNope, config.boolean("mla_use_nope", false));
  // Sections a layout without that mixer leaves out read as 0; validate() names what is missing.
  HYBRID_ASSIGN_OR_RETURN(spec.kdaNumHeads, config.integer("linear_attn_config.num_heads", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.kdaHeadDim, config.integer("linear_attn_config.head_dim", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.shortConvKernelSize,
                          config.integer("linear_attn_config.short_conv_kernel_size", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.indexNumHeads, config.integer("index_n_heads", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.indexHeadDim, config.integer("index_head_dim", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.indexTopK, config.integer("index_topk", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.numExperts, config.integer("num_experts", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.numExpertsPerToken, config.integer("num_experts_per_tok", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.numSharedExperts, config.integer("n_shared_experts", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.numExpertGroups, config.integer("n_group", 1));
  HYBRID_ASSIGN_OR_RETURN(spec.renormalize, config.boolean("norm_topk_prob", true));
  HYBRID_ASSIGN_OR_RETURN(spec.scoringFunction, config.string("scoring_func", "sigmoid"));
  HYBRID_ASSIGN_OR_RETURN(spec.attnResBlockSize, config.optionalInteger("attn_res_block_size"));
  return readKimiK3Fields(config, spec);
}

Status readDeepseekFields(const ConfigReader &config, SyntheticSpec &spec) {
  HYBRID_ASSIGN_OR_RETURN(spec.indexNumHeads, config.integer("index_n_heads"));
  HYBRID_ASSIGN_OR_RETURN(spec.indexHeadDim, config.integer("index_head_dim"));
  HYBRID_ASSIGN_OR_RETURN(spec.indexTopK, config.integer("index_topk"));
  HYBRID_ASSIGN_OR_RETURN(spec.maxPositionEmbeddings, config.integer("max_position_embeddings"));
  HYBRID_ASSIGN_OR_RETURN(spec.numExperts, config.integer("n_routed_experts", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.numExpertsPerToken, config.integer("num_experts_per_tok", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.numSharedExperts, config.integer("n_shared_experts", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.numExpertGroups, config.integer("n_group", 1));
  HYBRID_ASSIGN_OR_RETURN(spec.renormalize, config.boolean("norm_topk_prob", true));
  HYBRID_ASSIGN_OR_RETURN(spec.scoringFunction, config.string("scoring_func", "sigmoid"));
  HYBRID_ASSIGN_OR_RETURN(spec.numNextnPredictLayers,
                          config.integer("num_nextn_predict_layers", 0));
  if (const Json *quantization = config.find("quantization_config");
      quantization && !quantization->is_null()) {
    HYBRID_ASSIGN_OR_RETURN(std::string method, config.string("quantization_config.quant_method",
                                                              ""));
    const Json *block = config.find("quantization_config.weight_block_size");
    if (method != "fp8" || !block || *block != Json::array({kFp8BlockSize, kFp8BlockSize}))
      return Status::error(config.path() + ": field 'quantization_config': synthetic weights "
                                           "are bf16, or fp8 with weight_block_size [128, 128]");
    spec.fp8Weights = true;
  }
  return Status::ok();
}

} // namespace

StatusOr<SyntheticSpec> specFromConfigJson(const std::string &text, const std::string &path,
                                           uint64_t seed) {
  Json root = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object())
    return Status::error(path + ": not a JSON object");
  const ConfigReader config(root, path);
  SyntheticSpec spec;
  HYBRID_ASSIGN_OR_RETURN(spec.modelType, config.string("model_type", ""));
  if (spec.modelType != "kimi_linear" && spec.modelType != "deepseek_v32" &&
      spec.modelType != "hybrid")
    return Status::error(path + ": model_type '" + spec.modelType +
                         "': synthetic weights know the tensors of kimi_linear, deepseek_v32 and "
                         "hybrid");
  spec.seed = seed;
  HYBRID_ASSIGN_OR_RETURN(spec.hiddenSize, config.integer("hidden_size"));
  HYBRID_ASSIGN_OR_RETURN(spec.vocabSize, config.integer("vocab_size"));
  HYBRID_ASSIGN_OR_RETURN(spec.numLayers, config.integer("num_hidden_layers"));
  HYBRID_ASSIGN_OR_RETURN(spec.intermediateSize, config.integer("intermediate_size"));
  HYBRID_ASSIGN_OR_RETURN(spec.rmsNormEps, config.number("rms_norm_eps", 1e-6));
  HYBRID_ASSIGN_OR_RETURN(spec.numAttentionHeads, config.integer("num_attention_heads"));
  HYBRID_ASSIGN_OR_RETURN(spec.qLoraRank, config.optionalInteger("q_lora_rank"));
  HYBRID_ASSIGN_OR_RETURN(spec.kvLoraRank, config.integer("kv_lora_rank"));
  HYBRID_ASSIGN_OR_RETURN(spec.qkNopeHeadDim, config.integer("qk_nope_head_dim"));
  HYBRID_ASSIGN_OR_RETURN(spec.qkRopeHeadDim, config.integer("qk_rope_head_dim"));
  HYBRID_ASSIGN_OR_RETURN(spec.vHeadDim, config.integer("v_head_dim"));
  HYBRID_ASSIGN_OR_RETURN(spec.firstKDenseReplace, config.integer("first_k_dense_replace", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.moeLayerFreq, config.integer("moe_layer_freq", 1));
  HYBRID_ASSIGN_OR_RETURN(spec.moeIntermediateSize, config.integer("moe_intermediate_size", 0));
  HYBRID_ASSIGN_OR_RETURN(spec.topkGroup, config.integer("topk_group", 1));
  HYBRID_ASSIGN_OR_RETURN(spec.routedScalingFactor, config.number("routed_scaling_factor", 1.0));
  HYBRID_RETURN_IF_ERROR(spec.isKimi()     ? readKimiFields(config, spec)
                         : spec.isHybrid() ? readHybridFields(config, spec)
                                           : readDeepseekFields(config, spec));
  if (Status valid = spec.validate(); !valid)
    return Status::error(path + ": " + valid.message());
  return spec;
}

SyntheticValues syntheticValuesFor(const SyntheticSpec &spec, const SyntheticTensor &tensor) {
  using kernels::SyntheticKind;
  // a * X with X the Irwin-Hall sum (standard deviation 65536 / sqrt(3)) has deviation a * 65536
  // / sqrt(3); and its largest magnitude 131070 * sqrt(3) / 65536 = 3.464 deviations.
  const double perUnit = std::numbers::sqrt3 / 65536.0;
  constexpr double kFp8CodesPerDeviation = 128.0;   // 3.464 * 128 = 443.4 <= 448
  constexpr double kFp8DeviationsPerScale = 3.5;    // scale = 3.5 * std / 448
  SyntheticValues values;
  values.key = tensorKey(spec.seed, tensor.name);
  switch (tensor.kind) {
  case ValueKind::Weight:
  case ValueKind::Bias:
    values.a = static_cast<float>(
        (tensor.dtype == DType::F8_E4M3 ? kFp8CodesPerDeviation : spec.weightStd) * perUnit);
    break;
  case ValueKind::NormWeight:
    values.a = static_cast<float>(kNormWeightNoise * perUnit);
    values.b = 1.0f;
    break;
  case ValueKind::DecayLog:
    values = {SyntheticKind::LogUniform, values.key, static_cast<float>(kDecayMin),
              static_cast<float>(kDecayMax)};
    break;
  case ValueKind::DecayTimeBias:
    values = {SyntheticKind::DecayTimeBias, values.key, static_cast<float>(kDecayTimeMin),
              static_cast<float>(kDecayTimeMax)};
    break;
  case ValueKind::BlockScale:
    values.kind = SyntheticKind::Constant;
    values.b = static_cast<float>(kFp8DeviationsPerScale * spec.weightStd / kFp8E4M3Max);
    break;
  }
  return values;
}

Status writeSyntheticCheckpoint(const SyntheticSpec &spec, const std::string &dir,
                                const SyntheticWriteOptions &options,
                                SyntheticWriteSummary *summary) {
  SyntheticWriteSummary written;
  Status status;
  try {
    status = writeCheckpoint(spec, dir, options, written);
  } catch (const std::exception &error) { // filesystem_error, bad_alloc: report, never throw
    status = Status::error(dir + ": " + error.what());
  }
  if (status && summary)
    *summary = std::move(written);
  return status;
}

uint8_t floatToF8E4M3(float value) {
  if (std::isnan(value))
    return 0x7f;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const double magnitude = std::fabs(static_cast<double>(value));
  // 448 is the largest finite value; everything from 448 up (which would round to 448 or to the
  // unrepresentable 480/512) saturates, as scaled quantization expects.
  if (magnitude >= kFp8E4M3Max)
    return sign | 0x7e;
  // Subnormals are multiples of 2^-9 below 2^-6; a count of 8 is exactly the smallest normal's
  // encoding, so rounding up into the normal range needs no special case.
  if (magnitude < 0x1p-6)
    return sign | static_cast<uint8_t>(std::nearbyint(magnitude * 0x1p9));
  int exponent = 0;
  const double fraction = std::frexp(magnitude, &exponent); // magnitude = fraction * 2^exponent
  // magnitude = (1 + mantissa/8) * 2^(exponent-1); nearbyint rounds half to even.
  int mantissa = static_cast<int>(std::nearbyint((fraction * 2.0 - 1.0) * 8.0));
  int biasedExponent = exponent - 1 + 7;
  if (mantissa == 8) {
    mantissa = 0;
    ++biasedExponent;
  }
  return sign | static_cast<uint8_t>(biasedExponent << 3) | static_cast<uint8_t>(mantissa);
}

} // namespace hybrid::synth
