// hybrid-compile: Hugging Face checkpoint directory -> execution plan + weight archive.
#include "compiler/Analysis/ModelSummary.h"
#include "compiler/Driver/CompileDriver.h"
#include "compiler/Import/Importer.h"
#include "compiler/Target/PlanWriter.h"
#include "dialects/Hybrid/IR/HybridDialect.h"
#include "dialects/Plan/IR/PlanDialect.h"
#include "hybrid/runtime/Plan.h"
#include "hybrid/runtime/PlanReport.h"

#include "mlir/IR/AsmState.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Support/FileUtilities.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/ToolOutputFile.h"

#include <sstream>

namespace cl = llvm::cl;

namespace {
enum class Emit { Plan, Mlir, Summary, PlanMlir, PlanJson };

cl::opt<std::string> modelDir(cl::Positional, cl::desc("<model dir>"), cl::Required);
cl::opt<Emit> emit(
    "emit", cl::desc("What to produce"),
    cl::values(clEnumValN(Emit::Plan, "plan", "plan.hyplan + weights.hyw in the -o directory"),
               clEnumValN(Emit::Mlir, "mlir", "the imported hybrid IR"),
               clEnumValN(Emit::Summary, "summary", "layers, parameters, cache and state sizes"),
               clEnumValN(Emit::PlanMlir, "plan-mlir", "the plan dialect after lowering"),
               clEnumValN(Emit::PlanJson, "plan-json", "the serialized plan as JSON")),
    cl::init(Emit::Plan));
cl::opt<std::string> outputPath("o",
                                cl::desc("Output directory for --emit=plan, else output file "
                                         "(default: stdout)"),
                                cl::value_desc("path"), cl::init("-"));
cl::opt<std::string> mappingPath("mapping",
                                 cl::desc("Architecture mapping JSON to use instead of the "
                                          "built-in one for the config's model_type"),
                                 cl::value_desc("file"), cl::init(""));
cl::opt<std::string> device("device", cl::desc("Target device: cpu or cuda"), cl::init("cpu"));
cl::opt<std::string> arch("arch", cl::desc("Target architecture (sm_90a for cuda)"),
                          cl::init(""));
cl::opt<int64_t> prefillTokens("prefill-tokens",
                               cl::desc("Tokens one prefill step can take (arena size)"),
                               cl::init(4096));
cl::opt<int64_t> decodeBatch("decode-batch",
                             cl::desc("Sequences one decode step can take (its arena size; "
                                      "Model::decodeBatch)"),
                             cl::init(1));
cl::opt<int32_t> maxStreams("max-streams",
                            cl::desc("Streams a program's independent steps may spread over "
                                     "(--hybrid-assign-streams; 1: one stream, no events)"),
                            cl::init(3));
cl::opt<std::string> cacheDir("cache-dir",
                              cl::desc("Compilation cache folder (default $HYBRID_CACHE_DIR, "
                                       "else ~/.cache/hybrid)"),
                              cl::init(""));
cl::opt<std::string> compileTo(
    "compile-to",
    cl::desc("Stop after a pipeline phase and print the IR: import, lower, shard, fuse, "
             "quantize, layout, streams, memory, verify"),
    cl::value_desc("phase"), cl::init(""));
cl::opt<bool> noFuse("no-fuse",
                     cl::desc("Skip --hybrid-fuse-super-kernels (the unfused reference path)"),
                     cl::init(false));
cl::opt<bool> rowMajorWeights("row-major-weights",
                              cl::desc("Skip --hybrid-assign-weight-layout: no tiled weights"),
                              cl::init(false));
cl::opt<std::string> quantization(
    "quantization",
    cl::desc("Precision policy: default (DeepSeek-style: MXFP8 indexer Q/K, FP8 sparse KV cache, "
             "BF16 projections), none, or a JSON policy file"),
    cl::value_desc("policy"), cl::init("default"));
cl::opt<bool> noCache("no-cache", cl::desc("Neither read nor write the compilation cache"),
                      cl::init(false));
cl::opt<std::string> syntheticWeights(
    "synthetic-weights",
    cl::desc("Weights generated at load from a seed (default 0) instead of read: the model "
             "directory needs only config.json (kimi_linear, deepseek_v32 or hybrid); the archive "
             "holds generator descriptors"),
    cl::value_desc("seed"), cl::ValueOptional, cl::init(""));
cl::opt<std::string> shard(
    "shard",
    cl::desc("Shard for several ranks (--hybrid-shard): tp=N tensor-parallel, cp=C "
             "context-parallel (prefill), ep=M expert-parallel (1, N, or C when N is 1), comma "
             "separated; writes plan.rank<r>.hyplan and weights.rank<r>.hyw per rank (run with "
             "hybrid-run --world-size)"),
    cl::value_desc("tp=N,cp=C,ep=M"), cl::init(""));
cl::opt<bool> report("report",
                     cl::desc("With --emit=plan: print the plan's arena sizes, fused kernels, "
                              "streams, events and weight bytes per dtype"),
                     cl::init(false));

int fail(const std::string &message) {
  llvm::errs() << "error: " << message << "\n";
  return 1;
}
} // namespace

