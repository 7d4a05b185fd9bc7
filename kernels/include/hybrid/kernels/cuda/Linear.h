// Linear layers on CUDA through cuBLASLt: y[rows, out] = x[rows, in] W^T (+ y), with W the
// checkpoint's nn.Linear weight [out, in], row-major, in bf16 (the "BF16 projections" role of the
// quantization policy) and x, y the runtime's fp32 activations; products accumulate in fp32.
// x reaches the tensor cores either rounded to bf16 (8 significant bits), or split into
// hi = bf16(x) and lo = bf16(x - hi) (about 16 bits, close to the fp32 oracle): the two halves
// are stacked as 2 x rows rows of one GEMM, so the weights are still read once, and summed.
// At decode row counts (<= 8 rows, in % 8 == 0, 16-byte aligned operands) a bandwidth-bound kernel
// of our own replaces the three launches: it multiplies fp32 x exactly (the split's intent) or
// bf16(x), with fp32 sums (kernels/cuda/linear/gemv.cuh). xScratch / splitOutput are then unused.
// A second path multiplies FP8 weights (DeepSeek-V3.2, MODEL_SPEC §8.1): see LinearFp8Params.
// CUDA-free header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>

namespace hybrid::kernels::cuda {

inline constexpr int kLinearMaxGroup = 8; // LinearContext::runGroup's members per launch

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

// ---- FP8 block-scaled linear (DeepSeek-V3.2 weights, MODEL_SPEC §8.1)
//
// y[rows, out] = x[rows, in] W^T (+ y) with W in FP8 E4M3 and one fp32 multiplier per 128x128
// block of W (the checkpoint's weight_scale_inv). x is quantized on the fly, per (row, 128-column
// tile), to E4M3 codes and one fp32 scale (act_quant, bit-identical to ref::quantizeFp8Tiles),
// and cuBLASLt multiplies the codes block by block:
//   y[m, n] = sum_kb s_x[m, kb] * s_W[n / 128, kb] * sum_{k in kb} e4m3(x)[m, k] * e4m3(W)[n, k]
// with fp32 promotion per 128-wide k block (cuBLASLt's VEC128_32F scales for x and BLK128x128_32F
// for W, sm_90 only, cuBLASLt >= 12.9). The last tile of a row is shorter when in % 128 != 0.
inline constexpr int64_t kFp8BlockSize = 128;

// How an activation tile's scale s follows from its amax (ref::Fp8ScaleRule of the same name):
//   DeepSeekLinear: s = max(amax, 1e-4) * (1/448)                (act_quant's default)
//   DeepSeekUe8m0:  s = 2^ceil(log2(max(amax, 1e-4) * (1/448)))  (scale_fmt "ue8m0")
enum class Fp8ActivationScale { DeepSeekLinear, DeepSeekUe8m0 };

// Memory layouts. cuBLASLt takes no leading dimension for its scale tensors, so both are fixed
// (cuBLAS docs "Scaling factors layouts"; the same rules PyTorch's _scaled_mm enforces):
// - weight scales: fp32 [ceil(out/128), linearFp8WeightScaleStride(in)] row-major, i.e. the
//   checkpoint's weight_scale_inv [ceil(out/128), ceil(in/128)] with each row padded to
//   round_up(ceil(in/128), 4) entries (16 bytes); the padding is meant never to be read, write
//   zeros there. A packer re-lays the checkpoint's scales once; DeepSeek-V3.2's widths need none.
// - scratch (linearFp8ScratchBytes): the GEMM runs on P = linearFp8PaddedRows(rows) =
//   round_up(rows, 16) rows, because cuBLASLt's VEC128_32F activation scales have leading
//   dimension = the GEMM's row count, and its heuristic finds no FP8 kernel unless that is padded
//   (seen for rows 1, 3, 7, 130 on H200, cuBLASLt 13.1). In order, each at a multiple of 256 bytes:
//   * at 0: E4M3 codes of x [P, in] row-major; rows [rows, P) hold zero codes;
//   * at linearFp8ScratchScaleOffset: activation scales fp32 [ceil(in/128), P]: the scale of
//     (row r, tile t) at t * P + r ("outer-dimension major", as VEC128_32F reads them); the pad
//     rows' scales are 1 (any finite value works: they only scale zero codes);
//   * only when P != rows: fp32 [P, out] row-major, the GEMM's product before it is added to (or
//     copied into) y's rows [0, rows).
//   quantizeFp8Activations writes the first two parts, pad rows included; runFp8Prequantized
//   expects them in that form.
int64_t linearFp8WeightScaleStride(int64_t in);
int64_t linearFp8PaddedRows(int64_t rows);
size_t linearFp8ScratchScaleOffset(int64_t rows, int64_t in);
size_t linearFp8ScratchBytes(int64_t rows, int64_t in, int64_t out);
// Enough scratch for every rows in [1, maxRows] (linearFp8ScratchBytes is not monotonic: a
// multiple of 16 rows needs no product part).
size_t linearFp8MaxScratchBytes(int64_t maxRows, int64_t in, int64_t out);

struct LinearFp8Params {
  int64_t rows = 0; // tokens, any >= 1 (padded internally, see the scratch layout)
  int64_t in = 0;   // K: a multiple of 16
  int64_t out = 0;  // N: a multiple of 4
  const float *x = nullptr;           // [rows, in], row stride xStride (>= in)
  int64_t xStride = 0;                // 0: in
  const void *weight = nullptr;       // E4M3 [out, in] row-major, row stride weightStride
  int64_t weightStride = 0;           // elements (= bytes), a multiple of 16; 0: in
  const float *weightScale = nullptr; // see the layouts above
  float *y = nullptr;                 // [rows, out], row stride yStride (>= out, a multiple of 4)
  int64_t yStride = 0;                // 0: out
  bool accumulate = false;            // y += x W^T instead of y = x W^T
  Fp8ActivationScale activationScale = Fp8ActivationScale::DeepSeekLinear;
  void *scratch = nullptr;            // linearFp8ScratchBytes(rows, in, out) bytes, layout above
};

// Only the activation quantizer (what runFp8 launches before its GEMM): x [rows, in] (any in > 0,
// row stride xStride, 0: in) into the codes and scales of `scratch` (layout above, pad rows
// included; linearFp8ScratchBytes(rows, in, 0) bytes suffice). 0 or a cudaError_t.
int quantizeFp8Activations(const float *x, int64_t xStride, int64_t rows, int64_t in,
                           Fp8ActivationScale rule, void *scratch, void *stream);

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
  // Batch invariance (issue 9, LoadOptions::batchInvariant): with referenceRows > 0, every
  // cuBLASLt GEMM of a shape takes the algorithm cuBLASLt's heuristic picks for referenceRows rows,
  // whatever its own row count (validated for it by cublasLtMatmulAlgoCheck; a shape it does not
  // fit returns 1000 + CUBLAS_STATUS_NOT_SUPPORTED), so that a row's sums need not depend on how
  // many rows share the call. 0 (the default): the heuristic's pick for each row count. Set it
  // before the first run: algorithms already chosen are kept. Larger calls run as calls of at
  // most referenceRows rows (the pick's split-K workspace then fits every call; a prefill reads
  // its weights once per such part). The decode-size kernel (rows <= 8) sums in its own order:
  // setDecodeKernel(false) sends those rows to cuBLASLt too. runFp8Prequantized is not split.
  void setBatchInvariantRows(int64_t referenceRows) { batchInvariantRows_ = referenceRows; }
  // false: calls of decode row counts run on cuBLASLt like larger ones (slower at 1-8 rows, but a
  // row's bits then never depend on the call's row count).
  void setDecodeKernel(bool enabled) { decodeKernel_ = enabled; }
  // Launches on `stream` (a cudaStream_t). Shapes must be positive, strides at least the row
  // widths; an invalid shape or a missing pointer returns cudaErrorInvalidValue (1).
  int run(const LinearParams &params, void *stream);
  // `count` linear layers of the same rows that read nothing another one writes (a layer's
  // projections of one input): in one launch when every one takes the decode-size kernel (up to
  // kLinearMaxGroup of them; bit-identical to running each), else each by run in turn.
  int runGroup(const LinearParams *members, int count, void *stream);
  // Whether run and runGroup compute `params` with the decode-size kernel (its rows, shapes and
  // alignments), whose sums a kernel that computes some of those outputs itself reproduces
  // (KdaDecodeParams' low-rank gates; bf16(x) unless splitInput).
  bool runsDecodeKernel(const LinearParams &params) const;

