// Linear layers through cuBLASLt (see Linear.h). Row-major y[rows, out] = x W^T is the
// column-major y^T[out, rows] = W^T' x^T: A = W viewed column-major [in, out] and transposed,
// B = x viewed column-major [in, rows], D = y viewed column-major [out, rows] (the "TN" GEMM).
#include "hybrid/kernels/cuda/Linear.h"
#include "cublaslt_support.cuh"
#include "gemv.cuh"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {
namespace {

// x [rows, in] (row stride) -> contiguous bf16, round to nearest even; with `split`, also the
// remainders x - bf16(x) in bf16 as rows [rows, 2 rows).
__global__ void roundRowsToBf16(const float *x, int64_t stride, int64_t rows, int64_t in,
                                bool split, __nv_bfloat16 *out) {
  const int64_t total = rows * in;
  for (int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; index < total;
       index += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = index / in, column = index % in;
    const float value = x[row * stride + column];
    const __nv_bfloat16 high = __float2bfloat16(value);
    out[index] = high;
    if (split)
      out[total + index] = __float2bfloat16(value - __bfloat162float(high));
  }
}

// y[r] = (accumulate ? y[r] : 0) + products[r] + products[rows + r]: the hi and lo halves.
__global__ void sumSplitProducts(const float *products, int64_t rows, int64_t out, float *y,
                                 int64_t yStride, bool accumulate) {
  const int64_t total = rows * out;
  for (int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; index < total;
       index += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = index / out, column = index % out;
    const float sum = products[index] + products[total + index];
    float &target = y[row * yStride + column];
    target = accumulate ? target + sum : sum;
  }
}

} // namespace

LinearContext::~LinearContext() {
  for (auto &[shape, algorithm] : algorithms_)
    delete algorithm;
  for (auto &[shape, algorithm] : fp8Algorithms_)
    delete algorithm;
  if (workspace_)
    cudaFree(workspace_);
  if (handle_)
    cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

int LinearContext::init(size_t workspaceBytes) {
  if (handle_)
    return 0;
  cublasLtHandle_t handle = nullptr;
  if (int code = cublasCode(cublasLtCreate(&handle)))
    return code;
  handle_ = handle;
  if (workspaceBytes > 0) {
    if (cudaError_t status = cudaMalloc(&workspace_, workspaceBytes))
      return int(status);
    workspaceBytes_ = workspaceBytes;
  }
  return 0;
}

int LinearContext::completeAlgorithm(Algorithm &algorithm, int operandType, const Key &key) {
  const auto [rows, in, out, weightStride, yStride, weightAlignment, xAlignment, yAlignment] = key;
  const auto type = static_cast<cudaDataType_t>(operandType);
  if (int code = cublasCode(
          cublasLtMatrixLayoutCreate(&algorithm.weight, type, in, out, weightStride)))
    return code;
  if (int code = cublasCode(cublasLtMatrixLayoutCreate(&algorithm.x, type, in, rows, in)))
    return code;
  if (int code =
          cublasCode(cublasLtMatrixLayoutCreate(&algorithm.y, CUDA_R_32F, out, rows, yStride)))
    return code;
  cublasLtMatmulPreference_t preference = nullptr;
  if (int code = cublasCode(cublasLtMatmulPreferenceCreate(&preference)))
    return code;
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                       &workspaceBytes_, sizeof workspaceBytes_);
  const uint32_t alignments[3] = {uint32_t(weightAlignment), uint32_t(xAlignment),
                                  uint32_t(yAlignment)};
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                       &alignments[0], sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                       &alignments[1], sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                       &alignments[2], sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                       &alignments[2], sizeof(uint32_t));
  // Batch-invariant: the heuristic asked about the reference row count, its pick checked for
  // this one.
  cublasLtMatrixLayout_t referenceX = nullptr, referenceY = nullptr;
  const bool reference = batchInvariantRows_ > 0 && batchInvariantRows_ != rows;
  if (reference) {
    if (int code = cublasCode(
            cublasLtMatrixLayoutCreate(&referenceX, type, in, batchInvariantRows_, in))) {
      cublasLtMatmulPreferenceDestroy(preference);
      return code;
    }
    if (int code = cublasCode(cublasLtMatrixLayoutCreate(&referenceY, CUDA_R_32F, out,
                                                          batchInvariantRows_, yStride))) {
      cublasLtMatrixLayoutDestroy(referenceX);
      cublasLtMatmulPreferenceDestroy(preference);
      return code;
    }
  }
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      static_cast<cublasLtHandle_t>(handle_), algorithm.operation, algorithm.weight,
      reference ? referenceX : algorithm.x, reference ? referenceY : algorithm.y,
      reference ? referenceY : algorithm.y, preference, 1, &heuristic, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  if (reference) {
    cublasLtMatrixLayoutDestroy(referenceY);
    cublasLtMatrixLayoutDestroy(referenceX);
  }
  if (status != CUBLAS_STATUS_SUCCESS)
    return cublasCode(status);
  if (found == 0)
    return kCublasBase + int(CUBLAS_STATUS_NOT_SUPPORTED);
  if (reference) {
    cublasLtMatmulHeuristicResult_t checked{};
    status = cublasLtMatmulAlgoCheck(static_cast<cublasLtHandle_t>(handle_), algorithm.operation,
                                     algorithm.weight, algorithm.x, algorithm.y, algorithm.y,
                                     &heuristic.algo, &checked);
    if (status != CUBLAS_STATUS_SUCCESS || checked.workspaceSize > workspaceBytes_)
      return kCublasBase + int(CUBLAS_STATUS_NOT_SUPPORTED);
  }
  algorithm.algorithm = heuristic.algo;
  return 0;
}

