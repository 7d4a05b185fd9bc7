// Weight archive writer and reader (format: docs/weight-archive.md). Linked into the compiler,
// which is built with -fno-exceptions, so every public function catches what the standard library
// may throw (allocation failures) and reports a Status instead.
#include "hybrid/runtime/WeightArchive.h"
#include "hybrid/runtime/StatusHelpers.h"
#include "hybrid/runtime/UniqueFd.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fcntl.h>
#include <filesystem>
#include <sys/mman.h>
#include <sys/stat.h>
#include <system_error>
#include <unistd.h>
#include <utility>
#include <xxhash.h>

namespace hybrid {
namespace {

constexpr char kMagic[8] = {'H', 'Y', 'B', 'R', 'I', 'D', 'W', '1'};

// Header field offsets (docs/weight-archive.md); the header hash covers [0, kHeaderHashOffset).
constexpr size_t kMagicOffset = 0;
constexpr size_t kFormatVersionOffset = 8;
constexpr size_t kPageSizeOffset = 12;
constexpr size_t kKeyOffset = 16;
constexpr size_t kEntryCountOffset = 32;
constexpr size_t kTableOffsetOffset = 40;
constexpr size_t kTableSizeOffset = 48;
constexpr size_t kTableHashOffset = 56;
constexpr size_t kHeaderHashOffset = 64;
static_assert(kHeaderHashOffset + 8 == kWeightArchiveHeaderBytes);

// Sanity bounds that keep a corrupt table from asking for absurd allocations or messages.
constexpr uint32_t kMaxNameBytes = 64 * 1024;
constexpr uint32_t kMaxRank = 32;
// name length + dtype + rank + offset + size + hash: the smallest possible table record.
constexpr uint64_t kMinEntryRecordBytes = 4 + 1 + 4 + 8 + 8 + 8;

//===------------------------------------------------------------------------------------------===//
// Small helpers.
//===------------------------------------------------------------------------------------------===//

std::string hex64(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%016llx", static_cast<unsigned long long>(value));
  return text;
}

// Names read from a file may hold any byte; escape so every error stays one printable line.
std::string printable(std::string_view text) { return escapeBytes(text, NonAscii::Escape); }

std::string entryContext(size_t index, std::string_view name) {
  std::string out = "entry ";
  out += std::to_string(index);
  out += " '";
  out += printable(name);
  out += "'";
  return out;
}

std::string formatShape(const std::vector<int64_t> &shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i)
      out += ", ";
    out += std::to_string(shape[i]);
  }
  out += "]";
  return out;
}

bool isValidPageSize(uint64_t pageSize) {
  return std::has_single_bit(pageSize) && pageSize >= kMinWeightArchivePageSize &&
         pageSize <= kMaxWeightArchivePageSize;
}

// Rounds up to a multiple of `alignment`; nullopt on overflow.
std::optional<uint64_t> alignUp(uint64_t value, uint64_t alignment) {
  uint64_t remainder = value % alignment;
  if (remainder == 0)
    return value;
  uint64_t result = 0;
  if (__builtin_add_overflow(value, alignment - remainder, &result))
    return std::nullopt;
  return result;
}

// product(shape) * dtype size; nullopt for a negative dimension, an invalid dtype or overflow.
std::optional<uint64_t> expectedByteSize(plan::fb::DType dtype, const std::vector<int64_t> &shape) {
  uint64_t bytes = dtypeByteSize(dtype);
  if (bytes == 0)
    return std::nullopt;
  for (int64_t dim : shape)
    if (dim < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes))
      return std::nullopt;
  return bytes;
}

//===------------------------------------------------------------------------------------------===//
// Little-endian encoding, field by field, independent of the host's byte order.
//===------------------------------------------------------------------------------------------===//

void putU8(std::string &out, uint8_t value) { out.push_back(static_cast<char>(value)); }
void putU32(std::string &out, uint32_t value) {
  for (int i = 0; i < 4; ++i)
    out.push_back(static_cast<char>(value >> (8 * i)));
}
void putU64(std::string &out, uint64_t value) {
  for (int i = 0; i < 8; ++i)
    out.push_back(static_cast<char>(value >> (8 * i)));
}

uint64_t loadLittleEndian(const std::byte *data, size_t bytes) {
  uint64_t value = 0;
  for (size_t i = 0; i < bytes; ++i)
    value |= static_cast<uint64_t>(data[i]) << (8 * i);
  return value;
}

// Bounds-checked sequential reads over the entry table.
class TableReader {
public:
  explicit TableReader(std::span<const std::byte> table) : table_(table) {}

  bool readU8(uint8_t &value) { return readInteger(value); }
  bool readU32(uint32_t &value) { return readInteger(value); }
  bool readU64(uint64_t &value) { return readInteger(value); }
  bool readBytes(size_t count, std::string &out) {
    if (remaining() < count)
      return false;
    out.assign(reinterpret_cast<const char *>(table_.data() + position_), count);
    position_ += count;
    return true;
  }
  size_t position() const { return position_; }
  size_t remaining() const { return table_.size() - position_; }

private:
  template <typename T> bool readInteger(T &value) {
    if (remaining() < sizeof(T))
      return false;
    value = static_cast<T>(loadLittleEndian(table_.data() + position_, sizeof(T)));
    position_ += sizeof(T);
    return true;
  }

