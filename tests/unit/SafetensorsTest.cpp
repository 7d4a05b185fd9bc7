// Tests of the safetensors reader/writer: round trips, the real tiny checkpoint, every malformed
// input the reader must reject with a one-line error, and the float conversions.
#include "hybrid/runtime/Safetensors.h"

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <gtest/gtest.h>
#include <iterator>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

namespace hybrid::safetensors {
namespace {

namespace fs = std::filesystem;

const std::string kTinyModelDir = std::string(HYBRID_TEST_DATA_DIR) + "/kimi_linear_tiny";

template <typename T> std::vector<std::byte> toBytes(const std::vector<T> &values) {
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  if (!bytes.empty())
    std::memcpy(bytes.data(), values.data(), bytes.size());
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

// A safetensors file with the given header text and `dataBytes` zero bytes of data.
std::string craftFile(const std::string &header, size_t dataBytes) {
  uint64_t length = header.size();
  std::string content(reinterpret_cast<const char *>(&length), sizeof length);
  return content + header + std::string(dataBytes, '\0');
}

uint64_t headerLengthOf(const std::string &fileContent) {
  uint64_t length = 0;
  std::memcpy(&length, fileContent.data(), sizeof length);
  return length;
}

// Gives each test its own scratch folder, so ctest may run them in parallel.
class ScratchDirTest : public testing::Test {
protected:
  void SetUp() override {
    std::string pattern = (fs::path(testing::TempDir()) / "hybrid_safetensors_XXXXXX").string();
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

  // Opens a file that must be rejected and returns the message, checking it is one line that
  // starts with the path.
  std::string openError(const std::string &path) {
    StatusOr<File> file = File::open(path);
    EXPECT_FALSE(file.isOk()) << path << " was accepted";
    if (file.isOk())
      return "";
    const std::string &message = file.status().message();
    EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    return message;
  }

  std::string dir_;
};

//===------------------------------------------------------------------------------------------===//
// Round trip through the writer and reader.
//===------------------------------------------------------------------------------------------===//

using SafetensorsRoundTrip = ScratchDirTest;

TEST_F(SafetensorsRoundTrip, SeveralDTypesMetadataAndEmptyTensor) {
  // Names deliberately unsorted: the reader must keep the written order. The 1-byte tensor first
  // puts every later tensor at an odd offset, exercising unaligned reads.
  std::vector<uint8_t> flag = {7};
  std::vector<float> weights = {1.5f, -2.25f, 0.0f, 3.0e-5f, 1.0e10f, -0.0f};
  std::vector<uint16_t> bf16 = {floatToBf16(1.0f), floatToBf16(-0.5f), floatToBf16(3.0f),
                                floatToBf16(65536.0f)};
  std::vector<int64_t> ids = {0, -1, std::numeric_limits<int64_t>::max()};
  std::vector<uint8_t> fp8 = {0x38, 0x7e, 0x01, 0xb8, 0x00}; // 1, 448, 2^-9, -1, 0
  std::vector<std::byte> flagBytes = toBytes(flag), weightBytes = toBytes(weights),
                         bf16Bytes = toBytes(bf16), idBytes = toBytes(ids), fp8Bytes = toBytes(fp8);
  std::vector<TensorView> views = {
      {"z.flag", DType::U8, {1}, flagBytes},   {"m.weight", DType::F32, {2, 3}, weightBytes},
      {"a.bf16", DType::BF16, {4}, bf16Bytes}, {"empty", DType::F32, {0, 4}, {}},
      {"ids", DType::I64, {1, 3}, idBytes},    {"fp8", DType::F8_E4M3, {5}, fp8Bytes},
  };
  std::map<std::string, std::string> metadata = {{"format", "pt"}, {"producer", "hybrid-test"}};
  std::string path = pathFor("round_trip.safetensors");
  Status written = write(path, views, metadata);
  ASSERT_TRUE(written.isOk()) << written.message();

  StatusOr<File> file = File::open(path);
  ASSERT_TRUE(file.isOk()) << file.status().message();
  EXPECT_EQ(file->path(), path);
  EXPECT_EQ(file->metadata(), metadata);
  ASSERT_EQ(file->tensors().size(), views.size());
  uint64_t dataBytes = 0;
  for (size_t i = 0; i < views.size(); ++i) {
    const TensorInfo &tensor = file->tensors()[i];
    SCOPED_TRACE(views[i].name);
    EXPECT_EQ(tensor.name, views[i].name);
    EXPECT_EQ(tensor.dtype, views[i].dtype);
    EXPECT_EQ(tensor.shape, views[i].shape);
    EXPECT_EQ(tensor.begin, dataBytes); // packed back to back in the given order
    std::span<const std::byte> bytes = file->bytes(tensor);
    ASSERT_EQ(bytes.size(), views[i].data.size());
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), views[i].data.begin()));
    EXPECT_EQ(file->find(views[i].name), &tensor);
    dataBytes += tensor.byteSize();
  }
  EXPECT_EQ(file->find("missing"), nullptr);
  EXPECT_EQ(file->find("empty")->numElements(), 0);
  EXPECT_EQ(file->find("m.weight")->numElements(), 6);

