// KDA chunked prefill (see KdaPrefill.h and docs/cuda-kernels.md). Per 64-token chunk, with G the
// in-chunk cumulative log decay and A[i][j] = beta_i sum_c k_ic k_jc e^(G_ic - G_jc) (j < i):
//   T = (I + A)^-1,  w = T (beta k e^G),  u = T (beta v),  kg = k e^(G_last - G),  qg = q e^G,
//   v_new = u - w S,  O = qg S + Aqk v_new,  S <- e^G_last S + kg^T v_new.
// Only v_new, O and S depend on the state, so three kernels:
//  1. chunkFactorsKernel, one block per (chunk, head), all chunks at once: conv, SiLU, norms,
//     gates, A and Aqk, the inverse, w, u, qg, kg^T; written to the workspace in bf16.
//  2. the state chain, one block per (sequence, head, 32 value columns): walks the sequence's
//     chunks with the fp32 state as tensor-core accumulators, writes the raw output
//     (twoRoleChainKernel for few blocks, oneRoleChainKernel for many; section 2).
//  3. gatedNormKernel: the gated RMSNorm over each (token, head) in place.
// Every exponent is of a difference G_a - G_b <= 0 (the diagonal 16-token blocks are exact running
// products of decays), so any gate, including the unbounded softplus one, is safe.
#include "../common/device_setup.cuh"
#include "../common/warp_mma.cuh"
#include "hybrid/kernels/cuda/KdaPrefill.h"
#include "kda_device_math.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {
namespace {
using namespace kda_math;
using namespace mma;
using bf16 = __nv_bfloat16;

constexpr int kChunk = kKdaPrefillChunk, kDim = 128, kBlock = 16, kSlice = 32;
constexpr int kSlices = kDim / kSlice;
// Row strides (elements) of shared tiles, padded so that fragment loads hit distinct banks.
constexpr int kWideStride = kDim + 8;     // bf16 rows of 128
constexpr int kNarrowStride = kChunk + 8; // bf16 rows of 64
constexpr int kSliceStride = kSlice + 8;  // bf16 rows of 32
constexpr int kFloatStride = kDim + 8;    // fp32 [token][channel]
constexpr int kSquareStride = kChunk + 1; // fp32 [64][64]

// The workspace: one block of each per (chunk, head), chunk-major.
struct ChunkFactors {
  bf16 *w;    // [64][128]  T (beta k e^G)
  bf16 *u;    // [64][128]  T (beta v)
  bf16 *qg;   // [64][128]  q e^G / sqrt(K)
  bf16 *kgT;  // [128][64]  (k e^(G_last - G))^T
  bf16 *aqk;  // [64][64]   (q k^T masked j <= i, decays applied) / sqrt(K)
  float *gam; // [128]      e^G_last
};

size_t alignUp(size_t bytes) { return (bytes + 255) / 256 * 256; }
int64_t maxChunks(const KdaPrefillParams &p) { return int64_t(p.tokens) / kChunk + p.sequences; }

// Offsets of the ChunkFactors arrays in the workspace, and its size.
struct WorkspaceLayout {
  size_t w, u, qg, kgT, aqk, gam, total;
};
WorkspaceLayout workspaceLayout(const KdaPrefillParams &p) {
  const size_t blocks = size_t(maxChunks(p)) * size_t(p.heads);
  WorkspaceLayout layout{};
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    const size_t at = offset;
    offset += alignUp(blocks * bytes);
    return at;
  };
  layout.w = take(kChunk * kDim * sizeof(bf16));
  layout.u = take(kChunk * kDim * sizeof(bf16));
  layout.qg = take(kChunk * kDim * sizeof(bf16));
  layout.kgT = take(kDim * kChunk * sizeof(bf16));
  layout.aqk = take(kChunk * kChunk * sizeof(bf16));
  layout.gam = take(kDim * sizeof(float));
  layout.total = offset;
  return layout;
}

__device__ inline int chunksOf(const int32_t *cuSeqlens, int sequence) {
  return max(0, cuSeqlens[sequence + 1] - cuSeqlens[sequence] + kChunk - 1) / kChunk;
}

