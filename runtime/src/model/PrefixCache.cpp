#include "PrefixCache.h"

#include <algorithm>

namespace hybrid {

const PrefixCache::Entry *PrefixCache::find(std::span<const int64_t> tokens, int64_t maxTokens) {
  Entry *best = nullptr;
  for (Entry &entry : entries_) {
    const auto length = static_cast<int64_t>(entry.tokens.size());
    if (length > maxTokens || length > static_cast<int64_t>(tokens.size()) ||
        (best && length <= static_cast<int64_t>(best->tokens.size())))
      continue;
    if (std::equal(entry.tokens.begin(), entry.tokens.end(), tokens.begin()))
      best = &entry;
  }
  if (best)
    best->lastUse = ++clock_;
  return best;
}

void PrefixCache::insert(std::vector<int64_t> tokens, KvPrefix kv, RecurrentStateSnapshot state,
                         PagedKvCache &kvCache) {
  for (Entry &entry : entries_)
    if (entry.tokens == tokens) {
      entry.lastUse = ++clock_;
      kvCache.releasePrefix(kv);
      return;
    }
  entries_.push_back(Entry{std::move(tokens), std::move(kv), std::move(state), ++clock_});
  while (static_cast<int64_t>(entries_.size()) > capacity_) {
    auto oldest = std::min_element(entries_.begin(), entries_.end(),
                                   [](const Entry &a, const Entry &b) {
                                     return a.lastUse < b.lastUse;
                                   });
    kvCache.releasePrefix(oldest->kv);
    entries_.erase(oldest);
  }
}

} // namespace hybrid
