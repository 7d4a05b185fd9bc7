// Explicit little-endian encoding for the cache's on-disk bytes and hashed records: every field
// is written byte by byte, so the format does not depend on the host's layout or padding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace hybrid::cache::detail {

template <typename UInt> void storeLittleEndian(std::byte *out, UInt value) {
  static_assert(std::is_unsigned_v<UInt>);
  for (size_t i = 0; i < sizeof(UInt); ++i)
    out[i] = static_cast<std::byte>(value >> (8 * i));
}

template <typename UInt> UInt loadLittleEndian(const std::byte *in) {
  static_assert(std::is_unsigned_v<UInt>);
  UInt value = 0;
  for (size_t i = 0; i < sizeof(UInt); ++i)
    value |= static_cast<UInt>(std::to_integer<uint8_t>(in[i])) << (8 * i);
  return value;
}

} // namespace hybrid::cache::detail
