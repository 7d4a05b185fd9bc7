// Arena: one aligned allocation, zeroed once, carved into views by the plan's offsets.
#include "hybrid/runtime/Memory.h"

#include <cstring>
#include <new>
#include <sys/mman.h>
#include <utility>

namespace hybrid {
namespace {

// Large arenas are anonymous mappings: the kernel hands out zero pages on first touch, so an
// arena costs only what is used of it. The cuda device's host arenas, KV cache and state pool
// (Kimi-Linear-48B: a 5.7 GB prefill arena, 0.7 GB of KV pages) serve only the steps left to the
// cpu reference and the host snapshots, and zeroing them with memset was most of the load's time.
constexpr uint64_t kMappedBytes = uint64_t(1) << 20;

void release(std::byte *data, uint64_t bytes) {
  if (!data)
    return;
  if (bytes >= kMappedBytes)
    munmap(data, bytes);
  else
    ::operator delete (data, std::align_val_t{Arena::kAlignment});
}

} // namespace

StatusOr<Arena> Arena::create(uint64_t bytes) {
  Arena arena;
  if (bytes == 0)
    return arena;
  void *memory = nullptr;
  if (bytes >= kMappedBytes) { // page aligned, zero
    memory = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED)
      memory = nullptr;
  } else {
    // nothrow: the runtime reports allocation failure as a Status, never as an exception.
    memory = ::operator new (bytes, std::align_val_t{kAlignment}, std::nothrow);
    if (memory)
      std::memset(memory, 0, bytes);
  }
  if (!memory)
    return Status::error("cannot allocate an arena of " + std::to_string(bytes) + " bytes");
  arena.data_ = static_cast<std::byte *>(memory);
  arena.size_ = bytes;
  return arena;
}

Arena::Arena(Arena &&other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

Arena &Arena::operator=(Arena &&other) noexcept {
  if (this != &other) {
    release(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Arena::~Arena() { release(data_, size_); }

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
