// Byte-level BPE: the loaders of tokenizer.json and tiktoken.model, PCRE2 pre-tokenization, the
// two merge rules, decoding. docs/tokenizer.md describes the behaviour; the Hugging Face
// tokenizers and tiktoken libraries are the references it is tested against (goldens made by
// tools/scripts/make-tokenizer-testdata.py).
#include "hybrid/runtime/Tokenizer.h"

#include "hybrid/runtime/StatusHelpers.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_map>

namespace hybrid {
namespace {

using json = nlohmann::json;

// Ids are kept in dense tables: a file whose largest id is far beyond its entry count is refused
// rather than allocating for the gap.
constexpr int64_t kMaxIdGap = 1 << 20;

// ---- UTF-8 ------------------------------------------------------------------------------------

// The length of the valid UTF-8 character at s[i], 0 if none starts there. With `prefix`, set
// when the bytes up to the end of s are a valid but unfinished character.
size_t utf8Char(std::string_view s, size_t i, bool *prefix = nullptr) {
  if (prefix)
    *prefix = false;
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80)
    return 1;
  size_t length;
  unsigned char lo = 0x80, hi = 0xBF; // the allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    length = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    length = 3;
    if (b0 == 0xE0)
      lo = 0xA0;
    if (b0 == 0xED)
      hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    length = 4;
    if (b0 == 0xF0)
      lo = 0x90;
    if (b0 == 0xF4)
      hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k < length; ++k) {
    if (i + k >= s.size()) {
      if (prefix)
        *prefix = true;
      return 0;
    }
    const unsigned char b = byte(i + k);
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF))
      return 0;
  }
  return length;
}

bool validUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8Char(s, i);
    if (n == 0)
      return false;
    i += n;
  }
  return true;
}

// The bytes of a maximal invalid subsequence starting at s[i] (Unicode's "maximal subpart":
// a valid start byte followed by valid continuations that stop short; else one byte).
size_t invalidRun(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  size_t length = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF)
    length = 2;
  else if (b0 >= 0xE0 && b0 <= 0xEF) {
    length = 3;
    lo = b0 == 0xE0 ? 0xA0 : 0x80;
    hi = b0 == 0xED ? 0x9F : 0xBF;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    length = 4;
    lo = b0 == 0xF0 ? 0x90 : 0x80;
    hi = b0 == 0xF4 ? 0x8F : 0xBF;
  } else {
    return 1;
  }
  size_t k = 1;
  for (; k < length && i + k < s.size(); ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF))
      break;
  }
  return k;
}

// Code points of valid UTF-8 (the caller checked it).
std::vector<uint32_t> codePoints(std::string_view s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8Char(s, i);
    uint32_t c = static_cast<unsigned char>(s[i]);
    if (n == 2)
      c &= 0x1F;
    else if (n == 3)
      c &= 0x0F;
    else if (n == 4)
      c &= 0x07;
    for (size_t k = 1; k < n; ++k)
      c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(c);
    i += n == 0 ? 1 : n;
  }
  return out;
}

// ---- GPT-2's byte <-> character table ------------------------------------------------------------

// Printable bytes stand for themselves; the others (controls, space, 0x7F-0xA0, 0xAD) map to
// U+0100 onwards in byte order.
struct ByteTable {
  std::array<uint32_t, 256> charOf{};
  std::unordered_map<uint32_t, uint8_t> byteOf;
  ByteTable() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      charOf[b] = printable ? b : next++;
      byteOf[charOf[b]] = uint8_t(b);
    }
  }
};

const ByteTable &byteTable() {
  static const ByteTable table;
  return table;
}

// A vocabulary string of the byte-level alphabet -> its bytes; nullopt when a character is not
// in the table (an added token's own string, which never comes out of BPE).
std::optional<std::string> unmapBytes(std::string_view token) {
  std::string out;
  for (uint32_t c : codePoints(token)) {
    auto found = byteTable().byteOf.find(c);
    if (found == byteTable().byteOf.end())
      return std::nullopt;
    out += char(found->second);
  }
  return out;
}

// ---- Base64 (tiktoken.model) --------------------------------------------------------------

std::optional<std::string> base64Decode(std::string_view text) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z')
      return c - 'A';
    if (c >= 'a' && c <= 'z')
      return c - 'a' + 26;
    if (c >= '0' && c <= '9')
      return c - '0' + 52;
    if (c == '+')
      return 62;
    if (c == '/')
      return 63;
    return -1;
  };
  if (text.empty() || text.size() % 4 != 0)
    return std::nullopt;
  std::string out;
  for (size_t i = 0; i < text.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = text[i + k];
      if (c == '=' && i + 4 == text.size() && k >= 2) {
        v[k] = 0;
        ++pad;
        continue;
      }
      if (pad > 0 || (v[k] = value(c)) < 0)
        return std::nullopt;
    }
    const uint32_t bits = (uint32_t(v[0]) << 18) | (uint32_t(v[1]) << 12) | (uint32_t(v[2]) << 6) |
                          uint32_t(v[3]);
    out += char(bits >> 16);
    if (pad < 2)
      out += char((bits >> 8) & 0xFF);
    if (pad < 1)
      out += char(bits & 0xFF);
  }
  return out;
}

// ---- Regexes ----------------------------------------------------------------------------------

