// Compilation-cache entries: the header and checksums, then the zstd payload.
#include "hybrid/cache/Entry.h"

#include <span>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte *>(data), size);
  auto header = hybrid::cache::decodeEntryHeader(bytes);
  if (header.isOk())
    (void)hybrid::cache::decodeEntry(bytes, header->key, header->kind);
  return 0;
}
