// Random inputs of one KDA decode step (Kimi's value ranges, a 4-wide conv) for the decode
// benchmark and the tuner. `make(count, scale[, offset])` returns device floats it filled.
#pragma once

#include "hybrid/kernels/cuda/KdaDecode.h"

#include <cstddef>
#include <cstdint>

namespace hybrid::kernels::cuda::bench {

inline constexpr int32_t kDecodeConvKernel = 4;

// Everything of `p` but the states (the caller's: its state type and layout): shapes, the step's
// projections, gates and the layer's weights.
template <typename Make>
void randomDecodeInputs(KdaDecodeParams &p, int32_t batch, int32_t heads, int32_t headDim,
                        Make &&make) {
  const size_t P = size_t(heads) * size_t(headDim), W = kDecodeConvKernel;
  p.batch = batch;
  p.heads = heads;
  p.headDim = headDim;
  p.convKernel = kDecodeConvKernel;
  p.qkv = make(size_t(batch) * 3 * P, 1.0f);
  p.weights.convWeight = make(3 * P * W, 0.5f);
  p.forget = make(size_t(batch) * P, 1.0f);
  p.weights.aLog = make(size_t(heads), 0.3f, 0.5f);
  p.weights.dtBias = make(P, 0.5f);
  p.betaLogits = make(size_t(batch) * heads, 1.0f);
  p.outputGate = make(size_t(batch) * P, 1.0f);
  p.weights.normWeight = make(size_t(headDim), 0.1f, 1.0f);
}

} // namespace hybrid::kernels::cuda::bench
