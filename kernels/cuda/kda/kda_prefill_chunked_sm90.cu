// KDA chunked prefill (see KdaPrefill.h and docs/cuda-kernels.md). Per 64-token chunk, with G the
// in-chunk cumulative log decay and A[i][j] = beta_i sum_c k_ic k_jc e^(G_ic - G_jc) (j < i):
//   T = (I + A)^-1,  w = T (beta k e^G),  u = T (beta v),  kg = k e^(G_last - G),  qg = q e^G,
//   v_new = u - w S,  O = qg S + Aqk v_new,  S <- e^G_last S + kg^T v_new.
// Only v_new, O and S depend on the state, so three kernels:
//  1. chunkFactorsKernel, one block per (chunk, head), all chunks at once: conv, SiLU, norms, gates,
//     A and Aqk, the inverse, w, u, qg, kg^T; written to the workspace in bf16.
//  2. stateChainKernel, one block per (sequence, head, 32 value columns): walks the sequence's
//     chunks with the fp32 state as tensor-core accumulators, writes the raw output.
//  3. gatedNormKernel: the gated RMSNorm over each (token, head) in place.
// Every exponent is of a difference G_a - G_b <= 0 (the diagonal 16-token blocks are exact running
// products of decays), so any gate, including the unbounded softplus one, is safe.
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
constexpr int kWideStride = kDim + 8;       // bf16 rows of 128
constexpr int kNarrowStride = kChunk + 8;   // bf16 rows of 64
constexpr int kSliceStride = kSlice + 8;    // bf16 rows of 32
constexpr int kFloatStride = kDim + 8;      // fp32 [token][channel]
constexpr int kSquareStride = kChunk + 1;   // fp32 [64][64]

