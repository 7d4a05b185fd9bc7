// The device timeline (DeviceTimeline.h) records the kernels launched between its start and stop:
// their names, streams and device times. Labelled `gpu`; skipped without a GPU.
#include "CudaTestSupport.h"
#include "hybrid/kernels/cuda/DeviceTimeline.h"
#include "hybrid/kernels/cuda/Moe.h" // launchGatherRows: any small kernel

#include <algorithm>

namespace hybrid::kernels {
namespace {

TEST(DeviceTimeline, RecordsTheKernelsBetweenStartAndStop) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  if (!cuda::deviceTimelineBuilt())
    GTEST_SKIP() << "built without CUPTI";
  DeviceBuffer<float> x(std::vector<float>(64 * 32, 1.0f)), out(std::vector<float>(64 * 32, 0.0f));
  DeviceBuffer<int32_t> rows(std::vector<int32_t>{3, 1, 2});
  ASSERT_EQ(cuda::startDeviceTimeline(), "");
  for (int i = 0; i < 2; ++i)
    ASSERT_EQ(cuda::launchGatherRows(x.data, 32, rows.data, 3, out.data, nullptr), 0);
  std::vector<cuda::DeviceActivity> activities;
  ASSERT_EQ(cuda::stopDeviceTimeline(activities), "");
  const auto gathers = std::count_if(activities.begin(), activities.end(), [](const auto &a) {
    return a.kind == cuda::DeviceActivity::Kind::Kernel &&
           a.name.find("gatherRowsKernel") != std::string::npos && a.endNs > a.startNs;
  });
  EXPECT_EQ(gathers, 2);
  // Nothing after the stop: a second window holds only its own launch.
  ASSERT_EQ(cuda::launchGatherRows(x.data, 32, rows.data, 3, out.data, nullptr), 0);
  ASSERT_EQ(cuda::startDeviceTimeline(), "");
  ASSERT_EQ(cuda::launchGatherRows(x.data, 32, rows.data, 3, out.data, nullptr), 0);
  activities.clear();
  ASSERT_EQ(cuda::stopDeviceTimeline(activities), "");
  EXPECT_EQ(std::count_if(
                activities.begin(), activities.end(),
                [](const auto &a) { return a.name.find("gatherRowsKernel") != std::string::npos; }),
            1);
}

} // namespace
} // namespace hybrid::kernels
