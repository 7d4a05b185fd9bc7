// The compile pipeline behind hybrid-compile: import, look the plan up in the compilation cache
// (key: model structure, shape buckets, target, compiler identity and options; never weights),
// lower and verify on a miss, write plan + weight archive into the output directory.
#pragma once

#include "hybrid/runtime/Status.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/OwningOpRef.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hybrid::driver {

struct CompileOptions {
  std::string modelDir;
  std::string mappingPath;      // empty: the built-in mapping of the config's model_type
  std::string device = "cpu";   // cpu | cuda
  std::string arch;             // sm_90a for cuda
  int64_t prefillTokens = 4096; // rows the prefill arena is planned for
  int64_t decodeBatch = 1;      // sequences one decode step can take (Model::decodeBatch)
  int32_t pageSize = 64;        // tokens per KV page
  std::string cacheDir;         // empty: $HYBRID_CACHE_DIR, else ~/.cache/hybrid
  bool useCache = true;
  bool fuse = true;             // --hybrid-fuse-super-kernels (off: the unfused reference path)
  bool tileWeights = true;      // --hybrid-assign-weight-layout (off: every weight row-major)
  std::string quantization = "default"; // --hybrid-annotate-quantization policy
  int32_t maxStreams =
      3; // --hybrid-assign-streams' max-streams (1: every step in order, no events)
  // --synthetic-weights=SEED: the model directory holds config.json alone; the weight archive
  // holds generator descriptors the runtime fills at load (docs/weight-archive.md, version 2).
  std::optional<uint64_t> syntheticSeed;
  // --shard=tp=N,ep=M,cp=K (--hybrid-shard): one plan and one weight archive per rank.
  int32_t tensorParallel = 1;
  int32_t expertParallel = 1;
  int32_t contextParallel = 1;
  int32_t worldSize() const { return tensorParallel * contextParallel; }
};

// Reads "tp=2,ep=2" (any of tp, ep, cp, comma separated) into `options`; an error names the bad
// part.
Status parseShard(const std::string &text, CompileOptions &options);

// The compiler identity in every cache key: version plus a hash of this executable, so any
// change to the compiler invalidates its cache entries.
std::string compilerIdentity();

// The phases of the pipeline, in order; `--compile-to=<phase>` stops after one.
enum class Phase { Import, Lower, Shard, Fuse, Quantize, Layout, Streams, Memory, Verify };
// "import", "lower", "shard", "fuse", "quantize", "layout", "streams", "memory", "verify";
// nullopt otherwise.
std::optional<Phase> parsePhase(const std::string &name);
const char *phaseNames();

// Imports and runs the pipeline up to and including `stopAfter` (Verify: the whole pipeline, the
// plan the writer takes), no cache.
StatusOr<mlir::OwningOpRef<mlir::ModuleOp>> lowerToPlan(mlir::MLIRContext &context,
                                                       const CompileOptions &options,
                                                       Phase stopAfter = Phase::Verify);

struct CompileReport {
  bool cacheHit = false;
  std::string cacheKey;
  std::string cacheEntry;       // the cache file
  std::string cacheRejected;    // why an existing entry was not trusted, if one was
  std::string cacheWriteFailed; // why the plan could not be stored (a full disk): it was still
                                // compiled and written, only not cached
  std::string planPath;
  std::string archivePath;
  uint64_t planBytes = 0;
  uint64_t archiveBytes = 0;
  bool archiveReused = false;
  double importSeconds = 0, planSeconds = 0, weightSeconds = 0;
};

// The serialized plans for `options`, one per rank in rank order (one for a world of one), from
// the cache when possible (a hit only when every rank's plan is there).
StatusOr<std::vector<std::vector<uint8_t>>> compileRankPlans(mlir::MLIRContext &context,
                                                             const CompileOptions &options,
                                                             CompileReport &report);
// Rank `rank`'s serialized plan (compileRankPlans).
StatusOr<std::vector<uint8_t>> compilePlan(mlir::MLIRContext &context,
                                           const CompileOptions &options, CompileReport &report,
                                           int rank = 0);

// compileRankPlans, then writes `outDir/plan.hyplan` and `outDir/weights.hyw`, or for a sharded
// model each rank's plan.rank<r>.hyplan and weights.rank<r>.hyw (the report's paths: rank 0's).
StatusOr<CompileReport> compileToDirectory(mlir::MLIRContext &context,
                                           const CompileOptions &options,
                                           const std::string &outDir);

} // namespace hybrid::driver
