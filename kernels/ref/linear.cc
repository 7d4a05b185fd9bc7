#include "hybrid/kernels/ref/Linear.h"

#include "hybrid/kernels/ref/Math.h"
#include "hybrid/kernels/ref/Parallel.h"

#include <algorithm>
#include <cassert>
#include <vector>

namespace hybrid::kernels::ref {

void linear(std::span<const float> x, std::span<const float> weight, std::span<float> y,
            int64_t rows, int64_t inFeatures, int64_t outFeatures) {
  assert(static_cast<int64_t>(x.size()) >= rows * inFeatures);
  assert(static_cast<int64_t>(weight.size()) >= outFeatures * inFeatures);
  assert(static_cast<int64_t>(y.size()) >= rows * outFeatures);
  // Split over output features: works for one decode token as well as for a prefill block, and
  // each thread streams its own slice of W once per row.
  parallelFor(
      outFeatures,
      [&](int64_t begin, int64_t end) {
        for (int64_t row = 0; row < rows; ++row) {
          const float *xRow = x.data() + row * inFeatures;
          float *yRow = y.data() + row * outFeatures;
          for (int64_t o = begin; o < end; ++o)
            yRow[o] = dot(xRow, weight.data() + o * inFeatures, inFeatures);
        }
      },
      /*minGrain=*/std::max<int64_t>(1, 16384 / std::max<int64_t>(1, rows * inFeatures)));
}

void linearFp8Activations(std::span<const float> x, std::span<const float> weight,
                          std::span<float> y, int64_t rows, int64_t inFeatures,
                          int64_t outFeatures, Fp8ScaleRule rule) {
  assert(static_cast<int64_t>(x.size()) >= rows * inFeatures);
  const size_t count = static_cast<size_t>(rows * inFeatures);
  std::vector<uint8_t> codes(count);
  std::vector<float> scales(static_cast<size_t>(rows * fp8TileCount(inFeatures))), values(count);
  [[maybe_unused]] const bool sized =
      quantizeFp8Tiles(x.first(count), rows, inFeatures, kFp8TileSize, rule, codes, scales) &&
      dequantizeFp8Tiles(codes, scales, rows, inFeatures, kFp8TileSize, values);
  assert(sized);
  linear(values, weight, y, rows, inFeatures, outFeatures);
}

} // namespace hybrid::kernels::ref
