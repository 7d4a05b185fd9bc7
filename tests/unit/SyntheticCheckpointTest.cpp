// Tests of the synthetic checkpoint generator: the tiny presets reproduce the golden checkpoints'
// tensor lists and config facts, output is byte-deterministic, shards and index are consistent,
// FP8 mode quantizes within E4M3 precision, and the full-size presets have the published sizes.
#include "hybrid/runtime/SyntheticCheckpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <gtest/gtest.h>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <set>
#include <string>
#include <vector>

namespace hybrid::synth {
namespace {

namespace fs = std::filesystem;
using safetensors::DType;
using Json = nlohmann::json;

const std::string kDataDir = HYBRID_TEST_DATA_DIR;

std::string readWholeFile(const fs::path &path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

Json readJson(const fs::path &path) { return Json::parse(readWholeFile(path)); }

SyntheticSpec presetOrDie(const std::string &name) {
  StatusOr<SyntheticSpec> spec = SyntheticSpec::preset(name);
  EXPECT_TRUE(spec.isOk()) << spec.status().message();
  return spec.isOk() ? *spec : SyntheticSpec{};
}

// Every regular file of a folder, by name.
std::map<std::string, std::string> readFolder(const fs::path &dir) {
  std::map<std::string, std::string> files;
  for (const fs::directory_entry &entry : fs::directory_iterator(dir))
    files[entry.path().filename().string()] = readWholeFile(entry.path());
  return files;
}

class SyntheticCheckpointTest : public testing::Test {
protected:
  void SetUp() override {
    std::string pattern = (fs::path(testing::TempDir()) / "hybrid_synth_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    scratch_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(scratch_, ignored);
  }

  fs::path write(const SyntheticSpec &spec, const std::string &name,
                 SyntheticWriteOptions options = {}) {
    fs::path dir = scratch_ / name;
    Status status = writeSyntheticCheckpoint(spec, dir.string(), options);
    EXPECT_TRUE(status.isOk()) << status.message();
    return dir;
  }

  fs::path scratch_;
};

//===------------------------------------------------------------------------------------------===//
// The tiny presets are the golden checkpoints' shapes.
//===------------------------------------------------------------------------------------------===//

struct GoldenCase {
  std::string preset;
  std::string goldenDir;
};

void PrintTo(const GoldenCase &golden, std::ostream *out) { *out << golden.preset; }

class SyntheticMatchesGolden : public testing::TestWithParam<GoldenCase> {};

TEST_P(SyntheticMatchesGolden, TensorNamesShapesDtypesAndOrder) {
  // ordered_json keeps the file's key order: the module order the generator must follow too.
  const nlohmann::ordered_json golden = nlohmann::ordered_json::parse(
      readWholeFile(fs::path(kDataDir) / GetParam().goldenDir / "golden.json"));
  std::vector<SyntheticTensor> tensors = listSyntheticTensors(presetOrDie(GetParam().preset));

  const auto &keys = golden.at("checkpoint_keys");
  ASSERT_EQ(tensors.size(), keys.size());
  size_t i = 0;
  for (const auto &[name, entry] : keys.items()) {
    const SyntheticTensor &tensor = tensors[i++];
    EXPECT_EQ(tensor.name, name);
    EXPECT_EQ(tensor.shape, entry.at(0).get<std::vector<int64_t>>()) << name;
    const std::string torchDtype = entry.at(1).get<std::string>();
    EXPECT_EQ(tensor.dtype, torchDtype == "torch.float32" ? DType::F32 : DType::BF16) << name;
  }
}

// The config facts the importer reads equal the golden configs' values (where a golden config
// spells a field; the newer-transformers spellings it may carry in addition are not compared).
TEST_P(SyntheticMatchesGolden, ConfigFieldsTheImporterReads) {
  const Json golden = readJson(fs::path(kDataDir) / GetParam().goldenDir / "config.json");
  const SyntheticSpec spec = presetOrDie(GetParam().preset);
  const Json config = Json::parse(syntheticConfigJson(spec));

  std::vector<std::string> fields = {"model_type",
                                     "hidden_size",
                                     "vocab_size",
                                     "num_hidden_layers",
                                     "rms_norm_eps",
                                     "intermediate_size",
                                     "num_attention_heads",
                                     "q_lora_rank",
                                     "kv_lora_rank",
                                     "qk_nope_head_dim",
                                     "qk_rope_head_dim",
                                     "v_head_dim",
                                     "routed_scaling_factor",
                                     "moe_intermediate_size",
                                     "first_k_dense_replace",
                                     "topk_group",
                                     "moe_layer_freq",
                                     "tie_word_embeddings"};
  if (spec.isKimi()) {
    fields.insert(fields.end(),
                  {"linear_attn_config", "mla_use_nope", "num_experts", "num_experts_per_token",
                   "num_shared_experts", "num_expert_group", "moe_renormalize",
                   "moe_router_activation_func", "attn_res_block_size", "use_grouped_topk"});
  } else {
    fields.insert(fields.end(),
                  {"rope_theta", "rope_scaling", "n_routed_experts", "num_experts_per_tok",
                   "n_group", "n_shared_experts", "norm_topk_prob", "scoring_func", "index_n_heads",
                   "index_head_dim", "index_topk", "max_position_embeddings"});
  }
  int compared = 0;
  for (const std::string &field : fields) {
    if (!golden.contains(field))
      continue;
    ++compared;
    ASSERT_TRUE(config.contains(field)) << field;
    EXPECT_EQ(config.at(field), golden.at(field)) << field;
  }
  EXPECT_GE(compared, 20);
  // Defaulted by the importer when absent from the golden config; ours spells them out.
  EXPECT_EQ(config.value("torch_dtype", ""), "bfloat16");
  if (spec.isKimi())
    EXPECT_EQ(config.at("moe_router_activation_func"), "sigmoid");
  else
    EXPECT_EQ(config.at("scoring_func"), "sigmoid");
}

INSTANTIATE_TEST_SUITE_P(TinyPresets, SyntheticMatchesGolden,
                         testing::Values(GoldenCase{"kimi-linear-tiny", "kimi_linear_tiny"},
                                         GoldenCase{"deepseek-v32-tiny", "deepseek_v32_tiny"},
                                         GoldenCase{"kimi-attnres-tiny", "kimi_attnres_tiny"}),
                         [](const testing::TestParamInfo<GoldenCase> &info) {
                           std::string name = info.param.goldenDir;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

//===------------------------------------------------------------------------------------------===//
// Full-size presets: listed, never written.
//===------------------------------------------------------------------------------------------===//

uint64_t countParameters(const std::vector<SyntheticTensor> &tensors) {
  uint64_t count = 0;
  for (const SyntheticTensor &tensor : tensors) {
    uint64_t elements = 1;
    for (int64_t dim : tensor.shape)
      elements *= static_cast<uint64_t>(dim);
    count += elements;
  }
  return count;
}

TEST(SyntheticFullSizePresets, KimiLinear48bHasThePublishedLayout) {
  const SyntheticSpec spec = presetOrDie("kimi-linear-48b");
  ASSERT_TRUE(spec.validate().isOk());
  // Counted independently from MODEL_SPEC 1.2 / 2.1 / 3 / 5.1.
  EXPECT_EQ(countParameters(listSyntheticTensors(spec)), 49'122'681'728ULL);

  const Json config = Json::parse(syntheticConfigJson(spec));
  EXPECT_EQ(config.at("linear_attn_config").at("full_attn_layers"),
            Json::array({4, 8, 12, 16, 20, 24, 27}));
  EXPECT_EQ(config.at("linear_attn_config").at("kda_layers"),
            Json::array({1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26}));
  EXPECT_EQ(config.at("q_lora_rank"), nullptr);
  EXPECT_EQ(config.at("num_experts"), 256);
  EXPECT_EQ(config.at("vocab_size"), 163840);
  EXPECT_EQ(config.at("head_dim"), 72);
}

TEST(SyntheticFullSizePresets, DeepSeekV32_671bHasThePublishedLayout) {
  SyntheticSpec spec = presetOrDie("deepseek-v32-671b");
  ASSERT_TRUE(spec.validate().isOk());
  // 671.03 B of DeepSeek-V3 plus 61 lightning indexers (MODEL_SPEC 1.3 / 4.1).
  EXPECT_EQ(countParameters(listSyntheticTensors(spec)), 671'877'944'064ULL);

  const Json config = Json::parse(syntheticConfigJson(spec));
  EXPECT_EQ(config.at("rope_scaling"), Json({{"type", "yarn"},
                                             {"factor", 40.0},
                                             {"original_max_position_embeddings", 4096},
                                             {"beta_fast", 32.0},
                                             {"beta_slow", 1.0},
                                             {"mscale", 1.0},
                                             {"mscale_all_dim", 1.0}}));
  EXPECT_EQ(config.at("first_k_dense_replace"), 3);
  EXPECT_EQ(config.at("n_group"), 8);
  EXPECT_EQ(config.at("topk_group"), 4);
  EXPECT_FALSE(config.contains("quantization_config"));

  spec.fp8Weights = true;
  const Json fp8Config = Json::parse(syntheticConfigJson(spec));
  EXPECT_EQ(fp8Config.at("quantization_config").at("weight_block_size"), Json::array({128, 128}));
  bool sawScale = false;
  for (const SyntheticTensor &tensor : listSyntheticTensors(spec))
    if (tensor.name == "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv") {
      sawScale = true;
      EXPECT_EQ(tensor.shape, (std::vector<int64_t>{5, 56})); // [576, 7168] in 128x128 blocks
      EXPECT_EQ(tensor.dtype, DType::F32);
    }
  EXPECT_TRUE(sawScale);
}

TEST(SyntheticFullSizePresets, LayerCountOverrideKeepsThePattern) {
  SyntheticSpec spec = presetOrDie("kimi-linear-48b");
  spec.numLayers = 6;
  const Json config = Json::parse(syntheticConfigJson(spec));
  EXPECT_EQ(config.at("num_hidden_layers"), 6);
  EXPECT_EQ(config.at("linear_attn_config").at("full_attn_layers"), Json::array({4, 6}));
  EXPECT_EQ(config.at("linear_attn_config").at("kda_layers"), Json::array({1, 2, 3, 5}));

  int layerFiveTensors = 0;
  for (const SyntheticTensor &tensor : listSyntheticTensors(spec)) {
    EXPECT_EQ(tensor.name.rfind("model.layers.6.", 0), std::string::npos) << tensor.name;
    layerFiveTensors += tensor.name.rfind("model.layers.5.", 0) == 0;
  }
  EXPECT_GT(layerFiveTensors, 0);
}

TEST(SyntheticSpecValidation, RejectsInconsistentSpecs) {
  EXPECT_FALSE(SyntheticSpec::preset("llama-tiny").isOk());
  EXPECT_NE(SyntheticSpec::preset("llama-tiny").status().message().find("kimi-linear-tiny"),
            std::string::npos);

  SyntheticSpec kimi = presetOrDie("kimi-linear-tiny");
  kimi.fp8Weights = true;
  EXPECT_NE(kimi.validate().message().find("deepseek_v32"), std::string::npos);

  SyntheticSpec noLayers = presetOrDie("deepseek-v32-tiny");
  noLayers.numLayers = 0;
  EXPECT_EQ(noLayers.validate().message(),
            "synthetic spec: 'num_hidden_layers' must be positive, got 0");

  SyntheticSpec topK = presetOrDie("deepseek-v32-tiny");
  topK.numExpertsPerToken = 9;
  EXPECT_FALSE(topK.validate().isOk());

  SyntheticSpec attnRes = presetOrDie("deepseek-v32-tiny");
  attnRes.attnResBlockSize = 2;
  EXPECT_FALSE(attnRes.validate().isOk());
}

//===------------------------------------------------------------------------------------------===//
// The generic hybrid layout and the Kimi K3 gates.
//===------------------------------------------------------------------------------------------===//

bool hasTensor(const std::vector<SyntheticTensor> &tensors, const std::string &name) {
  return std::any_of(tensors.begin(), tensors.end(),
                     [&](const SyntheticTensor &tensor) { return tensor.name == name; });
}

TEST(SyntheticHybrid, EachLayerHasTheTensorsOfItsKinds) {
  const SyntheticSpec spec = presetOrDie("hybrid-tiny");
  ASSERT_TRUE(spec.validate().isOk()) << spec.validate().message();
  const std::vector<SyntheticTensor> tensors = listSyntheticTensors(spec);
  const std::string layer = "model.layers.";
  // kda, mla_dsa, kda, mla.
  for (int i : {0, 2}) {
    EXPECT_TRUE(hasTensor(tensors, layer + std::to_string(i) + ".self_attn.A_log"));
    EXPECT_FALSE(hasTensor(tensors, layer + std::to_string(i) + ".self_attn.kv_b_proj.weight"));
  }
  for (int i : {1, 3}) {
    EXPECT_TRUE(hasTensor(tensors, layer + std::to_string(i) + ".self_attn.q_a_proj.weight"));
    EXPECT_FALSE(hasTensor(tensors, layer + std::to_string(i) + ".self_attn.A_log"));
  }
  EXPECT_TRUE(hasTensor(tensors, layer + "1.self_attn.indexer.wk.weight"));
  EXPECT_FALSE(hasTensor(tensors, layer + "3.self_attn.indexer.wk.weight"));
  // dense, then MoE in DeepSeek's names.
  EXPECT_TRUE(hasTensor(tensors, layer + "0.mlp.gate_proj.weight"));
  EXPECT_FALSE(hasTensor(tensors, layer + "0.mlp.gate.weight"));
  for (int i : {1, 2, 3})
    EXPECT_TRUE(hasTensor(tensors, layer + std::to_string(i) + ".mlp.experts.7.down_proj.weight"));
  EXPECT_TRUE(hasTensor(tensors, "model.output_attn_res_proj.weight"));
  EXPECT_TRUE(hasTensor(tensors, layer + "3.mlp_res_norm.weight"));

  const Json config = Json::parse(syntheticConfigJson(spec));
  EXPECT_EQ(config.at("layer_types"), Json::array({"kda", "mla_dsa", "kda", "mla"}));
  EXPECT_EQ(config.at("mlp_layer_types"), Json::array({"dense", "moe", "moe", "moe"}));
  // The list decides; a prefix rule beside it would be a second, possibly disagreeing, source.
  EXPECT_FALSE(config.contains("first_k_dense_replace"));
  EXPECT_EQ(config.at("attn_res_block_size"), 2);
}

TEST(SyntheticHybrid, LayerOverrideRepeatsThePattern) {
  SyntheticSpec spec = presetOrDie("hybrid-tiny");
  spec.setNumLayers(7);
  ASSERT_TRUE(spec.validate().isOk()) << spec.validate().message();
  EXPECT_EQ(spec.layerTypes,
            (std::vector<std::string>{"kda", "mla_dsa", "kda", "mla", "kda", "mla_dsa", "kda"}));
  EXPECT_EQ(spec.mlpLayerTypes.size(), 7u);
  EXPECT_EQ(spec.mlpLayerTypes.front(), "dense");
  EXPECT_EQ(spec.mlpLayerTypes.back(), "moe");
  spec.setNumLayers(2);
  EXPECT_EQ(spec.layerTypes, (std::vector<std::string>{"kda", "mla_dsa"}));
}

TEST(SyntheticHybrid, RejectsBadLayerLists) {
  SyntheticSpec kind = presetOrDie("hybrid-tiny");
  kind.layerTypes[2] = "mamba";
  EXPECT_EQ(kind.validate().message(),
            "synthetic spec: 'layer_types'[2] = 'mamba' is not a mixer kind (kda, mla, mla_dsa)");
  SyntheticSpec length = presetOrDie("hybrid-tiny");
  length.mlpLayerTypes.pop_back();
  EXPECT_EQ(length.validate().message(),
            "synthetic spec: 'mlp_layer_types' lists 3 layers but num_hidden_layers = 4");
  SyntheticSpec noLora = presetOrDie("hybrid-tiny");
  noLora.qLoraRank.reset();
  EXPECT_NE(noLora.validate().message().find("'q_lora_rank'"), std::string::npos);
  SyntheticSpec kimiLists = presetOrDie("kimi-linear-tiny");
  kimiLists.layerTypes = {"kda", "kda", "kda", "mla"};
  EXPECT_NE(kimiLists.validate().message().find("hybrid option"), std::string::npos);
  // A hybrid without KDA layers needs no KDA fields.
  SyntheticSpec noKda = presetOrDie("hybrid-tiny");
  noKda.layerTypes = {"mla_dsa", "mla_dsa", "mla", "mla"};
  noKda.kdaNumHeads = 0;
  EXPECT_TRUE(noKda.validate().isOk()) << noKda.validate().message();
  StatusOr<SyntheticSpec> read = specFromConfigJson(syntheticConfigJson(noKda), "config.json");
  ASSERT_TRUE(read.isOk()) << read.status().message();
  EXPECT_EQ(read->layerTypes, noKda.layerTypes);
}

TEST(SyntheticKimiK3Gates, TensorsAndConfigFields) {
  for (const char *preset : {"kimi-linear-tiny", "hybrid-tiny"}) {
    SCOPED_TRACE(preset);
    SyntheticSpec spec = presetOrDie(preset);
    spec.kdaGateLowerBound = -5.0;
    spec.kdaFullRankOutputGate = true;
    spec.mlaOutputGate = true;
    ASSERT_TRUE(spec.validate().isOk()) << spec.validate().message();
    const std::vector<SyntheticTensor> tensors = listSyntheticTensors(spec);
    // Layer 0 is KDA, layer 3 MLA in both presets.
    auto shapeOf = [&](const std::string &name) {
      for (const SyntheticTensor &tensor : tensors)
        if (tensor.name == name)
          return tensor.shape;
      return std::vector<int64_t>{};
    };
    EXPECT_EQ(shapeOf("model.layers.0.self_attn.g_proj.weight"),
              (std::vector<int64_t>{spec.kdaNumHeads * spec.kdaHeadDim, spec.hiddenSize}));
    EXPECT_FALSE(hasTensor(tensors, "model.layers.0.self_attn.g_a_proj.weight"));
    EXPECT_EQ(shapeOf("model.layers.3.self_attn.g_proj.weight"),
              (std::vector<int64_t>{spec.numAttentionHeads * spec.vHeadDim, spec.hiddenSize}));
    const Json config = Json::parse(syntheticConfigJson(spec));
    EXPECT_EQ(config.at("linear_attn_config").at("gate_lower_bound"), -5.0);
    EXPECT_EQ(config.at("linear_attn_config").at("use_full_rank_gate"), true);
    EXPECT_EQ(config.at("mla_use_output_gate"), true);
    StatusOr<SyntheticSpec> read = specFromConfigJson(config.dump(), "config.json");
    ASSERT_TRUE(read.isOk()) << read.status().message();
    EXPECT_EQ(read->kdaGateLowerBound, std::optional<double>(-5.0));
    EXPECT_TRUE(read->kdaFullRankOutputGate);
    EXPECT_TRUE(read->mlaOutputGate);
    std::vector<std::string> names, readNames;
    for (const SyntheticTensor &tensor : tensors)
      names.push_back(tensor.name);
    for (const SyntheticTensor &tensor : listSyntheticTensors(*read))
      readNames.push_back(tensor.name);
    EXPECT_EQ(readNames, names);
  }
  SyntheticSpec positive = presetOrDie("kimi-linear-tiny");
  positive.kdaGateLowerBound = 1.0;
  EXPECT_NE(positive.validate().message().find("gate_lower_bound"), std::string::npos);
  SyntheticSpec deepseek = presetOrDie("deepseek-v32-tiny");
  deepseek.mlaOutputGate = true;
  EXPECT_FALSE(deepseek.validate().isOk());
}

TEST(SyntheticKimiK3FeedForward, LatentExpertsAndSituConfig) {
  const SyntheticSpec spec = presetOrDie("kimi-k3-tiny");
  ASSERT_TRUE(spec.validate().isOk()) << spec.validate().message();
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const SyntheticTensor &tensor : listSyntheticTensors(spec))
    shapes[tensor.name] = tensor.shape;
  const std::string moe = "model.layers.1.block_sparse_moe.";
  // Routed experts in the latent width (128), shared experts at full width (256).
  EXPECT_EQ(shapes[moe + "experts.0.w1.weight"], (std::vector<int64_t>{64, 128}));
  EXPECT_EQ(shapes[moe + "experts.15.w2.weight"], (std::vector<int64_t>{128, 64}));
  EXPECT_EQ(shapes[moe + "routed_expert_down_proj.weight"], (std::vector<int64_t>{128, 256}));
  EXPECT_EQ(shapes[moe + "routed_expert_up_proj.weight"], (std::vector<int64_t>{256, 128}));
  EXPECT_EQ(shapes[moe + "routed_expert_norm.weight"], (std::vector<int64_t>{128}));
  EXPECT_EQ(shapes[moe + "shared_experts.gate_proj.weight"], (std::vector<int64_t>{128, 256}));
  EXPECT_EQ(shapes.count("model.layers.0.mlp.routed_expert_down_proj.weight"), 0u);
  const Json config = Json::parse(syntheticConfigJson(spec));
  EXPECT_EQ(config.at("hidden_act"), "situ");
  EXPECT_EQ(config.at("activation_situ_beta"), 4.0);
  EXPECT_EQ(config.at("activation_situ_linear_beta"), 25.0);
  EXPECT_EQ(config.at("routed_expert_hidden_size"), 128);
  EXPECT_EQ(config.at("latent_moe_use_norm"), true);
  StatusOr<SyntheticSpec> read = specFromConfigJson(config.dump(), "config.json");
  ASSERT_TRUE(read.isOk()) << read.status().message();
  EXPECT_EQ(read->situBeta, std::optional<double>(4.0));
  EXPECT_EQ(read->situLinearBeta, std::optional<double>(25.0));
  EXPECT_EQ(read->latentMoeSize, std::optional<int64_t>(128));
  EXPECT_TRUE(read->latentMoeNorm);

  Json noBeta = config;
  noBeta.erase("activation_situ_beta");
  StatusOr<SyntheticSpec> refused = specFromConfigJson(noBeta.dump(), "/m/config.json");
  ASSERT_FALSE(refused.isOk());
  EXPECT_EQ(refused.status().message(),
            "/m/config.json: synthetic spec: 'activation_situ_beta' must be positive");
  SyntheticSpec latentKind = presetOrDie("hybrid-tiny");
  latentKind.mlpLayerTypes[2] = "latent_moe";
  EXPECT_NE(latentKind.validate().message().find("routed_expert_hidden_size"), std::string::npos);
  latentKind.latentMoeSize = 64;
  EXPECT_TRUE(latentKind.validate().isOk()) << latentKind.validate().message();
}

//===------------------------------------------------------------------------------------------===//
// Written checkpoints.
//===------------------------------------------------------------------------------------------===//

TEST_F(SyntheticCheckpointTest, IndexShardsAndTensorsAreConsistent) {
  SyntheticSpec spec = presetOrDie("kimi-linear-tiny");
  spec.maxShardBytes = 1 << 20;
  SyntheticWriteSummary summary;
  const fs::path dir = scratch_ / "kimi";
  ASSERT_TRUE(writeSyntheticCheckpoint(spec, dir.string(), {}, &summary).isOk());

  const std::vector<SyntheticTensor> expected = listSyntheticTensors(spec);
  const Json index = readJson(dir / "model.safetensors.index.json");
  const Json &weightMap = index.at("weight_map");
  EXPECT_EQ(weightMap.size(), expected.size());

  // Shards are named model-0000K-of-0000N and stay under the limit (a tensor larger than the
  // limit would get a shard of its own; none is here).
  const size_t numShards = summary.shards.size();
  ASSERT_GT(numShards, 4u);
  uint64_t totalBytes = 0;
  std::multiset<std::string> seen;
  for (size_t s = 0; s < numShards; ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, numShards);
    EXPECT_EQ(summary.shards[s].file, name);
    StatusOr<safetensors::File> file = safetensors::File::open((dir / name).string());
    ASSERT_TRUE(file.isOk()) << file.status().message();
    EXPECT_EQ(file->metadata().at("format"), "pt");
    uint64_t shardBytes = 0;
    for (const safetensors::TensorInfo &tensor : file->tensors()) {
      seen.insert(tensor.name);
      shardBytes += tensor.byteSize();
      EXPECT_EQ(weightMap.at(tensor.name), name) << tensor.name;
    }
    EXPECT_LE(shardBytes, spec.maxShardBytes) << name;
    EXPECT_EQ(shardBytes, summary.shards[s].tensorBytes);
    totalBytes += shardBytes;
  }
  EXPECT_EQ(index.at("metadata").at("total_size"), totalBytes);
  EXPECT_EQ(summary.totalTensorBytes, totalBytes);

  // Every tensor exactly once, in the planned order across the shards.
  EXPECT_EQ(seen.size(), expected.size());
  std::vector<std::string> fileOrder;
  for (size_t s = 0; s < numShards; ++s) {
    auto file = safetensors::File::open((dir / summary.shards[s].file).string());
    for (const safetensors::TensorInfo &tensor : file->tensors()) {
      fileOrder.push_back(tensor.name);
      EXPECT_EQ(seen.count(tensor.name), 1u) << tensor.name;
    }
  }
  for (size_t i = 0; i < expected.size() && i < fileOrder.size(); ++i)
    EXPECT_EQ(fileOrder[i], expected[i].name);

  EXPECT_EQ(readJson(dir / "config.json"), Json::parse(syntheticConfigJson(spec)));
  // Nothing but the checkpoint: no staging folders next to it, no temp files in it.
  EXPECT_EQ(std::distance(fs::directory_iterator(scratch_), fs::directory_iterator()), 1);
  EXPECT_EQ(readFolder(dir).size(), numShards + 2);
}

// Values have the intended distributions: weights N(0, std), norms near 1, KDA decay
// parameters as fla initialises them.
TEST_F(SyntheticCheckpointTest, ValuesFollowTheirDistributions) {
  const fs::path dir = write(presetOrDie("kimi-linear-tiny"), "kimi");
  const Json weightMap = readJson(dir / "model.safetensors.index.json").at("weight_map");
  auto values = [&](const std::string &name) {
    auto file = safetensors::File::open((dir / weightMap.at(name).get<std::string>()).string());
    EXPECT_TRUE(file.isOk());
    auto read = safetensors::readAsFloat(*file, *file->find(name));
    EXPECT_TRUE(read.isOk());
    return *read;
  };
  auto meanAndStd = [](const std::vector<float> &v) {
    double sum = 0, sumSquares = 0;
    for (float x : v) {
      sum += x;
      sumSquares += double(x) * x;
    }
    double mean = sum / v.size();
    return std::pair{mean, std::sqrt(sumSquares / v.size() - mean * mean)};
  };

  auto [weightMean, weightStd] = meanAndStd(values("model.layers.1.self_attn.q_proj.weight"));
  EXPECT_NEAR(weightMean, 0.0, 0.002);
  EXPECT_NEAR(weightStd, 0.06, 0.002);
  auto [normMean, normStd] = meanAndStd(values("model.norm.weight"));
  EXPECT_NEAR(normMean, 1.0, 0.03);
  EXPECT_NEAR(normStd, 0.1, 0.03);
  for (float aLog : values("model.layers.0.self_attn.A_log")) {
    EXPECT_GE(aLog, 0.0f);
    EXPECT_LE(aLog, std::log(16.0f));
  }
  for (float dtBias : values("model.layers.0.self_attn.dt_bias")) {
    const double dt = std::log1p(std::exp(double(dtBias))); // softplus
    EXPECT_GE(dt, 1e-3 * 0.999);
    EXPECT_LE(dt, 1e-1 * 1.001);
  }
  const std::vector<float> a = values("model.layers.1.self_attn.k_proj.weight");
  const std::vector<float> b = values("model.layers.2.self_attn.k_proj.weight");
  EXPECT_NE(a, b); // every tensor has its own stream
}

TEST_F(SyntheticCheckpointTest, SameSeedGivesIdenticalBytesWhateverTheThreads) {
  SyntheticSpec spec = presetOrDie("deepseek-v32-tiny");
  spec.maxShardBytes = 1 << 20;
  spec.seed = 7;
  const fs::path first = write(spec, "first", {.overwrite = false, .threads = 1});
  const fs::path second = write(spec, "second", {.overwrite = false, .threads = 3});
  const std::map<std::string, std::string> firstFiles = readFolder(first);
  EXPECT_EQ(firstFiles, readFolder(second));

  spec.seed = 8;
  const std::map<std::string, std::string> otherFiles = readFolder(write(spec, "other"));
  ASSERT_EQ(otherFiles.size(), firstFiles.size());
  EXPECT_EQ(otherFiles.at("config.json"), firstFiles.at("config.json"));
  for (const auto &[name, content] : firstFiles) {
    if (name.ends_with(".safetensors")) {
      EXPECT_NE(otherFiles.at(name), content) << name;
    }
  }
}

// Tensors above 4M elements are generated in pieces by several workers; the bytes must not
// depend on how many.
TEST_F(SyntheticCheckpointTest, LargeTensorsSplitAcrossThreadsGiveTheSameBytes) {
  SyntheticSpec spec = presetOrDie("deepseek-v32-tiny");
  spec.numLayers = 1;
  spec.vocabSize = 20000;        // embedding and lm_head: 5.1M bf16 elements each
  spec.intermediateSize = 20000; // dense MLP: 5.1M fp8 elements per projection, 157 bands
  spec.fp8Weights = true;
  const fs::path sequential = write(spec, "one-thread", {.overwrite = false, .threads = 1});
  const fs::path parallel = write(spec, "four-threads", {.overwrite = false, .threads = 4});
  EXPECT_EQ(readFolder(sequential), readFolder(parallel));
}

TEST_F(SyntheticCheckpointTest, ShardLimitDoesNotChangeTensorValues) {
  SyntheticSpec spec = presetOrDie("kimi-attnres-tiny");
  const fs::path oneShard = write(spec, "one");
  spec.maxShardBytes = 300'000;
  const fs::path manyShards = write(spec, "many");
  auto tensorBytes = [](const fs::path &dir) {
    std::map<std::string, std::vector<std::byte>> bytes;
    for (const fs::directory_entry &entry : fs::directory_iterator(dir)) {
      if (entry.path().extension() != ".safetensors")
        continue;
      auto file = safetensors::File::open(entry.path().string());
      for (const safetensors::TensorInfo &tensor : file->tensors()) {
        auto span = file->bytes(tensor);
        bytes[tensor.name].assign(span.begin(), span.end());
      }
    }
    return bytes;
  };
  EXPECT_EQ(tensorBytes(oneShard), tensorBytes(manyShards));
  EXPECT_EQ(readJson(oneShard / "model.safetensors.index.json").at("weight_map").size(), 169u);
}

TEST_F(SyntheticCheckpointTest, OversizedTensorGetsAShardOfItsOwn) {
  SyntheticSpec spec = presetOrDie("deepseek-v32-tiny");
  spec.maxShardBytes = 1000; // below every weight matrix
  SyntheticWriteSummary summary;
  ASSERT_TRUE(writeSyntheticCheckpoint(spec, (scratch_ / "small").string(), {}, &summary).isOk());
  for (const SyntheticShardSummary &shard : summary.shards)
    EXPECT_TRUE(shard.numTensors == 1 || shard.tensorBytes <= spec.maxShardBytes) << shard.file;
  EXPECT_EQ(summary.numTensors, 106);
}

TEST_F(SyntheticCheckpointTest, RefusesToOverwriteUnlessAsked) {
  SyntheticSpec spec = presetOrDie("kimi-linear-tiny");
  const fs::path dir = write(spec, "ckpt");
  const std::string firstShard = readWholeFile(dir / "model-00001-of-00001.safetensors");

  Status refused = writeSyntheticCheckpoint(spec, dir.string());
  EXPECT_EQ(refused.message(),
            dir.string() + ": directory exists and is not empty (overwrite it with --force)");

  spec.seed = 1;
  ASSERT_TRUE(writeSyntheticCheckpoint(spec, dir.string(), {.overwrite = true}).isOk());
  EXPECT_NE(readWholeFile(dir / "model-00001-of-00001.safetensors"), firstShard);
  EXPECT_EQ(std::distance(fs::directory_iterator(scratch_), fs::directory_iterator()), 1);

  // An empty folder is filled; a trailing separator names the same folder.
  fs::create_directory(scratch_ / "empty");
  EXPECT_TRUE(writeSyntheticCheckpoint(spec, (scratch_ / "empty").string() + "/").isOk());
  EXPECT_TRUE(fs::exists(scratch_ / "empty" / "config.json"));

  // A folder that holds something else is never deleted, even when asked.
  fs::create_directory(scratch_ / "precious");
  std::ofstream(scratch_ / "precious" / "notes.txt") << "keep me";
  Status kept =
      writeSyntheticCheckpoint(spec, (scratch_ / "precious").string(), {.overwrite = true});
  EXPECT_NE(kept.message().find("holds no checkpoint"), std::string::npos) << kept.message();
  EXPECT_EQ(readWholeFile(scratch_ / "precious" / "notes.txt"), "keep me");

  std::ofstream(scratch_ / "plain-file") << "x";
  EXPECT_NE(writeSyntheticCheckpoint(spec, (scratch_ / "plain-file").string(), {.overwrite = true})
                .message()
                .find("not a directory"),
            std::string::npos);
}

TEST_F(SyntheticCheckpointTest, InvalidSpecWritesNothing) {
  SyntheticSpec spec = presetOrDie("kimi-linear-tiny");
  spec.hiddenSize = -1;
  Status status = writeSyntheticCheckpoint(spec, (scratch_ / "bad").string());
  EXPECT_EQ(status.message(), "synthetic spec: 'hidden_size' must be positive, got -1");
  EXPECT_TRUE(fs::is_empty(scratch_));
}

//===------------------------------------------------------------------------------------------===//
// FP8.
//===------------------------------------------------------------------------------------------===//

TEST(SyntheticFp8, EncoderRoundTripsEveryCode) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f)
      continue; // NaN
    const float value = safetensors::f8e4m3ToFloat(static_cast<uint8_t>(code));
    EXPECT_EQ(floatToF8E4M3(value), code) << value;
  }
}

TEST(SyntheticFp8, EncoderRoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(floatToF8E4M3(1.0625f), 0x38); // 1 + 1/16: tie, even mantissa 0 (1.0)
  EXPECT_EQ(floatToF8E4M3(1.1875f), 0x3a); // 1 + 3/16: tie, even mantissa 2 (1.25)
  EXPECT_EQ(floatToF8E4M3(1.07f), 0x39);   // nearer to 1.125
  EXPECT_EQ(floatToF8E4M3(-2.0f), 0xc0);
  EXPECT_EQ(floatToF8E4M3(0x1p-10f), 0x00); // half the smallest subnormal: tie to 0
  EXPECT_EQ(floatToF8E4M3(0x1.8p-10f), 0x01);
  EXPECT_EQ(floatToF8E4M3(0x1.fp-7f), 0x08); // subnormal rounding up to the smallest normal 2^-6
  EXPECT_EQ(floatToF8E4M3(440.0f), 0x7e);    // 448
  EXPECT_EQ(floatToF8E4M3(1e6f), 0x7e);
  EXPECT_EQ(floatToF8E4M3(-INFINITY), 0xfe);
  EXPECT_EQ(floatToF8E4M3(NAN), 0x7f);
  EXPECT_EQ(floatToF8E4M3(-0.0f), 0x80);
}

// The fp8 checkpoint stores the same random bf16 weights as the bf16 one of the same seed,
// quantized per 128x128 block with scale amax / 448.
TEST_F(SyntheticCheckpointTest, Fp8WeightsDequantizeToTheBf16Originals) {
  SyntheticSpec spec = presetOrDie("deepseek-v32-tiny");
  const fs::path bf16Dir = write(spec, "bf16");
  spec.fp8Weights = true;
  const fs::path fp8Dir = write(spec, "fp8");

  const Json config = readJson(fp8Dir / "config.json");
  EXPECT_EQ(config.at("quantization_config").at("fmt"), "e4m3");
  auto openShard = [](const fs::path &dir) {
    auto file = safetensors::File::open((dir / "model-00001-of-00001.safetensors").string());
    EXPECT_TRUE(file.isOk()) << file.status().message();
    return std::move(file).value();
  };
  const safetensors::File original = openShard(bf16Dir);
  const safetensors::File quantized = openShard(fp8Dir);

  int fp8Tensors = 0;
  for (const safetensors::TensorInfo &tensor : original.tensors()) {
    const safetensors::TensorInfo *stored = quantized.find(tensor.name);
    ASSERT_NE(stored, nullptr) << tensor.name;
    EXPECT_EQ(stored->shape, tensor.shape) << tensor.name;
    const bool expectFp8 = tensor.shape.size() == 2 &&
                           (tensor.name.find("_proj") != std::string::npos ||
                            tensor.name.find("indexer.w") != std::string::npos) &&
                           tensor.name.find("weights_proj") == std::string::npos;
    if (!expectFp8) {
      EXPECT_EQ(stored->dtype, tensor.dtype) << tensor.name;
      auto a = original.bytes(tensor), b = quantized.bytes(*stored);
      EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end())) << tensor.name;
      continue;
    }
    ++fp8Tensors;
    ASSERT_EQ(stored->dtype, DType::F8_E4M3) << tensor.name;
    const safetensors::TensorInfo *scale = quantized.find(tensor.name + "_scale_inv");
    ASSERT_NE(scale, nullptr) << tensor.name;
    ASSERT_EQ(scale->dtype, DType::F32);
    const int64_t rows = tensor.shape[0], cols = tensor.shape[1];
    const int64_t blockCols = (cols + 127) / 128;
    ASSERT_EQ(scale->shape, (std::vector<int64_t>{(rows + 127) / 128, blockCols}));

    const std::vector<float> reference = *safetensors::readAsFloat(original, tensor);
    const std::vector<float> scales = *safetensors::readAsFloat(quantized, *scale);
    auto codes = quantized.bytes(*stored);
    std::vector<float> blockMax(scales.size(), 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const size_t block = (r / 128) * blockCols + c / 128;
        const float value = reference[r * cols + c];
        const float dequantized =
            safetensors::f8e4m3ToFloat(static_cast<uint8_t>(codes[r * cols + c])) * scales[block];
        // Half an E4M3 step: 2^-4 relative for normals, 2^-10 * scale in the subnormal range.
        const double tolerance =
            std::max(std::fabs(value) * 0x1p-4, double(scales[block]) * 0x1p-10) * (1 + 1e-5);
        ASSERT_LE(std::fabs(dequantized - value), tolerance)
            << tensor.name << " [" << r << ", " << c << "]";
        blockMax[block] = std::max(blockMax[block], std::fabs(value));
      }
    for (size_t b = 0; b < scales.size(); ++b)
      EXPECT_FLOAT_EQ(scales[b], blockMax[b] / 448.0f) << tensor.name << " block " << b;
  }
  // Per layer: 5 MLA projections + 2 indexer projections, plus 3 per MLP (1 dense layer: 3;
  // 2 MoE layers: 8 experts x 3 + 3 shared).
  EXPECT_EQ(fp8Tensors, 3 * 7 + 3 + 2 * (8 * 3 + 3));
  EXPECT_EQ(quantized.tensors().size(), original.tensors().size() + fp8Tensors);
}

//===------------------------------------------------------------------------------------------===//
// config.json -> spec (hybrid-compile --synthetic-weights) and the generator parameters.
//===------------------------------------------------------------------------------------------===//

void expectSameTensors(const SyntheticSpec &a, const SyntheticSpec &b) {
  const std::vector<SyntheticTensor> left = listSyntheticTensors(a), right = listSyntheticTensors(b);
  ASSERT_EQ(left.size(), right.size());
  for (size_t i = 0; i < left.size(); ++i) {
    EXPECT_EQ(left[i].name, right[i].name);
    EXPECT_EQ(left[i].shape, right[i].shape) << left[i].name;
    EXPECT_EQ(left[i].dtype, right[i].dtype) << left[i].name;
    EXPECT_EQ(left[i].kind, right[i].kind) << left[i].name;
  }
}

TEST(SpecFromConfigJson, EveryPresetRoundTripsThroughItsConfig) {
  for (const std::string &name : SyntheticSpec::presetNames()) {
    SCOPED_TRACE(name);
    StatusOr<SyntheticSpec> preset = SyntheticSpec::preset(name);
    ASSERT_TRUE(preset.isOk());
    for (bool fp8 : {false, true}) {
      if (fp8 && preset->modelType != "deepseek_v32")
        continue;
      preset->fp8Weights = fp8;
      StatusOr<SyntheticSpec> read =
          specFromConfigJson(syntheticConfigJson(*preset), "config.json", 42);
      ASSERT_TRUE(read.isOk()) << read.status().message();
      EXPECT_EQ(read->seed, 42u);
      EXPECT_EQ(read->fp8Weights, fp8);
      expectSameTensors(*preset, *read);
    }
  }
}

TEST(SpecFromConfigJson, ReadsThePublishedKimiLayerLists) {
  // MODEL_SPEC 1.2: the published lists, here with one layer fewer than the config's 27 would
  // need for the period rule to end on a full-attention layer.
  StatusOr<SyntheticSpec> preset = SyntheticSpec::preset("kimi-linear-48b");
  ASSERT_TRUE(preset.isOk());
  Json config = Json::parse(syntheticConfigJson(*preset));
  config["linear_attn_config"]["full_attn_layers"] = Json::array({2, 27});
  StatusOr<SyntheticSpec> read = specFromConfigJson(config.dump(), "config.json");
  ASSERT_TRUE(read.isOk()) << read.status().message();
  EXPECT_EQ(read->fullAttentionLayers, (std::vector<int64_t>{1, 26}));
  EXPECT_TRUE(read->isFullAttentionLayer(1));
  EXPECT_FALSE(read->isFullAttentionLayer(3));
  bool mla = false;
  for (const SyntheticTensor &tensor : listSyntheticTensors(*read))
    mla |= tensor.name == "model.layers.1.self_attn.kv_b_proj.weight";
  EXPECT_TRUE(mla);
}

TEST(SpecFromConfigJson, ErrorsNameTheFileAndField) {
  StatusOr<SyntheticSpec> preset = SyntheticSpec::preset("deepseek-v32-tiny");
  ASSERT_TRUE(preset.isOk());
  const Json config = Json::parse(syntheticConfigJson(*preset));
  auto error = [](const Json &edited) {
    StatusOr<SyntheticSpec> read = specFromConfigJson(edited.dump(), "/m/config.json");
    EXPECT_FALSE(read.isOk());
    return read.isOk() ? std::string() : read.status().message();
  };
  Json missing = config;
  missing.erase("hidden_size");
  EXPECT_EQ(error(missing), "/m/config.json: field 'hidden_size' missing or not an integer");
  Json wrongType = config;
  wrongType["index_topk"] = "many";
  EXPECT_EQ(error(wrongType), "/m/config.json: field 'index_topk' missing or not an integer");
  Json otherModel = config;
  otherModel["model_type"] = "llama";
  EXPECT_NE(error(otherModel).find("model_type 'llama'"), std::string::npos);
  Json blocks = config;
  blocks["quantization_config"] = {{"quant_method", "fp8"},
                                   {"weight_block_size", Json::array({64, 64})}};
  EXPECT_NE(error(blocks).find("field 'quantization_config'"), std::string::npos);
  Json negative = config;
  negative["num_hidden_layers"] = -1;
  EXPECT_NE(error(negative).find("/m/config.json: synthetic spec: 'num_hidden_layers'"),
            std::string::npos);
  EXPECT_NE(specFromConfigJson("{", "/m/config.json").status().message().find("not a JSON"),
            std::string::npos);
}

TEST(SyntheticValuesFor, ParametersGiveTheSpecsDistributions) {
  StatusOr<SyntheticSpec> spec = SyntheticSpec::preset("deepseek-v32-tiny");
  ASSERT_TRUE(spec.isOk());
  spec->fp8Weights = true;
  spec->seed = 3;
  const double unit = std::sqrt(3.0) / 65536.0; // one deviation of the Irwin-Hall sum
  bool sawFp8 = false, sawScale = false, sawNorm = false;
  for (const SyntheticTensor &tensor : listSyntheticTensors(*spec)) {
    const SyntheticValues values = syntheticValuesFor(*spec, tensor);
    if (tensor.kind == ValueKind::BlockScale) {
      sawScale = true;
      EXPECT_EQ(values.kind, kernels::SyntheticKind::Constant);
      EXPECT_FLOAT_EQ(values.b, static_cast<float>(3.5 * spec->weightStd / 448.0));
    } else if (tensor.dtype == DType::F8_E4M3) {
      sawFp8 = true; // codes * scale = N(0, 1) * 128 * 3.5 std / 448 = N(0, std^2)
      EXPECT_FLOAT_EQ(values.a, static_cast<float>(128.0 * unit));
    } else if (tensor.kind == ValueKind::NormWeight) {
      sawNorm = true;
      EXPECT_FLOAT_EQ(values.a, static_cast<float>(0.1 * unit));
      EXPECT_EQ(values.b, 1.0f);
    }
  }
  EXPECT_TRUE(sawFp8 && sawScale && sawNorm);
  // Keys: per tensor and per seed.
  const std::vector<SyntheticTensor> tensors = listSyntheticTensors(*spec);
  const uint64_t first = syntheticValuesFor(*spec, tensors[0]).key;
  EXPECT_NE(first, syntheticValuesFor(*spec, tensors[1]).key);
  spec->seed = 4;
  EXPECT_NE(first, syntheticValuesFor(*spec, tensors[0]).key);
}

} // namespace
} // namespace hybrid::synth
