// Growing a buffer to a size read from a payload or a file: the one allocation in this library
// that can plausibly fail. It is reported as a Status, so std::bad_alloc never reaches a caller
// built without exceptions.
#pragma once

#include "hybrid/runtime/Status.h"

#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace hybrid::cache::detail {

inline Status resizeBuffer(std::vector<std::byte> &buffer, uint64_t size,
                           std::string_view purpose) {
  try {
    buffer.resize(size);
  } catch (const std::bad_alloc &) {
    return Status::error("out of memory allocating " + std::to_string(size) + " bytes for " +
                         std::string(purpose));
  } catch (const std::length_error &) {
    return Status::error("cannot allocate " + std::to_string(size) + " bytes for " +
                         std::string(purpose));
  }
  return Status::ok();
}

} // namespace hybrid::cache::detail
