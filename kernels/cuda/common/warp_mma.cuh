// Warp-level tensor-core helpers: mma.sync m16n8k16 (bf16 in, fp32 accumulate) and m16n8k32 (E4M3
// in) with fragments
// loaded from shared memory, and cp.async for staging tiles. Fragment layouts are those of the PTX
// ISA ("Matrix Fragments for mma.m16n8k16"): lane = 4 * group + pair.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace hybrid::kernels::cuda::mma {

// d += a * b for one 16x16 (A, row-major) by 16x8 (B, column-major) tile.
__device__ inline void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ inline unsigned sharedAddress(const void *p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The A fragment of the 16x16 tile at `tile` of a row-major bf16 matrix in shared memory (`stride`
// elements per row, a multiple of 8; the k index is contiguous): one ldmatrix.x4, lanes 0-15
// naming rows 0-15 at k 0 and lanes 16-31 the same rows at k 8. Rows start (stride / 2) mod 32
// words apart; 4 mod 32 (or any step that spreads 8 rows over distinct 4-bank groups) is
// conflict-free.
__device__ inline void loadA(uint32_t (&a)[4], const __nv_bfloat16 *tile, int stride) {
  const int lane = threadIdx.x % 32;
  const __nv_bfloat16 *p = tile + (lane % 16) * stride + (lane / 16) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(sharedAddress(p)));
}

// The B fragment of the 16(k)x8(n) tile at `tile` of a matrix in shared memory stored n-major:
// row n holds the k values contiguously (`stride` elements per row, a multiple of 8). One
// ldmatrix.x2: lanes 0-7 name rows 0-7 at k 0, lanes 8-15 at k 8.
__device__ inline void loadB(uint32_t (&b)[2], const __nv_bfloat16 *tile, int stride) {
  const int lane = threadIdx.x % 32;
  const __nv_bfloat16 *p = tile + (lane % 8) * stride + ((lane / 8) % 2) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(b[0]), "=r"(b[1])
               : "r"(sharedAddress(p)));
}

// The B fragments of two adjacent 8-column tiles (rows 0-7 and 8-15 of the n-major storage at
// `tile`): one ldmatrix.x4.
__device__ inline void loadBPair(uint32_t (&first)[2], uint32_t (&second)[2],
                                 const __nv_bfloat16 *tile, int stride) {
  const int lane = threadIdx.x % 32;
  const __nv_bfloat16 *p = tile + (lane % 8 + 8 * (lane / 16)) * stride + ((lane / 8) % 2) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(first[0]), "=r"(first[1]), "=r"(second[0]), "=r"(second[1])
               : "r"(sharedAddress(p)));
}

// The B fragment of the 16(k)x8(n) tile at `tile` of a matrix in shared memory stored k-major:
// row k holds the n values contiguously (`stride` elements per row, rows 16-byte aligned). One
// ldmatrix.x2.trans: lanes 0-7 name rows k 0-7, lanes 8-15 rows 8-15 (e.g. V in P V).
__device__ inline void loadBTrans(uint32_t (&b)[2], const __nv_bfloat16 *tile, int stride) {
  const int lane = threadIdx.x % 32;
  const __nv_bfloat16 *p = tile + (lane % 16) * stride;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(b[0]), "=r"(b[1])
               : "r"(sharedAddress(p)));
}

// The B fragments of two adjacent 8-column tiles of the k-major storage at `tile` (columns 0-7
// and 8-15, k 0-15): one ldmatrix.x4.trans, lanes 8m..8m+7 naming rows k 8(m%2).. at column
// 8(m/2).
__device__ inline void loadBTransPair(uint32_t (&first)[2], uint32_t (&second)[2],
                                      const __nv_bfloat16 *tile, int stride) {
  const int lane = threadIdx.x % 32;
  const __nv_bfloat16 *p = tile + (lane % 8 + 8 * ((lane / 8) % 2)) * stride + 8 * (lane / 16);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(first[0]), "=r"(first[1]), "=r"(second[0]), "=r"(second[1])
               : "r"(sharedAddress(p)));
}

// d = a * b for one 16x32 (A, row-major) by 32x8 (B, column-major) tile of E4M3 codes, fp32
// out (sm_89+). Fragments ("Matrix Fragments for mma.m16n8k32", 8-bit types): a[0] holds row
// `group`, k 4*pair..+3; a[1] row group+8; a[2], a[3] the same rows at k + 16; b[0] column
// `group`, k 4*pair..+3; b[1] k + 16. Four codes per register, the lowest k in the low byte.
__device__ inline void mmaE4m3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};\n"
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
}

// d += a * b, the fragments as mmaE4m3's.
__device__ inline void mmaE4m3Add(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The (row, column) of accumulator element e (0..3) of this lane within its 16x8 tile.
__device__ inline int accRow(int e) { return (threadIdx.x % 32) / 4 + (e >= 2 ? 8 : 0); }
__device__ inline int accColumn(int e) { return 2 * (threadIdx.x % 4) + (e & 1); }

__device__ inline uint32_t packBf16(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t *>(&pair);
}

__device__ inline uint32_t packF16(float low, float high) {
  const __half2 pair = __floats2half2_rn(low, high);
  return *reinterpret_cast<const uint32_t *>(&pair);
}

// 16-byte global -> shared copy that bypasses the registers; completes at waitAsyncCopies.
__device__ inline void copyAsync16(void *shared, const void *global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sharedAddress(shared)),
               "l"(global));
}
// 4-byte copy for rows that are only 4-byte aligned.
__device__ inline void copyAsync4(void *shared, const void *global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(sharedAddress(shared)),
               "l"(global));
}
__device__ inline void commitAsyncCopies() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `kPending` committed groups are still in flight.
template <int kPending> __device__ inline void waitAsyncCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Named barriers (ids 1..15; 0 is __syncthreads) over `threads` threads, a multiple of 32: for
// roles of a block that wait on each other (producer and consumer warps) without stopping the
// whole block. Arrive signals without waiting.
__device__ inline void namedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ inline void namedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

} // namespace hybrid::kernels::cuda::mma
