// The benchmark's verdicts against the H200 targets: pure functions, no GPU needed.
#include "hybrid/kernels/cuda/KdaBench.h"

#include <gtest/gtest.h>

namespace hybrid::kernels::cuda {
namespace {

TEST(KdaTargets, DecodeLatencyAtBatchOne) {
  KdaDecodeBenchResult r;
  r.batch = 1;
  r.heads = 32;
  r.headDim = 128;
  r.graphMicroseconds = 5.7;
  EXPECT_EQ(kdaDecodeTargetVerdict(r), "<= 3 us: 1.90x over");
  r.graphMicroseconds = 2.9;
  EXPECT_EQ(kdaDecodeTargetVerdict(r), "<= 3 us: met");
}

TEST(KdaTargets, DecodeBandwidthAtBatch128) {
  KdaDecodeBenchResult r;
  r.batch = 128;
  r.heads = 32;
  r.headDim = 128;
  r.graphStateTbPerSecond = 3.2;
  EXPECT_EQ(kdaDecodeTargetVerdict(r), ">= 4.0 TB/s state: 80% of it");
  r.graphStateTbPerSecond = 4.1;
  EXPECT_EQ(kdaDecodeTargetVerdict(r), ">= 4.0 TB/s state: met");
}

// The peers' figures are fp32 states: a bf16-state run is not held to them, and says so.
TEST(KdaTargets, Bf16StateRunsAreNotJudgedAgainstFp32Targets) {
  KdaDecodeBenchResult decode;
  decode.batch = 128;
  decode.heads = 32;
  decode.headDim = 128;
  decode.graphStateTbPerSecond = 4.1;
  decode.bf16State = true;
  EXPECT_EQ(kdaDecodeTargetVerdict(decode), "bf16 state: targets are for fp32");
  KdaPrefillBenchResult prefill;
  prefill.sequences = 1;
  prefill.length = 8192;
  prefill.heads = 32;
  prefill.headDim = 128;
  prefill.milliseconds = 0.4;
  prefill.bf16State = true;
  EXPECT_EQ(kdaPrefillTargetVerdict(prefill), "bf16 state: targets are for fp32");
}

TEST(KdaTargets, ShapesWithoutTargetsHaveNoVerdict) {
  KdaDecodeBenchResult decode;
  decode.batch = 8;
  decode.heads = 32;
  decode.headDim = 128;
  EXPECT_EQ(kdaDecodeTargetVerdict(decode), "");
  decode.batch = 1;
  decode.headDim = 64;
  EXPECT_EQ(kdaDecodeTargetVerdict(decode), "");
  KdaPrefillBenchResult prefill;
  prefill.sequences = 2;
  prefill.length = 8192;
  prefill.heads = 32;
  prefill.headDim = 128;
  EXPECT_EQ(kdaPrefillTargetVerdict(prefill), "");
}

TEST(KdaTargets, PrefillOneLongSequenceAndVarlen) {
  KdaPrefillBenchResult r;
  r.sequences = 1;
  r.length = 8192;
  r.heads = 32;
  r.headDim = 128;
  r.milliseconds = 21.5;
  EXPECT_EQ(kdaPrefillTargetVerdict(r), "<= 0.43 ms: 50.00x over");
  r.heads = 96;
  r.milliseconds = 1.0;
  EXPECT_EQ(kdaPrefillTargetVerdict(r), "<= 1.16 ms: met");
  r.sequences = 8;
  r.length = 1024;
  r.heads = 32;
  r.milliseconds = 0.736;
  EXPECT_EQ(kdaPrefillTargetVerdict(r), "<= 0.37 ms: 2.00x over");
}

TEST(KdaTargets, PrefillWorkCountsTheContractAndTheChunkedProducts) {
  // 1 x 8192 tokens, 32 heads of 128: 6 fp32 rows of 4096 + 32 betas per token, the 64 KiB state
  // of each head read and written; 128 chunks x 32 heads x (10 * 64^2 * 128 + 6 * 64 * 128^2).
  const KdaPrefillWork work = kdaPrefillWork(1, 8192, 32, 128);
  EXPECT_DOUBLE_EQ(work.bytes, 8192.0 * (6 * 4096 + 32) * 4 + 32.0 * 128 * 128 * 4 * 2);
  EXPECT_DOUBLE_EQ(work.flops, 128.0 * 32 * (10.0 * 64 * 64 * 128 + 6.0 * 64 * 128 * 128));
  // A partial chunk counts as a whole one (the kernel pads it); sequences multiply.
  EXPECT_DOUBLE_EQ(kdaPrefillWork(3, 65, 2, 64).flops,
                   3 * 2.0 * 2 * (10.0 * 64 * 64 * 64 + 6.0 * 64 * 64 * 64));
}

} // namespace
} // namespace hybrid::kernels::cuda