int LinearContext::algorithmFor(const Key &key, Algorithm *&result) {
  if (auto found = algorithms_.find(key); found != algorithms_.end()) {
    result = found->second;
    return 0;
  }
  auto *algorithm = new Algorithm;
  auto fail = [&](int code) {
    delete algorithm;
    return code;
  };
  if (int code = cublasCode(
          cublasLtMatmulDescCreate(&algorithm->operation, CUBLAS_COMPUTE_32F, CUDA_R_32F)))
    return fail(code);
  const cublasOperation_t transpose = CUBLAS_OP_T;
  if (int code = cublasCode(cublasLtMatmulDescSetAttribute(
          algorithm->operation, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose)))
    return fail(code);
  if (int code = completeAlgorithm(*algorithm, CUDA_R_16BF, key))
    return fail(code);
  algorithms_.emplace(key, algorithm);
  result = algorithm;
  return 0;
}

namespace {

static_assert(kLinearMaxGroup == kGemvMaxGroup, "a full group is one launch");

bool validLinear(const LinearParams &p) {
  const int64_t xStride = p.xStride ? p.xStride : p.in;
  const int64_t weightStride = p.weightStride ? p.weightStride : p.in;
  const int64_t yStride = p.yStride ? p.yStride : p.out;
  return p.rows > 0 && p.in > 0 && p.out > 0 && xStride >= p.in && weightStride >= p.in &&
         yStride >= p.out && p.x && p.weight && p.y && p.xScratch &&
         (!p.splitInput || p.splitOutput);
}

// The decode-size kernel's problem for p (valid), if p has decode rows and the kernel takes it:
// the fp32 x (split inputs approximate it) or bf16(x), instead of rounding + cuBLASLt + summing.
bool asGemv(const LinearParams &p, bool decodeKernel, GemvParams &gemv) {
  if (!decodeKernel || p.rows > kGemvMaxRows)
    return false;
  gemv.rows = int32_t(p.rows);
  gemv.in = p.in;
  gemv.out = p.out;
  gemv.x = p.x;
  gemv.xStride = p.xStride ? p.xStride : p.in;
  gemv.weight = p.weight;
  gemv.weightStride = p.weightStride ? p.weightStride : p.in;
  gemv.y = p.y;
  gemv.yStride = p.yStride ? p.yStride : p.out;
  gemv.accumulate = p.accumulate;
  gemv.roundInputToBf16 = !p.splitInput;
  return gemvSupports(gemv);
}

} // namespace

bool LinearContext::runsDecodeKernel(const LinearParams &params) const {
  GemvParams gemv;
  return validLinear(params) && asGemv(params, decodeKernel_, gemv);
}

