// Golden forward passes: the reference kernels wired into the three tiny models of tests/data
// (Kimi-Linear, DeepSeek-V3.2, Kimi-Linear + Block AttnRes) and compared with the outputs of the HF
// reference (golden.safetensors). This wiring is the executable spec for the runtime's executor:
// which kernel runs where, with which weights, epsilons, RoPE layouts and caches.
//
// Everything is fp32, computed from the stored (bf16) weights widened to fp32.
#include "TestUtil.h"
#include "hybrid/kernels/ref/AttnRes.h"
#include "hybrid/kernels/ref/Dsa.h"
#include "hybrid/kernels/ref/Kda.h"
#include "hybrid/kernels/ref/Linear.h"
#include "hybrid/kernels/ref/Mla.h"
#include "hybrid/kernels/ref/Moe.h"
#include "hybrid/kernels/ref/Norm.h"
#include "hybrid/runtime/Safetensors.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <gtest/gtest.h>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace hybrid::kernels::ref {
namespace {

namespace st = hybrid::safetensors;
using Json = nlohmann::json;
using testing::maxAbsDiff;

// Max abs difference allowed against the golden logits (and used to flag diverging hidden states).
constexpr float kTolerance = 2e-3f;

std::string dataPath(const std::string &model, const std::string &file) {
  return std::string(HYBRID_TEST_DATA_DIR) + "/" + model + "/" + file;
}

Json readJson(const std::string &path) {
  std::ifstream in(path);
  if (!in)
    throw std::runtime_error("cannot open " + path);
  return Json::parse(in);
}

st::File openSafetensors(const std::string &path) {
  auto file = st::File::open(path);
  if (!file)
    throw std::runtime_error(file.status().message());
  return std::move(file).value();
}

std::vector<float> readFloats(const st::File &file, const std::string &name) {
  const st::TensorInfo *info = file.find(name);
  if (!info)
    throw std::runtime_error(file.path() + ": no tensor " + name);
  auto values = st::readAsFloat(file, *info);
  if (!values)
    throw std::runtime_error(values.status().message());
  return std::move(values).value();
}

std::vector<int64_t> readInts(const st::File &file, const std::string &name) {
  const st::TensorInfo *info = file.find(name);
  if (!info)
    throw std::runtime_error(file.path() + ": no tensor " + name);
  auto values = st::readAsInt64(file, *info);
  if (!values)
    throw std::runtime_error(values.status().message());
  return std::move(values).value();
}

// ---- Checkpoint: every tensor of the shards named by model.safetensors.index.json, as fp32 ------

class Checkpoint {
public:
  explicit Checkpoint(const std::string &model) {
    const Json index = readJson(dataPath(model, "model.safetensors.index.json"));
    std::map<std::string, st::File> shards;
    for (const auto &[name, shard] : index.at("weight_map").items()) {
      const std::string shardName = shard.get<std::string>();
      if (!shards.count(shardName))
        shards.emplace(shardName, openSafetensors(dataPath(model, shardName)));
      tensors_[name] = readFloats(shards.at(shardName), name);
    }
  }

