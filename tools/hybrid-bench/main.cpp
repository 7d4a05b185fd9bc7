// hybrid-bench: kernel benchmarks on the GPU and the serving benchmark, a table on stdout and
// JSON for the record.
#include "Tune.h"
#include "hybrid/runtime/BenchRecord.h"
#include "hybrid/runtime/Communicator.h"
#include "hybrid/runtime/E2eBench.h"
#include "hybrid/runtime/Generate.h"
#include "hybrid/runtime/LoadGenerator.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Server.h"
#include "hybrid/runtime/Timeline.h"
#include "hybrid_bench_commit.h" // HYBRID_BENCH_COMMIT, written at build time
#ifdef HYBRID_BENCH_KDA
#include "hybrid/kernels/cuda/BenchDevice.h"
#include "hybrid/kernels/cuda/DeviceTimeline.h"
#include "hybrid/kernels/cuda/DsaBench.h" // and SparseMla.h
#include "hybrid/kernels/cuda/KdaBench.h"
#include "hybrid/kernels/cuda/LinearBench.h"
#include "hybrid/kernels/cuda/MoeBench.h"
#endif

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

namespace {

// Writes `text` to `path` (--json); nothing when path is empty. False, with a message, on failure.
bool writeText(const std::string &path, const std::string &text) {
  if (path.empty())
    return true;
  std::ofstream file(path);
  file << text;
  if (!file) {
    std::cerr << "error: --json: cannot write '" << path << "'\n";
    return false;
  }
  return true;
}

// What a kernel benchmark does with its rows besides the table: a record (--json) and a
// comparison with a stored baseline (--compare, exit 1 when a row is slower than --threshold).
struct RecordOptions {
  std::string jsonPath, comparePath, commit = HYBRID_BENCH_COMMIT, command;
  double threshold = 0.05;
};

// The kernel benchmarks' --timeline (withKernelTimeline).
void addKernelTimelineOption(CLI::App *app, std::string &path) {
  app->add_option("--timeline", path,
                  "Record the device's work over the run (CUPTI): per kernel launches, exposed and "
                  "total time, and a Chrome trace (JSON) at this path");
}

void addRecordOptions(CLI::App *app, RecordOptions &record) {
  app->add_option("--json", record.jsonPath, "Write the results as a benchmark record (JSON)");
  app->add_option("--compare", record.comparePath,
                  "A stored record (docs/performance/*.json): print each row's ratio to it, exit 1 "
                  "when a row is slower than --threshold");
  app->add_option("--threshold", record.threshold, "Allowed slowdown for --compare")
      ->check(CLI::Range(0.0, 10.0));
  app->add_option("--commit", record.commit, "Commit recorded in --json (default: the build's)");
}

std::string utcNow() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

int finishRecord(const RecordOptions &options, const std::string &gpu,
                 std::vector<hybrid::bench::BenchRow> rows) {
  hybrid::bench::BenchRecord record{gpu, utcNow(), options.commit, options.command,
                                    std::move(rows)};
  if (!options.jsonPath.empty())
    if (hybrid::Status written = hybrid::bench::writeBenchRecord(record, options.jsonPath);
        !written) {
      std::cerr << "error: --json: " << written.message() << "\n";
      return 1;
    }
  if (options.comparePath.empty())
    return 0;
  auto baseline = hybrid::bench::readBenchRecord(options.comparePath);
  if (!baseline) {
    std::cerr << "error: --compare: " << baseline.status().message() << "\n";
    return 1;
  }
  const auto comparison = hybrid::bench::compareRecords(*baseline, record, options.threshold);
  std::printf("\n%s",
              hybrid::bench::formatComparison(comparison, *baseline, options.threshold).c_str());
  return comparison.slower > 0 ? 1 : 0;
}

// "SEQUENCESxLENGTH" texts as (sequences, length); false (with a message) on a malformed one.
bool parseShapes(const std::vector<std::string> &texts,
                 std::vector<std::pair<int32_t, int32_t>> &shapes) {
  for (const std::string &text : texts) {
    int sequences = 0, length = 0;
    char trailing = 0;
    if (std::sscanf(text.c_str(), "%dx%d%c", &sequences, &length, &trailing) != 2 ||
        sequences <= 0 || length <= 0) {
      std::cerr << "error: kda-prefill: --shapes: '" << text
                << "' is not SEQUENCESxLENGTH with both positive\n";
      return false;
    }
    shapes.emplace_back(sequences, length);
  }
  return true;
}

#ifdef HYBRID_BENCH_KDA
namespace kc = hybrid::kernels::cuda;

kc::KdaPrefillPath prefillPathOf(const std::string &name) {
  return name == "recurrent" ? kc::KdaPrefillPath::Recurrent
         : name == "chunked" ? kc::KdaPrefillPath::Chunked
                             : kc::KdaPrefillPath::Auto;
}
kc::KdaStateType stateTypeOf(const std::string &name) {
  return name == "bf16" ? kc::KdaStateType::BF16 : kc::KdaStateType::F32;
}
kc::KdaDecodePath decodePathOf(const std::string &name) {
  return name == "fused"   ? kc::KdaDecodePath::Fused
         : name == "split" ? kc::KdaDecodePath::Split
                           : kc::KdaDecodePath::Auto;
}

void printPrefillTable(const std::vector<kc::KdaPrefillBenchResult> &results) {
  std::printf("%-18s %9s %7s %6s %5s %10s %10s %9s %7s %9s %7s  %s\n", "kernel", "sequences",
              "length", "heads", "dim", "graph ms", "Mtok/s", "TB/s", "% copy", "TFLOP/s",
              "% bf16", "target (H200)");
  for (const auto &r : results) {
    const double tbPerSecond = r.bytes / (r.milliseconds * 1e-3) / 1e12;
    const double tflops = r.flops / (r.milliseconds * 1e-3) / 1e12;
    std::printf("%-18s %9d %7d %6d %5d %10.3f %10.2f %9.2f %6.1f%% %9.1f %6.1f%%  %s\n",
                r.chunked ? "kda-prefill-chunk" : "kda-prefill-recur", r.sequences, r.length,
                r.heads, r.headDim, r.milliseconds, r.tokensPerSecond / 1e6, tbPerSecond,
                100.0 * tbPerSecond / kc::kH200CopyTbPerSecond, tflops,
                100.0 * tflops / kc::kH200Bf16DenseTflops,
                kc::kdaPrefillTargetVerdict(r).c_str());
  }
}

void printDecodeTable(const std::vector<kc::KdaDecodeBenchResult> &results) {
  std::printf("%-10s %6s %6s %5s %6s %10s %10s %10s %11s %11s %10s  %s\n", "kernel", "batch",
              "heads", "dim", "path", "eager us", "graph us", "floor us", "state TB/s", "all TB/s",
              "% of copy", "target (H200)");
  for (const auto &r : results)
    std::printf("%-10s %6d %6d %5d %6s %10.2f %10.2f %10.2f %11.2f %11.2f %9.0f%%  %s\n",
                "kda-decode", r.batch, r.heads, r.headDim, r.split ? "split" : "fused",
                r.eagerMicroseconds, r.graphMicroseconds, r.graphFloorMicroseconds,
                r.graphStateTbPerSecond, r.graphTrafficTbPerSecond,
                100.0 * r.graphTrafficTbPerSecond / kc::kH200CopyTbPerSecond,
                kc::kdaDecodeTargetVerdict(r).c_str());
}

// One record row per result: named by the kernel and shape, timed by its graph replay.
void appendPrefillRows(const std::vector<kc::KdaPrefillBenchResult> &results,
                       std::vector<hybrid::bench::BenchRow> &rows) {
  for (const auto &r : results) {
    std::ostringstream json;
    json << "{\"kernel\": \"" << (r.chunked ? "kda-prefill-chunked" : "kda-prefill-recurrent")
         << "\", \"sequences\": " << r.sequences << ", \"length\": " << r.length
         << ", \"heads\": " << r.heads << ", \"head_dim\": " << r.headDim
         << ", \"graph_ms\": " << r.milliseconds << ", \"tokens_per_s\": " << r.tokensPerSecond
         << ", \"bytes\": " << r.bytes << ", \"flops\": " << r.flops << ", \"state\": \""
         << (r.bf16State ? "bf16" : "f32") << "\", \"target\": \""
         << kc::kdaPrefillTargetVerdict(r) << "\"}";
    rows.push_back({std::string(r.chunked ? "kda-prefill-chunked" : "kda-prefill-recurrent") +
                        " sequences=" + std::to_string(r.sequences) +
                        " length=" + std::to_string(r.length) + " heads=" +
                        std::to_string(r.heads) + " dim=" + std::to_string(r.headDim) +
                        " state=" + (r.bf16State ? "bf16" : "f32"),
                    r.milliseconds * 1e3, json.str()});
  }
}
void appendDecodeRows(const std::vector<kc::KdaDecodeBenchResult> &results,
                      std::vector<hybrid::bench::BenchRow> &rows) {
  for (const auto &r : results) {
    std::ostringstream json;
    json << "{\"kernel\": \"kda-decode\", \"batch\": " << r.batch << ", \"heads\": " << r.heads
         << ", \"head_dim\": " << r.headDim << ", \"eager_us\": " << r.eagerMicroseconds
         << ", \"graph_us\": " << r.graphMicroseconds
         << ", \"graph_floor_us\": " << r.graphFloorMicroseconds
         << ", \"state_bytes\": " << r.stateBytes
         << ", \"state_tb_per_s\": " << r.graphStateTbPerSecond
         << ", \"traffic_bytes\": " << r.trafficBytes
         << ", \"traffic_tb_per_s\": " << r.graphTrafficTbPerSecond << ", \"path\": \""
         << (r.split ? "split" : "fused") << "\", \"state\": \""
         << (r.bf16State ? "bf16" : "f32") << "\", \"target\": \""
         << kc::kdaDecodeTargetVerdict(r) << "\"}";
    rows.push_back({"kda-decode batch=" + std::to_string(r.batch) + " heads=" +
                        std::to_string(r.heads) + " dim=" + std::to_string(r.headDim) + " path=" +
                        (r.split ? "split" : "fused") + " state=" + (r.bf16State ? "bf16" : "f32"),
                    r.graphMicroseconds, json.str()});
  }
}

#endif

struct Options {
  std::vector<int32_t> batches = {1, 32, 128};
  int32_t heads = 32, headDim = 128, decodeIterations = 200, prefillIterations = 3;
  std::string decodePath = "auto", prefillPath = "auto", state = "f32", jsonPath; // jsonPath: serve
  std::vector<std::string> prefillShapes = {"1x8192", "8x1024"};
};

#ifdef HYBRID_BENCH_KDA
int runKdaDecode(const Options &o, const RecordOptions &record) {
  std::string error;
  const auto results = kc::benchKdaDecode(o.batches, o.heads, o.headDim, o.decodeIterations,
                                          decodePathOf(o.decodePath), stateTypeOf(o.state), error);
  if (!error.empty()) {
    std::cerr << "error: kda-decode: " << error << "\n";
    return 1;
  }
  printDecodeTable(results);
  std::vector<hybrid::bench::BenchRow> rows;
  appendDecodeRows(results, rows);
  return finishRecord(record, kc::benchDeviceName(), std::move(rows));
}

int runKdaPrefill(const Options &o, const RecordOptions &record) {
  std::vector<std::pair<int32_t, int32_t>> shapes;
  if (!parseShapes(o.prefillShapes, shapes))
    return 1;
  std::string error;
  const auto results = kc::benchKdaPrefill(shapes, o.heads, o.headDim, o.prefillIterations,
                                           prefillPathOf(o.prefillPath), stateTypeOf(o.state),
                                           error);
  if (!error.empty()) {
    std::cerr << "error: kda-prefill: " << error << "\n";
    return 1;
  }
  printPrefillTable(results);
  std::vector<hybrid::bench::BenchRow> rows;
  appendPrefillRows(results, rows);
  return finishRecord(record, kc::benchDeviceName(), std::move(rows));
}

// Every shape the issue sets a target for (PERF_TARGETS.md): decode B=1 and B=128 at H=32, and
// prefill 1x8192 and 8x1024 at H=32 and H=96, default kernel paths; one table each, one JSON.
int runKda(const Options &o, const RecordOptions &record) {
  std::string error;
  std::vector<hybrid::bench::BenchRow> rows;
  const auto decode = kc::benchKdaDecode({1, 128}, 32, 128, o.decodeIterations,
                                         kc::KdaDecodePath::Auto, kc::KdaStateType::F32, error);
  if (!error.empty()) {
    std::cerr << "error: kda: decode: " << error << "\n";
    return 1;
  }
  printDecodeTable(decode);
  appendDecodeRows(decode, rows);
  std::printf("\n");
  std::vector<kc::KdaPrefillBenchResult> prefill;
  for (int32_t heads : {32, 96}) {
    auto results = kc::benchKdaPrefill({{1, 8192}, {8, 1024}}, heads, 128, o.prefillIterations,
                                       kc::KdaPrefillPath::Auto, kc::KdaStateType::F32, error);
    if (!error.empty()) {
      std::cerr << "error: kda: prefill: " << error << "\n";
      return 1;
    }
    prefill.insert(prefill.end(), results.begin(), results.end());
  }
  printPrefillTable(prefill);
  appendPrefillRows(prefill, rows);
  return finishRecord(record, kc::benchDeviceName(), std::move(rows));
}

// The lightning indexer, decode: every sequence's query against its whole paged key cache.
struct IndexerOptions {
  std::vector<int32_t> batches = {1, 8, 64};
  std::vector<int32_t> contexts = {131072};
  int32_t heads = 64, headDim = 128, topK = 2048, iterations = 20;
  std::string keys = "mxfp8";
  std::string form = "unfused"; // what the runtime runs; fused (where the shape allows)
  std::string scores = "auto"; // the unfused form's tensor-core scores: auto, warpgroup, bf16, fp8
  std::string select = "auto"; // the unfused top-k after the warpgroup scores: auto or passes
};

int runDsaIndexer(const IndexerOptions &o, const RecordOptions &record) {
  const kc::IndexKeyType type = o.keys == "f32"   ? kc::IndexKeyType::F32
                                : o.keys == "fp8" ? kc::IndexKeyType::Fp8PerKey
                                                  : kc::IndexKeyType::Mxfp8;
  std::string error;
  const auto results = kc::benchIndexerDecode(
      o.batches, o.contexts, o.heads, o.headDim, o.topK, type, o.form == "fused",
      o.scores == "fp8-warpgroup" ? kc::IndexerParams::ScoreKernel::Fp8Warpgroup
      : o.scores == "fp8"         ? kc::IndexerParams::ScoreKernel::Fp8
      : o.scores == "bf16"        ? kc::IndexerParams::ScoreKernel::Bf16
      : o.scores == "warpgroup"   ? kc::IndexerParams::ScoreKernel::Warpgroup
                                  : kc::IndexerParams::ScoreKernel::Auto,
      o.select == "passes"       ? kc::IndexerParams::SelectForm::Passes
      : o.select == "one-launch" ? kc::IndexerParams::SelectForm::OneLaunch
      : o.select == "gathered"   ? kc::IndexerParams::SelectForm::Gathered
      : o.select == "cluster"    ? kc::IndexerParams::SelectForm::Cluster
                                 : kc::IndexerParams::SelectForm::Auto,
      o.iterations, error);
  if (!error.empty()) {
    std::cerr << "error: dsa-indexer: " << error << "\n";
    return 1;
  }
  std::printf("%-12s %6s %8s %6s %5s %6s %6s %8s %10s %10s %9s %8s  %s\n", "kernel", "batch",
              "context", "heads", "dim", "top-k", "keys", "form", "us", "floor us", "key TB/s",
              "% floor", "target (H200)");
  std::vector<hybrid::bench::BenchRow> rows;
  for (const auto &r : results) {
    const double tbPerSecond = r.keyBytes / (r.microseconds * 1e-6) / 1e12;
    std::printf("%-12s %6d %8d %6d %5d %6d %6s %8s %10.1f %10.1f %9.2f %7.1f%%  %s\n",
                "dsa-indexer", r.batch, r.context, r.heads, r.headDim, r.topK, o.keys.c_str(),
                r.fused ? "fused" : "unfused", r.microseconds,
                r.floorMicroseconds, tbPerSecond, 100.0 * r.floorMicroseconds / r.microseconds,
                kc::indexerTargetVerdict(r).c_str());
    std::ostringstream json;
    json << "{\"kernel\": \"dsa-indexer\", \"batch\": " << r.batch << ", \"context\": "
         << r.context << ", \"heads\": " << r.heads << ", \"head_dim\": " << r.headDim
         << ", \"top_k\": " << r.topK << ", \"keys\": \"" << o.keys << "\", \"form\": \""
         << (r.fused ? "fused" : "unfused") << "\", \"us\": " << r.microseconds << ", \"key_bytes\": " << r.keyBytes
         << ", \"floor_us\": " << r.floorMicroseconds << ", \"target\": \""
         << kc::indexerTargetVerdict(r) << "\"}";
    rows.push_back({"dsa-indexer batch=" + std::to_string(r.batch) + " context=" +
                        std::to_string(r.context) + " heads=" + std::to_string(r.heads) +
                        " dim=" + std::to_string(r.headDim) + " top_k=" + std::to_string(r.topK) +
                        " keys=" + o.keys + (r.fused ? " form=fused" : ""),
                    r.microseconds, json.str()});
  }
  return finishRecord(record, kc::benchDeviceName(), std::move(rows));
}

// Sparse MLA decode: every sequence's query heads over its top-k selected rows.
struct SparseMlaOptions {
  std::vector<int32_t> batches = {1, 8, 64};
  std::vector<int32_t> heads = {128, 16};
  int32_t topK = 2048, context = 8192, iterations = 20;
  bool prefill = false;
  std::vector<int32_t> splits = {0}; // 0: the kernel's cost model
  bool halfTiles = false;            // SparseMlaDecodeParams::halfTiles
};

int runDsaSparseMla(const SparseMlaOptions &o, const RecordOptions &record) {
  std::string error;
  const auto results =
      kc::benchSparseMla(o.batches, o.heads, o.topK, o.context, o.prefill, o.splits,
                         o.halfTiles, o.iterations, error);
  if (!error.empty()) {
    std::cerr << "error: dsa-sparse-mla: " << error << "\n";
    return 1;
  }
  std::printf("%-15s %6s %6s %6s %8s %6s %10s %10s %8s %9s %8s  %s\n", "kernel", "batch",
              "heads", "top-k", "context", "splits", "us", "floor us", "TB/s", "TFLOP/s", "% HBM",
              "target (H200)");
  std::vector<hybrid::bench::BenchRow> rows;
  for (const auto &r : results) {
    if (r.refused) {
      std::printf("%-15s %6d %6d %6d %8d %6d  refused: the kernel takes no %d splits of %d "
                  "positions at %d rows\n",
                  "dsa-sparse-mla", r.batch, r.heads, r.topK, r.context, r.splits, r.splits,
                  r.topK, r.batch);
      continue;
    }
    const double tbPerSecond = r.bytes / (r.microseconds * 1e-6) / 1e12;
    std::printf("%-15s %6d %6d %6d %8d %6s %10.1f %10.1f %8.2f %9.1f %7.1f%%  %s\n",
                "dsa-sparse-mla", r.batch, r.heads, r.topK, r.context,
                r.splits > 0 ? std::to_string(r.splits).c_str() : "auto", r.microseconds,
                r.floorMicroseconds, tbPerSecond, r.tflops,
                100.0 * r.floorMicroseconds / r.microseconds,
                kc::sparseMlaTargetVerdict(r).c_str());
    std::ostringstream json;
    const std::string kind = r.prefill ? "dsa-sparse-mla-prefill" : "dsa-sparse-mla-decode";
    json << "{\"kernel\": \"" << kind << "\", \"batch\": " << r.batch << ", \"heads\": " << r.heads
         << ", \"top_k\": " << r.topK << ", \"context\": " << r.context
         << ", \"splits\": " << r.splits << ", \"us\": " << r.microseconds
         << ", \"bytes\": " << r.bytes << ", \"floor_us\": " << r.floorMicroseconds
         << ", \"tflops\": " << r.tflops << ", \"target\": \"" << kc::sparseMlaTargetVerdict(r)
         << "\"}";
    // A row named as before unless its split count was asked for (stored records still match).
    rows.push_back({kind + " batch=" + std::to_string(r.batch) + " heads=" +
                        std::to_string(r.heads) + " top_k=" + std::to_string(r.topK) +
                        " context=" + std::to_string(r.context) +
                        (r.splits > 0 ? " splits=" + std::to_string(r.splits) : ""),
                    r.microseconds, json.str()});
  }
  return finishRecord(record, kc::benchDeviceName(), std::move(rows));
}

// The routed experts of a decode step: each token's top-k experts' weights read once.
struct MoeOptions {
  std::vector<int32_t> tokens = {1, 8, 64};
  int32_t experts = 256, topK = 8, hidden = 2304, intermediate = 1024, layers = 1,
          iterations = 20;
  bool fp8 = false;
};

int runMoe(const MoeOptions &o, const RecordOptions &record) {
  std::string error;
  const auto results = kc::benchMoeDecode(o.tokens, o.experts, o.topK, o.hidden, o.intermediate,
                                          o.fp8, o.layers, o.iterations, error);
  if (!error.empty()) {
    std::cerr << "error: moe: " << error << "\n";
    return 1;
  }
  std::printf("%-12s %6s %7s %5s %6s %6s %10s %10s %9s  %s\n", "kernel", "tokens", "experts",
              "top-k", "hidden", "inter", "us", "floor us", "TB/s", "target (H200)");
  std::vector<hybrid::bench::BenchRow> rows;
  for (const auto &r : results) {
    std::printf("%-12s %6d %7d %5d %6d %6d %10.1f %10.1f %9.2f  %s\n", "moe-experts", r.tokens,
                r.experts, r.topK, r.hidden, r.intermediate, r.microseconds, r.floorMicroseconds,
                r.terabytesPerSecond, kc::moeTargetVerdict(r).c_str());
    std::ostringstream json;
    json << "{\"kernel\": \"moe-experts\", \"tokens\": " << r.tokens
         << ", \"experts\": " << r.experts << ", \"top_k\": " << r.topK
         << ", \"hidden\": " << r.hidden << ", \"intermediate\": " << r.intermediate
         << ", \"layers\": " << r.layers << ", \"weights\": \"" << (r.fp8 ? "fp8" : "bf16") << "\""
         << ", \"us\": " << r.microseconds << ", \"weight_bytes\": " << r.weightBytes
         << ", \"floor_us\": " << r.floorMicroseconds << ", \"target\": \""
         << kc::moeTargetVerdict(r) << "\"}";
    rows.push_back({"moe-experts tokens=" + std::to_string(r.tokens) +
                        " experts=" + std::to_string(r.experts) +
                        " top_k=" + std::to_string(r.topK) + " hidden=" + std::to_string(r.hidden) +
                        " intermediate=" + std::to_string(r.intermediate) +
                        (r.layers > 1 ? " layers=" + std::to_string(r.layers) : "") +
                        (r.fp8 ? " fp8" : ""),
                    r.microseconds, json.str()});
  }
  return finishRecord(record, kc::benchDeviceName(), std::move(rows));
}

// The decode GEMVs at 1-8 rows on each form of the kernel (scalar, tensor cores).
struct GemvOptions {
  std::vector<int32_t> rows = {1, 2, 4, 5, 6, 8};
  // Kimi-Linear-48B's: KDA's projections of x, o_proj, the router's logits, the shared expert's
  // gate + up and down, the LM head.
  std::vector<std::string> shapes = {"2304x12576", "4096x2304", "2304x256",
                                     "2304x2048",  "1024x2304", "2304x163840"};
  int32_t layers = 0, iterations = 20;
  bool fp8 = false;
};

// DeepSeek-V3.2's FP8 projections at decode (--fp8 without --shapes): q_a, q_b, kv_a, o_proj,
// the indexer's wq_b, the shared expert's gate + up and down, the dense MLP's gate + up and down.
const std::vector<std::string> kDeepSeekFp8Shapes = {"7168x1536",  "1536x24576", "7168x576",
                                                     "16384x7168", "1536x8192",  "7168x4096",
                                                     "2048x7168",  "7168x36864", "18432x7168"};

// "INxOUT" items; false with a message naming the bad one.
bool parseGemvShapes(const std::vector<std::string> &items, std::vector<kc::GemvBenchShape> &out) {
  for (const std::string &item : items) {
    const size_t x = item.find('x');
    kc::GemvBenchShape shape;
    try {
      size_t used = 0, usedOut = 0;
      shape.in = x == std::string::npos ? 0 : std::stoll(item.substr(0, x), &used);
      shape.out = x == std::string::npos ? 0 : std::stoll(item.substr(x + 1), &usedOut);
      if (used != x || usedOut != item.size() - x - 1)
        shape.in = 0;
    } catch (const std::exception &) {
      shape.in = 0;
    }
    if (shape.in <= 0 || shape.out <= 0) {
      std::cerr << "error: gemv: --shapes: '" << item << "' is not INxOUT (positive sizes)\n";
      return false;
    }
    out.push_back(shape);
  }
  return true;
}

int runGemv(const GemvOptions &o, const RecordOptions &record) {
  std::vector<kc::GemvBenchShape> shapes;
  const bool kimiShapes = o.shapes == GemvOptions{}.shapes; // --shapes not given
  if (!parseGemvShapes(o.fp8 && kimiShapes ? kDeepSeekFp8Shapes : o.shapes, shapes))
    return 1;
  std::string error;
  const auto results = o.fp8 ? kc::benchFp8GemvDecode(o.rows, shapes, o.layers, o.iterations, error)
                             : kc::benchGemvDecode(o.rows, shapes, o.layers, o.iterations, error);
  if (!error.empty()) {
    std::cerr << "error: gemv: " << error << "\n";
    return 1;
  }
  std::printf("%-6s %4s %6s %7s %-13s %7s %10s %8s %7s\n", "kernel", "rows", "in", "out", "form",
              "layers", "us", "TB/s", "copy");
  std::vector<hybrid::bench::BenchRow> rows;
  for (const auto &r : results) {
    std::printf("%-6s %4d %6lld %7lld %-13s %7d %10.2f %8.2f %6.0f%%%s\n", "gemv", r.rows,
                static_cast<long long>(r.in), static_cast<long long>(r.out), r.form.c_str(),
                r.layers, r.microseconds, r.terabytesPerSecond, 100.0 * r.copyShare,
                r.automatic ? "  (default)" : "");
    std::ostringstream json;
    json << "{\"kernel\": \"gemv\", \"rows\": " << r.rows << ", \"in\": " << r.in
         << ", \"out\": " << r.out << ", \"form\": \"" << r.form
         << "\", \"default\": " << (r.automatic ? "true" : "false") << ", \"layers\": " << r.layers
         << ", \"us\": " << r.microseconds << ", \"weight_bytes\": " << r.weightBytes
         << ", \"tb_per_s\": " << r.terabytesPerSecond << "}";
    rows.push_back({"gemv rows=" + std::to_string(r.rows) + " in=" + std::to_string(r.in) +
                        " out=" + std::to_string(r.out) + " form=" + r.form,
                    r.microseconds, json.str()});
  }
  return finishRecord(record, kc::benchDeviceName(), std::move(rows));
}

#else
int noCuda(const char *subcommand) {
  std::cerr << "error: " << subcommand
            << ": this hybrid-bench was built without CUDA (HYBRID_ENABLE_CUDA)\n";
  return 1;
}
int runKdaDecode(const Options &, const RecordOptions &) { return noCuda("kda-decode"); }
int runKdaPrefill(const Options &o, const RecordOptions &) {
  std::vector<std::pair<int32_t, int32_t>> shapes;
  return parseShapes(o.prefillShapes, shapes) ? noCuda("kda-prefill") : 1;
}
int runKda(const Options &, const RecordOptions &) { return noCuda("kda"); }
struct IndexerOptions {
  std::vector<int32_t> batches = {1, 8, 64};
  std::vector<int32_t> contexts = {131072};
  int32_t heads = 64, headDim = 128, topK = 2048, iterations = 20;
  std::string keys = "mxfp8";
  std::string form = "unfused";
  std::string scores = "auto";
};
int runDsaIndexer(const IndexerOptions &, const RecordOptions &) { return noCuda("dsa-indexer"); }
struct MoeOptions {
  std::vector<int32_t> tokens = {1, 8, 64};
  int32_t experts = 256, topK = 8, hidden = 2304, intermediate = 1024, layers = 1,
          iterations = 20;
  bool fp8 = false;
};
int runMoe(const MoeOptions &, const RecordOptions &) { return noCuda("moe"); }
struct GemvOptions {
  std::vector<int32_t> rows = {1, 2, 4, 5, 6, 8};
  std::vector<std::string> shapes = {"2304x12576", "4096x2304", "2304x256",
                                     "2304x2048",  "1024x2304", "2304x163840"};
  int32_t layers = 0, iterations = 20;
  bool fp8 = false;
};
int runGemv(const GemvOptions &, const RecordOptions &) { return noCuda("gemv"); }
struct SparseMlaOptions {
  std::vector<int32_t> batches = {1, 8, 64};
  std::vector<int32_t> heads = {128, 16};
  int32_t topK = 2048, context = 8192, iterations = 20;
  bool prefill = false;
  std::vector<int32_t> splits = {0};
  bool halfTiles = false;
};
int runDsaSparseMla(const SparseMlaOptions &, const RecordOptions &) {
  return noCuda("dsa-sparse-mla");
}
#endif

// The whole model: prefill (TTFT) and decode (TPOT) per batch and context, each decode row
// against the bytes a step must move.
struct E2eCommandOptions {
  std::string model, plotPath;
  std::string timelinePath; // --timeline: one decode step a row as a Chrome trace
  hybrid::LoadOptions load;
  hybrid::bench::E2eOptions bench;
  bool skipCollectives = false; // timing only: the sharded steps without their communication
};

// --timeline: each row's step summarized (rank 0) and all of them as one Chrome trace at
// `path` (a sharded launch's other ranks at path.rank<r>).
int writeTimelines(const std::vector<hybrid::bench::LabelledTimeline> &timelines,
                   const std::string &path, int rank) {
  const std::string file = rank == 0 ? path : path + ".rank" + std::to_string(rank);
  std::ofstream out(file, std::ios::binary);
  out << hybrid::bench::chromeTraceJson(timelines);
  out.close();
  if (!out) {
    std::cerr << "error: e2e: --timeline: cannot write " << file << "\n";
    return 1;
  }
  if (rank != 0)
    return 0;
  for (const auto &t : timelines)
    std::printf("timeline %s: %s", t.label.c_str(),
                hybrid::bench::formatTimelineSummary(hybrid::bench::summarizeTimeline(t.activities))
                    .c_str());
  std::printf("timeline: %zu rows written to %s (chrome://tracing, ui.perfetto.dev)\n",
              timelines.size(), file.c_str());
  return 0;
}

// --timeline on a kernel benchmark: the device's work over the whole run (warm-ups, captures
// and every timed replay) summarized per kernel and written as a Chrome trace: how a benchmark's
// launches split its time in a graph, where a profiler replaying one kernel at a time cannot
// show the overlaps. Divide a kernel's exposed time by its launches for one call's share.
int withKernelTimeline(const std::string &path, const std::string &label,
                       const std::function<int()> &run) {
  if (path.empty())
    return run();
#ifdef HYBRID_BENCH_KDA
  if (std::string error = kc::startDeviceTimeline(); !error.empty()) {
    std::cerr << "error: --timeline: " << error << "\n";
    return 1;
  }
  const int status = run();
  std::vector<hybrid::bench::LabelledTimeline> timelines{{label, {}}};
  if (std::string error = kc::stopDeviceTimeline(timelines[0].activities); !error.empty()) {
    std::cerr << "error: --timeline: " << error << "\n";
    return 1;
  }
  return writeTimelines(timelines, path, 0) | status;
#else
  (void)label;
  return noCuda("--timeline");
#endif
}

// `hybrid-bench timeline FILE [--against BASE]`: a stored trace's rows summarized, or each row
// against the base trace's row of the same label. No device needed.
int runTimelineCommand(const std::string &path, const std::string &basePath, int top) {
  auto read = [](const std::string &file)
      -> hybrid::StatusOr<std::vector<hybrid::bench::LabelledTimeline>> {
    std::ifstream in(file, std::ios::binary);
    if (!in)
      return hybrid::Status::error(file + ": cannot open");
    std::stringstream text;
    text << in.rdbuf();
    return hybrid::bench::readChromeTrace(text.str(), file);
  };
  auto timelines = read(path);
  if (!timelines) {
    std::cerr << "error: timeline: " << timelines.status().message() << "\n";
    return 1;
  }
  if (basePath.empty()) {
    for (const auto &t : *timelines)
      std::printf(
          "timeline %s: %s", t.label.c_str(),
          hybrid::bench::formatTimelineSummary(hybrid::bench::summarizeTimeline(t.activities), top)
              .c_str());
    return 0;
  }
  auto base = read(basePath);
  if (!base) {
    std::cerr << "error: timeline: --against: " << base.status().message() << "\n";
    return 1;
  }
  int compared = 0;
  for (const auto &t : *timelines)
    for (const auto &b : *base)
      if (b.label == t.label) {
        std::printf("timeline %s, against %s: %s", t.label.c_str(), basePath.c_str(),
                    hybrid::bench::compareTimelineSummaries(
                        hybrid::bench::summarizeTimeline(b.activities),
                        hybrid::bench::summarizeTimeline(t.activities), top)
                        .c_str());
        ++compared;
      }
  if (compared == 0) {
    std::cerr << "error: timeline: no row of " << path << " has a label in " << basePath << "\n";
    return 1;
  }
  return 0;
}

int runE2eCommand(E2eCommandOptions o, const RecordOptions &record) {
  if (!o.timelinePath.empty() && o.load.device != "cuda") {
    std::cerr << "error: e2e: --timeline records a GPU's work: it needs --device cuda\n";
    return 1;
  }
  int64_t maxBatch = 1, maxContext = 1, kvTokens = 0;
  for (int64_t batch : o.bench.batches)
    for (int64_t context : o.bench.contexts) {
      maxBatch = std::max(maxBatch, batch);
      maxContext = std::max(maxContext, context);
      // Shared prompt: per sequence its last partial block, copied pages and decode rows (the
      // model adds a full context of pages per kept prefix, LoadOptions::prefixCacheEntries).
      const int64_t perSequence = o.bench.sharedPrompt ? o.bench.decodeSteps + 2 + 3 * 64
                                                       : context + o.bench.decodeSteps + 2 + 64;
      kvTokens = std::max(kvTokens, batch * perSequence); // kept prompts: pages of their own
    }
  if (o.bench.sharedPrompt) { // each context's prompt kept for all its rows
    const std::set<int64_t> distinct(o.bench.contexts.begin(), o.bench.contexts.end());
    o.load.prefixCacheEntries =
        std::max(o.load.prefixCacheEntries, static_cast<int32_t>(distinct.size()));
  }
  o.load.maxSequences = int32_t(maxBatch);
  o.load.maxContextTokens = maxContext + o.bench.decodeSteps + 2 +
                            (o.bench.aroundProfiledStep || !o.timelinePath.empty() ? 1 : 0);
  o.load.kvCacheTokens = kvTokens; // the largest row's, not every batch at the longest context
  // A sharded model launched one process per rank (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
  // MASTER_PORT): every rank runs the same rows, rank 0 reports.
  auto processRank = hybrid::comm::connectFromEnvironment(o.load.device);
  if (!processRank) {
    std::cerr << "error: e2e: " << processRank.status().message() << "\n";
    return 1;
  }
  o.load.communicator = processRank->get();
  std::unique_ptr<hybrid::comm::Communicator> skipping;
  if (o.skipCollectives) {
    if (!*processRank) {
      std::cerr << "error: e2e: --skip-collectives: this is not a sharded launch (WORLD_SIZE is "
                   "unset or 1): there are no collectives to skip\n";
      return 1;
    }
    skipping = hybrid::comm::skipCollectives(**processRank);
    o.load.communicator = skipping.get();
    std::fprintf(stderr, "e2e: collectives skipped (timing only: the logits and tokens are "
                         "wrong; the difference to a real run is the communication)\n");
  }
  const bool reports = !*processRank || (*processRank)->rank() == 0;
  const auto loadStart = std::chrono::steady_clock::now();
  auto model = hybrid::Model::load(o.model, o.load);
  if (!model) {
    std::cerr << "error: e2e: " << model.status().message() << "\n";
    return 1;
  }
  const double loadSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - loadStart).count();
  const hybrid::WeightGeneration &generated = (*model)->weightGeneration();
  std::fprintf(stderr, "e2e: loaded %s on %s in %.1f s (synthetic weights: %.1f GB generated)\n",
               o.model.c_str(), o.load.device.c_str(), loadSeconds,
               double(generated.hostBytes + generated.deviceBytes) / 1e9);
  std::fprintf(stderr, "e2e: load %s\n", (*model)->loadTimings().summary().c_str());
  // Which dispatches run where: a step left on the cpu reference explains a slow row at once.
  if (const std::string placement = (*model)->placementReport(); !placement.empty())
    std::fprintf(stderr, "%s%s", placement.c_str(), placement.back() == '\n' ? "" : "\n");
  // --timeline: the device's activities during each row's extra step (DeviceTimeline.h).
  std::vector<hybrid::bench::LabelledTimeline> timelines;
  std::string timelineError;
  if (!o.timelinePath.empty()) {
#ifdef HYBRID_BENCH_KDA
    auto profiler = o.bench.aroundProfiledStep;
    o.bench.aroundProfiledStep = [&, profiler](bool start, int64_t batch, int64_t context) {
      if (profiler)
        profiler(start, batch, context);
      if (start) {
        if (timelineError.empty())
          timelineError = kc::startDeviceTimeline();
        return;
      }
      timelines.push_back(
          {"batch " + std::to_string(batch) + " context " + std::to_string(context), {}});
      if (timelineError.empty())
        timelineError = kc::stopDeviceTimeline(timelines.back().activities);
    };
#else
    return noCuda("e2e --timeline");
#endif
  }
  auto rows = hybrid::bench::runE2e(**model, o.bench, [reports](const std::string &line) {
    if (reports)
      std::fprintf(stderr, "e2e: %s\n", line.c_str());
  });
  if (!rows) {
    std::cerr << "error: e2e: " << rows.status().message() << "\n";
    return 1;
  }
  if (!timelineError.empty()) {
    std::cerr << "error: e2e: --timeline: " << timelineError << "\n";
    return 1;
  }
  if (!timelines.empty() || !o.timelinePath.empty())
    if (int status =
            writeTimelines(timelines, o.timelinePath, reports ? 0 : (*processRank)->rank()))
      return status;
  if (!reports)
    return 0;
  std::printf("%-5s %6s %8s %10s %12s %10s %12s %10s %7s %9s\n", "", "batch", "context",
              "TTFT ms", "prefill t/s", "TPOT us", "decode t/s", "floor us", "ratio", "GB/step");
  std::vector<hybrid::bench::BenchRow> records;
  for (const auto &r : *rows) {
    std::printf("%-5s %6lld %8lld %10.1f %12.0f %10.1f %12.1f %10.1f %6.2fx %9.3f\n", "e2e",
                static_cast<long long>(r.batch), static_cast<long long>(r.context), r.ttftMs,
                r.prefillTokensPerSecond, r.tpotUs, r.decodeTokensPerSecond, r.floorUs, r.ratio(),
                r.bytes.total() / 1e9);
    std::ostringstream json;
    json << "{\"kernel\": \"e2e\", \"model\": \"" << o.model << "\", \"device\": \""
         << o.load.device << "\", \"batch\": " << r.batch << ", \"context\": " << r.context
         << ", \"shared_prompt\": " << (o.bench.sharedPrompt ? "true" : "false")
         << ", \"batch_invariant\": " << (o.load.batchInvariant ? "true" : "false")
         << ", \"bf16_gemm_inputs\": " << (o.load.bf16GemmInputs ? "true" : "false")
         << ", \"chained\": " << (o.bench.chainedDecode ? "true" : "false")
         << ", \"ttft_reused\": " << (r.ttftReused ? "true" : "false")
         << ", \"ttft_ms\": " << r.ttftMs
         << ", \"prefill_tokens_per_s\": " << r.prefillTokensPerSecond
         << ", \"tpot_us\": " << r.tpotUs
         << ", \"decode_tokens_per_s\": " << r.decodeTokensPerSecond
         << ", \"floor_us\": " << r.floorUs << ", \"ratio\": " << r.ratio()
         << ", \"bytes\": {\"weights\": " << r.bytes.weights << ", \"experts\": " << r.bytes.experts
         << ", \"kv_cache\": " << r.bytes.kvCache
         << ", \"recurrent_state\": " << r.bytes.recurrentState << "}}";
    records.push_back({"e2e batch=" + std::to_string(r.batch) + " context=" +
                           std::to_string(r.context),
                       r.tpotUs, json.str()});
  }
  if (std::any_of(rows->begin(), rows->end(), [](const auto &r) { return r.ttftReused; }))
    std::printf("(shared prompt: a row's TTFT after the first row of its context is that row's "
                "prefill of the same prompt)\n");
  if (!o.plotPath.empty())
    if (hybrid::Status plotted = hybrid::bench::writeE2ePlot(*rows, o.plotPath); !plotted) {
      std::cerr << "error: e2e: --plot: " << plotted.message() << "\n";
      return 1;
    }
  std::string device = o.load.device;
#ifdef HYBRID_BENCH_KDA
  if (o.load.device == "cuda")
    device = kc::benchDeviceName();
#endif
  return finishRecord(record, device, std::move(records));
}