  // FP8 weights: quantizes x into params.scratch, then the block-scaled GEMM (any rows >= 1).
  // Besides the checks of run (cudaErrorInvalidValue), a problem cuBLASLt's FP8 kernels cannot
  // take returns 1000 + CUBLAS_STATUS_NOT_SUPPORTED before anything is launched (y and scratch
  // untouched): in % 16, weightStride % 16, out % 4 or yStride % 4 not zero, weight, weightScale,
  // y, scratch not 16-byte aligned, or no cuBLASLt algorithm for the shape. The y conditions hold
  // for every rows, although y is a cuBLASLt operand only when rows % 16 == 0.
  int runFp8(const LinearFp8Params &params, void *stream);
  // The same GEMM on a scratch that already holds quantized activations (x is not read).
  int runFp8Prequantized(const LinearFp8Params &params, void *stream);

private:
  struct Algorithm;
  // One cuBLASLt problem: shapes, strides and the alignment (bytes, up to 256) of each pointer,
  // which decides the algorithms allowed.
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int>;
  int algorithmFor(const Key &key, Algorithm *&algorithm);
  // Completes an algorithm whose operation is configured: the TN layouts of W and x in
  // `operandType` (a cudaDataType_t), y in fp32, and cuBLASLt's best algorithm for them within
  // the workspace and the key's pointer alignments. 0 or an error code.
  int completeAlgorithm(Algorithm &algorithm, int operandType, const Key &key);
  // FP8: the same key (weight stride in bytes); cuBLASLt wants the scale pointers set before it
  // picks an algorithm, so the first call's pointers come along (each run sets its own).
  int fp8AlgorithmFor(const Key &key, const void *weightScale, const void *xScale,
                      Algorithm *&algorithm);
  // runFp8 (quantize) and runFp8Prequantized: every check and the algorithm lookup before the
  // first launch.
  int fp8Gemm(const LinearFp8Params &params, bool quantize, void *stream);

  void *handle_ = nullptr;
  void *workspace_ = nullptr;
  size_t workspaceBytes_ = 0;
  int64_t batchInvariantRows_ = 0;
  bool decodeKernel_ = true;
  std::map<Key, Algorithm *> algorithms_;
  std::map<Key, Algorithm *> fp8Algorithms_;
};

// The name of a code returned above: a CUDA error or a cuBLASLt status.
const char *linearErrorText(int code);

} // namespace hybrid::kernels::cuda