  const std::vector<float> &operator[](const std::string &name) const {
    auto it = tensors_.find(name);
    if (it == tensors_.end())
      throw std::runtime_error("checkpoint has no tensor " + name);
    return it->second;
  }
  bool contains(const std::string &name) const { return tensors_.count(name) != 0; }

private:
  std::map<std::string, std::vector<float>> tensors_;
};

// ---- Config: both spellings of the Hub and of newer transformers, checked to agree --------------

enum class Mixer { Kda, Mla };
enum class Ffn { Dense, Moe };

struct ModelConfig {
  int64_t hiddenSize = 0, vocabSize = 0, numLayers = 0, intermediateSize = 0;
  float rmsNormEps = 0;
  std::vector<Mixer> mixers;
  std::vector<Ffn> ffns;
  // KDA
  int64_t kdaHeads = 0, kdaHeadDim = 0, convKernelSize = 0;
  // MLA
  int64_t mlaHeads = 0, qLoraRank = 0 /* 0: plain q_proj */, kvLoraRank = 0;
  int64_t nopeDim = 0, ropeDim = 0, valueDim = 0;
  bool useRope = false;
  double ropeTheta = 10000.0;
  std::optional<YarnConfig> yarn;
  // DSA indexer (DeepSeek-V3.2)
  bool hasIndexer = false;
  int64_t indexHeads = 0, indexHeadDim = 0, indexTopK = 0;
  // MoE
  std::string moePrefix; // "block_sparse_moe" (Kimi) or "mlp" (DeepSeek)
  std::string expertGate, expertUp, expertDown;
  int64_t numExperts = 0, expertsPerToken = 0, numGroups = 1, topKGroups = 1;
  int64_t moeIntermediateSize = 0, numSharedExperts = 0;
  bool renormalize = true;
  float routedScalingFactor = 1;
  RouterScoring scoring = RouterScoring::Sigmoid;
  // Block AttnRes (0: plain residual stream)
  int64_t attnResBlockSize = 0;
};

template <typename T> T valueOr(const Json &config, const char *key, T fallback) {
  auto it = config.find(key);
  return it == config.end() || it->is_null() ? fallback : it->get<T>();
}

// Asserts two descriptions of the same fact agree when both are present; returns the one found.
template <typename T>
std::vector<T> reconcile(const char *what, std::vector<T> a, std::vector<T> b) {
  if (!a.empty() && !b.empty() && a != b)
    throw std::runtime_error(std::string("config spellings disagree on ") + what);
  if (a.empty() && b.empty())
    throw std::runtime_error(std::string("config does not describe ") + what);
  return a.empty() ? b : a;
}

ModelConfig parseConfig(const Json &c) {
  ModelConfig m;
  const std::string type = c.at("model_type");
  const bool kimi = type == "kimi_linear";
  if (!kimi && type != "deepseek_v32")
    throw std::runtime_error("unsupported model_type " + type);
  m.hiddenSize = c.at("hidden_size");
  m.vocabSize = c.at("vocab_size");
  m.numLayers = c.at("num_hidden_layers");
  m.intermediateSize = c.at("intermediate_size");
  m.rmsNormEps = c.at("rms_norm_eps");

  // Layer kinds: Hub Kimi lists 1-based kda_layers; newer transformers write layer_types.
  std::vector<Mixer> fromLayerTypes, fromLinearConfig;
  if (c.contains("layer_types"))
    for (const std::string kind : c.at("layer_types"))
      fromLayerTypes.push_back(kind == "linear_attention" ? Mixer::Kda : Mixer::Mla);
  if (kimi && c.contains("linear_attn_config")) {
    const Json &linear = c.at("linear_attn_config");
    const std::vector<int64_t> kdaLayers = linear.at("kda_layers");
    const std::vector<int64_t> fullLayers =
        valueOr(linear, "full_attn_layers", std::vector<int64_t>{});
    for (int64_t i = 0; i < m.numLayers; ++i) {
      const bool isKda = std::count(kdaLayers.begin(), kdaLayers.end(), i + 1) > 0;
      const bool isFull = std::count(fullLayers.begin(), fullLayers.end(), i + 1) > 0;
      if (isKda == isFull)
        throw std::runtime_error("linear_attn_config: layer " + std::to_string(i + 1) +
                                 " must be in exactly one of kda_layers / full_attn_layers");
      fromLinearConfig.push_back(isKda ? Mixer::Kda : Mixer::Mla);
    }
    m.kdaHeads = linear.at("num_heads");
    m.kdaHeadDim = linear.at("head_dim");
    m.convKernelSize = linear.at("short_conv_kernel_size");
  } else if (kimi) {
    m.kdaHeads = c.at("linear_num_heads");
    m.kdaHeadDim = c.at("linear_head_dim");
    m.convKernelSize = c.at("linear_conv_kernel_dim");
  }
  m.mixers = reconcile("attention layer kinds", fromLayerTypes, fromLinearConfig);

  // Dense / MoE: mlp_layer_types, or the first_k_dense_replace + moe_layer_freq rule.
  m.numExperts =
      kimi ? valueOr<int64_t>(c, "num_experts", 0) : valueOr<int64_t>(c, "n_routed_experts", 0);
  std::vector<Ffn> fromMlpTypes, fromRule;
  if (c.contains("mlp_layer_types"))
    for (const std::string kind : c.at("mlp_layer_types"))
      fromMlpTypes.push_back(kind == "sparse" ? Ffn::Moe : Ffn::Dense);
  const int64_t firstDense = valueOr<int64_t>(c, "first_k_dense_replace", 0);
  const int64_t moeFreq = valueOr<int64_t>(c, "moe_layer_freq", 1);
  for (int64_t i = 0; i < m.numLayers; ++i)
    fromRule.push_back(m.numExperts > 0 && i >= firstDense && i % moeFreq == 0 ? Ffn::Moe
                                                                               : Ffn::Dense);
  m.ffns = reconcile("MLP layer kinds", fromMlpTypes, fromRule);

  m.mlaHeads = c.at("num_attention_heads");
  m.qLoraRank = valueOr<int64_t>(c, "q_lora_rank", 0);
  m.kvLoraRank = c.at("kv_lora_rank");
  m.nopeDim = c.at("qk_nope_head_dim");
  m.ropeDim = c.at("qk_rope_head_dim");
  m.valueDim = c.at("v_head_dim");
  // Kimi-Linear's MLA is NoPE (the reference asserts mla_use_nope); DeepSeek rotates the rope part.
  if (kimi && !valueOr<bool>(c, "mla_use_nope", true))
    throw std::runtime_error("Kimi-Linear MLA with RoPE is not supported");
  m.useRope = !kimi;

  // RoPE: top-level rope_theta / rope_scaling (Hub) or rope_parameters (newer transformers).
  auto ropeType = [](const Json &scaling) {
    return valueOr<std::string>(scaling, "type",
                                valueOr<std::string>(scaling, "rope_type", "default"));
  };
  std::vector<double> thetas;
  std::vector<Json> scalings; // the non-default scalings found
  if (c.contains("rope_theta"))
    thetas.push_back(c.at("rope_theta"));
  if (const Json scaling = valueOr(c, "rope_scaling", Json()); !scaling.is_null())
    scalings.push_back(scaling);
  if (c.contains("rope_parameters")) {
    const Json &parameters = c.at("rope_parameters");
    if (parameters.contains("rope_theta"))
      thetas.push_back(parameters.at("rope_theta"));
    if (ropeType(parameters) != "default")
      scalings.push_back(parameters);
  }
  for (double theta : thetas)
    if (theta != thetas.front())
      throw std::runtime_error("rope_theta spellings disagree");
  if (!thetas.empty())
    m.ropeTheta = thetas.front();
  for (const Json &scaling : scalings)
    if (ropeType(scaling) != ropeType(scalings.front()) ||
        scaling.value("factor", 1.0) != scalings.front().value("factor", 1.0))
      throw std::runtime_error("rope_scaling and rope_parameters disagree");
  if (!scalings.empty()) {
    const Json &scaling = scalings.front();
    if (ropeType(scaling) == "yarn")
      m.yarn = YarnConfig{scaling.at("factor"),
                          scaling.at("original_max_position_embeddings"),
                          valueOr<double>(scaling, "beta_fast", 32.0),
                          valueOr<double>(scaling, "beta_slow", 1.0),
                          valueOr<double>(scaling, "mscale", 1.0),
                          valueOr<double>(scaling, "mscale_all_dim", 0.0)};
    else if (ropeType(scaling) != "default")
      throw std::runtime_error("unsupported rope type " + ropeType(scaling));
  }

  m.hasIndexer = type == "deepseek_v32";
  if (m.hasIndexer) {
    m.indexHeads = c.at("index_n_heads");
    m.indexHeadDim = c.at("index_head_dim");
    m.indexTopK = c.at("index_topk");
  }

  if (kimi) {
    m.moePrefix = "block_sparse_moe";
    m.expertGate = "w1", m.expertUp = "w3", m.expertDown = "w2";
    m.expertsPerToken = c.at("num_experts_per_token");
    m.numGroups = valueOr<int64_t>(c, "num_expert_group", 1);
    m.numSharedExperts = valueOr<int64_t>(c, "num_shared_experts", 0);
    m.renormalize = valueOr<bool>(c, "moe_renormalize", true);
    m.scoring = valueOr<std::string>(c, "moe_router_activation_func", "sigmoid") == "softmax"
                    ? RouterScoring::Softmax
                    : RouterScoring::Sigmoid;
  } else {
    m.moePrefix = "mlp";
    m.expertGate = "gate_proj", m.expertUp = "up_proj", m.expertDown = "down_proj";
    m.expertsPerToken = c.at("num_experts_per_tok");
    m.numGroups = valueOr<int64_t>(c, "n_group", 1);
    m.numSharedExperts = valueOr<int64_t>(c, "n_shared_experts", 0);
    m.renormalize = valueOr<bool>(c, "norm_topk_prob", true);
    m.scoring = valueOr<std::string>(c, "scoring_func", "sigmoid") == "softmax"
                    ? RouterScoring::Softmax
                    : RouterScoring::Sigmoid;
  }
  m.topKGroups = valueOr<int64_t>(c, "topk_group", 1);
  m.moeIntermediateSize = valueOr<int64_t>(c, "moe_intermediate_size", 0);
  m.routedScalingFactor = valueOr<float>(c, "routed_scaling_factor", 1.0f);
  m.attnResBlockSize = valueOr<int64_t>(c, "attn_res_block_size", 0);
  return m;
}

// ---- The numeric choices the golden outputs settle (kernels/ref/NUMERICS.md) --------------------

struct Numerics {
  RopeLayout mlaRope = RopeLayout::Interleaved; // DeepSeek MLA (Kimi MLA is NoPE)
  RopeLayout indexerRope = RopeLayout::HalfSplit;
  // q_a_layernorm and kv_a_layernorm; nullopt: rms_norm_eps.
  std::optional<float> latentNormEps = 1e-6f;
  float indexerKeyNormEps = 1e-6f;
  bool routerWeightsFromBiasedScores = false;
  GateActivation kdaOutputGate = GateActivation::Sigmoid;
  bool denseInsteadOfSparse = false; // evidence only: attend to every causal position
};

// ---- Decode state: what a sequence carries between forward calls --------------------------------

struct KdaState {
  std::vector<float> convQ, convK, convV; // [W−1, channels] pre-conv history
  std::vector<float> recurrent;           // [H, K, V]
};

struct MlaCache {
  std::vector<float> latents;     // [positions, kv_lora_rank], after kv_a_layernorm
  std::vector<float> ropeKeys;    // [positions, qk_rope_head_dim], after RoPE
  std::vector<float> indexerKeys; // [positions, index_head_dim], after LayerNorm + RoPE
};

struct SequenceState {
  int64_t length = 0;        // tokens already consumed
  std::vector<KdaState> kda; // per layer (empty for MLA layers)
  std::vector<MlaCache> mla; // per layer (empty for KDA layers)
};

// Intermediate results of one forward, by stage, for layer-by-layer comparison.
struct Stages {
  std::vector<std::pair<std::string, std::vector<float>>> entries;
  void add(std::string name, std::vector<float> values) {
    entries.emplace_back(std::move(name), std::move(values));
  }
};

// ---- The model
// -----------------------------------------------------------------------------------

class ReferenceModel {
public:
  ReferenceModel(const std::string &name, Numerics numerics = {})
      : config_(parseConfig(readJson(dataPath(name, "config.json")))), weights_(name),
        numerics_(numerics) {}

