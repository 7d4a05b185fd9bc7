// Linear layers at decode row counts (1 to kGemvMaxRows rows) without cuBLASLt: one kernel that
// streams the bf16 weight once at close to HBM bandwidth and multiplies it by the fp32
// activations read directly, so no rounding kernel before it and no split-sum kernel after it
// (cuBLASLt at 1-8 rows reached about a third of HBM bandwidth on the H200, and each linear
// layer cost three launches). Also batched: grid.y walks `batch` independent problems whose
// pointers advance by fixed strides (MLA's per-head W_UV expansion). And grouped: one launch
// runs up to kGemvMaxGroup independent problems of the same row count (a layer's projections
// of one input: KDA's q/k/v/forget/gate/beta), the grid spanning their outputs one after the
// other; each block computes exactly what it would in the problem's own launch, so the outputs
// are bit-identical to one launch per problem, without each launch's latency.
//
// Narrow inputs (in <= kGemvNarrowMaxIn, KDA's low-rank f_b / g_b at k = 128) take a form where
// a warp owns its outputs, instead of a block whose 256 threads would hold at most 32 chunks
// (at k = 128, 240 of them idle): the same chunk per lane and the same shuffle tree, so the
// same bits as the block form. A launch takes it only when every member is narrow.
//
// Numerics: each product is x * w in fp32 with x either exact (fp32, `roundInputToBf16` false)
// or rounded to bf16 first (the cuBLASLt path's bf16 inputs); sums in fp32 in a fixed order (a
// thread's chunks in k order, then a shuffle tree, then the warps in order), so the result
// does not depend on timing. Wide inputs (in > kGemvNarrowMaxIn, a multiple of 32) of calls of
// kGemvTensorCoreMinRows or more rows run on tensor cores instead: fp32 x as three bf16 terms
// (or bf16(x)), products exact, fp32 MMA accumulation in a fixed order, then the warps in
// order. Within either form a row's result does not depend on the call's rows. Internal to the
// kernels library.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hybrid::kernels::cuda {

inline constexpr int32_t kGemvMaxRows = 8;
inline constexpr int32_t kGemvMaxGroup = 8;
inline constexpr int64_t kGemvNarrowMaxIn = 8 * 32; // one 16-byte chunk a lane
// Calls of at least this many rows run their wide layers on tensor cores. Fewer rows stay on the
// scalar form: at 1 row the tensor-core form ran 1.6x slower (2 blocks an SM at 128 registers,
// 16 outputs a block: latency-bound), and below 6 rows a batch-1 decode step and its
// verification passes of up to 4 drafts (5 rows) keep the same sums, so speculation's outputs
// stay the plain decode's (docs/performance.md, 2026-12-01).
inline constexpr int32_t kGemvTensorCoreMinRows = 6;

// Which form multiplies a wide layer: Auto follows kGemvTensorCoreMinRows; the others force one
// (the benchmark compares them at every row count; TensorCores still needs in > 256, % 32).
enum class GemvForm : int32_t { Auto, Scalar, TensorCores };

struct GemvParams {
  int32_t rows = 0; // 1..kGemvMaxRows
  int64_t in = 0;   // a multiple of 8
  int64_t out = 0;
  const float *x = nullptr; // [rows, in], row stride xStride (a multiple of 4, 16-byte aligned)
  int64_t xStride = 0;
  const void *weight = nullptr; // bf16 [out, in], row stride weightStride (a multiple of 8)
  int64_t weightStride = 0;
  float *y = nullptr; // [rows, out], row stride yStride
  int64_t yStride = 0;
  bool accumulate = false;       // y += x W^T
  bool roundInputToBf16 = false; // multiply bf16(x) instead of x
  int32_t batch = 1;             // problems; pointers of problem b advance by b * these
  int64_t xBatchStride = 0, weightBatchStride = 0, yBatchStride = 0;
  GemvForm form = GemvForm::Auto;
};

// Whether the kernel takes these shapes, strides and alignments (else use the general path).
bool gemvSupports(const GemvParams &params);
// Whether a launch of these params multiplies on tensor cores (its form, rows and width).
bool gemvOnTensorCores(const GemvParams &params);
// 0 or a cudaError_t; cudaErrorInvalidValue when !gemvSupports(params).
int launchGemv(const GemvParams &params, cudaStream_t stream);

// `count` (1..kGemvMaxGroup) problems in one launch: each must pass gemvSupports, and all share
// rows, roundInputToBf16 and batch. They run in no particular order, so no member may read what
// another writes. 0 or a cudaError_t; cudaErrorInvalidValue when !gemvGroupSupports.
bool gemvGroupSupports(const GemvParams *members, int32_t count);
int launchGemvGroup(const GemvParams *members, int32_t count, cudaStream_t stream);

} // namespace hybrid::kernels::cuda
