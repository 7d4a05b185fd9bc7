// The CUDA generator of synthetic weights against the host one: the same bytes for every kind,
// storage, layout and source window (the decay kinds, computed through double log/exp, within one
// fp32 ulp).
#include "hybrid/kernels/cuda/SyntheticWeights.h"

#include "CudaTestSupport.h"

#include <cstring>
#include <numbers>

namespace hybrid::kernels {
namespace {

struct Case {
  const char *name;
  SyntheticKind kind;
  SyntheticStorage storage;
  float a, b;
  int64_t rows, cols, tileRows, tileCols;
  int64_t sourceRowStride = 0, sourceOffset = 0; // a sharded rank's slice of the tensor
};

TEST(SyntheticWeightsCuda, DeviceBytesEqualTheHostBytes) {
  if (!gpuPresent())
    GTEST_SKIP() << "no GPU";
  const float unit = static_cast<float>(std::numbers::sqrt3 / 65536.0);
  const Case cases[] = {
      {"bf16 weight", SyntheticKind::Normal, SyntheticStorage::BF16, 0.06f * unit, 0.0f, 777, 1031,
       0, 0},
      {"bf16 norm", SyntheticKind::Normal, SyntheticStorage::BF16, 0.1f * unit, 1.0f, 1, 4099, 0, 0},
      {"f32 bias", SyntheticKind::Normal, SyntheticStorage::F32, 0.06f * unit, 0.0f, 3, 1000, 0, 0},
      {"fp8 codes", SyntheticKind::Normal, SyntheticStorage::F8E4M3, 128.0f * unit, 0.0f, 300, 520,
       0, 0},
      {"tiled bf16", SyntheticKind::Normal, SyntheticStorage::BF16, 0.06f * unit, 0.0f, 70, 100, 16,
       32},
      {"block scales", SyntheticKind::Constant, SyntheticStorage::F32, 0.0f, 0.0005f, 3, 5, 0, 0},
      {"A_log", SyntheticKind::LogUniform, SyntheticStorage::F32, 1.0f, 16.0f, 1, 4096, 0, 0},
      {"dt_bias", SyntheticKind::DecayTimeBias, SyntheticStorage::F32, 1e-3f, 1e-1f, 1, 4096, 0, 0},
      {"bf16 row slice", SyntheticKind::Normal, SyntheticStorage::BF16, 0.06f * unit, 0.0f, 300,
       1031, 0, 0, 0, 300 * 1031},
      {"bf16 column slice", SyntheticKind::Normal, SyntheticStorage::BF16, 0.06f * unit, 0.0f, 777,
       515, 0, 0, 1031, 515},
      {"tiled column slice", SyntheticKind::Normal, SyntheticStorage::BF16, 0.06f * unit, 0.0f, 70,
       50, 16, 32, 100, 40},
      {"A_log heads", SyntheticKind::LogUniform, SyntheticStorage::F32, 1.0f, 16.0f, 1, 2048, 0, 0,
       4096, 2048},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.name);
    SyntheticFill fill{.kind = c.kind,
                       .storage = c.storage,
                       .key = 0xfeedULL,
                       .a = c.a,
                       .b = c.b,
                       .rows = c.rows,
                       .cols = c.cols,
                       .tileRows = c.tileRows,
                       .tileCols = c.tileCols,
                       .sourceRowStride = c.sourceRowStride,
                       .sourceOffset = c.sourceOffset};
    const int64_t paddedRows = c.tileRows ? (c.rows + c.tileRows - 1) / c.tileRows * c.tileRows
                                          : c.rows;
    const int64_t paddedCols = c.tileCols ? (c.cols + c.tileCols - 1) / c.tileCols * c.tileCols
                                          : c.cols;
    fill.storedElements = paddedRows * paddedCols;
    const size_t bytes = static_cast<size_t>(fill.storedElements * syntheticStorageBytes(c.storage));
    std::vector<uint8_t> host(bytes);
    ref::fillSynthetic(fill, host.data());
    DeviceBuffer<uint8_t> device(std::vector<uint8_t>(bytes, 0xff));
    ASSERT_EQ(cuda::launchSyntheticFill(fill, device.data, nullptr), 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint8_t> fromDevice = device.download();
    if (c.kind != SyntheticKind::LogUniform && c.kind != SyntheticKind::DecayTimeBias) {
      EXPECT_EQ(fromDevice, host);
      continue;
    }
    for (int64_t i = 0; i < fill.storedElements; ++i) {
      float h = 0, d = 0;
      std::memcpy(&h, host.data() + 4 * i, 4);
      std::memcpy(&d, fromDevice.data() + 4 * i, 4);
      ASSERT_LE(std::fabs(h - d), std::fabs(h) * 1.2e-7f) << "element " << i;
    }
  }
}

TEST(SyntheticWeightsCuda, RejectsANullOutput) {
  SyntheticFill fill;
  fill.storedElements = 16;
  EXPECT_EQ(cuda::launchSyntheticFill(fill, nullptr, nullptr), int(cudaErrorInvalidValue));
}

} // namespace
} // namespace hybrid::kernels