  const ModelConfig &config() const { return config_; }

  SequenceState newSequence() const {
    SequenceState state;
    state.kda.resize(config_.numLayers);
    state.mla.resize(config_.numLayers);
    for (int64_t i = 0; i < config_.numLayers; ++i) {
      if (config_.mixers[i] != Mixer::Kda)
        continue;
      const int64_t channels = config_.kdaHeads * config_.kdaHeadDim;
      const size_t history = (config_.convKernelSize - 1) * channels;
      state.kda[i] = {
          std::vector<float>(history, 0.0f), std::vector<float>(history, 0.0f),
          std::vector<float>(history, 0.0f),
          std::vector<float>(config_.kdaHeads * config_.kdaHeadDim * config_.kdaHeadDim, 0.0f)};
    }
    return state;
  }

  // Runs `tokens` as the next positions of `state` and returns their logits [T, vocab].
  std::vector<float> forward(std::span<const int64_t> tokens, SequenceState &state,
                             Stages *stages = nullptr) const {
    const int64_t T = static_cast<int64_t>(tokens.size()), d = config_.hiddenSize;
    std::vector<float> h(T * d);
    const std::vector<float> &embedding = weights_["model.embed_tokens.weight"];
    for (int64_t t = 0; t < T; ++t)
      std::copy_n(embedding.begin() + tokens[t] * d, d, h.begin() + t * d);
    if (stages)
      stages->add("embedding", h);

    h = config_.attnResBlockSize > 0 ? attnResLayers(std::move(h), T, state, stages)
                                     : residualLayers(std::move(h), T, state, stages);

    rmsNorm(h, weights_["model.norm.weight"], h, T, d, config_.rmsNormEps);
    if (stages)
      stages->add("final norm", h);
    std::vector<float> logits(T * config_.vocabSize);
    linear(h, weights_["lm_head.weight"], logits, T, d, config_.vocabSize);
    state.length += T;
    return logits;
  }

private:
  static std::string layerPrefix(int64_t layer) {
    return "model.layers." + std::to_string(layer) + ".";
  }

