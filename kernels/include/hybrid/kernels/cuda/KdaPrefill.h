// KDA prefill on CUDA (sm_90a), token recurrence over a varlen batch: for each sequence, its tokens
// in order through the short conv (with its state), SiLU, L2 norms, gate, beta, the delta rule on
// the fp32 state (read once before the first token, written once after the last) and the gated
// RMSNorm. The exact per-token math of the decode step (KdaDecode.h), so prefill and decode compose.
// This is the baseline prefill: one block per (head, sequence) walks the tokens; the chunked form
// is the fast path still to come (docs/cuda-kernels.md). CUDA-free header.
#pragma once

#include "hybrid/kernels/cuda/KdaDecode.h"

#include <cstdint>

namespace hybrid::kernels::cuda {

struct KdaPrefillParams {
  int32_t sequences = 0;
  int32_t heads = 0;
  int32_t headDim = 0;      // K = V: 64 or 128
  int32_t convKernel = 4;   // W, 1..kKdaMaxConvKernel (KdaDecode.h)
  KdaLayerWeights weights;
  const int32_t *cuSeqlens = nullptr; // device [sequences + 1], non-decreasing, cuSeqlens[0] = 0
  // Per token t (rows of the packed batch), fp32, channel c = head * headDim + i:
  const float *qkv = nullptr;        // [tokens, 3, heads * headDim]
  const float *forget = nullptr;     // [tokens, heads * headDim]
  const float *betaLogits = nullptr; // [tokens, heads]
  const float *outputGate = nullptr; // [tokens, heads * headDim]
  // Per sequence, read as the state before its first token and overwritten with the state after
  // its last (untouched for an empty sequence):
  float *convState = nullptr;        // [sequences, 3, W - 1, heads * headDim]
  float *state = nullptr;            // [sequences, heads, K, V]
  float *out = nullptr;              // [tokens, heads * headDim]
};

// Launches on `stream`; 0 or the CUDA error code. Unsupported headDim or convKernel, or no
// sequences, returns cudaErrorInvalidValue (1).
int launchKdaRecurrentPrefill(const KdaPrefillParams &params, void *stream);

} // namespace hybrid::kernels::cuda