// The workspace: one block of each per (chunk, head), chunk-major.
struct ChunkFactors {
  bf16 *w;     // [64][128]  T (beta k e^G)
  bf16 *u;     // [64][128]  T (beta v)
  bf16 *qg;    // [64][128]  q e^G / sqrt(K)
  bf16 *kgT;   // [128][64]  (k e^(G_last - G))^T
  bf16 *aqk;   // [64][64]   (q k^T masked j <= i, decays applied) / sqrt(K)
  float *gam;  // [128]      e^G_last
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

struct FactorShared {
  float q[kChunk][kFloatStride]; // SiLU(conv), then L2-normed and scaled by K^-1/2
  float k[kChunk][kFloatStride]; // SiLU(conv), then L2-normed
  float G[kChunk][kFloatStride]; // log decays, then their in-chunk inclusive cumsum
  union {
    float decay[kChunk][kFloatStride]; // e^g per token, for the exact diagonal blocks
    struct {
      bf16 left[2][kBlock][kWideStride]; // k, q rows of a block row, relative to its first row
      bf16 right[kChunk - kBlock][kWideStride]; // earlier k rows, relative to the same row
    } offDiagonal;
    float inverse[kChunk][kSquareStride]; // T in fp32
    bf16 keysT[kDim][kNarrowStride];      // (beta k e^G)^T, the B operand of w
  } scratch;
  bf16 valuesT[kDim][kNarrowStride]; // (beta v)^T, the B operand of u
  float a[kChunk][kSquareStride];    // A, strictly lower
  float aqk[kChunk][kSquareStride];  // Aqk, lower with the diagonal
  float partialInverse[3][kBlock][kBlock + 1];
  bf16 inverse16[kChunk][kNarrowStride];
  float beta[kChunk];
};

__global__ void __launch_bounds__(kFactorThreads)
    chunkFactorsKernel(KdaPrefillParams p, ChunkFactors factors) {
  extern __shared__ __align__(16) unsigned char sharedBytes[];
  FactorShared &sh = *reinterpret_cast<FactorShared *>(sharedBytes);
  const int head = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  ChunkLocation chunk;
  if (!locateChunk(p.cuSeqlens, p.sequences, blockIdx.x, chunk))
    return;
  const int channels = p.heads * kDim, history = p.convKernel - 1;
  const size_t block = size_t(blockIdx.x) * p.heads + head;

  // Phase 1: beta, then one thread per (stream, channel) walks the chunk's tokens: conv + SiLU of
  // q, k or v with the last W - 1 inputs in registers (each input read once), or the log decays
  // with their running in-chunk sum. Loads are issued 8 tokens at a time. Zeros past the tokens.
  if (tid < kChunk)
    sh.beta[tid] = tid < chunk.count
                       ? sigmoid(p.betaLogits[size_t(chunk.begin + tid) * p.heads + head])
                       : 0.0f;
  __syncthreads();
  {
    constexpr int kBatch = 8, kHistory = kKdaMaxConvKernel - 1;
    const int c = tid % kDim, stream = tid / kDim, channel = head * kDim + c;
    if (stream < 3) {
      const int projection = stream;
      float taps[kKdaMaxConvKernel], window[kHistory];
#pragma unroll
      for (int j = 0; j < kKdaMaxConvKernel; ++j)
        taps[j] = j < p.convKernel ? p.weights.convWeight[(size_t(projection) * channels + channel) *
                                                              p.convKernel +
                                                          j]
                                   : 0.0f;
#pragma unroll
      for (int j = 0; j < kHistory; ++j) {
        const int position = chunk.begin - history + j;
        window[j] = j >= history ? 0.0f
                    : position >= chunk.sequenceBegin
                        ? p.qkv[(size_t(position) * 3 + projection) * channels + channel]
                        : p.convState[((size_t(chunk.sequence) * 3 + projection) * history +
                                       (position - chunk.sequenceBegin + history)) *
                                          channels +
                                      channel];
      }
      for (int first = 0; first < kChunk; first += kBatch) {
        float x[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          x[b] = first + b < chunk.count
                     ? p.qkv[(size_t(chunk.begin + first + b) * 3 + projection) * channels + channel]
                     : 0.0f;
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int i = first + b;
          float acc = 0.0f;
#pragma unroll
          for (int j = 0; j < kHistory; ++j)
            acc += j < history ? taps[j] * window[j] : 0.0f;
#pragma unroll
          for (int j = 0; j < kKdaMaxConvKernel; ++j)
            acc += j == history ? taps[j] * x[b] : 0.0f;
#pragma unroll
          for (int j = 0; j < kHistory; ++j)
            if (j < history)
              window[j] = j + 1 < history ? window[j + 1] : x[b];
          const float out = i < chunk.count ? acc * sigmoid(acc) : 0.0f;
          if (projection == 0)
            sh.q[i][c] = out;
          else if (projection == 1)
            sh.k[i][c] = out;
          else
            sh.valuesT[c][i] = __float2bfloat16(sh.beta[i] * out);
        }
      }
    } else {
      const float scaleA = __expf(p.weights.aLog[head]), dtBias = p.weights.dtBias[channel];
      float sum = 0.0f;
      for (int first = 0; first < kChunk; first += kBatch) {
        float f[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          f[b] = first + b < chunk.count
                     ? p.forget[size_t(chunk.begin + first + b) * channels + channel]
                     : 0.0f;
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int i = first + b;
          const float g = i < chunk.count ? forgetLogDecay(f[b] + dtBias, scaleA, p.weights) : 0.0f;
          sum += g;
          sh.G[i][c] = sum;
          sh.scratch.decay[i][c] = __expf(g);
        }
      }
    }
  }
  __syncthreads();

  // Phase 2: L2 norms per token, a warp per token.
  for (int i = warp; i < kChunk; i += kFactorThreads / 32) {
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

  // Phase 3: the four diagonal 16x16 blocks of A and Aqk, exactly: e^(G_i - G_j) as the running
  // product of the decays from token j + 1 to i. Thread = (block, column j, channel part).
  {
    constexpr int kParts = kFactorThreads / (kChunk / kBlock) / kBlock;
    const int b = tid / (kBlock * kParts), j = (tid / kParts) % kBlock, part = tid % kParts;
    const int base = b * kBlock;
    float accA[kBlock], accQ[kBlock];
#pragma unroll
    for (int i = 0; i < kBlock; ++i)
      accA[i] = accQ[i] = 0.0f;
    for (int cc = 0; cc < kDim / kParts; ++cc) {
      const int c = cc * kParts + part;
      const float kj = sh.k[base + j][c];
      float f = kj;
#pragma unroll
      for (int i = 0; i < kBlock; ++i) {
        if (i > j) {
          f *= sh.scratch.decay[base + i][c];
          accA[i] += sh.k[base + i][c] * f;
        }
        if (i >= j)
          accQ[i] += sh.q[base + i][c] * f;
      }
    }
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
#pragma unroll
      for (int offset = 1; offset < kParts; offset *= 2) {
        accA[i] += __shfl_xor_sync(0xffffffffu, accA[i], offset);
        accQ[i] += __shfl_xor_sync(0xffffffffu, accQ[i], offset);
      }
      if (part == 0) {
        sh.a[base + i][base + j] = i > j ? accA[i] : 0.0f;
        sh.aqk[base + i][base + j] = i >= j ? accQ[i] : 0.0f;
      }
    }
  }
  __syncthreads();

  // Phase 4: the off-diagonal blocks on tensor cores, block row by block row. Relative to the
  // block row's first token r, both factors are at most 1: k_i e^(G_i - G_r) (i >= r) and
  // k_j e^(G_r - G_j) (j < r).
  for (int blockRow = 1; blockRow < kChunk / kBlock; ++blockRow) {
    const int r = blockRow * kBlock;
    for (int index = tid; index < kBlock * kDim; index += kFactorThreads) {
      const int i = index / kDim, c = index % kDim;
      const float toReference = __expf(sh.G[r + i][c] - sh.G[r][c]);
      sh.scratch.offDiagonal.left[0][i][c] = __float2bfloat16(sh.k[r + i][c] * toReference);
      sh.scratch.offDiagonal.left[1][i][c] = __float2bfloat16(sh.q[r + i][c] * toReference);
    }
    for (int index = tid; index < r * kDim; index += kFactorThreads) {
      const int j = index / kDim, c = index % kDim;
      sh.scratch.offDiagonal.right[j][c] =
          __float2bfloat16(sh.k[j][c] * __expf(sh.G[r][c] - sh.G[j][c]));
    }
    __syncthreads();
    const int jobs = 2 * (r / 8); // (A or Aqk) x 8-column tiles
    for (int job = warp; job < jobs; job += kFactorThreads / 32) {
      const int which = job % 2, nTile = job / 2;
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int ks = 0; ks < kDim / 16; ++ks) {
        uint32_t aFragment[4], bFragment[2];
        loadA(aFragment, &sh.scratch.offDiagonal.left[which][0][16 * ks], kWideStride);
        loadB(bFragment, &sh.scratch.offDiagonal.right[8 * nTile][16 * ks], kWideStride);
        mma16816(acc, aFragment, bFragment);
      }
      float(*target)[kSquareStride] = which == 0 ? sh.a : sh.aqk;
#pragma unroll
      for (int e = 0; e < 4; ++e)
        target[r + accRow(e)][8 * nTile + accColumn(e)] = acc[e];
    }
    __syncthreads();
  }

