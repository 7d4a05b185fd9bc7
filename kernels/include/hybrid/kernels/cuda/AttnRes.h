// AttnRes on CUDA (MODEL_SPEC 6, issue 7): attention over earlier layers' outputs instead of a
// residual add. Per token, each candidate (the completed blocks, then the partial sum) gets the
// score proj . (norm_weight * RMSNorm(candidate)); the mix is the softmax-weighted sum of the
// candidates, as ref::attnResMix; optionally the RMSNorm that reads the mix, in the same launch
// (the plan's AttnResRmsNorm). fp32, the reference's arithmetic up to summation order.
// CUDA-free header; 0 or a cudaError_t (cudaErrorInvalidValue for a bad shape or pointer).
#pragma once

#include <cstdint>

namespace hybrid::kernels::cuda {

inline constexpr int kAttnResMaxCandidates = 64;

struct AttnResParams {
  int32_t tokens = 0;
  int32_t dim = 0;
  int32_t candidates = 0; // 1..kAttnResMaxCandidates
  const float *values[kAttnResMaxCandidates] = {}; // each [tokens, dim], in the mix's order
  const float *normWeight = nullptr;               // [dim]
  const float *projWeight = nullptr;               // [dim]
  float epsilon = 1e-6f;
  float *mixed = nullptr; // [tokens, dim]
  // The fused RMSNorm of the mix (null: none).
  const float *outputNormWeight = nullptr; // [dim]
  float outputEpsilon = 1e-6f;
  float *normed = nullptr; // [tokens, dim]
};

int launchAttnResMix(const AttnResParams &params, void *stream);

} // namespace hybrid::kernels::cuda
