// Loading and verifying an execution plan (runtime/schema/plan.fbs, DESIGN.md section 1.4).
// LoadedPlan::load runs three gates, each failure one line naming the file and the field:
//   1. size and file identifier ("HYPL"),
//   2. the FlatBuffers verifier (every offset, vector and string inside the buffer),
//   3. semantic checks: version, indices (values, weights, streams, events, cache slots) in range,
//      arena bounds, params type, operand counts and weight roles matching each kernel's
//      signature (runtime/schema/kernel_signatures.h), weight sizes.
// After a successful load every index in the plan can be used without further bounds checks.
// checkTarget and checkWeights then match the plan against the device and the weight archive.
#pragma once

#include "hybrid/runtime/Status.h"
#include "hybrid/runtime/WeightArchive.h"
#include "runtime/schema/plan_generated.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hybrid {

// The plan format this runtime reads: same major, minor not newer (see plan.fbs).
inline constexpr uint16_t kPlanVersionMajor = 1;
inline constexpr uint16_t kPlanVersionMinor = 5; // 1.1: Plan.fp8_activation_scale; 1.2: sharding
                                                 // (Target rank/layout, Weight.slice, AllReduceSum);
                                                 // 1.3: the Situ activation (Mlp/MoeParams);
                                                 // 1.4: context parallelism (Value.rows,
                                                 // AllGatherRows, KdaContextSummary, MlaCacheRows);
                                                 // 1.5: experts over the context ranks
                                                 // (MoeParams.all_to_all, AllReduceSum over
                                                 // ContextParallel)

// Shorthands over the kernel table of runtime/schema/kernel_signatures.h, which the compiler's
// contract verifier reads too. The params table a kernel takes (MlaPrefill, MlaDecode,
// SparseMla* -> MlaParams); KernelParams::NONE for a value outside the enum.
plan::fb::KernelParams expectedParamsType(plan::fb::KernelId kernel);
// Number of entries in a dispatch's `weights` (role order in plan.fbs): KDA 16, MLA 7,
// DsaIndexer 5, MoE 5 + 3 * numExperts, AttnRes 2, Mlp 3, Embed/RmsNorm/Linear/LmHead 1, Add 0.
// nullopt for a kernel outside the enum.
std::optional<int64_t> expectedWeightCount(plan::fb::KernelId kernel, int64_t numExperts = 0);

// A verified plan. Owns its bytes (8-byte aligned, as FlatBuffers requires); movable, and the
// tables returned by plan() stay valid across moves.
// The shape a weight is stored with in the archive: its shape, or for an NzTiled weight the
// shape padded to whole tiles. Empty when an NzTiled weight lacks a 2-D shape or tile.
std::vector<int64_t> storedShape(const plan::fb::Weight &weight);

// The program of `plan` named e.g. "prefill" or "decode"; null when absent.
const plan::fb::Program *findProgram(const plan::fb::Plan &plan, std::string_view name);

class LoadedPlan {
public:
  // Reads and verifies a plan file.
  static StatusOr<LoadedPlan> load(const std::string &path);
  // Verifies plan bytes from elsewhere (a cache entry, a test); `sourceName` names them in errors.
  static StatusOr<LoadedPlan> fromBytes(std::span<const std::byte> bytes, std::string sourceName);

  const plan::fb::Plan &plan() const;
  const plan::fb::Plan *operator->() const { return &plan(); }
  // The file path, or the source name given to fromBytes.
  const std::string &path() const { return path_; }
  std::span<const std::byte> bytes() const;
  // The program named e.g. "prefill" or "decode"; null when absent.
  const plan::fb::Program *findProgram(std::string_view name) const;

private:
  LoadedPlan() = default;

  std::string path_;
  std::vector<uint64_t> storage_; // uint64_t elements give the buffer its 8-byte alignment
  size_t size_ = 0;
};

// The files a compiled model directory holds for one rank: plan.hyplan and weights.hyw for a
// world of one, plan.rank<r>.hyplan and weights.rank<r>.hyw for each rank of a sharded model
// (hybrid-compile --shard, docs/parallelism.md).
std::string planFileName(int rank, int worldSize);
std::string archiveFileName(int rank, int worldSize);

// Refuses a plan compiled for another device, architecture or world size, e.g.
//   "plan.hyplan was compiled for cuda sm_90a, this runtime device is cpu".
// `device` is "cpu" or "cuda"; an empty `arch` skips the architecture comparison.
Status checkTarget(const LoadedPlan &plan, std::string_view device, int worldSize,
                   std::string_view arch = {});
// Refuses a sharded plan loaded by another rank than the one it was sharded for, e.g.
//   "plan.rank1.hyplan is rank 1's plan of 2 (tensor_parallel 2, ...), this communicator's rank
//   is 0". Call after checkTarget (which compares the world sizes).
Status checkRank(const LoadedPlan &plan, int rank);

// Checks that `archive` is the one the plan was compiled against: the archive key equals the plan's
// weight_archive_key, weight_archive_bytes (when non-zero) equals where the archive's last entry
// ends, and every plan weight's name, dtype, shape, offset and size equals its archive entry.
Status checkWeights(const LoadedPlan &plan, const WeightArchive &archive);

} // namespace hybrid
