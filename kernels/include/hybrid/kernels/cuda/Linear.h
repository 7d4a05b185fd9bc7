// Linear layers on CUDA through cuBLASLt: y[rows, out] = x[rows, in] W^T (+ y), with W the
// checkpoint's nn.Linear weight [out, in], row-major, in bf16 (the "BF16 projections" role of the
// quantization policy) and x, y the runtime's fp32 activations; products accumulate in fp32.
// x reaches the tensor cores either rounded to bf16 (8 significant bits), or split into
// hi = bf16(x) and lo = bf16(x - hi) (about 16 bits, close to the fp32 oracle): the two halves
// are stacked as 2 x rows rows of one GEMM, so the weights are still read once, and summed.
// CUDA-free header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>

namespace hybrid::kernels::cuda {

struct LinearParams {
  int64_t rows = 0; // tokens
  int64_t in = 0;   // K
  int64_t out = 0;  // N
  const float *x = nullptr;      // [rows, in], row stride xStride (>= in)
  int64_t xStride = 0;           // 0: in
  const void *weight = nullptr;  // bf16 [out, in] row-major, row stride weightStride (>= in)
  int64_t weightStride = 0;      // 0: in
  float *y = nullptr;            // [rows, out], row stride yStride (>= out)
  int64_t yStride = 0;           // 0: out
  bool accumulate = false;       // y += x W^T instead of y = x W^T
  void *xScratch = nullptr;      // bf16 [rows, in] ([2 rows, in] when split): x in bf16
  bool splitInput = false;       // x as hi + lo (see above)
  float *splitOutput = nullptr;  // split only: fp32 [2 rows, out] scratch for the two products
};

// Owns a cuBLASLt handle, its workspace and the algorithms chosen per shape. Not thread-safe;
// one per executor. Every call returns 0 or an error code: a cudaError_t, or 1000 + a
// cublasStatus_t for cuBLASLt failures (linearErrorText names both).
class LinearContext {
public:
  LinearContext() = default;
  ~LinearContext();
  LinearContext(const LinearContext &) = delete;
  LinearContext &operator=(const LinearContext &) = delete;

  int init(size_t workspaceBytes = size_t(32) << 20);
  // Launches on `stream` (a cudaStream_t). Shapes must be positive, strides at least the row
  // widths; an invalid shape or a missing pointer returns cudaErrorInvalidValue (1).
  int run(const LinearParams &params, void *stream);

private:
  struct Algorithm;
  // One cuBLASLt problem: shapes, strides and the alignment (bytes, up to 256) of each pointer,
  // which decides the algorithms allowed.
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int>;
  int algorithmFor(const Key &key, Algorithm *&algorithm);

  void *handle_ = nullptr;
  void *workspace_ = nullptr;
  size_t workspaceBytes_ = 0;
  std::map<Key, Algorithm *> algorithms_;
};

// The name of a code returned above: a CUDA error or a cuBLASLt status.
const char *linearErrorText(int code);

} // namespace hybrid::kernels::cuda