  // Pre-norm residual blocks (MODEL_SPEC §1.1).
  std::vector<float> residualLayers(std::vector<float> h, int64_t T, SequenceState &state,
                                    Stages *stages) const {
    const int64_t d = config_.hiddenSize;
    std::vector<float> x(T * d);
    for (int64_t layer = 0; layer < config_.numLayers; ++layer) {
      const std::string prefix = layerPrefix(layer);
      rmsNorm(h, weights_[prefix + "input_layernorm.weight"], x, T, d, config_.rmsNormEps);
      addInPlace(h, mixer(layer, x, T, state));
      rmsNorm(h, weights_[prefix + "post_attention_layernorm.weight"], x, T, d, config_.rmsNormEps);
      addInPlace(h, ffn(layer, x, T));
      if (stages)
        stages->add("layer " + std::to_string(layer), h);
    }
    return h;
  }

  // Block AttnRes (MODEL_SPEC §6.2, Kimi K3 form): each sub-layer reads a softmax mix over the
  // completed blocks and the running partial sum instead of one residual stream.
  std::vector<float> attnResLayers(std::vector<float> h, int64_t T, SequenceState &state,
                                   Stages *stages) const {
    const int64_t d = config_.hiddenSize;
    std::vector<std::vector<float>> blocks; // b_0 = embedding, then completed block sums
    std::vector<float> x(T * d);
    // AR over the completed blocks followed by the current partial sum.
    auto mix = [&](const std::vector<float> &partial, const std::string &weightPrefix) {
      std::vector<const float *> candidates;
      for (const auto &block : blocks)
        candidates.push_back(block.data());
      candidates.push_back(partial.data());
      std::vector<float> mixed(T * d);
      attnResMix(candidates, T, d, weights_[weightPrefix + "_norm.weight"],
                 weights_[weightPrefix + "_proj.weight"], config_.rmsNormEps, mixed);
      return mixed;
    };
    for (int64_t layer = 0; layer < config_.numLayers; ++layer) {
      const std::string prefix = layerPrefix(layer);
      std::optional<std::vector<float>> partial = h; // the running sum of the current block
      if (!blocks.empty())
        h = mix(*partial, prefix + "self_attention_res");
      if (layer % config_.attnResBlockSize == 0) { // close the block (layer 0 pushes b_0)
        blocks.push_back(std::move(*partial));
        partial.reset();
      }
      rmsNorm(h, weights_[prefix + "input_layernorm.weight"], x, T, d, config_.rmsNormEps);
      std::vector<float> attention = mixer(layer, x, T, state);
      if (partial)
        addInPlace(*partial, attention);
      else
        partial = std::move(attention);
      h = mix(*partial, prefix + "mlp_res");
      rmsNorm(h, weights_[prefix + "post_attention_layernorm.weight"], x, T, d, config_.rmsNormEps);
      addInPlace(*partial, ffn(layer, x, T));
      h = std::move(*partial);
      if (stages)
        stages->add("layer " + std::to_string(layer), h);
    }
    return mix(h, "model.output_attn_res");
  }

  std::vector<float> mixer(int64_t layer, const std::vector<float> &x, int64_t T,
                           SequenceState &state) const {
    return config_.mixers[layer] == Mixer::Kda ? kda(layer, x, T, state.kda[layer], state.length)
                                               : mla(layer, x, T, state.mla[layer], state.length);
  }

