// Dense projection in the checkpoint's convention (MODEL_SPEC notation: row vectors).
#pragma once

#include "hybrid/kernels/ref/Quant.h"

#include <cstdint>
#include <span>

namespace hybrid::kernels::ref {

// y[rows, outFeatures] = x[rows, inFeatures] · Wᵀ, with W [outFeatures, inFeatures] row-major
// exactly as PyTorch nn.Linear stores it in safetensors. fp32 accumulation. y must not alias x.
void linear(std::span<const float> x, std::span<const float> weight, std::span<float> y,
            int64_t rows, int64_t inFeatures, int64_t outFeatures);

// A linear layer with FP8 block-scaled weights as DeepSeek's reference runs it (MODEL_SPEC 8.1:
// act_quant, then fp8_gemm), on the weight already dequantized: x is quantized per (row,
// kFp8TileSize channels) to E4M3 codes and a scale chosen by `rule`, dequantized, and multiplied
// by linear(). That is fp8_gemm's sum over k blocks of s_x s_W sum_k codes_x codes_W, summed in
// fp32 in linear's order instead of per-block promotion.
void linearFp8Activations(std::span<const float> x, std::span<const float> weight,
                          std::span<float> y, int64_t rows, int64_t inFeatures,
                          int64_t outFeatures, Fp8ScaleRule rule);

} // namespace hybrid::kernels::ref
