// Synthetic weights on the host (SyntheticWeights.h): every stored element from its own position,
// in parallel chunks, rounded to the storage type with the reference quantizers.
#include "hybrid/kernels/SyntheticWeights.h"

#include "hybrid/kernels/ref/Parallel.h"
#include "hybrid/kernels/ref/Quant.h"

#include <cstring>

namespace hybrid::kernels::ref {

void fillSynthetic(const SyntheticFill &fill, void *out) {
  auto *bytes = static_cast<unsigned char *>(out);
  parallelFor(
      fill.storedElements,
      [&](int64_t begin, int64_t end) {
        for (int64_t stored = begin; stored < end; ++stored) {
          const int64_t element = syntheticLogicalIndex(fill, stored);
          const float value = element < 0 ? 0.0f : syntheticValue(fill, element);
          switch (fill.storage) {
          case SyntheticStorage::F32:
            std::memcpy(bytes + 4 * stored, &value, 4);
            break;
          case SyntheticStorage::BF16: {
            const uint16_t bits = floatToBf16(value);
            std::memcpy(bytes + 2 * stored, &bits, 2);
            break;
          }
          case SyntheticStorage::F8E4M3:
            bytes[stored] = floatToE4M3(value);
            break;
          }
        }
      },
      /*minGrain=*/int64_t{1} << 16);
}

} // namespace hybrid::kernels::ref