// Rust regex / Oniguruma class intersections, [A&&[^B]] and [A&&[B]] (Kimi's pattern uses the
// first), become (?:(?![B])[A]) and (?:(?=[B])[A]), which PCRE2 takes. Other syntax is kept.
StatusOr<std::string> rewriteClassIntersections(std::string_view pattern) {
  std::string out;
  for (size_t i = 0; i < pattern.size();) {
    const char c = pattern[i];
    if (c == '\\') {
      out.append(pattern.substr(i, 2));
      i += 2;
      continue;
    }
    if (c != '[') {
      out += c;
      ++i;
      continue;
    }
    // A character class: find its end, noting one nested [..] after "&&".
    size_t j = i + 1;
    if (j < pattern.size() && pattern[j] == '^')
      ++j;
    if (j < pattern.size() && pattern[j] == ']')
      ++j; // a literal ] first
    size_t intersection = std::string_view::npos, nestedEnd = std::string_view::npos;
    bool closed = false;
    while (j < pattern.size()) {
      if (pattern[j] == '\\') {
        j += 2;
        continue;
      }
      if (pattern[j] == '[' && j + 1 < pattern.size() && pattern[j + 1] == ':') {
        const size_t end = pattern.find(":]", j + 2); // POSIX [:alpha:]
        if (end == std::string_view::npos)
          break;
        j = end + 2;
        continue;
      }
      if (pattern.compare(j, 3, "&&[") == 0 && intersection == std::string_view::npos) {
        intersection = j;
        size_t k = j + 3;
        if (k < pattern.size() && pattern[k] == '^')
          ++k;
        if (k < pattern.size() && pattern[k] == ']')
          ++k;
        while (k < pattern.size() && pattern[k] != ']')
          k += pattern[k] == '\\' ? 2 : 1;
        if (k >= pattern.size())
          break;
        nestedEnd = k;
        j = k + 1;
        continue;
      }
      if (pattern[j] == ']') {
        closed = true;
        break;
      }
      ++j;
    }
    if (!closed)
      return Status::error("unterminated character class at offset " + std::to_string(i));
    if (intersection == std::string_view::npos) {
      out.append(pattern.substr(i, j + 1 - i));
    } else {
      if (pattern[i + 1] == '^' || nestedEnd + 1 != j)
        return Status::error("unsupported class intersection at offset " + std::to_string(i));
      const std::string_view left = pattern.substr(i + 1, intersection - i - 1);
      const bool negated = pattern[intersection + 3] == '^';
      const size_t rightStart = intersection + 3 + (negated ? 1 : 0);
      const std::string_view right = pattern.substr(rightStart, nestedEnd - rightStart);
      out += negated ? "(?:(?![" : "(?:(?=[";
      out.append(right);
      out += "])[";
      out.append(left);
      out += "])";
    }
    i = j + 1;
  }
  return out;
}

class Regex {
public:
  static StatusOr<std::shared_ptr<Regex>> compile(std::string_view pattern) {
    StatusOr<std::string> rewritten = rewriteClassIntersections(pattern);
    if (!rewritten)
      return rewritten.status();
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code *code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten->data()),
                                     rewritten->size(), PCRE2_UTF | PCRE2_UCP, &error, &offset,
                                     nullptr);
    if (!code) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      return Status::error("bad regex at offset " + std::to_string(offset) + ": " +
                           reinterpret_cast<const char *>(message.data()));
    }
    return std::shared_ptr<Regex>(new Regex(code));
  }
  ~Regex() { pcre2_code_free(code_); }

  // Appends the [start, end) byte ranges of the successive non-overlapping matches in text
  // (valid UTF-8). Empty matches are skipped.
  Status matches(std::string_view text, std::vector<std::pair<size_t, size_t>> &out) const {
    pcre2_match_data *data = pcre2_match_data_create_from_pattern(code_, nullptr);
    if (!data)
      return Status::error("out of memory for a regex match");
    Status status;
    size_t at = 0;
    while (at <= text.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), at,
                                 PCRE2_NO_UTF_CHECK, data, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH)
        break;
      if (rc < 0) {
        std::array<PCRE2_UCHAR, 256> message{};
        pcre2_get_error_message(rc, message.data(), message.size());
        status = Status::error(std::string("regex match failed: ") +
                               reinterpret_cast<const char *>(message.data()));
        break;
      }
      const PCRE2_SIZE *ovector = pcre2_get_ovector_pointer(data);
      const size_t start = ovector[0], end = ovector[1];
      if (end > start) {
        out.emplace_back(start, end);
        at = end;
      } else { // an empty match: move one character on
        if (start >= text.size())
          break;
        const size_t n = utf8Char(text, start);
        at = start + (n == 0 ? 1 : n);
      }
    }
    pcre2_match_data_free(data);
    return status;
  }

private:
  explicit Regex(pcre2_code *code) : code_(code) {}
  pcre2_code *code_;
};

// GPT-2's split pattern (the ByteLevel pre-tokenizer's use_regex).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Kimi's split pattern: pat_str of tokenization_kimi.py (moonshotai/Kimi-K2-Instruct and
// Kimi-Linear-48B-A3B-Instruct), the eight alternatives joined by |.
constexpr std::string_view kKimiPattern =
    R"([\p{Han}]+|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"(\p{N}{1,3}|)"
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*|)"
    R"(\s*[\r\n]+|)"
    R"(\s+(?!\S)|)"
    R"(\s+)";

