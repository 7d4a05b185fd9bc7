// Safetensors reader and writer. This file is linked into the compiler, which is built with
// -fno-exceptions: every public function catches what nlohmann::json or the standard library may
// throw and turns it into a Status, so no exception ever leaves this translation unit.
#include "hybrid/runtime/Safetensors.h"
#include "hybrid/runtime/StatusHelpers.h"
#include "hybrid/runtime/UniqueFd.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <system_error>
#include <unistd.h>
#include <utility>

namespace hybrid::safetensors {
namespace {

// ordered_json keeps the header's key order, so tensors() follows the file.
using Json = nlohmann::ordered_json;

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swaps");

constexpr uint64_t kHeaderLengthBytes = 8;
// Real headers are at most a few MiB; a larger length means a corrupt or foreign file.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr uint64_t kDataAlignment = 8;
constexpr std::string_view kMetadataKey = "__metadata__";

struct DTypeDescription {
  DType dtype;
  std::string_view name;
  size_t size;
};

// Indexed by the enum value (checked below).
constexpr DTypeDescription kDTypes[] = {
    {DType::BOOL, "BOOL", 1}, {DType::U8, "U8", 1},           {DType::I8, "I8", 1},
    {DType::I16, "I16", 2},   {DType::I32, "I32", 4},         {DType::I64, "I64", 8},
    {DType::F16, "F16", 2},   {DType::BF16, "BF16", 2},       {DType::F32, "F32", 4},
    {DType::F64, "F64", 8},   {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
};

constexpr bool dtypeTableMatchesEnum() {
  for (size_t i = 0; i < std::size(kDTypes); ++i)
    if (static_cast<size_t>(kDTypes[i].dtype) != i)
      return false;
  return true;
}
static_assert(dtypeTableMatchesEnum(), "kDTypes must list the DType values in enum order");

const DTypeDescription *describe(DType dtype) {
  auto index = static_cast<size_t>(dtype);
  return index < std::size(kDTypes) ? &kDTypes[index] : nullptr;
}

// Names from a parsed header are valid UTF-8 but may hold control characters.
std::string printable(std::string_view text) { return escapeBytes(text, NonAscii::Keep); }

std::string tensorContext(std::string_view name) { return "tensor '" + printable(name) + "'"; }

std::string formatShape(const std::vector<int64_t> &shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// Built by appending: `"[" + std::to_string(...)` trips a GCC 12 -Wrestrict false positive.
std::string formatRange(uint64_t begin, uint64_t end) {
  std::string out = "[";
  out += std::to_string(begin);
  out += ", ";
  out += std::to_string(end);
  out += "]";
  return out;
}

// Number of elements of a shape, or nullopt when a dimension is negative or the product
// overflows int64.
std::optional<int64_t> checkedNumElements(const std::vector<int64_t> &shape) {
  int64_t count = 1;
  for (int64_t dim : shape)
    if (dim < 0 || __builtin_mul_overflow(count, dim, &count))
      return std::nullopt;
  return count;
}

// Byte size of `numElements` elements, or nullopt on uint64 overflow.
std::optional<uint64_t> checkedByteSize(int64_t numElements, DType dtype) {
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numElements), dtypeSize(dtype), &bytes))
    return std::nullopt;
  return bytes;
}

//===------------------------------------------------------------------------------------------===//
// Header parsing. Errors are phrased without the path; File::open prefixes it.
//===------------------------------------------------------------------------------------------===//

// Looks up a required field of a tensor entry and checks its JSON type.
StatusOr<const Json *> requireField(const Json &entry, const char *key, Json::value_t expectedType,
                                    const char *expectedTypeName) {
  auto it = entry.find(key);
  if (it == entry.end())
    return Status::error(std::string("missing field '") + key + "'");
  if (it->type() != expectedType)
    return Status::error(std::string("field '") + key + "' must be " + expectedTypeName + ", got " +
                         it->type_name());
  return &*it;
}

Status parseShape(const Json &shapeJson, std::vector<int64_t> &shape) {
  shape.clear();
  for (size_t i = 0; i < shapeJson.size(); ++i) {
    const Json &dim = shapeJson[i];
    std::string field = "shape[" + std::to_string(i) + "]";
    if (!dim.is_number_integer())
      return Status::error(field + " must be an integer, got " + dim.dump());
    if (dim.is_number_unsigned()) {
      auto value = dim.get<uint64_t>();
      if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return Status::error(field + " = " + std::to_string(value) + " is too large");
      shape.push_back(static_cast<int64_t>(value));
    } else {
      // nlohmann stores only negative integers as signed.
      return Status::error(field + " = " + std::to_string(dim.get<int64_t>()) + " is negative");
    }
  }
  return Status::ok();
}

// Parses and checks one tensor entry against the data section size.
Status parseTensorEntry(const std::string &name, const Json &entry, uint64_t dataSectionSize,
                        TensorInfo &tensor) {
  if (!entry.is_object())
    return Status::error(std::string("entry must be an object, got ") + entry.type_name());
  tensor.name = name;

  auto dtypeField = requireField(entry, "dtype", Json::value_t::string, "a string");
  if (!dtypeField)
    return dtypeField.status();
  const auto &dtypeSpelling = (*dtypeField)->get_ref<const std::string &>();
  std::optional<DType> dtype = parseDType(dtypeSpelling);
  if (!dtype)
    return Status::error("unknown dtype '" + printable(dtypeSpelling) + "'");
  tensor.dtype = *dtype;

  auto shapeField = requireField(entry, "shape", Json::value_t::array, "an array");
  if (!shapeField)
    return shapeField.status();
  if (Status status = parseShape(**shapeField, tensor.shape); !status)
    return status;
  std::optional<int64_t> numElements = checkedNumElements(tensor.shape);
  std::optional<uint64_t> expectedBytes;
  if (numElements)
    expectedBytes = checkedByteSize(*numElements, tensor.dtype);
  if (!expectedBytes)
    return Status::error("shape " + formatShape(tensor.shape) + " has too many elements");

  auto offsetsField = requireField(entry, "data_offsets", Json::value_t::array, "an array");
  if (!offsetsField)
    return offsetsField.status();
  const Json &offsets = **offsetsField;
  // nlohmann parses every non-negative integer as unsigned; negatives and floats fail here.
  if (offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
    return Status::error("data_offsets must be two non-negative integers, got " + offsets.dump());
  tensor.begin = offsets[0].get<uint64_t>();
  tensor.end = offsets[1].get<uint64_t>();
  std::string range = "data_offsets " + formatRange(tensor.begin, tensor.end);
  if (tensor.begin > tensor.end)
    return Status::error(range + " begin after end");
  if (tensor.end > dataSectionSize)
    return Status::error(range + " end past the data section (" + std::to_string(dataSectionSize) +
                         " bytes)");
  if (tensor.byteSize() != *expectedBytes)
    return Status::error(range + " hold " + std::to_string(tensor.byteSize()) + " bytes but " +
                         dtypeSpelling + " " + formatShape(tensor.shape) + " needs " +
                         std::to_string(*expectedBytes));
  return Status::ok();
}

Status parseMetadata(const Json &metadataJson, std::map<std::string, std::string> &metadata) {
  std::string field = "field '" + std::string(kMetadataKey) + "'";
  if (!metadataJson.is_object())
    return Status::error(field + " must be an object, got " + metadataJson.type_name());
  for (const auto &[key, value] : metadataJson.items()) {
    if (!value.is_string())
      return Status::error(field + " key '" + printable(key) + "' must map to a string, got " +
                           value.type_name());
    metadata[key] = value.get<std::string>();
  }
  return Status::ok();
}

// Rejects tensors whose non-empty byte ranges intersect (empty ranges overlap nothing).
Status checkNoOverlap(const std::vector<TensorInfo> &tensors) {
  std::vector<const TensorInfo *> byBegin;
  for (const TensorInfo &tensor : tensors)
    if (tensor.byteSize() > 0)
      byBegin.push_back(&tensor);
  std::sort(byBegin.begin(), byBegin.end(),
            [](const TensorInfo *a, const TensorInfo *b) { return a->begin < b->begin; });
  // The tensor reaching furthest so far is the one any later tensor could collide with.
  const TensorInfo *furthest = nullptr;
  for (const TensorInfo *tensor : byBegin) {
    if (furthest && tensor->begin < furthest->end)
      return Status::error(tensorContext(furthest->name) + " " +
                           formatRange(furthest->begin, furthest->end) + " and " +
                           tensorContext(tensor->name) + " " +
                           formatRange(tensor->begin, tensor->end) + " overlap");
    if (!furthest || tensor->end > furthest->end)
      furthest = tensor;
  }
  return Status::ok();
}

//===------------------------------------------------------------------------------------------===//
// Writing.
//===------------------------------------------------------------------------------------------===//

Status writeAll(int fd, const void *data, size_t size) {
  const char *cursor = static_cast<const char *>(data);
  while (size > 0) {
    ssize_t written = ::write(fd, cursor, size);
    if (written < 0) {
      if (errno == EINTR)
        continue;
      return Status::error("write failed: " + errnoMessage(errno));
    }
    cursor += written;
    size -= static_cast<size_t>(written);
  }
  return Status::ok();
}

// Deletes the temp file on scope exit unless it was renamed into place.
class TempFileGuard {
public:
  explicit TempFileGuard(std::string path) : path_(std::move(path)) {}
  TempFileGuard(const TempFileGuard &) = delete;
  TempFileGuard &operator=(const TempFileGuard &) = delete;
  ~TempFileGuard() {
    if (!committed_)
      ::unlink(path_.c_str());
  }
  void commit() { committed_ = true; }

private:
  std::string path_;
  bool committed_ = false;
};

// Builds the padded header text; the data section then starts at an 8-byte aligned offset.
StatusOr<std::string> buildHeader(const std::vector<TensorView> &tensors,
                                  const std::map<std::string, std::string> &metadata) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json metadataJson = Json::object();
    for (const auto &[key, value] : metadata)
      metadataJson[key] = value;
    header[std::string(kMetadataKey)] = std::move(metadataJson);
  }