// Chunk `chunk` of the packed batch (sequences in order, ceil(length / 64) chunks each): its
// sequence and tokens. False past the last chunk (the grid is sized for the worst case).
struct ChunkLocation {
  int sequence, sequenceBegin, begin, count;
};
__device__ bool locateChunk(const int32_t *cuSeqlens, int sequences, int chunk,
                            ChunkLocation &location) {
  int first = 0;
  for (int s = 0; s < sequences; ++s) {
    const int chunks = chunksOf(cuSeqlens, s);
    if (chunk < first + chunks) {
      location.sequence = s;
      location.sequenceBegin = cuSeqlens[s];
      location.begin = cuSeqlens[s] + (chunk - first) * kChunk;
      location.count = min(kChunk, cuSeqlens[s + 1] - location.begin);
      return true;
    }
    first += chunks;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// 1. Chunk factors.

constexpr int kFactorThreads = 512;

// Largest in-block decay span (nats, max over channels of G_first - G_last) for which a diagonal
// block uses a mid-row reference on the tensor cores: every factor is then within e^(+-80), so
// nothing flushes to zero (below e^-87) and even the masked upper-triangle sums stay finite
// (128 e^80 = 7e36 < 3.4e38). Wider spans take the exact path (one e^(G_i - G_j) per term).
constexpr float kMidReferenceSpan = 80.0f;

struct FactorShared {
  float q[kChunk][kFloatStride]; // SiLU(conv), then L2-normed and scaled by K^-1/2
  float k[kChunk][kFloatStride]; // SiLU(conv), then L2-normed
  float G[kChunk][kFloatStride]; // in-chunk inclusive cumsum of the log decays
  union {
    struct { // rows relative to their block's middle row: the diagonal blocks
      bf16 keyLeft[kChunk][kWideStride], queryLeft[kChunk][kWideStride];
      bf16 keyRight[kChunk][kWideStride];
    } diagonal;
    struct { // rows of block rows 1-3 relative to the block row's first row: the rest
      bf16 keyLeft[kChunk - kBlock][kWideStride], queryLeft[kChunk - kBlock][kWideStride];
      bf16 keyRight[kBlock * (1 + 2 + 3)][kWideStride]; // earlier rows for block rows 1, 2, 3
    } offDiagonal;
    float inverse[kChunk][kSquareStride];   // T in fp32
    bf16 keysT[kDim][kNarrowStride];        // (beta k e^G)^T, the B operand of w
    bf16 decayedKeysT[kDim][kNarrowStride]; // kg^T, staged for coalesced stores
  } scratch;
  bf16 valuesT[kDim][kNarrowStride]; // (beta v)^T, the B operand of u
  float a[kChunk][kSquareStride];    // A, strictly lower
  float aqk[kChunk][kSquareStride];  // Aqk, lower with the diagonal
  float partialInverse[3][kBlock][kBlock + 1];
  bf16 inverse16[kChunk][kNarrowStride];
  alignas(16) float beta[kChunk];
  float blockSpan[kFactorThreads / 32][kChunk / kBlock]; // per gate warp: max_c G_first - G_last
};

// Inputs of phase 1 in batches of 16 tokens, the next batch's loads issued before the current one
// is computed (two batches in registers, as many as they allow).
constexpr int kInputBatch = 16, kInputBatches = kChunk / kInputBatch;

// Walks one channel's inputs of the chunk (`at`, then every `stride` floats; zeros past `count`
// tokens unless kFull) batch by batch: compute(batch values, first token of the batch).
template <bool kFull, typename Compute>
__device__ __forceinline__ void forEachInputBatch(const float *at, size_t stride, int count,
                                                  Compute compute) {
  float x[2][kInputBatch];
  auto load = [&](float(&into)[kInputBatch], int first) {
#pragma unroll
    for (int b = 0; b < kInputBatch; ++b, at += stride)
      into[b] = kFull || first + b < count ? *at : 0.0f;
  };
  load(x[0], 0);
#pragma unroll
  for (int batch = 0; batch < kInputBatches; ++batch) {
    if (batch + 1 < kInputBatches)
      load(x[(batch + 1) % 2], (batch + 1) * kInputBatch);
    compute(x[batch % 2], batch * kInputBatch);
  }
}

// Phase 1 of the factors kernel for one thread: stream tid / 128 (q, k, v or the gate) of
// channel tid % 128 over the chunk's tokens. kFull: the chunk has all 64 tokens (no bounds checks).
template <int kConv, bool kLowerBound, bool kFull>
__device__ __forceinline__ void chunkInputs(const KdaPrefillParams &p, const ChunkLocation &chunk,
                                            FactorShared &sh, int head) {
  static_assert(kFactorThreads == 4 * kDim, "a thread per (stream, channel)");
  const int tid = threadIdx.x, c = tid % kDim, stream = tid / kDim, channel = head * kDim + c;
  const int channels = p.heads * kDim, warp = tid / 32;
  auto inChunk = [&](int i) { return kFull || i < chunk.count; };
  constexpr int kBatch = kInputBatch;
  if (stream < 3) {
    const int projection = stream;
    const size_t tokenStride = size_t(3) * channels;
    const float *input =
        p.qkv + size_t(chunk.begin) * tokenStride + projection * channels + channel;
    float taps[kConv], window[kConv]; // window[kConv - 1] is the current input
    const float *tap = p.weights.convWeight + (size_t(projection) * channels + channel) * kConv;
#pragma unroll
    for (int j = 0; j < kConv; ++j)
      taps[j] = tap[j];
    const float *history = p.convState +
                           (size_t(chunk.sequence) * 3 + projection) * (kConv - 1) * channels +
                           channel;
#pragma unroll
    for (int j = 0; j < kConv - 1; ++j) {
      const int position = chunk.begin - (kConv - 1) + j;
      window[j] = position >= chunk.sequenceBegin
                      ? input[(j - (kConv - 1)) * int64_t(tokenStride)]
                      : history[size_t(position - chunk.sequenceBegin + kConv - 1) * channels];
    }
    forEachInputBatch<kFull>(input, tokenStride, chunk.count, [&](float(&current)[kBatch],
                                                                  int first) {
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        window[kConv - 1] = current[b];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < kConv; ++j)
          acc += taps[j] * window[j];
#pragma unroll
        for (int j = 0; j + 1 < kConv; ++j)
          window[j] = window[j + 1];
        current[b] = inChunk(first + b) ? acc * fastSigmoid(acc) : 0.0f;
      }
      if (projection == 0) {
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          sh.q[first + b][c] = current[b];
      } else if (projection == 1) {
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          sh.k[first + b][c] = current[b];
      } else {
        // beta v transposed, 8 tokens per 16-byte store: rows c..c+7 of a quarter warp start 4
        // banks apart, so the stores are conflict-free.
#pragma unroll
        for (int b = 0; b < kBatch; b += 8) {
          const float4 beta0 = *reinterpret_cast<const float4 *>(&sh.beta[first + b]);
          const float4 beta1 = *reinterpret_cast<const float4 *>(&sh.beta[first + b + 4]);
          *reinterpret_cast<uint4 *>(&sh.valuesT[c][first + b]) =
              make_uint4(packBf16(beta0.x * current[b], beta0.y * current[b + 1]),
                         packBf16(beta0.z * current[b + 2], beta0.w * current[b + 3]),
                         packBf16(beta1.x * current[b + 4], beta1.y * current[b + 5]),
                         packBf16(beta1.z * current[b + 6], beta1.w * current[b + 7]));
        }
      }
    });
  } else {
    const float *forget = p.forget + size_t(chunk.begin) * channels + channel;
    const float scaleA = fastExp(p.weights.aLog[head]), dtBias = p.weights.dtBias[channel];
    const float lowerBound = p.weights.lowerBound;
    float sum = 0.0f, blockFirst = 0.0f;
    forEachInputBatch<kFull>(forget, channels, chunk.count, [&](float(&current)[kBatch],
                                                                int first) {
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int i = first + b;
        // Computed for padding tokens too (finite), then masked: no branch per token.
        const float g = fastForgetLogDecay<kLowerBound>(current[b] + dtBias, scaleA, lowerBound);
        sum += inChunk(i) ? g : 0.0f;
        sh.G[i][c] = sum;
        if (i % kBlock == 0)
          blockFirst = sum;
        if (i % kBlock == kBlock - 1) {
          float span = blockFirst - sum;
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2)
            span = fmaxf(span, __shfl_xor_sync(0xffffffffu, span, offset));
          sh.blockSpan[warp][i / kBlock] = span;
        }
      }
    });
  }
}

template <int kConv, bool kLowerBound>
__global__ void __launch_bounds__(kFactorThreads)
    chunkFactorsKernel(KdaPrefillParams p, ChunkFactors factors) {
  extern __shared__ __align__(16) unsigned char sharedBytes[];
  FactorShared &sh = *reinterpret_cast<FactorShared *>(sharedBytes);
  const int head = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  ChunkLocation chunk;
  if (!locateChunk(p.cuSeqlens, p.sequences, blockIdx.x, chunk))
    return;
  const size_t block = size_t(blockIdx.x) * p.heads + head;
  constexpr int kBlocks = kChunk / kBlock, kWarps = kFactorThreads / 32;

  // Phase 1: beta, then one thread per (stream, channel): all of the chunk's inputs of its channel
  // are loaded at once into registers (one memory round trip), then walked in order: conv + SiLU
  // of q, k or v with the last W - 1 inputs in registers, or the log decays with their running
  // sum and the per-block span of that sum. Zeros past the chunk's tokens. Every loop is unrolled
  // so that shared addresses are constant offsets; a full chunk (the common case) takes a copy of
  // the loop without the per-token bounds checks.
  if (tid < kChunk)
    sh.beta[tid] = tid < chunk.count
                       ? fastSigmoid(p.betaLogits[size_t(chunk.begin + tid) * p.heads + head])
                       : 0.0f;
  __syncthreads();
  if (chunk.count == kChunk)
    chunkInputs<kConv, kLowerBound, true>(p, chunk, sh, head);
  else
    chunkInputs<kConv, kLowerBound, false>(p, chunk, sh, head);
  __syncthreads();

  // Phase 2: L2 norms per token, a warp per token.
#pragma unroll
  for (int it = 0; it < kChunk / kWarps; ++it) {
    const int i = warp + kWarps * it;
    float q[4], k[4], qq = 0.0f, kk = 0.0f;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      q[m] = sh.q[i][lane + 32 * m];
      k[m] = sh.k[i][lane + 32 * m];
      qq += q[m] * q[m];
      kk += k[m] * k[m];
    }
    const float qScale = rsqrtf(warpSum(qq) + 1e-6f) * rsqrtf(float(kDim));
    const float kScale = rsqrtf(warpSum(kk) + 1e-6f);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      sh.q[i][lane + 32 * m] = q[m] * qScale;
      sh.k[i][lane + 32 * m] = k[m] * kScale;
    }
  }
  __syncthreads();
  // Whether diagonal block b is narrow enough for the mid-row reference (max over the gate
  // stream's warps of their spans).
  auto midReference = [&](int b) {
    float span = 0.0f;
#pragma unroll
    for (int w = 3 * kWarps / 4; w < kWarps; ++w)
      span = fmaxf(span, sh.blockSpan[w][b]);
    return span <= kMidReferenceSpan;
  };

  // The element-wise loops below give each thread a fixed column pair (or column) and rows
  // r + 8 it (r = tid / 64), so every shared address is a constant offset from the thread's own.
  constexpr int kPairs = kDim / 2, kRowStep = kFactorThreads / kPairs;
  static_assert(kRowStep == 8 && kBlock % kRowStep == 0, "two row steps per 16-row block");
  const int pairColumn = 2 * (tid % kPairs), rowInStep = tid / kPairs;

  // Phase 3: the diagonal 16x16 blocks of A and Aqk. On tensor cores relative to the block's
  // middle row m: (k_i e^(G_i - G_m)) . (k_j e^(G_m - G_j)); a block whose decay span is too wide
  // for that is summed exactly, one e^(G_i - G_j) per term. A is stored times beta_i.
