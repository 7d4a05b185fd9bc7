// The CUDA kernels' tunable parameters (issue 14, docs/autotune.md). Each tunable family declares
// here, CUDA-free, its parameters (names, the values worth trying, the default) and a constraint
// that rejects, with a reason, what cannot run at a shape; the shape bucket of a launch (what
// the tuner measures and the runtime looks up); and how a configuration is set on the kernel's
// params (0 in a params field = the kernel's own default choice, so an untuned launch is
// unchanged). The cuda device looks configurations up at run time through a TuningTable;
// `hybrid-bench tune` measures and stores them (kernels/Tuner.h).
#pragma once

#include "hybrid/cache/Tuning.h"
#include "hybrid/kernels/cuda/DsaIndexer.h"
#include "hybrid/kernels/cuda/KdaDecode.h"
#include "hybrid/kernels/cuda/Moe.h"
#include "hybrid/kernels/cuda/SparseMla.h"

#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace hybrid::kernels::tuning {

using cache::ShapeBucket;
using cache::TunableKernel;
using cache::TuningConfig;

// The DSA indexer's unfused tensor-core scores (dsa_indexer_sm90.cu): tiles_per_block, the
// 64-key tiles one block scores (0: about one wave of blocks on the GPU).
inline constexpr std::string_view kIndexerScores = "dsa-indexer-scores";
// Sparse MLA decode (sparse_mla_decode_sm90.cu): splits, the blocks a row's positions are split
// over (0: the cost model of waves).
inline constexpr std::string_view kSparseMlaDecode = "sparse-mla-decode";
// The routed experts (moe_sm90.cu per token, moe_grouped_sm90.cu on tensor cores):
// per_token_max_pairs, the (token, expert) pairs at or below which the per-token form runs where
// the grouped form could (0: kMoePerTokenMaxPairs, 64).
inline constexpr std::string_view kMoeExperts = "moe-experts";
// KDA's decode step (kda_decode_sm90.cu): path, 1 the fused kernel, 2 the split prolog + state
// kernels (0: the split path from kKdaDecodeSplitPairs (sequence, head) pairs at head_dim 128).
inline constexpr std::string_view kKdaDecode = "kda-decode";

const TunableKernel &indexerScoresKernel();
const TunableKernel &sparseMlaDecodeKernel();
const TunableKernel &moeExpertsKernel();
const TunableKernel &kdaDecodeKernel();
// Every tunable family, and one by name (null when there is none of that name).
std::vector<const TunableKernel *> tunableKernels();
const TunableKernel *findTunableKernel(std::string_view name);

// A launch's shape bucket: sizes that vary with the batch and context rounded up to powers of two
// (cache::bucketSize), the model's fixed dimensions exact. The tuner measures at the bucket's
// sizes; the runtime looks up the bucket of each launch.
ShapeBucket indexerScoresShape(const kernels::cuda::IndexerParams &params);
ShapeBucket sparseMlaDecodeShape(const kernels::cuda::SparseMlaDecodeParams &params);
ShapeBucket moeExpertsShape(const kernels::cuda::MoeExpertsParams &params);
ShapeBucket kdaDecodeShape(const kernels::cuda::KdaDecodeParams &params);
// The dimensions a family's bucket must hold, in order (the tuner's --shape checks them).
std::vector<std::string> shapeDimensions(const TunableKernel &kernel);

// Sets a configuration on the params; an empty one leaves them at the defaults.
void applyConfig(const TuningConfig &config, kernels::cuda::IndexerParams &params);
void applyConfig(const TuningConfig &config, kernels::cuda::SparseMlaDecodeParams &params);
void applyConfig(const TuningConfig &config, kernels::cuda::MoeExpertsParams &params);
void applyConfig(const TuningConfig &config, kernels::cuda::KdaDecodeParams &params);

// The configurations tuned for this GPU, read from a cache store on first use of each (kernel,
// bucket) and remembered; thread safe. Without a store, or on a miss, a lookup gives nothing and
// the kernel runs its defaults. A store that cannot be read is a miss too (serving does not stop
// for a tuning cache), noted in the report.
class TuningTable {
public:
  TuningTable() = default; // no store: defaults everywhere
  TuningTable(cache::CacheStore store, cache::TuningDevice device);

  std::optional<TuningConfig> lookup(const TunableKernel &kernel, const ShapeBucket &shape);
  bool enabled() const { return store_.has_value(); }
  const cache::TuningDevice &device() const { return device_; }
  // One line per (kernel, bucket) looked up: the configuration found, or "defaults" and why.
  std::string report() const;

private:
  struct Entry {
    std::string kernel;
    ShapeBucket shape;
    std::optional<TuningConfig> config;
    std::string note;
  };
  std::optional<cache::CacheStore> store_;
  cache::TuningDevice device_;
  mutable std::mutex mutex_;
  std::vector<Entry> entries_; // few: one per kernel and bucket seen
};

// "kernel a=1,b=2" / "k=v,k=v" spellings of buckets and configurations, for reports and the
// tuner's command line.
std::string formatConfig(const TuningConfig &config);
std::string formatShape(const ShapeBucket &shape);

} // namespace hybrid::kernels::tuning