  uint64_t offset = 0;
  for (const TensorView &tensor : tensors) {
    std::string context = tensorContext(tensor.name);
    if (tensor.name == kMetadataKey)
      return Status::error(context + ": the name is reserved for metadata");
    if (header.contains(tensor.name))
      return Status::error(context + ": duplicate tensor name");
    if (!describe(tensor.dtype))
      return Status::error(context + ": invalid dtype value " +
                           std::to_string(static_cast<int>(tensor.dtype)));
    std::optional<int64_t> numElements = checkedNumElements(tensor.shape);
    std::optional<uint64_t> expectedBytes;
    if (numElements)
      expectedBytes = checkedByteSize(*numElements, tensor.dtype);
    if (!expectedBytes)
      return Status::error(context + ": shape " + formatShape(tensor.shape) +
                           " has a negative dimension or too many elements");
    if (tensor.data.size() != *expectedBytes)
      return Status::error(context + ": has " + std::to_string(tensor.data.size()) + " bytes but " +
                           std::string(dtypeName(tensor.dtype)) + " " + formatShape(tensor.shape) +
                           " needs " + std::to_string(*expectedBytes));

    Json entry = Json::object();
    entry["dtype"] = std::string(dtypeName(tensor.dtype));
    entry["shape"] = tensor.shape;
    entry["data_offsets"] = Json::array({offset, offset + *expectedBytes});
    header[tensor.name] = std::move(entry);
    offset += *expectedBytes;
  }

