// The MoE kernels' benchmark (hybrid-bench moe): the routed experts of a decode step (each token's
// top-k experts, per (token, expert) on CUDA cores) at given shapes, replayed from a CUDA graph,
// with the bytes of expert weights the step must read. CUDA-free header.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hybrid::kernels::cuda {

struct MoeBenchResult {
  int32_t tokens = 0, experts = 0, topK = 0, hidden = 0, intermediate = 0;
  int32_t layers = 1;           // MoE layers in the graph, each choosing its own experts
  bool fp8 = false;             // E4M3 experts with 128 x 128 block scales, else bf16
  double microseconds = 0;      // one decode step's routed experts (one layer's)
  double weightBytes = 0;       // the distinct experts' gate, up and down weights (and scales)
  double floorMicroseconds = 0; // weightBytes at the measured copy bandwidth
  double terabytesPerSecond = 0; // weightBytes / microseconds: issue 7's "effective" bandwidth
};

// bf16 experts, or with `fp8` DeepSeek-V3.2's kind (E4M3 codes, one fp32 scale per 128 x 128
// block, inputs rounded per 128 values), each token choosing topK distinct random experts,
// `layers` launches in a row (each its own choice) per timed graph; times and bytes per layer.
std::vector<MoeBenchResult> benchMoeDecode(const std::vector<int32_t> &tokens, int32_t experts,
                                           int32_t topK, int32_t hidden, int32_t intermediate,
                                           bool fp8, int32_t layers, int32_t iterations,
                                           std::string &error);

// Issue 7's target: >= 3.5 TB/s effective for one token's top-8 at Kimi-Linear-48B shapes (bf16
// experts; FP8 rows get no verdict).
std::string moeTargetVerdict(const MoeBenchResult &result);

} // namespace hybrid::kernels::cuda
