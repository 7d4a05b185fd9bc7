// Tests of the host memory structures: arena views, the paged KV cache (appends across page
// boundaries, shared page tables, running out of pages, truncation) and the recurrent state pool
// (zeroed slots, snapshot / restore). Cache specs are built with the FlatBuffers builder.
#include "hybrid/runtime/Memory.h"

#include <gtest/gtest.h>
#include <numeric>
#include <string>
#include <vector>

namespace hybrid {
namespace {

using namespace plan::fb;

#define EXPECT_CONTAINS(text, part)                                                                \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "message: " << (text)

struct KvLayerSpec {
  int32_t latentDim;
  int32_t ropeDim;
  int32_t indexKeyDim;
  DType dtype = DType::F32;
};

struct RecurrentLayerSpec {
  int32_t numHeads;
  int32_t headKDim;
  int32_t headVDim;
  int32_t convChannels;
  int32_t convKernel;
};

// Owns the buffer a CacheSpec table lives in.
class CacheSpecBuffer {
public:
  CacheSpecBuffer(int32_t pageSize, const std::vector<KvLayerSpec> &kvLayers,
                  const std::vector<RecurrentLayerSpec> &recurrentLayers) {
    std::vector<flatbuffers::Offset<KvCacheLayer>> kv;
    for (size_t i = 0; i < kvLayers.size(); ++i)
      kv.push_back(CreateKvCacheLayer(builder_, static_cast<int32_t>(i), kvLayers[i].latentDim,
                                      kvLayers[i].ropeDim, kvLayers[i].dtype,
                                      kvLayers[i].indexKeyDim));
    std::vector<flatbuffers::Offset<RecurrentStateLayer>> recurrent;
    for (size_t i = 0; i < recurrentLayers.size(); ++i) {
      const RecurrentLayerSpec &layer = recurrentLayers[i];
      recurrent.push_back(CreateRecurrentStateLayer(
          builder_, static_cast<int32_t>(i), layer.numHeads, layer.headKDim, layer.headVDim,
          StateLayout::KMajor, layer.convChannels, layer.convKernel));
    }
    builder_.Finish(CreateCacheSpecDirect(builder_, pageSize, &kv, &recurrent));
  }
  const CacheSpec &spec() const {
    return *flatbuffers::GetRoot<CacheSpec>(builder_.GetBufferPointer());
  }

private:
  flatbuffers::FlatBufferBuilder builder_;
};

// Rows whose values encode (layer, position, element), so any misplaced row is caught.
std::vector<float> rowsFor(int layer, int64_t firstPosition, int64_t count, int64_t rowElements) {
  std::vector<float> rows;
  for (int64_t position = firstPosition; position < firstPosition + count; ++position)
    for (int64_t element = 0; element < rowElements; ++element)
      rows.push_back(static_cast<float>(layer * 10000 + position * 100 + element));
  return rows;
}

//===------------------------------------------------------------------------------------------===//
// Arena.
//===------------------------------------------------------------------------------------------===//

TEST(Arena, AlignedZeroedAndBoundsChecked) {
  StatusOr<Arena> created = Arena::create(1000);
  ASSERT_TRUE(created.isOk()) << created.status().message();
  Arena arena = std::move(created).value();
  EXPECT_EQ(arena.size(), 1000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(arena.data()) % Arena::kAlignment, 0u);
  for (uint64_t i = 0; i < arena.size(); ++i)
    ASSERT_EQ(arena.data()[i], std::byte{0});

  StatusOr<std::span<float>> floats = arena.viewAs<float>(64, 10);
  ASSERT_TRUE(floats.isOk());
  (*floats)[9] = 3.5f;
  EXPECT_EQ(arena.viewAs<float>(64, 10).value()[9], 3.5f);
  EXPECT_TRUE(arena.view(0, 1000).isOk());
  EXPECT_TRUE(arena.view(1000, 0).isOk());

  EXPECT_CONTAINS(arena.view(990, 11).status().message(), "leaves the 1000-byte arena");
  EXPECT_FALSE(arena.view(~uint64_t{0}, 2).isOk()); // offset + size overflows
  EXPECT_CONTAINS(arena.viewAs<float>(66, 1).status().message(), "not aligned");
  EXPECT_FALSE(arena.viewAs<double>(0, ~uint64_t{0} / 4).isOk());

  arena.clear();
  EXPECT_EQ(arena.viewAs<float>(64, 10).value()[9], 0.0f);

  Arena moved = std::move(arena);
  EXPECT_EQ(moved.size(), 1000u);
  EXPECT_EQ(arena.size(), 0u); // NOLINT(bugprone-use-after-move): moved-from is empty
}

TEST(Arena, EmptyAndHuge) {
  StatusOr<Arena> empty = Arena::create(0);
  ASSERT_TRUE(empty.isOk());
  EXPECT_EQ(empty->size(), 0u);
  EXPECT_TRUE(empty->view(0, 0).isOk());
  EXPECT_FALSE(empty->view(0, 1).isOk());
#ifndef __SANITIZE_ADDRESS__ // ASan aborts on absurd sizes unless allocator_may_return_null=1
  // Far beyond any machine: a clean error, not an exception or a crash.
  StatusOr<Arena> huge = Arena::create(uint64_t{1} << 62);
  ASSERT_FALSE(huge.isOk());
  EXPECT_CONTAINS(huge.status().message(), "cannot allocate");
#endif
}

//===------------------------------------------------------------------------------------------===//
// PagedKvCache.
//===------------------------------------------------------------------------------------------===//

// Two layers: an MLA layer (latent 3 + rope 2) and an MLA+DSA layer (latent 2 + rope 1 + index
// key 2); pages of 4 tokens.
CacheSpecBuffer twoLayerKvSpec() { return CacheSpecBuffer(4, {{3, 2, 0}, {2, 1, 2}}, {}); }

TEST(PagedKvCache, ShapesAndSizesComeFromTheSpec) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  StatusOr<PagedKvCache> cache = PagedKvCache::create(spec.spec(), 5, 3);
  ASSERT_TRUE(cache.isOk()) << cache.status().message();
  EXPECT_EQ(cache->numLayers(), 2);
  EXPECT_EQ(cache->pageSize(), 4);
  EXPECT_EQ(cache->numPages(), 5);
  EXPECT_EQ(cache->freePages(), 5);
  EXPECT_EQ(cache->layerShape(0).rowElements(), 5);
  EXPECT_EQ(cache->layerShape(1).rowElements(), 5);
  EXPECT_EQ(cache->layerShape(1).indexKeyDim, 2);
  // 4 tokens x (5 + 5) floats x 4 bytes.
  EXPECT_EQ(PagedKvCache::bytesPerPage(spec.spec()).value(), 160u);
}

TEST(PagedKvCache, AppendAndViewAcrossPageBoundaries) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 8, 2).value();
  const int64_t rowElements = cache.layerShape(0).rowElements();

  // Interleave two sequences so their pages are not contiguous.
  ASSERT_TRUE(cache.append(0, 0, rowsFor(0, 0, 3, rowElements)).isOk());
  ASSERT_TRUE(cache.append(0, 1, rowsFor(7, 0, 5, rowElements)).isOk());
  ASSERT_TRUE(cache.append(0, 0, rowsFor(0, 3, 6, rowElements)).isOk()); // crosses two boundaries
  EXPECT_EQ(cache.length(0, 0), 9);
  EXPECT_EQ(cache.length(1, 0), 0); // layer 1 has not appended yet
  EXPECT_EQ(cache.capacity(0), 12);
  EXPECT_EQ(cache.freePages(), 8 - 3 - 2);

  StatusOr<KvSequenceView> view = cache.view(0, 0, 9);
  ASSERT_TRUE(view.isOk()) << view.status().message();
  EXPECT_EQ(view->numTokens(), 9);
  std::vector<float> expected = rowsFor(0, 0, 9, rowElements);
  for (int64_t position = 0; position < 9; ++position) {
    std::span<const float> row = view->row(position);
    ASSERT_EQ(row.size(), static_cast<size_t>(rowElements));
    for (int64_t element = 0; element < rowElements; ++element)
      EXPECT_EQ(row[element], expected[position * rowElements + element]);
    EXPECT_EQ(view->latent(position).size(), 3u);
    EXPECT_EQ(view->ropeKey(position)[0], expected[position * rowElements + 3]);
    EXPECT_TRUE(view->indexKey(position).empty());
  }
  EXPECT_TRUE(view->row(9).empty());

  std::vector<float> gathered(9 * rowElements);
  ASSERT_TRUE(view->gatherRows(gathered).isOk());
  EXPECT_EQ(gathered, expected);
  std::vector<float> ropeKeys(9 * 2);
  ASSERT_TRUE(view->gatherRopeKeys(ropeKeys).isOk());
  EXPECT_EQ(ropeKeys[2 * 5 + 1], expected[5 * rowElements + 4]);
  std::vector<float> wrongSize(7);
  EXPECT_CONTAINS(view->gatherLatents(wrongSize).message(), "9 tokens x 3 need 27");

  // The other sequence is untouched; a prefix view works.
  StatusOr<KvSequenceView> other = cache.view(0, 1, 2);
  ASSERT_TRUE(other.isOk());
  EXPECT_EQ(other->row(1)[0], rowsFor(7, 1, 1, rowElements)[0]);
}