// One step of pre-tokenization (a Hugging Face Split, or ByteLevel's prefix space + regex).
struct SplitStep {
  enum class Behavior { Isolated, Removed, MergedWithPrevious, MergedWithNext };
  std::shared_ptr<Regex> regex; // null: no split (ByteLevel without use_regex)
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  bool addPrefixSpace = false;

  Status apply(const std::string &piece, std::vector<std::string> &out) const {
    std::string text = piece;
    if (addPrefixSpace && (text.empty() || text[0] != ' '))
      text.insert(text.begin(), ' ');
    if (!regex) {
      out.push_back(std::move(text));
      return Status::ok();
    }
    std::vector<std::pair<size_t, size_t>> found;
    if (Status status = regex->matches(text, found); !status)
      return status;
    // Alternate gaps and matches: (range, isMatch); `invert` swaps which ranges are "matches".
    std::vector<std::pair<std::pair<size_t, size_t>, bool>> parts;
    size_t at = 0;
    for (auto [start, end] : found) {
      if (start > at)
        parts.push_back({{at, start}, invert});
      parts.push_back({{start, end}, !invert});
      at = end;
    }
    if (at < text.size())
      parts.push_back({{at, text.size()}, invert});
    std::string carry; // MergedWithNext: a match waiting for what follows
    for (size_t k = 0; k < parts.size(); ++k) {
      const auto [range, isMatch] = parts[k];
      std::string part = text.substr(range.first, range.second - range.first);
      switch (behavior) {
      case Behavior::Isolated:
        out.push_back(std::move(part));
        break;
      case Behavior::Removed:
        if (!isMatch)
          out.push_back(std::move(part));
        break;
      case Behavior::MergedWithPrevious:
        if (isMatch && !out.empty() && k > 0)
          out.back() += part;
        else
          out.push_back(std::move(part));
        break;
      case Behavior::MergedWithNext:
        if (isMatch) {
          carry += part;
        } else {
          out.push_back(carry + part);
          carry.clear();
        }
        break;
      }
    }
    if (!carry.empty())
      out.push_back(std::move(carry));
    return Status::ok();
  }
};

enum class MergeRule { PairRanks, ByteRanks };

struct AddedToken {
  std::string content;
  int64_t id;
  bool special;
};

std::string readFile(const std::filesystem::path &path, Status &status) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    status = Status::error(path.string() + ": cannot open");
    return {};
  }
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad())
    status = Status::error(path.string() + ": read failed");
  return buffer.str();
}

} // namespace

// ---- The tokenizer ------------------------------------------------------------------------------

struct Tokenizer::Impl {
  MergeRule rule = MergeRule::PairRanks;
  std::vector<SplitStep> steps;
  // Regular tokens: raw bytes -> id (tiktoken: the rank), and id -> bytes for decoding.
  std::unordered_map<std::string, int64_t> idOfBytes;
  std::vector<std::string> bytesOfId;
  std::vector<uint8_t> kindOfId; // 0 unused, 1 regular, 2 added (non-special), 3 special
  std::array<int64_t, 256> byteToken{};
  // PairRanks: (left id, right id) -> (rank, merged id).
  std::unordered_map<uint64_t, std::pair<int64_t, int64_t>> merges;
  bool ignoreMerges = false;
  // Added tokens by their first byte, longest first.
  std::array<std::vector<AddedToken>, 256> addedByFirstByte;
  std::unordered_map<std::string, int64_t> addedIds;
  ChatFormat chatFormat = ChatFormat::None;
  std::optional<int64_t> bosForPrompts;

  Status setId(int64_t id, std::string bytes, uint8_t kind, const std::string &where) {
    if (id < 0 || id > int64_t(std::numeric_limits<int32_t>::max()))
      return Status::error(where + ": id " + std::to_string(id) + " is out of range");
    if (size_t(id) >= bytesOfId.size()) {
      bytesOfId.resize(size_t(id) + 1);
      kindOfId.resize(size_t(id) + 1, 0);
    }
    bytesOfId[size_t(id)] = std::move(bytes);
    kindOfId[size_t(id)] = kind;
    return Status::ok();
  }

  Status addAddedToken(const std::string &content, int64_t id, bool special,
                       const std::string &where) {
    if (content.empty())
      return Status::error(where + ": an added token's content is empty");
    if (Status status = setId(id, content, special ? 3 : 2, where); !status)
      return status;
    addedIds[content] = id;
    auto &bucket = addedByFirstByte[static_cast<unsigned char>(content[0])];
    bucket.push_back({content, id, special});
    std::stable_sort(bucket.begin(), bucket.end(), [](const AddedToken &a, const AddedToken &b) {
      return a.content.size() > b.content.size();
    });
    return Status::ok();
  }

  Status finishLoad(std::string_view config, const std::string &configOrigin, bool hasTemplate);

  Status bpe(std::string_view piece, std::vector<int64_t> &out) const;
  Status encodeOrdinary(std::string_view text, std::vector<int64_t> &out) const;
};

