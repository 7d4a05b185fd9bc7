// The activation of a gated MLP on the GPU (ref::GatedActivation is the definition): SwiGLU's
// silu(g) u, or Kimi K3's SiTU beta tanh(g / beta) sigmoid(g) u', with u' = linearBeta
// tanh(u / linearBeta), or u when linearBeta is 0. CUDA-free header.
#pragma once

namespace hybrid::kernels::cuda {

struct GatedActivation {
  enum class Kind { Silu, Situ };
  Kind kind = Kind::Silu;
  float beta = 0.0f;       // Situ: activation_situ_beta (> 0)
  float linearBeta = 0.0f; // Situ: activation_situ_linear_beta; 0: the linear half uncapped
};

// Whether the parameters are usable (Situ needs beta > 0 and linearBeta >= 0).
inline bool gatedActivationValid(const GatedActivation &a) {
  return a.kind == GatedActivation::Kind::Silu || (a.beta > 0.0f && a.linearBeta >= 0.0f);
}

} // namespace hybrid::kernels::cuda