TEST(PagedKvCache, LayersShareTheSequencePageTable) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 4, 1).value();
  ASSERT_TRUE(cache.append(0, 0, rowsFor(0, 0, 6, 5)).isOk());
  EXPECT_EQ(cache.freePages(), 2);
  ASSERT_TRUE(cache.append(1, 0, rowsFor(1, 0, 6, 5)).isOk());
  EXPECT_EQ(cache.freePages(), 2) << "layer 1 must reuse the pages layer 0 reserved";

  StatusOr<KvSequenceView> layer1 = cache.view(1, 0, 6);
  ASSERT_TRUE(layer1.isOk());
  std::vector<float> indexKeys(6 * 2);
  ASSERT_TRUE(layer1->gatherIndexKeys(indexKeys).isOk());
  EXPECT_EQ(indexKeys[5 * 2 + 1], rowsFor(1, 5, 1, 5)[4]);
  // Layer 0's rows were not overwritten by layer 1's.
  EXPECT_EQ(cache.view(0, 0, 6).value().row(5)[0], rowsFor(0, 5, 1, 5)[0]);
}

TEST(PagedKvCache, OutOfPagesFailsCleanly) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 3, 2).value();
  ASSERT_TRUE(cache.reserve(0, 8).isOk());
  EXPECT_EQ(cache.freePages(), 1);

  Status status = cache.reserve(1, 9);
  ASSERT_FALSE(status.isOk());
  EXPECT_EQ(status.message(), "KV cache out of pages: sequence 1 needs 3 more pages of 4 tokens "
                              "for 9 tokens, 1 of 3 pages are free");
  // A capacity error (a scheduler preempts and retries), and it stays one with context added.
  EXPECT_TRUE(status.isExhausted());
  EXPECT_TRUE(Status(status).withContext("MLA (layer 3)").isExhausted());
  EXPECT_FALSE(cache.reserve(7, 1).isExhausted()) << "a bad sequence is not a capacity error";
  EXPECT_EQ(cache.freePages(), 1) << "a failed reserve must not keep partial pages";
  EXPECT_EQ(cache.capacity(1), 0);

  // An append that does not fit leaves the length unchanged.
  Status append = cache.append(0, 1, rowsFor(0, 0, 5, 5));
  EXPECT_CONTAINS(append.message(), "out of pages");
  EXPECT_TRUE(append.isExhausted());
  EXPECT_EQ(cache.length(0, 1), 0);
  EXPECT_TRUE(cache.append(0, 1, rowsFor(0, 0, 4, 5)).isOk());
  EXPECT_EQ(cache.freePages(), 0);
}

