// Host-side (cpu device) memory, allocated once when a plan is loaded (DESIGN.md section 1.4):
//   Arena               one aligned allocation; the plan's values are views at planned offsets;
//   PagedKvCache        per-token latents of the MLA / DSA layers (CacheSpec.kv) in fixed pages;
//   RecurrentStatePool  fixed-size KDA state per sequence (CacheSpec.recurrent).
// Every size comes from the plan's CacheSpec; only the capacities (pages, sequence slots) are the
// runtime's choice. These are the CPU reference structures the cuda device mirrors, so they stay
// simple: fp32 everywhere, no CUDA, no threads.
#pragma once

#include "hybrid/runtime/Status.h"
#include "runtime/schema/plan_generated.h"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace hybrid {

//===------------------------------------------------------------------------------------------===//
// Arena.
//===------------------------------------------------------------------------------------------===//

// One zero-initialised allocation aligned to kAlignment bytes, handed out as views by offset.
class Arena {
public:
  static constexpr size_t kAlignment = 64; // a cache line; also enough for any SIMD load

  static StatusOr<Arena> create(uint64_t bytes);

  Arena() = default; // empty
  Arena(Arena &&other) noexcept;
  Arena &operator=(Arena &&other) noexcept;
  Arena(const Arena &) = delete;
  Arena &operator=(const Arena &) = delete;
  ~Arena();

  uint64_t size() const { return size_; }
  std::byte *data() { return data_; }
  const std::byte *data() const { return data_; }

  // Bytes [offset, offset + bytes); an error when the range leaves the arena.
  StatusOr<std::span<std::byte>> view(uint64_t offset, uint64_t bytes);
  // `count` elements of T at `offset`; also an error when offset is not aligned for T.
  template <typename T> StatusOr<std::span<T>> viewAs(uint64_t offset, uint64_t count);
  // Zeroes the whole arena.
  void clear();

private:
  std::byte *data_ = nullptr;
  uint64_t size_ = 0;
};

template <typename T> StatusOr<std::span<T>> Arena::viewAs(uint64_t offset, uint64_t count) {
  if (offset % alignof(T) != 0)
    return Status::error("arena offset " + std::to_string(offset) + " is not aligned to " +
                         std::to_string(alignof(T)) + " bytes");
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(count, sizeof(T), &bytes))
    return Status::error("arena view of " + std::to_string(count) + " elements overflows");
  StatusOr<std::span<std::byte>> raw = view(offset, bytes);
  if (!raw)
    return raw.status();
  return std::span<T>(reinterpret_cast<T *>(raw->data()), count);
}

//===------------------------------------------------------------------------------------------===//
// Paged KV cache.
//===------------------------------------------------------------------------------------------===//

// Per-token row of one KV layer: [latent (latentDim) | rope key (ropeDim) | index key
// (indexKeyDim)], fp32.
struct KvLayerShape {
  int32_t layer = 0; // decoder layer
  int64_t latentDim = 0;
  int64_t ropeDim = 0;
  int64_t indexKeyDim = 0;

  int64_t rowElements() const { return latentDim + ropeDim + indexKeyDim; }
};

// Positions [0, numTokens) of one sequence in one KV layer. Holds a copy of the sequence's page
// list, so it stays valid until the cache itself is destroyed; rows written after it was taken
// are visible, pages freed after it was taken must not be read through it.
class KvSequenceView {
public:
  int64_t numTokens() const { return numTokens_; }
  const KvLayerShape &shape() const { return shape_; }

  // The whole row of `position` (< numTokens()), and its three parts.
  std::span<const float> row(int64_t position) const;
  std::span<const float> latent(int64_t position) const;
  std::span<const float> ropeKey(int64_t position) const;
  std::span<const float> indexKey(int64_t position) const;

  // Copies the rows, or one part of each row, contiguously: out [numTokens, elements]. The
  // reference kernels read contiguous latents / rope keys / index keys.
  Status gatherRows(std::span<float> out) const;
  Status gatherLatents(std::span<float> out) const;
  Status gatherRopeKeys(std::span<float> out) const;
  Status gatherIndexKeys(std::span<float> out) const;

private:
  friend class PagedKvCache;
  Status gather(std::span<float> out, int64_t begin, int64_t count) const;

  KvLayerShape shape_;
  const float *layerStorage_ = nullptr; // page p starts at p * pageSize * rowElements
  std::vector<int32_t> pages_;
  int64_t pageSize_ = 0;
  int64_t numTokens_ = 0;
};

// Positions [0, tokens) of a sequence's KV rows in every layer, held apart from any sequence (a
// prefix-cache entry): its pages count as held until PagedKvCache::releasePrefix.
struct KvPrefix {
  std::vector<int32_t> pages;
  int64_t tokens = 0;
};