Status Tokenizer::Impl::bpe(std::string_view piece, std::vector<int64_t> &out) const {
  if (piece.empty())
    return Status::ok();
  if (rule == MergeRule::ByteRanks || ignoreMerges) {
    auto whole = idOfBytes.find(std::string(piece));
    if (whole != idOfBytes.end()) {
      out.push_back(whole->second);
      return Status::ok();
    }
  }
  // Symbols: byte ranges of the piece, with their ids. Each round merges the adjacent pair of
  // lowest rank, the leftmost among equals (tiktoken's _byte_pair_merge and tokenizers'
  // Word::merge_all agree on this order).
  struct Symbol {
    size_t start, end;
    int64_t id;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) {
    const int64_t id = byteToken[static_cast<unsigned char>(piece[i])];
    if (id < 0)
      return Status::error("no token for the byte 0x" +
                           escapeBytes(piece.substr(i, 1), NonAscii::Escape) +
                           " in the vocabulary");
    symbols.push_back({i, i + 1, id});
  }
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  auto pairRank = [&](size_t k, int64_t *merged) -> int64_t {
    const Symbol &a = symbols[k], &b = symbols[k + 1];
    if (rule == MergeRule::PairRanks) {
      auto found = merges.find((uint64_t(uint32_t(a.id)) << 32) | uint32_t(b.id));
      if (found == merges.end())
        return kNone;
      *merged = found->second.second;
      return found->second.first;
    }
    auto found = idOfBytes.find(std::string(piece.substr(a.start, b.end - a.start)));
    if (found == idOfBytes.end())
      return kNone;
    *merged = found->second;
    return found->second;
  };
  std::vector<int64_t> ranks(symbols.size(), kNone), mergedIds(symbols.size(), -1);
  for (size_t k = 0; k + 1 < symbols.size(); ++k)
    ranks[k] = pairRank(k, &mergedIds[k]);
  while (symbols.size() > 1) {
    size_t best = 0;
    for (size_t k = 1; k + 1 < symbols.size(); ++k)
      if (ranks[k] < ranks[best])
        best = k;
    if (ranks[best] == kNone)
      break;
    symbols[best].end = symbols[best + 1].end;
    symbols[best].id = mergedIds[best];
    symbols.erase(symbols.begin() + long(best) + 1);
    ranks.erase(ranks.begin() + long(best) + 1);
    mergedIds.erase(mergedIds.begin() + long(best) + 1);
    ranks.back() = kNone;
    if (best + 1 < symbols.size())
      ranks[best] = pairRank(best, &mergedIds[best]);
    else
      ranks[best] = kNone;
    if (best > 0)
      ranks[best - 1] = pairRank(best - 1, &mergedIds[best - 1]);
  }
  for (const Symbol &symbol : symbols)
    out.push_back(symbol.id);
  return Status::ok();
}

Status Tokenizer::Impl::encodeOrdinary(std::string_view text, std::vector<int64_t> &out) const {
  if (text.empty())
    return Status::ok();
  std::vector<std::string> pieces{std::string(text)};
  for (const SplitStep &step : steps) {
    std::vector<std::string> next;
    for (const std::string &piece : pieces)
      if (Status status = step.apply(piece, next); !status)
        return status;
    pieces.swap(next);
  }
  for (const std::string &piece : pieces)
    if (Status status = bpe(piece, out); !status)
      return status;
  return Status::ok();
}

namespace {

std::string fieldError(const std::string &origin, const std::string &field,
                       const std::string &message) {
  return origin + ": " + field + ": " + message;
}

// The pre-tokenizer of a tokenizer.json (null, ByteLevel, Split or a Sequence of them).
Status parsePreTokenizer(const json &spec, const std::string &origin, const std::string &field,
                         std::vector<SplitStep> &steps, bool &byteLevel) {
  if (spec.is_null())
    return Status::ok();
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string())
    return Status::error(fieldError(origin, field, "expected an object with a \"type\""));
  const std::string type = spec["type"].get<std::string>();
  auto flag = [&](const char *key, bool fallback, bool &value) -> Status {
    if (!spec.contains(key) || spec[key].is_null()) {
      value = fallback;
      return Status::ok();
    }
    if (!spec[key].is_boolean())
      return Status::error(fieldError(origin, field + "." + key, "expected true or false"));
    value = spec[key].get<bool>();
    return Status::ok();
  };
  if (type == "Sequence") {
    if (!spec.contains("pretokenizers") || !spec["pretokenizers"].is_array())
      return Status::error(fieldError(origin, field + ".pretokenizers", "expected an array"));
    for (size_t i = 0; i < spec["pretokenizers"].size(); ++i)
      if (Status status = parsePreTokenizer(spec["pretokenizers"][i], origin,
                                            field + ".pretokenizers[" + std::to_string(i) + "]",
                                            steps, byteLevel);
          !status)
        return status;
    return Status::ok();
  }
  if (type == "ByteLevel") {
    byteLevel = true;
    SplitStep step;
    bool useRegex = true;
    if (Status s = flag("use_regex", true, useRegex); !s)
      return s;
    if (Status s = flag("add_prefix_space", false, step.addPrefixSpace); !s)
      return s;
    if (useRegex) {
      StatusOr<std::shared_ptr<Regex>> regex = Regex::compile(kGpt2Pattern);
      if (!regex)
        return Status::error(fieldError(origin, field, regex.status().message()));
      step.regex = *regex;
    }
    steps.push_back(std::move(step));
    return Status::ok();
  }
  if (type == "Split") {
    SplitStep step;
    const json pattern = spec.value("pattern", json());
    std::string source;
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      source = pattern["Regex"].get<std::string>();
    } else if (pattern.is_object() && pattern.contains("String") &&
               pattern["String"].is_string()) {
      source = "\\Q" + pattern["String"].get<std::string>() + "\\E";
      if (pattern["String"].get<std::string>().find("\\E") != std::string::npos)
        return Status::error(fieldError(origin, field + ".pattern.String",
                                        "a literal containing \\E is not supported"));
    } else {
      return Status::error(
          fieldError(origin, field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}"));
    }
    StatusOr<std::shared_ptr<Regex>> regex = Regex::compile(source);
    if (!regex)
      return Status::error(fieldError(origin, field + ".pattern", regex.status().message()));
    step.regex = *regex;
    const std::string behavior = spec.value("behavior", json("Isolated")).is_string()
                                     ? spec.value("behavior", std::string("Isolated"))
                                     : std::string("?");
    if (behavior == "Isolated")
      step.behavior = SplitStep::Behavior::Isolated;
    else if (behavior == "Removed")
      step.behavior = SplitStep::Behavior::Removed;
    else if (behavior == "MergedWithPrevious")
      step.behavior = SplitStep::Behavior::MergedWithPrevious;
    else if (behavior == "MergedWithNext")
      step.behavior = SplitStep::Behavior::MergedWithNext;
    else
      return Status::error(fieldError(origin, field + ".behavior",
                                      "\"" + escapeBytes(behavior, NonAscii::Keep) +
                                          "\" is not supported (Isolated, Removed, "
                                          "MergedWithPrevious, MergedWithNext)"));
    if (Status s = flag("invert", false, step.invert); !s)
      return s;
    steps.push_back(std::move(step));
    return Status::ok();
  }
  return Status::error(fieldError(origin, field + ".type",
                                  "\"" + escapeBytes(type, NonAscii::Keep) +
                                      "\" is not supported (byte-level BPE: ByteLevel, Split, "
                                      "Sequence)"));
}