TEST(PagedKvCache, TruncateAndFreeReturnPages) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 4, 2).value();
  ASSERT_TRUE(cache.append(0, 0, rowsFor(0, 0, 10, 5)).isOk());
  ASSERT_TRUE(cache.append(1, 0, rowsFor(1, 0, 10, 5)).isOk());
  EXPECT_EQ(cache.freePages(), 1);

  // Speculative-decoding rollback: keep 5 tokens.
  ASSERT_TRUE(cache.truncate(0, 5).isOk());
  EXPECT_EQ(cache.length(0, 0), 5);
  EXPECT_EQ(cache.length(1, 0), 5);
  EXPECT_EQ(cache.freePages(), 2);
  ASSERT_TRUE(cache.append(0, 0, rowsFor(3, 5, 2, 5)).isOk());
  EXPECT_EQ(cache.view(0, 0, 7).value().row(6)[0], rowsFor(3, 6, 1, 5)[0]);
  EXPECT_EQ(cache.view(0, 0, 7).value().row(4)[0], rowsFor(0, 4, 1, 5)[0]);

  ASSERT_TRUE(cache.freeSequence(0).isOk());
  EXPECT_EQ(cache.freePages(), 4);
  EXPECT_EQ(cache.length(0, 0), 0);
  EXPECT_EQ(cache.capacity(0), 0);
  // The freed pages serve another sequence.
  EXPECT_TRUE(cache.reserve(1, 16).isOk());
}