  // KDA mixer (MODEL_SPEC §2.2).
  std::vector<float> kda(int64_t layer, const std::vector<float> &x, int64_t T, KdaState &state,
                         int64_t pastLength) const {
    const std::string p = layerPrefix(layer) + "self_attn.";
    const int64_t d = config_.hiddenSize, H = config_.kdaHeads, K = config_.kdaHeadDim;
    const int64_t channels = H * K, W = config_.convKernelSize;
    auto project = [&](const std::string &name, int64_t in, int64_t out,
                       const std::vector<float> &input) {
      std::vector<float> y(T * out);
      linear(input, weights_[p + name], y, T, in, out);
      return y;
    };

    // 1. q, k, v projections, each through its short causal conv + SiLU (conv state carried).
    std::vector<float> q(T * channels), k(T * channels), v(T * channels);
    shortConvSilu(project("q_proj.weight", d, channels, x), weights_[p + "q_conv1d.weight"],
                  state.convQ, q, T, channels, W);
    shortConvSilu(project("k_proj.weight", d, channels, x), weights_[p + "k_conv1d.weight"],
                  state.convK, k, T, channels, W);
    shortConvSilu(project("v_proj.weight", d, channels, x), weights_[p + "v_conv1d.weight"],
                  state.convV, v, T, channels, W);
    // 2. per-head l2 norm of q and k (eps 1e-6 on the sum of squares); 3. the K^−1/2 scale is
    // KdaParams' default.
    l2NormalizeRows(q, T * H, K);
    l2NormalizeRows(k, T * H, K);
    // 4. forget gate from the low-rank f_a → f_b projection.
    const std::vector<float> f =
        project("f_b_proj.weight", K, channels, project("f_a_proj.weight", d, K, x));
    std::vector<float> g(T * channels);
    kdaGate(f, weights_[p + "A_log"], weights_[p + "dt_bias"], g, T, H, K);
    // 5. β = σ(b_proj x).
    std::vector<float> beta = project("b_proj.weight", d, H, x);
    kdaBeta(beta);
    // 6. the delta-rule core: one recurrent step when decoding, the chunked form for a prefill.
    std::vector<float> o(T * channels);
    const KdaParams params{T,
                           H,
                           K,
                           K,
                           0.0f,
                           q.data(),
                           k.data(),
                           v.data(),
                           g.data(),
                           beta.data(),
                           state.recurrent.data(),
                           o.data()};
    if (T == 1 && pastLength > 0)
      kdaRecurrent(params);
    else
      kdaChunked(params, 64);
    // 7. per-head gated RMSNorm with the low-rank output gate, then o_proj.
    const std::vector<float> gate =
        project("g_b_proj.weight", K, channels, project("g_a_proj.weight", d, K, x));
    gatedRmsNorm(o, gate, weights_[p + "o_norm.weight"], o, T * H, K, config_.rmsNormEps,
                 numerics_.kdaOutputGate);
    return project("o_proj.weight", channels, d, o);
  }

  // MLA mixer (MODEL_SPEC §3.2), with the DSA indexer choosing the attended positions (§4).
  std::vector<float> mla(int64_t layer, const std::vector<float> &x, int64_t T, MlaCache &cache,
                         int64_t pastLength) const {
    const std::string p = layerPrefix(layer) + "self_attn.";
    const ModelConfig &c = config_;
    const int64_t d = c.hiddenSize, H = c.mlaHeads, qkDim = c.nopeDim + c.ropeDim;
    const float latentEps = numerics_.latentNormEps.value_or(c.rmsNormEps);

    // Queries [T, H, nope | rope], directly or through the q LoRA (whose latent the indexer
    // shares).
    std::vector<float> queries(T * H * qkDim), queryLatent;
    if (c.qLoraRank > 0) {
      queryLatent.resize(T * c.qLoraRank);
      linear(x, weights_[p + "q_a_proj.weight"], queryLatent, T, d, c.qLoraRank);
      rmsNorm(queryLatent, weights_[p + "q_a_layernorm.weight"], queryLatent, T, c.qLoraRank,
              latentEps);
      linear(queryLatent, weights_[p + "q_b_proj.weight"], queries, T, c.qLoraRank, H * qkDim);
    } else {
      linear(x, weights_[p + "q_proj.weight"], queries, T, d, H * qkDim);
    }
    // Latent c (normalised) and the shared rope key, appended to the cache.
    std::vector<float> kvA(T * (c.kvLoraRank + c.ropeDim));
    linear(x, weights_[p + "kv_a_proj_with_mqa.weight"], kvA, T, d, c.kvLoraRank + c.ropeDim);
    const std::vector<float> inverseFrequencies = ropeFrequencies();
    const RopeLayout mlaRope = c.useRope ? numerics_.mlaRope : RopeLayout::None;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t position = pastLength + t;
      float *row = kvA.data() + t * (c.kvLoraRank + c.ropeDim);
      rmsNorm({row, size_t(c.kvLoraRank)}, weights_[p + "kv_a_layernorm.weight"],
              {row, size_t(c.kvLoraRank)}, 1, c.kvLoraRank, latentEps);
      applyRope({row + c.kvLoraRank, size_t(c.ropeDim)}, position, inverseFrequencies, mlaRope);
      cache.latents.insert(cache.latents.end(), row, row + c.kvLoraRank);
      cache.ropeKeys.insert(cache.ropeKeys.end(), row + c.kvLoraRank,
                            row + c.kvLoraRank + c.ropeDim);
      for (int64_t h = 0; h < H; ++h)
        applyRope({queries.data() + (t * H + h) * qkDim + c.nopeDim, size_t(c.ropeDim)}, position,
                  inverseFrequencies, mlaRope);
    }
    const int64_t numKeys = pastLength + T;
    std::vector<int64_t> positions(T);
    for (int64_t t = 0; t < T; ++t)
      positions[t] = pastLength + t;

