// Bit-identity checks shared by the kernel and end-to-end test trees (header only, CUDA-free).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

namespace hybrid {

// Floats of a and b whose bits differ (a size mismatch counts as every float of the longer):
// what a bit-identity check expects to be 0.
inline size_t differingBits(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size())
    return std::max(a.size(), b.size());
  size_t count = 0;
  for (size_t i = 0; i < a.size(); ++i)
    count += std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i]);
  return count;
}

} // namespace hybrid