// The serving benchmark against `--host:--port`, or against a server started here on `--model`.
int runServe(hybrid::LoadGeneratorOptions load, const std::string &modelDir,
             hybrid::LoadOptions modelOptions, const hybrid::SchedulerOptions &scheduler,
             const std::string &jsonPath) {
  std::unique_ptr<hybrid::Model> model;
  std::unique_ptr<hybrid::Server> server;
  std::thread serving;
  if (!modelDir.empty()) {
    auto loaded = hybrid::Model::load(modelDir, modelOptions);
    if (!loaded) {
      std::cerr << "error: serve: " << loaded.status().message() << "\n";
      return 1;
    }
    model = std::move(*loaded);
    load.vocabSize = model->vocabSize();
    hybrid::ServeOptions serveOptions;
    serveOptions.port = 0;
    serveOptions.scheduler = scheduler;
    serveOptions.maxQueuedRequests = static_cast<size_t>(std::max(load.concurrency, 8));
    auto started = hybrid::Server::start(*model, serveOptions);
    if (!started) {
      std::cerr << "error: serve: " << started.status().message() << "\n";
      return 1;
    }
    server = std::move(*started);
    load.host = "127.0.0.1";
    load.port = server->port();
    serving = std::thread([&server] { (void)server->serve(); });
  }
  auto report = hybrid::runLoad(load);
  if (server) {
    server->stop();
    serving.join();
  }
  if (!report) {
    std::cerr << "error: serve: " << report.status().message() << "\n";
    return 1;
  }
  std::printf("%s", hybrid::formatLoadReport(load, *report).c_str());
  if (!writeText(jsonPath, hybrid::loadReportJson(load, *report)))
    return 1;
  return report->failed == 0 ? 0 : 1;
}