  std::span<const std::byte> table_;
  size_t position_ = 0;
};

void putF32(std::string &out, float value) { putU32(out, std::bit_cast<uint32_t>(value)); }

std::string encodeTable(const std::vector<WeightArchiveEntry> &entries) {
  std::string table;
  for (const WeightArchiveEntry &entry : entries) {
    putU32(table, static_cast<uint32_t>(entry.name.size()));
    table += entry.name;
    putU8(table, static_cast<uint8_t>(entry.dtype));
    putU32(table, static_cast<uint32_t>(entry.shape.size()));
    for (int64_t dim : entry.shape)
      putU64(table, static_cast<uint64_t>(dim));
    putU64(table, entry.offset);
    putU64(table, entry.size);
    putU64(table, entry.dataHash);
    if (const std::optional<SyntheticWeight> &synthetic = entry.synthetic) {
      putU8(table, static_cast<uint8_t>(synthetic->kind));
      putU64(table, synthetic->key);
      putF32(table, synthetic->a);
      putF32(table, synthetic->b);
      for (int64_t value : {synthetic->rows, synthetic->cols, synthetic->tileRows,
                            synthetic->tileCols, synthetic->sourceRowStride,
                            synthetic->sourceOffset})
        putU64(table, static_cast<uint64_t>(value));
    }
  }
  return table;
}

std::string encodeHeader(uint32_t formatVersion, const ArchiveKey &key, uint64_t pageSize,
                         uint64_t entryCount, uint64_t tableOffset, std::string_view table) {
  std::string header(kMagic, sizeof kMagic);
  putU32(header, formatVersion);
  putU32(header, static_cast<uint32_t>(pageSize));
  header.append(reinterpret_cast<const char *>(key.data()), key.size());
  putU64(header, entryCount);
  putU64(header, tableOffset);
  putU64(header, table.size());
  putU64(header, XXH3_64bits(table.data(), table.size()));
  putU64(header, XXH3_64bits(header.data(), header.size()));
  return header;
}

//===------------------------------------------------------------------------------------------===//
// File helpers.
//===------------------------------------------------------------------------------------------===//

Status writeAllAt(int fd, const void *data, size_t size, uint64_t offset) {
  const char *cursor = static_cast<const char *>(data);
  while (size > 0) {
    ssize_t written = ::pwrite(fd, cursor, size, static_cast<off_t>(offset));
    if (written < 0) {
      if (errno == EINTR)
        continue;
      return Status::error("write at offset " + std::to_string(offset) +
                           " failed: " + errnoMessage(errno));
    }
    cursor += written;
    size -= static_cast<size_t>(written);
    offset += static_cast<uint64_t>(written);
  }
  return Status::ok();
}

//===------------------------------------------------------------------------------------------===//
// Reading. Errors are phrased without the path; WeightArchive::open prefixes it.
//===------------------------------------------------------------------------------------------===//

struct ParsedHeader {
  bool synthetic = false;    // format version 2 or 3
  bool sourceWindow = false; // format version 3: descriptors end with the source window
  ArchiveKey key{};
  uint64_t pageSize = 0;
  uint64_t entryCount = 0;
  uint64_t tableOffset = 0;
  uint64_t tableSize = 0;
  uint64_t tableHash = 0;
};

