// Synthetic Hugging Face checkpoints: random weights in exactly the published Hub layout
// (config.json, sharded model-0000K-of-0000N.safetensors, model.safetensors.index.json, original
// tensor names) for Kimi-Linear (optionally with Block AttnRes and the Kimi K3 gates), DeepSeek-V3.2
// and the generic hybrid layout (docs/generic-hybrid.md: any mix of KDA, MLA and MLA+DSA layers,
// dense or MoE feed-forwards, optional Block AttnRes). They feed
// importer tests at tiny sizes and load / throughput benchmarks at the published sizes without
// downloading hundreds of GB.
//
// Values come from a self-contained generator (splitmix64 + Box-Muller, seeded per tensor from the
// seed and the tensor name), so the files are byte-identical on every machine, and a tensor's
// values do not depend on the shard size, the thread count or the other tensors.
#pragma once

#include "hybrid/kernels/SyntheticWeights.h"
#include "hybrid/runtime/Safetensors.h"
#include "hybrid/runtime/Status.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hybrid::synth {

// DeepSeek-V3.2's `rope_scaling` object ("type": "yarn").
struct YarnRopeScaling {
  double factor = 40.0;
  int64_t originalMaxPositionEmbeddings = 4096;
  double betaFast = 32.0;
  double betaSlow = 1.0;
  double mscale = 1.0;
  double mscaleAllDim = 1.0;
};

// Everything that decides the tensors and config.json of a synthetic checkpoint. Field names follow
// the config.json facts they produce; see MODEL_SPEC sections 1-6 for their meaning.
struct SyntheticSpec {
  std::string modelType; // "kimi_linear", "deepseek_v32" or "hybrid"

  // Model.
  int64_t hiddenSize = 0;
  int64_t vocabSize = 0;
  int64_t numLayers = 0;
  int64_t intermediateSize = 0; // dense SwiGLU MLP of the first layers
  double rmsNormEps = 1e-6;
  int64_t maxPositionEmbeddings = 0; // `model_max_length` (Kimi) / `max_position_embeddings`
  int64_t bosTokenId = 0;
  int64_t eosTokenId = 1;
  std::optional<int64_t> padTokenId;

  // MLA (Kimi's full-attention layers, every DeepSeek layer).
  int64_t numAttentionHeads = 0;
  std::optional<int64_t> qLoraRank; // nullopt: a plain q_proj (Kimi-Linear)
  int64_t kvLoraRank = 0;
  int64_t qkNopeHeadDim = 0;
  int64_t qkRopeHeadDim = 0;
  int64_t vHeadDim = 0;
  bool mlaUseNope = false; // Kimi-Linear: no RoPE in MLA
  double ropeTheta = 10000.0;
  std::optional<YarnRopeScaling> ropeScaling; // nullopt: `"rope_scaling": null`

  // KDA (kimi_linear). Layer layout: 1-based layer n is full attention (MLA) when n is a multiple
  // of fullAttentionPeriod or the last layer, otherwise KDA -- the published 3:1 pattern, which
  // stays meaningful when numLayers is overridden.
  int64_t kdaNumHeads = 0;
  int64_t kdaHeadDim = 0;
  int64_t shortConvKernelSize = 0;
  int64_t fullAttentionPeriod = 4;
  // When non-empty, the 0-based full-attention layers instead of the period rule (a config.json's
  // linear_attn_config.full_attn_layers, read by specFromConfigJson).
  std::vector<int64_t> fullAttentionLayers;

  // Kimi K3 options (MODEL_SPEC 2.1, 2.2, 7.4) of kimi_linear and hybrid KDA and MLA layers.
  std::optional<double> kdaGateLowerBound; // linear_attn_config.gate_lower_bound ("safe" gate)
  bool kdaFullRankOutputGate = false;      // linear_attn_config.use_full_rank_gate: g_proj [P, d]
  bool mlaOutputGate = false;              // mla_use_output_gate: g_proj [heads * v_head_dim, d]
  // SiTU activation (hidden_act "situ") of every gated MLP when set: activation_situ_beta and
  // activation_situ_linear_beta.
  std::optional<double> situBeta;
  std::optional<double> situLinearBeta;
  // Latent MoE (routed_expert_hidden_size): the routed experts of every MoE layer work in this
  // width between routed_expert_down_proj and routed_expert_up_proj, with routed_expert_norm when
  // latentMoeNorm (latent_moe_use_norm).
  std::optional<int64_t> latentMoeSize;
  bool latentMoeNorm = false;