// Speculative against plain decoding on `--model`: half the prompts repeat a random 8-token
// pattern (where prompt lookup drafts well), half are random.
int runDecodeBatch(const std::string &modelDir, hybrid::LoadOptions options,
                   const std::vector<int32_t> &batches, int32_t promptTokens, int32_t steps) {
  options.maxSequences = std::max(options.maxSequences,
                                  *std::max_element(batches.begin(), batches.end()));
  auto model = hybrid::Model::load(modelDir, options);
  if (!model) {
    std::cerr << "error: decode-batch: " << model.status().message() << "\n";
    return 1;
  }
  std::mt19937_64 rng(1);
  std::uniform_int_distribution<int64_t> token(0, (*model)->vocabSize() - 1);
  std::vector<int64_t> prompt(static_cast<size_t>(promptTokens));
  for (int64_t &id : prompt)
    id = token(rng);
  std::printf("%-12s %6s %6s %12s %12s\n", "kernel", "batch", "steps", "ms/step", "tokens/s");
  for (int32_t batch : batches) {
    auto report = hybrid::benchmarkBatchedDecode(**model, prompt, batch, steps);
    if (!report) {
      std::cerr << "error: decode-batch: batch " << batch << ": " << report.status().message()
                << "\n";
      return 1;
    }
    std::printf("%-12s %6lld %6lld %12.3f %12.1f\n", "decode-batch",
                static_cast<long long>(report->batch), static_cast<long long>(report->steps),
                report->stepMilliseconds, report->tokensPerSecond);
  }
  return 0;
}