  // Phase 5: T = (I + diag(beta) A)^-1 by 16x16 blocks: the diagonal blocks by substitution,
  // then T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj diagonal by diagonal.
  for (int index = tid; index < kChunk * kChunk; index += kFactorThreads) {
    const int i = index / kChunk, j = index % kChunk;
    sh.a[i][j] *= sh.beta[i];
    sh.scratch.inverse[i][j] = 0.0f;
  }
  __syncthreads();
  if (warp < 4 && lane < kBlock) {
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
  {
    const bool active = tid < kBlock * kBlock;
    const int row = (tid / kBlock) % kBlock, column = tid % kBlock;
    for (int distance = 1; distance < kChunk / kBlock; ++distance) {
      const int blocks = active ? kChunk / kBlock - distance : 0;
      for (int b = 0; b < blocks; ++b) {
        const int i = b + distance, j = b;
        float y = 0.0f;
        for (int m = j; m < i; ++m)
#pragma unroll
          for (int x = 0; x < kBlock; ++x)
            y += sh.a[kBlock * i + row][kBlock * m + x] *
                 sh.scratch.inverse[kBlock * m + x][kBlock * j + column];
        sh.partialInverse[b][row][column] = y;
      }
      __syncthreads();
      for (int b = 0; b < blocks; ++b) {
        const int i = b + distance, j = b;
        float t = 0.0f;
#pragma unroll
        for (int x = 0; x < kBlock; ++x)
          t -= sh.scratch.inverse[kBlock * i + row][kBlock * i + x] * sh.partialInverse[b][x][column];
        sh.scratch.inverse[kBlock * i + row][kBlock * j + column] = t;
      }
      __syncthreads();
    }
  }
  for (int index = tid; index < kChunk * kChunk; index += kFactorThreads) {
    const int i = index / kChunk, j = index % kChunk;
    sh.inverse16[i][j] = __float2bfloat16(sh.scratch.inverse[i][j]);
  }
  __syncthreads();

  // Phase 6: w = T (beta k e^G) and u = T (beta v) on tensor cores; warp = (row tile, a quarter
  // of the column tiles).
  for (int index = tid; index < kChunk * kDim; index += kFactorThreads) {
    const int c = index / kChunk, j = index % kChunk;
    sh.scratch.keysT[c][j] = __float2bfloat16(sh.beta[j] * sh.k[j][c] * __expf(sh.G[j][c]));
  }
  __syncthreads();
  {
    constexpr int kColumnTiles = kDim / 8 / (kFactorThreads / 32 / 4);
    const int rowTile = warp % 4, firstColumnTile = (warp / 4) * kColumnTiles;
    uint32_t aFragments[kChunk / 16][4];
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks)
      loadA(aFragments[ks], &sh.inverse16[16 * rowTile][16 * ks], kNarrowStride);
    bf16 *w = factors.w + block * kChunk * kDim, *u = factors.u + block * kChunk * kDim;
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
        const size_t at = size_t(16 * rowTile + accRow(2 * half)) * kDim + 8 * columnTile +
                          accColumn(2 * half);
        *reinterpret_cast<uint32_t *>(w + at) = packBf16(accW[2 * half], accW[2 * half + 1]);
        *reinterpret_cast<uint32_t *>(u + at) = packBf16(accU[2 * half], accU[2 * half + 1]);
      }
    }
  }

  // Phase 7: qg, kg^T, Aqk and e^G_last (G of padding tokens is the last real one's).
  {
    bf16 *qg = factors.qg + block * kChunk * kDim, *kgT = factors.kgT + block * kDim * kChunk;
    bf16 *aqk = factors.aqk + block * kChunk * kChunk;
    for (int index = tid; index < kChunk * kDim; index += kFactorThreads) {
      const int i = index / kDim, c = index % kDim;
      qg[index] = __float2bfloat16(sh.q[i][c] * __expf(sh.G[i][c]));
      const int c2 = index / kChunk, i2 = index % kChunk;
      kgT[index] = __float2bfloat16(sh.k[i2][c2] * __expf(sh.G[kChunk - 1][c2] - sh.G[i2][c2]));
    }
    for (int index = tid; index < kChunk * kChunk; index += kFactorThreads) {
      const int i = index / kChunk, j = index % kChunk;
      aqk[index] = __float2bfloat16(j <= i ? sh.aqk[i][j] : 0.0f);
    }
    if (tid < kDim)
      factors.gam[block * kDim + tid] = __expf(sh.G[kChunk - 1][tid]);
  }
}