// The rows of positions [0, tokens) of layer kvSlot of a sequence, gathered.
std::vector<float> gatheredRows(const PagedKvCache &cache, int32_t kvSlot, int32_t sequence,
                                int64_t tokens) {
  std::vector<float> rows(static_cast<size_t>(tokens * cache.layerShape(kvSlot).rowElements()));
  EXPECT_TRUE(cache.view(kvSlot, sequence, tokens).value().gatherRows(rows).isOk());
  return rows;
}

// `tokens` rows of `sequence` in both layers (values rowsFor(layer, ...)).
void fillBothLayers(PagedKvCache &cache, int32_t sequence, int64_t tokens) {
  ASSERT_TRUE(cache.append(0, sequence, rowsFor(0, 0, tokens, 5)).isOk());
  ASSERT_TRUE(cache.append(1, sequence, rowsFor(1, 0, tokens, 5)).isOk());
}

TEST(PagedKvCache, ForkSharesFullPagesAndCopiesThePartialOne) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 8, 3).value();
  fillBothLayers(cache, 0, 10); // pages of 4 tokens: 2 full, 1 partial
  ASSERT_EQ(cache.freePages(), 5);

  ASSERT_TRUE(cache.fork(0, 1, 10).isOk());
  EXPECT_EQ(cache.freePages(), 4) << "only the partial page is copied";
  EXPECT_EQ(cache.length(0, 1), 10);
  EXPECT_EQ(cache.length(1, 1), 10);
  for (int32_t kvSlot : {0, 1})
    EXPECT_EQ(gatheredRows(cache, kvSlot, 1, 10), rowsFor(kvSlot, 0, 10, 5));
  const int32_t sharedPage = cache.view(0, 0, 1).value().row(0).data() ==
                                     cache.view(0, 1, 1).value().row(0).data()
                                 ? 1
                                 : 0;
  EXPECT_EQ(sharedPage, 1) << "full pages are shared, not copied";

  // Each side appends its own continuation; neither sees the other's.
  ASSERT_TRUE(cache.append(0, 1, rowsFor(5, 10, 2, 5)).isOk());
  ASSERT_TRUE(cache.append(0, 0, rowsFor(0, 10, 2, 5)).isOk());
  EXPECT_EQ(gatheredRows(cache, 0, 0, 12), rowsFor(0, 0, 12, 5));
  std::vector<float> forked = rowsFor(0, 0, 10, 5), continuation = rowsFor(5, 10, 2, 5);
  forked.insert(forked.end(), continuation.begin(), continuation.end());
  EXPECT_EQ(gatheredRows(cache, 0, 1, 12), forked);

  // A fork of a fork, and a shorter prefix (a prefix-cache hit that ends mid-page).
  ASSERT_TRUE(cache.fork(1, 2, 6).isOk());
  EXPECT_EQ(gatheredRows(cache, 1, 2, 6), rowsFor(1, 0, 6, 5));
}

TEST(PagedKvCache, WritingIntoASharedPageCopiesItFirst) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 6, 2).value();
  fillBothLayers(cache, 0, 8);
  ASSERT_TRUE(cache.fork(0, 1, 8).isOk());
  EXPECT_EQ(cache.freePages(), 4) << "two full pages, nothing copied";

  // Roll the fork back into its second page, then write there: that page is copied first.
  ASSERT_TRUE(cache.truncate(1, 6).isOk());
  EXPECT_EQ(cache.freePages(), 4);
  ASSERT_TRUE(cache.append(0, 1, rowsFor(7, 6, 2, 5)).isOk());
  EXPECT_EQ(cache.freePages(), 3);
  EXPECT_EQ(gatheredRows(cache, 0, 0, 8), rowsFor(0, 0, 8, 5)) << "the source is untouched";
  std::vector<float> expected = rowsFor(0, 0, 6, 5), written = rowsFor(7, 6, 2, 5);
  expected.insert(expected.end(), written.begin(), written.end());
  EXPECT_EQ(gatheredRows(cache, 0, 1, 8), expected);
  // The copy carried layer 1's rows too (the page table is shared by the layers).
  EXPECT_EQ(gatheredRows(cache, 1, 1, 6), rowsFor(1, 0, 6, 5));
}

