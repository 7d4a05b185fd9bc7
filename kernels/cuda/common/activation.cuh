// The gated MLP activations in device code (Activation.h), shared by the elementwise and MoE
// kernels. SiLU keeps the form each kernel used before (g * (1 / (1 + e^-g)) * u).
#pragma once

#include "hybrid/kernels/cuda/Activation.h"

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {

__device__ inline float gatedActivationValue(const GatedActivation &a, float g, float u) {
  const float sigmoid = 1.0f / (1.0f + expf(-g));
  if (a.kind == GatedActivation::Kind::Silu)
    return g * sigmoid * u;
  const float capped = a.linearBeta > 0.0f ? a.linearBeta * tanhf(u / a.linearBeta) : u;
  return a.beta * tanhf(g / a.beta) * sigmoid * capped;
}

} // namespace hybrid::kernels::cuda
