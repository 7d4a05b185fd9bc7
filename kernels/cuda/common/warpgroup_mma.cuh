// Warpgroup tensor-core helpers (sm_90a wgmma): shared-memory matrix descriptors for the 128-byte
// swizzled layout, the async fences, and the shapes the sparse MLA and DSA indexer kernels multiply
// (bf16, f16 or E4M3 in, fp32 accumulate). Layout facts are those of the PTX ISA ("Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate", "Matrix Descriptor Format", "Shared Memory Matrix
// Layout").
//
// The 128-byte swizzled layout this file assumes: a matrix of R rows and C bf16 columns (C a
// multiple of 64) is stored as C / 64 column chunks of R rows x 128 bytes, each chunk 1024-byte
// aligned; within a chunk, the 16-byte unit u of row r sits at unit u ^ (r % 8). The same bytes
// serve as a K-major operand (rows = M or N, columns = K) and as an N-major one (rows = K,
// columns = N). swizzledOffset gives an element's byte offset.
#pragma once

#include <cstdint>

namespace hybrid::kernels::cuda::wgmma {

// Byte offset of element (row, column) in the swizzled layout of a matrix with `rows` rows.
__host__ __device__ constexpr uint32_t swizzledOffset(int rows, int row, int column) {
  const int chunk = column / 64, unit = column % 64 / 8;
  return uint32_t(chunk * rows * 128 + row * 128 + ((unit ^ (row % 8)) * 16) + column % 8 * 2);
}

// The descriptor of the 8-row groups starting at shared address `address` (1024-byte aligned
// chunk, plus 32 bytes per 16-column k step inside it): 128-byte swizzle, 1024 bytes between 8-row
// groups. Both offset fields hold 1024: an operand here never spans two chunks along its
// contiguous dimension, so only the 8-row stride is read, whichever field the major-ness uses.
__device__ inline uint64_t descriptor(uint32_t address) {
  return uint64_t((address >> 4) & 0x3FFF) | uint64_t(1024 >> 4) << 16 |
         uint64_t(1024 >> 4) << 32 | uint64_t(1) << 62;
}

// Orders this warpgroup's earlier register writes of accumulators before the wgmmas that follow.
__device__ inline void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending> __device__ inline void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Makes generic-proxy shared-memory writes (st.shared) visible to the wgmma (async proxy) reads
// that follow the next barrier.
__device__ inline void sharedWritesToAsyncProxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving uses of the accumulators across wgmma issue and wait (it does
// not know the registers are written asynchronously).
template <int N> __device__ inline void fenceOperands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x 32) += A (64 x 16) * B (16 x 32); A and B K-major in shared memory.
__device__ inline void mma64x32(float (&d)[16], uint64_t a, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
               "%16, %17, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "l"(a), "l"(b), "r"(1));
}

// d (64 x 16) += A (64 x 16) * B (16 x 16); A and B K-major in shared memory.
__device__ inline void mma64x16(float (&d)[8], uint64_t a, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                 "+f"(d[7])
               : "l"(a), "l"(b), "r"(1));
}

// d (64 x 64) += A (64 x 16, K-major) * B (16 x 64) stored N-major (the rows are k).
__device__ inline void mma64x64Transposed(float (&d)[32], uint64_t a, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "%32, %33, p, 1, 1, 0, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "l"(a), "l"(b), "r"(1));
}

// d (64 x 64) = A (64 x 16) * B (16 x 64) (+ d when `accumulate`); A in registers (bf16 pairs:
// each warp its 16 rows in mma.sync's m16n8k16 A-fragment order), B K-major in shared memory.
__device__ inline void mma64x64RegisterA(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                         bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)));
}

// The same with f16 A and B (every E4M3 code is exact in f16: the DSA indexer's keys widen to it by
// one conversion instruction a pair).
__device__ inline void mma64x64RegisterAF16(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                            bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)));
}

// d (64 x 64) = A (64 x 32) * B (32 x 64) (+ d when `accumulate`) on E4M3 codes, both K-major in
// shared memory (FP8 wgmmas take no transposed operand): the products are exact in fp32.
__device__ inline void mma64x64E4M3(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
               "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "%32, %33, p, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                 "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
                 "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
                 "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
                 "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
                 "+f"(d[31])
               : "l"(a), "l"(b), "r"(int(accumulate)));
}

} // namespace hybrid::kernels::cuda::wgmma