    MlaAttentionParams attention;
    attention.numQueries = T;
    attention.numKeys = numKeys;
    attention.numHeads = H;
    attention.nopeDim = c.nopeDim;
    attention.ropeDim = c.ropeDim;
    attention.valueDim = c.valueDim;
    attention.latentDim = c.kvLoraRank;
    attention.softmaxScale = softmaxScale();
    attention.queries = queries.data();
    attention.queryPositions = positions.data();
    attention.latents = cache.latents.data();
    attention.ropeKeys = cache.ropeKeys.data();
    attention.kvBProj = weights_[p + "kv_b_proj.weight"].data();
    std::vector<int32_t> selected;
    if (c.hasIndexer && !numerics_.denseInsteadOfSparse) {
      selected = indexerTopK(p + "indexer.", x, queryLatent, T, cache, positions);
      attention.sparseIndices = selected.data();
      attention.topK = c.indexTopK;
    }
    std::vector<float> out(T * H * c.valueDim), y(T * d);
    attention.out = out.data();
    mlaAttention(attention);
    linear(out, weights_[p + "o_proj.weight"], y, T, H * c.valueDim, d);
    return y;
  }

  // Lightning indexer (MODEL_SPEC §4.2): scores every cached position, keeps the causal top-k.
  std::vector<int32_t> indexerTopK(const std::string &p, const std::vector<float> &x,
                                   const std::vector<float> &queryLatent, int64_t T,
                                   MlaCache &cache, const std::vector<int64_t> &positions) const {
    const ModelConfig &c = config_;
    const int64_t d = c.hiddenSize, Hi = c.indexHeads, Di = c.indexHeadDim;
    const std::vector<float> inverseFrequencies = ropeFrequencies();
    // Queries from the shared q latent; keys from x through LayerNorm. RoPE on the first ropeDim
    // values of each head (rope first here, unlike MLA).
    std::vector<float> queries(T * Hi * Di), keys(T * Di), headWeights(T * Hi);
    linear(queryLatent, weights_[p + "wq_b.weight"], queries, T, c.qLoraRank, Hi * Di);
    linear(x, weights_[p + "wk.weight"], keys, T, d, Di);
    layerNorm(keys, weights_[p + "k_norm.weight"], weights_[p + "k_norm.bias"], keys, T, Di,
              numerics_.indexerKeyNormEps);
    linear(x, weights_[p + "weights_proj.weight"], headWeights, T, d, Hi);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < Hi; ++j)
        applyRope({queries.data() + (t * Hi + j) * Di, size_t(c.ropeDim)}, positions[t],
                  inverseFrequencies, numerics_.indexerRope);
      applyRope({keys.data() + t * Di, size_t(c.ropeDim)}, positions[t], inverseFrequencies,
                numerics_.indexerRope);
    }
    cache.indexerKeys.insert(cache.indexerKeys.end(), keys.begin(), keys.end());

    const int64_t numKeys = static_cast<int64_t>(cache.indexerKeys.size()) / Di;
    std::vector<float> scores(T * numKeys);
    indexerScores({T, numKeys, Hi, Di, queries.data(), cache.indexerKeys.data(), headWeights.data(),
                   positions.data(), scores.data()});
    std::vector<int32_t> selected(T * c.indexTopK);
    topKIndices(scores, T, numKeys, c.indexTopK, selected);
    return selected;
  }

  std::vector<float> ropeFrequencies() const {
    return config_.yarn ? yarnInverseFrequencies(config_.ropeDim, config_.ropeTheta, *config_.yarn)
                        : ropeInverseFrequencies(config_.ropeDim, config_.ropeTheta);
  }

  float softmaxScale() const {
    double scale = 1.0 / std::sqrt(double(config_.nopeDim + config_.ropeDim));
    if (config_.yarn && config_.yarn->mscaleAllDim != 0.0) {
      const double m = yarnMscale(config_.yarn->factor, config_.yarn->mscaleAllDim);
      scale *= m * m;
    }
    return static_cast<float>(scale);
  }

  // Dense SwiGLU MLP or MoE (MODEL_SPEC §5).
  std::vector<float> ffn(int64_t layer, const std::vector<float> &x, int64_t T) const {
    const ModelConfig &c = config_;
    const int64_t d = c.hiddenSize;
    const std::string prefix = layerPrefix(layer);
    std::vector<float> out(T * d);
    if (c.ffns[layer] == Ffn::Dense) {
      swiGluMlp(x, T,
                swiGlu(prefix + "mlp.", "gate_proj", "up_proj", "down_proj", c.intermediateSize),
                out);
      return out;
    }
    const std::string p = prefix + c.moePrefix + ".";
    std::vector<float> routerLogits(T * c.numExperts);
    linear(x, weights_[p + "gate.weight"], routerLogits, T, d, c.numExperts);
    RouterParams router;
    router.numExperts = c.numExperts;
    router.topK = c.expertsPerToken;
    router.numGroups = c.numGroups;
    router.topKGroups = c.topKGroups;
    router.scoring = c.scoring;
    if (weights_.contains(p + "gate.e_score_correction_bias"))
      router.correctionBias = weights_[p + "gate.e_score_correction_bias"];
    router.renormalize = c.renormalize;
    router.routedScalingFactor = c.routedScalingFactor;
    router.weightsFromBiasedScores = numerics_.routerWeightsFromBiasedScores;
    std::vector<int32_t> expertIds(T * c.expertsPerToken);
    std::vector<float> expertWeights(T * c.expertsPerToken);
    routeTokens(routerLogits, T, router, expertIds, expertWeights);

    std::vector<SwiGluWeights> experts;
    for (int64_t e = 0; e < c.numExperts; ++e)
      experts.push_back(swiGlu(p + "experts." + std::to_string(e) + ".", c.expertGate, c.expertUp,
                               c.expertDown, c.moeIntermediateSize));
    std::vector<SwiGluWeights> shared;
    if (c.numSharedExperts > 0)
      shared.push_back(swiGlu(p + "shared_experts.", "gate_proj", "up_proj", "down_proj",
                              c.moeIntermediateSize * c.numSharedExperts));
    moeExperts(x, T, d, expertIds, expertWeights, c.expertsPerToken, experts, shared, out);
    return out;
  }

  SwiGluWeights swiGlu(const std::string &p, const std::string &gate, const std::string &up,
                       const std::string &down, int64_t intermediate) const {
    return {weights_[p + gate + ".weight"], weights_[p + up + ".weight"],
            weights_[p + down + ".weight"], config_.hiddenSize, intermediate, std::nullopt};
  }

  static void addInPlace(std::vector<float> &h, const std::vector<float> &delta) {
    for (size_t i = 0; i < h.size(); ++i)
      h[i] += delta[i];
  }

  ModelConfig config_;
  Checkpoint weights_;
  Numerics numerics_;
};

