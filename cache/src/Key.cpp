// Cache keys: the canonical record fed to XXH3-128, and its human-readable twin.
#include "hybrid/cache/Key.h"

#include "LittleEndian.h"

#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <xxhash.h>

namespace hybrid::cache {

// Tags are part of the hashed record: never renumber them, only add new ones.
enum class KeyBuilder::FieldType : uint8_t {
  String = 1,
  Int64 = 2,
  UInt64 = 3,
  Double = 4,
  Bool = 5,
  Bytes = 6,
};

namespace {

// Hashed before the first field; bump it whenever the record encoding changes, so old keys can
// never match a record encoded differently.
constexpr std::string_view kRecordPreamble = "hybrid.cache.key-record.v1";

std::string hex128(uint64_t high, uint64_t low) {
  char digits[33];
  std::snprintf(digits, sizeof digits, "%016llx%016llx", static_cast<unsigned long long>(high),
                static_cast<unsigned long long>(low));
  return std::string(digits, 32);
}

std::optional<unsigned> hexDigitValue(char c) {
  if (c >= '0' && c <= '9')
    return static_cast<unsigned>(c - '0');
  if (c >= 'a' && c <= 'f')
    return static_cast<unsigned>(c - 'a' + 10);
  if (c >= 'A' && c <= 'F')
    return static_cast<unsigned>(c - 'A' + 10);
  return std::nullopt;
}

// Keeps each field on one line of canonicalText(): control characters, quotes, backslashes and
// (in names) '=' become \xNN or \" / \\. Non-ASCII bytes stay as they are (UTF-8 names read well).
std::string escapeForText(std::string_view text, bool escapeEquals) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    auto byte = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (byte < 0x20 || byte == 0x7f || (escapeEquals && c == '=')) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out;
}

// Shortest text that reads back to the same double, always recognizable as a double (a `.` or an
// exponent), so `1.0` never reads like the integer `1`. NaNs show their bits, which are hashed.
std::string formatDouble(double value) {
  if (std::isnan(value)) {
    char text[32];
    std::snprintf(text, sizeof text, "nan(0x%016llx)",
                  static_cast<unsigned long long>(std::bit_cast<uint64_t>(value)));
    return text;
  }
  char buffer[64];
  auto [end, error] = std::to_chars(buffer, buffer + sizeof buffer, value);
  std::string text(buffer, error == std::errc() ? end : buffer);
  if (text.find_first_of(".en") == std::string::npos) // "inf" contains an 'n'
    text += ".0";
  return text;
}

template <typename UInt> std::array<std::byte, sizeof(UInt)> littleEndianBytes(UInt value) {
  std::array<std::byte, sizeof(UInt)> bytes;
  detail::storeLittleEndian(bytes.data(), value);
  return bytes;
}

} // namespace

std::string CacheKey::hex() const { return hex128(high, low); }

std::optional<CacheKey> CacheKey::fromHex(std::string_view text) {
  if (text.size() != 32)
    return std::nullopt;
  uint64_t halves[2] = {0, 0};
  for (size_t i = 0; i < 32; ++i) {
    std::optional<unsigned> digit = hexDigitValue(text[i]);
    if (!digit)
      return std::nullopt;
    halves[i / 16] = (halves[i / 16] << 4) | *digit;
  }
  return CacheKey{halves[0], halves[1]};
}

void KeyBuilder::StateDeleter::operator()(XXH3_state_s *state) const { XXH3_freeState(state); }

KeyBuilder::KeyBuilder() : state_(XXH3_createState()) {
  // Only a failed allocation of a few hundred bytes gets here; like operator new without
  // exceptions, there is nothing sensible left to do.
  if (!state_ || XXH3_128bits_reset(state_.get()) != XXH_OK) {
    std::fputs("hybrid::cache::KeyBuilder: cannot allocate the XXH3 state\n", stderr);
    std::abort();
  }
  XXH3_128bits_update(state_.get(), kRecordPreamble.data(), kRecordPreamble.size());
}

KeyBuilder::~KeyBuilder() = default;
KeyBuilder::KeyBuilder(KeyBuilder &&) noexcept = default;
KeyBuilder &KeyBuilder::operator=(KeyBuilder &&) noexcept = default;

void KeyBuilder::addField(FieldType type, std::string_view name, std::span<const std::byte> value,
                          std::string_view valueText) {
  // (tag u8, name length u64, name, value length u64, value): lengths make every field
  // self-delimiting, the tag keeps values of different types apart.
  std::array<std::byte, 1 + sizeof(uint64_t)> tagAndNameLength;
  tagAndNameLength[0] = static_cast<std::byte>(type);
  detail::storeLittleEndian(tagAndNameLength.data() + 1, static_cast<uint64_t>(name.size()));
  auto valueLength = littleEndianBytes(static_cast<uint64_t>(value.size()));

  XXH3_state_s *state = state_.get();
  XXH3_128bits_update(state, tagAndNameLength.data(), tagAndNameLength.size());
  if (!name.empty())
    XXH3_128bits_update(state, name.data(), name.size());
  XXH3_128bits_update(state, valueLength.data(), valueLength.size());
  if (!value.empty())
    XXH3_128bits_update(state, value.data(), value.size());

  text_ += escapeForText(name, /*escapeEquals=*/true);
  text_ += '=';
  text_ += valueText;
  text_ += '\n';
}

KeyBuilder &KeyBuilder::add(std::string_view name, std::string_view value) {
  addField(FieldType::String, name, std::as_bytes(std::span(value.data(), value.size())),
           '"' + escapeForText(value, /*escapeEquals=*/false) + '"');
  return *this;
}

KeyBuilder &KeyBuilder::add(std::string_view name, int64_t value) {
  auto bytes = littleEndianBytes(static_cast<uint64_t>(value));
  addField(FieldType::Int64, name, bytes, std::to_string(value));
  return *this;
}

KeyBuilder &KeyBuilder::add(std::string_view name, uint64_t value) {
  auto bytes = littleEndianBytes(value);
  addField(FieldType::UInt64, name, bytes, std::to_string(value) + 'u');
  return *this;
}

KeyBuilder &KeyBuilder::add(std::string_view name, double value) {
  auto bytes = littleEndianBytes(std::bit_cast<uint64_t>(value));
  addField(FieldType::Double, name, bytes, formatDouble(value));
  return *this;
}

KeyBuilder &KeyBuilder::add(std::string_view name, bool value) {
  std::byte byte{value ? uint8_t{1} : uint8_t{0}};
  addField(FieldType::Bool, name, std::span(&byte, 1), value ? "true" : "false");
  return *this;
}

KeyBuilder &KeyBuilder::addBytes(std::string_view name, std::span<const std::byte> value) {
  XXH128_hash_t contentHash = XXH3_128bits(value.data(), value.size());
  std::string valueText = '<' + std::to_string(value.size()) +
                          " bytes xxh3:" + hex128(contentHash.high64, contentHash.low64) + '>';
  addField(FieldType::Bytes, name, value, valueText);
  return *this;
}

CacheKey KeyBuilder::finish() const {
  XXH128_hash_t digest = XXH3_128bits_digest(state_.get());
  return CacheKey{digest.high64, digest.low64};
}

} // namespace hybrid::cache
