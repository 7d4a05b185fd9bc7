// FP8 block-scaled linear layers through cuBLASLt (see Linear.h, MODEL_SPEC §8.1): an activation
// quantizer bit-identical to ref::quantizeFp8Tiles, then the "TN" GEMM of linear_cublaslt.cu with
// E4M3 operands: A = W (column-major [in, out], transposed) with BLK128x128_32F scales, B = the
// quantized x (column-major [in, P], P = rows padded to 16) with VEC128_32F scales, D = y
// (column-major [out, rows]) when P == rows, else the scratch's fp32 [P, out] product, whose first
// rows a small kernel adds to (or copies into) y.
#include "../common/fp8_quant.cuh"
#include "cublaslt_support.cuh"
#include "fp8_gemv.cuh"
#include "hybrid/kernels/cuda/Linear.h"

#include <algorithm>
#include <cublasLt.h>
#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 8; // one warp per (row, tile)
constexpr int kValuesPerLane = int(kFp8BlockSize) / kWarpSize;
constexpr size_t kScratchAlignment = 256; // each scratch part, so cuBLASLt sees aligned operands
// cuBLASLt finds no FP8 algorithm when the activation scales' leading dimension (the GEMM's row
// count) is not padded; 16 is known to work (H200, cuBLASLt 13.1).
constexpr int64_t kRowPadding = 16;
constexpr float kPadRowScale = 1.0f; // finite: it only scales the pad rows' zero codes
constexpr int kCopyThreads = 256;


int64_t ceilDiv(int64_t value, int64_t divisor) { return (value + divisor - 1) / divisor; }
int64_t roundUp(int64_t value, int64_t multiple) { return ceilDiv(value, multiple) * multiple; }

// One warp per (row, tile) of the paddedRows rows: the tile's amax (NaN ignored, as fmaxf does in
// the reference), its scale, then each code from the correctly rounded quotient x / s. Rows from
// `rows` on get zero codes and scale kPadRowScale.
__global__ void quantizeTiles(const float *x, int64_t xStride, int64_t rows, int64_t paddedRows,
                              int64_t in, int64_t tiles, Fp8ActivationScale rule, uint8_t *codes,
                              float *scales) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t tile = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (tile >= paddedRows * tiles)
    return; // the whole warp leaves together
  const int64_t row = tile / tiles, column0 = (tile % tiles) * kFp8BlockSize;
  const int64_t count = min(kFp8BlockSize, in - column0);
  if (row >= rows) {
    for (int i = 0; i < kValuesPerLane; ++i) {
      const int column = lane + i * kWarpSize;
      if (column < count)
        codes[row * in + column0 + column] = 0;
    }
    if (lane == 0)
      scales[(tile % tiles) * paddedRows + row] = kPadRowScale;
    return;
  }
  const float *source = x + row * xStride + column0;
  float values[kValuesPerLane];
  float amax = 0.0f;
  for (int i = 0; i < kValuesPerLane; ++i) {
    const int column = lane + i * kWarpSize;
    values[i] = column < count ? source[column] : 0.0f;
    amax = fmaxf(amax, fabsf(values[i]));
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  const float scale = quant::fp8TileScale(amax, rule);
  uint8_t *target = codes + row * in + column0;
  for (int i = 0; i < kValuesPerLane; ++i) {
    const int column = lane + i * kWarpSize;
    if (column < count)
      target[column] = quant::floatToE4M3(__fdiv_rn(values[i], scale));
  }
  if (lane == 0)
    scales[(tile % tiles) * paddedRows + row] = scale;
}

// y[r, c] = (accumulate ? y[r, c] : 0) + product[r, c] for r < rows, 4 columns per thread: out,
// yStride are multiples of 4 and y, product 16-byte aligned (checkFp8Problem, the scratch layout).
__global__ void addProduct(const float4 *product, int64_t rows, int64_t out4, float *y,
                           int64_t yStride, bool accumulate) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * out4;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / out4, column4 = i % out4;
    float4 value = product[i];
    float4 *target = reinterpret_cast<float4 *>(y + row * yStride) + column4;
    if (accumulate) {
      const float4 old = *target;
      value = make_float4(old.x + value.x, old.y + value.y, old.z + value.z, old.w + value.w);
    }
    *target = value;
  }
}

bool knownRule(Fp8ActivationScale rule) {
  return rule == Fp8ActivationScale::DeepSeekLinear || rule == Fp8ActivationScale::DeepSeekUe8m0;
}

float *activationScales(void *scratch, int64_t rows, int64_t in) {
  return reinterpret_cast<float *>(static_cast<char *>(scratch) +
                                   linearFp8ScratchScaleOffset(rows, in));
}

// The fp32 [paddedRows, out] product (used only when paddedRows != rows): after the scales.
size_t productOffset(int64_t rows, int64_t in) {
  return size_t(roundUp(int64_t(linearFp8ScratchScaleOffset(rows, in)) +
                            int64_t(sizeof(float)) * linearFp8PaddedRows(rows) *
                                ceilDiv(in, kFp8BlockSize),
                        int64_t(kScratchAlignment)));
}

