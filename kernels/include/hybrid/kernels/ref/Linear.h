// Dense projection in the checkpoint's convention (MODEL_SPEC notation: row vectors).
#pragma once

#include <cstdint>
#include <span>

namespace hybrid::kernels::ref {

// y[rows, outFeatures] = x[rows, inFeatures] · Wᵀ, with W [outFeatures, inFeatures] row-major
// exactly as PyTorch nn.Linear stores it in safetensors. fp32 accumulation. y must not alias x.
void linear(std::span<const float> x, std::span<const float> weight, std::span<float> y,
            int64_t rows, int64_t inFeatures, int64_t outFeatures);

} // namespace hybrid::kernels::ref
