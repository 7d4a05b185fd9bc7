// The weight archive: one file holding every weight a plan reads, each entry page aligned so the
// runtime can mmap the file and hand kernels pointers into it without copying. The compiler writes
// it (WeightArchiveWriter) from the checkpoint after layout and quantization decisions; the runtime
// opens it (WeightArchive) and cross-checks it against the plan (checkWeights in Plan.h).
// The byte-by-byte format is in docs/weight-archive.md. No exception leaves these functions: the
// compiler that links them is built with -fno-exceptions.
#pragma once

#include "hybrid/kernels/SyntheticWeights.h"
#include "hybrid/runtime/Status.h"
#include "runtime/schema/plan_generated.h"

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hybrid {

// Identifies the archive's contents (weights fingerprint + layout/quant decisions); the plan
// names the key of the archive it was compiled against (Plan.weight_archive_key, in hex).
using ArchiveKey = std::array<uint8_t, 16>;

inline constexpr uint32_t kWeightArchiveFormatVersion = 1;
// Format version 3: a synthetic archive, whose entries hold generator descriptors instead of data
// (hybrid-compile --synthetic-weights); the runtime generates their values at load. Version 2
// (still read) lacked the descriptor's source window: every entry was a whole tensor.
inline constexpr uint32_t kSyntheticWeightArchiveFormatVersion = 3;
inline constexpr uint32_t kWholeTensorSyntheticWeightArchiveFormatVersion = 2;
inline constexpr uint64_t kDefaultWeightArchivePageSize = 4096;
// Page sizes accepted by the writer and reader: powers of two in this range.
inline constexpr uint64_t kMinWeightArchivePageSize = 4096;
inline constexpr uint64_t kMaxWeightArchivePageSize = uint64_t{1} << 30;
// Bytes of the fixed header at offset 0 (the rest of the first page is zero).
inline constexpr uint64_t kWeightArchiveHeaderBytes = 72;

// Lowercase hex, key[0] first: the spelling of Plan.weight_archive_key.
std::string formatArchiveKey(const ArchiveKey &key);
// Parses 32 hex digits (either case); nullopt for anything else.
std::optional<ArchiveKey> parseArchiveKey(std::string_view hex);

// Bytes per element of a plan dtype; 0 for a value outside the enum.
size_t dtypeByteSize(plan::fb::DType dtype);
// "F32", "BF16", ...; "DType(<n>)" for a value outside the enum.
std::string dtypeName(plan::fb::DType dtype);

// The layout rule shared by the compiler and the runtime: entry data starts at offset `pageSize`
// (the first page holds the header) and each entry starts at the first multiple of pageSize at or
// after the previous entry's end. Returns one offset per size. pageSize must be non-zero.
std::vector<uint64_t> planWeightOffsets(std::span<const uint64_t> sizes,
                                        uint64_t pageSize = kDefaultWeightArchivePageSize);

// How a synthetic entry's values are generated (kernels/include/hybrid/kernels/SyntheticWeights.h):
// the logical tensor is a row-major [rows, cols] matrix, stored row-major (tile 0 x 0) or tiled
// with zero padding (the entry's shape is then the padded [rows, cols]). Its element (r, c) is
// element r * sourceRowStride + sourceOffset + c of the seeded tensor (sourceRowStride 0: cols),
// which is how a sharded plan's rank holds its slice of a synthetic tensor.
struct SyntheticWeight {
  kernels::SyntheticKind kind = kernels::SyntheticKind::Normal;
  uint64_t key = 0;
  float a = 0.0f;
  float b = 0.0f;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t tileRows = 0;
  int64_t tileCols = 0;
  int64_t sourceRowStride = 0;
  int64_t sourceOffset = 0;

  bool operator==(const SyntheticWeight &) const = default;
};

// One entry of the archive's table.
struct WeightArchiveEntry {
  std::string name;
  plan::fb::DType dtype = plan::fb::DType::F32;
  std::vector<int64_t> shape; // the stored shape: size == product(shape) * dtypeByteSize(dtype)
  uint64_t offset = 0;        // from the start of the file, a multiple of the page size
  uint64_t size = 0;          // bytes
  uint64_t dataHash = 0;      // XXH3-64 of the entry's bytes; 0 for a synthetic entry
  // Set in a synthetic archive (format version 2 or 3): the entry has no bytes in the file;
  // offset and size still place it in the data region the plan addresses.
  std::optional<SyntheticWeight> synthetic;
};

// The generator call for a synthetic entry (entry.synthetic set, as WeightArchive::open checked).
kernels::SyntheticFill syntheticFill(const WeightArchiveEntry &entry);

// Why `synthetic` cannot describe values of `dtype` and stored `shape` (an unknown kind, a dtype
// other than F32, BF16 or F8_E4M3, non-finite or out-of-range parameters, a layout that does not
// give `shape`), naming the field; nullopt when it can.
std::optional<std::string> syntheticWeightError(const SyntheticWeight &synthetic,
                                                plan::fb::DType dtype,
                                                const std::vector<int64_t> &shape);

// Writes an archive: data streams to a temp file beside `path` as entries are added, and finish()
// writes the table and header, fsyncs and renames into place, so a reader never sees a partial
// archive. Destroying a writer without a successful finish() deletes the temp file.
class WeightArchiveWriter {
public:
  static StatusOr<WeightArchiveWriter> create(const std::string &path, ArchiveKey key,
                                              uint64_t pageSize = kDefaultWeightArchivePageSize);

  WeightArchiveWriter(WeightArchiveWriter &&other) noexcept;
  WeightArchiveWriter &operator=(WeightArchiveWriter &&other) noexcept;
  WeightArchiveWriter(const WeightArchiveWriter &) = delete;
  WeightArchiveWriter &operator=(const WeightArchiveWriter &) = delete;
  ~WeightArchiveWriter();

  // Writes `data` at the next planned offset. Names must be unique and non-empty; data must hold
  // exactly product(shape) * dtypeByteSize(dtype) bytes. A rejected argument leaves the writer
  // usable; a failed write poisons it (every later call fails).
  Status add(std::string name, plan::fb::DType dtype, std::vector<int64_t> shape,
             std::span<const std::byte> data);
  // Adds an entry without data whose values the runtime generates from `synthetic` (checked with
  // syntheticWeightError). Such an entry takes its planned offset and size but no file bytes, and
  // makes the archive a synthetic one (format version 3): an archive holds data entries or
  // synthetic ones, never both.
  Status addSynthetic(std::string name, plan::fb::DType dtype, std::vector<int64_t> shape,
                      const SyntheticWeight &synthetic);
  // Writes the table and the header, fsyncs and renames the temp file to the final path.
  Status finish();

  const std::vector<WeightArchiveEntry> &entries() const { return entries_; }
  // The archive's total size in bytes (data and entry table) once finish() succeeded.
  uint64_t fileSize() const { return fileSize_; }

private:
  WeightArchiveWriter() = default;
  void abandon();
  Status addEntry(std::string name, plan::fb::DType dtype, std::vector<int64_t> shape,
                  std::span<const std::byte> data, const SyntheticWeight *synthetic);

  std::string path_;
  std::string tempPath_;
  int fd_ = -1;
  ArchiveKey key_{};
  uint64_t pageSize_ = kDefaultWeightArchivePageSize;
  uint64_t dataEnd_ = 0; // end of the last entry's data (pageSize_ while empty)
  std::optional<bool> synthetic_; // decided by the first entry
  std::vector<WeightArchiveEntry> entries_;
  std::map<std::string, size_t, std::less<>> index_;
  uint64_t fileSize_ = 0;
  bool failed_ = false;
  bool finished_ = false;
};

// A validated, read-only memory-mapped archive. Movable, not copyable. open() checks the whole
// header and table (see docs/weight-archive.md); verifyContents() additionally hashes the data.
class WeightArchive {
public:
  using Entry = WeightArchiveEntry;

  static StatusOr<WeightArchive> open(const std::string &path);

  WeightArchive(WeightArchive &&other) noexcept;
  WeightArchive &operator=(WeightArchive &&other) noexcept;
  WeightArchive(const WeightArchive &) = delete;
  WeightArchive &operator=(const WeightArchive &) = delete;
  ~WeightArchive();

  const std::string &path() const { return path_; }
  const ArchiveKey &key() const { return key_; }
  uint64_t pageSize() const { return pageSize_; }
  uint64_t fileSize() const { return fileSize_; }
  // A synthetic archive (format version 2 or 3): every entry has a descriptor and no bytes.
  bool synthetic() const { return synthetic_; }
  // In table order (the order they were added).
  const std::vector<Entry> &entries() const { return entries_; }
  const Entry *find(std::string_view name) const;
  // The entry's bytes inside the mapping; `entry` must come from this archive. Empty for a
  // synthetic entry, whose values are generated instead (syntheticFill).
  std::span<const std::byte> bytes(const Entry &entry) const;
  // Recomputes every entry's XXH3-64 (reads the whole file); names the first mismatching entry.
  // A synthetic archive has no data to hash: its descriptors were checked by open().
  Status verifyContents() const;

private:
  WeightArchive() = default;

  std::string path_;
  ArchiveKey key_{};
  uint64_t pageSize_ = 0;
  bool synthetic_ = false;
  std::vector<Entry> entries_;
  std::map<std::string, size_t, std::less<>> index_;
  const std::byte *mapping_ = nullptr;
  uint64_t fileSize_ = 0;
};

} // namespace hybrid