// The checks of runFp8 / runFp8Prequantized: invalid arguments first, then what cuBLASLt's FP8
// kernels cannot do (16-byte rows of A and B, 16-byte columns of D, 16-byte aligned pointers).
// y's conditions apply whether or not y is D: one rule for every rows, and addProduct's float4
// accesses need them.
int checkFp8Problem(const LinearFp8Params &p, bool readsX) {
  const int64_t xStride = p.xStride ? p.xStride : p.in;
  const int64_t weightStride = p.weightStride ? p.weightStride : p.in;
  const int64_t yStride = p.yStride ? p.yStride : p.out;
  if (p.rows <= 0 || p.in <= 0 || p.out <= 0 || xStride < p.in || weightStride < p.in ||
      yStride < p.out || (readsX && !p.x) || !p.weight || !p.weightScale || !p.y || !p.scratch ||
      !knownRule(p.activationScale))
    return cudaErrorInvalidValue;
  const bool aligned = alignmentOf(p.weight) >= 16 && alignmentOf(p.weightScale) >= 16 &&
                       alignmentOf(p.y) >= 16 && alignmentOf(p.scratch) >= 16;
  if (p.in % 16 != 0 || weightStride % 16 != 0 || p.out % 4 != 0 || yStride % 4 != 0 || !aligned)
    return kCublasBase + int(CUBLAS_STATUS_NOT_SUPPORTED);
  return 0;
}

} // namespace

int64_t linearFp8WeightScaleStride(int64_t in) {
  return in > 0 ? roundUp(ceilDiv(in, kFp8BlockSize), 4) : 0;
}

int64_t linearFp8PaddedRows(int64_t rows) { return rows > 0 ? roundUp(rows, kRowPadding) : 0; }

size_t linearFp8ScratchScaleOffset(int64_t rows, int64_t in) {
  return rows > 0 && in > 0
             ? size_t(roundUp(linearFp8PaddedRows(rows) * in, int64_t(kScratchAlignment)))
             : 0;
}

size_t linearFp8ScratchBytes(int64_t rows, int64_t in, int64_t out) {
  if (rows <= 0 || in <= 0 || out < 0)
    return 0;
  const int64_t paddedRows = linearFp8PaddedRows(rows);
  if (paddedRows == rows || out == 0) // no product part
    return linearFp8ScratchScaleOffset(rows, in) +
           sizeof(float) * size_t(paddedRows * ceilDiv(in, kFp8BlockSize));
  return productOffset(rows, in) + sizeof(float) * size_t(paddedRows * out);
}

size_t linearFp8MaxScratchBytes(int64_t maxRows, int64_t in, int64_t out) {
  // Only rows that are not a multiple of 16 need the product part, so the largest scratch of
  // the last padded row count is that of maxRows or of maxRows - 1.
  return std::max(linearFp8ScratchBytes(maxRows, in, out),
                  linearFp8ScratchBytes(maxRows - 1, in, out));
}

int quantizeFp8Activations(const float *x, int64_t xStride, int64_t rows, int64_t in,
                           Fp8ActivationScale rule, void *scratch, void *stream) {
  if (xStride == 0)
    xStride = in;
  if (rows <= 0 || in <= 0 || xStride < in || !x || !scratch || alignmentOf(scratch) < 4 ||
      !knownRule(rule))
    return cudaErrorInvalidValue;
  const int64_t tiles = ceilDiv(in, kFp8BlockSize), paddedRows = linearFp8PaddedRows(rows);
  const int64_t blocks = ceilDiv(paddedRows * tiles, kWarpsPerBlock);
  if (blocks > 0x7FFFFFFF)
    return cudaErrorInvalidValue;
  quantizeTiles<<<unsigned(blocks), kWarpsPerBlock * kWarpSize, 0,
                  static_cast<cudaStream_t>(stream)>>>(x, xStride, rows, paddedRows, in, tiles,
                                                       rule, static_cast<uint8_t *>(scratch),
                                                       activationScales(scratch, rows, in));
  return int(cudaGetLastError());
}

int LinearContext::fp8AlgorithmFor(const Key &key, const void *weightScale, const void *xScale,
                                   Algorithm *&result) {
  if (auto found = fp8Algorithms_.find(key); found != fp8Algorithms_.end()) {
    result = found->second;
    return 0;
  }
  auto *algorithm = new Algorithm;
  auto fail = [&](int code) {
    delete algorithm;
    return code;
  };
  auto set = [&](cublasLtMatmulDescAttributes_t attribute, const void *value, size_t bytes) {
    return cublasCode(
        cublasLtMatmulDescSetAttribute(algorithm->operation, attribute, value, bytes));
  };
  if (int code = cublasCode(
          cublasLtMatmulDescCreate(&algorithm->operation, CUBLAS_COMPUTE_32F, CUDA_R_32F)))
    return fail(code);
  const cublasOperation_t transpose = CUBLAS_OP_T, plain = CUBLAS_OP_N;
  // Block scaling on sm_90: W's 128x128 blocks on A, x's 1x128 tiles on B. Fast accumulation
  // (CUBLASLT_MATMUL_DESC_FAST_ACCUM, no promotion to fp32) is off by default.
  const int32_t weightMode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t xMode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  if (int code = set(CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose))
    return fail(code);
  if (int code = set(CUBLASLT_MATMUL_DESC_TRANSB, &plain, sizeof plain))
    return fail(code);
  if (int code = set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &weightMode, sizeof weightMode))
    return fail(code);
  if (int code = set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &xMode, sizeof xMode))
    return fail(code);
  if (int code = set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &weightScale, sizeof weightScale))
    return fail(code);
  if (int code = set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xScale, sizeof xScale))
    return fail(code);
  if (int code = completeAlgorithm(*algorithm, CUDA_R_8F_E4M3, key))
    return fail(code);
  fp8Algorithms_.emplace(key, algorithm);
  result = algorithm;
  return 0;
}

