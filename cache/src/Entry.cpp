// Entry files: header encoding, zstd compression and the checks a reader makes before trusting
// a payload. The header layout is documented in Entry.h and docs/cache.md.
#include "hybrid/cache/Entry.h"

#include "Buffer.h"
#include "LittleEndian.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <xxhash.h>
#include <zstd.h>
#include <zstd_errors.h>

namespace hybrid::cache {
namespace {

// Field offsets inside the header (see the table in Entry.h).
constexpr size_t kMagicOffset = 0;
constexpr size_t kVersionOffset = 8;
constexpr size_t kKeyHighOffset = 12;
constexpr size_t kKeyLowOffset = 20;
constexpr size_t kKindOffset = 28;
constexpr size_t kUncompressedSizeOffset = 32;
constexpr size_t kCompressedSizeOffset = 40;
constexpr size_t kContentHashHighOffset = 48;
constexpr size_t kContentHashLowOffset = 56;
constexpr size_t kChecksumOffset = 64;
static_assert(kChecksumOffset + sizeof(uint64_t) == kEntryHeaderSize);
static_assert(kEntryMagic.size() == kVersionOffset - kMagicOffset);

std::string hex64(uint64_t value) {
  char text[19];
  std::snprintf(text, sizeof text, "0x%016llx", static_cast<unsigned long long>(value));
  return text;
}

std::string hexHash(const ContentHash &hash) {
  return CacheKey{hash.high, hash.low}.hex(); // same 32-digit spelling as keys
}

// A foreign file's first bytes, printable and on one line.
std::string quoteBytes(std::span<const std::byte> bytes) {
  std::string out = "\"";
  for (std::byte b : bytes) {
    auto c = std::to_integer<unsigned char>(b);
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
      out += escaped;
    }
  }
  return out + "\"";
}

ContentHash hashPayload(std::span<const std::byte> payload) {
  XXH128_hash_t hash = XXH3_128bits(payload.data(), payload.size());
  return ContentHash{hash.high64, hash.low64};
}

uint64_t headerChecksum(std::span<const std::byte> header) {
  return XXH3_64bits(header.data(), kChecksumOffset);
}

} // namespace

std::string entryKindName(EntryKind kind) {
  switch (kind) {
  case EntryKind::Other:
    return "other";
  case EntryKind::Plan:
    return "plan";
  case EntryKind::WeightsManifest:
    return "weights-manifest";
  case EntryKind::Tuning:
    return "tuning";
  }
  return "kind " + std::to_string(static_cast<uint32_t>(kind));
}

uint64_t maxEntryFileSize() { return kEntryHeaderSize + ZSTD_compressBound(kMaxUncompressedSize); }

std::array<std::byte, kEntryHeaderSize> encodeEntryHeader(const EntryHeader &header) {
  std::array<std::byte, kEntryHeaderSize> bytes{};
  std::byte *out = bytes.data();
  std::memcpy(out + kMagicOffset, kEntryMagic.data(), kEntryMagic.size());
  detail::storeLittleEndian(out + kVersionOffset, header.formatVersion);
  detail::storeLittleEndian(out + kKeyHighOffset, header.key.high);
  detail::storeLittleEndian(out + kKeyLowOffset, header.key.low);
  detail::storeLittleEndian(out + kKindOffset, static_cast<uint32_t>(header.kind));
  detail::storeLittleEndian(out + kUncompressedSizeOffset, header.uncompressedSize);
  detail::storeLittleEndian(out + kCompressedSizeOffset, header.compressedSize);
  detail::storeLittleEndian(out + kContentHashHighOffset, header.contentHash.high);
  detail::storeLittleEndian(out + kContentHashLowOffset, header.contentHash.low);
  detail::storeLittleEndian(out + kChecksumOffset, headerChecksum(bytes));
  return bytes;
}

StatusOr<EntryHeader> decodeEntryHeader(std::span<const std::byte> bytes) {
  // The magic first, even on a short file: a foreign file is named as such, not as truncated.
  size_t magicBytesPresent = std::min(bytes.size(), kEntryMagic.size());
  auto magic = std::as_bytes(std::span(kEntryMagic.data(), kEntryMagic.size()));
  if (!std::equal(bytes.begin(), bytes.begin() + magicBytesPresent, magic.begin()))
    return Status::error("wrong magic " + quoteBytes(bytes.first(magicBytesPresent)) +
                         ", expected \"" + std::string(kEntryMagic) +
                         "\": not a hybrid cache entry");
  if (bytes.size() < kEntryHeaderSize)
    return Status::error("truncated header: " + std::to_string(bytes.size()) +
                         " bytes, a header has " + std::to_string(kEntryHeaderSize));

  const std::byte *in = bytes.data();
  EntryHeader header;
  header.formatVersion = detail::loadLittleEndian<uint32_t>(in + kVersionOffset);
  if (header.formatVersion != kEntryFormatVersion)
    return Status::error("unsupported format version " + std::to_string(header.formatVersion) +
                         " (this build reads version " + std::to_string(kEntryFormatVersion) + ")");

  uint64_t storedChecksum = detail::loadLittleEndian<uint64_t>(in + kChecksumOffset);
  uint64_t computedChecksum = headerChecksum(bytes);
  if (storedChecksum != computedChecksum)
    return Status::error("header checksum mismatch: stored " + hex64(storedChecksum) +
                         ", computed " + hex64(computedChecksum));

  header.key.high = detail::loadLittleEndian<uint64_t>(in + kKeyHighOffset);
  header.key.low = detail::loadLittleEndian<uint64_t>(in + kKeyLowOffset);
  header.kind = static_cast<EntryKind>(detail::loadLittleEndian<uint32_t>(in + kKindOffset));
  header.uncompressedSize = detail::loadLittleEndian<uint64_t>(in + kUncompressedSizeOffset);
  header.compressedSize = detail::loadLittleEndian<uint64_t>(in + kCompressedSizeOffset);
  header.contentHash.high = detail::loadLittleEndian<uint64_t>(in + kContentHashHighOffset);
  header.contentHash.low = detail::loadLittleEndian<uint64_t>(in + kContentHashLowOffset);
  return header;
}