  // Layout: 8-byte length, header padded so the data section starts 8-byte aligned.
  std::string raw = readWholeFile(path);
  uint64_t headerLength = headerLengthOf(raw);
  EXPECT_EQ((8 + headerLength) % 8, 0u);
  EXPECT_EQ(file->fileSize(), 8 + headerLength + dataBytes);
  EXPECT_EQ(raw.size(), file->fileSize());

  StatusOr<std::vector<float>> floats = readAsFloat(*file, *file->find("m.weight"));
  ASSERT_TRUE(floats.isOk()) << floats.status().message();
  EXPECT_EQ(*floats, weights);
  EXPECT_TRUE(std::signbit((*floats)[5]));
  StatusOr<std::vector<float>> fromBf16 = readAsFloat(*file, *file->find("a.bf16"));
  ASSERT_TRUE(fromBf16.isOk());
  EXPECT_EQ(*fromBf16, (std::vector<float>{1.0f, -0.5f, 3.0f, 65536.0f}));
  StatusOr<std::vector<float>> fromFp8 = readAsFloat(*file, *file->find("fp8"));
  ASSERT_TRUE(fromFp8.isOk());
  EXPECT_EQ(*fromFp8, (std::vector<float>{1.0f, 448.0f, std::ldexp(1.0f, -9), -1.0f, 0.0f}));
  StatusOr<std::vector<int64_t>> ints = readAsInt64(*file, *file->find("ids"));
  ASSERT_TRUE(ints.isOk()) << ints.status().message();
  EXPECT_EQ(*ints, ids);
  StatusOr<std::vector<int64_t>> flagInts = readAsInt64(*file, *file->find("z.flag"));
  ASSERT_TRUE(flagInts.isOk());
  EXPECT_EQ(*flagInts, std::vector<int64_t>{7});
  StatusOr<std::vector<float>> emptyFloats = readAsFloat(*file, *file->find("empty"));
  ASSERT_TRUE(emptyFloats.isOk());
  EXPECT_TRUE(emptyFloats->empty());
}

TEST_F(SafetensorsRoundTrip, NoMetadataKeyWhenMetadataIsEmpty) {
  std::vector<std::byte> data = toBytes(std::vector<int32_t>{1, 2, 3});
  std::string path = pathFor("plain.safetensors");
  ASSERT_TRUE(write(path, {{"x", DType::I32, {3}, data}}).isOk());
  EXPECT_EQ(readWholeFile(path).find("__metadata__"), std::string::npos);
  StatusOr<File> file = File::open(path);
  ASSERT_TRUE(file.isOk()) << file.status().message();
  EXPECT_TRUE(file->metadata().empty());
  StatusOr<std::vector<float>> asFloat = readAsFloat(*file, file->tensors()[0]);
  ASSERT_TRUE(asFloat.isOk());
  EXPECT_EQ(*asFloat, (std::vector<float>{1.0f, 2.0f, 3.0f}));
}

TEST_F(SafetensorsRoundTrip, BoolAndScalarTensors) {
  std::vector<std::byte> flags = toBytes(std::vector<uint8_t>{1, 0, 1});
  std::vector<std::byte> scalar = toBytes(std::vector<double>{2.5});
  std::string path = pathFor("bool.safetensors");
  ASSERT_TRUE(write(path, {{"flags", DType::BOOL, {3}, flags}, {"s", DType::F64, {}, scalar}}));
  StatusOr<File> file = File::open(path);
  ASSERT_TRUE(file.isOk()) << file.status().message();
  EXPECT_EQ(file->find("s")->numElements(), 1);
  EXPECT_TRUE(file->find("s")->shape.empty());
  EXPECT_EQ(*readAsInt64(*file, *file->find("flags")), (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(*readAsFloat(*file, *file->find("s")), std::vector<float>{2.5f});
}

TEST_F(SafetensorsRoundTrip, OverwritesExistingFile) {
  std::string path = pathFor("overwrite.safetensors");
  std::vector<std::byte> first = toBytes(std::vector<float>{1.0f});
  std::vector<std::byte> second = toBytes(std::vector<float>{2.0f, 3.0f});
  ASSERT_TRUE(write(path, {{"old", DType::F32, {1}, first}}).isOk());
  ASSERT_TRUE(write(path, {{"new", DType::F32, {2}, second}}).isOk());
  StatusOr<File> file = File::open(path);
  ASSERT_TRUE(file.isOk());
  ASSERT_EQ(file->tensors().size(), 1u);
  EXPECT_EQ(file->tensors()[0].name, "new");
  EXPECT_EQ(dirEntries(), std::vector<std::string>{"overwrite.safetensors"});
}

TEST_F(SafetensorsRoundTrip, MoveTransfersTheMapping) {
  std::string path = pathFor("move.safetensors");
  std::vector<std::byte> data = toBytes(std::vector<float>{4.0f, 5.0f});
  ASSERT_TRUE(write(path, {{"t", DType::F32, {2}, data}}).isOk());
  StatusOr<File> opened = File::open(path);
  ASSERT_TRUE(opened.isOk());
  File moved = std::move(opened).value();
  EXPECT_EQ(*readAsFloat(moved, *moved.find("t")), (std::vector<float>{4.0f, 5.0f}));

  StatusOr<File> other = File::open(path);
  ASSERT_TRUE(other.isOk());
  File assigned = std::move(other).value();
  assigned = std::move(moved); // unmaps the first mapping, takes the second
  EXPECT_EQ(*readAsFloat(assigned, *assigned.find("t")), (std::vector<float>{4.0f, 5.0f}));
  EXPECT_EQ(assigned.path(), path);
}

//===------------------------------------------------------------------------------------------===//
// Writer errors.
//===------------------------------------------------------------------------------------------===//

using SafetensorsWriter = ScratchDirTest;

TEST_F(SafetensorsWriter, RejectsSizeMismatchAndLeavesNoFiles) {
  std::string path = pathFor("bad.safetensors");
  std::vector<std::byte> sixBytes(6);
  Status status =
      write(path, {{"ok", DType::U8, {6}, sixBytes}, {"short", DType::F32, {2}, sixBytes}});
  ASSERT_FALSE(status.isOk());
  EXPECT_NE(status.message().find(path), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("'short'"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("needs 8"), std::string::npos) << status.message();
  EXPECT_TRUE(dirEntries().empty());
}

TEST_F(SafetensorsWriter, RejectsDuplicateNames) {
  std::string path = pathFor("dup.safetensors");
  std::vector<std::byte> four(4);
  Status status = write(path, {{"w", DType::F32, {1}, four}, {"w", DType::I32, {1}, four}});
  ASSERT_FALSE(status.isOk());
  EXPECT_NE(status.message().find(path), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("duplicate"), std::string::npos) << status.message();
  EXPECT_TRUE(dirEntries().empty());
}

TEST_F(SafetensorsWriter, RejectsReservedNameAndNegativeShape) {
  std::vector<std::byte> four(4);
  Status reserved = write(pathFor("r.safetensors"), {{"__metadata__", DType::F32, {1}, four}});
  EXPECT_FALSE(reserved.isOk());
  Status negative = write(pathFor("n.safetensors"), {{"neg", DType::F32, {-1}, {}}});
  ASSERT_FALSE(negative.isOk());
  EXPECT_NE(negative.message().find("'neg'"), std::string::npos) << negative.message();
  EXPECT_TRUE(dirEntries().empty());
}

TEST_F(SafetensorsWriter, RejectsNameThatIsNotUtf8) {
  std::string path = pathFor("utf8.safetensors");
  std::vector<std::byte> four(4);
  Status status = write(path, {{"bad\xff", DType::F32, {1}, four}});
  ASSERT_FALSE(status.isOk());
  EXPECT_NE(status.message().find("UTF-8"), std::string::npos) << status.message();
  EXPECT_TRUE(dirEntries().empty());
}

// A failure after the temp file exists (here: renaming onto a non-empty folder) removes it.
TEST_F(SafetensorsWriter, RemovesTempFileWhenRenameFails) {
  std::string path = pathFor("target.safetensors");
  fs::create_directory(path);
  writeWholeFile(path + "/keep", "x");
  std::vector<std::byte> four(4);
  Status status = write(path, {{"w", DType::F32, {1}, four}});
  ASSERT_FALSE(status.isOk());
  EXPECT_EQ(status.message().rfind(path + ": ", 0), 0u) << status.message();
  EXPECT_NE(status.message().find("rename"), std::string::npos) << status.message();
  EXPECT_EQ(dirEntries(), std::vector<std::string>{"target.safetensors"});
}

TEST_F(SafetensorsWriter, ReportsMissingDirectory) {
  std::string path = pathFor("no/such/dir/x.safetensors");
  Status status = write(path, {});
  ASSERT_FALSE(status.isOk());
  EXPECT_EQ(status.message().rfind(path + ": ", 0), 0u) << status.message();
}

//===------------------------------------------------------------------------------------------===//
// The real tiny checkpoint and golden file.
//===------------------------------------------------------------------------------------------===//

TEST(SafetensorsCheckpoint, ReadsFirstShard) {
  StatusOr<File> file = File::open(kTinyModelDir + "/model-00001-of-00002.safetensors");
  ASSERT_TRUE(file.isOk()) << file.status().message();
  EXPECT_EQ(file->tensors().size(), 76u);
  EXPECT_EQ(file->fileSize(), 3406848u);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  // Header order, not alphabetical: A_log comes before lm_head.weight in the file.
  EXPECT_EQ(file->tensors()[0].name, "model.layers.0.self_attn.A_log");
  EXPECT_EQ(file->tensors()[5].name, "lm_head.weight");

  const TensorInfo *embed = file->find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  EXPECT_EQ(embed->dtype, DType::BF16);
  EXPECT_EQ(embed->shape, (std::vector<int64_t>{256, 256}));
  EXPECT_EQ(embed->byteSize(), 256u * 256u * 2u);
  StatusOr<std::vector<float>> embedValues = readAsFloat(*file, *embed);
  ASSERT_TRUE(embedValues.isOk());
  ASSERT_EQ(embedValues->size(), 256u * 256u);
  EXPECT_EQ((*embedValues)[0], std::bit_cast<float>(0xbd8a0000u)); // first bf16 is 0xbd8a
  EXPECT_EQ((*embedValues)[3], std::bit_cast<float>(0xbcd50000u));

  const TensorInfo *aLog = file->find("model.layers.0.self_attn.A_log");
  ASSERT_NE(aLog, nullptr);
  EXPECT_EQ(aLog->dtype, DType::F32);
  EXPECT_EQ(aLog->shape, (std::vector<int64_t>{1, 1, 2, 1}));
  StatusOr<std::vector<float>> aLogValues = readAsFloat(*file, *aLog);
  ASSERT_TRUE(aLogValues.isOk());
  std::span<const std::byte> raw = file->bytes(*aLog);
  std::vector<float> rawValues(2);
  std::memcpy(rawValues.data(), raw.data(), raw.size());
  EXPECT_EQ(*aLogValues, rawValues);
  EXPECT_FLOAT_EQ((*aLogValues)[0], 2.531156539916992f);
  EXPECT_FLOAT_EQ((*aLogValues)[1], 1.2372031211853027f);
}

TEST(SafetensorsCheckpoint, ReadsGoldenInputIds) {
  std::string path = kTinyModelDir + "/golden.safetensors";
  StatusOr<File> file = File::open(path);
  ASSERT_TRUE(file.isOk()) << file.status().message();
  const TensorInfo *inputIds = file->find("input_ids");
  ASSERT_NE(inputIds, nullptr);
  EXPECT_EQ(inputIds->dtype, DType::I64);
  EXPECT_EQ(inputIds->shape, (std::vector<int64_t>{1, 40}));
  StatusOr<std::vector<int64_t>> ids = readAsInt64(*file, *inputIds);
  ASSERT_TRUE(ids.isOk()) << ids.status().message();
  ASSERT_EQ(ids->size(), 40u);
  EXPECT_EQ((std::vector<int64_t>(ids->begin(), ids->begin() + 4)),
            (std::vector<int64_t>{58, 50, 107, 157}));
  EXPECT_EQ(ids->back(), 145);

  // Float tensors are refused as int64, with the path and tensor in the message.
  StatusOr<std::vector<int64_t>> logits = readAsInt64(*file, *file->find("gen_logits"));
  ASSERT_FALSE(logits.isOk());
  EXPECT_EQ(logits.status().message().rfind(path + ": ", 0), 0u);
  EXPECT_NE(logits.status().message().find("'gen_logits'"), std::string::npos);
  EXPECT_NE(logits.status().message().find("F32"), std::string::npos);
}

TEST(SafetensorsCheckpoint, RejectsTensorInfoFromAnotherFile) {
  StatusOr<File> golden = File::open(kTinyModelDir + "/golden.safetensors");
  StatusOr<File> shard = File::open(kTinyModelDir + "/model-00001-of-00002.safetensors");
  ASSERT_TRUE(golden.isOk() && shard.isOk());
  StatusOr<std::vector<float>> values = readAsFloat(*golden, *shard->find("lm_head.weight"));
  ASSERT_FALSE(values.isOk());
  EXPECT_NE(values.status().message().find("'lm_head.weight'"), std::string::npos);
}

//===------------------------------------------------------------------------------------------===//
// Malformed files: each must fail with one line naming the file and the tensor or field.
//===------------------------------------------------------------------------------------------===//

using SafetensorsBadFile = ScratchDirTest;

TEST_F(SafetensorsBadFile, MissingFile) {
  std::string message = openError(pathFor("absent.safetensors"));
  EXPECT_NE(message.find("cannot open"), std::string::npos) << message;
}

TEST_F(SafetensorsBadFile, Directory) {
  std::string message = openError(dir_);
  EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
}

TEST_F(SafetensorsBadFile, EmptyFile) {
  std::string path = pathFor("empty.safetensors");
  writeWholeFile(path, "");
  std::string message = openError(path);
  EXPECT_NE(message.find("truncated"), std::string::npos) << message;
}

TEST_F(SafetensorsBadFile, ShorterThanHeaderLength) {
  std::string path = pathFor("short.safetensors");
  writeWholeFile(path, "abcde");
  std::string message = openError(path);
  EXPECT_NE(message.find("truncated: 5 bytes"), std::string::npos) << message;
}

TEST_F(SafetensorsBadFile, HeaderLengthPastEndOfFile) {
  std::string path = pathFor("long_header.safetensors");
  std::string content = craftFile("{}", 0);
  uint64_t claimed = 100;
  std::memcpy(content.data(), &claimed, sizeof claimed);
  writeWholeFile(path, content);
  std::string message = openError(path);
  EXPECT_NE(message.find("header length 100 is larger than the file (10 bytes)"), std::string::npos)
      << message;
}

TEST_F(SafetensorsBadFile, AbsurdHeaderLength) {
  std::string path = pathFor("absurd.safetensors");
  std::string content = craftFile("{}", 0);
  uint64_t claimed = uint64_t{1} << 40;
  std::memcpy(content.data(), &claimed, sizeof claimed);
  writeWholeFile(path, content);
  std::string message = openError(path);
  EXPECT_NE(message.find("header length"), std::string::npos) << message;
  EXPECT_NE(message.find("100 MiB"), std::string::npos) << message;
}

struct BadHeaderCase {
  const char *testName;
  std::string header;
  size_t dataBytes;
  std::vector<std::string> expectedInMessage;
};

void PrintTo(const BadHeaderCase &badCase, std::ostream *os) { *os << badCase.testName; }

class SafetensorsBadHeader : public ScratchDirTest,
                             public testing::WithParamInterface<BadHeaderCase> {};

TEST_P(SafetensorsBadHeader, IsRejectedWithClearMessage) {
  const BadHeaderCase &badCase = GetParam();
  std::string path = pathFor(std::string(badCase.testName) + ".safetensors");
  writeWholeFile(path, craftFile(badCase.header, badCase.dataBytes));
  std::string message = openError(path);
  for (const std::string &expected : badCase.expectedInMessage)
    EXPECT_NE(message.find(expected), std::string::npos)
        << "expected '" << expected << "' in: " << message;
}

// A tensor entry with the given fields, to keep the table readable.
std::string entry(const std::string &name, const std::string &fields) {
  return "\"" + name + "\": {" + fields + "}";
}

const BadHeaderCase kBadHeaders[] = {
    {"NotJson", R"({"w": )", 0, {"header is not valid JSON", "parse error"}},
    {"NumberBeyondDouble",
     R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1e999]}})",
     0,
     {"header is not valid JSON"}},
    // The parser quotes the raw byte; the message escapes it to stay printable.
    {"InvalidUtf8", "{\"w\xff\": {}}", 0, {"header is not valid JSON", "\\xff"}},
    {"EmptyHeader", "", 0, {"header is not valid JSON"}},
    {"NotAnObject", "[1, 2]", 0, {"header must be a JSON object, got array"}},
    {"EntryNotAnObject", R"({"w": 5})", 0, {"tensor 'w'", "must be an object, got number"}},
    {"MissingDType",
     "{" + entry("w", R"("shape": [2], "data_offsets": [0, 8])") + "}",
     8,
     {"tensor 'w'", "missing field 'dtype'"}},
    {"MissingShape",
     "{" + entry("w", R"("dtype": "F32", "data_offsets": [0, 8])") + "}",
     8,
     {"tensor 'w'", "missing field 'shape'"}},
    {"MissingDataOffsets",
     "{" + entry("w", R"("dtype": "F32", "shape": [2])") + "}",
     8,
     {"tensor 'w'", "missing field 'data_offsets'"}},
    {"DTypeNotString",
     "{" + entry("w", R"("dtype": 7, "shape": [2], "data_offsets": [0, 8])") + "}",
     8,
     {"tensor 'w'", "field 'dtype' must be a string, got number"}},
    {"ShapeNotArray",
     "{" + entry("w", R"("dtype": "F32", "shape": "2", "data_offsets": [0, 8])") + "}",
     8,
     {"tensor 'w'", "field 'shape' must be an array, got string"}},
    {"DataOffsetsNotArray",
     "{" + entry("w", R"("dtype": "F32", "shape": [2], "data_offsets": {})") + "}",
     8,
     {"tensor 'w'", "field 'data_offsets' must be an array, got object"}},
    {"UnknownDType",
     "{" + entry("w", R"("dtype": "F128", "shape": [2], "data_offsets": [0, 8])") + "}",
     8,
     {"tensor 'w'", "unknown dtype 'F128'"}},
    {"NegativeDim",
     "{" + entry("w", R"("dtype": "F32", "shape": [2, -2], "data_offsets": [0, 8])") + "}",
     8,
     {"tensor 'w'", "shape[1] = -2 is negative"}},
    {"FractionalDim",
     "{" + entry("w", R"("dtype": "F32", "shape": [2.5], "data_offsets": [0, 8])") + "}",
     8,
     {"tensor 'w'", "shape[0] must be an integer"}},
    {"DimBeyondInt64",
     "{" +
         entry("w", R"("dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 8])") +
         "}",
     8,
     {"tensor 'w'", "shape[0]", "too large"}},
    {"ElementCountOverflow",
     "{" +
         entry("w", R"("dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 8])") +
         "}",
     8,
     {"tensor 'w'", "too many elements"}},
    {"ByteCountOverflow",
     "{" + entry("w", R"("dtype": "F64", "shape": [4611686018427387904], "data_offsets": [0, 8])") +
         "}",
     8,
     {"tensor 'w'", "too many elements"}},
    {"OneDataOffset",
     "{" + entry("w", R"("dtype": "F32", "shape": [2], "data_offsets": [0])") + "}",
     8,
     {"tensor 'w'", "data_offsets must be two non-negative integers"}},
    {"NegativeDataOffset",
     "{" + entry("w", R"("dtype": "F32", "shape": [0], "data_offsets": [-8, 0])") + "}",
     8,
     {"tensor 'w'", "data_offsets must be two non-negative integers"}},
    {"FractionalDataOffset",
     "{" + entry("w", R"("dtype": "F32", "shape": [2], "data_offsets": [0, 8.0])") + "}",
     8,
     {"tensor 'w'", "data_offsets must be two non-negative integers"}},
    {"DataOffsetsReversed",
     "{" + entry("w", R"("dtype": "F32", "shape": [0], "data_offsets": [8, 0])") + "}",
     8,
     {"tensor 'w'", "data_offsets [8, 0] begin after end"}},
    {"EndPastDataSection",
     "{" +
         entry("model.layers.0.mlp.up_proj.weight",
               R"("dtype": "BF16", "shape": [16, 16], "data_offsets": [0, 512])") +
         "}",
     400,
     {"tensor 'model.layers.0.mlp.up_proj.weight': data_offsets [0, 512] end past the data "
      "section (400 bytes)"}},
    {"ByteSizeMismatch",
     "{" + entry("w", R"("dtype": "F32", "shape": [2], "data_offsets": [0, 12])") + "}",
     16,
     {"tensor 'w'", "hold 12 bytes but F32 [2] needs 8"}},
    {"OverlappingTensors",
     "{" + entry("first", R"("dtype": "F32", "shape": [4], "data_offsets": [0, 16])") + ", " +
         entry("second", R"("dtype": "F32", "shape": [4], "data_offsets": [8, 24])") + "}",
     24,
     {"tensor 'first' [0, 16]", "tensor 'second' [8, 24]", "overlap"}},
    {"OverlapHiddenBehindLongTensor",
     "{" + entry("long", R"("dtype": "U8", "shape": [32], "data_offsets": [0, 32])") + ", " +
         entry("a", R"("dtype": "U8", "shape": [8], "data_offsets": [8, 16])") + "}",
     32,
     {"tensor 'long'", "tensor 'a'", "overlap"}},
    {"MetadataNotObject",
     R"({"__metadata__": ["pt"]})",
     0,
     {"field '__metadata__' must be an object, got array"}},
    {"MetadataValueNotString",
     R"({"__metadata__": {"format": 1}})",
     0,
     {"field '__metadata__' key 'format' must map to a string, got number"}},
    {"ControlCharacterInName",
     "{" + entry("bad\\nname", R"("dtype": "F32", "shape": [2], "data_offsets": [0, 8])") + "}",
     4,
     {"tensor 'bad\\x0aname'", "end past the data section"}},
};