// What a device mirror of the pages (the cuda device's KV pools) relies on: prepareWrite makes
// the positions' pages exclusive before anything is written, advance grows a layer without host
// rows, and every page copy the cache makes is reported in order, so that repeating the copies
// on a mirror keeps it equal to the host pages.
TEST(PagedKvCache, DeviceMirrorsSeeEveryPageCopy) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 8, 3).value();
  cache.recordPageCopies(true);
  fillBothLayers(cache, 0, 6); // pages 0 and 1 (partial)
  EXPECT_TRUE(cache.takePageCopies().empty()) << "fresh pages are not copies";
  ASSERT_EQ(cache.pageTable(0).size(), 2u);
  EXPECT_TRUE(cache.pageTable(7).empty());

  ASSERT_TRUE(cache.fork(0, 1, 6).isOk()); // shares page 0, copies the partial page 1
  std::vector<PagedKvCache::PageCopy> copies = cache.takePageCopies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].from, cache.pageTable(0)[1]);
  EXPECT_EQ(copies[0].to, cache.pageTable(1)[1]);
  EXPECT_EQ(copies[0].rows, 2);
  EXPECT_TRUE(cache.takePageCopies().empty()) << "taking them empties the log";

  // Sequence 1 rewinds into the shared page 0 and writes there: prepareWrite copies it first.
  ASSERT_TRUE(cache.truncate(1, 3).isOk());
  const int32_t shared = cache.pageTable(1)[0];
  ASSERT_EQ(cache.pageReferences(shared), 2);
  ASSERT_TRUE(cache.prepareWrite(1, 3, 2).isOk());
  copies = cache.takePageCopies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].from, shared);
  EXPECT_EQ(copies[0].to, cache.pageTable(1)[0]);
  EXPECT_NE(cache.pageTable(1)[0], shared);
  EXPECT_EQ(cache.pageReferences(shared), 1);
  EXPECT_EQ(cache.length(0, 1), 3) << "prepareWrite grows no layer";

  // advance grows one layer; the pages are already exclusive, so nothing more is copied.
  ASSERT_TRUE(cache.advance(0, 1, 2).isOk());
  EXPECT_EQ(cache.length(0, 1), 5);
  EXPECT_EQ(cache.length(1, 1), 3);
  EXPECT_TRUE(cache.takePageCopies().empty());
  // Past the reserved pages it reserves more; a bad slot or sequence is an error.
  ASSERT_TRUE(cache.advance(1, 1, 6).isOk());
  EXPECT_EQ(cache.capacity(1), 12);
  EXPECT_FALSE(cache.advance(2, 1, 1).isOk());
  EXPECT_FALSE(cache.advance(0, 5, 1).isOk());
  EXPECT_FALSE(cache.prepareWrite(1, -1, 1).isOk());

  // Without recording nothing is kept.
  cache.recordPageCopies(false);
  ASSERT_TRUE(cache.fork(0, 2, 6).isOk());
  EXPECT_TRUE(cache.takePageCopies().empty());
}

TEST(PagedKvCache, PagesReturnWhenTheLastSharerLetsGo) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 4, 2).value();
  fillBothLayers(cache, 0, 8);
  ASSERT_TRUE(cache.fork(0, 1, 8).isOk());
  const int32_t unusedPage = 3; // pages are taken from 0 up: sequence 0 holds 0 and 1
  EXPECT_EQ(cache.pageReferences(0), 2);
  EXPECT_EQ(cache.pageReferences(unusedPage), 0);
  EXPECT_EQ(cache.pageReferences(-1), 0);

  ASSERT_TRUE(cache.freeSequence(0).isOk());
  EXPECT_EQ(cache.freePages(), 2) << "sequence 1 still holds both pages";
  EXPECT_EQ(cache.pageReferences(0), 1);
  EXPECT_EQ(gatheredRows(cache, 1, 1, 8), rowsFor(1, 0, 8, 5));
  ASSERT_TRUE(cache.freeSequence(1).isOk());
  EXPECT_EQ(cache.freePages(), 4);
  EXPECT_EQ(cache.pageReferences(0), 0);
}

