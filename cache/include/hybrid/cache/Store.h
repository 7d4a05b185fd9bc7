// The on-disk cache: one entry file per key, at <dir>/<first 2 hex digits>/<32 hex digits>.hyc.
//
// Writers never modify a file in place: put() writes a temporary file in the entry's folder,
// fsyncs it, renames it over the entry (atomic on POSIX) and fsyncs the folder. So a reader sees
// either the old entry, the new one or none — never a torn file — and concurrent writers of one
// key need no lock (the last rename wins; both wrote the same content in practice).
//
// Readers trust nothing: get() verifies the whole entry (Entry.h). A bad entry is a miss, never
// an error the caller must handle: it is removed so the caller recompiles and puts a fresh one,
// and the reason is handed back for a log line. docs/cache.md has the full policy.
#pragma once

#include "hybrid/cache/Entry.h"
#include "hybrid/cache/Key.h"
#include "hybrid/runtime/Status.h"

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace hybrid::cache {

inline constexpr std::string_view kEntryFileExtension = ".hyc";
// Temporary files start with '.' and end with this, so no listing mistakes them for entries.
inline constexpr std::string_view kTemporaryFileExtension = ".tmp";

// $HYBRID_CACHE_DIR if set, else $XDG_CACHE_HOME/hybrid (when absolute, as the XDG spec asks),
// else $HOME/.cache/hybrid. Empty variables count as unset. Fails only when none applies.
StatusOr<std::string> defaultCacheDir();

class CacheStore {
public:
  // Opens the cache rooted at `dir`, creating the folder (and its parents) when missing.
  static StatusOr<CacheStore> open(std::string dir);

  const std::string &dir() const { return dir_; }
  // Where the entry for `key` lives (whether or not it exists).
  std::string pathFor(const CacheKey &key) const;

  // The payload stored under `key`, or nullopt on a miss. An entry that fails any check (or holds
  // another kind) is also a miss: it is removed and, when `whyRejected` is given, the reason is
  // written there ("<path>: header checksum mismatch: ..."); on a plain miss it is cleared.
  // An error is returned only when the file exists but cannot be read (permissions, I/O).
  StatusOr<std::optional<std::vector<std::byte>>> get(const CacheKey &key, EntryKind kind,
                                                      std::string *whyRejected = nullptr);

  // Stores `payload` under `key`, replacing any entry atomically.
  Status put(const CacheKey &key, EntryKind kind, std::span<const std::byte> payload);

  // Removes the entry for `key`; removing a missing entry succeeds.
  Status remove(const CacheKey &key);

  // zstd level for entries written by put() (clamped to zstd's range).
  void setZstdLevel(int level) { zstdLevel_ = level; }

private:
  explicit CacheStore(std::string dir) : dir_(std::move(dir)) {}

  std::string shardDirFor(const CacheKey &key) const;

  std::string dir_;
  int zstdLevel_ = kDefaultZstdLevel;
};

} // namespace hybrid::cache
