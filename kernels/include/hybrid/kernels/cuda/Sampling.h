// Token choice on the GPU (kernels/ref/Sampling.h is the definition): one block per row of
// logits reads the row where the model wrote it and leaves only the chosen id, so a decode step
// copies rows ids to the host instead of rows x vocab floats. Greedy is an argmax; sampling
// finds the top-k threshold by a radix select over the scaled logits, the top-p threshold by a
// bisection over the weights' bit patterns, and walks the ids in order with fp64 sums, as the
// reference does. CUDA-free header.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hybrid::kernels::cuda {

// One row's parameters (ref::SamplingParams with the uniform number already drawn).
struct SamplingRow {
  float temperature = 0.0f; // <= 0: greedy
  int32_t topK = 0;         // > 0: only the topK largest (ties kept)
  float topP = 1.0f;        // < 1: nucleus
  float uniform = 0.0f;     // in [0, 1)
};

struct SampleRowsParams {
  int32_t rows = 0;
  int64_t vocab = 0;
  const float *logits = nullptr;           // device [rows, logitsStride]
  int64_t logitsStride = 0;                // 0: vocab
  const SamplingRow *samplingRows = nullptr; // device [rows]
  int64_t *tokens = nullptr;               // device [rows]
  // Optional, sampleRowsWorkspaceBytes(rows, vocab) bytes (16-byte aligned): the argmax then
  // runs over many blocks a row (each a part of the row, its best written here) before the
  // row's block, instead of one block reading the whole row (19 us at batch 1 and Kimi's
  // vocabulary on the H200: one SM's worth of load latency). The same ids either way.
  void *workspace = nullptr;
};

// Bytes of SampleRowsParams::workspace for these rows.
size_t sampleRowsWorkspaceBytes(int64_t rows, int64_t vocab);

// 0 or a cudaError_t (cudaErrorInvalidValue for a bad shape or a missing pointer).
int launchSampleRows(const SampleRowsParams &params, void *stream);

} // namespace hybrid::kernels::cuda