StatusOr<ParsedHeader> parseHeader(std::span<const std::byte> file) {
  if (file.size() < kWeightArchiveHeaderBytes)
    return Status::error("file is " + std::to_string(file.size()) + " bytes, smaller than the " +
                         std::to_string(kWeightArchiveHeaderBytes) +
                         "-byte header (truncated, or not a weight archive)");
  const std::byte *header = file.data();
  if (std::memcmp(header + kMagicOffset, kMagic, sizeof kMagic) != 0)
    return Status::error("header field 'magic' is '" +
                         printable(std::string_view(reinterpret_cast<const char *>(header), 8)) +
                         "', expected 'HYBRIDW1' (not a hybrid weight archive)");
  uint64_t storedHeaderHash = loadLittleEndian(header + kHeaderHashOffset, 8);
  uint64_t actualHeaderHash = XXH3_64bits(header, kHeaderHashOffset);
  if (storedHeaderHash != actualHeaderHash)
    return Status::error("header field 'header_hash' is " + hex64(storedHeaderHash) +
                         " but the header bytes hash to " + hex64(actualHeaderHash) +
                         " (corrupt header)");
  auto formatVersion = static_cast<uint32_t>(loadLittleEndian(header + kFormatVersionOffset, 4));
  if (formatVersion != kWeightArchiveFormatVersion &&
      formatVersion != kSyntheticWeightArchiveFormatVersion &&
      formatVersion != kWholeTensorSyntheticWeightArchiveFormatVersion)
    return Status::error("header field 'format_version' is " + std::to_string(formatVersion) +
                         ", this runtime reads versions " +
                         std::to_string(kWeightArchiveFormatVersion) + " (data) and " +
                         std::to_string(kWholeTensorSyntheticWeightArchiveFormatVersion) +
                         " and " + std::to_string(kSyntheticWeightArchiveFormatVersion) +
                         " (synthetic)");

  ParsedHeader parsed;
  parsed.synthetic = formatVersion != kWeightArchiveFormatVersion;
  parsed.sourceWindow = formatVersion == kSyntheticWeightArchiveFormatVersion;
  parsed.pageSize = loadLittleEndian(header + kPageSizeOffset, 4);
  std::memcpy(parsed.key.data(), header + kKeyOffset, parsed.key.size());
  parsed.entryCount = loadLittleEndian(header + kEntryCountOffset, 8);
  parsed.tableOffset = loadLittleEndian(header + kTableOffsetOffset, 8);
  parsed.tableSize = loadLittleEndian(header + kTableSizeOffset, 8);
  parsed.tableHash = loadLittleEndian(header + kTableHashOffset, 8);

  if (!isValidPageSize(parsed.pageSize))
    return Status::error("header field 'page_size' is " + std::to_string(parsed.pageSize) +
                         ", expected a power of two in [" +
                         std::to_string(kMinWeightArchivePageSize) + ", " +
                         std::to_string(kMaxWeightArchivePageSize) + "]");
  if (parsed.tableOffset < parsed.pageSize || parsed.tableOffset % parsed.pageSize != 0)
    return Status::error("header field 'table_offset' is " + std::to_string(parsed.tableOffset) +
                         ", expected a multiple of the page size " +
                         std::to_string(parsed.pageSize) + " past the header page");
  uint64_t tableEnd = 0;
  if (__builtin_add_overflow(parsed.tableOffset, parsed.tableSize, &tableEnd) ||
      tableEnd > file.size())
    return Status::error("header fields 'table_offset' " + std::to_string(parsed.tableOffset) +
                         " + 'table_size' " + std::to_string(parsed.tableSize) +
                         " reach past the end of the file (" + std::to_string(file.size()) +
                         " bytes; truncated archive?)");
  if (tableEnd != file.size())
    return Status::error("the entry table ends at byte " + std::to_string(tableEnd) +
                         " but the file is " + std::to_string(file.size()) +
                         " bytes (trailing data)");
  uint64_t actualTableHash = XXH3_64bits(file.data() + parsed.tableOffset, parsed.tableSize);
  if (actualTableHash != parsed.tableHash)
    return Status::error("header field 'table_hash' is " + hex64(parsed.tableHash) +
                         " but the entry table hashes to " + hex64(actualTableHash) +
                         " (corrupt table)");
  if (parsed.entryCount > parsed.tableSize / kMinEntryRecordBytes)
    return Status::error("header field 'entry_count' is " + std::to_string(parsed.entryCount) +
                         " but a " + std::to_string(parsed.tableSize) +
                         "-byte table holds at most " +
                         std::to_string(parsed.tableSize / kMinEntryRecordBytes));
  return parsed;
}