  std::string text;
  try {
    text = header.dump();
  } catch (const Json::type_error &error) {
    // dump() refuses strings that are not valid UTF-8.
    return Status::error(std::string("tensor names and metadata must be valid UTF-8: ") +
                         error.what());
  }
  // The length prefix is 8 bytes, so aligning the header length aligns the data section.
  size_t padding = (kDataAlignment - text.size() % kDataAlignment) % kDataAlignment;
  text.append(padding, ' ');
  return text;
}

Status writeImpl(const std::string &path, const std::vector<TensorView> &tensors,
                 const std::map<std::string, std::string> &metadata) {
  StatusOr<std::string> header = buildHeader(tensors, metadata);
  if (!header)
    return header.status();

  std::string tempPath = path + ".tmp." + std::to_string(::getpid());
  UniqueFd fd(::open(tempPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    int error = errno; // read before the string concatenation below may allocate
    return Status::error("cannot create temp file '" + tempPath + "': " + errnoMessage(error));
  }
  TempFileGuard guard(tempPath);

  uint64_t headerLength = header->size();
  if (Status status = writeAll(fd.get(), &headerLength, sizeof headerLength); !status)
    return status;
  if (Status status = writeAll(fd.get(), header->data(), header->size()); !status)
    return status;
  for (const TensorView &tensor : tensors)
    if (Status status = writeAll(fd.get(), tensor.data.data(), tensor.data.size()); !status)
      return status;
  if (::fsync(fd.get()) != 0)
    return Status::error("fsync failed: " + errnoMessage(errno));
  if (fd.closeNow() != 0)
    return Status::error("close failed: " + errnoMessage(errno));
  if (::rename(tempPath.c_str(), path.c_str()) != 0) {
    int error = errno;
    return Status::error("cannot rename '" + tempPath + "' into place: " + errnoMessage(error));
  }
  guard.commit();
  syncParentDirectory(path);
  return Status::ok();
}

//===------------------------------------------------------------------------------------------===//
// Element conversion.
//===------------------------------------------------------------------------------------------===//

// Data offsets carry no alignment guarantee, so elements are copied, never dereferenced in place.
template <typename T> T loadLittleEndian(const std::byte *source) {
  T value;
  std::memcpy(&value, source, sizeof value);
  return value;
}

template <typename Stored, typename Out, typename Convert>
std::vector<Out> convertElements(std::span<const std::byte> bytes, Convert convert) {
  std::vector<Out> out(bytes.size() / sizeof(Stored));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<Out>(convert(loadLittleEndian<Stored>(bytes.data() + i * sizeof(Stored))));
  return out;
}

// Converts an integer (or BOOL) tensor; nullopt for a floating dtype.
template <typename Out>
std::optional<std::vector<Out>> convertIntegerTensor(DType dtype,
                                                     std::span<const std::byte> bytes) {
  auto cast = [](auto value) { return static_cast<Out>(value); };
  switch (dtype) {
  case DType::BOOL:
    return convertElements<uint8_t, Out>(bytes, [](uint8_t value) { return value != 0; });
  case DType::U8:
    return convertElements<uint8_t, Out>(bytes, cast);
  case DType::I8:
    return convertElements<int8_t, Out>(bytes, cast);
  case DType::I16:
    return convertElements<int16_t, Out>(bytes, cast);
  case DType::I32:
    return convertElements<int32_t, Out>(bytes, cast);
  case DType::I64:
    return convertElements<int64_t, Out>(bytes, cast);
  default:
    return std::nullopt;
  }
}

// A caller-made TensorInfo could point outside this file's mapping; accept only our own entries.
Status checkTensorOfFile(const File &file, const TensorInfo &tensor) {
  const TensorInfo *own = file.find(tensor.name);
  if (!own || own->begin != tensor.begin || own->end != tensor.end || own->dtype != tensor.dtype)
    return Status::error(file.path() + ": " + tensorContext(tensor.name) +
                         ": not a tensor of this file");
  return Status::ok();
}

} // namespace