  // Generic hybrid ("hybrid"): the mixer of each layer ("kda", "mla" or "mla_dsa", config
  // `layer_types`) and its feed-forward ("dense", "moe" or "latent_moe", `mlp_layer_types`; when
  // empty the
  // first_k_dense_replace / moe_layer_freq rule below decides; "latent_moe" is a MoE layer that
  // requires latentMoeSize).
  std::vector<std::string> layerTypes;
  std::vector<std::string> mlpLayerTypes;

  // DSA lightning indexer (deepseek_v32, hybrid mla_dsa layers).
  int64_t indexNumHeads = 0;
  int64_t indexHeadDim = 0;
  int64_t indexTopK = 0;

  // MoE: layer i (0-based) is MoE iff i >= firstKDenseReplace and i % moeLayerFreq == 0.
  int64_t firstKDenseReplace = 0;
  int64_t moeLayerFreq = 1;
  int64_t numExperts = 0;
  int64_t numExpertsPerToken = 0;
  int64_t numSharedExperts = 0;
  int64_t moeIntermediateSize = 0;
  int64_t numExpertGroups = 1;
  int64_t topkGroup = 1;
  bool renormalize = true; // `moe_renormalize` (Kimi) / `norm_topk_prob` (DeepSeek)
  std::string scoringFunction = "sigmoid";
  double routedScalingFactor = 1.0;

  // Block AttnRes (Kimi K3 arrangement), counted in decoder layers.
  std::optional<int64_t> attnResBlockSize;

  // DeepSeek multi-token prediction (`num_nextn_predict_layers`): each MTP layer is
  // model.layers.{numLayers + i}: enorm, hnorm, eh_proj [hidden, 2 * hidden], a full decoder block
  // shaped like a layer at that index, shared_head.norm and shared_head.head (the published
  // checkpoints also carry a copy of embed_tokens there, which is generated too).
  int64_t numNextnPredictLayers = 0;

  // Generation.
  uint64_t seed = 0;
  double weightStd = 0.06;
  // DeepSeek-V3.2 only: linear layers stored as F8_E4M3 with F32 `weight_scale_inv` block scales
  // [ceil(out/128), ceil(in/128)], as the full-size checkpoints ship.
  bool fp8Weights = false;
  // A shard is closed before it would grow past this many tensor bytes (a single larger tensor
  // gets a shard of its own). Also bounds the memory the writer holds at once.
  uint64_t maxShardBytes = 5'000'000'000;

  // kimi-linear-tiny, deepseek-v32-tiny, kimi-attnres-tiny (the shapes of tests/data),
  // hybrid-tiny (KDA, MLA+DSA, MLA, MoE and Block AttnRes in four layers), kimi-k3-tiny (Kimi K3's
  // layout in 8 layers: the K3 gates, SiTU, latent MoE, 2 shared experts, AttnRes blocks of 3), the
  // published full sizes kimi-linear-48b and deepseek-v32-671b (hundreds of GB when written), and
  // kimi-k3-slice (K3's widths in 12 layers with 64 experts, for timing).
  static StatusOr<SyntheticSpec> preset(const std::string &name);
  static std::vector<std::string> presetNames();

  // One line naming the first inconsistent field.
  Status validate() const;

  // Overrides num_hidden_layers (hybrid-synth --layers). A hybrid's layer_types repeat their
  // pattern and its mlp_layer_types are continued by their last entry, so a dense prefix stays.
  void setNumLayers(int64_t layers);