// Reads one table record and checks it against the header; `index` only names it in errors.
Status parseEntry(TableReader &reader, size_t index, const ParsedHeader &header,
                  WeightArchiveEntry &entry) {
  auto truncated = [&](const char *field) {
    return Status::error(entryContext(index, entry.name) + ": the table ends inside field '" +
                         field + "'");
  };
  uint32_t nameBytes = 0;
  if (!reader.readU32(nameBytes))
    return truncated("name_length");
  if (nameBytes == 0 || nameBytes > kMaxNameBytes)
    return Status::error(entryContext(index, "") + ": field 'name_length' is " +
                         std::to_string(nameBytes) + ", expected 1 to " +
                         std::to_string(kMaxNameBytes));
  if (!reader.readBytes(nameBytes, entry.name))
    return truncated("name");
  std::string context = entryContext(index, entry.name);

  uint8_t dtypeValue = 0;
  if (!reader.readU8(dtypeValue))
    return truncated("dtype");
  entry.dtype = static_cast<plan::fb::DType>(dtypeValue);
  if (dtypeByteSize(entry.dtype) == 0)
    return Status::error(context + ": field 'dtype' has the unknown value " +
                         std::to_string(dtypeValue));

  uint32_t rank = 0;
  if (!reader.readU32(rank))
    return truncated("rank");
  if (rank > kMaxRank)
    return Status::error(context + ": field 'rank' is " + std::to_string(rank) + ", at most " +
                         std::to_string(kMaxRank) + " supported");
  entry.shape.resize(rank);
  for (uint32_t axis = 0; axis < rank; ++axis) {
    uint64_t dim = 0;
    if (!reader.readU64(dim))
      return truncated("shape");
    entry.shape[axis] = static_cast<int64_t>(dim);
    if (entry.shape[axis] < 0)
      return Status::error(context + ": field 'shape[" + std::to_string(axis) + "]' is negative");
  }
  if (!reader.readU64(entry.offset))
    return truncated("offset");
  if (!reader.readU64(entry.size))
    return truncated("size");
  if (!reader.readU64(entry.dataHash))
    return truncated("data_hash");
  if (header.synthetic) {
    SyntheticWeight synthetic;
    uint8_t kind = 0;
    uint32_t a = 0, b = 0;
    uint64_t layout[4] = {};
    if (!reader.readU8(kind))
      return truncated("synthetic.kind");
    if (!reader.readU64(synthetic.key))
      return truncated("synthetic.key");
    if (!reader.readU32(a) || !reader.readU32(b))
      return truncated("synthetic.a");
    for (uint64_t &value : layout)
      if (!reader.readU64(value))
        return truncated("synthetic.layout");
    uint64_t window[2] = {}; // version 2: the whole tensor (stride 0 = cols, offset 0)
    if (header.sourceWindow)
      for (uint64_t &value : window)
        if (!reader.readU64(value))
          return truncated("synthetic.source");
    synthetic.kind = static_cast<kernels::SyntheticKind>(kind);
    synthetic.a = std::bit_cast<float>(a);
    synthetic.b = std::bit_cast<float>(b);
    synthetic.rows = static_cast<int64_t>(layout[0]);
    synthetic.cols = static_cast<int64_t>(layout[1]);
    synthetic.tileRows = static_cast<int64_t>(layout[2]);
    synthetic.tileCols = static_cast<int64_t>(layout[3]);
    synthetic.sourceRowStride = static_cast<int64_t>(window[0]);
    synthetic.sourceOffset = static_cast<int64_t>(window[1]);
    entry.synthetic = synthetic;
    if (entry.dataHash != 0)
      return Status::error(context + ": field 'data_hash' is " + hex64(entry.dataHash) +
                           ", expected 0 for a synthetic entry (it has no data)");
  }

  std::optional<uint64_t> expectedBytes = expectedByteSize(entry.dtype, entry.shape);
  if (!expectedBytes)
    return Status::error(context + ": shape " + formatShape(entry.shape) +
                         " has too many elements");
  if (entry.size != *expectedBytes)
    return Status::error(context + ": field 'size' is " + std::to_string(entry.size) + " but " +
                         dtypeName(entry.dtype) + " " + formatShape(entry.shape) + " needs " +
                         std::to_string(*expectedBytes) + " bytes");
  if (entry.offset < header.pageSize || entry.offset % header.pageSize != 0)
    return Status::error(context + ": field 'offset' is " + std::to_string(entry.offset) +
                         ", expected a multiple of the page size " +
                         std::to_string(header.pageSize) + " past the header page");
  uint64_t end = 0;
  if (entry.synthetic) {
    // No bytes in the file: only the range the plan addresses must exist.
    if (__builtin_add_overflow(entry.offset, entry.size, &end))
      return Status::error(context + ": data [" + std::to_string(entry.offset) + ", +" +
                           std::to_string(entry.size) + ") passes 2^64 bytes");
    if (std::optional<std::string> error =
            syntheticWeightError(*entry.synthetic, entry.dtype, entry.shape))
      return Status::error(context + ": " + *error);
    return Status::ok();
  }
  if (__builtin_add_overflow(entry.offset, entry.size, &end) || end > header.tableOffset)
    return Status::error(context + ": data [" + std::to_string(entry.offset) + ", +" +
                         std::to_string(entry.size) + ") runs past the entry table at " +
                         std::to_string(header.tableOffset));
  return Status::ok();
}

// Rejects entries whose non-empty byte ranges intersect (empty ranges overlap nothing).
Status checkNoOverlap(const std::vector<WeightArchiveEntry> &entries) {
  std::vector<size_t> order;
  for (size_t i = 0; i < entries.size(); ++i)
    if (entries[i].size > 0)
      order.push_back(i);
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return entries[a].offset < entries[b].offset; });
  for (size_t i = 1; i < order.size(); ++i) {
    const WeightArchiveEntry &previous = entries[order[i - 1]];
    const WeightArchiveEntry &current = entries[order[i]];
    // Sorted by offset and every range page aligned: the neighbour is the only possible overlap.
    if (current.offset < previous.offset + previous.size)
      return Status::error(entryContext(order[i - 1], previous.name) + " and " +
                           entryContext(order[i], current.name) + " overlap at offset " +
                           std::to_string(current.offset));
  }
  return Status::ok();
}

} // namespace

//===------------------------------------------------------------------------------------------===//
// Shared helpers.
//===------------------------------------------------------------------------------------------===//

std::string formatArchiveKey(const ArchiveKey &key) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * key.size());
  for (uint8_t byte : key) {
    hex += kDigits[byte >> 4];
    hex += kDigits[byte & 0xf];
  }
  return hex;
}