TEST(PagedKvCache, ForkAndCopyFailuresChangeNothing) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 3, 3).value();
  fillBothLayers(cache, 0, 6);
  ASSERT_TRUE(cache.append(0, 2, rowsFor(0, 0, 1, 5)).isOk());
  EXPECT_EQ(cache.freePages(), 0);

  EXPECT_EQ(cache.fork(0, 0, 4).message(), "KV cache: cannot fork sequence 0 into itself");
  EXPECT_EQ(cache.fork(0, 2, 4).message(),
            "KV cache: cannot fork into sequence 2, which holds 1 pages (free it first)");
  EXPECT_EQ(cache.fork(0, 1, 7).message(),
            "KV cache: cannot take 7 tokens of sequence 0: kv_slot 0 holds 6");
  EXPECT_CONTAINS(cache.fork(0, 5, 4).message(), "sequence 5 is out of range");
  EXPECT_EQ(cache.fork(0, 1, 6).message(),
            "KV cache out of pages: taking 6 tokens of sequence 0 copies its partial last page, "
            "and none of the 3 pages is free");
  EXPECT_EQ(cache.capacity(1), 0);
  EXPECT_EQ(cache.length(0, 1), 0);

  // A fork at the page boundary needs no free page; writing into the shared page then does.
  ASSERT_TRUE(cache.fork(0, 1, 4).isOk());
  ASSERT_TRUE(cache.truncate(1, 3).isOk());
  EXPECT_EQ(cache.append(0, 1, rowsFor(9, 3, 1, 5)).message(),
            "KV cache out of pages: sequence 1 needs 0 new pages and copies of 1 pages it "
            "shares, 0 of 3 pages are free");
  EXPECT_EQ(cache.length(0, 1), 3);
  EXPECT_EQ(cache.freePages(), 0);
  EXPECT_EQ(gatheredRows(cache, 0, 0, 6), rowsFor(0, 0, 6, 5));
  ASSERT_TRUE(cache.freeSequence(2).isOk());
  ASSERT_TRUE(cache.append(0, 1, rowsFor(9, 3, 1, 5)).isOk()) << "now one page is free to copy";
  EXPECT_EQ(gatheredRows(cache, 0, 0, 6), rowsFor(0, 0, 6, 5));
}

TEST(PagedKvCache, HeldPrefixesOutliveTheirSequence) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 6, 2).value();
  fillBothLayers(cache, 0, 10);
  StatusOr<KvPrefix> prefix = cache.holdPrefix(0, 6); // one full page, a partial one copied
  ASSERT_TRUE(prefix.isOk()) << prefix.status().message();
  EXPECT_EQ(prefix->tokens, 6);
  ASSERT_EQ(prefix->pages.size(), 2u);
  EXPECT_EQ(cache.freePages(), 2);
  ASSERT_TRUE(cache.freeSequence(0).isOk());
  EXPECT_EQ(cache.freePages(), 4) << "the prefix still holds its two pages";

  // Two sequences take the prefix; each writes its own continuation into the shared last page.
  ASSERT_TRUE(cache.adoptPrefix(0, *prefix).isOk());
  ASSERT_TRUE(cache.adoptPrefix(1, *prefix).isOk());
  ASSERT_TRUE(cache.append(0, 0, rowsFor(4, 6, 1, 5)).isOk());
  ASSERT_TRUE(cache.append(0, 1, rowsFor(5, 6, 1, 5)).isOk());
  EXPECT_EQ(cache.view(0, 0, 7).value().row(6)[0], rowsFor(4, 6, 1, 5)[0]);
  EXPECT_EQ(cache.view(0, 1, 7).value().row(6)[0], rowsFor(5, 6, 1, 5)[0]);
  for (int32_t sequence : {0, 1})
    for (int32_t kvSlot : {0, 1})
      EXPECT_EQ(gatheredRows(cache, kvSlot, sequence, 6), rowsFor(kvSlot, 0, 6, 5));

  EXPECT_CONTAINS(cache.adoptPrefix(0, *prefix).message(), "only an empty sequence");
  KvPrefix forged{{5}, 3};
  EXPECT_EQ(cache.adoptPrefix(0, forged).message(), "KV cache: sequence 0 holds 2 pages; only an "
                                                    "empty sequence takes a prefix (free it first)");
  ASSERT_TRUE(cache.freeSequence(0).isOk());
  EXPECT_EQ(cache.adoptPrefix(0, forged).message(), "KV cache: prefix page 5 is not a held page");
  EXPECT_EQ(cache.adoptPrefix(0, KvPrefix{{}, 3}).message(),
            "KV cache: a prefix of 3 tokens with 0 pages");

  ASSERT_TRUE(cache.freeSequence(1).isOk());
  cache.releasePrefix(*prefix);
  EXPECT_TRUE(prefix->pages.empty());
  EXPECT_EQ(cache.freePages(), 6);
}