// ---------------------------------------------------------------------------------------------
// 2. The state chain.

constexpr int kChainThreads = 128; // 4 warps

struct ChainStage {
  bf16 w[kChunk][kWideStride];
  bf16 qg[kChunk][kWideStride];
  bf16 kgT[kDim][kNarrowStride];
  bf16 aqk[kChunk][kNarrowStride];
  bf16 u[kChunk][kSliceStride];
  float gam[kDim];
};
struct ChainShared {
  ChainStage stage[2];
  bf16 stateT[kSlice][kWideStride];      // S^T of the slice in bf16: [value][key]
  bf16 newValuesT[kSlice][kNarrowStride]; // v_new^T: [value][token]
};

// Starts the asynchronous copy of one chunk's factors (this block's value slice of u).
__device__ inline void loadChunk(ChainStage &stage, const ChunkFactors &factors, size_t block,
                                 int slice) {
  const int tid = threadIdx.x;
  const bf16 *w = factors.w + block * kChunk * kDim, *qg = factors.qg + block * kChunk * kDim;
  const bf16 *kgT = factors.kgT + block * kDim * kChunk;
  const bf16 *aqk = factors.aqk + block * kChunk * kChunk;
  const bf16 *u = factors.u + block * kChunk * kDim + slice * kSlice;
  for (int index = tid; index < kChunk * kDim / 8; index += kChainThreads) {
    const int row = index / (kDim / 8), part = index % (kDim / 8);
    copyAsync16(&stage.w[row][8 * part], w + row * kDim + 8 * part);
    copyAsync16(&stage.qg[row][8 * part], qg + row * kDim + 8 * part);
  }
  for (int index = tid; index < kDim * kChunk / 8; index += kChainThreads) {
    const int row = index / (kChunk / 8), part = index % (kChunk / 8);
    copyAsync16(&stage.kgT[row][8 * part], kgT + row * kChunk + 8 * part);
  }
  for (int index = tid; index < kChunk * kChunk / 8; index += kChainThreads) {
    const int row = index / (kChunk / 8), part = index % (kChunk / 8);
    copyAsync16(&stage.aqk[row][8 * part], aqk + row * kChunk + 8 * part);
  }
  for (int index = tid; index < kChunk * kSlice / 8; index += kChainThreads) {
    const int row = index / (kSlice / 8), part = index % (kSlice / 8);
    copyAsync16(&stage.u[row][8 * part], u + row * kDim + 8 * part);
  }
  if (tid < kDim / 4)
    copyAsync16(&stage.gam[4 * tid], factors.gam + block * kDim + 4 * tid);
}

