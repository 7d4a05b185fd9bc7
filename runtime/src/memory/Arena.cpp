// Arena: one aligned allocation, zeroed once, carved into views by the plan's offsets.
#include "hybrid/runtime/Memory.h"

#include <cstring>
#include <new>
#include <utility>

namespace hybrid {

StatusOr<Arena> Arena::create(uint64_t bytes) {
  Arena arena;
  if (bytes == 0)
    return arena;
  // nothrow: the runtime reports allocation failure as a Status, never as an exception.
  void *memory = ::operator new (bytes, std::align_val_t{kAlignment}, std::nothrow);
  if (!memory)
    return Status::error("cannot allocate an arena of " + std::to_string(bytes) + " bytes");
  std::memset(memory, 0, bytes);
  arena.data_ = static_cast<std::byte *>(memory);
  arena.size_ = bytes;
  return arena;
}

Arena::Arena(Arena &&other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

Arena &Arena::operator=(Arena &&other) noexcept {
  if (this != &other) {
    if (data_)
      ::operator delete (data_, std::align_val_t{kAlignment});
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Arena::~Arena() {
  if (data_)
    ::operator delete (data_, std::align_val_t{kAlignment});
}

StatusOr<std::span<std::byte>> Arena::view(uint64_t offset, uint64_t bytes) {
  uint64_t end = 0;
  if (__builtin_add_overflow(offset, bytes, &end) || end > size_)
    return Status::error("arena view [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                         ") leaves the " + std::to_string(size_) + "-byte arena");
  return std::span<std::byte>(data_ + offset, bytes);
}

void Arena::clear() {
  if (data_)
    std::memset(data_, 0, size_);
}

} // namespace hybrid
