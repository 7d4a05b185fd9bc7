// Paged KV cache for the MLA / DSA layers: fixed pages of page_size token rows, one page table per
// sequence shared by every layer (the vLLM block-table scheme), fp32 rows on the cpu device.
#include "hybrid/runtime/Memory.h"
#include "hybrid/runtime/StatusHelpers.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>

namespace hybrid {
namespace fb = plan::fb;
namespace {

std::string kvField(size_t index) { return "cache.kv[" + std::to_string(index) + "]"; }

// Validated layer shapes of CacheSpec.kv (the cpu cache stores fp32 rows only).
StatusOr<std::vector<KvLayerShape>> readKvLayers(const fb::CacheSpec &spec) {
  std::vector<KvLayerShape> shapes;
  const auto *kv = spec.kv();
  if (!kv || kv->size() == 0)
    return shapes; // page_size may be unset when nothing is cached per token
  if (spec.page_size() <= 0)
    return Status::error("cache.page_size = " + std::to_string(spec.page_size()) +
                         " must be positive");
  for (flatbuffers::uoffset_t i = 0; i < kv->size(); ++i) {
    const fb::KvCacheLayer *layer = kv->Get(i);
    KvLayerShape shape;
    shape.layer = layer->layer();
    shape.latentDim = layer->latent_dim();
    shape.ropeDim = layer->rope_dim();
    shape.indexKeyDim = layer->index_key_dim();
    if (shape.latentDim < 0 || shape.ropeDim < 0 || shape.indexKeyDim < 0 ||
        shape.latentDim + shape.ropeDim == 0)
      return Status::error(kvField(i) + ": latent_dim " + std::to_string(shape.latentDim) +
                           ", rope_dim " + std::to_string(shape.ropeDim) + ", index_key_dim " +
                           std::to_string(shape.indexKeyDim) + " do not describe a KV row");
    if (layer->dtype() != fb::DType::F32)
      return Status::error(kvField(i) + ".dtype is " +
                           std::string(fb::EnumNameDType(layer->dtype())) +
                           "; the cpu KV cache stores F32");
    shapes.push_back(shape);
  }
  return shapes;
}

// Bytes of one page of one layer; nullopt on overflow.
std::optional<uint64_t> pageBytes(const KvLayerShape &shape, int64_t pageSize) {
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(pageSize),
                             static_cast<uint64_t>(shape.rowElements()), &bytes) ||
      __builtin_mul_overflow(bytes, sizeof(float), &bytes))
    return std::nullopt;
  return bytes;
}

int64_t pagesFor(int64_t tokens, int64_t pageSize) { return (tokens + pageSize - 1) / pageSize; }

} // namespace

//===------------------------------------------------------------------------------------------===//
// KvSequenceView.
//===------------------------------------------------------------------------------------------===//

std::span<const float> KvSequenceView::row(int64_t position) const {
  if (position < 0 || position >= numTokens_)
    return {};
  int64_t page = pages_[static_cast<size_t>(position / pageSize_)];
  int64_t rowIndex = page * pageSize_ + position % pageSize_;
  return {layerStorage_ + rowIndex * shape_.rowElements(),
          static_cast<size_t>(shape_.rowElements())};
}

std::span<const float> KvSequenceView::latent(int64_t position) const {
  std::span<const float> whole = row(position);
  if (whole.empty())
    return {};
  return whole.first(static_cast<size_t>(shape_.latentDim));
}

std::span<const float> KvSequenceView::ropeKey(int64_t position) const {
  std::span<const float> whole = row(position);
  if (whole.empty())
    return {};
  return whole.subspan(static_cast<size_t>(shape_.latentDim), static_cast<size_t>(shape_.ropeDim));
}

std::span<const float> KvSequenceView::indexKey(int64_t position) const {
  std::span<const float> whole = row(position);
  if (whole.empty())
    return {};
  return whole.subspan(static_cast<size_t>(shape_.latentDim + shape_.ropeDim),
                       static_cast<size_t>(shape_.indexKeyDim));
}

