#include "hybrid/kernels/ref/Norm.h"

#include "hybrid/kernels/ref/Math.h"

#include <cassert>
#include <cmath>

namespace hybrid::kernels::ref {
namespace {

float inverseRms(const float *row, int64_t dim, float eps) {
  const float meanSquare = dot(row, row, dim) / static_cast<float>(dim);
  return 1.0f / std::sqrt(meanSquare + eps);
}

} // namespace

void rmsNorm(std::span<const float> x, std::span<const float> weight, std::span<float> y,
             int64_t rows, int64_t dim, float eps) {
  assert(weight.empty() || static_cast<int64_t>(weight.size()) == dim);
  for (int64_t r = 0; r < rows; ++r) {
    const float *in = x.data() + r * dim;
    float *out = y.data() + r * dim;
    const float scale = inverseRms(in, dim, eps);
    // Same order as the references: normalise first, then multiply by the weight.
    for (int64_t i = 0; i < dim; ++i) {
      const float normalised = in[i] * scale;
      out[i] = weight.empty() ? normalised : weight[i] * normalised;
    }
  }
}

void layerNorm(std::span<const float> x, std::span<const float> weight, std::span<const float> bias,
               std::span<float> y, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *in = x.data() + r * dim;
    float *out = y.data() + r * dim;
    float mean = 0.0f;
    for (int64_t i = 0; i < dim; ++i)
      mean += in[i];
    mean /= static_cast<float>(dim);
    float variance = 0.0f;
    for (int64_t i = 0; i < dim; ++i)
      variance += (in[i] - mean) * (in[i] - mean);
    variance /= static_cast<float>(dim);
    const float scale = 1.0f / std::sqrt(variance + eps);
    for (int64_t i = 0; i < dim; ++i)
      out[i] = (in[i] - mean) * scale * weight[i] + bias[i];
  }
}

void gatedRmsNorm(std::span<const float> x, std::span<const float> gate,
                  std::span<const float> weight, std::span<float> y, int64_t rows, int64_t dim,
                  float eps, GateActivation activation) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *in = x.data() + r * dim;
    const float *gateRow = gate.data() + r * dim;
    float *out = y.data() + r * dim;
    const float scale = inverseRms(in, dim, eps);
    for (int64_t i = 0; i < dim; ++i) {
      const float gated =
          activation == GateActivation::Sigmoid ? sigmoid(gateRow[i]) : silu(gateRow[i]);
      out[i] = weight[i] * (in[i] * scale) * gated;
    }
  }
}

void l2NormalizeRows(std::span<float> x, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float *row = x.data() + r * dim;
    const float scale = 1.0f / std::sqrt(dot(row, row, dim) + eps);
    for (int64_t i = 0; i < dim; ++i)
      row[i] *= scale;
  }
}

} // namespace hybrid::kernels::ref
