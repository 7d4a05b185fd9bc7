#include "hybrid/kernels/cuda/KdaBench.h"

#include <cmath>
#include <cstdio>

namespace hybrid::kernels::cuda {
namespace {

// "<= 3 us: met" or "<= 3 us: 1.90x over" for a time that should be at most `limit`.
std::string atMost(double value, double limit, const char *limitText) {
  char text[96];
  if (value <= limit)
    std::snprintf(text, sizeof text, "%s: met", limitText);
  else
    std::snprintf(text, sizeof text, "%s: %.2fx over", limitText, value / limit);
  return text;
}

} // namespace

std::string kdaDecodeTargetVerdict(const KdaDecodeBenchResult &r) {
  if (r.heads != 32 || r.headDim != 128)
    return {};
  if (r.bf16State)
    return "bf16 state: targets are for fp32";
  if (r.batch == 1)
    return atMost(r.graphMicroseconds, 3.0, "<= 3 us");
  if (r.batch == 128) {
    constexpr double kTarget = 4.0; // TB/s of effective state traffic
    char text[96];
    if (r.graphStateTbPerSecond >= kTarget)
      std::snprintf(text, sizeof text, ">= 4.0 TB/s state: met");
    else
      std::snprintf(text, sizeof text, ">= 4.0 TB/s state: %.0f%% of it",
                    100.0 * r.graphStateTbPerSecond / kTarget);
    return text;
  }
  return {};
}

KdaPrefillWork kdaPrefillWork(int32_t sequences, int32_t length, int32_t heads, int32_t headDim) {
  const double tokens = double(sequences) * length, P = double(heads) * headDim, D = headDim;
  KdaPrefillWork work;
  // Per token: q, k, v, forget, gate in and the output out (6 P floats), beta (H floats).
  work.bytes = tokens * (6 * P + heads) * 4 + double(sequences) * heads * D * D * 4 * 2;
  constexpr double kChunk = 64;
  const double chunks = double(sequences) * std::ceil(double(length) / kChunk);
  work.flops = chunks * heads * (10 * kChunk * kChunk * D + 6 * kChunk * D * D);
  return work;
}

std::string kdaPrefillTargetVerdict(const KdaPrefillBenchResult &r) {
  if (r.headDim != 128 || (r.heads != 32 && r.heads != 96))
    return {};
  if (r.bf16State)
    return "bf16 state: targets are for fp32";
  const bool wide = r.heads == 96;
  if (r.sequences == 1 && r.length == 8192)
    return wide ? atMost(r.milliseconds, 1.16, "<= 1.16 ms") : atMost(r.milliseconds, 0.43, "<= 0.43 ms");
  if (r.sequences == 8 && r.length == 1024) // 0.8x FlashKDA's 0.46 / 1.24 ms
    return wide ? atMost(r.milliseconds, 0.992, "<= 0.99 ms") : atMost(r.milliseconds, 0.368, "<= 0.37 ms");
  return {};
}

} // namespace hybrid::kernels::cuda