  // Layer structure (0-based layer index).
  bool isKimi() const { return modelType == "kimi_linear"; }
  bool isHybrid() const { return modelType == "hybrid"; }
  // "kda", "mla" or "mla_dsa".
  std::string mixerKind(int64_t layer) const;
  bool isFullAttentionLayer(int64_t layer) const { return mixerKind(layer) != "kda"; }
  bool isMoeLayer(int64_t layer) const;
};

// How a tensor's values are drawn.
enum class ValueKind {
  Weight,        // N(0, weightStd): linear, embedding, conv, router and AttnRes projections
  NormWeight,    // 1 + N(0, 0.1)
  Bias,          // N(0, weightStd): LayerNorm bias, router correction bias
  DecayLog,      // KDA A_log = log(U(1, 16)), fla's initialisation
  DecayTimeBias, // KDA dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1], fla's init
  BlockScale,    // the F32 block scales of an F8_E4M3 weight
};

// One tensor of the checkpoint, in file order.
struct SyntheticTensor {
  std::string name;
  safetensors::DType dtype = safetensors::DType::BF16;
  std::vector<int64_t> shape;
  ValueKind kind = ValueKind::Weight;
  uint64_t byteSize() const;
};

// Every tensor the spec produces (block scales right after their fp8 weights), in file order;
// nothing is generated, so this is cheap for the full-size presets too. Like
// syntheticConfigJson, meaningful only for a spec that passes validate().
std::vector<SyntheticTensor> listSyntheticTensors(const SyntheticSpec &spec);

// The text of config.json in the published Hub spelling.
std::string syntheticConfigJson(const SyntheticSpec &spec);

// The spec a config.json describes (kimi_linear, deepseek_v32 or hybrid, in the published spelling or
// syntheticConfigJson's), validated; `seed` is the spec's seed. Errors are one line naming `path`
// and the field. Fields that do not change the tensor list (token ids, rope) are not read.
StatusOr<SyntheticSpec> specFromConfigJson(const std::string &text, const std::string &path,
                                           uint64_t seed = 0);

// Weights generated where they are used instead of read from files (hybrid-compile
// --synthetic-weights): the generator parameters of one tensor of listSyntheticTensors(spec), for
// kernels::SyntheticFill. These values are not those of writeSyntheticCheckpoint's files (the
// same distributions, drawn so that a GPU produces the host's bits): normals are a scaled sum of
// four uniform 16-bit draws (bounded at 3.46 sigma); an F8_E4M3 weight stores codes of N(0, 1) *
// 128 and its block scales are all 3.5 * weightStd / 448, so code * scale is N(0, weightStd^2).
struct SyntheticValues {
  kernels::SyntheticKind kind = kernels::SyntheticKind::Normal;
  uint64_t key = 0; // from the spec's seed and the tensor's name
  float a = 0.0f;
  float b = 0.0f;
};
SyntheticValues syntheticValuesFor(const SyntheticSpec &spec, const SyntheticTensor &tensor);

struct SyntheticWriteOptions {
  // Replace an existing non-empty directory; only one that holds a checkpoint (config.json or
  // model.safetensors.index.json) is ever deleted.
  bool overwrite = false;
  // Tensors of a shard are generated in parallel; 0 = hardware concurrency. Output is identical
  // for every thread count.
  int threads = 0;
};

struct SyntheticShardSummary {
  std::string file;
  int64_t numTensors = 0;
  uint64_t tensorBytes = 0;
};

struct SyntheticWriteSummary {
  int64_t numTensors = 0;
  uint64_t totalTensorBytes = 0; // the index's metadata.total_size
  std::vector<SyntheticShardSummary> shards;
};

// Writes the checkpoint into `dir`: generated into a staging folder next to it, then renamed into
// place, so `dir` never holds a partial checkpoint. Shards are generated and written one at a time.
Status writeSyntheticCheckpoint(const SyntheticSpec &spec, const std::string &dir,
                                const SyntheticWriteOptions &options = {},
                                SyntheticWriteSummary *summary = nullptr);

// FP8 E4M3 ("fn": no infinities, max 448) nearest-even encoding; values beyond +-448 saturate,
// NaN maps to 0x7f.
uint8_t floatToF8E4M3(float value);

} // namespace hybrid::synth