//===------------------------------------------------------------------------------------------===//
// DType.
//===------------------------------------------------------------------------------------------===//

size_t dtypeSize(DType dtype) {
  const DTypeDescription *description = describe(dtype);
  return description ? description->size : 0;
}

std::string_view dtypeName(DType dtype) {
  const DTypeDescription *description = describe(dtype);
  return description ? description->name : std::string_view("<invalid dtype>");
}

std::optional<DType> parseDType(std::string_view name) {
  for (const DTypeDescription &description : kDTypes)
    if (description.name == name)
      return description.dtype;
  return std::nullopt;
}

int64_t TensorInfo::numElements() const {
  int64_t count = 1;
  for (int64_t dim : shape)
    count *= dim;
  return count;
}

//===------------------------------------------------------------------------------------------===//
// File.
//===------------------------------------------------------------------------------------------===//

StatusOr<File> File::open(const std::string &path) {
  try {
    auto fail = [&](const std::string &message) { return Status::error(path + ": " + message); };

    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0)
      return fail("cannot open: " + errnoMessage(errno));
    struct stat info;
    if (::fstat(fd.get(), &info) != 0)
      return fail("cannot stat: " + errnoMessage(errno));
    if (!S_ISREG(info.st_mode))
      return fail("not a regular file");
    auto fileSize = static_cast<uint64_t>(info.st_size);
    // Checked before mmap, which rejects an empty file.
    if (fileSize < kHeaderLengthBytes)
      return fail("file is truncated: " + std::to_string(fileSize) +
                  " bytes, too short for the 8-byte header length");

    void *mapping = ::mmap(nullptr, fileSize, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (mapping == MAP_FAILED)
      return fail("cannot mmap: " + errnoMessage(errno));
    // From here the File owns the mapping and unmaps it on every error return.
    File file;
    file.path_ = path;
    file.mapping_ = static_cast<const std::byte *>(mapping);
    file.fileSize_ = fileSize;

    auto headerLength = loadLittleEndian<uint64_t>(file.mapping_);
    if (headerLength > kMaxHeaderBytes)
      return fail("header length " + std::to_string(headerLength) +
                  " exceeds the 100 MiB limit (corrupt or not a safetensors file)");
    if (headerLength > fileSize - kHeaderLengthBytes)
      return fail("header length " + std::to_string(headerLength) + " is larger than the file (" +
                  std::to_string(fileSize) + " bytes)");
    file.dataOffset_ = kHeaderLengthBytes + headerLength;
    uint64_t dataSectionSize = fileSize - file.dataOffset_;

    const char *headerText = reinterpret_cast<const char *>(file.mapping_ + kHeaderLengthBytes);
    Json header;
    try {
      header = Json::parse(headerText, headerText + headerLength);
    } catch (const Json::exception &error) {
      // parse_error for bad syntax, out_of_range for a number beyond double.
      return fail("header is not valid JSON: " + escapeBytes(error.what(), NonAscii::Escape));
    }
    if (!header.is_object())
      return fail(std::string("header must be a JSON object, got ") + header.type_name());

    for (const auto &[key, value] : header.items()) {
      if (key == kMetadataKey) {
        if (Status status = parseMetadata(value, file.metadata_); !status)
          return std::move(status).withContext(path);
        continue;
      }
      TensorInfo tensor;
      if (Status status = parseTensorEntry(key, value, dataSectionSize, tensor); !status)
        return std::move(status).withContext(tensorContext(key)).withContext(path);
      file.index_[tensor.name] = file.tensors_.size();
      file.tensors_.push_back(std::move(tensor));
    }
    if (Status status = checkNoOverlap(file.tensors_); !status)
      return std::move(status).withContext(path);
    return file;
  } catch (const std::exception &error) {
    return Status::error(path + ": unexpected error while reading: " + error.what());
  }
}

