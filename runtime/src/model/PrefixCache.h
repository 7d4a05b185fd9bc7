// Prompt prefixes kept after their sequence for later prompts that start the same way (prefix
// caching, docs/runtime.md). An entry is a prompt's first L tokens (L a multiple of the block
// size), the KV rows of those positions (a KvPrefix: full pages shared with live sequences) and
// the recurrent state of every layer (KDA state and conv state) right after position L - 1. A hit
// restores both, so the rest of the prompt computes exactly what a full prefill computes.
#pragma once

#include "hybrid/runtime/Memory.h"

#include <cstdint>
#include <span>
#include <vector>

namespace hybrid {

class PrefixCache {
public:
  struct Entry {
    std::vector<int64_t> tokens;
    KvPrefix kv;
    RecurrentStateSnapshot state;
    uint64_t lastUse = 0;
  };

  // capacity 0: no prefix caching.
  PrefixCache(int32_t capacity, int64_t blockTokens)
      : capacity_(capacity), blockTokens_(blockTokens) {}

  bool enabled() const { return capacity_ > 0; }
  int64_t blockTokens() const { return blockTokens_; }
  size_t size() const { return entries_.size(); }

  // The longest entry whose tokens start `tokens` and number at most maxTokens, marked as just
  // used; null when there is none. A linear scan with exact token comparison: the capacity is
  // small, and a hash index belongs with the serving scheduler.
  const Entry *find(std::span<const int64_t> tokens, int64_t maxTokens);
  // Keeps a prefix. When an entry with the same tokens exists the new rows are released and the
  // old entry is marked used; past capacity the least recently used entry is dropped.
  void insert(std::vector<int64_t> tokens, KvPrefix kv, RecurrentStateSnapshot state,
              PagedKvCache &kvCache);

private:
  int32_t capacity_;
  int64_t blockTokens_;
  uint64_t clock_ = 0;
  std::vector<Entry> entries_;
};

} // namespace hybrid