StatusOr<std::vector<std::byte>> encodeEntry(const CacheKey &key, EntryKind kind,
                                             std::span<const std::byte> payload, int zstdLevel) {
  if (payload.size() > kMaxUncompressedSize)
    return Status::error("payload of " + std::to_string(payload.size()) +
                         " bytes exceeds the entry limit of " +
                         std::to_string(kMaxUncompressedSize) + " bytes");
  zstdLevel = std::clamp(zstdLevel, ZSTD_minCLevel(), ZSTD_maxCLevel());

  std::vector<std::byte> entry;
  HYBRID_RETURN_IF_ERROR(detail::resizeBuffer(
      entry, kEntryHeaderSize + ZSTD_compressBound(payload.size()), "a cache entry"));
  size_t compressedSize =
      ZSTD_compress(entry.data() + kEntryHeaderSize, entry.size() - kEntryHeaderSize,
                    payload.data(), payload.size(), zstdLevel);
  if (ZSTD_isError(compressedSize))
    return Status::error(std::string("zstd compression failed: ") +
                         ZSTD_getErrorName(compressedSize));
  entry.resize(kEntryHeaderSize + compressedSize);

  EntryHeader header;
  header.key = key;
  header.kind = kind;
  header.uncompressedSize = payload.size();
  header.compressedSize = compressedSize;
  header.contentHash = hashPayload(payload);
  std::array<std::byte, kEntryHeaderSize> headerBytes = encodeEntryHeader(header);
  std::copy(headerBytes.begin(), headerBytes.end(), entry.begin());
  return entry;
}

StatusOr<std::vector<std::byte>> decodeEntry(std::span<const std::byte> bytes,
                                             const CacheKey &expectedKey, EntryKind expectedKind) {
  HYBRID_ASSIGN_OR_RETURN(EntryHeader header, decodeEntryHeader(bytes));
  if (header.key != expectedKey)
    return Status::error("key mismatch: entry holds " + header.key.hex() + ", expected " +
                         expectedKey.hex());
  if (header.kind != expectedKind)
    return Status::error("kind mismatch: entry holds " + entryKindName(header.kind) +
                         ", expected " + entryKindName(expectedKind));
  if (header.uncompressedSize > kMaxUncompressedSize)
    return Status::error("uncompressed size " + std::to_string(header.uncompressedSize) +
                         " exceeds the entry limit of " + std::to_string(kMaxUncompressedSize) +
                         " bytes");

  std::span<const std::byte> compressed = bytes.subspan(kEntryHeaderSize);
  if (header.compressedSize != compressed.size())
    return Status::error("compressed size mismatch: header says " +
                         std::to_string(header.compressedSize) + " bytes, the file has " +
                         std::to_string(compressed.size()) + " after the header");

  // The frame states its own content size; checking it first means a header that lies about
  // the size costs no allocation.
  unsigned long long frameContentSize =
      ZSTD_getFrameContentSize(compressed.data(), compressed.size());
  if (frameContentSize == ZSTD_CONTENTSIZE_ERROR)
    return Status::error("zstd error: the payload is not a valid zstd frame");
  if (frameContentSize != ZSTD_CONTENTSIZE_UNKNOWN && frameContentSize != header.uncompressedSize)
    return Status::error("decompressed size mismatch: header says " +
                         std::to_string(header.uncompressedSize) + " bytes, the zstd frame " +
                         std::to_string(frameContentSize));

  std::vector<std::byte> payload;
  HYBRID_RETURN_IF_ERROR(
      detail::resizeBuffer(payload, header.uncompressedSize, "a cache entry's payload"));
  size_t decompressedSize =
      ZSTD_decompress(payload.data(), payload.size(), compressed.data(), compressed.size());
  if (ZSTD_isError(decompressedSize)) {
    if (ZSTD_getErrorCode(decompressedSize) == ZSTD_error_dstSize_tooSmall)
      return Status::error("decompressed size mismatch: the payload decompresses to more than "
                           "the header's " +
                           std::to_string(header.uncompressedSize) + " bytes");
    return Status::error(std::string("zstd error: ") + ZSTD_getErrorName(decompressedSize));
  }
  if (decompressedSize != header.uncompressedSize)
    return Status::error("decompressed size mismatch: header says " +
                         std::to_string(header.uncompressedSize) +
                         " bytes, the payload decompresses to " + std::to_string(decompressedSize));

  ContentHash computedHash = hashPayload(payload);
  if (computedHash != header.contentHash)
    return Status::error("content hash mismatch: stored " + hexHash(header.contentHash) +
                         ", computed " + hexHash(computedHash));
  return payload;
}

} // namespace hybrid::cache
