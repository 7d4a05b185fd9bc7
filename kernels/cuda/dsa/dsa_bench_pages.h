// Random DSA cache pages for the benchmarks and the tuner (host side): finite codes, fixed
// power-of-two scales, so any kernel reading them does bounded, representative work.
#pragma once

#include "hybrid/kernels/cuda/DsaIndexer.h"
#include "hybrid/kernels/cuda/SparseMla.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace hybrid::kernels::cuda::bench {

// One random E4M3 code, never a NaN.
inline uint8_t randomE4m3(std::mt19937 &rng) {
  return uint8_t(rng() % 0x7E) | uint8_t((rng() & 1u) << 7);
}

// One random index-key page of `pageTokens` keys of `type`: E4M3 codes with unit scales, or
// normal fp32 values.
inline std::vector<uint8_t> randomIndexKeyPage(IndexKeyType type, int32_t headDim,
                                               int32_t pageTokens, std::mt19937 &rng) {
  std::vector<uint8_t> page(size_t(indexerPageBytes(type, pageTokens, headDim)));
  if (type == IndexKeyType::F32) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto *values = reinterpret_cast<float *>(page.data());
    for (size_t i = 0; i < page.size() / 4; ++i)
      values[i] = normal(rng);
    return page;
  }
  const size_t codes = size_t(pageTokens) * headDim;
  for (size_t i = 0; i < codes; ++i)
    page[i] = randomE4m3(rng);
  if (type == IndexKeyType::Mxfp8) {
    std::fill(page.begin() + codes, page.end(), uint8_t(127)); // E8M0 1.0
  } else {
    auto *scales = reinterpret_cast<float *>(page.data() + codes);
    std::fill(scales, scales + pageTokens, 1.0f);
  }
  return page;
}

// One random page of `pageTokens` latent rows: E4M3 codes, a 1/64 scale per 128 codes, bf16 rope
// values around 0.01.
inline std::vector<uint8_t> randomLatentPage(int32_t latent, int32_t rope, int32_t pageTokens,
                                             std::mt19937 &rng) {
  const int64_t rowBytes = sparseMlaRowBytes(latent, rope);
  const int32_t scaleTiles = (latent + 127) / 128;
  std::vector<uint8_t> page(size_t(pageTokens * rowBytes));
  for (int32_t t = 0; t < pageTokens; ++t) {
    uint8_t *row = page.data() + t * rowBytes;
    for (int32_t i = 0; i < latent; ++i)
      row[i] = randomE4m3(rng);
    const float scale = 1.0f / 64;
    for (int32_t s = 0; s < scaleTiles; ++s)
      std::memcpy(row + latent + 4 * s, &scale, 4);
    for (int32_t i = 0; i < rope; ++i) {
      const uint16_t bits = uint16_t(0x3C00u + rng() % 0x200u);
      std::memcpy(row + latent + 4 * scaleTiles + 2 * i, &bits, 2);
    }
  }
  return page;
}

} // namespace hybrid::kernels::cuda::bench