TEST(PagedKvCache, BadArgumentsAreErrors) {
  CacheSpecBuffer spec = twoLayerKvSpec();
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 2, 2).value();
  EXPECT_CONTAINS(cache.append(2, 0, rowsFor(0, 0, 1, 5)).message(), "kv_slot 2 is out of range");
  EXPECT_CONTAINS(cache.append(0, 2, rowsFor(0, 0, 1, 5)).message(), "sequence 2 is out of range");
  EXPECT_CONTAINS(cache.append(0, 0, std::vector<float>(7)).message(), "not a multiple");
  EXPECT_CONTAINS(cache.view(0, 0, 1).status().message(), "which holds 0");
  EXPECT_FALSE(cache.reserve(0, -1).isOk());
  EXPECT_FALSE(cache.truncate(-1, 0).isOk());
  EXPECT_EQ(cache.length(5, 0), 0);

  EXPECT_FALSE(PagedKvCache::create(spec.spec(), -1, 1).isOk());
  EXPECT_FALSE(PagedKvCache::create(spec.spec(), 1, 0).isOk());
  CacheSpecBuffer bf16(4, {{3, 2, 0, DType::BF16}}, {});
  EXPECT_CONTAINS(PagedKvCache::create(bf16.spec(), 1, 1).status().message(),
                  "cache.kv[0].dtype is BF16; the cpu KV cache stores F32");
  CacheSpecBuffer noPageSize(0, {{3, 2, 0}}, {});
  EXPECT_CONTAINS(PagedKvCache::create(noPageSize.spec(), 1, 1).status().message(),
                  "cache.page_size = 0");
  CacheSpecBuffer huge(1 << 30, {{1 << 30, 1 << 30, 0}}, {});
  EXPECT_CONTAINS(PagedKvCache::create(huge.spec(), 1 << 30, 1).status().message(), "overflows");
}

TEST(PagedKvCache, NoKvLayersNeedsNoPages) {
  CacheSpecBuffer spec(0, {}, {});
  PagedKvCache cache = PagedKvCache::create(spec.spec(), 0, 1).value();
  EXPECT_EQ(cache.numLayers(), 0);
  EXPECT_TRUE(cache.reserve(0, 1000).isOk());
  EXPECT_EQ(PagedKvCache::bytesPerPage(spec.spec()).value(), 0u);
}

//===------------------------------------------------------------------------------------------===//
// RecurrentStatePool.
//===------------------------------------------------------------------------------------------===//

// Two KDA layers: 2 heads x 4 x 4 with a 24-channel, kernel-4 conv; 1 head x 3 x 5 with kernel 1
// (no conv state).
CacheSpecBuffer twoLayerStateSpec() {
  return CacheSpecBuffer(16, {}, {{2, 4, 4, 24, 4}, {1, 3, 5, 6, 1}});
}

TEST(RecurrentStatePool, SlotsStartZeroed) {
  CacheSpecBuffer spec = twoLayerStateSpec();
  StatusOr<RecurrentStatePool> created = RecurrentStatePool::create(spec.spec(), 2);
  ASSERT_TRUE(created.isOk()) << created.status().message();
  RecurrentStatePool pool = std::move(created).value();
  EXPECT_EQ(pool.numLayers(), 2);
  EXPECT_EQ(pool.layerShape(0).stateElements(), 32);
  EXPECT_EQ(pool.layerShape(0).convStateElements(), 72);
  EXPECT_EQ(pool.layerShape(1).convStateElements(), 0);

  int32_t slot = pool.allocate().value();
  EXPECT_TRUE(pool.isAllocated(slot));
  std::span<float> state = pool.state(0, slot).value();
  std::span<float> conv = pool.convState(0, slot).value();
  ASSERT_EQ(state.size(), 32u);
  ASSERT_EQ(conv.size(), 72u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(state.data()) % Arena::kAlignment, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(conv.data()) % Arena::kAlignment, 0u);
  for (float value : state)
    ASSERT_EQ(value, 0.0f);
  for (float value : conv)
    ASSERT_EQ(value, 0.0f);

  // A released slot comes back zeroed for the next sequence.
  std::fill(state.begin(), state.end(), 7.0f);
  std::fill(conv.begin(), conv.end(), 7.0f);
  pool.state(1, slot).value()[14] = 7.0f;
  ASSERT_TRUE(pool.release(slot).isOk());
  EXPECT_FALSE(pool.isAllocated(slot));
  int32_t again = pool.allocate().value();
  EXPECT_EQ(again, slot);
  // Spans kept in locals: a range-for over a temporary StatusOr's value() would dangle.
  std::span<float> stateAgain = pool.state(0, again).value();
  std::span<float> convAgain = pool.convState(0, again).value();
  for (float value : stateAgain)
    ASSERT_EQ(value, 0.0f);
  for (float value : convAgain)
    ASSERT_EQ(value, 0.0f);
  EXPECT_EQ(pool.state(1, again).value()[14], 0.0f);
}