INSTANTIATE_TEST_SUITE_P(AllCases, SafetensorsBadHeader, testing::ValuesIn(kBadHeaders),
                         [](const testing::TestParamInfo<BadHeaderCase> &info) {
                           return std::string(info.param.testName);
                         });

// An empty byte range overlaps nothing, even when it sits inside another tensor's range.
TEST_F(SafetensorsRoundTrip, EmptyTensorInsideAnotherRangeIsAccepted) {
  std::string header = "{" + entry("a", R"("dtype": "F32", "shape": [0], "data_offsets": [4, 4])") +
                       ", " +
                       entry("b", R"("dtype": "F32", "shape": [2], "data_offsets": [0, 8])") + "}";
  std::string path = pathFor("empty_inside.safetensors");
  writeWholeFile(path, craftFile(header, 8));
  StatusOr<File> file = File::open(path);
  ASSERT_TRUE(file.isOk()) << file.status().message();
  EXPECT_EQ(file->bytes(*file->find("a")).size(), 0u);
  EXPECT_EQ(file->bytes(*file->find("b")).size(), 8u);
}

//===------------------------------------------------------------------------------------------===//
// Conversions.
//===------------------------------------------------------------------------------------------===//

TEST(SafetensorsConversion, Bf16KnownValues) {
  EXPECT_EQ(bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(bf16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(bf16ToFloat(0x7f80), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(bf16ToFloat(0x7fc0)));
  EXPECT_EQ(floatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(floatToBf16(-2.0f), 0xc000);
  EXPECT_EQ(floatToBf16(0.0f), 0x0000);
  EXPECT_EQ(floatToBf16(-0.0f), 0x8000);
}

TEST(SafetensorsConversion, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 lies exactly between 0x3f80 and 0x3f81: ties go to the even 0x3f80.
  EXPECT_EQ(floatToBf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);
  // 1 + 3 * 2^-8 lies between 0x3f81 and 0x3f82: ties go to the even 0x3f82.
  EXPECT_EQ(floatToBf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);
  // Just above or below the tie rounds to the nearer value.
  EXPECT_EQ(floatToBf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(floatToBf16(std::bit_cast<float>(0x3f817fffu)), 0x3f81);
  // The largest float rounds up to infinity; infinity stays infinity.
  EXPECT_EQ(floatToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(floatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
}

TEST(SafetensorsConversion, Bf16NaNStaysNaN) {
  // Payload only in the low half: plain truncation would turn it into infinity.
  uint16_t fromLowPayload = floatToBf16(std::bit_cast<float>(0x7f800001u));
  EXPECT_TRUE(std::isnan(bf16ToFloat(fromLowPayload)));
  uint16_t negative = floatToBf16(std::bit_cast<float>(0xffffffffu));
  EXPECT_TRUE(std::isnan(bf16ToFloat(negative)));
  EXPECT_TRUE(negative & 0x8000);
  EXPECT_TRUE(std::isnan(bf16ToFloat(floatToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(SafetensorsConversion, F16Values) {
  EXPECT_EQ(f16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(f16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(f16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(f16ToFloat(0x0400), std::ldexp(1.0f, -14)); // smallest normal
  EXPECT_EQ(f16ToFloat(0x0001), std::ldexp(1.0f, -24)); // smallest subnormal
  EXPECT_EQ(f16ToFloat(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(f16ToFloat(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::signbit(f16ToFloat(0x8000)));
  EXPECT_EQ(f16ToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(f16ToFloat(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(f16ToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(f16ToFloat(0x7c01)));
}

TEST(SafetensorsConversion, F8E4M3Values) {
  EXPECT_EQ(f8e4m3ToFloat(0x38), 1.0f);
  EXPECT_EQ(f8e4m3ToFloat(0x7e), 448.0f); // max finite: S.1111.110
  EXPECT_EQ(f8e4m3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(f8e4m3ToFloat(0x78), 256.0f);               // exponent 15 is still finite in "fn"
  EXPECT_EQ(f8e4m3ToFloat(0x01), std::ldexp(1.0f, -9)); // smallest subnormal
  EXPECT_EQ(f8e4m3ToFloat(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(f8e4m3ToFloat(0x08), std::ldexp(1.0f, -6)); // smallest normal
  EXPECT_EQ(f8e4m3ToFloat(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(f8e4m3ToFloat(0x80)));
  EXPECT_TRUE(std::isnan(f8e4m3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(f8e4m3ToFloat(0xff)));
}

TEST(SafetensorsConversion, F8E5M2Values) {
  EXPECT_EQ(f8e5m2ToFloat(0x3c), 1.0f);
  EXPECT_EQ(f8e5m2ToFloat(0x7b), 57344.0f); // max finite
  EXPECT_EQ(f8e5m2ToFloat(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(f8e5m2ToFloat(0x7c), std::numeric_limits<float>::infinity());
  EXPECT_EQ(f8e5m2ToFloat(0xfc), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(f8e5m2ToFloat(0x7d)));
  EXPECT_TRUE(std::isnan(f8e5m2ToFloat(0xff)));
}

TEST(SafetensorsConversion, DTypeNamesRoundTrip) {
  const DType all[] = {DType::BOOL, DType::U8,  DType::I8,      DType::I16,
                       DType::I32,  DType::I64, DType::F16,     DType::BF16,
                       DType::F32,  DType::F64, DType::F8_E4M3, DType::F8_E5M2};
  const size_t sizes[] = {1, 1, 1, 2, 4, 8, 2, 2, 4, 8, 1, 1};
  for (size_t i = 0; i < std::size(all); ++i) {
    EXPECT_EQ(parseDType(dtypeName(all[i])), all[i]) << dtypeName(all[i]);
    EXPECT_EQ(dtypeSize(all[i]), sizes[i]) << dtypeName(all[i]);
  }
  EXPECT_EQ(dtypeName(DType::F8_E4M3), "F8_E4M3");
  EXPECT_EQ(parseDType("bf16"), std::nullopt); // spellings are case-sensitive
  EXPECT_EQ(parseDType("F8_E4M3FN"), std::nullopt);
}

} // namespace
} // namespace hybrid::safetensors