__global__ void __launch_bounds__(kChainThreads)
    stateChainKernel(KdaPrefillParams p, ChunkFactors factors) {
  extern __shared__ __align__(16) unsigned char sharedBytes[];
  ChainShared &sh = *reinterpret_cast<ChainShared *>(sharedBytes);
  const int slice = blockIdx.x, head = blockIdx.y, sequence = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int begin = p.cuSeqlens[sequence], length = p.cuSeqlens[sequence + 1] - begin;
  if (length <= 0)
    return; // an empty sequence keeps its states
  int firstChunk = 0;
  for (int s = 0; s < sequence; ++s)
    firstChunk += chunksOf(p.cuSeqlens, s);
  const int chunks = (length + kChunk - 1) / kChunk, channels = p.heads * kDim;

  // This warp's 32 key rows of the slice's K x 32 state: s[row tile][column tile][element].
  float *state = p.state + (size_t(sequence) * p.heads + head) * kDim * kDim + slice * kSlice;
  float s[2][4][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[mt][nt][e] =
            state[size_t(32 * warp + 16 * mt + accRow(e)) * kDim + 8 * nt + accColumn(e)];

  loadChunk(sh.stage[0], factors, size_t(firstChunk) * p.heads + head, slice);
  commitAsyncCopies();
  for (int c = 0; c < chunks; ++c) {
    if (c + 1 < chunks)
      loadChunk(sh.stage[(c + 1) % 2], factors, size_t(firstChunk + c + 1) * p.heads + head,
                slice);
    commitAsyncCopies();
    waitAsyncCopies<1>();
    ChainStage &st = sh.stage[c % 2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sh.stateT[8 * nt + accColumn(e)][32 * warp + 16 * mt + accRow(e)] =
              __float2bfloat16(s[mt][nt][e]);
    __syncthreads();

    // v_new = u - w S for this warp's 16 tokens.
    {
      float product[4][4] = {};
#pragma unroll
      for (int ks = 0; ks < kDim / 16; ++ks) {
        uint32_t aFragment[4];
        loadA(aFragment, &st.w[16 * warp][16 * ks], kWideStride);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          uint32_t bFragment[2];
          loadB(bFragment, &sh.stateT[8 * nt][16 * ks], kWideStride);
          mma16816(product[nt], aFragment, bFragment);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * warp + accRow(e), column = 8 * nt + accColumn(e);
          sh.newValuesT[column][row] =
              __float2bfloat16(__bfloat162float(st.u[row][column]) - product[nt][e]);
        }
    }
    __syncthreads();

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
      for (int mt = 0; mt < 2; ++mt) {
        uint32_t aFragment[4];
        loadA(aFragment, &st.kgT[32 * warp + 16 * mt][16 * ks], kNarrowStride);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          uint32_t bFragment[2];
          loadB(bFragment, &sh.newValuesT[8 * nt][16 * ks], kNarrowStride);
          mma16816(s[mt][nt], aFragment, bFragment);
        }
      }

    // O = qg S + Aqk v_new for this warp's 16 tokens (causal: token blocks up to its own).
    {
      float o[4][4] = {};
#pragma unroll
      for (int ks = 0; ks < kDim / 16; ++ks) {
        uint32_t aFragment[4];
        loadA(aFragment, &st.qg[16 * warp][16 * ks], kWideStride);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          uint32_t bFragment[2];
          loadB(bFragment, &sh.stateT[8 * nt][16 * ks], kWideStride);
          mma16816(o[nt], aFragment, bFragment);
        }
      }
      for (int ks = 0; ks <= warp; ++ks) {
        uint32_t aFragment[4];
        loadA(aFragment, &st.aqk[16 * warp][16 * ks], kNarrowStride);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          uint32_t bFragment[2];
          loadB(bFragment, &sh.newValuesT[8 * nt][16 * ks], kNarrowStride);
          mma16816(o[nt], aFragment, bFragment);
        }
      }
      const int chunkBegin = begin + c * kChunk, count = min(kChunk, length - c * kChunk);
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
    __syncthreads(); // the stage, stateT and newValuesT are free for the next chunk
  }

#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        state[size_t(32 * warp + 16 * mt + accRow(e)) * kDim + 8 * nt + accColumn(e)] =
            s[mt][nt][e];

  // The conv state after the sequence: its last W - 1 inputs, older ones from the old state
  // when the sequence is shorter (the factors kernel, which read the old state, has finished).
  if (slice == 0) {
    const int history = p.convKernel - 1, channel = head * kDim + threadIdx.x;
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
        next[j] = position >= begin
                      ? p.qkv[(size_t(position) * 3 + projection) * channels + channel]
                      : old[min(j + length, kKdaMaxConvKernel - 2)];
      }
#pragma unroll
      for (int j = 0; j < kKdaMaxConvKernel - 1; ++j)
        if (j < history)
          convState[size_t(j) * channels] = next[j];
    }
  }
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
        o[m] * scale * p.weights.normWeight[lane + 32 * m] * sigmoid(gate[lane + 32 * m]);
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
  const ChunkFactors factors{reinterpret_cast<bf16 *>(base + layout.w),
                             reinterpret_cast<bf16 *>(base + layout.u),
                             reinterpret_cast<bf16 *>(base + layout.qg),
                             reinterpret_cast<bf16 *>(base + layout.kgT),
                             reinterpret_cast<bf16 *>(base + layout.aqk),
                             reinterpret_cast<float *>(base + layout.gam)};
  cudaError_t status = cudaFuncSetAttribute(
      chunkFactorsKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(FactorShared));
  if (status == cudaSuccess)
    status = cudaFuncSetAttribute(stateChainKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  sizeof(ChainShared));
  if (status != cudaSuccess)
    return status;
  auto cudaStream = static_cast<cudaStream_t>(stream);
  chunkFactorsKernel<<<dim3(unsigned(maxChunks(params)), params.heads), kFactorThreads,
                       sizeof(FactorShared), cudaStream>>>(params, factors);
  stateChainKernel<<<dim3(kSlices, params.heads, params.sequences), kChainThreads,
                     sizeof(ChainShared), cudaStream>>>(params, factors);
  const int64_t rows = int64_t(params.tokens) * params.heads;
  gatedNormKernel<<<unsigned((rows + kNormThreads / 32 - 1) / (kNormThreads / 32)), kNormThreads,
                    0, cudaStream>>>(params);
  return static_cast<int>(cudaGetLastError());
}

KdaPrefillPath resolveKdaPrefillPath(const KdaPrefillParams &params) {
  if (params.path != KdaPrefillPath::Auto)
    return params.path;
  return params.headDim == kDim ? KdaPrefillPath::Chunked : KdaPrefillPath::Recurrent;
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
