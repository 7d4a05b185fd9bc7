// Scalar helpers shared by the reference kernels. Header-only so they inline into the loops.
#pragma once

#include <cmath>
#include <cstdint>

namespace hybrid::kernels::ref {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

inline float silu(float x) { return x * sigmoid(x); }

// PyTorch's softplus (beta 1, threshold 20): returns x itself above the threshold.
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// fp32 dot product with eight independent accumulators: vectorisable without -ffast-math and a
// little more accurate than one running sum; the result does not depend on threading.
inline float dot(const float *a, const float *b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int lane = 0; lane < 8; ++lane)
      lanes[lane] += a[i + lane] * b[i + lane];
  float tail = 0.0f;
  for (; i < n; ++i)
    tail += a[i] * b[i];
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
         ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + tail;
}

} // namespace hybrid::kernels::ref