#pragma unroll
  for (int it = 0; it < kChunk / kRowStep; ++it) {
    const int i = rowInStep + kRowStep * it, c = pairColumn;
    const int middle = kBlock * (it / 2) + kBlock / 2;
    const float2 g = *reinterpret_cast<const float2 *>(&sh.G[i][c]);
    const float2 gm = *reinterpret_cast<const float2 *>(&sh.G[middle][c]);
    const float2 k = *reinterpret_cast<const float2 *>(&sh.k[i][c]);
    const float2 q = *reinterpret_cast<const float2 *>(&sh.q[i][c]);
    const float left0 = fastExp(g.x - gm.x), left1 = fastExp(g.y - gm.y);
    const float right0 = fastExp(gm.x - g.x), right1 = fastExp(gm.y - g.y);
    *reinterpret_cast<uint32_t *>(&sh.scratch.diagonal.keyLeft[i][c]) =
        packBf16(k.x * left0, k.y * left1);
    *reinterpret_cast<uint32_t *>(&sh.scratch.diagonal.queryLeft[i][c]) =
        packBf16(q.x * left0, q.y * left1);
    *reinterpret_cast<uint32_t *>(&sh.scratch.diagonal.keyRight[i][c]) =
        packBf16(k.x * right0, k.y * right1);
  }
  __syncthreads();
  {
    // 16 jobs, one per warp: (block, A or Aqk, 8-column tile).
    static_assert(kWarps == kBlocks * 2 * 2, "one diagonal job per warp");
    const int b = warp / 4, which = (warp / 2) % 2, nTile = warp % 2, base = b * kBlock;
    if (midReference(b)) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const bf16(*left)[kWideStride] =
          which == 0 ? sh.scratch.diagonal.keyLeft : sh.scratch.diagonal.queryLeft;
#pragma unroll
      for (int ks = 0; ks < kDim / 16; ++ks) {
        uint32_t aFragment[4], bFragment[2];
        loadA(aFragment, &left[base][16 * ks], kWideStride);
        loadB(bFragment, &sh.scratch.diagonal.keyRight[base + 8 * nTile][16 * ks], kWideStride);
        mma16816(acc, aFragment, bFragment);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = accRow(e), j = 8 * nTile + accColumn(e);
        if (which == 0)
          sh.a[base + i][base + j] = i > j ? acc[e] * sh.beta[base + i] : 0.0f;
        else
          sh.aqk[base + i][base + j] = i >= j ? acc[e] : 0.0f;
      }
    }
  }
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    if (midReference(b))
      continue; // uniform over the block
    const int base = b * kBlock;
    for (int pair = warp; pair < kBlock * kBlock; pair += kWarps) {
      const int i = pair / kBlock, j = pair % kBlock;
      float sumA = 0.0f, sumQ = 0.0f;
      if (j <= i)
#pragma unroll
        for (int m = 0; m < kDim / 32; ++m) {
          const int c = lane + 32 * m;
          const float term = sh.k[base + j][c] * fastExp(sh.G[base + i][c] - sh.G[base + j][c]);
          sumA += sh.k[base + i][c] * term;
          sumQ += sh.q[base + i][c] * term;
        }
      sumA = warpSum(sumA);
      sumQ = warpSum(sumQ);
      if (lane == 0) {
        sh.a[base + i][base + j] = j < i ? sumA * sh.beta[base + i] : 0.0f;
        sh.aqk[base + i][base + j] = sumQ; // 0 above the diagonal
      }
    }
  }
  __syncthreads();

  // Phase 4: the blocks left of the diagonal, relative to the block row's first token r, where
  // both factors are at most 1 for any gate: k_i e^(G_i - G_r) (i >= r), k_j e^(G_r - G_j) (j < r).
#pragma unroll
  for (int it = 0; it < (kChunk - kBlock) / kRowStep; ++it) {
    const int i = kBlock + rowInStep + kRowStep * it, c = pairColumn;
    const int first = kBlock * (1 + it / 2);
    const float2 g = *reinterpret_cast<const float2 *>(&sh.G[i][c]);
    const float2 gr = *reinterpret_cast<const float2 *>(&sh.G[first][c]);
    const float2 k = *reinterpret_cast<const float2 *>(&sh.k[i][c]);
    const float2 q = *reinterpret_cast<const float2 *>(&sh.q[i][c]);
    const float left0 = fastExp(g.x - gr.x), left1 = fastExp(g.y - gr.y);
    *reinterpret_cast<uint32_t *>(&sh.scratch.offDiagonal.keyLeft[i - kBlock][c]) =
        packBf16(k.x * left0, k.y * left1);
    *reinterpret_cast<uint32_t *>(&sh.scratch.offDiagonal.queryLeft[i - kBlock][c]) =
        packBf16(q.x * left0, q.y * left1);
  }
  // keyRight rows: block row 1 at 0 (16 rows), 2 at 16 (32 rows), 3 at 48 (48 rows).
#pragma unroll
  for (int it = 0; it < kBlock * (1 + 2 + 3) / kRowStep; ++it) {
    const int row = rowInStep + kRowStep * it, c = pairColumn;
    const int blockRow = it < 2 ? 1 : it < 6 ? 2 : 3; // row < 16, < 48, else
    const int j = row - kBlock * (blockRow * (blockRow - 1) / 2), r = blockRow * kBlock;
    const float2 g = *reinterpret_cast<const float2 *>(&sh.G[j][c]);
    const float2 gr = *reinterpret_cast<const float2 *>(&sh.G[r][c]);
    const float2 k = *reinterpret_cast<const float2 *>(&sh.k[j][c]);
    *reinterpret_cast<uint32_t *>(&sh.scratch.offDiagonal.keyRight[row][c]) =
        packBf16(k.x * fastExp(gr.x - g.x), k.y * fastExp(gr.y - g.y));
  }
  __syncthreads();
  // 24 jobs: (block row, A or Aqk, 8-column tile left of the diagonal).
  for (int job = warp; job < 2 * (2 + 4 + 6); job += kWarps) {
    const int which = job % 2, tile = job / 2;
    const int blockRow = tile < 2 ? 1 : tile < 6 ? 2 : 3;
    const int nTile = tile - 2 * (blockRow * (blockRow - 1) / 2);
    const int rightBase = kBlock * (blockRow * (blockRow - 1) / 2);
    const bf16(*left)[kWideStride] =
        which == 0 ? sh.scratch.offDiagonal.keyLeft : sh.scratch.offDiagonal.queryLeft;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int ks = 0; ks < kDim / 16; ++ks) {
      uint32_t aFragment[4], bFragment[2];
      loadA(aFragment, &left[(blockRow - 1) * kBlock][16 * ks], kWideStride);
      loadB(bFragment, &sh.scratch.offDiagonal.keyRight[rightBase + 8 * nTile][16 * ks],
            kWideStride);
      mma16816(acc, aFragment, bFragment);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = blockRow * kBlock + accRow(e), j = 8 * nTile + accColumn(e);
      if (which == 0)
        sh.a[i][j] = acc[e] * sh.beta[i];
      else
        sh.aqk[i][j] = acc[e];
    }
  }
  __syncthreads();

  // Phase 5: T = (I + diag(beta) A)^-1 by 16x16 blocks: the diagonal blocks by substitution,
  // then T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj diagonal by diagonal. Only the blocks on and below
  // the diagonal are written; the bf16 copy zeroes the rest.
  if (warp < kBlocks && lane < kBlock) {
    const int base = warp * kBlock, j = lane;
    float x[kBlock];
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      float value = i == j ? 1.0f : 0.0f;
#pragma unroll
      for (int m = 0; m < i; ++m)
        value -= sh.a[base + i][base + m] * x[m];
      x[i] = value;
      sh.scratch.inverse[base + i][base + j] = value;
    }
  }
  __syncthreads();
  // Each level's blocks are independent: all threads share their elements.
