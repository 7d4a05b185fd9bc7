// Reader and writer for the safetensors format (Hugging Face checkpoints, golden files, hybrid-run
// outputs). The reader maps the file and validates the header completely before any tensor is
// handed out: every offset inside the data section, no overlaps, byte size consistent with dtype
// and shape. Errors name the file and the tensor or field.
#pragma once

#include "hybrid/runtime/Status.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hybrid::safetensors {

enum class DType : uint8_t { BOOL, U8, I8, I16, I32, I64, F16, BF16, F32, F64, F8_E4M3, F8_E5M2 };

// Size of one element in bytes.
size_t dtypeSize(DType dtype);
// The spelling used in safetensors headers ("BF16", "F8_E4M3", ...).
std::string_view dtypeName(DType dtype);
// Parses a header spelling; nullopt for an unknown one.
std::optional<DType> parseDType(std::string_view name);

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  // Byte range inside the data section (after the 8-byte length and the JSON header).
  uint64_t begin = 0;
  uint64_t end = 0;

  int64_t numElements() const;
  uint64_t byteSize() const { return end - begin; }
};

// A validated, memory-mapped safetensors file. Movable, not copyable.
class File {
public:
  static StatusOr<File> open(const std::string &path);

  File(File &&) noexcept;
  File &operator=(File &&) noexcept;
  File(const File &) = delete;
  File &operator=(const File &) = delete;
  ~File();

  const std::string &path() const { return path_; }
  // In header order.
  const std::vector<TensorInfo> &tensors() const { return tensors_; }
  const TensorInfo *find(std::string_view name) const;
  // The raw little-endian bytes of a tensor of this file.
  std::span<const std::byte> bytes(const TensorInfo &tensor) const;
  const std::map<std::string, std::string> &metadata() const { return metadata_; }
  uint64_t fileSize() const { return fileSize_; }

private:
  File() = default;
  std::string path_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  const std::byte *mapping_ = nullptr;
  uint64_t fileSize_ = 0;
  uint64_t dataOffset_ = 0;
};

// One tensor to write; the bytes must hold exactly numElements * dtypeSize bytes.
struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;
};

// Writes a safetensors file atomically (temp file in the same folder, fsync, rename), so a reader
// never sees a half-written file. Tensors are stored in the given order, data 8-byte aligned.
Status write(const std::string &path, const std::vector<TensorView> &tensors,
             const std::map<std::string, std::string> &metadata = {});

// Float conversions shared by readers of bf16 / fp16 / fp8 checkpoints.
float bf16ToFloat(uint16_t bits);
uint16_t floatToBf16(float value); // round to nearest even
float f16ToFloat(uint16_t bits);
float f8e4m3ToFloat(uint8_t bits); // OCP E4M3 "fn": no inf, 0x7f/0xff NaN
float f8e5m2ToFloat(uint8_t bits);

// Reads a tensor of any floating or integer dtype as fp32 / int64 values.
StatusOr<std::vector<float>> readAsFloat(const File &file, const TensorInfo &tensor);
StatusOr<std::vector<int64_t>> readAsInt64(const File &file, const TensorInfo &tensor);

} // namespace hybrid::safetensors
