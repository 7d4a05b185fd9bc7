// Sparse MLA decode on CUDA (MODEL_SPEC 3.3 and 4, issue 6): for each query row and head, the
// absorbed query Q_h = [q~_h ; q_r,h] attends over exactly the positions the indexer selected,
// read from the paged FP8 latent cache (FlashMLA's "V32_FP8Sparse" rows, docs/dsa-cache-layout.md):
//   o^_h = sum_s softmax_s(softmaxScale * Q_h . K_s) c_s,  K_s = [c_s ; k_r,s]
// as ref::latentAttention. The cached latent (E4M3 codes times a power-of-two tile scale) and the
// bf16 rope key are exact in bf16; the query and the softmax weights are rounded to bf16 for the
// tensor cores (FlashMLA's precision), sums in fp32. CUDA-free header.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hybrid::kernels::cuda {

// How a latent page stores a token's row: FlashMLA's FP8 "V32" row (E4M3 latent, one power-of-two
// fp32 scale per 128 elements, bf16 rope key), or fp32 [latent | rope] (the unquantized policy).
enum class LatentCacheType { Fp8Tiles, F32 };

struct SparseMlaDecodeParams {
  int32_t rows = 0;      // query rows (one per sequence in decode)
  int32_t heads = 0;     // query heads (padded to 16 inside)
  int32_t latentDim = 0; // 512 (DeepSeek-V3.2) or 64 (the tiny model)
  int32_t ropeDim = 0;   // 64 or 32, with latentDim
  float softmaxScale = 0.0f;
  const float *q = nullptr; // [rows, heads, latentDim + ropeDim], absorbed; 16-byte aligned
  const int32_t *indices = nullptr;   // [rows, topK] positions; -1 entries are skipped
  int32_t topK = 0;
  // Without indices, dense causal attention (MLA layers without an indexer): row r attends to
  // positions 0..positions[r], and topK is the most positions any row may have (it sizes the
  // grid, so a captured launch stays valid as sequences grow; at most
  // sparseMlaMaxCausalPositions()).
  const int32_t *positions = nullptr; // [rows]
  const int32_t *sequences = nullptr; // [rows]: the row's block-table row
  // The cache: pages of pageTokens rows of ref::kvRowBytes(latentDim, ropeDim) bytes.
  const void *latentPages = nullptr;
  int32_t pageTokens = 64;
  const int32_t *blockTables = nullptr; // [sequences, maxPages]
  int32_t maxPages = 0;
  float *out = nullptr; // [rows, heads, latentDim]: o^ (zero for a row without positions)
  // sparseMlaWorkspaceBytes(rows, heads, latentDim, topK): split partials
  void *workspace = nullptr;
  // Blocks the positions of a row are split over (flash-decoding; a tuned configuration,
  // kernels/KernelTuning.h), 1..sparseMlaMaxSplitsForRows(topK, rows), at least topK /
  // kSparseMlaMaxPositionsPerBlock and at most the row's tiles (sparseMlaTileKeys); 0: the
  // default, a cost model of waves.
  int32_t splits = 0;
  // With splits = 0: the count the cost model chooses for one row, whatever `rows` is, so that a
  // row's sums (split order, positions per split) do not depend on the rows sharing its call
  // (LoadOptions::batchInvariant: a decode step of 32 rows and a verification pass of 160).
  bool rowInvariantSplits = false;
  // DeepSeek-V3.2's 64-head blocks (more than 32 heads, 512 + 64 rows) in 32-position halves,
  // two bf16 buffers, the next half converted while the MMAs of this one run, instead of one
  // 64-position tile converted between its MMAs. Off until measured against the tile form on a
  // GPU (docs/performance.md, 2026-12-02, session 24); elsewhere ignored.
  bool halfTiles = false;
};

// The most positions one block holds, and the most blocks a row's positions are split over:
// the cost model chooses among up to kSparseMlaMaxSplits, and longer (causal) rows take as many
// blocks as hold them, up to kSparseMlaMaxLongSplits (256K positions: Kimi's dense layers at
// 128K context and beyond), so the partials of short rows stay as small as before.
inline constexpr int32_t kSparseMlaMaxPositionsPerBlock = 2048;
inline constexpr int32_t kSparseMlaMaxSplits = 32;
inline constexpr int32_t kSparseMlaMaxLongSplits = 128;
inline constexpr int32_t sparseMlaMaxSplits(int32_t topK) {
  const int32_t needed = (topK + kSparseMlaMaxPositionsPerBlock - 1) / kSparseMlaMaxPositionsPerBlock;
  return needed > kSparseMlaMaxSplits ? needed : kSparseMlaMaxSplits;
}
// A launch of at most kSparseMlaFewRows rows (a small decode step) may split a row over up to
// kSparseMlaMaxLongSplits blocks: one row of a dense layer at 8K positions took 26 blocks of 5
// tiles under the 32 cap, on 26 of the H200's 132 SMs. The workspace holds either.
inline constexpr int32_t kSparseMlaFewRows = 4;
inline constexpr int32_t sparseMlaMaxSplitsForRows(int32_t topK, int32_t rows) {
  return rows <= kSparseMlaFewRows && sparseMlaMaxSplits(topK) < kSparseMlaMaxLongSplits
             ? kSparseMlaMaxLongSplits
             : sparseMlaMaxSplits(topK);
}
// Positions per tile of the launched kernel (every head count).
inline constexpr int32_t sparseMlaTileKeys(int32_t) { return 64; }

// The most positions a causal (index-free) launch may cover.
int32_t sparseMlaMaxCausalPositions();

// The scratch of a launch of `rows` rows of up to `topK` positions each: partial results when
// the positions are split over blocks.
size_t sparseMlaWorkspaceBytes(int32_t rows, int32_t heads, int32_t latentDim, int32_t topK);

// Bytes of one cached row (ref::kvRowBytes with 128-element tiles).
int64_t sparseMlaRowBytes(int32_t latentDim, int32_t ropeDim);
// Bytes of one cached row in either format.
int64_t latentRowBytes(LatentCacheType type, int32_t latentDim, int32_t ropeDim);

// 0 or a cudaError_t (cudaErrorInvalidValue for an unsupported shape or a missing pointer).
int launchSparseMlaDecode(const SparseMlaDecodeParams &params, void *stream);

} // namespace hybrid::kernels::cuda
