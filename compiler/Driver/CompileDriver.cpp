#include "compiler/Driver/CompileDriver.h"

#include "compiler/Import/Importer.h"
#include "compiler/Target/PlanWriter.h"
#include "compiler/Target/WeightPacker.h"
#include "compiler/Transforms/Passes.h"
#include "hybrid/cache/Key.h"
#include "hybrid/runtime/Plan.h"
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

Status parseShard(const std::string &text, CompileOptions &options) {
  llvm::SmallVector<llvm::StringRef> parts;
  llvm::StringRef(text).split(parts, ',', -1, /*KeepEmpty=*/false);
  if (parts.empty())
    return Status::error("--shard=" + text + ": expected tp=N,ep=M,cp=K");
  for (llvm::StringRef part : parts) {
    auto [name, value] = part.split('=');
    int32_t count = 0;
    if (value.getAsInteger(10, count) || count < 1 || count > 4096)
      return Status::error("--shard=" + text + ": '" + part.str() +
                           "' needs a rank count between 1 and 4096");
    if (name == "tp")
      options.tensorParallel = count;
    else if (name == "ep")
      options.expertParallel = count;
    else if (name == "cp")
      options.contextParallel = count;
    else
      return Status::error("--shard=" + text + ": unknown '" + name.str() + "' (tp, ep or cp)");
  }
  return Status::ok();
}