int LinearContext::runFp8(const LinearFp8Params &p, void *stream) {
  if (batchInvariantRows_ > 0 && p.rows > batchInvariantRows_) { // as run: reference-size calls
    if (!handle_)
      return cudaErrorInvalidValue;
    if (int code = checkFp8Problem(p, true)) // nothing launched for a bad problem
      return code;
    return inRowParts(p, batchInvariantRows_, p.xStride ? p.xStride : p.in,
                      p.yStride ? p.yStride : p.out,
                      [&](const LinearFp8Params &part) { return fp8Gemm(part, true, stream); });
  }
  return fp8Gemm(p, true, stream);
}

int LinearContext::runFp8Prequantized(const LinearFp8Params &p, void *stream) {
  return fp8Gemm(p, false, stream);
}

int LinearContext::fp8Gemm(const LinearFp8Params &p, bool quantize, void *stream) {
  if (!handle_)
    return cudaErrorInvalidValue;
  if (int code = checkFp8Problem(p, quantize))
    return code;
  // Decode rows: the quantizer, then the decode kernel on tensor cores (fp8_gemv.cuh), not
  // cuBLASLt's 16-row GEMM, its split-K reduction and the copy-out.
  if (decodeKernel_ && fp8GemvSupports(p)) {
    if (quantize)
      if (int code = quantizeFp8Activations(p.x, p.xStride, p.rows, p.in, p.activationScale,
                                            p.scratch, stream))
        return code;
    return launchFp8Gemv(p, static_cast<cudaStream_t>(stream));
  }
  const int64_t weightStride = p.weightStride ? p.weightStride : p.in;
  const int64_t yStride = p.yStride ? p.yStride : p.out;
  const int64_t paddedRows = linearFp8PaddedRows(p.rows);
  // D is y itself when no row is padded; otherwise the scratch's product, copied out below.
  const bool direct = paddedRows == p.rows;
  float *d = direct ? p.y
                    : reinterpret_cast<float *>(static_cast<char *>(p.scratch) +
                                                productOffset(p.rows, p.in));
  const int64_t dStride = direct ? yStride : p.out;
  const float *xScale = activationScales(p.scratch, p.rows, p.in);
  // Looked up before any launch, so an unsupported shape leaves scratch and y untouched.
  Algorithm *algorithm = nullptr;
  if (int code = fp8AlgorithmFor(Key{paddedRows, p.in, p.out, weightStride, dStride,
                                     keyAlignment(p.weight, batchInvariantRows_ > 0),
                                     keyAlignment(p.scratch, batchInvariantRows_ > 0),
                                     keyAlignment(d, batchInvariantRows_ > 0)},
                                 p.weightScale, xScale, algorithm))
    return code;
  // The scale tensors are per call (the cached descriptor keeps the last ones otherwise).
  if (int code = cublasCode(cublasLtMatmulDescSetAttribute(algorithm->operation,
                                                           CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                           &p.weightScale, sizeof p.weightScale)))
    return code;
  if (int code = cublasCode(cublasLtMatmulDescSetAttribute(
          algorithm->operation, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xScale, sizeof xScale)))
    return code;
  if (quantize)
    if (int code = quantizeFp8Activations(p.x, p.xStride, p.rows, p.in, p.activationScale,
                                          p.scratch, stream))
      return code;
  const float alpha = 1.0f, beta = direct && p.accumulate ? 1.0f : 0.0f;
  if (int code = cublasCode(cublasLtMatmul(
          static_cast<cublasLtHandle_t>(handle_), algorithm->operation, &alpha, p.weight,
          algorithm->weight, p.scratch, algorithm->x, &beta, d, algorithm->y, d, algorithm->y,
          &algorithm->algorithm, workspace_, workspaceBytes_, static_cast<cudaStream_t>(stream))))
    return code;
  if (direct)
    return 0;
  const int64_t out4 = p.out / 4;
  const int64_t blocks = std::min<int64_t>(ceilDiv(p.rows * out4, kCopyThreads), 1 << 16);
  addProduct<<<unsigned(blocks), kCopyThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const float4 *>(d), p.rows, out4, p.y, yStride, p.accumulate);
  return int(cudaGetLastError());
}

} // namespace hybrid::kernels::cuda
