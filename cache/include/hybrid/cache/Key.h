// Cache keys: a 128-bit XXH3 hash of a canonical record of typed, named fields.
//
// What goes into a key decides what can be reused, so the two kinds of entries hash different
// things:
//  - the plan's key covers the model structure (config, layer kinds and shapes), the shape
//    buckets, the target (device kind, architecture), the compiler version and every option that
//    changes the output — never weight values, so a fine-tuned checkpoint reuses the plan;
//  - the weight archive has its own key, built from the checkpoint fingerprint (file names, sizes
//    and content hashes) and the layout and quantization choices applied to it.
// A field left out of a key is a field whose change silently reuses a stale entry; a field put in
// needlessly only costs a recompile. When in doubt, add the field.
//
// The record is canonical: every field is hashed as (type tag, name length, name, value length,
// value) with fixed-width little-endian integers, so ("ab","c") and ("a","bc") differ and the
// integer 42 differs from the string "42". Field order matters; callers add fields in a fixed
// order. canonicalText() renders the same record for people, so a surprising cache miss is
// explained by diffing the texts of two builds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

struct XXH3_state_s; // xxhash's streaming state; the header stays out of this interface.

namespace hybrid::cache {

struct CacheKey {
  uint64_t high = 0;
  uint64_t low = 0;

  // 32 lowercase hex digits, `high` first (the canonical XXH128 spelling).
  std::string hex() const;
  // Parses exactly 32 hex digits (either case); nullopt for anything else.
  static std::optional<CacheKey> fromHex(std::string_view text);

  friend bool operator==(const CacheKey &, const CacheKey &) = default;
};

// Integer types without an add() overload of their own.
template <typename T>
concept OtherInteger = std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                       !std::is_same_v<T, int64_t> && !std::is_same_v<T, uint64_t>;

// Fields are added in a fixed order; a moved-from builder may only be destroyed or assigned to.
class KeyBuilder {
public:
  KeyBuilder();
  ~KeyBuilder();
  KeyBuilder(KeyBuilder &&) noexcept;
  KeyBuilder &operator=(KeyBuilder &&) noexcept;
  KeyBuilder(const KeyBuilder &) = delete;
  KeyBuilder &operator=(const KeyBuilder &) = delete;

  KeyBuilder &add(std::string_view name, std::string_view value);
  // Without this overload a string literal would pick add(name, bool): pointer-to-bool is a
  // standard conversion and beats the user-defined conversion to string_view.
  KeyBuilder &add(std::string_view name, const char *value) {
    return add(name, std::string_view(value));
  }
  KeyBuilder &add(std::string_view name, int64_t value);
  KeyBuilder &add(std::string_view name, uint64_t value);
  // Hashes the bit pattern: 0.0 and -0.0 give different keys, as they may give different code.
  KeyBuilder &add(std::string_view name, double value);
  KeyBuilder &add(std::string_view name, bool value);
  // Any other integer type (int, unsigned, long long, ...): signed ones are recorded as int64,
  // unsigned ones as uint64, so `add("layers", 4)` is neither ambiguous nor a bool.
  template <OtherInteger Integer> KeyBuilder &add(std::string_view name, Integer value) {
    if constexpr (std::is_signed_v<Integer>)
      return add(name, static_cast<int64_t>(value));
    else
      return add(name, static_cast<uint64_t>(value));
  }
  // Raw bytes (a serialized blob, a file's content). The text shows only the size and a hash.
  KeyBuilder &addBytes(std::string_view name, std::span<const std::byte> value);

  // One `name=value` line per field, in the order added: strings quoted and escaped, integers
  // bare (unsigned with a `u` suffix), doubles always with a `.` or an exponent, booleans as
  // true/false, bytes as `<N bytes xxh3:HEX>`.
  const std::string &canonicalText() const { return text_; }
  // The key of the fields added so far; the builder stays usable.
  CacheKey finish() const;

private:
  enum class FieldType : uint8_t;
  void addField(FieldType type, std::string_view name, std::span<const std::byte> value,
                std::string_view valueText);

  struct StateDeleter {
    void operator()(XXH3_state_s *state) const;
  };
  std::unique_ptr<XXH3_state_s, StateDeleter> state_;
  std::string text_;
};

} // namespace hybrid::cache