int main(int argc, char **argv) {
  llvm::InitLLVM initLLVM(argc, argv);
  // --mlir-print-ir-after-all, --mlir-print-debuginfo and friends work as in mlir-opt.
  mlir::registerAsmPrinterCLOptions();
  mlir::registerMLIRContextCLOptions();
  mlir::registerPassManagerCLOptions();
  cl::ParseCommandLineOptions(argc, argv, "hybrid ahead-of-time compiler\n");

  mlir::MLIRContext context;
  context.loadDialect<hybrid::HybridDialect, hybrid::plan::PlanDialect>();
  hybrid::driver::CompileOptions options;
  options.modelDir = modelDir;
  options.mappingPath = mappingPath;
  options.device = device;
  options.arch = arch;
  options.prefillTokens = prefillTokens;
  options.decodeBatch = decodeBatch;
  // Past these the arenas would not fit any device (and int32 row counts would overflow).
  if (prefillTokens < 1 || prefillTokens > (int64_t{1} << 24))
    return fail("--prefill-tokens=" + std::to_string(prefillTokens) +
                " must be between 1 and 16777216");
  if (decodeBatch < 1 || decodeBatch > 4096)
    return fail("--decode-batch=" + std::to_string(decodeBatch) + " must be between 1 and 4096");
  if (maxStreams < 1 || maxStreams > 64)
    return fail("--max-streams=" + std::to_string(maxStreams) + " must be between 1 and 64");
  options.maxStreams = maxStreams;
  options.cacheDir = cacheDir;
  options.useCache = !noCache;
  options.fuse = !noFuse;
  options.tileWeights = !rowMajorWeights;
  options.quantization = quantization;
  if (syntheticWeights.getNumOccurrences() > 0) {
    uint64_t seed = 0;
    if (!syntheticWeights.empty() && llvm::StringRef(syntheticWeights).getAsInteger(10, seed))
      return fail("--synthetic-weights=" + syntheticWeights +
                  " is not a seed (a non-negative integer below 2^64)");
    options.syntheticSeed = seed;
  }

  if (!shard.empty())
    if (hybrid::Status parsed = hybrid::driver::parseShard(shard, options); !parsed)
      return fail(parsed.message());

  if (!compileTo.empty()) {
    std::optional<hybrid::driver::Phase> phase = hybrid::driver::parsePhase(compileTo);
    if (!phase)
      return fail("--compile-to=" + compileTo + " is not a phase (" +
                  hybrid::driver::phaseNames() + ")");
    std::string error;
    auto output = mlir::openOutputFile(outputPath, &error);
    if (!output)
      return fail(error);
    auto module = hybrid::driver::lowerToPlan(context, options, *phase);
    if (!module)
      return fail(module.status().message());
    (*module)->print(output->os());
    output->os() << "\n";
    output->keep();
    return 0;
  }

  if (emit == Emit::Plan) {
    if (outputPath == "-")
      return fail("--emit=plan needs an output directory: -o DIR");
    auto report = hybrid::driver::compileToDirectory(context, options, outputPath);
    if (!report)
      return fail(report.status().message());
    if (!report->cacheRejected.empty())
      llvm::errs() << "warning: rejected a bad cache entry and recompiled: "
                   << report->cacheRejected << "\n";
    if (!report->cacheWriteFailed.empty())
      llvm::errs() << "warning: the plan is not cached: " << report->cacheWriteFailed << "\n";
    llvm::outs() << "plan     " << report->planPath << " (" << report->planBytes << " bytes, "
                 << (report->cacheHit ? "cache hit" : "compiled") << ", key "
                 << report->cacheKey << ")\n"
                 << "weights  " << report->archivePath << " (" << report->archiveBytes
                 << " bytes, " << (report->archiveReused ? "reused" : "written")
                 << (options.syntheticSeed
                         ? ", synthetic: generated at load from seed " +
                               std::to_string(*options.syntheticSeed)
                         : std::string())
                 << ")\n"
                 << llvm::format("time     import %.3f s, plan %.3f s, weights %.3f s\n",
                                 report->importSeconds, report->planSeconds,
                                 report->weightSeconds);
    if (::report) {
      auto plan = hybrid::LoadedPlan::load(report->planPath);
      if (!plan)
        return fail(plan.status().message());
      std::ostringstream text;
      hybrid::printPlanReport(plan->plan(), text);
      llvm::outs() << text.str();
    }
    return 0;
  }

  std::string error;
  auto output = mlir::openOutputFile(outputPath, &error);
  if (!output)
    return fail(error);
  if (emit == Emit::PlanJson) {
    hybrid::driver::CompileReport report;
    auto bytes = hybrid::driver::compilePlan(context, options, report);
    if (!bytes)
      return fail(bytes.status().message());
    auto json = hybrid::target::planToJson(*bytes, error);
    if (mlir::failed(json))
      return fail(modelDir + ": " + error);
    output->os() << *json;
  } else if (emit == Emit::PlanMlir) {
    auto module = hybrid::driver::lowerToPlan(context, options);
    if (!module)
      return fail(module.status().message());
    (*module)->print(output->os());
    output->os() << "\n";
  } else {
    hybrid::import::ImportOptions importOptions;
    importOptions.mappingPath = mappingPath;
    importOptions.syntheticSeed = options.syntheticSeed; // a config.json alone imports too
    auto module = hybrid::import::importCheckpoint(context, modelDir, importOptions);
    if (!module)
      return fail(module.status().message());
    if (emit == Emit::Summary) {
      for (auto model : (*module)->getOps<hybrid::ModelOp>())
        hybrid::analysis::printModelSummary(model, output->os());
    } else {
      (*module)->print(output->os());
      output->os() << "\n";
    }
  }
  output->keep();
  return 0;
}
