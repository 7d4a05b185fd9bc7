// The DSA lightning indexer on CUDA (MODEL_SPEC 4.2, issue 6): for each query row, the score of
// every earlier position s <= position,
//   I[s] = sum_j (w[j] * heads^-1/2) * ReLU(headDim^-1/2 * q[j] . k[s]),
// read from the paged index-key cache (docs/dsa-cache-layout.md, ref::PagedCacheLayout), then
// the topK positions with the largest scores (ties: lower position first, as ref::topKIndices).
// One launch serves decode (one row per sequence, its last position) and causal prefill (one row
// per token, each with its position). CUDA-free header.
//
// Two forms, the same selection. Fused (no `scores` workspace; FP8 keys, contexts up to
// indexerFusedSupported): one launch, a cluster of blocks per row keeping the row's scores in
// their shared memory and selecting over distributed shared memory, so the scores never reach
// global memory. Unfused (a `scores` workspace; also fp32 keys and longer contexts): the scores
// of a row are written to a workspace row, then selected by a radix select spread over many
// blocks. FP8 keys multiply on the bf16 tensor cores exactly (see dsa_indexer_sm90.cu), fp32 keys
// on CUDA cores; either way the cpu oracle's values up to fp32 summation order.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hybrid::kernels::cuda {

// How a page stores a key: the same formats and byte layout as ref::IndexKeyFormat.
enum class IndexKeyType { Fp8PerKey, Mxfp8, F32 };

inline constexpr int kIndexerMaxHeads = 64;
inline constexpr int kIndexerMaxTopK = 4096;

struct IndexerParams {
  int32_t rows = 0;    // query rows
  int32_t heads = 0;   // 1..kIndexerMaxHeads
  int32_t headDim = 0; // 64 or 128
  const float *q = nullptr;           // [rows, heads, headDim], RoPE'd (as the cpu device's)
  // The queries are MXFP8-rounded (the policy's indexer Q), so exact in bf16 and in E4M3: with
  // FP8 keys in 64-token pages the unfused form then takes the warpgroup (or FP8) scores.
  bool mxfp8Queries = false;
  // The queries are E4M3 codes times one power of two a (row, head): DeepSeek-V3.2's own FP8
  // indexer (act_quant over the 128-wide head, ue8m0 scale; MODEL_SPEC 4.3). Exact in f16 too, so
  // every form mxfp8Queries allows takes them; with Fp8PerKey keys, head dim 128 and 64-token
  // pages Auto picks the FP8 warpgroup scores (E4M3 x E4M3 warpgroup MMAs, nothing widened; the
  // tensor cores' FP8 sums carry ~13 mantissa bits, as DeepGEMM's: scores within ~1e-4 relative,
  // where Warpgroup's are exact fp32 sums).
  bool fp8HeadQueries = false;
  // Which tensor-core scores the unfused form runs for FP8 keys. With mxfp8Queries (or
  // fp8HeadQueries) and 64-token pages: Warpgroup (keys widened to f16 in registers, warpgroup
  // MMAs; what Auto picks, but for Fp8Warpgroup where that applies) or Fp8 (E4M3 mma.sync, one MX
  // block per MMA); otherwise, and for Bf16, the bf16 mma.sync form.
  enum class ScoreKernel {
    Auto,
    Bf16,
    Fp8,
    Warpgroup,
    Fp8Warpgroup
  } scoreKernel = ScoreKernel::Auto;
  const float *headWeights = nullptr; // [rows, heads]: weights_proj(x), raw
  const int32_t *positions = nullptr; // [rows]: the row attends to keys 0..position
  const int32_t *sequences = nullptr; // [rows]: the row's block-table row
  // The cache: pages of pageTokens keys in `keyType` (PagedCacheLayout's index page), block
  // table [sequences, maxPages] of physical page numbers.
  const void *keyPages = nullptr;
  IndexKeyType keyType = IndexKeyType::Fp8PerKey;
  int32_t pageTokens = 64;
  const int32_t *blockTables = nullptr;
  int32_t maxPages = 0;
  // Every position + 1 must be <= maxKeys. Unfused: the scores workspace [rows, maxKeys]; null
  // for the fused form.
  float *scores = nullptr;
  int32_t maxKeys = 0;
  int32_t topK = 0;           // 1..kIndexerMaxTopK; above maxKeys every row selects all its keys
  int32_t *indices = nullptr; // [rows, topK]: the selected positions in ascending order (the
                              // same bits every run); a row with fewer than topK keys gets all
                              // of them, then -1s
  // Unfused: indexerSelectWorkspaceBytes(rows, maxKeys, selectForm), 16-byte aligned.
  void *selectWorkspace = nullptr;
  // How the unfused top-k selects after the warpgroup scores, which choose its first digit. From
  // each 2048-key chunk's gathered candidates (the keys in that digit's bin): OneLaunch, one
  // cooperative launch, when every row's chunks (of maxKeys) fit on the GPU at once, a block
  // each (else it fails: cudaErrorCooperativeLaunchTooLarge); Gathered, three launches (gather,
  // rank, write). Passes: a launch per remaining digit over every score, then the write. Auto:
  // OneLaunch where it fits at up to 4 blocks an SM, else Passes. Cluster: one launch, a cluster
  // of up to 16 blocks a row holding the row's scores in shared memory (up to ~900K keys), the
  // fused form's radix select; needs no first digit. Auto leaves it: on the H200 it gains 0.3-1.2
  // us a call at 8K keys but loses 1-13 us at 32K and up to 5 us at 128K (batch 1-8; docs/
  // performance.md, 2026-12-02, session 23). Tests and benchmarks pick each.
  enum class SelectForm {
    Auto,
    OneLaunch,
    Gathered,
    Passes,
    Cluster
  } selectForm = SelectForm::Auto;
  // The unfused tensor-core scores' 64-key tiles per block (a tuned configuration, kernels/
  // KernelTuning.h); 0: the default, about one wave of blocks on the GPU.
  int32_t tilesPerBlock = 0;
};

// Keys per tile of the tensor-core score kernels (IndexerParams::tilesPerBlock counts these).
inline constexpr int kIndexerTileKeys = 64;

// Whether the fused form takes these keys: FP8 keys, and maxKeys whose scores fit the shared
// memory of a cluster of 16 blocks (about 600K keys on H200). Queries the current device.
bool indexerFusedSupported(IndexKeyType type, int32_t headDim, int32_t maxKeys);

// The top-k's scratch: per row the queries as the warpgroup scores kernel reads them (16 KB) and
// their heads' scales, its radix-select state and a digit histogram, per 2048 keys a chunk's
// counts and places, one counter, and a word a key of the capacity for the gathered candidates:
// of every row for SelectForm::Gathered, else of the rows a one-launch grid may take (at most 1024
// chunks of 2048 keys: 8 MB). The bytes for `rows` rows hold any launch of fewer rows.
size_t
indexerSelectWorkspaceBytes(int32_t rows, int32_t maxKeys,
                            IndexerParams::SelectForm form = IndexerParams::SelectForm::Auto);

// Bytes of one index-key page (PagedCacheLayout::indexPageBytes for the same format).
int64_t indexerPageBytes(IndexKeyType type, int32_t pageTokens, int32_t headDim);

// Scores, then top-k, on `stream`. 0 or a cudaError_t (cudaErrorInvalidValue for bad shapes or
// missing pointers; positions and page numbers are the caller's to keep in range).
int launchIndexerTopK(const IndexerParams &params, void *stream);

} // namespace hybrid::kernels::cuda