// The KV cache of every MLA / DSA layer of CacheSpec.kv (indexed by MlaParams.kv_slot). Memory is
// split into `numPages` pages of CacheSpec.page_size tokens; a sequence (an id in
// [0, maxSequences)) owns a page table that is shared by all layers, so page p of a sequence holds
// the same positions in every layer. Each layer keeps its own length per sequence because layers
// append one after another during a forward pass.
// Pages are reference-counted: fork() gives a sequence the full pages of another's prefix without
// copying them (prefix caching, speculative branches), and a write into a page that another
// sequence still holds first copies it (copy-on-write), so no sequence ever sees another's rows.
class PagedKvCache {
public:
  static StatusOr<PagedKvCache> create(const plan::fb::CacheSpec &spec, int64_t numPages,
                                       int32_t maxSequences);
  // Bytes one page takes over all layers: budget / bytesPerPage = numPages.
  static StatusOr<uint64_t> bytesPerPage(const plan::fb::CacheSpec &spec);

  int32_t numLayers() const { return static_cast<int32_t>(layers_.size()); }
  const KvLayerShape &layerShape(int32_t kvSlot) const { return layers_[kvSlot].shape; }
  int64_t pageSize() const { return pageSize_; }
  int64_t numPages() const { return numPages_; }
  int64_t freePages() const { return static_cast<int64_t>(freePages_.size()); }
  int32_t maxSequences() const { return maxSequences_; }

  // Makes room for positions [0, tokens) of `sequence` in every layer. Allocates only the missing
  // pages; when there are not enough free pages it fails and changes nothing.
  Status reserve(int32_t sequence, int64_t tokens);
  // Writes rows [numRows, rowElements] to layer kvSlot at positions [length, length + numRows),
  // reserving pages as needed.
  Status append(int32_t kvSlot, int32_t sequence, std::span<const float> rows);
  // Makes positions [begin, begin + count) of `sequence` writable in every layer: reserves their
  // pages and copies the ones it shares (copy-on-write). Fails, changing nothing, when there are
  // not enough free pages. append does this itself; a device writing its own mirror of the pages
  // calls it before it writes.
  Status prepareWrite(int32_t sequence, int64_t begin, int64_t count);
  // Layer kvSlot of `sequence` grows by `count` positions whose rows only a device mirror holds
  // (the cuda device's KV pools): as append, without writing the host rows.
  Status advance(int32_t kvSlot, int32_t sequence, int64_t count);
  // Positions written so far to layer kvSlot of `sequence` (0 for a bad index).
  int64_t length(int32_t kvSlot, int32_t sequence) const;
  // The sequence's physical pages in position order (empty for a bad index).
  std::span<const int32_t> pageTable(int32_t sequence) const;
  // A page copy the cache made itself (copy-on-write, a held prefix's partial last page): rows
  // [0, rows) of page `from` went to page `to`. A device mirroring the pages repeats them, in
  // order, before it next writes or reads a page.
  struct PageCopy {
    int32_t from = 0;
    int32_t to = 0;
    int64_t rows = 0;
  };
  void recordPageCopies(bool on) { recordCopies_ = on; }
  std::vector<PageCopy> takePageCopies() { return std::exchange(pageCopies_, {}); }
  // Positions the sequence's pages can hold.
  int64_t capacity(int32_t sequence) const;
  // Positions [0, numTokens) of layer kvSlot; numTokens must not exceed length().
  StatusOr<KvSequenceView> view(int32_t kvSlot, int32_t sequence, int64_t numTokens) const;
  // Positions [0, tokens) of `from` in every layer become those of `to`, which must hold no pages:
  // full pages are shared, a partial last page is copied. tokens must not exceed any layer's
  // length of `from`. Fails, changing nothing, when there is no free page for the copy.
  Status fork(int32_t from, int32_t to, int64_t tokens);
  // The same as a KvPrefix: holdPrefix shares the full pages of positions [0, tokens) of
  // `sequence` and copies a partial last page; adoptPrefix gives an empty sequence those rows
  // (sharing every page, so its first write into the last one copies it); releasePrefix lets go.
  StatusOr<KvPrefix> holdPrefix(int32_t sequence, int64_t tokens);
  Status adoptPrefix(int32_t to, const KvPrefix &prefix);
  void releasePrefix(KvPrefix &prefix);
  // How many sequences and held prefixes hold `page` (0: free).
  int32_t pageReferences(int32_t page) const;
  // Forgets positions >= tokens in every layer and releases the pages no longer needed (a page
  // returns to the free list when no sequence holds it any more; rollback).
  Status truncate(int32_t sequence, int64_t tokens);
  // Forgets positions >= tokens of one layer only (its pages stay: the other layers hold them);
  // the multi-token-prediction layer drops the rows of its chained drafts this way.
  Status truncateLayer(int32_t kvSlot, int32_t sequence, int64_t tokens);
  // Returns all pages of the sequence; its lengths become 0.
  Status freeSequence(int32_t sequence);

private:
  struct Layer {
    KvLayerShape shape;
    uint64_t storageOffset = 0; // bytes into storage_
  };

