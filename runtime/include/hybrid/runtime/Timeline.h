// Reading a device timeline (kernels::cuda::DeviceActivity, as `hybrid-bench e2e --timeline`
// records one decode step): where the step's time goes, per stream and per kernel, and how much of
// the communication (NCCL's kernels) other streams' work hid; and the timeline as a Chrome trace
// (chrome://tracing, Perfetto). Pure C++: no device needed.
#pragma once

#include "hybrid/kernels/cuda/DeviceTimeline.h"
#include "hybrid/runtime/Status.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace hybrid::bench {

using kernels::cuda::DeviceActivity;

struct TimelineSummary {
  double spanUs = 0; // the first start to the last end
  struct Stream {
    uint32_t id = 0;
    int64_t activities = 0;
    double busyUs = 0; // the union of its activities' intervals
  };
  std::vector<Stream> streams; // busiest first
  // Per name (a kernel's without its namespaces and arguments), over all streams: `totalUs` sums
  // the activities' own intervals; `exposedUs` only what each adds to its stream after the
  // stream's earlier activities ended (a dependent launch that waits on its predecessor counts
  // from that one's end), so a stream's exposed times sum to its busy time.
  struct Name {
    std::string name;
    int64_t count = 0;
    double totalUs = 0, exposedUs = 0;
  };
  std::vector<Name> names; // most exposed first
  // Communication: the union of the activities whose name holds "nccl" (any case); `hiddenUs` is
  // the part of it during which some other activity (not communication) ran.
  double communicationUs = 0, communicationHiddenUs = 0;
  // Idle: the span's time with no activity on any stream (the host's share of a step: waking
  // from a synchronization, queueing the next work). `gaps` are the longest such stretches,
  // each named by the activity that ended last before it and the one that started after it.
  struct Gap {
    double us = 0;
    std::string before, after;
  };
  double idleUs = 0;
  std::vector<Gap> gaps; // longest first, at most kTimelineGaps
};
inline constexpr size_t kTimelineGaps = 5;

TimelineSummary summarizeTimeline(std::span<const DeviceActivity> activities);

// A line per stream and per name (the `topNames` most exposed: launches, exposed time, exposed
// time a launch, total time), and the communication's share.
std::string formatTimelineSummary(const TimelineSummary &summary, int topNames = 25);

// The short name summaries group by: "ns::kernel<36>(args)" -> "kernel<36>", "void f()" -> "f".
std::string shortActivityName(const std::string &name);

// One labelled timeline (a benchmark row) per process of the trace, a stream per thread, times in
// microseconds from the label's first start.
struct LabelledTimeline {
  std::string label;
  std::vector<DeviceActivity> activities;
};
std::string chromeTraceJson(std::span<const LabelledTimeline> timelines);
// The timelines of a trace chromeTraceJson wrote (times relative to each label's first start);
// `source` names the trace in errors.
StatusOr<std::vector<LabelledTimeline>> readChromeTrace(const std::string &text,
                                                        const std::string &source);

// Two summaries side by side (`hybrid-bench timeline --against`): the spans, then per name the
// exposed time in each and the difference, the `topNames` largest differences first.
std::string compareTimelineSummaries(const TimelineSummary &base, const TimelineSummary &candidate,
                                     int topNames = 25);

} // namespace hybrid::bench