TEST(RecurrentStatePool, SlotsAreIndependentAndLimited) {
  CacheSpecBuffer spec = twoLayerStateSpec();
  RecurrentStatePool pool = RecurrentStatePool::create(spec.spec(), 2).value();
  int32_t first = pool.allocate().value();
  int32_t second = pool.allocate().value();
  EXPECT_NE(first, second);
  EXPECT_EQ(pool.freeSlots(), 0);
  EXPECT_CONTAINS(pool.allocate().status().message(), "all 2 sequence slots are in use");

  std::span<float> a = pool.state(1, first).value();
  std::span<float> b = pool.state(1, second).value();
  std::fill(a.begin(), a.end(), 1.0f);
  EXPECT_EQ(b[0], 0.0f);
  EXPECT_EQ(b[b.size() - 1], 0.0f);

  EXPECT_CONTAINS(pool.state(2, first).status().message(), "state_slot 2 is out of range");
  EXPECT_CONTAINS(pool.state(0, 5).status().message(), "slot 5 is out of range");
  ASSERT_TRUE(pool.release(second).isOk());
  EXPECT_CONTAINS(pool.state(0, second).status().message(), "is not allocated");
  EXPECT_CONTAINS(pool.release(second).message(), "is not allocated");
}

TEST(RecurrentStatePool, SnapshotAndRestore) {
  CacheSpecBuffer spec = twoLayerStateSpec();
  RecurrentStatePool pool = RecurrentStatePool::create(spec.spec(), 2).value();
  int32_t slot = pool.allocate().value();
  auto fill = [&](float base) {
    for (int32_t layer = 0; layer < pool.numLayers(); ++layer) {
      std::span<float> state = pool.state(layer, slot).value();
      std::iota(state.begin(), state.end(), base + 1000.0f * layer);
      std::span<float> conv = pool.convState(layer, slot).value();
      std::iota(conv.begin(), conv.end(), base + 1000.0f * layer + 500.0f);
    }
  };
  fill(1.0f);
  StatusOr<RecurrentStateSnapshot> snapshot = pool.snapshot(slot);
  ASSERT_TRUE(snapshot.isOk());
  fill(-50.0f); // speculative tokens advance the state
  ASSERT_TRUE(pool.restore(slot, *snapshot).isOk());
  EXPECT_EQ(pool.state(0, slot).value()[0], 1.0f);
  EXPECT_EQ(pool.state(1, slot).value()[14], 1015.0f);
  EXPECT_EQ(pool.convState(0, slot).value()[71], 572.0f);

  // A snapshot only fits a pool with the same slot layout.
  CacheSpecBuffer otherSpec(16, {}, {{1, 2, 2, 0, 1}});
  RecurrentStatePool other = RecurrentStatePool::create(otherSpec.spec(), 1).value();
  int32_t otherSlot = other.allocate().value();
  EXPECT_CONTAINS(other.restore(otherSlot, *snapshot).message(), "the snapshot holds");
  EXPECT_FALSE(pool.snapshot(1).isOk()); // not allocated
}

TEST(RecurrentStatePool, SizesAndBadSpecs) {
  CacheSpecBuffer spec = twoLayerStateSpec();
  // Layer 0: 32 state + 72 conv floats padded to 16-float lines: 32 + 80; layer 1: 15 -> 16.
  EXPECT_EQ(RecurrentStatePool::bytesPerSlot(spec.spec()).value(), (32u + 80u + 16u) * 4u);
  EXPECT_FALSE(RecurrentStatePool::create(spec.spec(), 0).isOk());
  CacheSpecBuffer bad(16, {}, {{0, 4, 4, 8, 4}});
  EXPECT_CONTAINS(RecurrentStatePool::create(bad.spec(), 1).status().message(),
                  "cache.recurrent[0]: num_heads 0");
  CacheSpecBuffer huge(16, {}, {{1 << 30, 1 << 30, 1 << 30, 0, 1}});
  EXPECT_CONTAINS(RecurrentStatePool::create(huge.spec(), 1).status().message(), "overflows");
  CacheSpecBuffer none(16, {}, {});
  RecurrentStatePool empty = RecurrentStatePool::create(none.spec(), 3).value();
  EXPECT_EQ(empty.numLayers(), 0);
  EXPECT_TRUE(empty.allocate().isOk());
}

} // namespace
} // namespace hybrid
