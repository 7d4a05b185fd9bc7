// Shared by the cuBLASLt linear paths (bf16 and FP8 weights): error codes, pointer alignment and
// the cached per-shape problem description.
#pragma once

#include "hybrid/kernels/cuda/Linear.h"

#include <algorithm>
#include <cstdint>
#include <cublasLt.h>

namespace hybrid::kernels::cuda {

// LinearContext codes: a cudaError_t, or kCublasBase + a cublasStatus_t.
inline constexpr int kCublasBase = 1000;

inline int cublasCode(cublasStatus_t status) {
  return status == CUBLAS_STATUS_SUCCESS ? 0 : kCublasBase + int(status);
}

// The largest power of two (up to 256) dividing the address: what cuBLASLt may assume.
inline int alignmentOf(const void *pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  int alignment = 256;
  while (alignment > 1 && address % alignment != 0)
    alignment /= 2;
  return alignment;
}

// The alignment an algorithm is chosen for: with batch invariance at most 16 bytes, so that a
// row's algorithm does not depend on where the call's buffers happen to start (a decode step's
// and a verification pass's arenas place a value at different offsets).
inline int keyAlignment(const void *pointer, bool batchInvariant) {
  const int alignment = alignmentOf(pointer);
  return batchInvariant && alignment > 16 ? 16 : alignment;
}

// Batch invariance's calls of at most `partRows` rows: `part` on each consecutive slice of p's
// rows (x and y advanced by their row strides), stopping at the first error code.
template <typename Params, typename Part>
int inRowParts(const Params &p, int64_t partRows, int64_t xStride, int64_t yStride, Part part) {
  for (int64_t first = 0; first < p.rows; first += partRows) {
    Params slice = p;
    slice.rows = std::min(partRows, p.rows - first);
    slice.x = p.x + first * xStride;
    slice.y = p.y + first * yStride;
    if (int code = part(slice))
      return code;
  }
  return 0;
}

struct LinearContext::Algorithm {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t weight = nullptr, x = nullptr, y = nullptr;
  cublasLtMatmulAlgo_t algorithm{};
  ~Algorithm() {
    if (y)
      cublasLtMatrixLayoutDestroy(y);
    if (x)
      cublasLtMatrixLayoutDestroy(x);
    if (weight)
      cublasLtMatrixLayoutDestroy(weight);
    if (operation)
      cublasLtMatmulDescDestroy(operation);
  }
};

} // namespace hybrid::kernels::cuda