#pragma unroll
  for (int distance = 1; distance < kBlocks; ++distance) {
    constexpr int kElements = kBlock * kBlock;
    const int elements = (kBlocks - distance) * kElements;
    for (int index = tid; index < elements; index += kFactorThreads) {
      const int b = index / kElements, row = (index / kBlock) % kBlock;
      const int column = index % kBlock, i = b + distance, j = b;
      const float *aRow = &sh.a[kBlock * i + row][kBlock * j];
      const float *tColumn = &sh.scratch.inverse[kBlock * j][kBlock * j + column];
      float y = 0.0f;
#pragma unroll
      for (int x = 0; x < kBlock * distance; ++x)
        y += aRow[x] * tColumn[x * kSquareStride];
      sh.partialInverse[b][row][column] = y;
    }
    __syncthreads();
    for (int index = tid; index < elements; index += kFactorThreads) {
      const int b = index / kElements, row = (index / kBlock) % kBlock;
      const int column = index % kBlock, i = b + distance, j = b;
      const float *tRow = &sh.scratch.inverse[kBlock * i + row][kBlock * i];
      float t = 0.0f;
#pragma unroll
      for (int x = 0; x < kBlock; ++x)
        t -= tRow[x] * sh.partialInverse[b][x][column];
      sh.scratch.inverse[kBlock * i + row][kBlock * j + column] = t;
    }
    __syncthreads();
  }
#pragma unroll
  for (int it = 0; it < kChunk * kChunk / kFactorThreads; ++it) {
    const int i = tid / kChunk + (kFactorThreads / kChunk) * it, j = tid % kChunk;
    sh.inverse16[i][j] = __float2bfloat16(j / kBlock <= i / kBlock ? sh.scratch.inverse[i][j] : 0.0f);
  }
  {
    // Aqk goes out now: its shared copy stages u below.
    bf16 *aqk = factors.aqk + block * kChunk * kChunk;
    constexpr int kAqkRowStep = kFactorThreads / (kChunk / 2);
#pragma unroll
    for (int it = 0; it < kChunk / kAqkRowStep; ++it) {
      const int i = tid / (kChunk / 2) + kAqkRowStep * it, j = 2 * (tid % (kChunk / 2));
      *reinterpret_cast<uint32_t *>(aqk + size_t(i) * kChunk + j) =
          packBf16(j <= i ? sh.aqk[i][j] : 0.0f, j + 1 <= i ? sh.aqk[i][j + 1] : 0.0f);
    }
  }
  __syncthreads();

  // Phase 6: w = T (beta k e^G) and u = T (beta v) on tensor cores; warp = (row tile, a quarter
  // of the column tiles). The transposed operand is built 8 tokens of one channel per thread, one
  // 16-byte store each (conflict-free, as for valuesT).
  // w and u are staged in bf16 in the shared copies of A and Aqk (both spent by now), 16-byte
  // chunk c of row r at chunk c ^ (r % 8): the fragment-order writes of 8 rows then hit distinct
  // banks, and the copy-out stores whole rows, 16 bytes per thread.
  static_assert(sizeof(sh.a) >= kChunk * kDim * sizeof(bf16), "w fits the spent A");
  static_assert(sizeof(sh.aqk) >= kChunk * kDim * sizeof(bf16), "u fits the spent Aqk");
  bf16 *stagedW = reinterpret_cast<bf16 *>(&sh.a[0][0]);
  bf16 *stagedU = reinterpret_cast<bf16 *>(&sh.aqk[0][0]);
  auto stagedOffset = [](int row, int chunk) { return row * kDim + 8 * (chunk ^ (row % 8)); };
  constexpr int kTokenGroups = kFactorThreads / kDim; // 8-token groups in flight
  const int ownChannel = tid % kDim, ownGroup = tid / kDim;
