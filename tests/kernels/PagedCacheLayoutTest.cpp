// The DSA caches' paged FP8 layout (PagedCacheLayout.h): page sizes for DeepSeek-V3.2 and the
// tiny model, tokens packed into their slots byte for byte as the logical rows of Quant.h,
// non-contiguous pages through a block table, and refused arguments that write nothing.
#include "hybrid/kernels/ref/PagedCacheLayout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

namespace hybrid::kernels::ref {
namespace {

std::vector<float> randomValues(size_t n, std::mt19937 &rng, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(n);
  for (float &v : values)
    v = normal(rng);
  return values;
}

TEST(PagedCacheLayout, PageSizesOfTheModels) {
  const PagedCacheLayout v32; // DeepSeek-V3.2: latent 512 + rope 64, index key 128, 64 tokens
  EXPECT_TRUE(v32.valid());
  EXPECT_EQ(v32.latentRowBytes(), 656);
  EXPECT_EQ(v32.latentPageBytes(), 64 * 656);
  EXPECT_EQ(v32.indexPageBytes(), 64 * 132);
  EXPECT_EQ(v32.indexScaleOffset(0), 64 * 128);
  const PagedCacheLayout tiny{64, 64, 32, 128, 64}; // the tiny test model
  EXPECT_TRUE(tiny.valid());
  EXPECT_EQ(tiny.latentRowBytes(), 132);
  EXPECT_EQ(tiny.indexPageBytes(), 64 * 68);
  // Pages that would leave the next page unaligned are refused.
  EXPECT_FALSE((PagedCacheLayout{3, 64, 32, 128, 64}.valid()));
  EXPECT_FALSE((PagedCacheLayout{0, 512, 64, 128, 128}.valid()));
}

// Each slot of a page holds exactly the bytes of the logical row; unpacking gives the values a
// kernel reading the page sees; the other slots are untouched.
TEST(PagedCacheLayout, TokensLandInTheirSlotsAsTheLogicalRows) {
  const PagedCacheLayout layout{16, 64, 32, 128, 64};
  ASSERT_TRUE(layout.valid());
  std::mt19937 rng(3);
  std::vector<uint8_t> latentPage(static_cast<size_t>(layout.latentPageBytes()), 0xAB);
  std::vector<uint8_t> indexPage(static_cast<size_t>(layout.indexPageBytes()), 0xCD);
  for (int64_t t : {0, 5, 15}) {
    const auto latent = randomValues(64, rng, 3.0f), rope = randomValues(32, rng, 1.0f);
    const auto key = randomValues(64, rng, 0.5f);
    ASSERT_TRUE(packLatentToken(layout, latentPage, t, latent, rope));
    ASSERT_TRUE(packIndexKeyToken(layout, indexPage, t, key));

    std::vector<uint8_t> row(static_cast<size_t>(layout.latentRowBytes()));
    ASSERT_TRUE(packFp8KvRow(latent, rope, row, layout.tile));
    EXPECT_TRUE(std::equal(row.begin(), row.end(), latentPage.begin() + layout.latentRowOffset(t)));
    std::vector<uint8_t> keyRow(static_cast<size_t>(indexKeyBytes(64)));
    ASSERT_TRUE(packFp8IndexKey(key, keyRow));
    EXPECT_TRUE(std::equal(keyRow.begin(), keyRow.begin() + 64,
                           indexPage.begin() + layout.indexCodesOffset(t)));
    EXPECT_TRUE(std::equal(keyRow.begin() + 64, keyRow.end(),
                           indexPage.begin() + layout.indexScaleOffset(t)));

    std::vector<float> latentBack(64), ropeBack(32), keyBack(64), latentRef(64), ropeRef(32),
        keyRef(64);
    ASSERT_TRUE(unpackLatentToken(layout, latentPage, t, latentBack, ropeBack));
    ASSERT_TRUE(unpackFp8KvRow(row, latentRef, ropeRef, layout.tile));
    EXPECT_EQ(latentBack, latentRef);
    EXPECT_EQ(ropeBack, ropeRef);
    ASSERT_TRUE(unpackIndexKeyToken(layout, indexPage, t, keyBack));
    ASSERT_TRUE(unpackFp8IndexKey(keyRow, keyRef));
    EXPECT_EQ(keyBack, keyRef);
  }
  // Slot 1 was never written: still the fill bytes, in both pages.
  EXPECT_TRUE(std::all_of(latentPage.begin() + layout.latentRowOffset(1),
                          latentPage.begin() + layout.latentRowOffset(2),
                          [](uint8_t b) { return b == 0xAB; }));
  EXPECT_EQ(indexPage[static_cast<size_t>(layout.indexCodesOffset(1))], 0xCD);
  EXPECT_EQ(indexPage[static_cast<size_t>(layout.indexScaleOffset(1))], 0xCD);
}

// A sequence whose pages are scattered over a pool: every position maps to its page and slot.
// The other key formats: MXFP8 (codes, then indexDim / 32 E8M0 bytes per key; the cpu device's
// keys under the default policy) and plain fp32 (the unquantized policy).
TEST(PagedCacheLayout, IndexKeyFormats) {
  PagedCacheLayout mx{64, 512, 64, 128, 128, IndexKeyFormat::Mxfp8};
  EXPECT_TRUE(mx.valid());
  EXPECT_EQ(mx.indexPageBytes(), 64 * (128 + 4));
  EXPECT_EQ(mx.indexScaleOffset(3), 64 * 128 + 3 * 4);
  PagedCacheLayout tinyMx{64, 64, 32, 128, 64, IndexKeyFormat::Mxfp8};
  EXPECT_TRUE(tinyMx.valid());
  EXPECT_EQ(tinyMx.indexPageBytes(), 64 * (64 + 2));
  EXPECT_FALSE((PagedCacheLayout{64, 64, 32, 128, 48, IndexKeyFormat::Mxfp8}.valid()));
  PagedCacheLayout plain{16, 64, 32, 128, 64, IndexKeyFormat::F32};
  EXPECT_TRUE(plain.valid());
  EXPECT_EQ(plain.indexPageBytes(), 16 * 64 * 4);
  EXPECT_EQ(plain.indexCodesOffset(2), 2 * 64 * 4);

  std::mt19937 rng(8);
  const auto key = randomValues(64, rng, 0.7f);
  // MXFP8: the codes and scales of quantizeMxfp8 (RoundUp), the values of dequantizeMxfp8.
  std::vector<uint8_t> page(static_cast<size_t>(tinyMx.indexPageBytes()), 0);
  ASSERT_TRUE(packIndexKeyToken(tinyMx, page, 7, key));
  std::vector<uint8_t> codes(64), scales(2);
  ASSERT_TRUE(quantizeMxfp8(key, 1, 64, codes, scales, MxScaleRule::RoundUp));
  EXPECT_TRUE(std::equal(codes.begin(), codes.end(), page.begin() + tinyMx.indexCodesOffset(7)));
  EXPECT_TRUE(std::equal(scales.begin(), scales.end(), page.begin() + tinyMx.indexScaleOffset(7)));
  std::vector<float> expected(64), unpacked(64);
  ASSERT_TRUE(dequantizeMxfp8(codes, scales, 1, 64, expected));
  ASSERT_TRUE(unpackIndexKeyToken(tinyMx, page, 7, unpacked));
  EXPECT_EQ(unpacked, expected);
  // fp32: the values themselves.
  std::vector<uint8_t> plainPage(static_cast<size_t>(plain.indexPageBytes()), 0);
  ASSERT_TRUE(packIndexKeyToken(plain, plainPage, 15, key));
  ASSERT_TRUE(unpackIndexKeyToken(plain, plainPage, 15, unpacked));
  EXPECT_EQ(unpacked, key);
}

TEST(PagedCacheLayout, BlockTablesMapPositionsToScatteredPages) {
  const PagedCacheLayout layout{16, 64, 32, 128, 64};
  const std::vector<int32_t> blockTable = {7, 2, 5};
  const int64_t pageBytes = layout.latentPageBytes();
  for (int64_t position : {0, 15, 16, 31, 47}) {
    const PagedSlot where = pagedSlot(blockTable, layout.pageTokens, pageBytes, position);
    EXPECT_EQ(where.pageOffset, blockTable[static_cast<size_t>(position / 16)] * pageBytes);
    EXPECT_EQ(where.slot, position % 16);
  }
  EXPECT_EQ(pagedSlot(blockTable, 16, pageBytes, 48).pageOffset, -1); // past the table
  EXPECT_EQ(pagedSlot(blockTable, 16, pageBytes, -1).pageOffset, -1);
  const std::vector<int32_t> freed = {3, -1};
  EXPECT_EQ(pagedSlot(freed, 16, pageBytes, 20).pageOffset, -1); // an unmapped page
}

TEST(PagedCacheLayout, RefusedArgumentsWriteNothing) {
  const PagedCacheLayout layout{16, 64, 32, 128, 64};
  std::vector<uint8_t> page(static_cast<size_t>(layout.latentPageBytes()), 0x11);
  const std::vector<uint8_t> before = page;
  const std::vector<float> latent(64, 1.0f), rope(32, 1.0f), shortLatent(63, 1.0f);
  EXPECT_FALSE(packLatentToken(layout, page, 16, latent, rope));  // slot past the page
  EXPECT_FALSE(packLatentToken(layout, page, -1, latent, rope));
  EXPECT_FALSE(packLatentToken(layout, page, 0, shortLatent, rope));
  EXPECT_FALSE(packLatentToken(layout, std::span(page).first(page.size() - 1), 0, latent, rope));
  std::vector<uint8_t> indexPage(static_cast<size_t>(layout.indexPageBytes()), 0x22);
  const std::vector<uint8_t> indexBefore = indexPage;
  EXPECT_FALSE(packIndexKeyToken(layout, indexPage, 0, std::vector<float>(65, 1.0f)));
  EXPECT_FALSE(packIndexKeyToken(PagedCacheLayout{3, 64, 32, 128, 64}, indexPage, 0, latent));
  EXPECT_EQ(page, before);
  EXPECT_EQ(indexPage, indexBefore);
}

} // namespace
} // namespace hybrid::kernels::ref
