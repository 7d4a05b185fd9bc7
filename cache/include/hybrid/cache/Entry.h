// One cache entry = one file: a fixed 72-byte header followed by the zstd-compressed payload.
//
//   offset  size  field
//        0     8  magic "HYBRIDC1"
//        8     4  format version (u32, currently 1)
//       12    16  cache key (u64 high, u64 low)
//       28     4  kind (u32: other=0, plan=1, weights-manifest=2, tuning=3)
//       32     8  uncompressed payload size (u64)
//       40     8  compressed payload size (u64) = file size - 72
//       48    16  XXH3-128 of the uncompressed payload (u64 high, u64 low)
//       64     8  header checksum: XXH3-64 of bytes [0, 64)
//       72     -  one zstd frame
//
// Every integer is little-endian and written field by field. Decoding trusts nothing: each check
// that fails names the problem, and a caller treats any failure as a miss (docs/cache.md).
#pragma once

#include "hybrid/cache/Key.h"
#include "hybrid/runtime/Status.h"

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hybrid::cache {

// What an entry's payload is. Stored as a u32, so values unknown to this build still compare.
enum class EntryKind : uint32_t {
  Other = 0,
  Plan = 1,
  WeightsManifest = 2,
  Tuning = 3, // a kernel's tuned configuration for a shape bucket and GPU (Tuning.h)
};
// "plan", "weights-manifest", "tuning", "other", or "kind N" for a value this build does not know.
std::string entryKindName(EntryKind kind);

inline constexpr std::string_view kEntryMagic = "HYBRIDC1";
inline constexpr uint32_t kEntryFormatVersion = 1;
inline constexpr size_t kEntryHeaderSize = 72;
// No plan or manifest comes near this; a larger size in a header means corruption or forgery, and
// decoding refuses it before allocating anything.
inline constexpr uint64_t kMaxUncompressedSize = uint64_t{16} << 30;
inline constexpr int kDefaultZstdLevel = 3;
// The largest file a valid entry can be (header + zstd's bound for kMaxUncompressedSize); a
// reader refuses a larger file before reading it.
uint64_t maxEntryFileSize();

struct ContentHash {
  uint64_t high = 0;
  uint64_t low = 0;
  friend bool operator==(const ContentHash &, const ContentHash &) = default;
};

struct EntryHeader {
  uint32_t formatVersion = kEntryFormatVersion;
  CacheKey key;
  EntryKind kind = EntryKind::Other;
  uint64_t uncompressedSize = 0;
  uint64_t compressedSize = 0;
  ContentHash contentHash;
};

// Serializes the header and appends the checksum of the bytes written.
std::array<std::byte, kEntryHeaderSize> encodeEntryHeader(const EntryHeader &header);

// Parses the first kEntryHeaderSize bytes and checks magic, version and checksum; the payload
// (if any follows) is not looked at. Tools use it to list entries without decompressing them.
StatusOr<EntryHeader> decodeEntryHeader(std::span<const std::byte> bytes);

// Builds the bytes of an entry file. Fails only for a payload over kMaxUncompressedSize (which
// no reader would accept) or when memory runs out. The level is clamped to zstd's range.
StatusOr<std::vector<std::byte>> encodeEntry(const CacheKey &key, EntryKind kind,
                                             std::span<const std::byte> payload,
                                             int zstdLevel = kDefaultZstdLevel);

// Checks an entry file completely and returns its payload. Fails, with a message naming the
// problem, on: truncated header, wrong magic, unsupported version, header checksum mismatch, key
// or kind mismatch, size over the limit, compressed size not matching the file, zstd error,
// decompressed size mismatch, content hash mismatch.
StatusOr<std::vector<std::byte>> decodeEntry(std::span<const std::byte> bytes,
                                             const CacheKey &expectedKey, EntryKind expectedKind);

} // namespace hybrid::cache
