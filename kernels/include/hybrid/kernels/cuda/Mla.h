// MLA on CUDA (MODEL_SPEC 3): what the runtime's MLA and DSA dispatches put around the attention
// kernels, in the absorbed form of 3.3 (ref::absorbMlaQueries / latentAttention /
// expandLatentOutputs): RoPE by position, the cache rows of a step (RMSNorm'ed latent + rotated
// key), the per-head absorption of the queries through W_UK and expansion of the outputs through
// W_UV, and a CUDA-core latent attention over the paged cache in either row format (fp32 for the
// unquantized policy, FlashMLA's FP8 rows otherwise), sparse (the indexer's positions) or dense
// causal. fp32 throughout, the reference's arithmetic up to summation order. CUDA-free header.
// Every launch returns 0 or a cudaError_t (cudaErrorInvalidValue for a bad shape or a missing
// pointer; positions and page numbers are the caller's to keep in range).
#pragma once

#include "hybrid/kernels/cuda/Elementwise.h" // WeightType
#include "hybrid/kernels/cuda/SparseMla.h"   // LatentCacheType

#include <cstdint>

namespace hybrid::kernels::cuda {

enum class RopePairing { Interleaved, HalfSplit };

// Rotates `dims` values (dims / 2 pairs) at `offset` of every head of every row by the row's
// position, as ref::applyRope: x[r * rowStride + h * headStride + offset + ...], in floats.
struct RopeParams {
  int32_t rows = 0;
  int32_t heads = 1;
  int64_t rowStride = 0;
  int64_t headStride = 0;
  int64_t offset = 0;
  int32_t dims = 0;
  RopePairing pairing = RopePairing::Interleaved;
  const float *inverseFrequencies = nullptr; // [dims / 2]
  const int32_t *positions = nullptr;        // [rows]
  float *x = nullptr;
  // Then, in the same launch, the first `mxfp8Width` values of each row (a multiple of 32)
  // rounded to MXFP8 as launchMxfp8RoundTrip does: the DSA indexer's query / key prolog.
  int64_t mxfp8Width = 0;
  // Or (not both) the first `fp8Width` values of each row rounded to FP8 in groups of `fp8Group`
  // (a multiple of 32 dividing headStride when heads > 1): E4M3 with one ue8m0 power-of-two scale
  // a group, as ref::quantizeFp8Tiles (tile fp8Group, Fp8ScaleRule::DeepSeekUe8m0) then
  // dequantizeFp8Tiles: DeepSeek-V3.2's own indexer quantization, a group a query head or a key.
  int64_t fp8Width = 0;
  int32_t fp8Group = 0;
};
int launchRope(const RopeParams &params, void *stream);

// A step's cache rows from its kv_a projection [rows, latentDim + ropeDim]: latent = RMSNorm of
// the first latentDim values times normWeight, rope = the rest, rotated by position (copied as it
// is without inverseFrequencies: NoPE).
struct MlaLatentRowsParams {
  int32_t rows = 0;
  int32_t latentDim = 0;
  int32_t ropeDim = 0;
  float epsilon = 1e-6f;
  const float *kvA = nullptr;
  const float *normWeight = nullptr; // [latentDim]
  RopePairing pairing = RopePairing::Interleaved;
  const float *inverseFrequencies = nullptr; // [ropeDim / 2] or null
  const int32_t *positions = nullptr;        // [rows]
  float *latent = nullptr;                   // [rows, latentDim]
  float *rope = nullptr;                     // [rows, ropeDim]
};
int launchMlaLatentRows(const MlaLatentRowsParams &params, void *stream);

// kv_b_proj [heads * (nopeDim + valueDim), latentDim] holds per head W_UK [nopeDim, latentDim]
// then W_UV [valueDim, latentDim]: fp32, bf16, or (Fp8Block) E4M3 codes with one fp32 scale per
// 128 x 128 block in the FP8 GEMM's layout (kvBScales [ceil(rows / 128), kvBScaleStride]), each
// weight its code times its scale in fp32 (the value the cpu device reads); Fp8Block needs a
// latentDim that is a multiple of 16 and 16-byte aligned codes.
struct MlaHeadWeights {
  int32_t heads = 0;
  int32_t nopeDim = 0;
  int32_t valueDim = 0;
  int32_t latentDim = 0; // <= kMlaMaxLatentDim
  const void *kvB = nullptr;
  WeightType type = WeightType::BF16;
  const float *kvBScales = nullptr; // Fp8Block only
  int64_t kvBScaleStride = 0;       // Fp8Block only: scales a row of blocks
};
inline constexpr int kMlaMaxLatentDim = 512;

// absorbed[r, h] = [W_UK_h^T q_nope[r, h] ; q_rope[r, h]] from queries [rows, heads, nopeDim +
// ropeDim]: [rows, heads, latentDim + ropeDim].
int launchMlaAbsorbQueries(const MlaHeadWeights &weights, int32_t rows, int32_t ropeDim,
                           const float *queries, float *absorbed, void *stream);
// out[r, h * valueDim + v] = W_UV_h[v] . latentOut[r, h] from latentOut [rows, heads, latentDim].
// Decode rows (<= 8, bf16) take the GEMV, which sums in another order than the kernel of larger
// calls; rowInvariant: that kernel for every row count (LoadOptions::batchInvariant).
int launchMlaExpandOutputs(const MlaHeadWeights &weights, int32_t rows, const float *latentOut,
                           float *out, void *stream, bool rowInvariant = false);

// Attention of absorbed queries over a paged latent cache (pages of pageTokens rows of
// latentRowBytes(cacheType, latentDim, ropeDim) bytes): row r attends to the positions
// indices[r, :topK] (-1 skipped) or, without indices, to every position <= positions[r].
struct LatentAttentionParams {
  int32_t rows = 0;
  int32_t heads = 0;
  int32_t latentDim = 0; // <= kMlaMaxLatentDim, a multiple of 4
  int32_t ropeDim = 0;   // <= 64
  float softmaxScale = 0.0f;
  const float *q = nullptr;           // [rows, heads, latentDim + ropeDim]
  const int32_t *indices = nullptr;   // [rows, topK] or null: causal
  int32_t topK = 0;
  const int32_t *positions = nullptr; // [rows] (read without indices)
  const int32_t *sequences = nullptr; // [rows]: the row's block-table row
  const void *latentPages = nullptr;
  LatentCacheType cacheType = LatentCacheType::F32;
  int32_t pageTokens = 64;
  const int32_t *blockTables = nullptr; // [sequences, maxPages]
  int32_t maxPages = 0;
  float *out = nullptr; // [rows, heads, latentDim]; zero for a row without positions
};
int launchLatentAttention(const LatentAttentionParams &params, void *stream);

} // namespace hybrid::kernels::cuda
