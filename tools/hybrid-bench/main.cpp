// hybrid-bench: kernel benchmarks on the GPU, a table on stdout and JSON for the record.
#include "hybrid/kernels/cuda/KdaBench.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>

namespace {

int runKdaPrefill(const std::vector<std::string> &shapeTexts, int32_t heads, int32_t headDim,
                  int32_t iterations, const std::string &pathName, const std::string &jsonPath) {
  std::vector<std::pair<int32_t, int32_t>> shapes;
  for (const std::string &text : shapeTexts) {
    int sequences = 0, length = 0;
    char trailing = 0;
    if (std::sscanf(text.c_str(), "%dx%d%c", &sequences, &length, &trailing) != 2 ||
        sequences <= 0 || length <= 0) {
      std::cerr << "error: kda-prefill: --shapes: '" << text
                << "' is not SEQUENCESxLENGTH with both positive\n";
      return 1;
    }
    shapes.emplace_back(sequences, length);
  }
  std::string error;
  using hybrid::kernels::cuda::KdaPrefillPath;
  const KdaPrefillPath path = pathName == "recurrent" ? KdaPrefillPath::Recurrent
                              : pathName == "chunked" ? KdaPrefillPath::Chunked
                                                      : KdaPrefillPath::Auto;
  auto results =
      hybrid::kernels::cuda::benchKdaPrefill(shapes, heads, headDim, iterations, path, error);
  if (!error.empty()) {
    std::cerr << "error: kda-prefill: " << error << "\n";
    return 1;
  }
  using hybrid::kernels::cuda::kH200Bf16DenseTflops;
  using hybrid::kernels::cuda::kH200CopyTbPerSecond;
  std::printf("%-18s %9s %7s %6s %5s %10s %10s %9s %7s %9s %7s  %s\n", "kernel", "sequences",
              "length", "heads", "dim", "graph ms", "Mtok/s", "TB/s", "% copy", "TFLOP/s",
              "% bf16", "target (H200)");
  for (const auto &r : results) {
    const double tbPerSecond = r.bytes / (r.milliseconds * 1e-3) / 1e12;
    const double tflops = r.flops / (r.milliseconds * 1e-3) / 1e12;
    std::printf("%-18s %9d %7d %6d %5d %10.3f %10.2f %9.2f %6.1f%% %9.1f %6.1f%%  %s\n",
                r.chunked ? "kda-prefill-chunk" : "kda-prefill-recur", r.sequences, r.length,
                r.heads, r.headDim, r.milliseconds, r.tokensPerSecond / 1e6, tbPerSecond,
                100.0 * tbPerSecond / kH200CopyTbPerSecond, tflops,
                100.0 * tflops / kH200Bf16DenseTflops,
                hybrid::kernels::cuda::kdaPrefillTargetVerdict(r).c_str());
  }
  if (!jsonPath.empty()) {
    std::ofstream json(jsonPath);
    json << "[\n";
    for (size_t i = 0; i < results.size(); ++i) {
      const auto &r = results[i];
      json << "  {\"kernel\": \"" << (r.chunked ? "kda-prefill-chunked" : "kda-prefill-recurrent")
           << "\", \"sequences\": " << r.sequences
           << ", \"length\": " << r.length << ", \"heads\": " << r.heads
           << ", \"head_dim\": " << r.headDim << ", \"graph_ms\": " << r.milliseconds
           << ", \"tokens_per_s\": " << r.tokensPerSecond << ", \"bytes\": " << r.bytes
           << ", \"flops\": " << r.flops << ", \"target\": \""
           << hybrid::kernels::cuda::kdaPrefillTargetVerdict(r) << "\"}"
           << (i + 1 < results.size() ? ",\n" : "\n");
    }
    json << "]\n";
  }
  return 0;
}

} // namespace