#pragma unroll
  for (int it = 0; it < kChunk / 8 / kTokenGroups; ++it) {
    const int j0 = 8 * (ownGroup + kTokenGroups * it), c = ownChannel;
    uint32_t packed[4];
#pragma unroll
    for (int t = 0; t < 8; t += 2)
      packed[t / 2] = packBf16(sh.beta[j0 + t] * sh.k[j0 + t][c] * fastExp(sh.G[j0 + t][c]),
                               sh.beta[j0 + t + 1] * sh.k[j0 + t + 1][c] *
                                   fastExp(sh.G[j0 + t + 1][c]));
    *reinterpret_cast<uint4 *>(&sh.scratch.keysT[c][j0]) =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
  __syncthreads();
  {
    constexpr int kColumnTiles = kDim / 8 / (kWarps / 4);
    const int rowTile = warp % 4, firstColumnTile = (warp / 4) * kColumnTiles;
    uint32_t aFragments[kChunk / 16][4];
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks)
      loadA(aFragments[ks], &sh.inverse16[16 * rowTile][16 * ks], kNarrowStride);
#pragma unroll
    for (int nt = 0; nt < kColumnTiles; ++nt) {
      const int columnTile = firstColumnTile + nt;
      float accW[4] = {0.0f, 0.0f, 0.0f, 0.0f}, accU[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int ks = 0; ks < kChunk / 16; ++ks) {
        uint32_t bFragment[2];
        loadB(bFragment, &sh.scratch.keysT[8 * columnTile][16 * ks], kNarrowStride);
        mma16816(accW, aFragments[ks], bFragment);
        loadB(bFragment, &sh.valuesT[8 * columnTile][16 * ks], kNarrowStride);
        mma16816(accU, aFragments[ks], bFragment);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = 16 * rowTile + accRow(2 * half);
        const int at = stagedOffset(row, columnTile) + accColumn(2 * half);
        *reinterpret_cast<uint32_t *>(stagedW + at) = packBf16(accW[2 * half], accW[2 * half + 1]);
        *reinterpret_cast<uint32_t *>(stagedU + at) = packBf16(accU[2 * half], accU[2 * half + 1]);
      }
    }
  }
  __syncthreads(); // keysT is read by the w products above

  // Phase 7: qg, kg^T (staged in shared memory, then stored 16 bytes per thread), e^G_last (G of
  // padding tokens is the last real one's), then the staged w and u, 16 bytes per thread.
  {
    bf16 *qg = factors.qg + block * kChunk * kDim, *kgT = factors.kgT + block * kDim * kChunk;
    bf16 *w = factors.w + block * kChunk * kDim, *u = factors.u + block * kChunk * kDim;
#pragma unroll
    for (int it = 0; it < kChunk / kRowStep; ++it) {
      const int i = rowInStep + kRowStep * it, c = pairColumn;
      const float2 q = *reinterpret_cast<const float2 *>(&sh.q[i][c]);
      const float2 g = *reinterpret_cast<const float2 *>(&sh.G[i][c]);
      *reinterpret_cast<uint32_t *>(qg + size_t(i) * kDim + c) =
          packBf16(q.x * fastExp(g.x), q.y * fastExp(g.y));
    }
    const float last = sh.G[kChunk - 1][ownChannel];
#pragma unroll
    for (int it = 0; it < kChunk / 8 / kTokenGroups; ++it) {
      const int j0 = 8 * (ownGroup + kTokenGroups * it), c = ownChannel;
      uint32_t packed[4];
#pragma unroll
      for (int t = 0; t < 8; t += 2)
        packed[t / 2] = packBf16(sh.k[j0 + t][c] * fastExp(last - sh.G[j0 + t][c]),
                                 sh.k[j0 + t + 1][c] * fastExp(last - sh.G[j0 + t + 1][c]));
      *reinterpret_cast<uint4 *>(&sh.scratch.decayedKeysT[c][j0]) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
    if (tid < kDim)
      factors.gam[block * kDim + tid] = fastExp(sh.G[kChunk - 1][tid]);
    __syncthreads();
#pragma unroll
    for (int it = 0; it < kDim * kChunk / 8 / kFactorThreads; ++it) {
      const int index = tid + kFactorThreads * it;
      const int c = index / (kChunk / 8), part = index % (kChunk / 8);
      *reinterpret_cast<uint4 *>(kgT + size_t(c) * kChunk + 8 * part) =
          *reinterpret_cast<const uint4 *>(&sh.scratch.decayedKeysT[c][8 * part]);
    }
#pragma unroll
    for (int it = 0; it < kChunk * kDim / 8 / kFactorThreads; ++it) {
      const int index = tid + kFactorThreads * it;
      const int row = index / (kDim / 8), chunk = index % (kDim / 8);
      const int at = stagedOffset(row, chunk);
      *reinterpret_cast<uint4 *>(w + row * kDim + 8 * chunk) =
          *reinterpret_cast<const uint4 *>(stagedW + at);
      *reinterpret_cast<uint4 *>(u + row * kDim + 8 * chunk) =
          *reinterpret_cast<const uint4 *>(stagedU + at);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 2. The state chain, one block per (sequence, head, 32 value columns), in two forms:
//  - two roles (few blocks, long sequences): warps 0-7 walk the state (v_new, then the update)
//    and hand each chunk's bf16 S^T and v_new^T to warps 8-11, which compute the outputs one
//    chunk behind, off the chain's critical path. Named barriers (ids 1-6; 0 is __syncthreads) order
//    the hand-off through double buffers. 159 KB: one block per SM.
//  - one role (many blocks): 4 warps do both in turn over one stage of factors refilled part by
//    part. 81 KB: two blocks per SM, which wins once there are several waves of blocks.

constexpr int kRoleThreads = 128; // the one-role form's 4 warps
// The two-role form: 8 state warps (16 key rows each for the update, a row tile by 16 value
// columns each for v_new), then 4 output warps (16 tokens each).
constexpr int kStateThreads = 256, kOutputThreads = 128;
constexpr int kTwoRoleThreads = kStateThreads + kOutputThreads;
constexpr int kTwoRoleMaxWaves = 4; // blocks per SM up to which the two-role form is used

struct TwoRoleShared {
  // By chunk parity. The state role's operands:
  bf16 w[2][kChunk][kWideStride];
  bf16 kgT[2][kDim][kNarrowStride];
  bf16 u[2][kChunk][kSliceStride]; // this block's 32 value columns
  float gam[2][kDim];
  // The output role's operands:
  bf16 qg[2][kChunk][kWideStride];
  bf16 aqk[2][kChunk][kNarrowStride];
  // Handed from the state role to the output role:
  bf16 stateT[2][kSlice][kWideStride];       // S^T of the slice before the chunk: [value][key]
  bf16 newValuesT[2][kSlice][kNarrowStride]; // v_new^T: [value][token]
};

enum ChainBarrier : int {
  kStateRole = 1,  // the state role's threads
  kOutputRole = 2, // the output role's threads
  kHandedOver = 3, // + parity: stateT / newValuesT of that parity are written (state arrives)
  kHandedBack = 5, // + parity: ... and read (output arrives)
};

// Asynchronous copies of `rows` rows of `bytesPerRow` bytes (a multiple of 16) from global rows
// `globalStride` elements apart into shared rows `sharedStride` elements apart, by the role's
// kThreads threads (`index` = the thread's index in its role).
template <int kThreads>
__device__ inline void copyRows(bf16 *shared, int sharedStride, const bf16 *global,
                                int globalStride, int rows, int bytesPerRow, int index) {
  const int parts = bytesPerRow / 16;
  for (int at = index; at < rows * parts; at += kThreads) {
    const int row = at / parts, part = at % parts;
    copyAsync16(shared + row * sharedStride + 8 * part, global + size_t(row) * globalStride + 8 * part);
  }
}

// One warp's share of a chain-step product: acc[nt] += A B^T over kSteps 16-wide k-steps, A the
// 16-row tile at `a` (k contiguous), B the slice's four 8-column tiles at `b` (stored n-major).
template <int kSteps>
__device__ __forceinline__ void mmaRowTileBySlice(float (&acc)[4][4], const bf16 *a, int aStride,
                                                  const bf16 *b, int bStride) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    uint32_t aFragment[4];
    loadA(aFragment, a + 16 * ks, aStride);
#pragma unroll
    for (int nt = 0; nt < 4; nt += 2) {
      uint32_t bFragments[2][2];
      loadBPair(bFragments[0], bFragments[1], b + 8 * nt * bStride + 16 * ks, bStride);
      mma16816(acc[nt], aFragment, bFragments[0]);
      mma16816(acc[nt + 1], aFragment, bFragments[1]);
    }
  }
}

// Calls f(element, key row, value column) for each of the warp's state elements: its 16 x
// kRowTiles key rows from `firstRow` of the slice's K x 32 state, held as s[row tile][column
// tile][accumulator element].
template <int kRowTiles, typename F>
__device__ __forceinline__ void forEachStateElement(float (&s)[kRowTiles][4][4], int firstRow,
                                                    F f) {
#pragma unroll
  for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        f(s[mt][nt][e], firstRow + 16 * mt + accRow(e), 8 * nt + accColumn(e));
}

// O = qg S + Aqk v_new for a warp's 16 tokens of the chunk (rows 16 warp..; causal: Aqk's token
// blocks up to the warp's own), from the chunk's bf16 S^T and v_new^T of this slice.
__device__ __forceinline__ void outputTile(float (&o)[4][4], const bf16 *qg, const bf16 *aqk,
                                           const bf16 *stateT, const bf16 *newValuesT, int warp) {
  mmaRowTileBySlice<kDim / 16>(o, qg + 16 * warp * kWideStride, kWideStride, stateT, kWideStride);
  for (int ks = 0; ks <= warp; ++ks)
    mmaRowTileBySlice<1>(o, aqk + 16 * warp * kNarrowStride + 16 * ks, kNarrowStride,
                         newValuesT + 16 * ks, kNarrowStride);
}

// Stores a warp's output tile: rows 16 warp.. of chunk `c` of the sequence, this slice's columns.
__device__ __forceinline__ void storeOutputTile(const KdaPrefillParams &p, const float (&o)[4][4],
                                                int warp, int begin, int length, int c, int head,
                                                int slice) {
  const int chunkBegin = begin + c * kChunk, count = min(kChunk, length - c * kChunk);
  const int channels = p.heads * kDim;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * warp + accRow(2 * half);
    if (row < count) {
      float *out = p.out + size_t(chunkBegin + row) * channels + head * kDim + slice * kSlice;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
        *reinterpret_cast<float2 *>(out + 8 * nt + accColumn(2 * half)) =
            make_float2(o[nt][2 * half], o[nt][2 * half + 1]);
    }
  }
}