// Speculative against plain decoding at each batch: `batch` requests of repetitive text (each
// its own 8-token pattern repeated), decoding together through the scheduler.
struct SpecOptions {
  std::string model;
  hybrid::LoadOptions load;
  std::vector<int32_t> batches = {1};
  int32_t promptTokens = 64, maxTokens = 32, draftTokens = 4;
  std::string draftSource = "prompt-lookup";
  double replayAcceptance = 1.0;      // --draft-source replay only
  bool replayAcceptanceGiven = false; // --replay-acceptance was on the command line
  bool alwaysDraft = false;
  uint64_t seed = 1;
};

int runSpec(SpecOptions o, const RecordOptions &record) {
  auto draftSource = hybrid::parseDraftSource(o.draftSource);
  if (!draftSource) {
    std::cerr << "error: spec: --draft-source: " << draftSource.status().message() << "\n";
    return 1;
  }
  const bool replay = *draftSource == hybrid::DraftSourceKind::Replay;
  if (o.replayAcceptanceGiven && !replay) {
    std::cerr << "error: spec: --replay-acceptance applies to --draft-source replay only (not "
              << hybrid::draftSourceName(*draftSource) << ")\n";
    return 1;
  }
  const hybrid::ReplayOptions replayOptions{.acceptance = o.replayAcceptance,
                                            .seed = o.seed};
  // The source as printed: replay with the acceptance it emulates.
  char acceptanceText[32];
  std::snprintf(acceptanceText, sizeof acceptanceText, "%.2f", replayOptions.acceptance);
  std::string sourceName(hybrid::draftSourceName(*draftSource));
  if (replay)
    sourceName += std::string(" (acceptance ") + acceptanceText + ")";
  const int32_t maxBatch = *std::max_element(o.batches.begin(), o.batches.end());
  o.load.maxSequences = maxBatch;
  // A verification pass may append draftTokens + 1 rows before it truncates.
  o.load.maxContextTokens = o.promptTokens + o.maxTokens + o.draftTokens + 1;
  auto model = hybrid::Model::load(o.model, o.load);
  if (!model) {
    std::cerr << "error: spec: " << model.status().message() << "\n";
    return 1;
  }
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<int64_t> token(0, (*model)->vocabSize() - 1);
  std::vector<hybrid::bench::BenchRow> rows;
  bool identical = true;
  for (int32_t batch : o.batches) {
    std::vector<std::vector<int64_t>> prompts(static_cast<size_t>(batch));
    for (std::vector<int64_t> &prompt : prompts) {
      std::vector<int64_t> pattern(8);
      for (int64_t &id : pattern)
        id = token(rng);
      for (int32_t t = 0; t < o.promptTokens; ++t)
        prompt.push_back(pattern[static_cast<size_t>(t) % pattern.size()]);
    }
    const hybrid::SpeculationOptions options{.maxNewTokens = o.maxTokens,
                                             .draftTokens = o.draftTokens,
                                             .draftSource = *draftSource,
                                             .draftOnlyWhenItPays = !o.alwaysDraft,
                                             .prefillChunkTokens = 8192,
                                             .replay = replayOptions};
    const hybrid::CudaGraphCounts graphsBefore = (*model)->cudaGraphCounts();
    auto report = hybrid::benchmarkSpeculation(**model, prompts, options);
    const hybrid::CudaGraphCounts graphsAfter = (*model)->cudaGraphCounts();
    if (!report) {
      std::cerr << "error: spec: batch " << batch << ": " << report.status().message() << "\n";
      return 1;
    }
    const auto &r = *report;
    identical = identical && r.identical;
    const double ratio = r.speculativeTokensPerSecond / std::max(r.plainTokensPerSecond, 1e-9);
    const double acceptance = double(r.acceptedTokens) / double(std::max<int64_t>(1, r.draftedTokens));
    // Tokens a verification pass yields: its accepted drafts and the model's own next token.
    const double perPass =
        double(r.acceptedTokens + r.verifySteps) / double(std::max<int64_t>(1, r.verifySteps));
    std::printf("spec batch %d: %lld prompts x %d tokens, %lld generated, %s drafts <= %d: "
                "outputs %s\n"
                "  decode %.1f tokens/s plain, %.1f speculative (%.2fx); %lld passes in %lld "
                "program calls (%.1f sequences per call), %lld "
                "drafted, %lld accepted (acceptance %.0f%%, %.2f tokens per pass); %lld decode "
                "steps without a pass (drafting did not pay, or nothing was proposed)\n"
                "  rollback memory %.1f KiB per sequence: state snapshot %.1f KiB, KDA replay "
                "inputs %.1f KiB, KV tail pages %.1f KiB (truncated, not copied)\n",
                batch, static_cast<long long>(r.prompts), o.promptTokens,
                static_cast<long long>(r.generatedTokens),
                sourceName.c_str(), o.draftTokens,
                r.identical ? "identical" : "DIFFERENT", r.plainTokensPerSecond,
                r.speculativeTokensPerSecond, ratio, static_cast<long long>(r.verifySteps),
                static_cast<long long>(r.verifyCalls),
                double(r.verifySteps) / double(std::max<int64_t>(1, r.verifyCalls)),
                static_cast<long long>(r.draftedTokens), static_cast<long long>(r.acceptedTokens),
                100.0 * acceptance, perPass, static_cast<long long>(r.declinedDrafts),
                r.rollbackBytesPerSequence / 1024.0, r.stateSnapshotBytes / 1024.0,
                r.replayLogBytes / 1024.0, r.kvTailBytes / 1024.0);
    if (r.verify.calls > 0) {
      const double perCall = 1e3 / double(r.verify.calls);
      std::printf("  verification calls: %.2f ms each (%.1f sequences): snapshots %.2f, pass %.2f "
                  "(launches, device, logits to the host), choosing %.2f, rollbacks %.2f\n",
                  perCall * (r.verify.snapshotSeconds + r.verify.passSeconds +
                             r.verify.chooseSeconds + r.verify.rollbackSeconds),
                  double(r.verify.sequences) / double(r.verify.calls),
                  perCall * r.verify.snapshotSeconds, perCall * r.verify.passSeconds,
                  perCall * r.verify.chooseSeconds, perCall * r.verify.rollbackSeconds);
    }
    // This batch's prefill and verification calls (plain and speculative runs together).
    const long long prefillCaptures = graphsAfter.prefillCaptures - graphsBefore.prefillCaptures;
    const long long prefillReplays = graphsAfter.prefillReplays - graphsBefore.prefillReplays;
    const long long prefillEager = graphsAfter.prefillEager - graphsBefore.prefillEager;
    const long long prefillEvictions =
        graphsAfter.prefillEvictions - graphsBefore.prefillEvictions;
    if (o.load.device == "cuda")
      std::printf("  cuda graphs: %lld decode graphs held; prefill / verification calls: %lld "
                  "replayed (%lld captures), %lld eager, %lld graphs evicted\n",
                  static_cast<long long>(graphsAfter.decodeGraphs), prefillReplays,
                  prefillCaptures, prefillEager, prefillEvictions);
    std::ostringstream json;
    json << "{\"batch\": " << batch << ", \"prompt_tokens\": " << o.promptTokens
         << ", \"new_tokens\": " << o.maxTokens << ", \"draft_tokens\": " << o.draftTokens
         << ", \"draft_source\": \"" << hybrid::draftSourceName(*draftSource) << "\"";
    if (replay)
      json << ", \"replay_acceptance\": " << replayOptions.acceptance;
    json << ", \"identical\": " << (r.identical ? "true" : "false")
         << ", \"plain_tokens_per_second\": " << r.plainTokensPerSecond
         << ", \"speculative_tokens_per_second\": " << r.speculativeTokensPerSecond
         << ", \"speedup\": " << ratio << ", \"verify_passes\": " << r.verifySteps
         << ", \"verify_calls\": " << r.verifyCalls
         << ", \"drafted\": " << r.draftedTokens << ", \"accepted\": " << r.acceptedTokens
         << ", \"acceptance\": " << acceptance << ", \"tokens_per_pass\": " << perPass
         << ", \"declined_drafts\": " << r.declinedDrafts
         << ", \"rollback_bytes_per_sequence\": {\"state_snapshot\": " << r.stateSnapshotBytes
         << ", \"kda_replay_inputs\": " << r.replayLogBytes << ", \"kv_tail_pages\": "
         << r.kvTailBytes << "}";
    if (o.load.device == "cuda")
      json << ", \"cuda_graphs\": " << (o.load.cudaGraphs ? "true" : "false")
           << ", \"prefill_graphs\": "
           << (o.load.cudaGraphs && o.load.prefillGraphs ? "true" : "false")
           << ", \"prefill_graph_replays\": " << prefillReplays
           << ", \"prefill_graph_captures\": " << prefillCaptures
           << ", \"prefill_eager_calls\": " << prefillEager;
    json << "}";
    // Compared by the speculative decode's time per token.
    rows.push_back({"spec batch=" + std::to_string(batch) + " prompt=" +
                        std::to_string(o.promptTokens) + " new=" + std::to_string(o.maxTokens) +
                        " draft=" + std::to_string(o.draftTokens) + " source=" +
                        std::string(hybrid::draftSourceName(*draftSource)) +
                        (replay ? std::string(" acceptance=") + acceptanceText : ""),
                    1e6 / std::max(r.speculativeTokensPerSecond, 1e-9), json.str()});
  }
  std::string device = o.load.device;
#ifdef HYBRID_BENCH_KDA
  if (o.load.device == "cuda")
    device = kc::benchDeviceName();
#endif
  const int recorded = finishRecord(record, device, std::move(rows));
  return identical ? recorded : 1;
}

} // namespace

