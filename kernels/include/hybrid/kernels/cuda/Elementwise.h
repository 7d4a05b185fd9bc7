// Small CUDA kernels a model's plan needs between the big ones: the embedding gather, the
// residual add, SwiGLU's silu(gate) * up, an output gate and the MXFP8 round trip of an
// activation. fp32 activations; tables in bf16 or fp32 as the weight archive stores them. CUDA-free header. Every launch returns 0 or the CUDA error code
// (cudaErrorInvalidValue for bad shapes or missing pointers).
#pragma once

#include "hybrid/kernels/cuda/Activation.h"

#include <cstdint>

namespace hybrid::kernels::cuda {

enum class TableType : int32_t { F32, BF16 };
// How a weight matrix the CUDA-core kernels read is stored (Fp8Block: E4M3 codes with one fp32
// scale per 128 x 128 block, where the kernel says it takes them).
enum class WeightType { F32, BF16, Fp8Block };

// out[t] = table[ids[t]] for t < rows; the ids are device int64 and must be in [0, vocab) (the
// caller checks them on the host, where it has them, and names the bad one).
int launchEmbed(const int64_t *ids, int64_t rows, const void *table, TableType type,
                int64_t vocab, int64_t width, float *out, void *stream);

// y = a + b over n elements (y may alias a or b).
int launchAdd(const float *a, const float *b, float *y, int64_t n, void *stream);

// out[r, i] = silu(gate[r, i]) * up[r, i] for i < width; gate and up rows have their own strides
// (they may be the two halves of one [rows, 2 * width] projection).
int launchSiluMul(const float *gate, const float *up, int64_t rows, int64_t width,
                  int64_t inputStride, float *out, void *stream);
// The same for any gated activation (SiLU goes to launchSiluMul, bit for bit).
int launchGatedActivation(const float *gate, const float *up, int64_t rows, int64_t width,
                          int64_t inputStride, float *out, const GatedActivation &activation,
                          void *stream);

// x[i] *= sigmoid(gate[i]) over n elements (an attention output gate).
int launchSigmoidGate(float *x, const float *gate, int64_t n, void *stream);

// In place: each 32-value block of x [n] replaced by what its MXFP8 encoding (E4M3 elements, one
// E8M0 scale by the RoundUp rule) decodes to, bit for bit ref::quantizeMxfp8 then
// dequantizeMxfp8 (a block with a non-finite value becomes NaNs). n % 32 == 0.
int launchMxfp8RoundTrip(float *x, int64_t n, void *stream);

} // namespace hybrid::kernels::cuda