// The state role: S <- e^G_last S + kg^T (u - w S) chunk by chunk, S in mma accumulators, 16
// key rows per warp.
template <typename State>
__device__ __forceinline__ void chainStateRole(const KdaPrefillParams &p, const ChunkFactors &factors,
                                               TwoRoleShared &sh, int firstChunk, int chunks,
                                               int slice, int head, State *state) {
  const int index = threadIdx.x, warp = index / 32;
  auto load = [&](int c) {
    const int b = c % 2;
    const size_t block = size_t(firstChunk + c) * p.heads + head;
    copyRows<kStateThreads>(&sh.w[b][0][0], kWideStride, factors.w + block * kChunk * kDim, kDim,
                            kChunk, kDim * 2, index);
    copyRows<kStateThreads>(&sh.u[b][0][0], kSliceStride,
                            factors.u + block * kChunk * kDim + slice * kSlice, kDim, kChunk,
                            kSlice * 2, index);
    copyRows<kStateThreads>(&sh.kgT[b][0][0], kNarrowStride, factors.kgT + block * kDim * kChunk,
                            kChunk, kDim, kChunk * 2, index);
    if (index < kDim / 4)
      copyAsync16(&sh.gam[b][4 * index], factors.gam + block * kDim + 4 * index);
  };
  const int keyRow = 16 * warp;                       // the update: this warp's 16 key rows
  const int rowTile = warp % 4, columnPair = warp / 4; // v_new: 16 tokens x 16 value columns
  float s[1][4][4];
  forEachStateElement(s, keyRow, [&](float &element, int row, int column) {
    element = loadState(state + size_t(row) * kDim + column);
  });
  load(0);
  commitAsyncCopies();
  for (int c = 0; c < chunks; ++c) {
    const int b = c % 2;
    if (c + 1 < chunks)
      load(c + 1);
    commitAsyncCopies();
    waitAsyncCopies<1>(); // this thread's copies of chunk c
    if (c >= 2)
      namedBarrierSync(kHandedBack + b, kTwoRoleThreads); // chunk c - 2's outputs are done
    forEachStateElement(s, keyRow, [&](float &element, int row, int column) {
      sh.stateT[b][column][row] = __float2bfloat16(element);
    });
    namedBarrierSync(kStateRole, kStateThreads); // every copy of chunk c and stateT are visible

    // v_new = u - w S for this warp's 16 tokens and 16 value columns.
    {
      float product[2][4] = {};
#pragma unroll
      for (int ks = 0; ks < kDim / 16; ++ks) {
        uint32_t aFragment[4], bFragments[2][2];
        loadA(aFragment, &sh.w[b][16 * rowTile][16 * ks], kWideStride);
        loadBPair(bFragments[0], bFragments[1], &sh.stateT[b][16 * columnPair][16 * ks],
                  kWideStride);
        mma16816(product[0], aFragment, bFragments[0]);
        mma16816(product[1], aFragment, bFragments[1]);
      }
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * rowTile + accRow(e);
          const int column = 16 * columnPair + 8 * t + accColumn(e);
          sh.newValuesT[b][column][row] =
              __float2bfloat16(__bfloat162float(sh.u[b][row][column]) - product[t][e]);
        }
    }
    namedBarrierSync(kStateRole, kStateThreads);           // v_new is visible to the role
    namedBarrierArrive(kHandedOver + b, kTwoRoleThreads); // ... and to the output role

    // S <- e^G_last S + kg^T v_new for this warp's 16 key rows.
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float decay = sh.gam[b][keyRow + accRow(e)];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
        s[0][nt][e] *= decay;
    }
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks)
      mmaRowTileBySlice<1>(s[0], &sh.kgT[b][keyRow][16 * ks], kNarrowStride,
                           &sh.newValuesT[b][0][16 * ks], kNarrowStride);
    namedBarrierSync(kStateRole, kStateThreads); // buffer b's operands are free for chunk c + 2
  }
  forEachStateElement(s, keyRow, [&](float &element, int row, int column) {
    storeState(state + size_t(row) * kDim + column, element);
  });
}

// The output role: O = qg S + Aqk v_new for the chunk the state role handed over.
__device__ __forceinline__ void chainOutputRole(const KdaPrefillParams &p,
                                                const ChunkFactors &factors, TwoRoleShared &sh,
                                                int firstChunk, int chunks, int slice, int head,
                                                int begin, int length) {
  const int index = threadIdx.x - kStateThreads, warp = index / 32;
  auto load = [&](int c) {
    const int b = c % 2;
    const size_t block = size_t(firstChunk + c) * p.heads + head;
    copyRows<kOutputThreads>(&sh.qg[b][0][0], kWideStride, factors.qg + block * kChunk * kDim,
                             kDim, kChunk, kDim * 2, index);
    copyRows<kOutputThreads>(&sh.aqk[b][0][0], kNarrowStride,
                             factors.aqk + block * kChunk * kChunk, kChunk, kChunk, kChunk * 2,
                             index);
  };
  load(0);
  commitAsyncCopies();
  for (int c = 0; c < chunks; ++c) {
    const int b = c % 2;
    if (c + 1 < chunks)
      load(c + 1);
    commitAsyncCopies();
    waitAsyncCopies<1>();
    namedBarrierSync(kOutputRole, kOutputThreads);    // every copy of chunk c is visible
    namedBarrierSync(kHandedOver + b, kTwoRoleThreads); // S^T and v_new^T of chunk c are ready
    float o[4][4] = {};
    outputTile(o, &sh.qg[b][0][0], &sh.aqk[b][0][0], &sh.stateT[b][0][0],
               &sh.newValuesT[b][0][0], warp);
    if (c + 2 < chunks) // the state role waits for this only before chunk c + 2
      namedBarrierArrive(kHandedBack + b, kTwoRoleThreads);
    storeOutputTile(p, o, warp, begin, length, c, head, slice);
    namedBarrierSync(kOutputRole, kOutputThreads); // qg and Aqk of parity b are free
  }
}

// The conv state after the sequence, a thread per channel of the head (threadIdx.x < 128): its
// last W - 1 inputs, older ones from the old state when the sequence is shorter (the factors
// kernel, which read the old state, has finished).
__device__ inline void updateConvState(const KdaPrefillParams &p, int sequence, int head, int begin,
                                       int length) {
  const int history = p.convKernel - 1, channels = p.heads * kDim;
  const int channel = head * kDim + threadIdx.x;
#pragma unroll
  for (int projection = 0; projection < 3; ++projection) {
    float *convState =
        p.convState + (size_t(sequence) * 3 + projection) * history * channels + channel;
    float old[kKdaMaxConvKernel - 1], next[kKdaMaxConvKernel - 1];
#pragma unroll
    for (int j = 0; j < kKdaMaxConvKernel - 1; ++j)
      old[j] = j < history ? convState[size_t(j) * channels] : 0.0f;
#pragma unroll
    for (int j = 0; j < kKdaMaxConvKernel - 1; ++j) {
      const int position = begin + length - history + j;
      next[j] = position >= begin ? p.qkv[(size_t(position) * 3 + projection) * channels + channel]
                                  : old[min(j + length, kKdaMaxConvKernel - 2)];
    }
#pragma unroll
    for (int j = 0; j < kKdaMaxConvKernel - 1; ++j)
      if (j < history)
        convState[size_t(j) * channels] = next[j];
  }
}