std::optional<Phase> parsePhase(const std::string &name) {
  if (name == "import")
    return Phase::Import;
  if (name == "lower")
    return Phase::Lower;
  if (name == "shard")
    return Phase::Shard;
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
  return "import, lower, shard, fuse, quantize, layout, streams, memory, verify";
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
  const bool sharded = options.tensorParallel != 1 || options.expertParallel != 1 ||
                       options.contextParallel != 1;
  if (stopAfter >= Phase::Shard && sharded) {
    ShardOptions shard;
    shard.tp = options.tensorParallel;
    shard.ep = options.expertParallel;
    shard.cp = options.contextParallel;
    pm.addPass(createShard(shard));
  }
  if (stopAfter >= Phase::Fuse && options.fuse)
    pm.addPass(createFuseSuperKernels());
  if (stopAfter >= Phase::Quantize) {
    AnnotateQuantizationOptions quantization;
    quantization.policy = options.quantization;
    pm.addPass(createAnnotateQuantization(quantization));
  }
  if (stopAfter >= Phase::Layout && options.tileWeights)
    pm.addPass(createAssignWeightLayout());
  if (stopAfter >= Phase::Streams) {
    AssignStreamsOptions streams;
    streams.maxStreams = options.maxStreams;
    pm.addPass(createAssignStreams(streams));
  }
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

StatusOr<std::vector<std::vector<uint8_t>>> compileRankPlans(mlir::MLIRContext &context,
                                                             const CompileOptions &options,
                                                             CompileReport &report) {
  auto start = std::chrono::steady_clock::now();
  import::ImportOptions importOptions;
  importOptions.mappingPath = options.mappingPath;
  importOptions.syntheticSeed = options.syntheticSeed;
  HYBRID_ASSIGN_OR_RETURN(mlir::OwningOpRef<mlir::ModuleOp> imported,
                          import::importCheckpoint(context, options.modelDir, importOptions));
  report.importSeconds = secondsSince(start);

  // The canonical record: the imported IR is the model structure (names, shapes, dtypes,
  // attributes), never weight values. A sharded compile keys each rank's plan by the layout and
  // the rank too (a world of one keeps the keys it had before sharding existed).
  const std::string structure = printIR(*imported);
  std::string policyText;
  // A policy file counts by its contents, not its name.
  const bool policyFile = options.quantization != "default" && options.quantization != "none";
  if (policyFile) {
    auto policy = llvm::MemoryBuffer::getFile(options.quantization);
    policyText = policy ? (*policy)->getBuffer().str() : std::string();
  }
  const int32_t world = options.worldSize();
  const bool sharded = world != 1 || options.expertParallel != 1;
  const std::string compiler = compilerIdentity();
  auto keyFor = [&](int32_t rank) {
    cache::KeyBuilder key;
    key.add("record", "hybrid plan v1")
        .add("compiler", compiler)
        .add("structure", structure)
        .add("device", options.device)
        .add("arch", options.arch)
        .add("prefill_tokens", options.prefillTokens)
        .add("decode_tokens", options.decodeBatch)
        .add("page_size", static_cast<int64_t>(options.pageSize))
        .add("fuse", options.fuse)
        .add("tile_weights", options.tileWeights)
        .add("quantization", options.quantization)
        .add("max_streams", static_cast<int64_t>(options.maxStreams));
    if (policyFile)
      key.add("quantization_policy", policyText);
    if (sharded)
      key.add("tensor_parallel", static_cast<int64_t>(options.tensorParallel))
          .add("expert_parallel", static_cast<int64_t>(options.expertParallel))
          .add("context_parallel", static_cast<int64_t>(options.contextParallel))
          .add("rank", static_cast<int64_t>(rank));
    return key.finish();
  };
  std::vector<cache::CacheKey> cacheKeys;
  for (int32_t rank = 0; rank < world; ++rank)
    cacheKeys.push_back(keyFor(rank));
  report.cacheKey = cacheKeys.front().hex();

  std::optional<cache::CacheStore> store;
  if (options.useCache) {
    std::string cacheDir = options.cacheDir;
    if (cacheDir.empty()) {
      HYBRID_ASSIGN_OR_RETURN(cacheDir, cache::defaultCacheDir());
    }
    HYBRID_ASSIGN_OR_RETURN(store, cache::CacheStore::open(cacheDir));
    report.cacheEntry = store->pathFor(cacheKeys.front());
    std::vector<std::vector<uint8_t>> cached;
    for (const cache::CacheKey &cacheKey : cacheKeys) {
      HYBRID_ASSIGN_OR_RETURN(std::optional<std::vector<std::byte>> payload,
                              store->get(cacheKey, cache::EntryKind::Plan, &report.cacheRejected));
      if (!payload)
        break;
      const auto *bytes = reinterpret_cast<const uint8_t *>(payload->data());
      cached.emplace_back(bytes, bytes + payload->size());
    }
    if (cached.size() == cacheKeys.size()) {
      report.cacheHit = true;
      return cached;
    }
  }

  start = std::chrono::steady_clock::now();
  HYBRID_ASSIGN_OR_RETURN(mlir::OwningOpRef<mlir::ModuleOp> lowered, lowerToPlan(context, options));
  std::vector<std::vector<uint8_t>> plans;
  for (plan::PlanOp planOp : lowered->getOps<plan::PlanOp>()) {
    mlir::FailureOr<std::vector<uint8_t>> bytes = target::serializePlan(planOp);
    if (mlir::failed(bytes))
      return Status::error(options.modelDir + ": the plan could not be serialized");
    plans.push_back(std::move(*bytes));
  }
  if (plans.size() != cacheKeys.size())
    return Status::error(options.modelDir + ": lowering produced " + std::to_string(plans.size()) +
                         " plans for a world of " + std::to_string(cacheKeys.size()));
  report.planSeconds = secondsSince(start);
  // A cache that cannot take the entry (a full disk) costs the next compile its hit, nothing more.
  if (store)
    for (size_t rank = 0; rank < plans.size(); ++rank)
      if (Status stored = store->put(cacheKeys[rank], cache::EntryKind::Plan,
                                     std::as_bytes(std::span(plans[rank])));
          !stored) {
        report.cacheWriteFailed = stored.message();
        break;
      }
  return plans;
}

StatusOr<std::vector<uint8_t>> compilePlan(mlir::MLIRContext &context,
                                           const CompileOptions &options, CompileReport &report,
                                           int rank) {
  HYBRID_ASSIGN_OR_RETURN(std::vector<std::vector<uint8_t>> plans,
                          compileRankPlans(context, options, report));
  if (rank < 0 || static_cast<size_t>(rank) >= plans.size())
    return Status::error(options.modelDir + ": no rank " + std::to_string(rank) + " in a world of " +
                         std::to_string(plans.size()));
  return std::move(plans[static_cast<size_t>(rank)]);
}

StatusOr<CompileReport> compileToDirectory(mlir::MLIRContext &context,
                                           const CompileOptions &options,
                                           const std::string &outDir) {
  CompileReport report;
  HYBRID_ASSIGN_OR_RETURN(std::vector<std::vector<uint8_t>> plans,
                          compileRankPlans(context, options, report));
  if (std::error_code error = llvm::sys::fs::create_directories(outDir))
    return Status::error(outDir + ": cannot create: " + error.message());

  const int world = static_cast<int>(plans.size());
  auto start = std::chrono::steady_clock::now();
  for (int rank = 0; rank < world; ++rank) {
    const std::vector<uint8_t> &planBytes = plans[static_cast<size_t>(rank)];
    const std::string planPath = outDir + "/" + planFileName(rank, world);
    const std::string archivePath = outDir + "/" + archiveFileName(rank, world);
    HYBRID_RETURN_IF_ERROR(writeFileAtomically(planPath, planBytes.data(), planBytes.size()));
    const plan::fb::Plan *plan = plan::fb::GetPlan(planBytes.data());
    std::vector<target::WeightPlacement> placements = target::weightPlacements(*plan);
    HYBRID_ASSIGN_OR_RETURN(target::PackResult packed,
                            target::packWeights(placements, options.modelDir, archivePath,
                                                options.syntheticSeed));
    if (rank == 0) {
      report.planPath = planPath;
      report.archivePath = archivePath;
      report.planBytes = planBytes.size();
      report.archiveBytes = packed.bytes;
      report.archiveReused = packed.reused;
    }
  }
  report.weightSeconds = secondsSince(start);
  return report;
}

} // namespace hybrid::driver
