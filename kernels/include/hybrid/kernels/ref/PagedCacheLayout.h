// Byte layout of the DSA caches as the GPU kernels will read them (issue 6): the MLA latent cache
// in FP8 and the indexer-key cache in FP8, both paged. A page holds `pageTokens` consecutive
// positions of one sequence; a sequence's block table maps its logical page i to a physical
// page of the pool, so a sequence's pages need not be contiguous. docs/dsa-cache-layout.md.
//
// Latent page: pageTokens rows of kvRowBytes(latentDim, ropeDim, tile) bytes each, the FlashMLA
//   "V32_FP8Sparse" row of Quant.h (E4M3 latent codes, one fp32 power-of-two scale per tile, the
//   rope key in bf16): 64 x 656 = 41,984 bytes for DeepSeek-V3.2.
// Index-key page (DeepGEMM's paged layout): the page's pageTokens rows of `indexDim` E4M3 codes
//   first, then their pageTokens fp32 scales: 64 x (128 + 4) = 8,448 bytes for DeepSeek-V3.2, so
//   a warp reads 128-byte code rows without the scales in between.
//
// The packers below write one token into a page from fp32 values, through the bit-exact
// quantizers of Quant.h; the unpackers give back exactly what a kernel reading the page sees.
// Every function that takes spans checks their sizes and the position and returns false (writing
// nothing) when they do not fit; none asserts.
#pragma once

#include "hybrid/kernels/ref/Quant.h"

#include <cstdint>
#include <span>

namespace hybrid::kernels::ref {

// How an index-key page stores a key (its codes part, then its scales part):
//   Fp8PerKey: indexDim E4M3 codes, one fp32 scale (DeepGEMM; the rule given to the packer);
//   Mxfp8:     indexDim E4M3 codes, indexDim / 32 E8M0 scale bytes (the quantization policy's
//              `indexer_qk: mxfp8`, RoundUp rule: what the cpu device's keys hold);
//   F32:       indexDim fp32 values, no scales (the unquantized policy).
enum class IndexKeyFormat { Fp8PerKey, Mxfp8, F32 };

struct PagedCacheLayout {
  int64_t pageTokens = 64;
  int64_t latentDim = 512, ropeDim = 64, tile = kFp8TileSize; // the MLA latent row
  int64_t indexDim = 128;                                      // the indexer key
  IndexKeyFormat indexFormat = IndexKeyFormat::Fp8PerKey;

  // All positive (Mxfp8: indexDim a multiple of 32), and pages whose sizes keep every page
  // 16-byte aligned in a pool.
  bool valid() const;
  int64_t latentRowBytes() const { return kvRowBytes(latentDim, ropeDim, tile); }
  int64_t latentPageBytes() const { return pageTokens * latentRowBytes(); }
  int64_t indexCodeBytes() const {
    return indexFormat == IndexKeyFormat::F32 ? 4 * indexDim : indexDim;
  }
  int64_t indexScaleBytes() const {
    return indexFormat == IndexKeyFormat::Fp8PerKey ? 4
           : indexFormat == IndexKeyFormat::Mxfp8   ? indexDim / kMxBlockSize
                                                    : 0;
  }
  int64_t indexPageBytes() const { return pageTokens * (indexCodeBytes() + indexScaleBytes()); }
  // Offsets inside a page of the token in slot `t` (0 <= t < pageTokens).
  int64_t latentRowOffset(int64_t t) const { return t * latentRowBytes(); }
  int64_t indexCodesOffset(int64_t t) const { return t * indexCodeBytes(); }
  int64_t indexScaleOffset(int64_t t) const {
    return pageTokens * indexCodeBytes() + t * indexScaleBytes();
  }
};

// Where a sequence's `position` lives in a pool of pages (physical page p at p * pageBytes), given
// its block table (logical page -> physical page): the byte offset of its page and its slot in
// the page (add latentRowOffset / indexCodesOffset / indexScaleOffset of the slot). pageOffset is
// -1 when the position is negative, past the table, or its page index is negative.
struct PagedSlot {
  int64_t pageOffset = -1;
  int64_t slot = 0;
};
PagedSlot pagedSlot(std::span<const int32_t> blockTable, int64_t pageTokens, int64_t pageBytes,
                    int64_t position);

// One token's latent (latentDim values) and rope key (ropeDim) into slot t of a latent page
// (latentPageBytes bytes), and back.
[[nodiscard]] bool packLatentToken(const PagedCacheLayout &layout, std::span<uint8_t> page,
                                   int64_t t, std::span<const float> latent,
                                   std::span<const float> rope);
[[nodiscard]] bool unpackLatentToken(const PagedCacheLayout &layout,
                                     std::span<const uint8_t> page, int64_t t,
                                     std::span<float> latent, std::span<float> rope);

// One token's indexer key (indexDim values, in the layout's indexFormat; `rule` picks the scale
// of Fp8PerKey) into slot t of an index-key page (indexPageBytes bytes), and back.
[[nodiscard]] bool packIndexKeyToken(const PagedCacheLayout &layout, std::span<uint8_t> page,
                                     int64_t t, std::span<const float> key,
                                     Fp8ScaleRule rule = Fp8ScaleRule::DeepSeekUe8m0);
[[nodiscard]] bool unpackIndexKeyToken(const PagedCacheLayout &layout,
                                       std::span<const uint8_t> page, int64_t t,
                                       std::span<float> key);

} // namespace hybrid::kernels::ref