int main(int argc, char **argv) {
  CLI::App app{"hybrid kernel benchmarks (CUDA events, warm-up, median of 7)"};
  app.require_subcommand(1);
  Options o;

  CLI::App *kda = app.add_subcommand(
      "kda", "KDA decode and prefill at every shape with a target (PERF_TARGETS.md)");
  RecordOptions record;
  for (int i = 0; i < argc; ++i)
    record.command += (i ? " " : "") + std::string(i ? argv[i] : "hybrid-bench");
  addRecordOptions(kda, record);
  std::string kernelTimeline; // --timeline of whichever kernel benchmark runs
  addKernelTimelineOption(kda, kernelTimeline);

  CLI::App *kdaDecode = app.add_subcommand("kda-decode", "fused KDA decode step");
  kdaDecode->add_option("--batch", o.batches, "Batch sizes")->delimiter(',');
  kdaDecode->add_option("--heads", o.heads, "KDA heads")->check(CLI::PositiveNumber);
  kdaDecode->add_option("--head-dim", o.headDim, "Head dimension (64 or 128)");
  kdaDecode->add_option("--iterations", o.decodeIterations, "Calls per timing")
      ->check(CLI::PositiveNumber);
  addRecordOptions(kdaDecode, record);
  addKernelTimelineOption(kdaDecode, kernelTimeline);
  kdaDecode->add_option("--path", o.decodePath, "Kernels: auto (by batch), fused or split")
      ->check(CLI::IsMember({"auto", "fused", "split"}));
  kdaDecode->add_option("--state", o.state, "Recurrent state storage: f32 or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}));

  CLI::App *kdaPrefill =
      app.add_subcommand("kda-prefill", "KDA prefill, varlen, with initial and final states");
  kdaPrefill->add_option("--shapes", o.prefillShapes, "SEQUENCESxLENGTH, comma-separated")
      ->delimiter(',');
  kdaPrefill->add_option("--heads", o.heads, "KDA heads")->check(CLI::PositiveNumber);
  kdaPrefill->add_option("--head-dim", o.headDim, "Head dimension (64 or 128)");
  kdaPrefill->add_option("--iterations", o.prefillIterations, "Calls per timing")
      ->check(CLI::PositiveNumber);
  addRecordOptions(kdaPrefill, record);
  addKernelTimelineOption(kdaPrefill, kernelTimeline);
  kdaPrefill->add_option("--path", o.prefillPath,
                         "Kernels: auto (chunked at head dim 128), recurrent or chunked")
      ->check(CLI::IsMember({"auto", "recurrent", "chunked"}));
  kdaPrefill->add_option("--state", o.state, "Recurrent state storage: f32 or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}));
  IndexerOptions indexer;
  CLI::App *dsaIndexer = app.add_subcommand(
      "dsa-indexer", "DSA lightning indexer decode (scores + top-k) over paged keys");
  dsaIndexer->add_option("--batch", indexer.batches, "Sequences (one query each)")
      ->delimiter(',')->check(CLI::PositiveNumber);
  dsaIndexer->add_option("--context", indexer.contexts, "Keys per sequence")
      ->delimiter(',')->check(CLI::PositiveNumber);
  dsaIndexer->add_option("--heads", indexer.heads, "Indexer heads (at most 64)")
      ->check(CLI::Range(1, 64));
  dsaIndexer->add_option("--head-dim", indexer.headDim, "64 or 128")
      ->check(CLI::IsMember({64, 128}));
  dsaIndexer->add_option("--top-k", indexer.topK, "Positions selected")
      ->check(CLI::PositiveNumber);
  dsaIndexer
      ->add_option("--keys", indexer.keys,
                   "Key cache format: mxfp8 (queries MXFP8 too), fp8 (one scale per key, "
                   "the queries one a head: DeepSeek-V3.2's FP8 indexer) or f32")
      ->check(CLI::IsMember({"mxfp8", "fp8", "f32"}));
  dsaIndexer->add_option("--form", indexer.form,
                         "fused: scores and top-k in one launch, the scores kept on chip (FP8 "
                         "keys); unfused: scores through a workspace, then the top-k")
      ->check(CLI::IsMember({"fused", "unfused"}));
  dsaIndexer
      ->add_option("--scores", indexer.scores,
                   "unfused form, FP8 keys: auto, warpgroup (keys widened to f16 in "
                   "registers, warpgroup MMAs), fp8-warpgroup (--keys fp8: E4M3 warpgroup "
                   "MMAs, what auto takes there), bf16 (mma.sync on widened keys) or fp8 "
                   "(E4M3 mma.sync, one MX block a step)")
      ->check(CLI::IsMember({"auto", "bf16", "fp8", "warpgroup", "fp8-warpgroup"}));
  dsaIndexer
      ->add_option("--select", indexer.select,
                   "unfused top-k after the warpgroup scores: one-launch (the chunks' gathered "
                   "candidates ranked in one cooperative launch; only where every row's "
                   "2048-key chunks fit on the GPU at once), gathered (the same in three "
                   "launches), auto (one-launch where it fits, else passes), passes (a "
                   "launch a digit over every score, then the write) or cluster (a cluster of "
                   "blocks a row, the scores in shared memory)")
      ->check(CLI::IsMember({"auto", "one-launch", "gathered", "passes", "cluster"}));
  dsaIndexer->add_option("--iterations", indexer.iterations, "Calls per timing")
      ->check(CLI::PositiveNumber);
  addRecordOptions(dsaIndexer, record);
  addKernelTimelineOption(dsaIndexer, kernelTimeline);
  SparseMlaOptions sparseMla;
  CLI::App *dsaSparseMla = app.add_subcommand(
      "dsa-sparse-mla", "Sparse MLA decode over the top-k rows of the paged FP8 latent cache");
  dsaSparseMla->add_option("--batch", sparseMla.batches,
                           "Sequences (one query row each); with --prefill, query rows")
      ->delimiter(',')->check(CLI::PositiveNumber);
  dsaSparseMla->add_option("--heads", sparseMla.heads, "Query heads (128; 16 for a TP=8 shard)")
      ->delimiter(',')->check(CLI::PositiveNumber);
  dsaSparseMla->add_option("--top-k", sparseMla.topK, "Positions per row")
      ->check(CLI::PositiveNumber);
  dsaSparseMla->add_option("--context", sparseMla.context, "Cached positions per sequence")
      ->check(CLI::PositiveNumber);
  dsaSparseMla->add_option("--iterations", sparseMla.iterations, "Calls per timing")
      ->check(CLI::PositiveNumber);
  dsaSparseMla->add_flag("--prefill", sparseMla.prefill,
                         "The rows are tokens of one sequence (prefill), not one row per sequence");
  dsaSparseMla->add_option("--splits", sparseMla.splits,
                           "Blocks the positions are split over, each count a row (0: the "
                           "kernel's cost model)")
      ->delimiter(',')->check(CLI::Range(0, 4096));
  dsaSparseMla->add_flag("--half-tiles", sparseMla.halfTiles,
                         "64-head blocks in 32-position halves, the next converted under the "
                         "MMAs (SparseMlaDecodeParams::halfTiles)");
  addRecordOptions(dsaSparseMla, record);
  addKernelTimelineOption(dsaSparseMla, kernelTimeline);
  MoeOptions moe;
  CLI::App *moeCommand = app.add_subcommand(
      "moe", "MoE routed experts of a decode step (each token's top-k experts, bf16 or FP8)");
  moeCommand->add_option("--tokens", moe.tokens, "Tokens in the step")
      ->delimiter(',')->check(CLI::PositiveNumber);
  moeCommand->add_option("--experts", moe.experts, "Routed experts")->check(CLI::Range(1, 1024));
  moeCommand->add_option("--top-k", moe.topK, "Experts per token")->check(CLI::Range(1, 32));
  moeCommand->add_option("--hidden", moe.hidden, "Hidden size (even)")->check(CLI::Range(2, 16384));
  moeCommand->add_option("--intermediate", moe.intermediate, "Expert intermediate size (even)")
      ->check(CLI::Range(2, 16384));
  moeCommand->add_option("--layers", moe.layers,
                         "MoE layers per timed graph, each choosing its own experts (times per "
                         "layer; more than one keeps a layer's experts from being L2 hits)")
      ->check(CLI::Range(1, 64));
  moeCommand->add_flag("--fp8", moe.fp8,
                       "FP8 experts as DeepSeek-V3.2's (E4M3, 128 x 128 block scales); e.g. "
                       "--hidden 7168 --intermediate 2048");
  moeCommand->add_option("--iterations", moe.iterations, "Calls per timing")
      ->check(CLI::PositiveNumber);
  addRecordOptions(moeCommand, record);
  addKernelTimelineOption(moeCommand, kernelTimeline);
  GemvOptions gemv;
  CLI::App *gemvCommand = app.add_subcommand(
      "gemv", "The decode-size linear layer at 1-8 rows on each of its forms (scalar, tensor "
              "cores), bf16 weights, fp32 activations");
  gemvCommand->add_option("--rows", gemv.rows, "Rows (tokens) of a call, 1-8")
      ->delimiter(',')
      ->check(CLI::Range(1, 8));
  gemvCommand->add_option("--shapes", gemv.shapes, "Layers as INxOUT (default: Kimi-Linear-48B's)")
      ->delimiter(',');
  gemvCommand
      ->add_option("--layers", gemv.layers,
                   "Distinct weight matrices per timed graph (0: enough for 256 MB, so "
                   "none is read from L2)")
      ->check(CLI::Range(0, 512));
  gemvCommand->add_flag("--fp8", gemv.fp8,
                        "FP8 block-scaled layers as the runtime runs them, quantizer included: "
                        "the decode kernel and cuBLASLt (default shapes: DeepSeek-V3.2's)");
  gemvCommand->add_option("--iterations", gemv.iterations, "Calls per timing")
      ->check(CLI::PositiveNumber);
  addRecordOptions(gemvCommand, record);
  addKernelTimelineOption(gemvCommand, kernelTimeline);
  IndexerOptions dsaAllIndexer;
  SparseMlaOptions dsaAllSparseMla;
  CLI::App *dsaAll = app.add_subcommand(
      "dsa", "Both DSA kernels at their default shapes: dsa-indexer, then dsa-sparse-mla");
  dsaAll->add_option("--batch", dsaAllIndexer.batches, "Sequences (one query each)")
      ->delimiter(',')->check(CLI::PositiveNumber);
  dsaAll->add_option("--iterations", dsaAllIndexer.iterations, "Calls per timing")
      ->check(CLI::PositiveNumber);
  hybrid::LoadGeneratorOptions load;
  hybrid::LoadOptions modelOptions;
  std::string modelDir;
  CLI::App *serve = app.add_subcommand(
      "serve", "Serving benchmark: streaming completions over loopback HTTP (hybrid-serve)");
  serve->add_option("--model", modelDir, "Start a server on this compiled model (else --port)");
  serve->add_option("--host", load.host, "An already running hybrid-serve")->default_val("127.0.0.1");
  serve->add_option("--port", load.port, "Its port")->default_val(8000);
  serve->add_option("--api-key", load.apiKey, "Its API key");
  serve->add_option("--requests", load.requests, "Requests in all")->check(CLI::PositiveNumber);
  serve->add_option("--concurrency", load.concurrency, "Client threads")
      ->check(CLI::PositiveNumber);
  serve->add_option("--prompt-tokens", load.promptTokens, "Random prompt length")
      ->check(CLI::PositiveNumber);
  serve->add_option("--max-tokens", load.maxTokens, "Tokens to generate per request")
      ->check(CLI::PositiveNumber);
  serve->add_option("--vocab", load.vocabSize, "Prompt ids are drawn below this (--model: its own)")
      ->check(CLI::PositiveNumber);
  serve->add_option("--seed", load.seed, "Prompt seed");
  serve->add_option("--device", modelOptions.device, "--model: cpu or cuda")->default_val("cpu");
  hybrid::SchedulerOptions serveScheduler;
  serve->add_option("--prefill-chunk", serveScheduler.prefillChunkTokens,
                    "--model: prompt tokens a prefilling request gets per step")
      ->check(CLI::PositiveNumber);
  serve->add_flag("--batch-prefill-calls", serveScheduler.batchPrefillCalls,
                  "--model: several requests per prefill call, up to the plan's rows (else one)");
  serve->add_option("--max-sequences", modelOptions.maxSequences, "--model: sequences at once")
      ->check(CLI::PositiveNumber);
  serve->add_option("--prefix-cache", modelOptions.prefixCacheEntries,
                    "--model: prompt prefixes kept")
      ->check(CLI::NonNegativeNumber);
  serve->add_flag("--synthetic-weights", modelOptions.syntheticWeights,
                  "--model: compiled with --synthetic-weights (values generated at load)");
  serve->add_option("--json", o.jsonPath, "Write the results as JSON");
  SpecOptions specOptions;
  CLI::App *spec = app.add_subcommand(
      "spec", "Speculative (prompt-lookup, MTP or replay drafts) against plain greedy decoding, "
              "batched");
  spec->add_option("--model", specOptions.model, "A compiled model")->required();
  spec->add_option("--batch", specOptions.batches,
                   "Requests decoding together, one run per value (repetitive-text prompts)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  spec->add_option("--prompt-tokens", specOptions.promptTokens, "Prompt length")
      ->check(CLI::PositiveNumber);
  spec->add_option("--max-tokens", specOptions.maxTokens, "Tokens to generate per prompt")
      ->check(CLI::PositiveNumber);
  spec->add_option("--draft", specOptions.draftTokens, "Most draft tokens per verification pass")
      ->check(CLI::PositiveNumber);
  spec->add_option("--draft-source", specOptions.draftSource,
                   "prompt-lookup, mtp (the model's multi-token-prediction layer), or replay (the "
                   "plain run's own tokens: the verification machinery's upper bound, not a "
                   "draft model's quality)");
  CLI::Option *replayAcceptance =
      spec->add_option("--replay-acceptance", specOptions.replayAcceptance,
                       "--draft-source replay: the chance each draft token is the plain run's "
                       "(else a wrong one, seeded by --seed); default 1")
          ->check(CLI::Range(0.0, 1.0));
  spec->add_flag("--always-draft", specOptions.alwaysDraft,
                 "Draft on every greedy step, also where a verification pass is slower than the "
                 "batched decode step it replaces (default: drafts back off to 0 there)");
  spec->add_option("--seed", specOptions.seed, "Prompt seed");
  spec->add_option("--device", specOptions.load.device, "cpu or cuda")->default_val("cpu");
  spec->add_flag("--synthetic-weights", specOptions.load.syntheticWeights,
                 "The model was compiled with --synthetic-weights (values generated at load)");
  spec->add_option("--kda-prefill", specOptions.load.kdaPrefill,
                   "cuda: KDA prefill kernel of the verification passes: auto, chunked (bf16 "
                   "operands: near-ties may flip against fp32 decode steps) or recurrent")
      ->check(CLI::IsMember({"auto", "chunked", "recurrent"}));
  spec->add_flag("--batch-invariant", specOptions.load.batchInvariant,
                 "cuda: batch-invariant kernels (LoadOptions::batchInvariant): verification "
                 "passes give a row the bits its decode step would");
  bool specNoGraphs = false, specNoPrefillGraphs = false;
  spec->add_flag("--no-cuda-graphs", specNoGraphs,
                 "cuda: launch every kernel of every call (decode steps and verification passes)");
  spec->add_flag("--no-prefill-graphs", specNoPrefillGraphs,
                 "cuda: launch the prefill and verification calls' kernels one by one (decode "
                 "steps still replay graphs)");
  addRecordOptions(spec, record);
  std::string batchModel;
  hybrid::LoadOptions batchOptions;
  std::vector<int32_t> decodeBatches = {1, 2, 4};
  int32_t batchPromptTokens = 16, batchSteps = 64;
  bool batchNoGraphs = false;
  CLI::App *decodeBatch = app.add_subcommand(
      "decode-batch", "Batched decode (Model::decodeBatch) tokens/s per batch size on a model");
  decodeBatch->add_option("--model", batchModel, "A model compiled with --decode-batch")
      ->required();
  decodeBatch->add_option("--device", batchOptions.device, "cpu or cuda")->default_val("cpu");
  decodeBatch->add_option("--batch", decodeBatches, "Batch sizes")->delimiter(',')
      ->check(CLI::PositiveNumber);
  decodeBatch->add_option("--prompt-tokens", batchPromptTokens, "Prompt length")
      ->check(CLI::PositiveNumber);
  decodeBatch->add_option("--steps", batchSteps, "Timed steps per batch size")
      ->check(CLI::PositiveNumber);
  decodeBatch->add_flag("--no-cuda-graphs", batchNoGraphs, "cuda: launch every kernel each step");
  E2eCommandOptions e2e;
  bool e2eNoGraphs = false;
  CLI::App *e2eCommand = app.add_subcommand(
      "e2e", "A compiled model's prefill (TTFT) and decode (TPOT) per batch and context, with "
             "the floor of each decode step (bytes it must move / bandwidth)");
  e2eCommand->add_option("--model", e2e.model, "A compiled model directory")->required();
  e2eCommand->add_option("--device", e2e.load.device, "cpu or cuda")->default_val("cpu");
  e2eCommand->add_flag("--synthetic-weights", e2e.load.syntheticWeights,
                       "The model was compiled with --synthetic-weights (values generated at load)");
  e2eCommand->add_option("--batch", e2e.bench.batches, "Sequences decoded together")
      ->delimiter(',')->check(CLI::PositiveNumber);
  e2eCommand->add_option("--context", e2e.bench.contexts, "Prompt tokens per sequence")
      ->delimiter(',')->check(CLI::PositiveNumber);
  e2eCommand->add_flag("--shared-prompt", e2e.bench.sharedPrompt,
                       "One prompt for a row's sequences: the first prefills it, the others "
                       "restore it from the prefix cache (long contexts at large batches in one "
                       "prefill and one context of KV pages; TPOT may gain from shared pages in L2)");
  e2eCommand->add_flag("--chained", e2e.bench.chainedDecode,
                       "Time the decode steps as one chained call (Model::decodeSteps: each step "
                       "queued before the host has seen the previous one's ids)");
  e2eCommand->add_option("--decode-steps", e2e.bench.decodeSteps, "Timed decode steps per row")
      ->check(CLI::PositiveNumber);
  e2eCommand->add_option("--bandwidth", e2e.bench.bandwidthTbPerSecond,
                         "TB/s of the floor (default: the H200's measured device copy)")
      ->check(CLI::PositiveNumber);
  e2eCommand->add_option("--kda-prefill", e2e.load.kdaPrefill, "cuda: auto, chunked or recurrent")
      ->check(CLI::IsMember({"auto", "chunked", "recurrent"}));
  e2eCommand->add_flag("--batch-invariant", e2e.load.batchInvariant,
                       "cuda: batch-invariant kernels (LoadOptions::batchInvariant)");
  e2eCommand->add_flag("--bf16-gemm-inputs", e2e.load.bf16GemmInputs,
                       "cuda: round GEMM inputs to bf16 instead of splitting them into bf16 "
                       "terms (LoadOptions::bf16GemmInputs; what other engines' bf16 "
                       "activations cost)");
  e2eCommand->add_flag("--no-cuda-graphs", e2eNoGraphs,
                       "cuda: launch every kernel each step (decode and short prefill calls)");
  e2eCommand->add_flag("--skip-collectives", e2e.skipCollectives,
                       "Sharded launch, timing only: every collective returns at once (wrong "
                       "results); the time against a real run is the share spent communicating");
  bool e2eProfileStep = false;
  e2eCommand->add_flag("--profile-decode-step", e2eProfileStep,
                       "cuda: one extra, untimed decode step per row inside a profiler range "
                       "(for ncu --profile-from-start off)");
  e2eCommand->add_option("--plot", e2e.plotPath, "Write TPOT against context as a PNG");
  e2eCommand->add_option("--timeline", e2e.timelinePath,
                         "cuda: one extra, untimed decode step per row recorded by CUPTI (every "
                         "kernel, copy and stream); prints where each step's time goes and writes "
                         "them as a Chrome trace (JSON)");
  addRecordOptions(e2eCommand, record);
  std::string timelinePath, timelineBase;
  int timelineTop = 25;
  CLI::App *timelineCommand = app.add_subcommand(
      "timeline", "Summarize a trace written by --timeline, or compare it with another's rows");
  timelineCommand->add_option("trace", timelinePath, "The trace (JSON)")->required();
  timelineCommand->add_option("--against", timelineBase,
                              "A base trace: each row's exposed times against its row of the "
                              "same label there");
  timelineCommand->add_option("--top", timelineTop, "Names shown per row")
      ->check(CLI::PositiveNumber);
  TuneCommandOptions tuneOptions;
  CLI::App *tune = app.add_subcommand(
      "tune", "Search the tunable kernels' configurations per shape bucket on this GPU and store "
              "the winners in the compilation cache (docs/autotune.md)");
  addTuneOptions(tune, tuneOptions);
  CLI11_PARSE(app, argc, argv);

  if (tune->parsed())
    return runTune(tuneOptions);
  if (timelineCommand->parsed())
    return runTimelineCommand(timelinePath, timelineBase, timelineTop);

  if (e2eCommand->parsed()) {
    e2e.load.cudaGraphs = !e2eNoGraphs;
    if (e2eProfileStep) {
#ifdef HYBRID_BENCH_KDA
      e2e.bench.aroundProfiledStep = [](bool start, int64_t, int64_t) {
        hybrid::kernels::cuda::benchProfilerRange(start);
      };
#else
      return noCuda("e2e --profile-decode-step");
#endif
    }
    return runE2eCommand(e2e, record);
  }
  if (decodeBatch->parsed()) {
    batchOptions.cudaGraphs = !batchNoGraphs;
    return runDecodeBatch(batchModel, batchOptions, decodeBatches, batchPromptTokens, batchSteps);
  }
  if (spec->parsed()) {
    specOptions.replayAcceptanceGiven = replayAcceptance->count() > 0;
    specOptions.load.cudaGraphs = !specNoGraphs;
    specOptions.load.prefillGraphs = !specNoPrefillGraphs;
    return runSpec(specOptions, record);
  }
  if (serve->parsed())
    return runServe(load, modelDir, modelOptions, serveScheduler, o.jsonPath);
  const std::string benchmark = app.get_subcommands().front()->get_name();
  if (kda->parsed())
    return withKernelTimeline(kernelTimeline, benchmark, [&] { return runKda(o, record); });
  if (dsaIndexer->parsed())
    return withKernelTimeline(kernelTimeline, benchmark,
                              [&] { return runDsaIndexer(indexer, record); });
  if (moeCommand->parsed())
    return withKernelTimeline(kernelTimeline, benchmark, [&] { return runMoe(moe, record); });
  if (gemvCommand->parsed())
    return withKernelTimeline(kernelTimeline, benchmark, [&] { return runGemv(gemv, record); });
  if (dsaAll->parsed()) {
    dsaAllIndexer.form = "unfused"; // the form the runtime runs
    dsaAllSparseMla.batches = dsaAllIndexer.batches;
    dsaAllSparseMla.iterations = dsaAllIndexer.iterations;
    const int indexerStatus = runDsaIndexer(dsaAllIndexer, RecordOptions{});
    return runDsaSparseMla(dsaAllSparseMla, RecordOptions{}) | indexerStatus;
  }
  if (dsaSparseMla->parsed())
    return withKernelTimeline(kernelTimeline, benchmark,
                              [&] { return runDsaSparseMla(sparseMla, record); });
  if (kdaPrefill->parsed())
    return withKernelTimeline(kernelTimeline, benchmark, [&] { return runKdaPrefill(o, record); });
  return withKernelTimeline(kernelTimeline, benchmark, [&] { return runKdaDecode(o, record); });
}
