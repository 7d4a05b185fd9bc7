// hybrid-synth: writes a synthetic Hub-format checkpoint (random weights, published layout).
//   hybrid-synth --preset kimi-linear-tiny --out DIR [--seed N] [--layers N] [--fp8]
//                [--mtp-layers N] [--attn-res-block-size N] [--max-shard-mib N] [--threads N]
//                [--force] [--config-only]
#include "hybrid/runtime/SyntheticCheckpoint.h"

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>

namespace {

std::string joined(const std::vector<std::string> &names) {
  std::string text;
  for (const std::string &name : names)
    text += (text.empty() ? "" : ", ") + name;
  return text;
}

std::string formatMiB(uint64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return text;
}

int fail(const std::string &message) {
  std::cerr << "error: " << message << "\n";
  return 1;
}

} // namespace

int main(int argc, char **argv) {
  CLI::App app{"Writes a synthetic checkpoint in the Hugging Face Hub layout (config.json, sharded "
               "safetensors, index) with deterministic random weights."};
  std::string presetName;
  std::string outDir;
  uint64_t seed = 0;
  std::optional<int64_t> layers;
  bool fp8 = false;
  std::optional<int64_t> mtpLayers;
  std::optional<int64_t> attnResBlockSize;
  std::optional<uint64_t> maxShardMiB;
  int threads = 0;
  bool force = false;
  bool configOnly = false;
  app.add_option("--preset", presetName,
                 "Model preset: " + joined(hybrid::synth::SyntheticSpec::presetNames()))
      ->required();
  app.add_option("--out", outDir, "Checkpoint directory to create")->required();
  app.add_option("--seed", seed, "Random seed (same seed, same bytes)");
  app.add_option("--layers", layers,
                 "Override num_hidden_layers (a hybrid's layer_types repeat their pattern)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_flag("--fp8", fp8, "FP8 E4M3 linear weights with 128x128 block scales (deepseek_v32)");
  app.add_option("--mtp-layers", mtpLayers,
                 "num_nextn_predict_layers: DeepSeek multi-token-prediction layers after the "
                 "decoder (deepseek_v32)")
      ->check(CLI::Range(int64_t{0}, int64_t{8}));
  app.add_option("--attn-res-block-size", attnResBlockSize,
                 "Block AttnRes in blocks of N layers; 0: the plain residual stream (kimi_linear, "
                 "hybrid; e.g. to measure AttnRes's cost)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  app.add_option("--max-shard-mib", maxShardMiB, "Shard size limit in MiB (default 5 GB)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 30));
  app.add_option("--threads", threads, "Generator threads (default: all cores)")
      ->check(CLI::Range(0, 4096));
  app.add_flag("--force", force, "Replace an existing checkpoint directory");
  app.add_flag("--config-only", configOnly,
               "Write only DIR/config.json, for hybrid-compile --synthetic-weights (no weights on "
               "disk: full sizes fit)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp &help) {
    return app.exit(help);
  } catch (const CLI::ParseError &error) {
    return fail(error.what()); // one line, unlike CLI11's default report
  }

  auto spec = hybrid::synth::SyntheticSpec::preset(presetName);
  if (!spec)
    return fail(spec.status().message());
  spec->seed = seed;
  spec->fp8Weights = fp8;
  if (layers)
    spec->setNumLayers(*layers);
  if (mtpLayers)
    spec->numNextnPredictLayers = *mtpLayers;
  if (attnResBlockSize)
    spec->attnResBlockSize =
        *attnResBlockSize > 0 ? std::optional<int64_t>(*attnResBlockSize) : std::nullopt;
  if (maxShardMiB)
    spec->maxShardBytes = *maxShardMiB << 20;

  if (configOnly) {
    if (hybrid::Status valid = spec->validate(); !valid)
      return fail(valid.message());
    std::error_code error;
    std::filesystem::create_directories(outDir, error);
    const std::string path = outDir + "/config.json";
    if (!error && std::filesystem::exists(path) && !force)
      return fail(path + ": exists (replace it with --force)");
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << hybrid::synth::syntheticConfigJson(*spec);
    out.close();
    if (error || !out)
      return fail(path + ": cannot write" + (error ? ": " + error.message() : std::string()));
    std::cout << "wrote " << path << " (" << presetName << ", " << spec->numLayers
              << " layers" << (fp8 ? ", fp8" : "") << ")\n";
    return 0;
  }

  hybrid::synth::SyntheticWriteOptions options;
  options.overwrite = force;
  options.threads = threads;
  hybrid::synth::SyntheticWriteSummary summary;
  if (hybrid::Status status =
          hybrid::synth::writeSyntheticCheckpoint(*spec, outDir, options, &summary);
      !status)
    return fail(status.message());

  std::cout << "wrote " << outDir << " (" << presetName << ", " << spec->numLayers
            << " layers, seed " << seed << (fp8 ? ", fp8" : "") << "): " << summary.numTensors
            << " tensors, " << summary.totalTensorBytes << " bytes ("
            << formatMiB(summary.totalTensorBytes) << ") in " << summary.shards.size()
            << (summary.shards.size() == 1 ? " shard" : " shards") << "\n";
  for (const hybrid::synth::SyntheticShardSummary &shard : summary.shards)
    std::cout << "  " << shard.file << ": " << shard.numTensors << " tensors, " << shard.tensorBytes
              << " bytes\n";
  return 0;
}
