// The DSA kernels' benchmarks (hybrid-bench dsa-indexer, dsa-sparse-mla): CUDA events, warm-up,
// median of 7, on random data. CUDA-free header.
#pragma once

#include "hybrid/kernels/cuda/DsaIndexer.h"
#include "hybrid/kernels/cuda/SparseMla.h"

#include <cstdint>
#include <string>
#include <vector>

namespace hybrid::kernels::cuda {

struct IndexerBenchResult {
  int32_t batch = 0, context = 0, heads = 0, headDim = 0, topK = 0;
  IndexKeyType keyType = IndexKeyType::Mxfp8;
  bool fused = false;      // the one-launch form (no scores workspace)
  double microseconds = 0; // one decode step (every sequence's query against its whole
                           // context), replayed from a CUDA graph
  double keyBytes = 0;     // the key cache the step must read: batch x context keys
  double floorMicroseconds = 0; // keyBytes at the measured copy bandwidth
};

// Decode: `batch` sequences, each with `context` keys in its own (scattered) pages of 64 tokens,
// one query row each; the fused form where `fused` and it takes the shape (result.fused says).
std::vector<IndexerBenchResult>
benchIndexerDecode(const std::vector<int32_t> &batches, const std::vector<int32_t> &contexts,
                   int32_t heads, int32_t headDim, int32_t topK, IndexKeyType keyType, bool fused,
                   IndexerParams::ScoreKernel scoreKernel, IndexerParams::SelectForm selectForm,
                   int32_t iterations, std::string &error);

// "meets" / "x.xx of the target": the issue's >= 70% of the key-cache bandwidth floor.
std::string indexerTargetVerdict(const IndexerBenchResult &result);

struct SparseMlaBenchResult {
  int32_t batch = 0, heads = 0, topK = 0, context = 0;
  int32_t splits = 0; // the positions' splits asked for (0: the kernel's cost model chooses)
  bool refused = false; // the kernel does not take that split count for this shape: not timed
  bool prefill = false;
  double microseconds = 0;      // one call, replayed from a CUDA graph
  double bytes = 0;             // what the step must move: the selected rows, q, the output
  double floorMicroseconds = 0; // bytes at the measured copy bandwidth
  double tflops = 0;            // QK (576 wide) and PV (512 wide) per head and position
};

// Decode: `batch` sequences of `context` cached DeepSeek-V3.2 rows (512 + 64, FP8) each, one
// query row each selecting `topK` random distinct positions. Prefill: `batch` query rows (tokens)
// of one sequence of `context` cached rows, each selecting its own `topK` of them. Each shape
// runs once per entry of `splits` (SparseMlaDecodeParams::splits; 0: the cost model's count);
// `halfTiles` is SparseMlaDecodeParams::halfTiles.
std::vector<SparseMlaBenchResult> benchSparseMla(const std::vector<int32_t> &batches,
                                                 const std::vector<int32_t> &heads, int32_t topK,
                                                 int32_t context, bool prefill,
                                                 const std::vector<int32_t> &splits,
                                                 bool halfTiles, int32_t iterations,
                                                 std::string &error);

// The targets: decode >= 60% of HBM bandwidth for the bytes the kernel must read;
// prefill reported against the 640 TFLOP/s FlashMLA publishes for its sparse prefill (H800).
std::string sparseMlaTargetVerdict(const SparseMlaBenchResult &result);
inline constexpr double kFlashMlaSparsePrefillTflops = 640.0;

} // namespace hybrid::kernels::cuda
