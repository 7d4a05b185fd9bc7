// Block Attention Residuals: the depth mix AR of MODEL_SPEC §6.2.
#pragma once

#include <cstdint>
#include <span>

namespace hybrid::kernels::ref {

// For every token t, over the candidates V_m (each [numTokens, dim]: completed blocks, then the
// running partial sum):
//   K_m = normWeight ⊙ V_m[t] / sqrt(mean(V_m[t]²) + eps),  score_m = projWeight · K_m,
//   out[t] = Σ_m softmax_m(score)_m · V_m[t].
// normWeight, projWeight [dim] (proj is the [1, dim] checkpoint tensor). out must not alias a
// candidate.
void attnResMix(std::span<const float *const> candidates, int64_t numTokens, int64_t dim,
                std::span<const float> normWeight, std::span<const float> projWeight, float eps,
                std::span<float> out);

} // namespace hybrid::kernels::ref