File::File(File &&other) noexcept
    : path_(std::move(other.path_)), tensors_(std::move(other.tensors_)),
      index_(std::move(other.index_)), metadata_(std::move(other.metadata_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      fileSize_(std::exchange(other.fileSize_, 0)),
      dataOffset_(std::exchange(other.dataOffset_, 0)) {}

File &File::operator=(File &&other) noexcept {
  if (this != &other) {
    if (mapping_)
      ::munmap(const_cast<std::byte *>(mapping_), fileSize_);
    path_ = std::move(other.path_);
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    fileSize_ = std::exchange(other.fileSize_, 0);
    dataOffset_ = std::exchange(other.dataOffset_, 0);
  }
  return *this;
}

File::~File() {
  if (mapping_)
    ::munmap(const_cast<std::byte *>(mapping_), fileSize_);
}

const TensorInfo *File::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const std::byte> File::bytes(const TensorInfo &tensor) const {
  assert(mapping_ && tensor.begin <= tensor.end && tensor.end <= fileSize_ - dataOffset_ &&
         "tensor is not from this file");
  return {mapping_ + dataOffset_ + tensor.begin, tensor.byteSize()};
}

//===------------------------------------------------------------------------------------------===//
// Writer.
//===------------------------------------------------------------------------------------------===//

Status write(const std::string &path, const std::vector<TensorView> &tensors,
             const std::map<std::string, std::string> &metadata) {
  try {
    return writeImpl(path, tensors, metadata).withContext(path);
  } catch (const std::exception &error) {
    return Status::error(path + ": unexpected error while writing: " + error.what());
  }
}

//===------------------------------------------------------------------------------------------===//
// Conversions.
//===------------------------------------------------------------------------------------------===//

float bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

uint16_t floatToBf16(float value) {
  auto bits = std::bit_cast<uint32_t>(value);
  // Truncating a NaN whose payload sits in the low half would produce infinity; keep it a
  // (quiet) NaN with the same sign instead.
  if (std::isnan(value))
    return static_cast<uint16_t>((bits >> 16) | 0x0040);
  // Round to nearest even: add just under half an ulp, plus one if the kept part is odd. Finite
  // values past the bf16 range carry into the exponent and become infinity, as they should.
  uint32_t roundingBias = 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + roundingBias) >> 16);
}

