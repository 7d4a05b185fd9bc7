// What the GPU did between two points of a program, as CUPTI's activity records report it: every
// kernel (also those a CUDA graph launches, and NCCL's), copy and memset with its stream and its
// start and end on the device's clock. For `hybrid-bench e2e --timeline`: where a decode step's
// time goes with graphs, dependent launches and several streams, which a profiler replaying
// kernels one at a time cannot show. CUDA-free header; without CUPTI in the build, or without a
// device, collection fails with a message.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hybrid::kernels::cuda {

struct DeviceActivity {
  enum class Kind { Kernel, Copy, Memset };
  Kind kind = Kind::Kernel;
  std::string name;    // a kernel's demangled name; "copy <direction>" or "memset"
  uint32_t stream = 0; // CUPTI's stream id
  uint64_t startNs = 0, endNs = 0;
};

// Whether this build collects timelines (CUPTI found at configure time).
bool deviceTimelineBuilt();

// Starts recording (the activities of every stream and graph on every device of the process);
// "" or what failed.
std::string startDeviceTimeline();
// Waits for the device, stops recording and appends what was recorded since the start, in no
// particular order; "" or what failed.
std::string stopDeviceTimeline(std::vector<DeviceActivity> &activities);

} // namespace hybrid::kernels::cuda