Status KvSequenceView::gather(std::span<float> out, int64_t begin, int64_t count) const {
  if (out.size() != static_cast<uint64_t>(numTokens_ * count))
    return Status::error("KV gather: the output holds " + std::to_string(out.size()) + " floats, " +
                         std::to_string(numTokens_) + " tokens x " + std::to_string(count) +
                         " need " + std::to_string(numTokens_ * count));
  for (int64_t position = 0; position < numTokens_; ++position)
    std::memcpy(out.data() + position * count, row(position).data() + begin,
                static_cast<size_t>(count) * sizeof(float));
  return Status::ok();
}

Status KvSequenceView::gatherRows(std::span<float> out) const {
  return gather(out, 0, shape_.rowElements());
}
Status KvSequenceView::gatherLatents(std::span<float> out) const {
  return gather(out, 0, shape_.latentDim);
}
Status KvSequenceView::gatherRopeKeys(std::span<float> out) const {
  return gather(out, shape_.latentDim, shape_.ropeDim);
}
Status KvSequenceView::gatherIndexKeys(std::span<float> out) const {
  return gather(out, shape_.latentDim + shape_.ropeDim, shape_.indexKeyDim);
}

//===------------------------------------------------------------------------------------------===//
// PagedKvCache.
//===------------------------------------------------------------------------------------------===//

StatusOr<uint64_t> PagedKvCache::bytesPerPage(const fb::CacheSpec &spec) {
  return catchExceptions("KV cache", [&]() -> StatusOr<uint64_t> {
    HYBRID_ASSIGN_OR_RETURN(std::vector<KvLayerShape> shapes, readKvLayers(spec));
    uint64_t total = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      std::optional<uint64_t> bytes = pageBytes(shapes[i], spec.page_size());
      if (!bytes || __builtin_add_overflow(total, *bytes, &total))
        return Status::error(kvField(i) + ": page size overflows");
    }
    return total;
  });
}

StatusOr<PagedKvCache> PagedKvCache::create(const fb::CacheSpec &spec, int64_t numPages,
                                            int32_t maxSequences) {
  return catchExceptions("KV cache", [&]() -> StatusOr<PagedKvCache> {
    if (numPages < 0 || numPages > std::numeric_limits<int32_t>::max())
      return Status::error("KV cache: " + std::to_string(numPages) +
                           " pages requested, expected 0 to 2^31 - 1");
    if (maxSequences <= 0)
      return Status::error("KV cache: maxSequences = " + std::to_string(maxSequences) +
                           " must be positive");
    HYBRID_ASSIGN_OR_RETURN(std::vector<KvLayerShape> shapes, readKvLayers(spec));

    PagedKvCache cache;
    cache.pageSize_ = std::max(spec.page_size(), 1); // page_size may be unset without layers
    cache.numPages_ = numPages;
    cache.maxSequences_ = maxSequences;
    // Layers back to back in one allocation, each starting on an Arena::kAlignment boundary.
    uint64_t totalBytes = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      std::optional<uint64_t> bytes = pageBytes(shapes[i], cache.pageSize_);
      uint64_t layerBytes = 0;
      uint64_t end = 0;
      if (!bytes || __builtin_mul_overflow(*bytes, static_cast<uint64_t>(numPages), &layerBytes) ||
          __builtin_add_overflow(totalBytes, layerBytes, &end) ||
          __builtin_add_overflow(end, Arena::kAlignment - 1, &end))
        return Status::error("KV cache: " + kvField(i) + " with " + std::to_string(numPages) +
                             " pages overflows");
      cache.layers_.push_back({shapes[i], totalBytes});
      totalBytes = end / Arena::kAlignment * Arena::kAlignment;
    }
    HYBRID_ASSIGN_OR_RETURN(cache.storage_, Arena::create(totalBytes));

    cache.freePages_.reserve(static_cast<size_t>(numPages));
    for (int64_t page = numPages - 1; page >= 0; --page)
      cache.freePages_.push_back(static_cast<int32_t>(page));
    cache.references_.assign(static_cast<size_t>(numPages), 0);
    cache.pageTables_.resize(static_cast<size_t>(maxSequences));
    cache.lengths_.assign(cache.layers_.size() * static_cast<size_t>(maxSequences), 0);
    return cache;
  });
}

