// Tests of the compilation cache: key records (determinism, field boundaries, types), the entry
// format (round trips and every corruption a reader must reject with a message naming it) and the
// store (layout, miss, rejection and removal of bad entries, environment, concurrent writers).
#include "hybrid/cache/Entry.h"
#include "hybrid/cache/Key.h"
#include "hybrid/cache/Store.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <gtest/gtest.h>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>
// Used directly to check the documented layouts independently of the library's code; libxxhash
// reaches the link through hybrid_cache.
#include <xxhash.h>

namespace hybrid::cache {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::byte>;

Bytes bytesOf(std::string_view text) {
  Bytes bytes(text.size());
  std::transform(text.begin(), text.end(), bytes.begin(),
                 [](char c) { return static_cast<std::byte>(c); });
  return bytes;
}

// Half random, half repetitive: exercises zstd's literal and match paths alike.
Bytes samplePayload(size_t size, uint32_t seed) {
  Bytes bytes(size);
  std::mt19937 random(seed);
  for (size_t i = 0; i < size; ++i)
    bytes[i] = static_cast<std::byte>(i < size / 2 ? random() : i % 251);
  return bytes;
}

CacheKey keyOf(std::string_view modelName) {
  return KeyBuilder().add("model", modelName).add("target", "cpu").finish();
}

// ---------------------------------------------------------------------------------------------
// Keys

TEST(CacheKeyTest, SameRecordGivesSameKeyAndText) {
  auto build = [] {
    KeyBuilder builder;
    builder.add("model", "kimi-linear").add("layers", 4).add("rope_theta", 10000.0);
    builder.add("fuse", true).addBytes("config", bytesOf("{\"hidden\": 64}"));
    return builder;
  };
  KeyBuilder first = build();
  KeyBuilder second = build();
  EXPECT_EQ(first.finish(), second.finish());
  EXPECT_EQ(first.canonicalText(), second.canonicalText());
  // finish() does not consume the builder.
  EXPECT_EQ(first.finish(), first.finish());
}

TEST(CacheKeyTest, FieldBoundariesChangeTheKey) {
  // The same characters split differently between name and value...
  EXPECT_NE(KeyBuilder().add("ab", "c").finish(), KeyBuilder().add("a", "bc").finish());
  // ...or between two values.
  EXPECT_NE(KeyBuilder().add("f", "ab").add("f", "c").finish(),
            KeyBuilder().add("f", "a").add("f", "bc").finish());
  // An empty field is still a field.
  EXPECT_NE(KeyBuilder().add("f", "").finish(), KeyBuilder().finish());
  EXPECT_NE(KeyBuilder().addBytes("f", {}).finish(), KeyBuilder().add("f", "").finish());
}

TEST(CacheKeyTest, ValueTypesAreKeptApart) {
  CacheKey asString = KeyBuilder().add("n", "42").finish();
  CacheKey asInt = KeyBuilder().add("n", int64_t{42}).finish();
  CacheKey asUnsigned = KeyBuilder().add("n", uint64_t{42}).finish();
  CacheKey asDouble = KeyBuilder().add("n", 42.0).finish();
  CacheKey asBytes = KeyBuilder().addBytes("n", bytesOf("42")).finish();
  std::vector<CacheKey> keys = {asString, asInt, asUnsigned, asDouble, asBytes};
  for (size_t i = 0; i < keys.size(); ++i)
    for (size_t j = i + 1; j < keys.size(); ++j)
      EXPECT_NE(keys[i], keys[j]) << i << " vs " << j;
  EXPECT_NE(KeyBuilder().add("b", true).finish(), KeyBuilder().add("b", 1).finish());
  // Literals and other integer types land on the expected field type (never on bool).
  EXPECT_EQ(KeyBuilder().add("n", 42).finish(), asInt);
  EXPECT_EQ(KeyBuilder().add("n", 42u).finish(), asUnsigned);
  EXPECT_EQ(KeyBuilder().add("n", static_cast<int16_t>(42)).finish(), asInt);
  EXPECT_EQ(KeyBuilder().add("n", std::string("42")).finish(), asString);
  EXPECT_EQ(KeyBuilder().add("n", 42.0f).finish(), asDouble);
}

TEST(CacheKeyTest, OrderAndValuesChangeTheKey) {
  EXPECT_NE(KeyBuilder().add("a", 1).add("b", 2).finish(),
            KeyBuilder().add("b", 2).add("a", 1).finish());
  EXPECT_NE(KeyBuilder().add("bucket", 128).finish(), KeyBuilder().add("bucket", 256).finish());
  // Doubles are hashed by bit pattern.
  EXPECT_NE(KeyBuilder().add("x", 0.0).finish(), KeyBuilder().add("x", -0.0).finish());
  EXPECT_NE(KeyBuilder().addBytes("w", bytesOf("abc")).finish(),
            KeyBuilder().addBytes("w", bytesOf("abd")).finish());
}

TEST(CacheKeyTest, CanonicalTextShowsOneTypedFieldPerLine) {
  KeyBuilder builder;
  builder.add("model", "tiny \"v2\"\n").add("layers", -4).add("bucket", uint64_t{128});
  builder.add("eps", 1e-6).add("scale", 1.0).add("fuse", false).add("a=b", "x");
  builder.addBytes("blob", bytesOf("abc"));
  XXH128_hash_t abcHash = XXH3_128bits("abc", 3);
  std::string blobHash = CacheKey{abcHash.high64, abcHash.low64}.hex();
  EXPECT_EQ(builder.canonicalText(), "model=\"tiny \\\"v2\\\"\\x0a\"\n"
                                     "layers=-4\n"
                                     "bucket=128u\n"
                                     "eps=1e-06\n"
                                     "scale=1.0\n"
                                     "fuse=false\n"
                                     "a\\x3db=\"x\"\n"
                                     "blob=<3 bytes xxh3:" +
                                         blobHash + ">\n");
}

// The record layout is part of the cache format (docs/cache.md): rebuild it by hand and check
// the builder hashes exactly these bytes.
TEST(CacheKeyTest, RecordEncodingMatchesTheDocumentedLayout) {
  std::string record = "hybrid.cache.key-record.v1";
  auto appendU64 = [&](uint64_t value) {
    for (int i = 0; i < 8; ++i)
      record += static_cast<char>(value >> (8 * i));
  };
  auto appendField = [&](uint8_t tag, std::string_view name, std::string_view value) {
    record += static_cast<char>(tag);
    appendU64(name.size());
    record += name;
    appendU64(value.size());
    record += value;
  };
  appendField(1, "model", "tiny");
  std::string int64Bytes(8, '\0');
  int64Bytes[0] = static_cast<char>(0xfe); // -2, little-endian two's complement
  std::fill(int64Bytes.begin() + 1, int64Bytes.end(), static_cast<char>(0xff));
  appendField(2, "n", int64Bytes);
  appendField(5, "on", std::string(1, '\1'));
  appendField(6, "blob", "xyz");

  XXH128_hash_t expected = XXH3_128bits(record.data(), record.size());
  CacheKey key = KeyBuilder()
                     .add("model", "tiny")
                     .add("n", -2)
                     .add("on", true)
                     .addBytes("blob", bytesOf("xyz"))
                     .finish();
  EXPECT_EQ(key, (CacheKey{expected.high64, expected.low64}));
}

TEST(CacheKeyTest, HexRoundTrip) {
  CacheKey key{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  EXPECT_EQ(key.hex(), "0123456789abcdeffedcba9876543210");
  EXPECT_EQ(CacheKey::fromHex(key.hex()), key);
  EXPECT_EQ(CacheKey::fromHex("0123456789ABCDEFFEDCBA9876543210"), key);
  CacheKey built = keyOf("round-trip");
  EXPECT_EQ(CacheKey::fromHex(built.hex()), built);
  EXPECT_EQ(CacheKey{}.hex(), std::string(32, '0'));

  EXPECT_FALSE(CacheKey::fromHex(""));
  EXPECT_FALSE(CacheKey::fromHex(key.hex().substr(1)));
  EXPECT_FALSE(CacheKey::fromHex(key.hex() + "0"));
  EXPECT_FALSE(CacheKey::fromHex("0123456789abcdeffedcba987654321g"));
  EXPECT_FALSE(CacheKey::fromHex("0x23456789abcdeffedcba9876543210"));
}

// ---------------------------------------------------------------------------------------------
// Entries

const CacheKey kEntryKey = {0x1111222233334444ULL, 0x5555666677778888ULL};

Bytes encodeOrDie(const Bytes &payload, EntryKind kind = EntryKind::Plan) {
  StatusOr<Bytes> entry = encodeEntry(kEntryKey, kind, payload);
  EXPECT_TRUE(entry.isOk()) << entry.status().message();
  return entry.isOk() ? std::move(entry).value() : Bytes{};
}

// Decodes bytes that must be rejected; returns the message (one line, not empty).
std::string rejection(const Bytes &entry, const CacheKey &key = kEntryKey,
                      EntryKind kind = EntryKind::Plan) {
  StatusOr<Bytes> payload = decodeEntry(entry, key, kind);
  EXPECT_FALSE(payload.isOk()) << "a bad entry was accepted";
  if (payload.isOk())
    return "";
  const std::string &message = payload.status().message();
  EXPECT_FALSE(message.empty());
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  return message;
}

// Rewrites the header through `edit` and re-seals its checksum: a well-formed header that lies,
// to reach the checks behind the checksum.
template <typename Edit> Bytes withForgedHeader(Bytes entry, Edit edit) {
  StatusOr<EntryHeader> header = decodeEntryHeader(entry);
  EXPECT_TRUE(header.isOk()) << header.status().message();
  if (!header.isOk())
    return entry;
  edit(*header);
  auto headerBytes = encodeEntryHeader(*header);
  std::copy(headerBytes.begin(), headerBytes.end(), entry.begin());
  return entry;
}

class CacheEntryRoundTripTest : public testing::TestWithParam<size_t> {};

TEST_P(CacheEntryRoundTripTest, PayloadComesBackUnchanged) {
  Bytes payload = samplePayload(GetParam(), 7);
  Bytes entry = encodeOrDie(payload);
  ASSERT_GE(entry.size(), kEntryHeaderSize);
  StatusOr<Bytes> decoded = decodeEntry(entry, kEntryKey, EntryKind::Plan);
  ASSERT_TRUE(decoded.isOk()) << decoded.status().message();
  EXPECT_EQ(*decoded, payload);
}

INSTANTIATE_TEST_SUITE_P(CachePayloadSizes, CacheEntryRoundTripTest,
                         testing::Values(0, 1, 100, 64 << 10, (5 << 20) + 3),
                         [](const testing::TestParamInfo<size_t> &info) {
                           return "Bytes" + std::to_string(info.param);
                         });

TEST(CacheEntryTest, HeaderFieldsSitAtTheDocumentedOffsets) {
  Bytes payload = samplePayload(1000, 1);
  Bytes entry = encodeOrDie(payload, EntryKind::WeightsManifest);
  auto u32At = [&](size_t offset) {
    uint32_t value = 0;
    for (int i = 3; i >= 0; --i)
      value = (value << 8) | std::to_integer<uint32_t>(entry[offset + i]);
    return value;
  };
  auto u64At = [&](size_t offset) {
    uint64_t value = 0;
    for (int i = 7; i >= 0; --i)
      value = (value << 8) | std::to_integer<uint64_t>(entry[offset + i]);
    return value;
  };
  EXPECT_EQ(std::string(reinterpret_cast<const char *>(entry.data()), 8), "HYBRIDC1");
  EXPECT_EQ(u32At(8), 1u);
  EXPECT_EQ(u64At(12), kEntryKey.high);
  EXPECT_EQ(u64At(20), kEntryKey.low);
  EXPECT_EQ(u32At(28), 2u);
  EXPECT_EQ(u64At(32), payload.size());
  EXPECT_EQ(u64At(40), entry.size() - kEntryHeaderSize);
  XXH128_hash_t contentHash = XXH3_128bits(payload.data(), payload.size());
  EXPECT_EQ(u64At(48), contentHash.high64);
  EXPECT_EQ(u64At(56), contentHash.low64);
  EXPECT_EQ(u64At(64), XXH3_64bits(entry.data(), 64));
}

TEST(CacheEntryTest, AnyZstdLevelRoundTrips) {
  Bytes payload = samplePayload(4096, 3);
  for (int level : {-1000, -1, 0, 1, 19, 1000}) {
    StatusOr<Bytes> entry = encodeEntry(kEntryKey, EntryKind::Other, payload, level);
    ASSERT_TRUE(entry.isOk()) << level << ": " << entry.status().message();
    StatusOr<Bytes> decoded = decodeEntry(*entry, kEntryKey, EntryKind::Other);
    ASSERT_TRUE(decoded.isOk()) << level << ": " << decoded.status().message();
    EXPECT_EQ(*decoded, payload) << level;
  }
}

TEST(CacheEntryTest, EveryHeaderByteFlipIsRejected) {
  const Bytes entry = encodeOrDie(samplePayload(3000, 2));
  for (size_t offset = 0; offset < kEntryHeaderSize; ++offset) {
    Bytes corrupted = entry;
    corrupted[offset] ^= std::byte{0x10};
    std::string message = rejection(corrupted);
    const char *expected = offset < 8    ? "wrong magic"
                           : offset < 12 ? "unsupported format version"
                                         : "header checksum mismatch";
    EXPECT_NE(message.find(expected), std::string::npos) << "offset " << offset << ": " << message;
  }
}

TEST(CacheEntryTest, PayloadByteFlipsAreRejected) {
  const Bytes entry = encodeOrDie(samplePayload(20000, 4));
  for (size_t offset = kEntryHeaderSize; offset < entry.size(); offset += 97) {
    Bytes corrupted = entry;
    corrupted[offset] ^= std::byte{0x01};
    std::string message = rejection(corrupted);
    bool named = message.find("zstd error") != std::string::npos ||
                 message.find("content hash mismatch") != std::string::npos ||
                 message.find("decompressed size mismatch") != std::string::npos;
    EXPECT_TRUE(named) << "offset " << offset << ": " << message;
  }
}

TEST(CacheEntryTest, TruncationIsRejectedAtEveryPoint) {
  const Bytes entry = encodeOrDie(samplePayload(5000, 5));
  for (size_t size : {size_t{0}, size_t{3}, size_t{8}, size_t{12}, size_t{40}, size_t{71}}) {
    std::string message = rejection(Bytes(entry.begin(), entry.begin() + size));
    EXPECT_NE(message.find("truncated header: " + std::to_string(size) + " bytes"),
              std::string::npos)
        << message;
  }
  for (size_t size : {kEntryHeaderSize, kEntryHeaderSize + 1, entry.size() / 2, entry.size() - 1}) {
    std::string message = rejection(Bytes(entry.begin(), entry.begin() + size));
    EXPECT_NE(message.find("compressed size mismatch"), std::string::npos)
        << size << ": " << message;
  }
  Bytes withTrailingGarbage = entry;
  withTrailingGarbage.push_back(std::byte{0});
  EXPECT_NE(rejection(withTrailingGarbage).find("compressed size mismatch"), std::string::npos);
}

TEST(CacheEntryTest, ForeignFileIsNamedAsSuch) {
  std::string message = rejection(bytesOf("{\"not\": \"an entry at all, just some json\"}"));
  // The first 8 bytes, quoted, with the quotes inside escaped.
  EXPECT_NE(message.find("wrong magic \"{\\x22not\\x22: \", expected \"HYBRIDC1\""),
            std::string::npos)
      << message;
}

TEST(CacheEntryTest, WrongKeyOrKindIsRejected) {
  const Bytes entry = encodeOrDie(samplePayload(100, 6));
  CacheKey otherKey = kEntryKey;
  otherKey.low ^= 1;
  std::string message = rejection(entry, otherKey);
  EXPECT_NE(
      message.find("key mismatch: entry holds " + kEntryKey.hex() + ", expected " + otherKey.hex()),
      std::string::npos)
      << message;
  message = rejection(entry, kEntryKey, EntryKind::WeightsManifest);
  EXPECT_NE(message.find("kind mismatch: entry holds plan, expected weights-manifest"),
            std::string::npos)
      << message;
}

TEST(CacheEntryTest, UnsupportedVersionIsNamed) {
  Bytes entry = encodeOrDie(samplePayload(10, 8));
  entry[8] = std::byte{2};
  EXPECT_NE(rejection(entry).find("unsupported format version 2 (this build reads version 1)"),
            std::string::npos);
}

TEST(CacheEntryTest, LyingHeaderSizesAreRejected) {
  const Bytes entry = encodeOrDie(samplePayload(4000, 9));
  for (int64_t delta : {-1, 1, 1000}) {
    Bytes forged = withForgedHeader(
        entry, [&](EntryHeader &h) { h.uncompressedSize += static_cast<uint64_t>(delta); });
    std::string message = rejection(forged);
    EXPECT_NE(message.find("decompressed size mismatch"), std::string::npos)
        << delta << ": " << message;
  }
  Bytes huge = withForgedHeader(entry, [](EntryHeader &h) { h.uncompressedSize = 17ULL << 30; });
  EXPECT_NE(rejection(huge).find("exceeds the entry limit"), std::string::npos);
  Bytes absurd = withForgedHeader(entry, [](EntryHeader &h) { h.compressedSize = ~0ULL; });
  EXPECT_NE(rejection(absurd).find("compressed size mismatch"), std::string::npos);
}

TEST(CacheEntryTest, WrongContentHashIsRejected) {
  const Bytes entry = encodeOrDie(samplePayload(4000, 10));
  Bytes forged = withForgedHeader(entry, [](EntryHeader &h) { h.contentHash.low ^= 1; });
  EXPECT_NE(rejection(forged).find("content hash mismatch"), std::string::npos);
}

TEST(CacheEntryTest, GarbagePayloadIsAZstdError) {
  Bytes entry = encodeOrDie(samplePayload(4000, 11));
  std::fill(entry.begin() + kEntryHeaderSize, entry.end(), std::byte{0xab});
  EXPECT_NE(rejection(entry).find("zstd error"), std::string::npos);
}

TEST(CacheEntryTest, KindNames) {
  EXPECT_EQ(entryKindName(EntryKind::Plan), "plan");
  EXPECT_EQ(entryKindName(EntryKind::WeightsManifest), "weights-manifest");
  EXPECT_EQ(entryKindName(EntryKind::Other), "other");
  EXPECT_EQ(entryKindName(static_cast<EntryKind>(7)), "kind 7");
}

// ---------------------------------------------------------------------------------------------
// Store

// Each test gets its own cache folder, so ctest may run them in parallel.
class CacheStoreTest : public testing::Test {
protected:
  void SetUp() override {
    std::string pattern = (fs::path(testing::TempDir()) / "hybrid_cache_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << pattern;
    root_ = pattern;
    StatusOr<CacheStore> store = CacheStore::open(root_ + "/cache");
    ASSERT_TRUE(store.isOk()) << store.status().message();
    store_.emplace(std::move(store).value());
  }
  void TearDown() override {
    // Whatever a test did, no writer may leave a temporary file behind.
    EXPECT_EQ(filesEndingWith(std::string(kTemporaryFileExtension)), std::vector<std::string>{});
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  CacheStore &store() { return *store_; }

  std::vector<std::string> filesEndingWith(const std::string &suffix) const {
    std::vector<std::string> found;
    std::error_code error;
    for (auto it = fs::recursive_directory_iterator(root_, error);
         !error && it != fs::recursive_directory_iterator(); it.increment(error)) {
      std::string name = it->path().filename().string();
      if (it->is_regular_file() && name.size() >= suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        found.push_back(it->path().string());
    }
    return found;
  }

  // get() that must succeed; returns the payload or nullopt, and the rejection reason.
  std::optional<Bytes> lookup(const CacheKey &key, EntryKind kind, std::string *why = nullptr) {
    StatusOr<std::optional<Bytes>> result = store().get(key, kind, why);
    EXPECT_TRUE(result.isOk()) << result.status().message();
    return result.isOk() ? *result : std::nullopt;
  }

  void putOrFail(const CacheKey &key, const Bytes &payload, EntryKind kind = EntryKind::Plan) {
    Status status = store().put(key, kind, payload);
    ASSERT_TRUE(status.isOk()) << status.message();
  }

  std::string root_;
  std::optional<CacheStore> store_;
};

Bytes readFile(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  std::string content{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return bytesOf(content);
}

void writeFile(const std::string &path, const Bytes &bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char *>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

TEST_F(CacheStoreTest, PutThenGetReturnsThePayload) {
  CacheKey key = keyOf("tiny");
  Bytes payload = samplePayload(100000, 12);
  putOrFail(key, payload);
  std::string why = "stale";
  EXPECT_EQ(lookup(key, EntryKind::Plan, &why), payload);
  EXPECT_EQ(why, "");
}

TEST_F(CacheStoreTest, MissIsNulloptWithoutReason) {
  std::string why = "stale";
  EXPECT_EQ(lookup(keyOf("never-stored"), EntryKind::Plan, &why), std::nullopt);
  EXPECT_EQ(why, "");
}

TEST_F(CacheStoreTest, EntriesLiveInTwoHexDigitFolders) {
  CacheKey key = keyOf("layout");
  std::string hex = key.hex();
  EXPECT_EQ(store().pathFor(key), root_ + "/cache/" + hex.substr(0, 2) + "/" + hex + ".hyc");
  putOrFail(key, bytesOf("plan bytes"));
  EXPECT_TRUE(fs::is_regular_file(store().pathFor(key)));
  EXPECT_EQ(filesEndingWith(".hyc"), std::vector<std::string>{store().pathFor(key)});
}

TEST_F(CacheStoreTest, PutReplacesAnEntry) {
  CacheKey key = keyOf("replace");
  putOrFail(key, bytesOf("first"));
  putOrFail(key, bytesOf("second, longer"));
  EXPECT_EQ(lookup(key, EntryKind::Plan), bytesOf("second, longer"));
}

TEST_F(CacheStoreTest, EmptyPayloadIsAHitNotAMiss) {
  CacheKey key = keyOf("empty");
  putOrFail(key, {});
  EXPECT_EQ(lookup(key, EntryKind::Plan), Bytes{});
}

TEST_F(CacheStoreTest, CorruptedEntryIsRejectedReportedAndRemoved) {
  CacheKey key = keyOf("corrupt");
  Bytes payload = samplePayload(50000, 13);
  putOrFail(key, payload);
  std::string path = store().pathFor(key);
  Bytes file = readFile(path);
  file[kEntryHeaderSize + file.size() / 3] ^= std::byte{0x40};
  writeFile(path, file);

  std::string why;
  EXPECT_EQ(lookup(key, EntryKind::Plan, &why), std::nullopt);
  EXPECT_EQ(why.rfind(path + ": ", 0), 0u) << why;
  EXPECT_NE(why.find("(removed)"), std::string::npos) << why;
  EXPECT_FALSE(fs::exists(path));

  // The caller recompiles and stores a good entry again.
  putOrFail(key, payload);
  EXPECT_EQ(lookup(key, EntryKind::Plan, &why), payload);
  EXPECT_EQ(why, "");
}

TEST_F(CacheStoreTest, TruncatedAndForeignFilesAreRejected) {
  CacheKey key = keyOf("truncated");
  putOrFail(key, samplePayload(20000, 14));
  std::string path = store().pathFor(key);
  Bytes file = readFile(path);
  writeFile(path, Bytes(file.begin(), file.begin() + 30));
  std::string why;
  EXPECT_EQ(lookup(key, EntryKind::Plan, &why), std::nullopt);
  EXPECT_NE(why.find("truncated header"), std::string::npos) << why;
  EXPECT_FALSE(fs::exists(path));

  writeFile(path, bytesOf("GARBAGE!"));
  EXPECT_EQ(lookup(key, EntryKind::Plan, &why), std::nullopt);
  EXPECT_NE(why.find("wrong magic"), std::string::npos) << why;
  EXPECT_FALSE(fs::exists(path));
}

TEST_F(CacheStoreTest, EntryMovedToAnotherKeysPathIsRejected) {
  CacheKey stored = keyOf("a");
  CacheKey other = keyOf("b");
  putOrFail(stored, bytesOf("payload of a"));
  fs::create_directories(fs::path(store().pathFor(other)).parent_path());
  fs::rename(store().pathFor(stored), store().pathFor(other));
  std::string why;
  EXPECT_EQ(lookup(other, EntryKind::Plan, &why), std::nullopt);
  EXPECT_NE(why.find("key mismatch"), std::string::npos) << why;
}

TEST_F(CacheStoreTest, KindMismatchIsAMiss) {
  CacheKey key = keyOf("kind");
  putOrFail(key, bytesOf("manifest"), EntryKind::WeightsManifest);
  std::string why;
  EXPECT_EQ(lookup(key, EntryKind::Plan, &why), std::nullopt);
  EXPECT_NE(why.find("kind mismatch"), std::string::npos) << why;
}

TEST_F(CacheStoreTest, RemoveDeletesAndToleratesMissing) {
  CacheKey key = keyOf("remove");
  putOrFail(key, bytesOf("x"));
  EXPECT_TRUE(store().remove(key).isOk());
  EXPECT_FALSE(fs::exists(store().pathFor(key)));
  EXPECT_EQ(lookup(key, EntryKind::Plan), std::nullopt);
  Status again = store().remove(key);
  EXPECT_TRUE(again.isOk()) << again.message();
}

TEST_F(CacheStoreTest, OpenCreatesNestedFoldersAndRefusesFiles) {
  StatusOr<CacheStore> nested = CacheStore::open(root_ + "/deep/er/cache/");
  ASSERT_TRUE(nested.isOk()) << nested.status().message();
  EXPECT_EQ(nested->dir(), root_ + "/deep/er/cache");
  EXPECT_TRUE(fs::is_directory(nested->dir()));

  writeFile(root_ + "/plain-file", bytesOf("x"));
  StatusOr<CacheStore> onFile = CacheStore::open(root_ + "/plain-file");
  ASSERT_FALSE(onFile.isOk());
  EXPECT_NE(onFile.status().message().find(root_ + "/plain-file"), std::string::npos)
      << onFile.status().message();
  EXPECT_FALSE(CacheStore::open("").isOk());
}

// Sets or unsets an environment variable for one scope and restores it afterwards.
class ScopedEnv {
public:
  ScopedEnv(const char *name, const char *value) : name_(name) {
    if (const char *old = std::getenv(name))
      old_ = old;
    if (value)
      ::setenv(name, value, /*overwrite=*/1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv &) = delete;
  ScopedEnv &operator=(const ScopedEnv &) = delete;

private:
  const char *name_;
  std::optional<std::string> old_;
};

std::string defaultDirOrError() {
  StatusOr<std::string> dir = defaultCacheDir();
  return dir.isOk() ? *dir : "error: " + dir.status().message();
}

TEST_F(CacheStoreTest, DefaultDirFollowsTheEnvironment) {
  ScopedEnv home("HOME", "/home/someone");
  ScopedEnv xdg("XDG_CACHE_HOME", "/xdg/cache");
  {
    ScopedEnv dir("HYBRID_CACHE_DIR", (root_ + "/from-env").c_str());
    EXPECT_EQ(defaultDirOrError(), root_ + "/from-env");
    StatusOr<std::string> path = defaultCacheDir();
    ASSERT_TRUE(path.isOk());
    StatusOr<CacheStore> store = CacheStore::open(*path);
    ASSERT_TRUE(store.isOk()) << store.status().message();
    EXPECT_TRUE(store->put(keyOf("env"), EntryKind::Plan, bytesOf("x")).isOk());
    EXPECT_TRUE(fs::exists(root_ + "/from-env/" + keyOf("env").hex().substr(0, 2)));
  }
  {
    ScopedEnv dir("HYBRID_CACHE_DIR", "");
    EXPECT_EQ(defaultDirOrError(), "/xdg/cache/hybrid");
  }
  ScopedEnv dir("HYBRID_CACHE_DIR", nullptr);
  EXPECT_EQ(defaultDirOrError(), "/xdg/cache/hybrid");
  {
    ScopedEnv relativeXdg("XDG_CACHE_HOME", "relative/cache");
    EXPECT_EQ(defaultDirOrError(), "/home/someone/.cache/hybrid");
  }
  {
    ScopedEnv noXdg("XDG_CACHE_HOME", nullptr);
    EXPECT_EQ(defaultDirOrError(), "/home/someone/.cache/hybrid");
    ScopedEnv noHome("HOME", nullptr);
    EXPECT_EQ(defaultDirOrError().rfind("error: ", 0), 0u);
  }
}

// Two writers race on one key while a reader polls it: the reader only ever sees a miss or one
// of the two complete payloads (never a torn or rejected file), and one valid entry remains.
TEST_F(CacheStoreTest, ConcurrentWritersOfOneKeyLeaveOneValidEntry) {
  CacheKey key = keyOf("race");
  const Bytes payloadA = samplePayload(1 << 20, 100);
  const Bytes payloadB = samplePayload(1 << 20, 200);
  constexpr int kPutsPerWriter = 20;
  std::atomic<int> writersDone{0};
  std::atomic<int> putFailures{0};
  auto writer = [&](const Bytes &payload) {
    for (int i = 0; i < kPutsPerWriter; ++i)
      if (!store().put(key, EntryKind::Plan, payload).isOk())
        ++putFailures;
    ++writersDone;
  };
  std::vector<std::string> readerProblems;
  std::thread first(writer, std::cref(payloadA));
  std::thread second(writer, std::cref(payloadB));
  while (writersDone.load() < 2) {
    std::string why;
    StatusOr<std::optional<Bytes>> seen = store().get(key, EntryKind::Plan, &why);
    if (!seen.isOk())
      readerProblems.push_back(seen.status().message());
    else if (!why.empty())
      readerProblems.push_back(why);
    else if (seen->has_value() && **seen != payloadA && **seen != payloadB)
      readerProblems.push_back("a payload that neither writer wrote");
  }
  first.join();
  second.join();

  EXPECT_EQ(putFailures.load(), 0);
  EXPECT_EQ(readerProblems, std::vector<std::string>{});
  std::optional<Bytes> final = lookup(key, EntryKind::Plan);
  ASSERT_TRUE(final.has_value());
  EXPECT_TRUE(*final == payloadA || *final == payloadB);
  EXPECT_EQ(filesEndingWith(".hyc"), std::vector<std::string>{store().pathFor(key)});
}

} // namespace
} // namespace hybrid::cache