  PagedKvCache() = default;
  Status reservePages(int32_t sequence, int64_t tokens);
  Status makeWritable(int32_t sequence, int64_t begin, int64_t count);
  // Gives `sequence` its own copy of its page `index` if another sequence holds it too.
  Status ensureExclusive(int32_t sequence, int64_t index);
  int32_t takeFreePage();
  void copyPage(int32_t from, int32_t to, int64_t rows);
  void releasePage(int32_t page);
  Status checkSequence(int32_t sequence) const;
  Status checkLayer(int32_t kvSlot) const;
  float *rowPointer(int32_t kvSlot, int32_t page, int64_t row);
  int64_t &lengthRef(int32_t kvSlot, int32_t sequence) {
    return lengths_[static_cast<size_t>(kvSlot) * maxSequences_ + sequence];
  }

  Arena storage_;
  std::vector<Layer> layers_;
  int64_t pageSize_ = 0;
  int64_t numPages_ = 0;
  int32_t maxSequences_ = 0;
  std::vector<int32_t> freePages_;               // a stack of free page ids, page 0 on top at first
  std::vector<int32_t> references_;              // per page: the page tables holding it
  std::vector<std::vector<int32_t>> pageTables_; // per sequence
  std::vector<int64_t> lengths_;                 // [layer][sequence]
  bool recordCopies_ = false;
  std::vector<PageCopy> pageCopies_;
};

//===------------------------------------------------------------------------------------------===//
// Recurrent state pool.
//===------------------------------------------------------------------------------------------===//

// One KDA layer of CacheSpec.recurrent.
struct RecurrentLayerShape {
  int32_t layer = 0; // decoder layer
  int64_t numHeads = 0;
  int64_t headKDim = 0;
  int64_t headVDim = 0;
  plan::fb::StateLayout layout = plan::fb::StateLayout::KMajor;
  int64_t convChannels = 0;
  int64_t convKernel = 0;

  // H x K x V fp32 (KMajor: [H][K][V], VMajor: [H][V][K]).
  int64_t stateElements() const { return numHeads * headKDim * headVDim; }
  // The last conv_kernel - 1 pre-conv inputs: [convKernel - 1][convChannels].
  int64_t convStateElements() const { return convChannels * (convKernel - 1); }
};

// The full recurrent state of one sequence slot, all layers; see RecurrentStatePool::snapshot.
class RecurrentStateSnapshot {
public:
  bool empty() const { return values_.empty(); }

private:
  friend class RecurrentStatePool;
  std::vector<float> values_;
};

// Fixed-size recurrent state of every KDA layer of CacheSpec.recurrent (indexed by
// KdaParams.state_slot), for `numSlots` sequence slots. A slot's state over all layers is one
// contiguous block, so snapshot / restore (speculative-decoding rollback) is one copy.
class RecurrentStatePool {
public:
  static StatusOr<RecurrentStatePool> create(const plan::fb::CacheSpec &spec, int32_t numSlots);
  // Bytes one sequence slot takes over all layers.
  static StatusOr<uint64_t> bytesPerSlot(const plan::fb::CacheSpec &spec);

  int32_t numLayers() const { return static_cast<int32_t>(layers_.size()); }
  const RecurrentLayerShape &layerShape(int32_t stateSlot) const {
    return layers_[stateSlot].shape;
  }
  int32_t numSlots() const { return numSlots_; }
  int32_t freeSlots() const { return static_cast<int32_t>(freeSlots_.size()); }
  bool isAllocated(int32_t slot) const;

  // Hands out a free slot with every layer's state and conv state zeroed (a fresh sequence).
  StatusOr<int32_t> allocate();
  Status release(int32_t slot);

  // The state [H, K, V] and the conv state [convKernel - 1, convChannels] of layer stateSlot.
  StatusOr<std::span<float>> state(int32_t stateSlot, int32_t slot);
  StatusOr<std::span<float>> convState(int32_t stateSlot, int32_t slot);

  // Where those start, in floats from the pool's first slot, and the pool's size in floats: a
  // device mirror of the pool (the cuda device's) uses the same layout.
  StatusOr<uint64_t> stateOffset(int32_t stateSlot, int32_t slot) const;
  StatusOr<uint64_t> convStateOffset(int32_t stateSlot, int32_t slot) const;
  uint64_t slotElements() const { return slotElements_; }
  uint64_t totalElements() const { return slotElements_ * static_cast<uint64_t>(numSlots_); }

  // Copies a slot's state out / back in (all layers).
  StatusOr<RecurrentStateSnapshot> snapshot(int32_t slot) const;
  Status restore(int32_t slot, const RecurrentStateSnapshot &snapshot);

private:
  struct Layer {
    RecurrentLayerShape shape;
    uint64_t stateOffset = 0; // floats into a slot's block
    uint64_t convOffset = 0;
  };

  RecurrentStatePool() = default;
  Status checkSlot(int32_t slot) const;
  Status checkLayerAndSlot(int32_t stateSlot, int32_t slot) const;
  float *slotBlock(int32_t slot);

  Arena storage_;
  std::vector<Layer> layers_;
  uint64_t slotElements_ = 0; // floats per slot, a multiple of Arena::kAlignment / 4
  int32_t numSlots_ = 0;
  std::vector<int32_t> freeSlots_; // a stack of free slots, slot 0 on top at first
  std::vector<bool> allocated_;
};

} // namespace hybrid
