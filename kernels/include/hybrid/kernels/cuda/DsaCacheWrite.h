// Writing a step's tokens into the DSA caches on CUDA (docs/dsa-cache-layout.md): the MLA latent
// rows in FlashMLA's FP8 "V32" layout (or fp32 rows for the unquantized policy) and the indexer keys in any IndexKeyType, each token at its
// position's slot of its sequence's page. Bit-identical to the reference packers
// (ref::packLatentToken, ref::packIndexKeyToken), so a cache the GPU writes reads back exactly as
// the cpu device's. CUDA-free header.
#pragma once

#include "hybrid/kernels/cuda/DsaIndexer.h" // IndexKeyType
#include "hybrid/kernels/cuda/SparseMla.h"  // LatentCacheType

#include <cstdint>

namespace hybrid::kernels::cuda {

// Where each token goes: token t of the step at positions[t] of block-table row sequences[t].
struct PagedTokens {
  int32_t tokens = 0;
  const int32_t *positions = nullptr;   // [tokens]
  const int32_t *sequences = nullptr;   // [tokens]
  const int32_t *blockTables = nullptr; // [sequences, maxPages] physical page numbers
  int32_t maxPages = 0;
  int32_t pageTokens = 64;
};

struct LatentWriteParams {
  PagedTokens where;
  int32_t latentDim = 0, ropeDim = 0; // 512 + 64 (DeepSeek-V3.2); latentDim % 4, ropeDim % 2 == 0
  const float *latent = nullptr;      // [tokens, latentDim], after kv_a_layernorm
  const float *rope = nullptr;        // [tokens, ropeDim], rotated
  LatentCacheType type = LatentCacheType::Fp8Tiles;
  void *pages = nullptr;              // rows of latentRowBytes(type, latentDim, ropeDim) bytes
};

// The scale rule of an Fp8PerKey key (ref::Fp8ScaleRule; the V3.2 indexer uses ue8m0).
enum class IndexKeyScale { DeepSeekUe8m0, DeepSeekLinear };

struct IndexKeyWriteParams {
  PagedTokens where;
  int32_t dim = 0; // indexDim, 1..128 (a multiple of 32 for Mxfp8)
  IndexKeyType type = IndexKeyType::Mxfp8;
  IndexKeyScale scale = IndexKeyScale::DeepSeekUe8m0;
  const float *keys = nullptr; // [tokens, dim]
  void *pages = nullptr;       // indexerPageBytes(type, pageTokens, dim) per page
};

// 0 or a cudaError_t (cudaErrorInvalidValue for a bad shape or a missing pointer).
int launchWriteLatentRows(const LatentWriteParams &params, void *stream);
int launchWriteIndexKeys(const IndexKeyWriteParams &params, void *stream);

} // namespace hybrid::kernels::cuda
