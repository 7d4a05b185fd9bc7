// The FP8 block-scaled linear layer at decode rows (1 to kGemvMaxRows) without cuBLASLt, whose
// FP8 GEMMs run on 16 padded rows with a split-K reduction and a copy-out after them (DeepSeek-
// V3.2 on the H200: ~190 us of FP8 projections a layer at batch 1, about a quarter of HBM
// bandwidth). Reads the activation codes and scales quantizeFp8Activations wrote to the scratch
// (LinearFp8Params' layout) and writes y (or adds to it). Internal to the kernels library.
#pragma once

#include "hybrid/kernels/cuda/Linear.h"

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {

// Whether the kernel takes the problem: decode rows, in a multiple of 128 (whole scale tiles)
// and the 16-byte alignments runFp8 already requires.
bool fp8GemvSupports(const LinearFp8Params &params);
// 0 or a cudaError_t; cudaErrorInvalidValue when !fp8GemvSupports(params).
int launchFp8Gemv(const LinearFp8Params &params, cudaStream_t stream);

} // namespace hybrid::kernels::cuda