Status PagedKvCache::checkSequence(int32_t sequence) const {
  if (sequence >= 0 && sequence < maxSequences_)
    return Status::ok();
  return Status::error("KV cache: sequence " + std::to_string(sequence) + " is out of range [0, " +
                       std::to_string(maxSequences_) + ")");
}

Status PagedKvCache::checkLayer(int32_t kvSlot) const {
  if (kvSlot >= 0 && kvSlot < numLayers())
    return Status::ok();
  return Status::error("KV cache: kv_slot " + std::to_string(kvSlot) + " is out of range [0, " +
                       std::to_string(numLayers()) + ")");
}

float *PagedKvCache::rowPointer(int32_t kvSlot, int32_t page, int64_t row) {
  const Layer &layer = layers_[static_cast<size_t>(kvSlot)];
  auto *base = reinterpret_cast<float *>(storage_.data() + layer.storageOffset);
  return base + (static_cast<int64_t>(page) * pageSize_ + row) * layer.shape.rowElements();
}

Status PagedKvCache::reserve(int32_t sequence, int64_t tokens) {
  return catchExceptions("KV cache", [&]() -> Status { return reservePages(sequence, tokens); });
}

Status PagedKvCache::reservePages(int32_t sequence, int64_t tokens) {
  HYBRID_RETURN_IF_ERROR(checkSequence(sequence));
  if (tokens < 0)
    return Status::error("KV cache: cannot reserve " + std::to_string(tokens) + " tokens");
  if (layers_.empty())
    return Status::ok(); // nothing is cached per token
  std::vector<int32_t> &pageTable = pageTables_[static_cast<size_t>(sequence)];
  int64_t missing = pagesFor(tokens, pageSize_) - static_cast<int64_t>(pageTable.size());
  if (missing <= 0)
    return Status::ok();
  if (missing > freePages())
    return Status::exhausted("KV cache out of pages: sequence " + std::to_string(sequence) + " needs " +
                         std::to_string(missing) + " more pages of " + std::to_string(pageSize_) +
                         " tokens for " + std::to_string(tokens) + " tokens, " +
                         std::to_string(freePages()) + " of " + std::to_string(numPages_) +
                         " pages are free");
  for (int64_t i = 0; i < missing; ++i)
    pageTable.push_back(takeFreePage());
  return Status::ok();
}

int32_t PagedKvCache::takeFreePage() {
  const int32_t page = freePages_.back();
  freePages_.pop_back();
  references_[static_cast<size_t>(page)] = 1;
  return page;
}

void PagedKvCache::releasePage(int32_t page) {
  // freePages_ has room: its capacity is numPages and every page came from it.
  if (--references_[static_cast<size_t>(page)] == 0)
    freePages_.push_back(page);
}

// Rows [0, rows) of page `from` into page `to`, in every layer.
void PagedKvCache::copyPage(int32_t from, int32_t to, int64_t rows) {
  if (recordCopies_)
    pageCopies_.push_back({from, to, rows});
  for (int32_t kvSlot = 0; kvSlot < numLayers(); ++kvSlot)
    std::memcpy(rowPointer(kvSlot, to, 0), rowPointer(kvSlot, from, 0),
                static_cast<size_t>(rows * layers_[static_cast<size_t>(kvSlot)].shape.rowElements()) *
                    sizeof(float));
}

Status PagedKvCache::ensureExclusive(int32_t sequence, int64_t index) {
  int32_t &page = pageTables_[static_cast<size_t>(sequence)][static_cast<size_t>(index)];
  if (references_[static_cast<size_t>(page)] == 1)
    return Status::ok();
  if (freePages_.empty())
    return Status::exhausted("KV cache out of pages: sequence " + std::to_string(sequence) +
                         " must copy a page it shares before writing to it, and none of the " +
                         std::to_string(numPages_) + " pages is free");
  const int32_t copy = takeFreePage();
  copyPage(page, copy, pageSize_);
  releasePage(page);
  page = copy;
  return Status::ok();
}