int LinearContext::runGroup(const LinearParams *members, int count, void *stream) {
  if (!handle_ || !members || count < 1)
    return cudaErrorInvalidValue;
  for (int m = 0; m < count; ++m) // nothing launched unless every member is valid
    if (!validLinear(members[m]))
      return cudaErrorInvalidValue;
  GemvParams gemvs[kGemvMaxGroup];
  bool grouped = count <= kGemvMaxGroup;
  for (int m = 0; m < count && grouped; ++m)
    grouped = asGemv(members[m], decodeKernel_, gemvs[m]);
  if (grouped && gemvGroupSupports(gemvs, count))
    return launchGemvGroup(gemvs, count, static_cast<cudaStream_t>(stream));
  for (int m = 0; m < count; ++m)
    if (int code = run(members[m], stream))
      return code;
  return 0;
}

int LinearContext::run(const LinearParams &p, void *stream) {
  const int64_t xStride = p.xStride ? p.xStride : p.in;
  const int64_t weightStride = p.weightStride ? p.weightStride : p.in;
  const int64_t yStride = p.yStride ? p.yStride : p.out;
  if (!handle_ || !validLinear(p))
    return cudaErrorInvalidValue;
  if (batchInvariantRows_ > 0 && p.rows > batchInvariantRows_)
    // Calls of at most the reference rows: the algorithm picked for them (its split-K
    // workspace included) is then valid for every call, and a row's sums never see its call's
    // size.
    return inRowParts(p, batchInvariantRows_, xStride, yStride,
                      [&](const LinearParams &part) { return run(part, stream); });
  auto cudaStream = static_cast<cudaStream_t>(stream);
  if (GemvParams gemv; asGemv(p, decodeKernel_, gemv))
    return launchGemv(gemv, cudaStream);
  const int64_t total = p.rows * p.in;
  const int threads = 256;
  const int blocks = int(std::min<int64_t>((total + threads - 1) / threads, 4096));
  roundRowsToBf16<<<blocks, threads, 0, cudaStream>>>(
      p.x, xStride, p.rows, p.in, p.splitInput, static_cast<__nv_bfloat16 *>(p.xScratch));
  if (cudaError_t status = cudaGetLastError())
    return int(status);
  // Split: one GEMM over the stacked halves into the scratch, then their sum into y.
  const int64_t gemmRows = p.splitInput ? 2 * p.rows : p.rows;
  float *gemmY = p.splitInput ? p.splitOutput : p.y;
  const int64_t gemmYStride = p.splitInput ? p.out : yStride;
  Algorithm *algorithm = nullptr;
  if (int code = algorithmFor(Key{gemmRows, p.in, p.out, weightStride, gemmYStride,
                                  keyAlignment(p.weight, batchInvariantRows_ > 0),
                                  keyAlignment(p.xScratch, batchInvariantRows_ > 0),
                                  keyAlignment(gemmY, batchInvariantRows_ > 0)},
                              algorithm))
    return code;
  const float alpha = 1.0f, beta = p.accumulate && !p.splitInput ? 1.0f : 0.0f;
  if (int code = cublasCode(cublasLtMatmul(
          static_cast<cublasLtHandle_t>(handle_), algorithm->operation, &alpha, p.weight,
          algorithm->weight, p.xScratch, algorithm->x, &beta, gemmY, algorithm->y, gemmY,
          algorithm->y, &algorithm->algorithm, workspace_, workspaceBytes_, cudaStream)))
    return code;
  if (!p.splitInput)
    return 0;
  const int64_t outputs = p.rows * p.out;
  sumSplitProducts<<<int(std::min<int64_t>((outputs + threads - 1) / threads, 4096)), threads, 0,
                     cudaStream>>>(p.splitOutput, p.rows, p.out, p.y, yStride, p.accumulate);
  return int(cudaGetLastError());
}

const char *linearErrorText(int code) {
  if (code >= kCublasBase)
    return cublasLtGetStatusName(static_cast<cublasStatus_t>(code - kCublasBase));
  return cudaGetErrorName(static_cast<cudaError_t>(code));
}

} // namespace hybrid::kernels::cuda