std::optional<ArchiveKey> parseArchiveKey(std::string_view hex) {
  ArchiveKey key{};
  if (hex.size() != 2 * key.size())
    return std::nullopt;
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9')
      return c - '0';
    if (c >= 'a' && c <= 'f')
      return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
      return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < key.size(); ++i) {
    int high = digit(hex[2 * i]);
    int low = digit(hex[2 * i + 1]);
    if (high < 0 || low < 0)
      return std::nullopt;
    key[i] = static_cast<uint8_t>(high << 4 | low);
  }
  return key;
}

size_t dtypeByteSize(plan::fb::DType dtype) {
  using plan::fb::DType;
  switch (dtype) {
  case DType::F32:
  case DType::I32:
    return 4;
  case DType::BF16:
  case DType::F16:
    return 2;
  case DType::F8_E4M3:
    return 1;
  case DType::I64:
    return 8;
  }
  return 0;
}

std::string dtypeName(plan::fb::DType dtype) {
  if (dtypeByteSize(dtype) == 0)
    return "DType(" + std::to_string(static_cast<int>(dtype)) + ")";
  return plan::fb::EnumNameDType(dtype);
}

std::vector<uint64_t> planWeightOffsets(std::span<const uint64_t> sizes, uint64_t pageSize) {
  std::vector<uint64_t> offsets;
  offsets.reserve(sizes.size());
  uint64_t end = pageSize; // the header page
  for (uint64_t size : sizes) {
    uint64_t offset = (end + pageSize - 1) / pageSize * pageSize;
    offsets.push_back(offset);
    end = offset + size;
  }
  return offsets;
}

std::optional<std::string> syntheticWeightError(const SyntheticWeight &synthetic,
                                                plan::fb::DType dtype,
                                                const std::vector<int64_t> &shape) {
  using kernels::SyntheticKind;
  if (static_cast<uint8_t>(synthetic.kind) >= kernels::kSyntheticKindCount)
    return "field 'synthetic.kind' has the unknown value " +
           std::to_string(static_cast<int>(synthetic.kind));
  if (dtype != plan::fb::DType::F32 && dtype != plan::fb::DType::BF16 &&
      dtype != plan::fb::DType::F8_E4M3)
    return "synthetic values are generated as F32, BF16 or F8_E4M3, not " + dtypeName(dtype);
  if (!std::isfinite(synthetic.a) || !std::isfinite(synthetic.b))
    return std::string("fields 'synthetic.a' and 'synthetic.b' must be finite");
  if ((synthetic.kind == SyntheticKind::LogUniform ||
       synthetic.kind == SyntheticKind::DecayTimeBias) &&
      !(synthetic.a > 0.0f && synthetic.a < synthetic.b))
    return "fields 'synthetic.a' " + std::to_string(synthetic.a) + " and 'synthetic.b' " +
           std::to_string(synthetic.b) + " must satisfy 0 < a < b for this kind";
  if (synthetic.rows < 0 || synthetic.cols < 0)
    return std::string("fields 'synthetic.rows' and 'synthetic.cols' must not be negative");
  uint64_t elements = 1;
  for (int64_t dim : shape)
    elements *= static_cast<uint64_t>(dim); // the caller checked the byte size for overflow
  uint64_t logical = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(synthetic.rows),
                             static_cast<uint64_t>(synthetic.cols), &logical))
    return std::string("fields 'synthetic.rows' x 'synthetic.cols' overflow");
  // The window must lie in a stream of 2^63 elements: sourceRowStride 0 (cols) or at least cols
  // (rows do not overlap), the offset not negative, the last element's index representable.
  if (synthetic.sourceRowStride != 0 && synthetic.sourceRowStride < synthetic.cols)
    return "field 'synthetic.source_row_stride' is " + std::to_string(synthetic.sourceRowStride) +
           ", expected 0 or at least the " + std::to_string(synthetic.cols) + " columns";
  if (synthetic.sourceOffset < 0)
    return std::string("field 'synthetic.source_offset' is negative");
  if (synthetic.rows > 0 && synthetic.cols > 0) {
    const int64_t stride =
        synthetic.sourceRowStride == 0 ? synthetic.cols : synthetic.sourceRowStride;
    int64_t last = 0;
    if (__builtin_mul_overflow(synthetic.rows - 1, stride, &last) ||
        __builtin_add_overflow(last, synthetic.sourceOffset, &last) ||
        __builtin_add_overflow(last, synthetic.cols, &last))
      return std::string("fields 'synthetic.source_row_stride' and 'synthetic.source_offset' "
                         "place elements past 2^63");
  }
  if (synthetic.tileRows == 0 && synthetic.tileCols == 0) {
    if (logical != elements)
      return "fields 'synthetic.rows' x 'synthetic.cols' (" + std::to_string(synthetic.rows) +
             " x " + std::to_string(synthetic.cols) + ") do not match the " +
             std::to_string(elements) + " elements of " + formatShape(shape);
    return std::nullopt;
  }
  if (synthetic.tileRows < 1 || synthetic.tileCols < 1)
    return std::string("fields 'synthetic.tile_rows' and 'synthetic.tile_cols' must both be 0 "
                       "(row-major) or both positive (tiled)");
  auto padded = [](int64_t extent, int64_t tile) {
    return (extent / tile + (extent % tile != 0 ? 1 : 0)) * tile;
  };
  if (shape.size() != 2 || shape[0] != padded(synthetic.rows, synthetic.tileRows) ||
      shape[1] != padded(synthetic.cols, synthetic.tileCols))
    return "a tiled synthetic entry of " + std::to_string(synthetic.rows) + " x " +
           std::to_string(synthetic.cols) + " in tiles of " + std::to_string(synthetic.tileRows) +
           " x " + std::to_string(synthetic.tileCols) + " is stored padded, not as " +
           formatShape(shape);
  return std::nullopt;
}