int32_t PagedKvCache::pageReferences(int32_t page) const {
  if (page < 0 || page >= numPages_)
    return 0;
  return references_[static_cast<size_t>(page)];
}

StatusOr<KvPrefix> PagedKvCache::holdPrefix(int32_t sequence, int64_t tokens) {
  return catchExceptions("KV cache", [&]() -> StatusOr<KvPrefix> {
    HYBRID_RETURN_IF_ERROR(checkSequence(sequence));
    for (int32_t kvSlot = 0; kvSlot < numLayers(); ++kvSlot)
      if (tokens < 0 || tokens > length(kvSlot, sequence))
        return Status::error("KV cache: cannot take " + std::to_string(tokens) +
                             " tokens of sequence " + std::to_string(sequence) + ": kv_slot " +
                             std::to_string(kvSlot) + " holds " +
                             std::to_string(length(kvSlot, sequence)));
    KvPrefix prefix;
    prefix.tokens = tokens;
    if (layers_.empty())
      return prefix;
    const int64_t fullPages = tokens / pageSize_, partialRows = tokens % pageSize_;
    if (partialRows > 0 && freePages_.empty())
      return Status::exhausted("KV cache out of pages: taking " + std::to_string(tokens) +
                           " tokens of sequence " + std::to_string(sequence) +
                           " copies its partial last page, and none of the " +
                           std::to_string(numPages_) + " pages is free");
    const std::vector<int32_t> &source = pageTables_[static_cast<size_t>(sequence)];
    for (int64_t index = 0; index < fullPages; ++index) {
      const int32_t page = source[static_cast<size_t>(index)];
      ++references_[static_cast<size_t>(page)];
      prefix.pages.push_back(page);
    }
    if (partialRows > 0) {
      const int32_t copy = takeFreePage();
      copyPage(source[static_cast<size_t>(fullPages)], copy, partialRows);
      prefix.pages.push_back(copy);
    }
    return prefix;
  });
}

Status PagedKvCache::adoptPrefix(int32_t to, const KvPrefix &prefix) {
  return catchExceptions("KV cache", [&]() -> Status {
    HYBRID_RETURN_IF_ERROR(checkSequence(to));
    std::vector<int32_t> &target = pageTables_[static_cast<size_t>(to)];
    if (!target.empty())
      return Status::error("KV cache: sequence " + std::to_string(to) + " holds " +
                           std::to_string(target.size()) +
                           " pages; only an empty sequence takes a prefix (free it first)");
    if (!layers_.empty() &&
        static_cast<int64_t>(prefix.pages.size()) != pagesFor(prefix.tokens, pageSize_))
      return Status::error("KV cache: a prefix of " + std::to_string(prefix.tokens) +
                           " tokens with " + std::to_string(prefix.pages.size()) + " pages");
    for (int32_t page : prefix.pages) {
      if (page < 0 || page >= numPages_ || references_[static_cast<size_t>(page)] == 0)
        return Status::error("KV cache: prefix page " + std::to_string(page) +
                             " is not a held page");
    }
    for (int32_t page : prefix.pages) {
      ++references_[static_cast<size_t>(page)];
      target.push_back(page);
    }
    for (int32_t kvSlot = 0; kvSlot < numLayers(); ++kvSlot)
      lengthRef(kvSlot, to) = prefix.tokens;
    return Status::ok();
  });
}

void PagedKvCache::releasePrefix(KvPrefix &prefix) {
  for (int32_t page : prefix.pages)
    releasePage(page);
  prefix.pages.clear();
  prefix.tokens = 0;
}

Status PagedKvCache::fork(int32_t from, int32_t to, int64_t tokens) {
  HYBRID_RETURN_IF_ERROR(checkSequence(to));
  if (from == to)
    return Status::error("KV cache: cannot fork sequence " + std::to_string(from) +
                         " into itself");
  if (!pageTables_[static_cast<size_t>(to)].empty())
    return Status::error("KV cache: cannot fork into sequence " + std::to_string(to) +
                         ", which holds " +
                         std::to_string(pageTables_[static_cast<size_t>(to)].size()) +
                         " pages (free it first)");
  // A held prefix handed over: the copied partial page ends up with `to` alone.
  HYBRID_ASSIGN_OR_RETURN(KvPrefix prefix, holdPrefix(from, tokens));
  const Status adopted = adoptPrefix(to, prefix);
  releasePrefix(prefix);
  return adopted;
}

