#include "compiler/Driver/CompileDriver.h"

#include "compiler/Import/Importer.h"
#include "compiler/Target/PlanWriter.h"
#include "compiler/Target/WeightPacker.h"
#include "compiler/Transforms/Passes.h"
#include "hybrid/cache/Key.h"
#include "hybrid/cache/Store.h"

#include "mlir/Pass/PassManager.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/raw_ostream.h"

#include <chrono>
#include <cstdio>

namespace hybrid::driver {
namespace {

constexpr const char *kCompilerVersion = "0.1.0";

double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string printIR(mlir::ModuleOp module) {
  std::string text;
  llvm::raw_string_ostream os(text);
  module.print(os);
  return text;
}

// Writes a file atomically: temp file beside it, then rename.
Status writeFileAtomically(const std::string &path, const void *data, size_t size) {
  const std::string temp = path + ".tmp";
  std::error_code error;
  {
    llvm::raw_fd_ostream out(temp, error);
    if (error)
      return Status::error(temp + ": cannot write: " + error.message());
    out.write(static_cast<const char *>(data), size);
    out.flush();
    if (out.has_error())
      return Status::error(temp + ": write failed: " + out.error().message());
  }
  if ((error = llvm::sys::fs::rename(temp, path))) {
    llvm::sys::fs::remove(temp);
    return Status::error(path + ": cannot rename into place: " + error.message());
  }
  return Status::ok();
}

} // namespace

std::string compilerIdentity() {
  std::string identity = std::string("hybrid-compile ") + kCompilerVersion;
  std::string exe = llvm::sys::fs::getMainExecutable(nullptr, nullptr);
  auto binary = llvm::MemoryBuffer::getFile(exe, /*IsText=*/false, /*RequiresNullTerminator=*/false);
  if (binary) {
    cache::KeyBuilder key;
    key.addBytes("executable", std::as_bytes(std::span((*binary)->getBufferStart(),
                                                        (*binary)->getBufferSize())));
    identity += " exe:" + key.finish().hex().substr(0, 16);
  }
  return identity;
}

std::optional<Phase> parsePhase(const std::string &name) {
  if (name == "import")
    return Phase::Import;
  if (name == "lower")
    return Phase::Lower;
  if (name == "fuse")
    return Phase::Fuse;
  if (name == "quantize")
    return Phase::Quantize;
  if (name == "layout")
    return Phase::Layout;
  if (name == "streams")
    return Phase::Streams;
  if (name == "memory")
    return Phase::Memory;
  if (name == "verify")
    return Phase::Verify;
  return std::nullopt;
}

const char *phaseNames() {
  return "import, lower, fuse, quantize, layout, streams, memory, verify";
}

StatusOr<mlir::OwningOpRef<mlir::ModuleOp>> lowerToPlan(mlir::MLIRContext &context,
                                                       const CompileOptions &options,
                                                       Phase stopAfter) {
  import::ImportOptions importOptions;
  importOptions.mappingPath = options.mappingPath;
  importOptions.syntheticSeed = options.syntheticSeed;
  HYBRID_ASSIGN_OR_RETURN(mlir::OwningOpRef<mlir::ModuleOp> module,
                          import::importCheckpoint(context, options.modelDir, importOptions));
  context.getOrLoadDialect<plan::PlanDialect>();
  if (stopAfter == Phase::Import)
    return module;

  std::string diagnostics;
  mlir::ScopedDiagnosticHandler handler(&context, [&](mlir::Diagnostic &diag) {
    if (diag.getSeverity() == mlir::DiagnosticSeverity::Error && diagnostics.empty())
      diagnostics = diag.str();
    return mlir::success();
  });
  mlir::PassManager pm(&context);
  if (mlir::failed(mlir::applyPassManagerCLOptions(pm)))
    return Status::error("invalid pass manager options");
  LowerToPlanOptions lowerOptions;
  lowerOptions.device = options.device;
  lowerOptions.arch = options.arch;
  lowerOptions.prefillTokens = options.prefillTokens;
  lowerOptions.decodeTokens = options.decodeBatch;
  lowerOptions.pageSize = options.pageSize;
  lowerOptions.compilerId = compilerIdentity();
  pm.addPass(createLowerToPlan(lowerOptions));
  if (stopAfter >= Phase::Fuse && options.fuse)
    pm.addPass(createFuseSuperKernels());
  if (stopAfter >= Phase::Quantize) {
    AnnotateQuantizationOptions quantization;
    quantization.policy = options.quantization;
    pm.addPass(createAnnotateQuantization(quantization));
  }
  if (stopAfter >= Phase::Layout && options.tileWeights)
    pm.addPass(createAssignWeightLayout());
  if (stopAfter >= Phase::Streams)
    pm.addPass(createAssignStreams());
  if (stopAfter >= Phase::Memory)
    pm.addPass(createPlanMemory());
  if (stopAfter >= Phase::Verify)
    pm.addPass(createVerifyPlanContract());
  if (mlir::failed(pm.run(*module)))
    return Status::error(options.modelDir + ": lowering to a plan failed: " + diagnostics);

  // The plan names its archive by the weight layout (structural, so the plan stays keyed by
  // structure alone).
  for (auto planOp : module->getOps<plan::PlanOp>()) {
    std::vector<target::WeightPlacement> placements = target::weightPlacements(planOp);
    planOp.setWeightArchiveKey(formatArchiveKey(target::weightLayoutKey(placements)));
  }
  return module;
}

StatusOr<std::vector<uint8_t>> compilePlan(mlir::MLIRContext &context,
                                           const CompileOptions &options, CompileReport &report) {
  auto start = std::chrono::steady_clock::now();
  import::ImportOptions importOptions;
  importOptions.mappingPath = options.mappingPath;
  importOptions.syntheticSeed = options.syntheticSeed;
  HYBRID_ASSIGN_OR_RETURN(mlir::OwningOpRef<mlir::ModuleOp> imported,
                          import::importCheckpoint(context, options.modelDir, importOptions));
  report.importSeconds = secondsSince(start);

  // The canonical record: the imported IR is the model structure (names, shapes, dtypes,
  // attributes), never weight values.
  cache::KeyBuilder key;
  key.add("record", "hybrid plan v1")
      .add("compiler", compilerIdentity())
      .add("structure", printIR(*imported))
      .add("device", options.device)
      .add("arch", options.arch)
      .add("prefill_tokens", options.prefillTokens)
      .add("decode_tokens", options.decodeBatch)
      .add("page_size", static_cast<int64_t>(options.pageSize))
      .add("fuse", options.fuse)
      .add("tile_weights", options.tileWeights)
      .add("quantization", options.quantization);
  // A policy file counts by its contents, not its name.
  if (options.quantization != "default" && options.quantization != "none") {
    auto policy = llvm::MemoryBuffer::getFile(options.quantization);
    key.add("quantization_policy", policy ? (*policy)->getBuffer().str() : std::string());
  }
  cache::CacheKey cacheKey = key.finish();
  report.cacheKey = cacheKey.hex();

  std::optional<cache::CacheStore> store;
  if (options.useCache) {
    std::string cacheDir = options.cacheDir;
    if (cacheDir.empty()) {
      HYBRID_ASSIGN_OR_RETURN(cacheDir, cache::defaultCacheDir());
    }
    HYBRID_ASSIGN_OR_RETURN(store, cache::CacheStore::open(cacheDir));
    report.cacheEntry = store->pathFor(cacheKey);
    HYBRID_ASSIGN_OR_RETURN(std::optional<std::vector<std::byte>> payload,
                            store->get(cacheKey, cache::EntryKind::Plan, &report.cacheRejected));
    if (payload) {
      report.cacheHit = true;
      const auto *bytes = reinterpret_cast<const uint8_t *>(payload->data());
      return std::vector<uint8_t>(bytes, bytes + payload->size());
    }
  }

  start = std::chrono::steady_clock::now();
  HYBRID_ASSIGN_OR_RETURN(mlir::OwningOpRef<mlir::ModuleOp> lowered, lowerToPlan(context, options));
  auto planOps = lowered->getOps<plan::PlanOp>();
  if (planOps.empty())
    return Status::error(options.modelDir + ": lowering produced no plan");
  mlir::FailureOr<std::vector<uint8_t>> bytes = target::serializePlan(*planOps.begin());
  if (mlir::failed(bytes))
    return Status::error(options.modelDir + ": the plan could not be serialized");
  report.planSeconds = secondsSince(start);
  // A cache that cannot take the entry (a full disk) costs the next compile its hit, nothing more.
  if (store)
    if (Status stored = store->put(cacheKey, cache::EntryKind::Plan, std::as_bytes(std::span(*bytes)));
        !stored)
      report.cacheWriteFailed = stored.message();
  return std::move(*bytes);
}

StatusOr<CompileReport> compileToDirectory(mlir::MLIRContext &context,
                                           const CompileOptions &options,
                                           const std::string &outDir) {
  CompileReport report;
  HYBRID_ASSIGN_OR_RETURN(std::vector<uint8_t> planBytes, compilePlan(context, options, report));
  if (std::error_code error = llvm::sys::fs::create_directories(outDir))
    return Status::error(outDir + ": cannot create: " + error.message());

  report.planPath = outDir + "/plan.hyplan";
  report.archivePath = outDir + "/weights.hyw";
  report.planBytes = planBytes.size();
  HYBRID_RETURN_IF_ERROR(writeFileAtomically(report.planPath, planBytes.data(), planBytes.size()));

  auto start = std::chrono::steady_clock::now();
  const plan::fb::Plan *plan = plan::fb::GetPlan(planBytes.data());
  std::vector<target::WeightPlacement> placements = target::weightPlacements(*plan);
  HYBRID_ASSIGN_OR_RETURN(target::PackResult packed,
                          target::packWeights(placements, options.modelDir, report.archivePath,
                                              options.syntheticSeed));
  report.weightSeconds = secondsSince(start);
  report.archiveBytes = packed.bytes;
  report.archiveReused = packed.reused;
  return report;
}

} // namespace hybrid::driver