int main(int argc, char **argv) {
  CLI::App app{"hybrid kernel benchmarks (CUDA events, warm-up, median of 7)"};
  app.require_subcommand(1);
  std::vector<int32_t> batches = {1, 32, 128};
  int32_t heads = 32, headDim = 128, iterations = 200;
  std::string jsonPath;
  CLI::App *kdaDecode = app.add_subcommand("kda-decode", "fused KDA decode step");
  kdaDecode->add_option("--batch", batches, "Batch sizes")->delimiter(',');
  kdaDecode->add_option("--heads", heads, "KDA heads")->check(CLI::PositiveNumber);
  kdaDecode->add_option("--head-dim", headDim, "Head dimension (64 or 128)");
  kdaDecode->add_option("--iterations", iterations, "Calls per timing")
      ->check(CLI::PositiveNumber);
  kdaDecode->add_option("--json", jsonPath, "Write the results as JSON");
  std::string path = "auto";
  kdaDecode->add_option("--path", path, "Kernels: auto (by batch), fused or split")
      ->check(CLI::IsMember({"auto", "fused", "split"}));
  std::vector<std::string> prefillShapes = {"1x8192", "8x1024"};
  int32_t prefillIterations = 3;
  CLI::App *kdaPrefill =
      app.add_subcommand("kda-prefill", "KDA prefill, varlen, with initial and final states");
  kdaPrefill->add_option("--shapes", prefillShapes, "SEQUENCESxLENGTH, comma-separated")
      ->delimiter(',');
  kdaPrefill->add_option("--heads", heads, "KDA heads")->check(CLI::PositiveNumber);
  kdaPrefill->add_option("--head-dim", headDim, "Head dimension (64 or 128)");
  kdaPrefill->add_option("--iterations", prefillIterations, "Calls per timing")
      ->check(CLI::PositiveNumber);
  kdaPrefill->add_option("--json", jsonPath, "Write the results as JSON");
  std::string prefillPath = "auto";
  kdaPrefill->add_option("--path", prefillPath, "Kernels: auto (chunked at head dim 128), "
                                                "recurrent or chunked")
      ->check(CLI::IsMember({"auto", "recurrent", "chunked"}));
  CLI11_PARSE(app, argc, argv);
  if (kdaPrefill->parsed())
    return runKdaPrefill(prefillShapes, heads, headDim, prefillIterations, prefillPath, jsonPath);

  std::string error;
  auto results = hybrid::kernels::cuda::benchKdaDecode(
      batches, heads, headDim, iterations,
      path == "fused"   ? hybrid::kernels::cuda::KdaDecodePath::Fused
      : path == "split" ? hybrid::kernels::cuda::KdaDecodePath::Split
                        : hybrid::kernels::cuda::KdaDecodePath::Auto,
      error);
  if (!error.empty()) {
    std::cerr << "error: kda-decode: " << error << "\n";
    return 1;
  }
  // 4.28 TB/s: the H200's measured copy bandwidth (PERF_TARGETS.md), the ceiling for state traffic.
  constexpr double kCopyTbPerSecond = 4.28;
  std::printf("%-10s %6s %6s %5s %6s %10s %10s %10s %11s %11s %10s  %s\n", "kernel", "batch",
              "heads", "dim", "path", "eager us", "graph us", "floor us", "state TB/s", "all TB/s",
              "% of copy", "target (H200)");
  for (const auto &r : results)
    std::printf("%-10s %6d %6d %5d %6s %10.2f %10.2f %10.2f %11.2f %11.2f %9.0f%%  %s\n",
                "kda-decode", r.batch, r.heads, r.headDim, r.split ? "split" : "fused",
                r.eagerMicroseconds, r.graphMicroseconds, r.graphFloorMicroseconds,
                r.graphStateTbPerSecond, r.graphTrafficTbPerSecond,
                100.0 * r.graphTrafficTbPerSecond / kCopyTbPerSecond,
                hybrid::kernels::cuda::kdaDecodeTargetVerdict(r).c_str());
  if (!jsonPath.empty()) {
    std::ofstream json(jsonPath);
    json << "[\n";
    for (size_t i = 0; i < results.size(); ++i) {
      const auto &r = results[i];
      json << "  {\"kernel\": \"kda-decode\", \"batch\": " << r.batch << ", \"heads\": " << r.heads
           << ", \"head_dim\": " << r.headDim << ", \"eager_us\": " << r.eagerMicroseconds
           << ", \"graph_us\": " << r.graphMicroseconds
           << ", \"graph_floor_us\": " << r.graphFloorMicroseconds << ", \"state_bytes\": " << r.stateBytes
           << ", \"state_tb_per_s\": " << r.graphStateTbPerSecond
           << ", \"traffic_bytes\": " << r.trafficBytes
           << ", \"traffic_tb_per_s\": " << r.graphTrafficTbPerSecond
           << ", \"path\": \"" << (r.split ? "split" : "fused") << "\", \"target\": \""
           << hybrid::kernels::cuda::kdaDecodeTargetVerdict(r) << "\"}"
           << (i + 1 < results.size() ? ",\n" : "\n");
    }
    json << "]\n";
  }
  return 0;
}