kernels::SyntheticFill syntheticFill(const WeightArchiveEntry &entry) {
  const SyntheticWeight &synthetic = *entry.synthetic;
  kernels::SyntheticFill fill;
  fill.kind = synthetic.kind;
  fill.storage = entry.dtype == plan::fb::DType::F32    ? kernels::SyntheticStorage::F32
                 : entry.dtype == plan::fb::DType::BF16 ? kernels::SyntheticStorage::BF16
                                                        : kernels::SyntheticStorage::F8E4M3;
  fill.key = synthetic.key;
  fill.a = synthetic.a;
  fill.b = synthetic.b;
  fill.rows = synthetic.rows;
  fill.cols = synthetic.cols;
  fill.tileRows = synthetic.tileRows;
  fill.tileCols = synthetic.tileCols;
  fill.sourceRowStride = synthetic.sourceRowStride;
  fill.sourceOffset = synthetic.sourceOffset;
  fill.storedElements = static_cast<int64_t>(entry.size / dtypeByteSize(entry.dtype));
  return fill;
}

//===------------------------------------------------------------------------------------------===//
// WeightArchiveWriter.
//===------------------------------------------------------------------------------------------===//

StatusOr<WeightArchiveWriter> WeightArchiveWriter::create(const std::string &path, ArchiveKey key,
                                                          uint64_t pageSize) {
  return catchExceptions(path, [&]() -> StatusOr<WeightArchiveWriter> {
    if (!isValidPageSize(pageSize))
      return Status::error(path + ": page size " + std::to_string(pageSize) +
                           " is not a power of two in [" +
                           std::to_string(kMinWeightArchivePageSize) + ", " +
                           std::to_string(kMaxWeightArchivePageSize) + "]");
    WeightArchiveWriter writer;
    writer.path_ = path;
    writer.key_ = key;
    writer.pageSize_ = pageSize;
    writer.dataEnd_ = pageSize;
    // A unique temp name in the destination folder, so the final rename stays atomic.
    std::string pattern = path + ".tmp.XXXXXX";
    writer.fd_ = ::mkostemp(pattern.data(), O_CLOEXEC);
    if (writer.fd_ < 0) {
      int error = errno;
      return Status::error(path + ": cannot create a temp file: " + errnoMessage(error));
    }
    writer.tempPath_ = pattern;
    ::fchmod(writer.fd_, 0644); // mkostemp creates 0600; archives are shared read-only data
    return writer;
  });
}

WeightArchiveWriter::WeightArchiveWriter(WeightArchiveWriter &&other) noexcept
    : path_(std::move(other.path_)), tempPath_(std::exchange(other.tempPath_, {})),
      fd_(std::exchange(other.fd_, -1)), key_(other.key_), pageSize_(other.pageSize_),
      dataEnd_(other.dataEnd_), synthetic_(other.synthetic_), entries_(std::move(other.entries_)),
      index_(std::move(other.index_)), fileSize_(other.fileSize_), failed_(other.failed_),
      finished_(other.finished_) {}

WeightArchiveWriter &WeightArchiveWriter::operator=(WeightArchiveWriter &&other) noexcept {
  if (this != &other) {
    abandon();
    path_ = std::move(other.path_);
    tempPath_ = std::exchange(other.tempPath_, {});
    fd_ = std::exchange(other.fd_, -1);
    key_ = other.key_;
    pageSize_ = other.pageSize_;
    dataEnd_ = other.dataEnd_;
    synthetic_ = other.synthetic_;
    entries_ = std::move(other.entries_);
    index_ = std::move(other.index_);
    fileSize_ = other.fileSize_;
    failed_ = other.failed_;
    finished_ = other.finished_;
  }
  return *this;
}

WeightArchiveWriter::~WeightArchiveWriter() { abandon(); }

void WeightArchiveWriter::abandon() {
  if (fd_ >= 0)
    ::close(fd_);
  fd_ = -1;
  if (!finished_ && !tempPath_.empty())
    ::unlink(tempPath_.c_str());
  tempPath_.clear();
}