// A merges entry: "a b" or ["a", "b"].
bool mergePair(const json &entry, std::string &left, std::string &right) {
  if (entry.is_string()) {
    const std::string text = entry.get<std::string>();
    const size_t space = text.find(' ');
    if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos)
      return false;
    left = text.substr(0, space);
    right = text.substr(space + 1);
    return !left.empty() && !right.empty();
  }
  if (entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_string()) {
    left = entry[0].get<std::string>();
    right = entry[1].get<std::string>();
    return !left.empty() && !right.empty();
  }
  return false;
}

json parseConfig(std::string_view text, const std::string &origin, Status &status) {
  if (text.empty())
    return json::object();
  json config = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    status = Status::error(origin + ": not a JSON object");
    return json();
  }
  return config;
}

// A token field of tokenizer_config.json: "text" or {"content": "text", ...}.
std::optional<std::string> configToken(const json &config, const char *key) {
  if (!config.contains(key))
    return std::nullopt;
  const json &value = config[key];
  if (value.is_string())
    return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string())
    return value["content"].get<std::string>();
  return std::nullopt;
}

} // namespace

Status Tokenizer::Impl::finishLoad(std::string_view configText, const std::string &configOrigin,
                                   bool hasTemplate) {
  Status status;
  const json config = parseConfig(configText, configOrigin, status);
  if (!status)
    return status;
  // Chat format: Kimi's role tokens, or DeepSeek's; V3 and V3.1 ship a Jinja chat_template,
  // V3.2 none (its encoding_dsv32.py renders the chat, ending the prompt with </think>).
  std::string chatTemplate;
  if (config.contains("chat_template") && config["chat_template"].is_string())
    chatTemplate = config["chat_template"].get<std::string>();
  hasTemplate = hasTemplate || !chatTemplate.empty();
  if (addedIds.count("<|im_middle|>") && addedIds.count("<|im_end|>"))
    chatFormat = ChatFormat::Kimi;
  else if (addedIds.count("<｜User｜>") && addedIds.count("<｜Assistant｜>") &&
           addedIds.count("<｜begin▁of▁sentence｜>") && addedIds.count("<｜end▁of▁sentence｜>"))
    chatFormat = hasTemplate ? ChatFormat::DeepSeekV3 : ChatFormat::DeepSeekV32;
  // A BOS token before completion prompts, as the Hugging Face tokenizer adds it
  // (add_bos_token, DeepSeek's LlamaTokenizerFast).
  if (config.contains("add_bos_token") && config["add_bos_token"].is_boolean() &&
      config["add_bos_token"].get<bool>()) {
    if (std::optional<std::string> bos = configToken(config, "bos_token")) {
      auto found = addedIds.find(*bos);
      if (found == addedIds.end())
        return Status::error(fieldError(configOrigin, "bos_token",
                                        "\"" + escapeBytes(*bos, NonAscii::Keep) +
                                            "\" is not a token of the vocabulary"));
      bosForPrompts = found->second;
    }
  }
  return Status::ok();
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::fromHfJson(std::string_view text,
                                                           std::string_view configText,
                                                           std::string_view originView) {
  const std::string origin(originView);
  return catchExceptions(origin, [&]() -> StatusOr<std::unique_ptr<Tokenizer>> {
    const json spec = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (spec.is_discarded() || !spec.is_object())
      return Status::error(origin + ": not a JSON object");
    auto impl = std::make_unique<Impl>();
    impl->rule = MergeRule::PairRanks;
    impl->byteToken.fill(-1);
    if (!spec.contains("model") || !spec["model"].is_object())
      return Status::error(fieldError(origin, "model", "missing or not an object"));
    const json &model = spec["model"];
    const json type = model.value("type", json("BPE"));
    if (!type.is_string() || type.get<std::string>() != "BPE")
      return Status::error(fieldError(origin, "model.type",
                                      "only \"BPE\" (byte-level) is supported, not " +
                                          escapeBytes(type.dump(), NonAscii::Keep)));
    for (const char *key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(key) && !model[key].is_null() &&
          !(model[key].is_string() && model[key].get<std::string>().empty()))
        return Status::error(fieldError(origin, std::string("model.") + key,
                                        "not supported by byte-level BPE"));
    if (model.contains("dropout") && !model["dropout"].is_null())
      return Status::error(fieldError(origin, "model.dropout", "BPE dropout is not supported"));
    if (model.contains("byte_fallback") && model["byte_fallback"].is_boolean() &&
        model["byte_fallback"].get<bool>())
      return Status::error(fieldError(origin, "model.byte_fallback",
                                      "byte fallback (SentencePiece-style BPE) is not supported"));
    if (model.contains("ignore_merges")) {
      if (!model["ignore_merges"].is_boolean())
        return Status::error(fieldError(origin, "model.ignore_merges", "expected true or false"));
      impl->ignoreMerges = model["ignore_merges"].get<bool>();
    }
    if (spec.contains("normalizer") && !spec["normalizer"].is_null())
      return Status::error(fieldError(origin, "normalizer",
                                      "normalizers are not supported (byte-level BPE has none)"));
    bool byteLevel = false;
    if (Status s = parsePreTokenizer(spec.value("pre_tokenizer", json()), origin, "pre_tokenizer",
                                     impl->steps, byteLevel);
        !s)
      return s;
    if (!byteLevel)
      return Status::error(fieldError(origin, "pre_tokenizer",
                                      "no ByteLevel pre-tokenizer: not a byte-level BPE"));
    if (spec.contains("decoder") && !spec["decoder"].is_null()) {
      const json &decoder = spec["decoder"];
      if (!decoder.is_object() || decoder.value("type", json()) != json("ByteLevel"))
        return Status::error(fieldError(origin, "decoder.type", "only ByteLevel is supported"));
    }

    // Vocabulary: strings of the byte-level alphabet.
    if (!model.contains("vocab") || !model["vocab"].is_object())
      return Status::error(fieldError(origin, "model.vocab", "missing or not an object"));
    const size_t entries = model["vocab"].size();
    std::unordered_map<std::string, int64_t> idOfString;
    idOfString.reserve(entries);
    for (const auto &[token, value] : model["vocab"].items()) {
      if (!value.is_number_integer())
        return Status::error(fieldError(origin, "model.vocab[\"" +
                                                    escapeBytes(token, NonAscii::Keep) + "\"]",
                                        "expected an integer id"));
      const int64_t id = value.get<int64_t>();
      if (id < 0 || id >= int64_t(entries) + kMaxIdGap)
        return Status::error(fieldError(origin, "model.vocab[\"" +
                                                    escapeBytes(token, NonAscii::Keep) + "\"]",
                                        "id " + std::to_string(id) + " is out of range"));
      idOfString[token] = id;
      std::optional<std::string> bytes = unmapBytes(token);
      // A string outside the byte alphabet (an added token kept in the vocabulary) decodes as
      // itself and never comes out of BPE.
      if (Status s = impl->setId(id, bytes ? *bytes : token, 1, origin + ": model.vocab"); !s)
        return s;
      if (bytes) {
        impl->idOfBytes[*bytes] = id;
        if (bytes->size() == 1)
          impl->byteToken[static_cast<unsigned char>((*bytes)[0])] = id;
      }
    }
    // Merges, ranked by position.
    const json merges = model.value("merges", json::array());
    if (!merges.is_array())
      return Status::error(fieldError(origin, "model.merges", "expected an array"));
    impl->merges.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const std::string field = "model.merges[" + std::to_string(rank) + "]";
      std::string left, right;
      if (!mergePair(merges[rank], left, right))
        return Status::error(fieldError(origin, field, "expected \"a b\" or [\"a\", \"b\"]"));
      auto a = idOfString.find(left), b = idOfString.find(right),
           merged = idOfString.find(left + right);
      if (a == idOfString.end() || b == idOfString.end() || merged == idOfString.end())
        return Status::error(fieldError(origin, field,
                                        "\"" + escapeBytes(left, NonAscii::Keep) + "\", \"" +
                                            escapeBytes(right, NonAscii::Keep) +
                                            "\" or their concatenation is not in model.vocab"));
      const uint64_t key = (uint64_t(uint32_t(a->second)) << 32) | uint32_t(b->second);
      impl->merges.emplace(key, std::make_pair(int64_t(rank), merged->second)); // first wins
    }
    // Added tokens.
    const json added = spec.value("added_tokens", json::array());
    if (!added.is_array())
      return Status::error(fieldError(origin, "added_tokens", "expected an array"));
    for (size_t i = 0; i < added.size(); ++i) {
      const std::string field = "added_tokens[" + std::to_string(i) + "]";
      const json &token = added[i];
      if (!token.is_object() || !token.contains("id") || !token["id"].is_number_integer() ||
          !token.contains("content") || !token["content"].is_string())
        return Status::error(fieldError(origin, field, "expected {\"id\": N, \"content\": ...}"));
      for (const char *key : {"lstrip", "rstrip", "single_word"})
        if (token.contains(key) && token[key].is_boolean() && token[key].get<bool>())
          return Status::error(fieldError(origin, field + "." + key,
                                          "true is not supported (only exact matches)"));
      const int64_t id = token["id"].get<int64_t>();
      if (id < 0 || id >= int64_t(entries + added.size()) + kMaxIdGap)
        return Status::error(fieldError(origin, field + ".id",
                                        std::to_string(id) + " is out of range"));
      const bool special = token.value("special", json(false)).is_boolean() &&
                           token.value("special", false);
      if (Status s = impl->addAddedToken(token["content"].get<std::string>(), id, special,
                                         origin + ": " + field);
          !s)
        return s;
    }
    if (impl->bytesOfId.empty())
      return Status::error(fieldError(origin, "model.vocab", "is empty"));
    if (Status s = impl->finishLoad(configText, origin + " (tokenizer_config.json)", false); !s)
      return s;
    return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
  });
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::fromTiktoken(std::string_view text,
                                                             std::string_view configText,
                                                             std::string_view originView) {
  const std::string origin(originView);
  return catchExceptions(origin, [&]() -> StatusOr<std::unique_ptr<Tokenizer>> {
    auto impl = std::make_unique<Impl>();
    impl->rule = MergeRule::ByteRanks;
    impl->byteToken.fill(-1);
    // Lines "<base64 token> <rank>"; blank lines are skipped.
    size_t lineNumber = 0, entries = 0;
    for (size_t at = 0; at < text.size();) {
      size_t end = text.find('\n', at);
      if (end == std::string_view::npos)
        end = text.size();
      std::string_view line = text.substr(at, end - at);
      at = end + 1;
      ++lineNumber;
      if (!line.empty() && line.back() == '\r')
        line.remove_suffix(1);
      if (line.empty())
        continue;
      const std::string where = origin + ": line " + std::to_string(lineNumber);
      const size_t space = line.find(' ');
      if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos)
        return Status::error(where + ": expected \"<base64 token> <rank>\"");
      std::optional<std::string> bytes = base64Decode(line.substr(0, space));
      if (!bytes)
        return Status::error(where + ": the token is not valid base64");
      const std::string_view rankText = line.substr(space + 1);
      int64_t rank = -1;
      auto [ptr, ec] = std::from_chars(rankText.data(), rankText.data() + rankText.size(), rank);
      if (ec != std::errc() || ptr != rankText.data() + rankText.size() || rank < 0)
        return Status::error(where + ": the rank is not a non-negative integer");
      ++entries;
      if (rank >= int64_t(entries) + kMaxIdGap)
        return Status::error(where + ": rank " + std::to_string(rank) +
                             " leaves too large a gap after " + std::to_string(entries - 1) +
                             " tokens");
      if (size_t(rank) < impl->kindOfId.size() && impl->kindOfId[size_t(rank)] != 0)
        return Status::error(where + ": rank " + std::to_string(rank) + " appears twice");
      if (!impl->idOfBytes.emplace(*bytes, rank).second)
        return Status::error(where + ": the token appears twice");
      if (bytes->size() == 1)
        impl->byteToken[static_cast<unsigned char>((*bytes)[0])] = rank;
      if (Status s = impl->setId(rank, *bytes, 1, where); !s)
        return s;
    }
    if (entries == 0)
      return Status::error(origin + ": no tokens");
    // tokenizer_config.json: added_tokens_decoder {"<id>": {"content": ...}}, optional pat_str.
    const std::string configOrigin = origin + " (tokenizer_config.json)";
    Status status;
    const json config = parseConfig(configText, configOrigin, status);
    if (!status)
      return status;
    std::string pattern(kKimiPattern);
    if (config.contains("pat_str")) {
      if (!config["pat_str"].is_string())
        return Status::error(fieldError(configOrigin, "pat_str", "expected a string"));
      pattern = config["pat_str"].get<std::string>();
    }
    StatusOr<std::shared_ptr<Regex>> regex = Regex::compile(pattern);
    if (!regex)
      return Status::error(fieldError(configOrigin, "pat_str", regex.status().message()));
    SplitStep step;
    step.regex = *regex;
    impl->steps.push_back(std::move(step));
    if (config.contains("added_tokens_decoder")) {
      const json &added = config["added_tokens_decoder"];
      if (!added.is_object())
        return Status::error(fieldError(configOrigin, "added_tokens_decoder", "expected an object"));
      for (const auto &[key, token] : added.items()) {
        const std::string field = "added_tokens_decoder[\"" + escapeBytes(key, NonAscii::Keep) +
                                  "\"]";
        int64_t id = -1;
        auto [ptr, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
        if (ec != std::errc() || ptr != key.data() + key.size() || id < 0 ||
            id >= int64_t(entries + added.size()) + kMaxIdGap)
          return Status::error(fieldError(configOrigin, field, "the key is not a token id in range"));
        if (size_t(id) < impl->kindOfId.size() && impl->kindOfId[size_t(id)] == 1)
          return Status::error(fieldError(configOrigin, field,
                                          "id " + key + " is a rank of the tiktoken.model"));
        if (!token.is_object() || !token.contains("content") || !token["content"].is_string())
          return Status::error(fieldError(configOrigin, field, "expected {\"content\": ...}"));
        const bool special = !token.contains("special") ||
                             (token["special"].is_boolean() && token["special"].get<bool>());
        if (Status s = impl->addAddedToken(token["content"].get<std::string>(), id, special,
                                           configOrigin + ": " + field);
            !s)
          return s;
      }
    }
    if (Status s = impl->finishLoad(configText, configOrigin, false); !s)
      return s;
    return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
  });
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::load(const std::string &directory) {
  namespace fs = std::filesystem;
  const fs::path dir(directory);
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return Status::error(directory + ": not a directory");
  Status status;
  std::string config;
  if (fs::exists(dir / "tokenizer_config.json", ec)) {
    config = readFile(dir / "tokenizer_config.json", status);
    if (!status)
      return status;
  }
  if (fs::exists(dir / "tokenizer.json", ec)) {
    const std::string text = readFile(dir / "tokenizer.json", status);
    if (!status)
      return status;
    return fromHfJson(text, config, (dir / "tokenizer.json").string());
  }
  if (fs::exists(dir / "tiktoken.model", ec)) {
    const std::string text = readFile(dir / "tiktoken.model", status);
    if (!status)
      return status;
    return fromTiktoken(text, config, (dir / "tiktoken.model").string());
  }
  return Status::error(directory + ": no tokenizer.json or tiktoken.model");
}

StatusOr<std::vector<int64_t>> Tokenizer::encode(std::string_view text, bool parseSpecial) const {
  return catchExceptions("encode", [&]() -> StatusOr<std::vector<int64_t>> {
    if (!validUtf8(text))
      return Status::error("the text is not valid UTF-8");
    std::vector<int64_t> ids;
    size_t segment = 0;
    if (parseSpecial) {
      for (size_t i = 0; i < text.size();) {
        const AddedToken *match = nullptr;
        for (const AddedToken &token : impl_->addedByFirstByte[static_cast<unsigned char>(text[i])])
          if (text.compare(i, token.content.size(), token.content) == 0) {
            match = &token;
            break;
          }
        if (!match) {
          ++i;
          continue;
        }
        if (Status s = impl_->encodeOrdinary(text.substr(segment, i - segment), ids); !s)
          return s;
        ids.push_back(match->id);
        i += match->content.size();
        segment = i;
      }
    }
    if (Status s = impl_->encodeOrdinary(text.substr(segment), ids); !s)
      return s;
    return ids;
  });
}

StatusOr<std::string> Tokenizer::decodeBytes(std::span<const int64_t> ids,
                                             bool skipSpecial) const {
  std::string out;
  for (int64_t id : ids) {
    if (id < 0 || size_t(id) >= impl_->kindOfId.size() || impl_->kindOfId[size_t(id)] == 0)
      return Status::error("token id " + std::to_string(id) + " is not in the vocabulary");
    if (skipSpecial && impl_->kindOfId[size_t(id)] == 3)
      continue;
    out += impl_->bytesOfId[size_t(id)];
  }
  return out;
}

StatusOr<std::string> Tokenizer::decode(std::span<const int64_t> ids, bool skipSpecial) const {
  StatusOr<std::string> bytes = decodeBytes(ids, skipSpecial);
  if (!bytes)
    return bytes.status();
  return utf8Lossy(*bytes);
}

int64_t Tokenizer::vocabSize() const { return int64_t(impl_->kindOfId.size()); }

std::optional<int64_t> Tokenizer::tokenId(std::string_view token) const {
  auto added = impl_->addedIds.find(std::string(token));
  if (added != impl_->addedIds.end())
    return added->second;
  auto regular = impl_->idOfBytes.find(std::string(token));
  if (regular != impl_->idOfBytes.end())
    return regular->second;
  return std::nullopt;
}

bool Tokenizer::isSpecial(int64_t id) const {
  return id >= 0 && size_t(id) < impl_->kindOfId.size() && impl_->kindOfId[size_t(id)] == 3;
}

ChatFormat Tokenizer::chatFormat() const { return impl_->chatFormat; }

std::optional<int64_t> Tokenizer::promptBosToken() const { return impl_->bosForPrompts; }

std::vector<int64_t> Tokenizer::endOfTurnTokens() const {
  std::vector<int64_t> out;
  for (const char *token : {"<|im_end|>", "[EOS]", "<｜end▁of▁sentence｜>"})
    if (auto id = impl_->addedIds.find(token); id != impl_->addedIds.end())
      out.push_back(id->second);
  return out;
}

std::string utf8Lossy(std::string_view bytes, bool complete, std::string *rest) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    bool prefix = false;
    const size_t n = utf8Char(bytes, i, &prefix);
    if (n > 0) {
      out.append(bytes.substr(i, n));
      i += n;
      continue;
    }
    if (prefix && !complete) {
      if (rest)
        *rest = std::string(bytes.substr(i));
      return out;
    }
    out += "\xEF\xBF\xBD"; // U+FFFD
    i += invalidRun(bytes, i);
  }
  if (rest)
    rest->clear();
  return out;
}

StatusOr<std::string> IncrementalDecoder::push(int64_t id) {
  const int64_t one[1] = {id};
  StatusOr<std::string> bytes = tokenizer_.decodeBytes(one, skipSpecial_);
  if (!bytes)
    return bytes.status();
  pending_ += *bytes;
  std::string rest;
  std::string out = utf8Lossy(pending_, /*complete=*/false, &rest);
  pending_ = std::move(rest);
  return out;
}

std::string IncrementalDecoder::finish() {
  std::string out = utf8Lossy(pending_);
  pending_.clear();
  return out;
}

} // namespace hybrid
