// The decode-size linear layer's benchmark (hybrid-bench gemv): a model's decode GEMVs at 1 to 8
// rows on each of the kernel's forms (scalar, tensor cores), replayed from a CUDA graph over
// enough distinct weight matrices that none is read from L2, with the weight bytes a call must
// read. For choosing where the tensor-core form takes over (kGemvTensorCoreMinRows) and tuning
// it. CUDA-free header.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hybrid::kernels::cuda {

struct GemvBenchShape {
  int64_t in = 0, out = 0;
};

struct GemvBenchResult {
  int32_t rows = 0;
  int64_t in = 0, out = 0;
  std::string form;              // "scalar", "tensor-cores", "fp8-gemv" or "fp8-cublaslt"
  bool automatic = false;        // the form a call of these rows takes by default
  int32_t layers = 0;            // distinct weight matrices a timed graph runs through
  double microseconds = 0;       // one call
  double weightBytes = 0;        // one call's weights (bf16, or FP8 codes and scales)
  double terabytesPerSecond = 0; // weightBytes / microseconds
  double copyShare = 0;          // of the H200's measured copy bandwidth
};

// Each shape at each row count on every form it takes (the tensor-core form needs in > 256 and
// a multiple of 32), fp32 activations as the runtime's default (split-input) policy multiplies
// them; `layers` 0 picks enough matrices for 256 MB. Empty with `error` set on failure.
std::vector<GemvBenchResult> benchGemvDecode(const std::vector<int32_t> &rows,
                                             const std::vector<GemvBenchShape> &shapes,
                                             int32_t layers, int32_t iterations,
                                             std::string &error);

// FP8 block-scaled layers (DeepSeek-V3.2's projections: E4M3 weights with 128 x 128 block scales)
// at each row count as the runtime runs them, the activations' quantizer included: form
// "fp8-gemv" (the decode kernel, LinearContext's default at 1-8 rows) and "fp8-cublaslt" (its
// padded GEMM, split-K and copy-out: setDecodeKernel(false)). Weight bytes are the codes and
// scales; in must be a multiple of 128 for the decode kernel (others get only cuBLASLt's rows).
std::vector<GemvBenchResult> benchFp8GemvDecode(const std::vector<int32_t> &rows,
                                                const std::vector<GemvBenchShape> &shapes,
                                                int32_t layers, int32_t iterations,
                                                std::string &error);

} // namespace hybrid::kernels::cuda