Status WeightArchiveWriter::add(std::string name, plan::fb::DType dtype, std::vector<int64_t> shape,
                                std::span<const std::byte> data) {
  return addEntry(std::move(name), dtype, std::move(shape), data, nullptr);
}

Status WeightArchiveWriter::addSynthetic(std::string name, plan::fb::DType dtype,
                                         std::vector<int64_t> shape,
                                         const SyntheticWeight &synthetic) {
  return addEntry(std::move(name), dtype, std::move(shape), {}, &synthetic);
}

Status WeightArchiveWriter::addEntry(std::string name, plan::fb::DType dtype,
                                     std::vector<int64_t> shape, std::span<const std::byte> data,
                                     const SyntheticWeight *synthetic) {
  return catchExceptions(path_, [&]() -> Status {
    std::string context =
        path_ + ": entry " + std::to_string(entries_.size()) + " '" + printable(name) + "'";
    if (finished_)
      return Status::error(context + ": the archive is already finished");
    if (failed_ || fd_ < 0)
      return Status::error(context + ": an earlier write failed");
    if (name.empty() || name.size() > kMaxNameBytes)
      return Status::error(context + ": the name must have 1 to " + std::to_string(kMaxNameBytes) +
                           " bytes");
    if (index_.count(name))
      return Status::error(context + ": duplicate name");
    if (dtypeByteSize(dtype) == 0)
      return Status::error(context + ": invalid dtype value " +
                           std::to_string(static_cast<int>(dtype)));
    if (shape.size() > kMaxRank)
      return Status::error(context + ": rank " + std::to_string(shape.size()) +
                           " is above the supported " + std::to_string(kMaxRank));
    std::optional<uint64_t> expectedBytes = expectedByteSize(dtype, shape);
    if (!expectedBytes)
      return Status::error(context + ": shape " + formatShape(shape) +
                           " has a negative dimension or too many elements");
    if (synthetic_ && *synthetic_ != (synthetic != nullptr))
      return Status::error(context + ": an archive holds data entries or synthetic ones, not both");
    if (synthetic) {
      if (std::optional<std::string> error = syntheticWeightError(*synthetic, dtype, shape))
        return Status::error(context + ": " + *error);
    } else if (data.size() != *expectedBytes) {
      return Status::error(context + ": has " + std::to_string(data.size()) + " bytes but " +
                           dtypeName(dtype) + " " + formatShape(shape) + " needs " +
                           std::to_string(*expectedBytes));
    }
    const uint64_t size = *expectedBytes;
    std::optional<uint64_t> offset = alignUp(dataEnd_, pageSize_);
    uint64_t end = 0;
    if (!offset || __builtin_add_overflow(*offset, size, &end))
      return Status::error(context + ": the archive would exceed 2^64 bytes");

    if (Status status = writeAllAt(fd_, data.data(), data.size(), *offset); !status) {
      failed_ = true;
      return std::move(status).withContext(context);
    }
    WeightArchiveEntry entry;
    entry.name = std::move(name);
    entry.dtype = dtype;
    entry.shape = std::move(shape);
    entry.offset = *offset;
    entry.size = size;
    if (synthetic)
      entry.synthetic = *synthetic;
    else
      entry.dataHash = XXH3_64bits(data.data(), data.size());
    synthetic_ = synthetic != nullptr;
    index_.emplace(entry.name, entries_.size());
    entries_.push_back(std::move(entry));
    dataEnd_ = end;
    return Status::ok();
  });
}

Status WeightArchiveWriter::finish() {
  return catchExceptions(path_, [&]() -> Status {
    if (finished_)
      return Status::error(path_ + ": the archive is already finished");
    if (failed_ || fd_ < 0)
      return Status::error(path_ + ": cannot finish, an earlier write failed");
    // From here any failure leaves the temp file to the destructor.
    failed_ = true;
    // A synthetic archive's entries have no bytes: its table follows the header page.
    const bool synthetic = synthetic_.value_or(false);
    std::optional<uint64_t> tableOffset = synthetic ? pageSize_ : alignUp(dataEnd_, pageSize_);
    if (!tableOffset)
      return Status::error(path_ + ": the archive would exceed 2^64 bytes");
    std::string table = encodeTable(entries_);
    std::string header = encodeHeader(
        synthetic ? kSyntheticWeightArchiveFormatVersion : kWeightArchiveFormatVersion, key_,
        pageSize_, entries_.size(), *tableOffset, table);
    uint64_t fileSize = *tableOffset + table.size();

    HYBRID_RETURN_IF_ERROR(
        writeAllAt(fd_, table.data(), table.size(), *tableOffset).withContext(path_ + ": table"));
    HYBRID_RETURN_IF_ERROR(
        writeAllAt(fd_, header.data(), header.size(), 0).withContext(path_ + ": header"));
    // The padding after the last entry is a hole; the size must still cover the empty table.
    if (::ftruncate(fd_, static_cast<off_t>(fileSize)) != 0)
      return Status::error(path_ + ": ftruncate failed: " + errnoMessage(errno));
    if (::fsync(fd_) != 0)
      return Status::error(path_ + ": fsync failed: " + errnoMessage(errno));
    int closeResult = ::close(fd_);
    fd_ = -1;
    if (closeResult != 0)
      return Status::error(path_ + ": close failed: " + errnoMessage(errno));
    if (::rename(tempPath_.c_str(), path_.c_str()) != 0) {
      int error = errno;
      return Status::error(path_ + ": cannot rename '" + tempPath_ +
                           "' into place: " + errnoMessage(error));
    }
    syncParentDirectory(path_);
    finished_ = true;
    failed_ = false;
    fileSize_ = fileSize;
    tempPath_.clear();
    return Status::ok();
  });
}