template <typename State>
__global__ void __launch_bounds__(kTwoRoleThreads)
    twoRoleChainKernel(KdaPrefillParams p, ChunkFactors factors) {
  extern __shared__ __align__(16) unsigned char sharedBytes[];
  TwoRoleShared &sh = *reinterpret_cast<TwoRoleShared *>(sharedBytes);
  const int slice = blockIdx.x, head = blockIdx.y, sequence = blockIdx.z;
  const int begin = p.cuSeqlens[sequence], length = p.cuSeqlens[sequence + 1] - begin;
  if (length <= 0)
    return; // an empty sequence keeps its states
  int firstChunk = 0;
  for (int s = 0; s < sequence; ++s)
    firstChunk += chunksOf(p.cuSeqlens, s);
  const int chunks = (length + kChunk - 1) / kChunk;
  if (threadIdx.x >= kStateThreads) {
    chainOutputRole(p, factors, sh, firstChunk, chunks, slice, head, begin, length);
    return;
  }
  State *state = static_cast<State *>(p.state) +
                 (size_t(sequence) * p.heads + head) * kDim * kDim + slice * kSlice;
  chainStateRole(p, factors, sh, firstChunk, chunks, slice, head, state);

  if (slice == 0 && threadIdx.x < kDim)
    updateConvState(p, sequence, head, begin, length);
}


struct ChainStage {
  bf16 w[kChunk][kWideStride];
  bf16 qg[kChunk][kWideStride];
  bf16 kgT[kDim][kNarrowStride];
  bf16 aqk[kChunk][kNarrowStride];
  bf16 u[kChunk][kSliceStride];
  float gam[kDim];
};
// One stage, refilled part by part as the chunk's computation frees it (w and u once v_new is
// computed, the rest at the end of the chunk): 81 KB, so two blocks share an SM.
struct OneRoleShared {
  ChainStage stage;
  bf16 stateT[kSlice][kWideStride];       // S^T of the slice in bf16: [value][key]
  bf16 newValuesT[kSlice][kNarrowStride]; // v_new^T: [value][token]
};

// Asynchronous copies of one chunk's factors in two parts: the operands of v_new (w and this
// block's value slice of u), then the rest (kg^T, e^G_last, qg, Aqk).
enum class ChunkPart { NewValues, Rest };
template <ChunkPart kPart>
__device__ inline void loadChunk(ChainStage &stage, const ChunkFactors &factors, size_t block,
                                 int slice) {
  const int tid = threadIdx.x;
  if constexpr (kPart == ChunkPart::NewValues) {
    const bf16 *w = factors.w + block * kChunk * kDim;
    const bf16 *u = factors.u + block * kChunk * kDim + slice * kSlice;
    for (int index = tid; index < kChunk * kDim / 8; index += kRoleThreads) {
      const int row = index / (kDim / 8), part = index % (kDim / 8);
      copyAsync16(&stage.w[row][8 * part], w + row * kDim + 8 * part);
    }
    for (int index = tid; index < kChunk * kSlice / 8; index += kRoleThreads) {
      const int row = index / (kSlice / 8), part = index % (kSlice / 8);
      copyAsync16(&stage.u[row][8 * part], u + row * kDim + 8 * part);
    }
  } else {
    const bf16 *qg = factors.qg + block * kChunk * kDim;
    const bf16 *kgT = factors.kgT + block * kDim * kChunk;
    const bf16 *aqk = factors.aqk + block * kChunk * kChunk;
    for (int index = tid; index < kDim * kChunk / 8; index += kRoleThreads) {
      const int row = index / (kChunk / 8), part = index % (kChunk / 8);
      copyAsync16(&stage.kgT[row][8 * part], kgT + row * kChunk + 8 * part);
    }
    for (int index = tid; index < kChunk * kDim / 8; index += kRoleThreads) {
      const int row = index / (kDim / 8), part = index % (kDim / 8);
      copyAsync16(&stage.qg[row][8 * part], qg + row * kDim + 8 * part);
    }
    for (int index = tid; index < kChunk * kChunk / 8; index += kRoleThreads) {
      const int row = index / (kChunk / 8), part = index % (kChunk / 8);
      copyAsync16(&stage.aqk[row][8 * part], aqk + row * kChunk + 8 * part);
    }
    if (tid < kDim / 4)
      copyAsync16(&stage.gam[4 * tid], factors.gam + block * kDim + 4 * tid);
  }
}


template <typename State>
__global__ void __launch_bounds__(kRoleThreads)
    oneRoleChainKernel(KdaPrefillParams p, ChunkFactors factors) {
  extern __shared__ __align__(16) unsigned char sharedBytes[];
  OneRoleShared &sh = *reinterpret_cast<OneRoleShared *>(sharedBytes);
  const int slice = blockIdx.x, head = blockIdx.y, sequence = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int begin = p.cuSeqlens[sequence], length = p.cuSeqlens[sequence + 1] - begin;
  if (length <= 0)
    return; // an empty sequence keeps its states
  int firstChunk = 0;
  for (int s = 0; s < sequence; ++s)
    firstChunk += chunksOf(p.cuSeqlens, s);
  const int chunks = (length + kChunk - 1) / kChunk;

  // This warp's 32 key rows of the slice's K x 32 state (forEachStateElement).
  State *state = static_cast<State *>(p.state) +
                 (size_t(sequence) * p.heads + head) * kDim * kDim + slice * kSlice;
  float s[2][4][4];
  forEachStateElement(s, 32 * warp, [&](float &element, int row, int column) {
    element = loadState(state + size_t(row) * kDim + column);
  });

  // Copy groups in flight at the top of each chunk: its NewValues part, then its Rest part.
  ChainStage &st = sh.stage;
  loadChunk<ChunkPart::NewValues>(st, factors, size_t(firstChunk) * p.heads + head, slice);
  commitAsyncCopies();
  loadChunk<ChunkPart::Rest>(st, factors, size_t(firstChunk) * p.heads + head, slice);
  commitAsyncCopies();
  for (int c = 0; c < chunks; ++c) {
    const size_t next = size_t(firstChunk + c + 1) * p.heads + head;
    waitAsyncCopies<1>(); // this thread's NewValues copies
    forEachStateElement(s, 32 * warp, [&](float &element, int row, int column) {
      sh.stateT[column][row] = __float2bfloat16(element);
    });
    __syncthreads();

    // v_new = u - w S for this warp's 16 tokens.
    {
      float product[4][4] = {};
      mmaRowTileBySlice<kDim / 16>(product, &st.w[16 * warp][0], kWideStride, &sh.stateT[0][0],
                                   kWideStride);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * warp + accRow(e), column = 8 * nt + accColumn(e);
          sh.newValuesT[column][row] =
              __float2bfloat16(__bfloat162float(st.u[row][column]) - product[nt][e]);
        }
    }
    waitAsyncCopies<0>(); // this thread's Rest copies (issued a whole v_new earlier)
    __syncthreads();      // every thread's copies and v_new are visible; w and u are free
    if (c + 1 < chunks)
      loadChunk<ChunkPart::NewValues>(st, factors, next, slice);
    commitAsyncCopies();

    // S <- e^G_last S + kg^T v_new for this warp's 32 key rows.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float decay = st.gam[32 * warp + 16 * mt + accRow(e)];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          s[mt][nt][e] *= decay;
      }
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
        mmaRowTileBySlice<1>(s[mt], &st.kgT[32 * warp + 16 * mt][16 * ks], kNarrowStride,
                             &sh.newValuesT[0][16 * ks], kNarrowStride);

    // O = qg S + Aqk v_new for this warp's 16 tokens (causal: token blocks up to its own).
    {
      float o[4][4] = {};
      outputTile(o, &st.qg[0][0], &st.aqk[0][0], &sh.stateT[0][0], &sh.newValuesT[0][0], warp);
      storeOutputTile(p, o, warp, begin, length, c, head, slice);
    }
    __syncthreads(); // the rest of the stage, stateT and newValuesT are free for the next chunk
    if (c + 1 < chunks)
      loadChunk<ChunkPart::Rest>(st, factors, next, slice);
    commitAsyncCopies();
  }

  forEachStateElement(s, 32 * warp, [&](float &element, int row, int column) {
    storeState(state + size_t(row) * kDim + column, element);
  });

  if (slice == 0)
    updateConvState(p, sequence, head, begin, length);
}

