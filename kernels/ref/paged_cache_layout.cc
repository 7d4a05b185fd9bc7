#include "hybrid/kernels/ref/PagedCacheLayout.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace hybrid::kernels::ref {

bool PagedCacheLayout::valid() const {
  if (pageTokens <= 0 || latentDim <= 0 || ropeDim < 0 || tile <= 0 || indexDim <= 0)
    return false;
  if (indexFormat == IndexKeyFormat::Mxfp8 && indexDim % kMxBlockSize != 0)
    return false;
  // Vector loads and TMA copies want every page of a pool to start 16-byte aligned.
  return latentPageBytes() % 16 == 0 && indexPageBytes() % 16 == 0;
}

PagedSlot pagedSlot(std::span<const int32_t> blockTable, int64_t pageTokens, int64_t pageBytes,
                    int64_t position) {
  if (pageTokens <= 0 || pageBytes <= 0 || position < 0)
    return {};
  const int64_t logical = position / pageTokens;
  if (logical >= static_cast<int64_t>(blockTable.size()) || blockTable[logical] < 0)
    return {};
  return {int64_t(blockTable[logical]) * pageBytes, position % pageTokens};
}

namespace {

bool slotFits(const PagedCacheLayout &layout, int64_t t, size_t pageSize, int64_t pageBytes) {
  return layout.valid() && t >= 0 && t < layout.pageTokens &&
         static_cast<int64_t>(pageSize) == pageBytes;
}

} // namespace

bool packLatentToken(const PagedCacheLayout &layout, std::span<uint8_t> page, int64_t t,
                     std::span<const float> latent, std::span<const float> rope) {
  if (!slotFits(layout, t, page.size(), layout.latentPageBytes()) ||
      static_cast<int64_t>(latent.size()) != layout.latentDim ||
      static_cast<int64_t>(rope.size()) != layout.ropeDim)
    return false;
  return packFp8KvRow(latent, rope,
                      page.subspan(static_cast<size_t>(layout.latentRowOffset(t)),
                                   static_cast<size_t>(layout.latentRowBytes())),
                      layout.tile);
}

bool unpackLatentToken(const PagedCacheLayout &layout, std::span<const uint8_t> page, int64_t t,
                       std::span<float> latent, std::span<float> rope) {
  if (!slotFits(layout, t, page.size(), layout.latentPageBytes()) ||
      static_cast<int64_t>(latent.size()) != layout.latentDim ||
      static_cast<int64_t>(rope.size()) != layout.ropeDim)
    return false;
  return unpackFp8KvRow(page.subspan(static_cast<size_t>(layout.latentRowOffset(t)),
                                     static_cast<size_t>(layout.latentRowBytes())),
                        latent, rope, layout.tile);
}

bool packIndexKeyToken(const PagedCacheLayout &layout, std::span<uint8_t> page, int64_t t,
                       std::span<const float> key, Fp8ScaleRule rule) {
  if (!slotFits(layout, t, page.size(), layout.indexPageBytes()) ||
      static_cast<int64_t>(key.size()) != layout.indexDim)
    return false;
  const auto dim = static_cast<size_t>(layout.indexDim);
  std::vector<uint8_t> codes(static_cast<size_t>(layout.indexCodeBytes())),
      scales(static_cast<size_t>(layout.indexScaleBytes()));
  switch (layout.indexFormat) {
  case IndexKeyFormat::Fp8PerKey: { // the logical row (codes, then its scale), split in two
    std::vector<uint8_t> row(static_cast<size_t>(indexKeyBytes(layout.indexDim)));
    if (!packFp8IndexKey(key, row, rule))
      return false;
    std::copy_n(row.begin(), dim, codes.begin());
    std::copy_n(row.begin() + static_cast<std::ptrdiff_t>(dim), 4, scales.begin());
    break;
  }
  case IndexKeyFormat::Mxfp8:
    if (!quantizeMxfp8(key, 1, layout.indexDim, codes, scales, MxScaleRule::RoundUp))
      return false;
    break;
  case IndexKeyFormat::F32:
    std::memcpy(codes.data(), key.data(), codes.size());
    break;
  }
  std::copy(codes.begin(), codes.end(), page.begin() + layout.indexCodesOffset(t));
  std::copy(scales.begin(), scales.end(), page.begin() + layout.indexScaleOffset(t));
  return true;
}

bool unpackIndexKeyToken(const PagedCacheLayout &layout, std::span<const uint8_t> page, int64_t t,
                         std::span<float> key) {
  if (!slotFits(layout, t, page.size(), layout.indexPageBytes()) ||
      static_cast<int64_t>(key.size()) != layout.indexDim)
    return false;
  const auto dim = static_cast<size_t>(layout.indexDim);
  const auto codes = page.subspan(static_cast<size_t>(layout.indexCodesOffset(t)),
                                  static_cast<size_t>(layout.indexCodeBytes()));
  const auto scales = page.subspan(static_cast<size_t>(layout.indexScaleOffset(t)),
                                   static_cast<size_t>(layout.indexScaleBytes()));
  switch (layout.indexFormat) {
  case IndexKeyFormat::Fp8PerKey: {
    std::vector<uint8_t> row(codes.begin(), codes.end());
    row.insert(row.end(), scales.begin(), scales.end());
    return unpackFp8IndexKey(row, key);
  }
  case IndexKeyFormat::Mxfp8:
    return dequantizeMxfp8(codes, scales, 1, layout.indexDim, key);
  case IndexKeyFormat::F32:
    std::memcpy(key.data(), codes.data(), dim * sizeof(float));
    return true;
  }
  return false;
}

} // namespace hybrid::kernels::ref