//===------------------------------------------------------------------------------------------===//
// WeightArchive.
//===------------------------------------------------------------------------------------------===//

StatusOr<WeightArchive> WeightArchive::open(const std::string &path) {
  return catchExceptions(path, [&]() -> StatusOr<WeightArchive> {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.isOpen()) {
      int error = errno;
      return Status::error(path + ": cannot open: " + errnoMessage(error));
    }
    struct stat info {};
    if (::fstat(fd.get(), &info) != 0) {
      int error = errno;
      return Status::error(path + ": cannot stat: " + errnoMessage(error));
    }
    WeightArchive archive;
    archive.path_ = path;
    archive.fileSize_ = static_cast<uint64_t>(info.st_size);
    if (archive.fileSize_ > 0) {
      void *mapping = ::mmap(nullptr, archive.fileSize_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
      if (mapping == MAP_FAILED) {
        int error = errno;
        return Status::error(path + ": cannot mmap: " + errnoMessage(error));
      }
      archive.mapping_ = static_cast<const std::byte *>(mapping);
    }
    fd.closeNow(); // the mapping keeps the file alive

    std::span<const std::byte> file(archive.mapping_, archive.fileSize_);
    StatusOr<ParsedHeader> header = parseHeader(file);
    if (!header)
      return Status(header.status()).withContext(path);
    archive.key_ = header->key;
    archive.pageSize_ = header->pageSize;
    archive.synthetic_ = header->synthetic;

    TableReader reader(file.subspan(header->tableOffset, header->tableSize));
    archive.entries_.resize(header->entryCount);
    for (size_t i = 0; i < archive.entries_.size(); ++i) {
      WeightArchiveEntry &entry = archive.entries_[i];
      HYBRID_RETURN_IF_ERROR(parseEntry(reader, i, *header, entry).withContext(path));
      if (!archive.index_.emplace(entry.name, i).second)
        return Status::error(path + ": " + entryContext(i, entry.name) + ": duplicate name");
    }
    if (reader.remaining() != 0)
      return Status::error(path + ": the entry table has " + std::to_string(reader.remaining()) +
                           " bytes after its last entry (header field 'entry_count' is " +
                           std::to_string(header->entryCount) + ")");
    HYBRID_RETURN_IF_ERROR(checkNoOverlap(archive.entries_).withContext(path));
    return archive;
  });
}

WeightArchive::WeightArchive(WeightArchive &&other) noexcept
    : path_(std::move(other.path_)), key_(other.key_), pageSize_(other.pageSize_),
      synthetic_(other.synthetic_), entries_(std::move(other.entries_)), index_(std::move(other.index_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      fileSize_(std::exchange(other.fileSize_, 0)) {}

WeightArchive &WeightArchive::operator=(WeightArchive &&other) noexcept {
  if (this != &other) {
    if (mapping_)
      ::munmap(const_cast<std::byte *>(mapping_), fileSize_);
    path_ = std::move(other.path_);
    key_ = other.key_;
    pageSize_ = other.pageSize_;
    synthetic_ = other.synthetic_;
    entries_ = std::move(other.entries_);
    index_ = std::move(other.index_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    fileSize_ = std::exchange(other.fileSize_, 0);
  }
  return *this;
}

WeightArchive::~WeightArchive() {
  if (mapping_)
    ::munmap(const_cast<std::byte *>(mapping_), fileSize_);
}

const WeightArchive::Entry *WeightArchive::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

std::span<const std::byte> WeightArchive::bytes(const Entry &entry) const {
  // open() checked every data entry lies inside the mapping.
  if (entry.synthetic)
    return {};
  return {mapping_ + entry.offset, entry.size};
}

Status WeightArchive::verifyContents() const {
  return catchExceptions(path_, [&]() -> Status {
    for (size_t i = 0; i < entries_.size() && !synthetic_; ++i) {
      const Entry &entry = entries_[i];
      std::span<const std::byte> data = bytes(entry);
      uint64_t actual = XXH3_64bits(data.data(), data.size());
      if (actual != entry.dataHash)
        return Status::error(path_ + ": " + entryContext(i, entry.name) + ": data hashes to " +
                             hex64(actual) + " but the table records " + hex64(entry.dataHash) +
                             " (corrupt data)");
    }
    return Status::ok();
  });
}

} // namespace hybrid
