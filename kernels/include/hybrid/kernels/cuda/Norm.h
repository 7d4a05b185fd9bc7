// RMSNorm on CUDA, optionally fused with the residual add that feeds it (the plan's RmsNorm and
// AddRmsNorm kernels): sum = x + addend, y = sum / sqrt(mean(sum^2) + eps) * weight, per row, in
// fp32 with the reference's order (normalise, then multiply by the weight). CUDA-free header.
#pragma once

#include <cstdint>

namespace hybrid::kernels::cuda {

struct RmsNormParams {
  int64_t rows = 0;
  int64_t dim = 0;
  float epsilon = 1e-6f;
  const float *x = nullptr;      // [rows, dim]
  const float *addend = nullptr; // [rows, dim] or null (plain RMSNorm)
  // [rows, dim] or null; with an addend, sum = x + (addend + secondAddend): an add folded in
  // (the plan's three-input AddRmsNorm), its sum first.
  const float *secondAddend = nullptr;
  float *sum = nullptr;          // [rows, dim]: x + addend, written when addend is set; may be x
  const float *weight = nullptr; // [dim] or null (no scale)
  float *y = nullptr;            // [rows, dim]; may alias x or sum
};

// Launches on `stream`; 0 or the CUDA error code (cudaErrorInvalidValue for bad shapes).
int launchRmsNorm(const RmsNormParams &params, void *stream);

// LayerNorm with bias (the DSA indexer's key norm, ref::layerNorm): y = (x - mean) / sqrt(var +
// eps) * weight + bias per row, the biased variance, fp32. y may alias x.
struct LayerNormParams {
  int64_t rows = 0;
  int64_t dim = 0;
  float epsilon = 1e-6f;
  const float *x = nullptr;      // [rows, dim]
  const float *weight = nullptr; // [dim]
  const float *bias = nullptr;   // [dim]
  float *y = nullptr;            // [rows, dim]
};
int launchLayerNorm(const LayerNormParams &params, void *stream);

} // namespace hybrid::kernels::cuda