float f16ToFloat(uint16_t bits) {
  uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  uint32_t exponent = (bits >> 10) & 0x1f;
  uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in fp32.
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) // infinity (mantissa 0) or NaN (payload kept)
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent - 15 + 127) << 23) | (mantissa << 13));
}

float f8e4m3ToFloat(uint8_t bits) {
  bool negative = bits & 0x80;
  uint32_t exponent = (bits >> 3) & 0xf;
  uint32_t mantissa = bits & 0x7;
  // The "fn" variant has no infinities; only S.1111.111 is NaN, so 448 = 1.75 * 2^8 is the max.
  if (exponent == 0xf && mantissa == 0x7)
    return std::numeric_limits<float>::quiet_NaN();
  float magnitude =
      exponent == 0
          ? std::ldexp(static_cast<float>(mantissa), -9) // subnormal: m/8 * 2^-6
          : std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, static_cast<int>(exponent) - 7);
  return negative ? -magnitude : magnitude;
}

// E5M2 has the layout of the upper byte of an fp16 (same bias, inf and NaN encodings).
float f8e5m2ToFloat(uint8_t bits) { return f16ToFloat(static_cast<uint16_t>(bits << 8)); }

StatusOr<std::vector<float>> readAsFloat(const File &file, const TensorInfo &tensor) {
  try {
    if (Status status = checkTensorOfFile(file, tensor); !status)
      return status;
    std::span<const std::byte> bytes = file.bytes(tensor);
    switch (tensor.dtype) {
    case DType::F16:
      return convertElements<uint16_t, float>(bytes, f16ToFloat);
    case DType::BF16:
      return convertElements<uint16_t, float>(bytes, bf16ToFloat);
    case DType::F32:
      return convertElements<float, float>(bytes, [](float value) { return value; });
    case DType::F64:
      return convertElements<double, float>(bytes, [](double value) { return value; });
    case DType::F8_E4M3:
      return convertElements<uint8_t, float>(bytes, f8e4m3ToFloat);
    case DType::F8_E5M2:
      return convertElements<uint8_t, float>(bytes, f8e5m2ToFloat);
    default:
      break;
    }
    if (auto values = convertIntegerTensor<float>(tensor.dtype, bytes))
      return std::move(*values);
    return Status::error(file.path() + ": " + tensorContext(tensor.name) + ": dtype " +
                         std::string(dtypeName(tensor.dtype)) + " cannot be read as float");
  } catch (const std::exception &error) {
    return Status::error(file.path() + ": " + tensorContext(tensor.name) + ": " + error.what());
  }
}

StatusOr<std::vector<int64_t>> readAsInt64(const File &file, const TensorInfo &tensor) {
  try {
    if (Status status = checkTensorOfFile(file, tensor); !status)
      return status;
    if (auto values = convertIntegerTensor<int64_t>(tensor.dtype, file.bytes(tensor)))
      return std::move(*values);
    return Status::error(file.path() + ": " + tensorContext(tensor.name) + ": dtype " +
                         std::string(dtypeName(tensor.dtype)) +
                         " is not an integer type, cannot read as int64");
  } catch (const std::exception &error) {
    return Status::error(file.path() + ": " + tensorContext(tensor.name) + ": " + error.what());
  }
}

} // namespace hybrid::safetensors