// ---------------------------------------------------------------------------------------------
// 3. Gated RMSNorm of each (token, head) row of the output, in place; a warp per row.

constexpr int kNormThreads = 256;

__global__ void __launch_bounds__(kNormThreads) gatedNormKernel(KdaPrefillParams p) {
  const int64_t row = int64_t(blockIdx.x) * (kNormThreads / 32) + threadIdx.x / 32;
  if (row >= int64_t(p.tokens) * p.heads)
    return;
  const int lane = threadIdx.x % 32;
  float *out = p.out + row * kDim;
  const float *gate = p.outputGate + row * kDim;
  float o[4], squares = 0.0f;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    o[m] = out[lane + 32 * m];
    squares += o[m] * o[m];
  }
  const float scale = rsqrtf(warpSum(squares) / kDim + p.weights.normEpsilon);
#pragma unroll
  for (int m = 0; m < 4; ++m)
    out[lane + 32 * m] =
        o[m] * scale * p.weights.normWeight[lane + 32 * m] * fastSigmoid(gate[lane + 32 * m]);
}

using FactorsKernel = void (*)(KdaPrefillParams, ChunkFactors);
// The conv width and the gate kind are template parameters: the factors kernel is
// instruction-bound.
constexpr FactorsKernel kFactorsKernels[2][kKdaMaxConvKernel] = {
    {chunkFactorsKernel<1, false>, chunkFactorsKernel<2, false>, chunkFactorsKernel<3, false>,
     chunkFactorsKernel<4, false>},
    {chunkFactorsKernel<1, true>, chunkFactorsKernel<2, true>, chunkFactorsKernel<3, true>,
     chunkFactorsKernel<4, true>}};

// The shared-memory opt-ins of every kernel and the SM count, once per device.
DeviceSetup chunkedPrefillSetup() {
  return deviceSetup([] {
    cudaError_t status = cudaSuccess;
    for (const auto &byGate : kFactorsKernels)
      for (FactorsKernel kernel : byGate)
        if (status == cudaSuccess)
          status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        sizeof(FactorShared));
    for (KdaStateType type : {KdaStateType::F32, KdaStateType::BF16})
      if (status == cudaSuccess)
        status = static_cast<cudaError_t>(withStateType(type, [](auto tag) {
          using State = typename decltype(tag)::type;
          cudaError_t set = cudaFuncSetAttribute(twoRoleChainKernel<State>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 sizeof(TwoRoleShared));
          if (set == cudaSuccess)
            set = cudaFuncSetAttribute(oneRoleChainKernel<State>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       sizeof(OneRoleShared));
          return static_cast<int>(set);
        }));
    return status;
  });
}

} // namespace

size_t kdaChunkedPrefillWorkspaceBytes(const KdaPrefillParams &params) {
  if (params.tokens <= 0 || params.heads <= 0 || params.sequences <= 0)
    return 0;
  return workspaceLayout(params).total;
}

int launchKdaChunkedPrefill(const KdaPrefillParams &params, void *stream) {
  if (params.sequences <= 0 || params.heads <= 0 || params.headDim != kDim ||
      params.convKernel < 1 || params.convKernel > kKdaMaxConvKernel ||
      params.cuSeqlens == nullptr || params.tokens < 0)
    return cudaErrorInvalidValue;
  if (params.tokens == 0)
    return cudaSuccess; // only empty sequences: every state stays as it is
  if (params.workspace == nullptr)
    return cudaErrorInvalidValue;
  const WorkspaceLayout layout = workspaceLayout(params);
  auto *base = static_cast<unsigned char *>(params.workspace);
  const ChunkFactors factors{
      reinterpret_cast<bf16 *>(base + layout.w),   reinterpret_cast<bf16 *>(base + layout.u),
      reinterpret_cast<bf16 *>(base + layout.qg),  reinterpret_cast<bf16 *>(base + layout.kgT),
      reinterpret_cast<bf16 *>(base + layout.aqk), reinterpret_cast<float *>(base + layout.gam)};
  const DeviceSetup setup = chunkedPrefillSetup();
  if (setup.status != cudaSuccess)
    return setup.status;
  const FactorsKernel factorsKernel =
      kFactorsKernels[params.weights.lowerBoundGate ? 1 : 0][params.convKernel - 1];
  auto cudaStream = static_cast<cudaStream_t>(stream);
  factorsKernel<<<dim3(unsigned(maxChunks(params)), params.heads), kFactorThreads,
                  sizeof(FactorShared), cudaStream>>>(params, factors);
  // Two roles while the chain blocks fit in few waves (latency per chunk decides), one role with
  // two blocks per SM beyond (throughput decides); measured in docs/performance.md.
  const dim3 chainGrid(kSlices, params.heads, params.sequences);
  const bool twoRoles = int64_t(kSlices) * params.heads * params.sequences <=
                        int64_t(kTwoRoleMaxWaves) * setup.multiprocessors;
  const int chained = withStateType(params.stateType, [&](auto tag) {
    using State = typename decltype(tag)::type;
    if (twoRoles)
      twoRoleChainKernel<State>
          <<<chainGrid, kTwoRoleThreads, sizeof(TwoRoleShared), cudaStream>>>(params, factors);
    else
      oneRoleChainKernel<State>
          <<<chainGrid, kRoleThreads, sizeof(OneRoleShared), cudaStream>>>(params, factors);
    return 0;
  });
  if (chained != 0)
    return chained;
  const int64_t rows = int64_t(params.tokens) * params.heads;
  gatedNormKernel<<<unsigned((rows + kNormThreads / 32 - 1) / (kNormThreads / 32)), kNormThreads, 0,
                    cudaStream>>>(params);
  return static_cast<int>(cudaGetLastError());
}

KdaPrefillPath resolveKdaPrefillPath(const KdaPrefillParams &params) {
  if (params.path != KdaPrefillPath::Auto)
    return params.path;
  return params.headDim == kDim && params.tokens > kKdaRecurrentPrefillMaxTokens
             ? KdaPrefillPath::Chunked
             : KdaPrefillPath::Recurrent;
}

size_t kdaPrefillWorkspaceBytes(const KdaPrefillParams &params) {
  return resolveKdaPrefillPath(params) == KdaPrefillPath::Chunked
             ? kdaChunkedPrefillWorkspaceBytes(params)
             : 0;
}

int launchKdaPrefill(const KdaPrefillParams &params, void *stream) {
  return resolveKdaPrefillPath(params) == KdaPrefillPath::Chunked
             ? launchKdaChunkedPrefill(params, stream)
             : launchKdaRecurrentPrefill(params, stream);
}

} // namespace hybrid::kernels::cuda