Status PagedKvCache::makeWritable(int32_t sequence, int64_t begin, int64_t count) {
  HYBRID_RETURN_IF_ERROR(checkSequence(sequence));
  if (begin < 0 || count < 0)
    return Status::error("KV cache: cannot write " + std::to_string(count) + " positions from " +
                         std::to_string(begin));
  if (layers_.empty() || count == 0)
    return Status::ok();
  // The pages written to that this sequence shares with another are copied first; all free
  // pages needed (copies and new pages) are checked before anything changes.
  const std::vector<int32_t> &held = pageTables_[static_cast<size_t>(sequence)];
  const int64_t firstWritten = begin / pageSize_;
  const int64_t lastWritten = pagesFor(begin + count, pageSize_); // exclusive
  int64_t copies = 0;
  for (int64_t index = firstWritten; index < std::min<int64_t>(lastWritten, held.size()); ++index)
    copies += references_[static_cast<size_t>(held[static_cast<size_t>(index)])] > 1 ? 1 : 0;
  const int64_t newPages = std::max<int64_t>(0, lastWritten - static_cast<int64_t>(held.size()));
  if (copies > 0 && copies + newPages > freePages())
    return Status::exhausted("KV cache out of pages: sequence " + std::to_string(sequence) +
                             " needs " + std::to_string(newPages) + " new pages and copies of " +
                             std::to_string(copies) + " pages it shares, " +
                             std::to_string(freePages()) + " of " + std::to_string(numPages_) +
                             " pages are free");
  HYBRID_RETURN_IF_ERROR(reservePages(sequence, begin + count));
  for (int64_t index = firstWritten; index < lastWritten; ++index)
    HYBRID_RETURN_IF_ERROR(ensureExclusive(sequence, index));
  return Status::ok();
}

Status PagedKvCache::prepareWrite(int32_t sequence, int64_t begin, int64_t count) {
  return catchExceptions("KV cache",
                         [&]() -> Status { return makeWritable(sequence, begin, count); });
}

Status PagedKvCache::advance(int32_t kvSlot, int32_t sequence, int64_t count) {
  return catchExceptions("KV cache", [&]() -> Status {
    HYBRID_RETURN_IF_ERROR(checkLayer(kvSlot));
    HYBRID_RETURN_IF_ERROR(checkSequence(sequence));
    int64_t &length = lengthRef(kvSlot, sequence);
    HYBRID_RETURN_IF_ERROR(makeWritable(sequence, length, count));
    length += count;
    return Status::ok();
  });
}

Status PagedKvCache::append(int32_t kvSlot, int32_t sequence, std::span<const float> rows) {
  return catchExceptions("KV cache", [&]() -> Status {
    HYBRID_RETURN_IF_ERROR(checkLayer(kvSlot));
    HYBRID_RETURN_IF_ERROR(checkSequence(sequence));
    const KvLayerShape &shape = layers_[static_cast<size_t>(kvSlot)].shape;
    auto rowElements = static_cast<uint64_t>(shape.rowElements());
    if (rows.size() % rowElements != 0)
      return Status::error("KV cache: append to kv_slot " + std::to_string(kvSlot) + " of " +
                           std::to_string(rows.size()) + " floats, not a multiple of the " +
                           std::to_string(rowElements) + "-float row");
    auto numRows = static_cast<int64_t>(rows.size() / rowElements);
    int64_t &length = lengthRef(kvSlot, sequence);
    HYBRID_RETURN_IF_ERROR(makeWritable(sequence, length, numRows));
    // Rows within a page are contiguous: copy one page's worth at a time.
    const std::vector<int32_t> &pageTable = pageTables_[static_cast<size_t>(sequence)];
    const float *source = rows.data();
    for (int64_t position = length; position < length + numRows;) {
      int64_t rowInPage = position % pageSize_;
      int64_t count = std::min(pageSize_ - rowInPage, length + numRows - position);
      int32_t page = pageTable[static_cast<size_t>(position / pageSize_)];
      std::memcpy(rowPointer(kvSlot, page, rowInPage), source,
                  static_cast<size_t>(count) * rowElements * sizeof(float));
      source += static_cast<size_t>(count) * rowElements;
      position += count;
    }
    length += numRows;
    return Status::ok();
  });
}

