// Tests of the weight archive: the shared offset rule, write/open round trips, the writer's
// argument checks and temp-file cleanup, and every corruption the reader must reject with a
// one-line error naming the file and the field or entry.
#include "hybrid/runtime/WeightArchive.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <gtest/gtest.h>
#include <iterator>
#include <limits>
#include <string>
#include <vector>
#include <xxhash.h>

namespace hybrid {
namespace {

namespace fs = std::filesystem;
using plan::fb::DType;

constexpr uint64_t kPage = 4096;

ArchiveKey testKey() {
  ArchiveKey key{};
  for (size_t i = 0; i < key.size(); ++i)
    key[i] = static_cast<uint8_t>(0xa0 + i);
  return key;
}

// Deterministic, entry-specific bytes, so a misplaced entry cannot compare equal.
std::vector<std::byte> patternBytes(size_t count, uint8_t seed) {
  std::vector<std::byte> bytes(count);
  for (size_t i = 0; i < count; ++i)
    bytes[i] = static_cast<std::byte>((i * 131 + seed * 17 + (i >> 8)) & 0xff);
  return bytes;
}

std::string readWholeFile(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void writeWholeFile(const std::string &path, const std::string &content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(content.data(), static_cast<std::streamsize>(content.size()));
  ASSERT_TRUE(out.good()) << path;
}

uint64_t loadU64(const std::string &bytes, size_t offset) {
  uint64_t value = 0;
  std::memcpy(&value, bytes.data() + offset, sizeof value); // the test host is little-endian
  return value;
}

void storeU64(std::string &bytes, size_t offset, uint64_t value) {
  std::memcpy(bytes.data() + offset, &value, sizeof value);
}

void storeU32(std::string &bytes, size_t offset, uint32_t value) {
  std::memcpy(bytes.data() + offset, &value, sizeof value);
}

// Header field offsets from docs/weight-archive.md.
constexpr size_t kFormatVersionField = 8;
constexpr size_t kPageSizeField = 12;
constexpr size_t kEntryCountField = 32;
constexpr size_t kTableOffsetField = 40;
constexpr size_t kTableSizeField = 48;
constexpr size_t kTableHashField = 56;
constexpr size_t kHeaderHashField = 64;

// Recomputes the table and header hashes after a deliberate edit, so the reader's deeper checks
// (not just the checksums) are exercised.
void reseal(std::string &archive) {
  uint64_t tableOffset = loadU64(archive, kTableOffsetField);
  uint64_t tableSize = loadU64(archive, kTableSizeField);
  if (tableOffset + tableSize <= archive.size())
    storeU64(archive, kTableHashField, XXH3_64bits(archive.data() + tableOffset, tableSize));
  storeU64(archive, kHeaderHashField, XXH3_64bits(archive.data(), kHeaderHashField));
}

struct TestEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;
};

// Sizes deliberately not multiples of the page: 24, 4100, 2, 0 and 8192 + 8 bytes.
std::vector<TestEntry> sampleEntries() {
  return {
      {"model.embed_tokens.weight", DType::F32, {2, 3}, patternBytes(24, 1)},
      {"model.layers.0.mlp.gate_proj.weight", DType::BF16, {2, 1025}, patternBytes(4100, 2)},
      {"model.layers.0.self_attn.scale", DType::F8_E4M3, {2}, patternBytes(2, 3)},
      {"empty", DType::I32, {0, 7}, {}},
      {"model.norm.weight", DType::I64, {1025}, patternBytes(8200, 5)},
  };
}

class WeightArchiveTest : public testing::Test {
protected:
  void SetUp() override {
    std::string pattern = (fs::path(testing::TempDir()) / "hybrid_weights_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << pattern;
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }
  std::string pathFor(const std::string &name) const { return (fs::path(dir_) / name).string(); }
  std::vector<std::string> dirEntries() const {
    std::vector<std::string> names;
    for (const auto &entry : fs::directory_iterator(dir_))
      names.push_back(entry.path().filename().string());
    return names;
  }

  // Writes `entries` to `name` and returns the path.
  std::string writeArchive(const std::string &name, const std::vector<TestEntry> &entries) {
    std::string path = pathFor(name);
    StatusOr<WeightArchiveWriter> writer = WeightArchiveWriter::create(path, testKey());
    EXPECT_TRUE(writer.isOk()) << writer.status().message();
    if (!writer.isOk())
      return path;
    for (const TestEntry &entry : entries) {
      Status status = writer->add(entry.name, entry.dtype, entry.shape, entry.data);
      EXPECT_TRUE(status.isOk()) << status.message();
    }
    Status status = writer->finish();
    EXPECT_TRUE(status.isOk()) << status.message();
    return path;
  }

  // Opens an archive that must be rejected and returns the message, checking it is one line that
  // starts with the path.
  std::string openError(const std::string &path) {
    StatusOr<WeightArchive> archive = WeightArchive::open(path);
    EXPECT_FALSE(archive.isOk()) << path << " was accepted";
    if (archive.isOk())
      return "";
    const std::string &message = archive.status().message();
    EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    return message;
  }

  // Writes the sample archive, applies `edit` to its bytes and returns the open() error.
  std::string corruptedOpenError(const std::function<void(std::string &)> &edit) {
    std::string path = writeArchive("sample.hyw", sampleEntries());
    std::string bytes = readWholeFile(path);
    edit(bytes);
    std::string corrupted = pathFor("corrupted.hyw");
    writeWholeFile(corrupted, bytes);
    return openError(corrupted);
  }

  // Offset of the first entry's record fields inside the file (name "model.embed_tokens.weight",
  // rank 2): name_length u32, name, dtype u8, rank u32, 2 dims, offset, size, data_hash.
  static size_t firstRecordField(const std::string &archive, const std::string &field) {
    size_t record = loadU64(archive, kTableOffsetField);
    size_t name = record + 4;
    size_t dtype = name + std::string("model.embed_tokens.weight").size();
    size_t rank = dtype + 1;
    size_t offset = rank + 4 + 2 * 8;
    if (field == "dtype")
      return dtype;
    if (field == "rank")
      return rank;
    if (field == "offset")
      return offset;
    if (field == "size")
      return offset + 8;
    return record;
  }

  std::string dir_;
};

//===------------------------------------------------------------------------------------------===//
// The offset rule.
//===------------------------------------------------------------------------------------------===//

TEST(PlanWeightOffsets, FirstEntryAfterTheHeaderPageEachOnTheNextPage) {
  std::vector<uint64_t> sizes = {1, 4096, 0, 5000, 4097};
  std::vector<uint64_t> expected = {4096, 8192, 12288, 12288, 20480};
  EXPECT_EQ(planWeightOffsets(sizes), expected);
  EXPECT_TRUE(planWeightOffsets({}).empty());
}

TEST(PlanWeightOffsets, LargerPages) {
  std::vector<uint64_t> sizes = {65536, 1, 70000};
  std::vector<uint64_t> expected = {65536, 131072, 196608};
  EXPECT_EQ(planWeightOffsets(sizes, 65536), expected);
}

TEST(ArchiveKeyText, FormatsAndParsesHex) {
  ArchiveKey key = testKey();
  std::string hex = formatArchiveKey(key);
  EXPECT_EQ(hex, "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf");
  EXPECT_EQ(parseArchiveKey(hex), key);
  EXPECT_EQ(parseArchiveKey("A0A1A2A3A4A5A6A7A8A9AAABACADAEAF"), key);
  EXPECT_FALSE(parseArchiveKey("a0a1"));
  EXPECT_FALSE(parseArchiveKey("g0a1a2a3a4a5a6a7a8a9aaabacadaeaf"));
}

//===------------------------------------------------------------------------------------------===//
// Round trips.
//===------------------------------------------------------------------------------------------===//

TEST_F(WeightArchiveTest, RoundTripKeepsEveryEntry) {
  std::vector<TestEntry> entries = sampleEntries();
  std::string path = writeArchive("model.hyw", entries);
  EXPECT_EQ(dirEntries(), std::vector<std::string>{"model.hyw"}) << "temp file left behind";

  StatusOr<WeightArchive> archive = WeightArchive::open(path);
  ASSERT_TRUE(archive.isOk()) << archive.status().message();
  EXPECT_EQ(archive->key(), testKey());
  EXPECT_EQ(archive->pageSize(), kPage);
  EXPECT_EQ(archive->fileSize(), fs::file_size(path));
  ASSERT_EQ(archive->entries().size(), entries.size());

  std::vector<uint64_t> sizes;
  for (const TestEntry &entry : entries)
    sizes.push_back(entry.data.size());
  std::vector<uint64_t> offsets = planWeightOffsets(sizes);
  for (size_t i = 0; i < entries.size(); ++i) {
    const WeightArchive::Entry &entry = archive->entries()[i];
    SCOPED_TRACE(entry.name);
    EXPECT_EQ(entry.name, entries[i].name);
    EXPECT_EQ(entry.dtype, entries[i].dtype);
    EXPECT_EQ(entry.shape, entries[i].shape);
    EXPECT_EQ(entry.offset, offsets[i]);
    EXPECT_EQ(entry.size, entries[i].data.size());
    const WeightArchive::Entry *found = archive->find(entries[i].name);
    ASSERT_EQ(found, &entry);
    std::span<const std::byte> bytes = archive->bytes(entry);
    EXPECT_TRUE(
        std::equal(bytes.begin(), bytes.end(), entries[i].data.begin(), entries[i].data.end()));
    // Page aligned in memory too: the mapping starts on a page.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(bytes.data()) % kPage, 0u);
  }
  EXPECT_EQ(archive->find("missing"), nullptr);
  Status verified = archive->verifyContents();
  EXPECT_TRUE(verified.isOk()) << verified.message();

  // The writer reports the same entries and size the reader sees.
  StatusOr<WeightArchiveWriter> writer =
      WeightArchiveWriter::create(pathFor("again.hyw"), testKey());
  ASSERT_TRUE(writer.isOk());
  for (const TestEntry &entry : entries)
    ASSERT_TRUE(writer->add(entry.name, entry.dtype, entry.shape, entry.data).isOk());
  ASSERT_TRUE(writer->finish().isOk());
  EXPECT_EQ(writer->fileSize(), archive->fileSize());
  EXPECT_EQ(writer->entries().size(), entries.size());
}

TEST_F(WeightArchiveTest, EmptyArchiveRoundTrips) {
  std::string path = writeArchive("empty.hyw", {});
  StatusOr<WeightArchive> archive = WeightArchive::open(path);
  ASSERT_TRUE(archive.isOk()) << archive.status().message();
  EXPECT_TRUE(archive->entries().empty());
  EXPECT_EQ(archive->fileSize(), kPage); // the header page, an empty table right after it
  EXPECT_TRUE(archive->verifyContents().isOk());
}

TEST_F(WeightArchiveTest, MovedArchiveKeepsItsMapping) {
  std::string path = writeArchive("model.hyw", sampleEntries());
  StatusOr<WeightArchive> opened = WeightArchive::open(path);
  ASSERT_TRUE(opened.isOk());
  WeightArchive archive = std::move(opened).value();
  WeightArchive other = std::move(archive);
  const WeightArchive::Entry *entry = other.find("model.norm.weight");
  ASSERT_NE(entry, nullptr);
  EXPECT_EQ(other.bytes(*entry)[5], patternBytes(8200, 5)[5]);
  EXPECT_TRUE(other.verifyContents().isOk());
}

//===------------------------------------------------------------------------------------------===//
// Writer argument checks and cleanup.
//===------------------------------------------------------------------------------------------===//

TEST_F(WeightArchiveTest, WriterRejectsBadEntriesAndStaysUsable) {
  std::string path = pathFor("model.hyw");
  StatusOr<WeightArchiveWriter> writer = WeightArchiveWriter::create(path, testKey());
  ASSERT_TRUE(writer.isOk());
  std::vector<std::byte> eight = patternBytes(8, 1);

  Status wrongSize = writer->add("w", DType::F32, {3}, eight);
  ASSERT_FALSE(wrongSize.isOk());
  EXPECT_NE(wrongSize.message().find("entry 0 'w'"), std::string::npos) << wrongSize.message();
  EXPECT_NE(wrongSize.message().find("needs 12"), std::string::npos) << wrongSize.message();

  EXPECT_FALSE(writer->add("", DType::F32, {2}, eight).isOk());
  EXPECT_FALSE(writer->add("neg", DType::F32, {-2}, eight).isOk());
  EXPECT_FALSE(writer->add("bad", static_cast<DType>(77), {2}, eight).isOk());

  ASSERT_TRUE(writer->add("w", DType::F32, {2}, eight).isOk());
  Status duplicate = writer->add("w", DType::F32, {2}, eight);
  ASSERT_FALSE(duplicate.isOk());
  EXPECT_NE(duplicate.message().find("duplicate"), std::string::npos) << duplicate.message();

  ASSERT_TRUE(writer->finish().isOk());
  EXPECT_FALSE(writer->add("late", DType::F32, {2}, eight).isOk());
  EXPECT_FALSE(writer->finish().isOk());

  StatusOr<WeightArchive> archive = WeightArchive::open(path);
  ASSERT_TRUE(archive.isOk()) << archive.status().message();
  ASSERT_EQ(archive->entries().size(), 1u);
  EXPECT_EQ(archive->entries()[0].offset, kPage);
}

TEST_F(WeightArchiveTest, WriterRejectsBadPageSize) {
  for (uint64_t pageSize : {uint64_t{0}, uint64_t{1000}, uint64_t{2048}, uint64_t{4097}}) {
    StatusOr<WeightArchiveWriter> writer =
        WeightArchiveWriter::create(pathFor("x.hyw"), testKey(), pageSize);
    ASSERT_FALSE(writer.isOk()) << pageSize;
    EXPECT_NE(writer.status().message().find("page size"), std::string::npos);
  }
  EXPECT_TRUE(dirEntries().empty());
}

TEST_F(WeightArchiveTest, LargerPageSizeRoundTrips) {
  std::string path = pathFor("big_pages.hyw");
  StatusOr<WeightArchiveWriter> writer = WeightArchiveWriter::create(path, testKey(), 65536);
  ASSERT_TRUE(writer.isOk());
  ASSERT_TRUE(writer->add("a", DType::F32, {3}, patternBytes(12, 1)).isOk());
  ASSERT_TRUE(writer->add("b", DType::F16, {5}, patternBytes(10, 2)).isOk());
  ASSERT_TRUE(writer->finish().isOk());
  StatusOr<WeightArchive> archive = WeightArchive::open(path);
  ASSERT_TRUE(archive.isOk()) << archive.status().message();
  EXPECT_EQ(archive->pageSize(), 65536u);
  EXPECT_EQ(archive->entries()[1].offset, 131072u);
}

TEST_F(WeightArchiveTest, WriterDestroyedWithoutFinishLeavesNothing) {
  {
    StatusOr<WeightArchiveWriter> writer = WeightArchiveWriter::create(pathFor("x.hyw"), testKey());
    ASSERT_TRUE(writer.isOk());
    ASSERT_TRUE(writer->add("w", DType::F32, {1024}, patternBytes(4096, 1)).isOk());
    EXPECT_EQ(dirEntries().size(), 1u); // the temp file
    // Moving transfers ownership of the temp file; the moved-from writer must not delete it.
    WeightArchiveWriter moved = std::move(writer).value();
    EXPECT_EQ(dirEntries().size(), 1u);
  }
  EXPECT_TRUE(dirEntries().empty());
}

TEST_F(WeightArchiveTest, FinishReplacesAnExistingFileAtomically) {
  std::string path = writeArchive("model.hyw", sampleEntries());
  writeArchive("model.hyw", {{"only", DType::F32, {1}, patternBytes(4, 9)}});
  StatusOr<WeightArchive> archive = WeightArchive::open(path);
  ASSERT_TRUE(archive.isOk()) << archive.status().message();
  ASSERT_EQ(archive->entries().size(), 1u);
  EXPECT_EQ(dirEntries().size(), 1u);
}

//===------------------------------------------------------------------------------------------===//
// Corruption the reader must reject.
//===------------------------------------------------------------------------------------------===//

TEST_F(WeightArchiveTest, MissingFile) {
  std::string message = openError(pathFor("absent.hyw"));
  EXPECT_NE(message.find("cannot open"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, TruncatedArchive) {
  std::string path = writeArchive("sample.hyw", sampleEntries());
  std::string bytes = readWholeFile(path);
  std::string truncated = pathFor("truncated.hyw");
  for (size_t keep : {size_t{0}, size_t{10}, size_t{71}, size_t{72}, size_t{4096}, size_t{9000},
                      bytes.size() - 1}) {
    SCOPED_TRACE(keep);
    writeWholeFile(truncated, bytes.substr(0, keep));
    std::string message = openError(truncated);
    EXPECT_FALSE(message.empty());
  }
  writeWholeFile(truncated, bytes.substr(0, 9000));
  EXPECT_NE(openError(truncated).find("truncated"), std::string::npos);
}

TEST_F(WeightArchiveTest, TrailingBytes) {
  std::string message = corruptedOpenError([](std::string &bytes) { bytes += "x"; });
  EXPECT_NE(message.find("trailing"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, WrongMagic) {
  std::string message = corruptedOpenError([](std::string &bytes) { bytes[7] = '2'; });
  EXPECT_NE(message.find("'magic'"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, CorruptHeaderFailsTheHeaderHash) {
  std::string message =
      corruptedOpenError([](std::string &bytes) { bytes[kEntryCountField] ^= 0x01; });
  EXPECT_NE(message.find("'header_hash'"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, CorruptTableFailsTheTableHash) {
  std::string message =
      corruptedOpenError([](std::string &bytes) { bytes[bytes.size() - 3] ^= 1; });
  EXPECT_NE(message.find("'table_hash'"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, CorruptEntryDataFoundByVerifyContents) {
  std::string path = writeArchive("sample.hyw", sampleEntries());
  std::string bytes = readWholeFile(path);
  bytes[8192 + 4000] ^= 0x40; // inside the second entry (offset 8192, 4100 bytes)
  writeWholeFile(path, bytes);
  StatusOr<WeightArchive> archive = WeightArchive::open(path); // the table is intact
  ASSERT_TRUE(archive.isOk()) << archive.status().message();
  Status verified = archive->verifyContents();
  ASSERT_FALSE(verified.isOk());
  EXPECT_EQ(verified.message().rfind(path + ": entry 1 'model.layers.0.mlp.gate_proj.weight'", 0),
            0u)
      << verified.message();
  EXPECT_NE(verified.message().find("corrupt data"), std::string::npos);
}

TEST_F(WeightArchiveTest, UnsupportedFormatVersion) {
  std::string message = corruptedOpenError([](std::string &bytes) {
    storeU32(bytes, kFormatVersionField, 4);
    reseal(bytes);
  });
  EXPECT_NE(message.find("'format_version' is 4"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, BadPageSize) {
  std::string message = corruptedOpenError([](std::string &bytes) {
    storeU32(bytes, kPageSizeField, 1000);
    reseal(bytes);
  });
  EXPECT_NE(message.find("'page_size' is 1000"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, TableOutsideTheFile) {
  std::string message = corruptedOpenError([](std::string &bytes) {
    storeU64(bytes, kTableSizeField, loadU64(bytes, kTableSizeField) + 4096);
    reseal(bytes);
  });
  EXPECT_NE(message.find("'table_size'"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, EntryCountDisagreesWithTable) {
  std::string fewer = corruptedOpenError([](std::string &bytes) {
    storeU64(bytes, kEntryCountField, loadU64(bytes, kEntryCountField) - 1);
    reseal(bytes);
  });
  EXPECT_NE(fewer.find("after its last entry"), std::string::npos) << fewer;
  std::string more = corruptedOpenError([](std::string &bytes) {
    storeU64(bytes, kEntryCountField, loadU64(bytes, kEntryCountField) + 1);
    reseal(bytes);
  });
  EXPECT_NE(more.find("entry 5"), std::string::npos) << more;
  std::string huge = corruptedOpenError([](std::string &bytes) {
    storeU64(bytes, kEntryCountField, uint64_t{1} << 60);
    reseal(bytes);
  });
  EXPECT_NE(huge.find("'entry_count'"), std::string::npos) << huge;
}

TEST_F(WeightArchiveTest, MisalignedEntry) {
  std::string message = corruptedOpenError([](std::string &bytes) {
    size_t field = firstRecordField(bytes, "offset");
    storeU64(bytes, field, loadU64(bytes, field) + 8);
    reseal(bytes);
  });
  EXPECT_NE(message.find("entry 0 'model.embed_tokens.weight': field 'offset' is 4104"),
            std::string::npos)
      << message;
}

TEST_F(WeightArchiveTest, EntryInTheHeaderPage) {
  std::string message = corruptedOpenError([](std::string &bytes) {
    storeU64(bytes, firstRecordField(bytes, "offset"), 0);
    reseal(bytes);
  });
  EXPECT_NE(message.find("field 'offset' is 0"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, EntryPastTheTable) {
  std::string message = corruptedOpenError([](std::string &bytes) {
    storeU64(bytes, firstRecordField(bytes, "offset"), uint64_t{1} << 40);
    reseal(bytes);
  });
  EXPECT_NE(message.find("runs past the entry table"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, OverlappingEntries) {
  std::string message = corruptedOpenError([](std::string &bytes) {
    // The first entry moved onto the second one's page.
    storeU64(bytes, firstRecordField(bytes, "offset"), 8192);
    reseal(bytes);
  });
  EXPECT_NE(message.find("overlap"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, SizeInconsistentWithDtypeAndShape) {
  std::string message = corruptedOpenError([](std::string &bytes) {
    storeU64(bytes, firstRecordField(bytes, "size"), 20);
    reseal(bytes);
  });
  EXPECT_NE(message.find("field 'size' is 20 but F32 [2, 3] needs 24 bytes"), std::string::npos)
      << message;
}

TEST_F(WeightArchiveTest, UnknownDtype) {
  std::string message = corruptedOpenError([](std::string &bytes) {
    bytes[firstRecordField(bytes, "dtype")] = 99;
    reseal(bytes);
  });
  EXPECT_NE(message.find("field 'dtype' has the unknown value 99"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, AbsurdRank) {
  std::string message = corruptedOpenError([](std::string &bytes) {
    storeU32(bytes, firstRecordField(bytes, "rank"), 1000000);
    reseal(bytes);
  });
  EXPECT_NE(message.find("field 'rank'"), std::string::npos) << message;
}

TEST_F(WeightArchiveTest, RandomByteFlipsNeverCrash) {
  std::string path = writeArchive("sample.hyw", sampleEntries());
  const std::string original = readWholeFile(path);
  std::string corrupted = pathFor("flipped.hyw");
  uint64_t tableOffset = loadU64(original, kTableOffsetField);
  std::srand(1234);
  for (int trial = 0; trial < 200; ++trial) {
    std::string bytes = original;
    // Half the flips land in the header or the table, where the checks are.
    size_t position = trial % 2 ? static_cast<size_t>(std::rand()) % kWeightArchiveHeaderBytes
                                : tableOffset + static_cast<size_t>(std::rand()) %
                                                    (original.size() - tableOffset);
    bytes[position] ^= static_cast<char>(1 + std::rand() % 255);
    if (trial % 4 == 3)
      reseal(bytes); // get past the checksums to the field checks
    writeWholeFile(corrupted, bytes);
    StatusOr<WeightArchive> archive = WeightArchive::open(corrupted);
    if (archive.isOk())
      (void)archive->verifyContents();
    else
      EXPECT_EQ(archive.status().message().rfind(corrupted + ": ", 0), 0u)
          << archive.status().message();
  }
}

//===------------------------------------------------------------------------------------------===//
// Synthetic archives (format version 2): descriptors instead of data.
//===------------------------------------------------------------------------------------------===//

using kernels::SyntheticKind;

struct SyntheticTestEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  SyntheticWeight synthetic;
};

std::vector<SyntheticTestEntry> sampleSyntheticEntries() {
  return {
      {"model.embed_tokens.weight", DType::BF16, {3, 5},
       {SyntheticKind::Normal, 0x1234, 0.5f, 0.0f, 3, 5, 0, 0}},
      {"model.layers.0.self_attn.A_log", DType::F32, {1, 1, 4, 1},
       {SyntheticKind::LogUniform, 7, 1.0f, 16.0f, 1, 4, 0, 0}},
      // [10, 40] in tiles of 8 x 32, stored padded to [16, 64].
      {"model.layers.0.mlp.gate_proj.weight", DType::F8_E4M3, {16, 64},
       {SyntheticKind::Normal, 9, 0.25f, 0.0f, 10, 40, 8, 32}},
      {"model.layers.0.mlp.gate_proj.weight_scale_inv", DType::F32, {1, 1},
       {SyntheticKind::Constant, 11, 0.0f, 0.125f, 1, 1, 0, 0}},
      // A sharded rank's columns [6, 12) of a [4, 12] tensor.
      {"model.layers.0.self_attn.o_proj.weight", DType::BF16, {4, 6},
       {.kind = SyntheticKind::Normal,
        .key = 13,
        .a = 0.5f,
        .rows = 4,
        .cols = 6,
        .sourceRowStride = 12,
        .sourceOffset = 6}},
  };
}

class SyntheticArchiveTest : public WeightArchiveTest {
protected:
  std::string writeSynthetic(const std::string &name,
                             const std::vector<SyntheticTestEntry> &entries) {
    std::string path = pathFor(name);
    StatusOr<WeightArchiveWriter> writer = WeightArchiveWriter::create(path, testKey());
    EXPECT_TRUE(writer.isOk()) << writer.status().message();
    if (!writer.isOk())
      return path;
    for (const SyntheticTestEntry &entry : entries) {
      Status status = writer->addSynthetic(entry.name, entry.dtype, entry.shape, entry.synthetic);
      EXPECT_TRUE(status.isOk()) << status.message();
    }
    Status status = writer->finish();
    EXPECT_TRUE(status.isOk()) << status.message();
    return path;
  }

  std::string corruptedSyntheticError(const std::function<void(std::string &)> &edit) {
    std::string bytes = readWholeFile(writeSynthetic("synthetic.hyw", sampleSyntheticEntries()));
    edit(bytes);
    std::string corrupted = pathFor("corrupted.hyw");
    writeWholeFile(corrupted, bytes);
    return openError(corrupted);
  }

  // The first record's data_hash and descriptor (name "model.embed_tokens.weight", rank 2).
  static size_t firstDescriptorField(const std::string &archive, const std::string &field) {
    const size_t hash = loadU64(archive, kTableOffsetField) + 4 +
                        std::string("model.embed_tokens.weight").size() + 1 + 4 + 2 * 8 + 16;
    const size_t kind = hash + 8;
    if (field == "data_hash")
      return hash;
    if (field == "kind")
      return kind;
    if (field == "a")
      return kind + 1 + 8;
    return kind + 1 + 8 + 4 + 4; // rows
  }
};

TEST_F(SyntheticArchiveTest, RoundTripKeepsDescriptorsAndPlannedOffsets) {
  const std::vector<SyntheticTestEntry> entries = sampleSyntheticEntries();
  const std::string path = writeSynthetic("synthetic.hyw", entries);
  const std::string bytes = readWholeFile(path);
  uint32_t version = 0;
  std::memcpy(&version, bytes.data() + kFormatVersionField, 4);
  EXPECT_EQ(version, kSyntheticWeightArchiveFormatVersion);
  // No data: the table follows the header page and the file ends with it.
  EXPECT_EQ(loadU64(bytes, kTableOffsetField), kPage);
  EXPECT_EQ(bytes.size(), kPage + loadU64(bytes, kTableSizeField));

  StatusOr<WeightArchive> archive = WeightArchive::open(path);
  ASSERT_TRUE(archive.isOk()) << archive.status().message();
  EXPECT_TRUE(archive->synthetic());
  ASSERT_EQ(archive->entries().size(), entries.size());
  const std::vector<uint64_t> sizes = {30, 16, 1024, 4, 48};
  const std::vector<uint64_t> offsets = planWeightOffsets(sizes);
  for (size_t i = 0; i < entries.size(); ++i) {
    const WeightArchiveEntry &entry = archive->entries()[i];
    EXPECT_EQ(entry.name, entries[i].name);
    EXPECT_EQ(entry.dtype, entries[i].dtype);
    EXPECT_EQ(entry.shape, entries[i].shape);
    EXPECT_EQ(entry.size, sizes[i]) << entry.name;
    EXPECT_EQ(entry.offset, offsets[i]) << entry.name;
    EXPECT_EQ(entry.dataHash, 0u);
    ASSERT_TRUE(entry.synthetic.has_value());
    EXPECT_EQ(*entry.synthetic, entries[i].synthetic) << entry.name;
    EXPECT_TRUE(archive->bytes(entry).empty());
  }
  const kernels::SyntheticFill fill = syntheticFill(archive->entries()[2]);
  EXPECT_EQ(fill.storage, kernels::SyntheticStorage::F8E4M3);
  EXPECT_EQ(fill.storedElements, 1024);
  EXPECT_EQ(fill.tileRows, 8);
  EXPECT_EQ(fill.cols, 40);
  EXPECT_EQ(fill.sourceRowStride, 0);
  const kernels::SyntheticFill window = syntheticFill(archive->entries()[4]);
  EXPECT_EQ(window.sourceRowStride, 12);
  EXPECT_EQ(window.sourceOffset, 6);
  EXPECT_EQ(window.storedElements, 24);
  EXPECT_TRUE(archive->verifyContents().isOk());
}

// Format version 2 (before sharded plans) has no source window: its entries are whole tensors.
TEST_F(SyntheticArchiveTest, VersionTwoReadsAsWholeTensors) {
  const SyntheticTestEntry entry = sampleSyntheticEntries()[0];
  std::string bytes = readWholeFile(writeSynthetic("whole.hyw", {entry}));
  // The only record ends the file with its window (two u64 zeros): drop them, as version 2 wrote.
  ASSERT_EQ(bytes.substr(bytes.size() - 16), std::string(16, '\0'));
  bytes.resize(bytes.size() - 16);
  storeU64(bytes, kTableSizeField, loadU64(bytes, kTableSizeField) - 16);
  storeU32(bytes, kFormatVersionField, kWholeTensorSyntheticWeightArchiveFormatVersion);
  reseal(bytes);
  const std::string path = pathFor("version2.hyw");
  writeWholeFile(path, bytes);
  StatusOr<WeightArchive> archive = WeightArchive::open(path);
  ASSERT_TRUE(archive.isOk()) << archive.status().message();
  ASSERT_EQ(archive->entries().size(), 1u);
  EXPECT_EQ(*archive->entries()[0].synthetic, entry.synthetic);
}

TEST_F(SyntheticArchiveTest, WriterRejectsABadSourceWindow) {
  StatusOr<WeightArchiveWriter> writer =
      WeightArchiveWriter::create(pathFor("window.hyw"), testKey());
  ASSERT_TRUE(writer.isOk());
  SyntheticWeight overlapping{.kind = SyntheticKind::Normal, .a = 0.5f, .rows = 2, .cols = 3,
                              .sourceRowStride = 2};
  Status status = writer->addSynthetic("w", DType::BF16, {2, 3}, overlapping);
  EXPECT_NE(status.message().find("field 'synthetic.source_row_stride' is 2, expected 0 or at "
                                  "least the 3 columns"),
            std::string::npos)
      << status.message();
  SyntheticWeight negative{.kind = SyntheticKind::Normal, .a = 0.5f, .rows = 2, .cols = 3,
                           .sourceOffset = -1};
  status = writer->addSynthetic("w", DType::BF16, {2, 3}, negative);
  EXPECT_NE(status.message().find("'synthetic.source_offset' is negative"), std::string::npos)
      << status.message();
  SyntheticWeight far{.kind = SyntheticKind::Normal, .a = 0.5f, .rows = 2, .cols = 3,
                      .sourceRowStride = int64_t{1} << 62, .sourceOffset = int64_t{1} << 62};
  status = writer->addSynthetic("w", DType::BF16, {2, 3}, far);
  EXPECT_NE(status.message().find("place elements past 2^63"), std::string::npos)
      << status.message();
}

TEST_F(SyntheticArchiveTest, WriterRejectsBadDescriptorsAndStaysUsable) {
  StatusOr<WeightArchiveWriter> writer =
      WeightArchiveWriter::create(pathFor("bad.hyw"), testKey());
  ASSERT_TRUE(writer.isOk());
  auto error = [&](DType dtype, std::vector<int64_t> shape, SyntheticWeight synthetic) {
    Status status = writer->addSynthetic("w", dtype, std::move(shape), synthetic);
    EXPECT_FALSE(status.isOk());
    return status.message();
  };
  const SyntheticWeight normal{SyntheticKind::Normal, 1, 0.5f, 0.0f, 2, 3, 0, 0};
  SyntheticWeight unknownKind = normal;
  unknownKind.kind = static_cast<SyntheticKind>(9);
  EXPECT_NE(error(DType::BF16, {2, 3}, unknownKind).find("'synthetic.kind'"), std::string::npos);
  EXPECT_NE(error(DType::I32, {2, 3}, normal).find("F32, BF16 or F8_E4M3, not I32"),
            std::string::npos);
  SyntheticWeight infinite = normal;
  infinite.a = std::numeric_limits<float>::infinity();
  EXPECT_NE(error(DType::BF16, {2, 3}, infinite).find("must be finite"), std::string::npos);
  const SyntheticWeight backwards{SyntheticKind::LogUniform, 1, 16.0f, 1.0f, 1, 6, 0, 0};
  EXPECT_NE(error(DType::F32, {6}, backwards).find("0 < a < b"), std::string::npos);
  EXPECT_NE(error(DType::BF16, {3, 3}, normal).find("do not match the 9 elements"),
            std::string::npos);
  SyntheticWeight halfTiled = normal;
  halfTiled.tileRows = 8;
  EXPECT_NE(error(DType::BF16, {2, 3}, halfTiled).find("both be 0"), std::string::npos);
  SyntheticWeight tiled = normal;
  tiled.tileRows = tiled.tileCols = 8;
  EXPECT_NE(error(DType::BF16, {2, 3}, tiled).find("stored padded, not as [2, 3]"),
            std::string::npos);
  // A synthetic archive takes no data entry (nor the reverse).
  ASSERT_TRUE(writer->addSynthetic("w", DType::BF16, {2, 3}, normal).isOk());
  Status mixed = writer->add("data", DType::F32, {1}, patternBytes(4, 1));
  EXPECT_NE(mixed.message().find("data entries or synthetic ones, not both"), std::string::npos)
      << mixed.message();
  ASSERT_TRUE(writer->addSynthetic("w8", DType::BF16, {8, 8}, tiled).isOk());
  ASSERT_TRUE(writer->finish().isOk());
  StatusOr<WeightArchive> archive = WeightArchive::open(pathFor("bad.hyw"));
  ASSERT_TRUE(archive.isOk()) << archive.status().message();
  EXPECT_EQ(archive->entries().size(), 2u);
}

TEST_F(SyntheticArchiveTest, ReaderRejectsAnUnknownKind) {
  std::string message = corruptedSyntheticError([](std::string &bytes) {
    bytes[firstDescriptorField(bytes, "kind")] = 9;
    reseal(bytes);
  });
  EXPECT_NE(message.find("entry 0 'model.embed_tokens.weight': field 'synthetic.kind' has the "
                         "unknown value 9"),
            std::string::npos)
      << message;
}

TEST_F(SyntheticArchiveTest, ReaderRejectsADataHash) {
  std::string message = corruptedSyntheticError([](std::string &bytes) {
    storeU64(bytes, firstDescriptorField(bytes, "data_hash"), 5);
    reseal(bytes);
  });
  EXPECT_NE(message.find("field 'data_hash' is 0x0000000000000005, expected 0"),
            std::string::npos)
      << message;
}

TEST_F(SyntheticArchiveTest, ReaderRejectsANonFiniteParameter) {
  std::string message = corruptedSyntheticError([](std::string &bytes) {
    storeU32(bytes, firstDescriptorField(bytes, "a"), 0x7fc00000u); // NaN
    reseal(bytes);
  });
  EXPECT_NE(message.find("must be finite"), std::string::npos) << message;
}

TEST_F(SyntheticArchiveTest, ReaderRejectsALayoutThatMissesTheShape) {
  std::string message = corruptedSyntheticError([](std::string &bytes) {
    storeU64(bytes, firstDescriptorField(bytes, "rows"), 4);
    reseal(bytes);
  });
  EXPECT_NE(message.find("(4 x 5) do not match the 15 elements of [3, 5]"), std::string::npos)
      << message;
}

TEST_F(SyntheticArchiveTest, DataArchiveReadAsSyntheticIsRejected) {
  // Version 1 records read as version 2 ones: each has a data hash and lacks a descriptor.
  std::string message = corruptedOpenError([](std::string &bytes) {
    storeU32(bytes, kFormatVersionField, kSyntheticWeightArchiveFormatVersion);
    reseal(bytes);
  });
  EXPECT_NE(message.find("expected 0 for a synthetic entry"), std::string::npos) << message;
}

TEST_F(SyntheticArchiveTest, RandomByteFlipsNeverCrash) {
  const std::string original =
      readWholeFile(writeSynthetic("synthetic.hyw", sampleSyntheticEntries()));
  const std::string corrupted = pathFor("flipped.hyw");
  const uint64_t tableOffset = loadU64(original, kTableOffsetField);
  std::srand(4321);
  for (int round = 0; round < 300; ++round) {
    std::string bytes = original;
    const size_t at = tableOffset + static_cast<size_t>(std::rand()) % (bytes.size() - tableOffset);
    bytes[at] = static_cast<char>(bytes[at] ^ (1 + std::rand() % 255));
    reseal(bytes);
    writeWholeFile(corrupted, bytes);
    StatusOr<WeightArchive> archive = WeightArchive::open(corrupted);
    if (!archive.isOk())
      EXPECT_EQ(archive.status().message().find('\n'), std::string::npos);
  }
}

} // namespace
} // namespace hybrid
