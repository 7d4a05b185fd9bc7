// Bit-exact reference quantizers (MODEL_SPEC §4.3, §4.5, §8): FP8 E4M3 "fn", E8M0 scales, MXFP8
// blocks, DeepSeek/FlashMLA FP8 tiles, the FlashMLA V32 FP8 KV row and the 132-byte indexer key.
// They are the oracle of the CUDA quantization kernels and what the cpu device runs; every result
// is defined bit for bit below (no dependence on the FP rounding mode or on the compiler).
//
// Sizes: the functions that take a shape and spans return false, and write nothing, when a span's
// size does not match the shape (or the shape is not one the format allows). They never assert.
#pragma once

#include <cstdint>
#include <span>

namespace hybrid::kernels::ref {

// ---- Scalar formats

// FP8 E4M3 "fn" (OCP FP8, torch.float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits.
//   exponent 0:      (−1)^s · m/8 · 2^−6          (subnormals; smallest 2^−9)
//   exponent 1..15:  (−1)^s · (1 + m/8) · 2^(e−7) (largest 0x7E = 1.75 · 2^8 = 448)
//   S.1111.111 (0x7F, 0xFF) is NaN; there is no infinity.
inline constexpr float kE4M3Max = 448.0f;
inline constexpr uint8_t kE4M3MaxCode = 0x7E;
inline constexpr uint8_t kE4M3NaNCode = 0x7F;

// Round to nearest, ties to even, saturating: every |value| ≥ 448 (including ±inf, and the values
// in (448, 480) that would otherwise round to the NaN pattern) becomes ±448 (0x7E / 0xFE). NaN of
// either sign becomes 0x7F. The sign is kept, so −0 → 0x80 and tiny negatives round to 0x80.
// Subnormals are exact: the result is the representable value nearest to `value` itself (one
// rounding, no intermediate fp32 step).
uint8_t floatToE4M3(float value);
float e4m3ToFloat(uint8_t code); // exact; 0x7F and 0xFF give a quiet NaN

// E8M0 (OCP MX scale): unsigned 8-bit exponent, bias 127: X = 2^(E−127) for E in 0..254 (2^−127 is
// an fp32 subnormal, still exact); E = 0xFF is NaN.
inline constexpr uint8_t kE8M0NaNCode = 0xFF;
float e8m0ToFloat(uint8_t code);

// bfloat16 (the upper half of an fp32): round to nearest even; NaN stays a quiet NaN of the same
// sign; finite values past the bf16 range become ±inf.
uint16_t floatToBf16(float value);
float bf16ToFloat(uint16_t bits); // exact

// ---- MXFP8 (OCP Microscaling v1.0, E4M3 elements) — MODEL_SPEC §8.4

// One E8M0 scale X per block of 32 consecutive elements along the last dimension; element i of a
// block stores P_i = e4m3(v_i / X) and represents v_i ≈ X · P_i.
inline constexpr int64_t kMxBlockSize = 32;

// How X is chosen from the block's amax = max |v_i| (MODEL_SPEC §8.4 asks to pick one explicitly):
//   OcpFloor: X = 2^(floor(log2 amax) − 8)   (the OCP reference; 8 = emax of E4M3). amax/X lies in
//             [256, 512), so elements above 448·X saturate to ±448 (up to 12.5% error on them).
//   RoundUp:  X = 2^ceil(log2(amax / 448))    (NVIDIA Transformer Engine / Megatron): the smallest
//             power of two with amax ≤ 448·X, so no element saturates (at the price of up to one
//             bit of range). Evaluated exactly (no rounded amax/448 quotient).
// The exponent is clamped to the E8M0 range [−127, 127]. amax == 0 gives E = 0 (X = 2^−127), so a
// zero block stays zero. A block holding a NaN or an infinity gets X = NaN (E = 0xFF) and every
// element 0x7F (OCP: a NaN scale makes the whole block NaN).
enum class MxScaleRule { OcpFloor, RoundUp };

// The E8M0 code of the scale of a block with this amax (≥ 0, finite; NaN/inf give 0xFF).
uint8_t mxScaleCode(float amax, MxScaleRule rule);

// x [rows, cols] row-major → elements [rows, cols] E4M3 codes, scales [rows, cols/32] E8M0 codes.
// Requires cols % 32 == 0 and x.size() == elements.size() == rows·cols.
[[nodiscard]] bool quantizeMxfp8(std::span<const float> x, int64_t rows, int64_t cols,
                                 std::span<uint8_t> elements, std::span<uint8_t> scales,
                                 MxScaleRule rule);

// x[r, c] = e4m3ToFloat(elements[r, c]) · e8m0ToFloat(scales[r, c/32]); exact (no rounding).
[[nodiscard]] bool dequantizeMxfp8(std::span<const uint8_t> elements,
                                   std::span<const uint8_t> scales, int64_t rows, int64_t cols,
                                   std::span<float> x);

// In place: x [rows, cols] replaced by what its MXFP8 encoding decodes to (quantizeMxfp8 then
// dequantizeMxfp8): the values a kernel reading the packed form sees. False, x untouched, where
// quantizeMxfp8 refuses the shape.
[[nodiscard]] bool roundTripMxfp8(std::span<float> x, int64_t rows, int64_t cols, MxScaleRule rule);

// ---- FP8 tiles with fp32 scales (DeepSeek act_quant, FlashMLA KV cache) — MODEL_SPEC §8.1, §8.2

// One fp32 scale s per (row, tile) of `tile` consecutive elements along the last dimension; the
// last tile of a row is shorter when cols is not a multiple of tile. Elements store
// q = e4m3(clamp(x / s, −448, 448)) with x / s an fp32 division; x ≈ e4m3ToFloat(q) · s.
inline constexpr int64_t kFp8TileSize = 128;

// How s is chosen from the tile's amax = max |x|: each rule is the spec's formula, evaluated in
// fp32 the way its reference kernel evaluates it:
//   DeepSeekLinear: s = max(amax, 1e-4) · (1/448)                        (§8.1, act_quant default)
//   DeepSeekUe8m0:  s = 2^ceil(log2(max(amax, 1e-4) · (1/448)))          (§8.1/§4.3, scale_fmt
//                   "ue8m0": the V3.2 indexer's q and k, FP8 activations)
//   FlashMlaPow2:   s = 2^ceil(log2(max(amax / 448, 1e-4)))              (§8.2, FlashMLA KV cache)
// (1/448) is the fp32 reciprocal the DeepSeek kernel multiplies by (the product may differ from
// amax/448 by one ulp); amax / 448 is FlashMLA's fp32 division; ceil(log2 y) is exact (for these
// normal y it is DeepSeek's fast_log2_ceil: the fp32 exponent, +1 if any mantissa bit is set).
// The floors differ: DeepSeek bounds amax (s ≥ 2^−22 for Ue8m0), FlashMLA the scale (s ≥ 2^−13).
// An infinite amax gives s = +inf, as in the reference kernels; NaN elements do not count.
enum class Fp8ScaleRule { DeepSeekLinear, DeepSeekUe8m0, FlashMlaPow2 };

// The scale of a tile with this amax (≥ 0).
float fp8TileScale(float amax, Fp8ScaleRule rule);

// Number of tiles per row: ceil(cols / tile).
int64_t fp8TileCount(int64_t cols, int64_t tile = kFp8TileSize);

// x [rows, cols] → elements [rows, cols] E4M3 codes, scales [rows, fp8TileCount(cols, tile)].
// Requires tile > 0.
[[nodiscard]] bool quantizeFp8Tiles(std::span<const float> x, int64_t rows, int64_t cols,
                                    int64_t tile, Fp8ScaleRule rule, std::span<uint8_t> elements,
                                    std::span<float> scales);

// x[r, c] = e4m3ToFloat(elements[r, c]) · scales[r, c / tile] (one fp32 multiply).
[[nodiscard]] bool dequantizeFp8Tiles(std::span<const uint8_t> elements,
                                      std::span<const float> scales, int64_t rows, int64_t cols,
                                      int64_t tile, std::span<float> x);

// In place: x [rows, cols] through quantizeFp8Tiles then dequantizeFp8Tiles. False, x untouched,
// where quantizeFp8Tiles refuses the shape.
[[nodiscard]] bool roundTripFp8Tiles(std::span<float> x, int64_t rows, int64_t cols, int64_t tile,
                                     Fp8ScaleRule rule);

// ---- FlashMLA "V32_FP8Sparse" KV-cache row (one token of the MLA latent cache) — MODEL_SPEC §8.2

// Byte layout (little-endian), n = latentDim, t = fp8TileCount(latentDim, tile):
//   [0, n)                 latent c as E4M3 codes, tile j scaled by s_j (FlashMlaPow2 rule)
//   [n, n + 4t)            s_0 … s_{t−1} as fp32
//   [n + 4t, n + 4t + 2r)  the r = ropeDim rope-key values as bf16 (not quantized)
// DeepSeek-V3.2 (512, 64): 512 + 16 + 128 = 656 bytes; the tiny test model (64, 32): 132 bytes.
int64_t kvRowBytes(int64_t latentDim, int64_t ropeDim, int64_t tile = kFp8TileSize);

// Requires row.size() == kvRowBytes(latent.size(), rope.size(), tile).
[[nodiscard]] bool packFp8KvRow(std::span<const float> latent, std::span<const float> rope,
                                std::span<uint8_t> row, int64_t tile = kFp8TileSize);
// latent[i] = e4m3ToFloat(code_i) · s_{i / tile}, rope[i] = bf16ToFloat(rope_i).
[[nodiscard]] bool unpackFp8KvRow(std::span<const uint8_t> row, std::span<float> latent,
                                  std::span<float> rope, int64_t tile = kFp8TileSize);

// ---- Indexer key cache row (one token's DSA indexer key) — MODEL_SPEC §4.3, §4.5, §8.3

// One scale per key, whatever its length (DeepGEMM's fp8_mqa_logits reads one fp32 scale per
// cached key): bytes [0, dim) E4M3 codes, [dim, dim + 4) the fp32 scale (little-endian).
// DeepSeek-V3.2 (dim 128): 132 bytes; the tiny test model (dim 64): 68 bytes. A paged cache may
// store a page's code rows first and its scales after them (DeepGEMM); that is the cache's layout,
// this is the logical row.
int64_t indexKeyBytes(int64_t dim);

// Requires out.size() == indexKeyBytes(key.size()). The DeepSeek-V3.2 indexer uses DeepSeekUe8m0.
[[nodiscard]] bool packFp8IndexKey(std::span<const float> key, std::span<uint8_t> out,
                                   Fp8ScaleRule rule = Fp8ScaleRule::DeepSeekUe8m0);
// key[i] = e4m3ToFloat(code_i) · scale.
[[nodiscard]] bool unpackFp8IndexKey(std::span<const uint8_t> in, std::span<float> key);

} // namespace hybrid::kernels::ref