// ---- Golden data
// ---------------------------------------------------------------------------------

struct Golden {
  std::vector<int64_t> inputIds, genIds;
  std::vector<float> logits, genLogits;
  std::vector<std::vector<float>> hidden; // hidden.0, hidden.1, ...

  explicit Golden(const std::string &model) {
    const st::File file = openSafetensors(dataPath(model, "golden.safetensors"));
    inputIds = readInts(file, "input_ids");
    genIds = readInts(file, "gen_ids");
    logits = readFloats(file, "logits");
    genLogits = readFloats(file, "gen_logits");
    for (int i = 0; file.find("hidden." + std::to_string(i)); ++i)
      hidden.push_back(readFloats(file, "hidden." + std::to_string(i)));
  }
};

int64_t argmaxLastRow(const std::vector<float> &logits, int64_t vocab) {
  auto last = logits.end() - vocab;
  return std::max_element(last, logits.end()) - last;
}

// Greedy decoding. Without cache every step re-runs the whole sequence (as the golden gen_ids were
// made); with cache the prompt is prefilled once and each new token is one decode step.
struct Generation {
  std::vector<int64_t> ids;
  std::vector<std::vector<float>> logits; // the row that chose each id
};

Generation generate(const ReferenceModel &model, const std::vector<int64_t> &prompt, size_t steps,
                    bool useCache) {
  const int64_t vocab = model.config().vocabSize;
  Generation result;
  std::vector<int64_t> sequence = prompt;
  SequenceState state = model.newSequence();
  std::vector<float> logits = model.forward(sequence, state);
  for (size_t step = 0; step < steps; ++step) {
    const int64_t next = argmaxLastRow(logits, vocab);
    result.ids.push_back(next);
    result.logits.emplace_back(logits.end() - vocab, logits.end());
    sequence.push_back(next);
    if (step + 1 == steps)
      break;
    if (useCache) {
      logits = model.forward(std::span(&sequence.back(), 1), state);
    } else {
      state = model.newSequence();
      logits = model.forward(sequence, state);
    }
  }
  return result;
}

// ---- Tests
// ---------------------------------------------------------------------------------------

class GoldenForward : public ::testing::TestWithParam<std::string> {};

std::string modelName(const ::testing::TestParamInfo<std::string> &info) { return info.param; }

TEST_P(GoldenForward, PromptLogitsAndHiddenStatesMatch) {
  const std::string name = GetParam();
  const Golden golden(name);
  const ReferenceModel model(name);
  SequenceState state = model.newSequence();
  Stages stages;
  const std::vector<float> logits = model.forward(golden.inputIds, state, &stages);

  // Map our stages onto hidden.<i>: the plain models' golden lists omit the last layer's raw output
  // (its last entry is after the final norm); the AttnRes one keeps every layer.
  std::vector<size_t> stageForHidden(golden.hidden.size());
  for (size_t i = 0; i < golden.hidden.size(); ++i)
    stageForHidden[i] = i + 1 == golden.hidden.size() ? stages.entries.size() - 1 : i;
  std::string firstDiverging;
  for (size_t i = 0; i < golden.hidden.size(); ++i) {
    const auto &[stage, values] = stages.entries[stageForHidden[i]];
    const float diff = maxAbsDiff(values, golden.hidden[i]);
    std::printf("  %s hidden.%zu (%s): max abs diff %.3g\n", name.c_str(), i, stage.c_str(), diff);
    if (diff > kTolerance && firstDiverging.empty())
      firstDiverging = "hidden." + std::to_string(i) + " (" + stage + ")";
  }
  const float logitsDiff = maxAbsDiff(logits, golden.logits);
  std::printf("  %s logits: max abs diff %.3g\n", name.c_str(), logitsDiff);
  EXPECT_LE(logitsDiff, kTolerance) << "first diverging: " << firstDiverging;
  EXPECT_TRUE(firstDiverging.empty()) << "first diverging: " << firstDiverging;
}

