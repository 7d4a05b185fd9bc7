// Row-wise normalisations (MODEL_SPEC §1.1, §2.2 step 7, §4.2). All compute in fp32; y may alias x.
#pragma once

#include <cstdint>
#include <span>

namespace hybrid::kernels::ref {

// y = w ⊙ x / sqrt(mean(x²) + eps) per row of `dim` values. An empty weight means no weight (all
// ones).
void rmsNorm(std::span<const float> x, std::span<const float> weight, std::span<float> y,
             int64_t rows, int64_t dim, float eps);

// y = (x − mean(x)) / sqrt(var(x) + eps) ⊙ w + b per row (biased variance, as torch.nn.LayerNorm).
void layerNorm(std::span<const float> x, std::span<const float> weight, std::span<const float> bias,
               std::span<float> y, int64_t rows, int64_t dim, float eps);

enum class GateActivation { Sigmoid, Silu };

// KDA output norm: y = RMSNorm_w(x) ⊙ act(gate), per row of `dim` values (one row per token and
// head; w [dim] shared by all heads). Kimi-Linear uses the sigmoid gate.
void gatedRmsNorm(std::span<const float> x, std::span<const float> gate,
                  std::span<const float> weight, std::span<float> y, int64_t rows, int64_t dim,
                  float eps, GateActivation activation = GateActivation::Sigmoid);

// x ← x / sqrt(Σ x² + eps) per row: eps is added to the sum of squares (fla l2norm), not a clamp.
void l2NormalizeRows(std::span<float> x, int64_t rows, int64_t dim, float eps = 1e-6f);

} // namespace hybrid::kernels::ref