std::span<const int32_t> PagedKvCache::pageTable(int32_t sequence) const {
  if (!checkSequence(sequence).isOk())
    return {};
  return pageTables_[static_cast<size_t>(sequence)];
}

int64_t PagedKvCache::length(int32_t kvSlot, int32_t sequence) const {
  if (!checkLayer(kvSlot).isOk() || !checkSequence(sequence).isOk())
    return 0;
  return lengths_[static_cast<size_t>(kvSlot) * maxSequences_ + sequence];
}

int64_t PagedKvCache::capacity(int32_t sequence) const {
  if (!checkSequence(sequence).isOk())
    return 0;
  return static_cast<int64_t>(pageTables_[static_cast<size_t>(sequence)].size()) * pageSize_;
}

StatusOr<KvSequenceView> PagedKvCache::view(int32_t kvSlot, int32_t sequence,
                                            int64_t numTokens) const {
  return catchExceptions("KV cache", [&]() -> StatusOr<KvSequenceView> {
    HYBRID_RETURN_IF_ERROR(checkLayer(kvSlot));
    HYBRID_RETURN_IF_ERROR(checkSequence(sequence));
    int64_t written = length(kvSlot, sequence);
    if (numTokens < 0 || numTokens > written)
      return Status::error("KV cache: view of " + std::to_string(numTokens) +
                           " tokens of sequence " + std::to_string(sequence) + " in kv_slot " +
                           std::to_string(kvSlot) + ", which holds " + std::to_string(written));
    const Layer &layer = layers_[static_cast<size_t>(kvSlot)];
    const std::vector<int32_t> &pageTable = pageTables_[static_cast<size_t>(sequence)];
    KvSequenceView view;
    view.shape_ = layer.shape;
    view.layerStorage_ = reinterpret_cast<const float *>(storage_.data() + layer.storageOffset);
    view.pages_.assign(pageTable.begin(), pageTable.begin() + pagesFor(numTokens, pageSize_));
    view.pageSize_ = pageSize_;
    view.numTokens_ = numTokens;
    return view;
  });
}

Status PagedKvCache::truncate(int32_t sequence, int64_t tokens) {
  HYBRID_RETURN_IF_ERROR(checkSequence(sequence));
  if (tokens < 0)
    return Status::error("KV cache: cannot truncate to " + std::to_string(tokens) + " tokens");
  for (int32_t kvSlot = 0; kvSlot < numLayers(); ++kvSlot) {
    int64_t &length = lengthRef(kvSlot, sequence);
    length = std::min(length, tokens);
  }
  std::vector<int32_t> &pageTable = pageTables_[static_cast<size_t>(sequence)];
  auto keep = static_cast<size_t>(pagesFor(tokens, pageSize_));
  while (pageTable.size() > keep) {
    releasePage(pageTable.back());
    pageTable.pop_back();
  }
  return Status::ok();
}

Status PagedKvCache::truncateLayer(int32_t kvSlot, int32_t sequence, int64_t tokens) {
  HYBRID_RETURN_IF_ERROR(checkSequence(sequence));
  HYBRID_RETURN_IF_ERROR(checkLayer(kvSlot));
  if (tokens < 0)
    return Status::error("KV cache: cannot truncate kv_slot " + std::to_string(kvSlot) + " to " +
                         std::to_string(tokens) + " tokens");
  int64_t &length = lengthRef(kvSlot, sequence);
  length = std::min(length, tokens);
  return Status::ok();
}

Status PagedKvCache::freeSequence(int32_t sequence) { return truncate(sequence, 0); }

} // namespace hybrid
