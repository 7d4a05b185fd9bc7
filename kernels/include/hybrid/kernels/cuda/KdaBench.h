// Benchmarks of the CUDA KDA kernels (hybrid-bench kda-decode): CUDA events, warm-up, the median
// of repeated measurements, random (never zero) data.
#pragma once

#include "hybrid/kernels/cuda/KdaDecode.h"
#include "hybrid/kernels/cuda/KdaPrefill.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace hybrid::kernels::cuda {

struct KdaDecodeBenchResult {
  int32_t batch = 0, heads = 0, headDim = 0;
  double eagerMicroseconds = 0; // one launch per step from the host
  double graphMicroseconds = 0; // the step replayed from a CUDA graph
  double graphFloorMicroseconds = 0; // as many empty kernels as the step launches, same graph use
  double stateBytes = 0;        // state read + written per step (fp32 or bf16)
  double graphStateTbPerSecond = 0;
  double trafficBytes = 0;      // everything the step must move: state, conv state, inputs, output
  double graphTrafficTbPerSecond = 0;
  bool split = false;           // the prolog + state kernel path (KdaDecode.h)
  bool bf16State = false;       // KdaStateType::BF16
};

// Runs the fused decode step for each batch size; `error` is set (and the list empty) when CUDA
// is unavailable or a call fails.
std::vector<KdaDecodeBenchResult> benchKdaDecode(const std::vector<int32_t> &batches,
                                                 int32_t heads, int32_t headDim,
                                                 int32_t iterations, KdaDecodePath path,
                                                 KdaStateType stateType, std::string &error);

struct KdaPrefillBenchResult {
  int32_t sequences = 0, length = 0, heads = 0, headDim = 0;
  bool chunked = false;
  bool bf16State = false;      // KdaStateType::BF16
  double milliseconds = 0;     // one launch over the whole varlen batch, from a CUDA graph
  double tokensPerSecond = 0;
  double bytes = 0;            // kdaPrefillWork: what the contract must move
  double flops = 0;            // kdaPrefillWork: the chunked form's matrix products
};

// The work of one prefill call, for achieved-rate columns. bytes: the contract's minimum HBM
// traffic, fp32 per token q, k, v (before the conv), forget, output gate and output, beta per head,
// plus each (sequence, head) state read and written. flops: the chunked form's matrix products per
// 64-token chunk and head (A and Aqk, w and u: 2 C^2 D each; w S, the state update and q S:
// 2 C D^2 each; Aqk v_new: 2 C^2 D), i.e. 10 C^2 D + 6 C D^2, whichever kernel ran.
struct KdaPrefillWork {
  double bytes = 0, flops = 0;
};
KdaPrefillWork kdaPrefillWork(int32_t sequences, int32_t length, int32_t heads, int32_t headDim);

// The H200's measured ceilings (../shared/docs/PERF_TARGETS.md).
constexpr double kH200CopyTbPerSecond = 4.28;      // device-to-device copy, read + write
constexpr double kH200Bf16DenseTflops = 790.0;     // cuBLAS bf16 GEMM 8192^3

// Times the prefill (KdaPrefill.h, the given path) on `sequences` sequences of `length` tokens
// each, with initial and final states, for each (sequences, length) pair.
std::vector<KdaPrefillBenchResult>
benchKdaPrefill(const std::vector<std::pair<int32_t, int32_t>> &shapes, int32_t heads,
                int32_t headDim, int32_t iterations, KdaPrefillPath path, KdaStateType stateType,
                std::string &error);

// The targets on the H200 (../shared/docs/PERF_TARGETS.md) for the shapes that have one,
// as the benchmark's verdict column: "<= 3 us: 1.90x over", ">= 4.0 TB/s: met", ... Empty for
// shapes without a target; runs with a bf16 state say so (the peers' figures are fp32 states). Pure functions of the result, so they are tested without a GPU.
std::string kdaDecodeTargetVerdict(const KdaDecodeBenchResult &result);
std::string kdaPrefillTargetVerdict(const KdaPrefillBenchResult &result);

} // namespace hybrid::kernels::cuda