// The worst max-abs difference between the logits rows that chose each token and gen_logits.
float worstGenLogitsDiff(const Generation &generation, const Golden &golden, int64_t vocab) {
  float worst = 0.0f;
  for (size_t i = 0; i < generation.logits.size(); ++i)
    worst = std::max(worst, maxAbsDiff(generation.logits[i],
                                       std::span(golden.genLogits).subspan(i * vocab, vocab)));
  return worst;
}

TEST_P(GoldenForward, GreedyFullReforwardsMatchGenIds) {
  const std::string name = GetParam();
  const Golden golden(name);
  const ReferenceModel model(name);
  const Generation generation = generate(model, golden.inputIds, golden.genIds.size(), false);
  EXPECT_EQ(generation.ids, golden.genIds);
  const float worst = worstGenLogitsDiff(generation, golden, model.config().vocabSize);
  std::printf("  %s full re-forwards: max abs diff to gen_logits %.3g\n", name.c_str(), worst);
  EXPECT_LE(worst, kTolerance);
}

// Prefill once, then one token per forward through the carried KDA states, MLA latent caches and
// indexer key caches.
TEST_P(GoldenForward, CachedDecodingMatchesGenIds) {
  const std::string name = GetParam();
  const Golden golden(name);
  const ReferenceModel model(name);
  const Generation cached = generate(model, golden.inputIds, golden.genIds.size(), true);
  EXPECT_EQ(cached.ids, golden.genIds);
  const float worst = worstGenLogitsDiff(cached, golden, model.config().vocabSize);
  std::printf("  %s cached decoding: max abs diff to gen_logits %.3g\n", name.c_str(), worst);
  EXPECT_LE(worst, kTolerance);
}

// The evidence behind kernels/ref/NUMERICS.md: each open numerics question answered by running the
// prompt with the other choice. A wrong choice that matters moves the logits by O(1); choices the
// golden data cannot tell apart are only reported.
TEST(GoldenNumerics, AlternativeChoicesAreRuledOut) {
  struct Alternative {
    std::string model, what;
    void (*change)(Numerics &);
    bool distinguishable; // expected to miss the golden logits by far more than the tolerance
  };
  const std::vector<Alternative> alternatives = {
      {"kimi_linear_tiny", "router weights from biased scores",
       [](Numerics &n) { n.routerWeightsFromBiasedScores = true; }, true},
      {"kimi_linear_tiny", "KDA output gate silu",
       [](Numerics &n) { n.kdaOutputGate = GateActivation::Silu; }, true},
      {"kimi_linear_tiny", "kv_a_layernorm eps = rms_norm_eps (1e-5)",
       [](Numerics &n) { n.latentNormEps.reset(); }, false},
      {"deepseek_v32_tiny", "MLA rope half-split",
       [](Numerics &n) { n.mlaRope = RopeLayout::HalfSplit; }, true},
      {"deepseek_v32_tiny", "indexer rope interleaved",
       [](Numerics &n) { n.indexerRope = RopeLayout::Interleaved; }, true},
      {"deepseek_v32_tiny", "indexer without rope",
       [](Numerics &n) { n.indexerRope = RopeLayout::None; }, true},
      {"deepseek_v32_tiny", "dense attention (indexer ignored)",
       [](Numerics &n) { n.denseInsteadOfSparse = true; }, true},
      {"deepseek_v32_tiny", "router weights from biased scores",
       [](Numerics &n) { n.routerWeightsFromBiasedScores = true; }, true},
      {"deepseek_v32_tiny", "q/kv latent norm eps 1e-5",
       [](Numerics &n) { n.latentNormEps = 1e-5f; }, false},
      {"deepseek_v32_tiny", "indexer k_norm eps 1e-5",
       [](Numerics &n) { n.indexerKeyNormEps = 1e-5f; }, false},
      {"kimi_attnres_tiny", "router weights from biased scores",
       [](Numerics &n) { n.routerWeightsFromBiasedScores = true; }, true},
      {"kimi_attnres_tiny", "KDA output gate silu",
       [](Numerics &n) { n.kdaOutputGate = GateActivation::Silu; }, true},
  };
  std::map<std::string, Golden> goldens;
  auto promptDiff = [&](const std::string &name, const Numerics &numerics) {
    if (!goldens.count(name))
      goldens.emplace(name, Golden(name));
    const Golden &golden = goldens.at(name);
    const ReferenceModel model(name, numerics);
    SequenceState state = model.newSequence();
    return maxAbsDiff(model.forward(golden.inputIds, state), golden.logits);
  };
  for (std::string name : {"kimi_linear_tiny", "deepseek_v32_tiny", "kimi_attnres_tiny"}) {
    const float diff = promptDiff(name, Numerics{});
    std::printf("  %-18s %-42s logits max abs diff %.3g\n", name.c_str(), "(chosen numerics)",
                diff);
    EXPECT_LE(diff, kTolerance) << name;
  }
  for (const Alternative &alternative : alternatives) {
    Numerics numerics;
    alternative.change(numerics);
    const float diff = promptDiff(alternative.model, numerics);
    std::printf("  %-18s %-42s logits max abs diff %.3g\n", alternative.model.c_str(),
                alternative.what.c_str(), diff);
    if (alternative.distinguishable) {
      EXPECT_GT(diff, 0.1f) << alternative.model << ": " << alternative.what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, GoldenForward,
                         ::testing::Values("kimi_linear_tiny", "deepseek_v32_tiny",
                                           "kimi_attnres_tiny"),
                         modelName);

} // namespace
} // namespace hybrid::kernels::ref
