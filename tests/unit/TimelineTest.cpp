// Reading device timelines (Timeline.h): busy and exposed times per stream and name with
// overlapping (dependent) launches, the communication's hidden share, short names, the Chrome
// trace.
#include "hybrid/runtime/Timeline.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace hybrid::bench {
namespace {

DeviceActivity kernel(const std::string &name, uint32_t stream, uint64_t startUs, uint64_t endUs) {
  return {DeviceActivity::Kind::Kernel, name, stream, startUs * 1000, endUs * 1000};
}

const TimelineSummary::Name &named(const TimelineSummary &s, const std::string &name) {
  for (const auto &n : s.names)
    if (n.name == name)
      return n;
  static const TimelineSummary::Name none;
  ADD_FAILURE() << "no name " << name;
  return none;
}

TEST(Timeline, ShortNamesDropNamespacesReturnTypesAndArguments) {
  EXPECT_EQ(shortActivityName("void hybrid::kernels::cuda::(anonymous namespace)::"
                              "gateUpStreamedKernel<36>(hybrid::kernels::cuda::MoeExpertsParams, "
                              "float*)"),
            "gateUpStreamedKernel<36>");
  EXPECT_EQ(shortActivityName("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<"
                              "4096ul>)"),
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL");
  EXPECT_EQ(shortActivityName("void cutlass::Kernel2<cutlass::gemm::Foo<int, (cute::X)1> >(int)"),
            "Kernel2<cutlass::gemm::Foo<int, (cute::X)1> >");
  EXPECT_EQ(shortActivityName("memset"), "memset");
  // Copies keep their names in summaries.
  const std::vector<DeviceActivity> copy = {
      {DeviceActivity::Kind::Copy, "copy device to host", 1, 0, 1000}};
  EXPECT_EQ(summarizeTimeline(copy).names.at(0).name, "copy device to host");
}

// Stream 1: a (0-10), then b launched early as a dependent (5-14: it waits from 5 to 10), then a
// gap, then a again (20-25). Stream 2: c (2-4). Exposed: a 10 + 5, b 4 (10-14), c 2; busy: stream
// 1 19 us, stream 2 2 us; span 25 us.
TEST(Timeline, ExposedTimeCountsFromTheStreamsPreviousEnd) {
  const std::vector<DeviceActivity> activities = {
      kernel("void ns::a(int)", 1, 0, 10), kernel("void ns::b<2>(float*)", 1, 5, 14),
      kernel("void ns::a(int)", 1, 20, 25), kernel("c", 2, 2, 4)};
  const TimelineSummary s = summarizeTimeline(activities);
  EXPECT_DOUBLE_EQ(s.spanUs, 25.0);
  ASSERT_EQ(s.streams.size(), 2u);
  EXPECT_EQ(s.streams[0].id, 1u); // busiest first
  EXPECT_EQ(s.streams[0].activities, 3);
  EXPECT_DOUBLE_EQ(s.streams[0].busyUs, 19.0);
  EXPECT_DOUBLE_EQ(s.streams[1].busyUs, 2.0);
  EXPECT_EQ(named(s, "a").count, 2);
  EXPECT_DOUBLE_EQ(named(s, "a").exposedUs, 15.0);
  EXPECT_DOUBLE_EQ(named(s, "a").totalUs, 15.0);
  EXPECT_DOUBLE_EQ(named(s, "b<2>").exposedUs, 4.0);
  EXPECT_DOUBLE_EQ(named(s, "b<2>").totalUs, 9.0);
  EXPECT_DOUBLE_EQ(named(s, "c").exposedUs, 2.0);
  EXPECT_EQ(s.names.front().name, "a"); // most exposed first
  EXPECT_DOUBLE_EQ(s.communicationUs, 0.0);
  const std::string text = formatTimelineSummary(s);
  EXPECT_NE(text.find("span 25.0 us, 2 streams"), std::string::npos) << text;
  // a: 2 launches, 15 us exposed, 7.50 a launch, 15 total.
  EXPECT_NE(text.find("       2        15.0        7.50        15.0"), std::string::npos) << text;
  EXPECT_EQ(text.find("communication"), std::string::npos) << text;
  // Idle: 14-20, after b (the furthest-reaching activity so far), before the second a.
  EXPECT_DOUBLE_EQ(s.idleUs, 6.0);
  ASSERT_EQ(s.gaps.size(), 1u);
  EXPECT_DOUBLE_EQ(s.gaps[0].us, 6.0);
  EXPECT_EQ(s.gaps[0].before, "b<2>");
  EXPECT_EQ(s.gaps[0].after, "a");
  EXPECT_NE(text.find("idle 6.0 us (no stream busy)"), std::string::npos) << text;
  EXPECT_NE(text.find("      6.0 us  b<2> -> a"), std::string::npos) << text;
}

// Seven idle stretches between kernels on two streams (1, 2, ..., 7 us, one of them hidden
// by the other stream's kernel): the idle time sums the uncovered ones, and the longest five
// are kept, longest first, each named by its neighbours.
TEST(Timeline, IdleGapsAreTheTimeNoStreamIsBusy) {
  std::vector<DeviceActivity> activities;
  uint64_t t = 0;
  for (int i = 1; i <= 7; ++i) {
    activities.push_back(kernel("k" + std::to_string(i), 1, t, t + 10));
    t += 10 + uint64_t(i); // then i us of nothing on stream 1
  }
  activities.push_back(kernel("k8", 1, t, t + 10));
  activities.push_back(kernel("cover", 2, 10, 11)); // fills the first stretch (10-11)
  const TimelineSummary s = summarizeTimeline(activities);
  EXPECT_DOUBLE_EQ(s.idleUs, 2.0 + 3 + 4 + 5 + 6 + 7);
  ASSERT_EQ(s.gaps.size(), kTimelineGaps);
  EXPECT_DOUBLE_EQ(s.gaps[0].us, 7.0);
  EXPECT_EQ(s.gaps[0].before, "k7");
  EXPECT_EQ(s.gaps[0].after, "k8");
  EXPECT_DOUBLE_EQ(s.gaps[4].us, 3.0);
  EXPECT_EQ(s.gaps[4].before, "k3");
  // Comparing two summaries reports the idle time's change too.
  const TimelineSummary none = summarizeTimeline(std::vector<DeviceActivity>{kernel("k", 1, 0, 5)});
  EXPECT_DOUBLE_EQ(none.idleUs, 0.0);
  EXPECT_TRUE(none.gaps.empty());
  const std::string compared = compareTimelineSummaries(none, s, 5);
  EXPECT_NE(compared.find("idle 0.0 -> 27.0 us (+27.0)"), std::string::npos) << compared;
}

// NCCL on stream 3 (0-10 and 30-40); compute on stream 1 (5-35, two kernels touching): hidden
// 5-10 and 30-35, 10 of the 20 us.
TEST(Timeline, CommunicationHiddenBehindOtherStreams) {
  const std::vector<DeviceActivity> activities = {kernel("ncclDevKernel_AllReduce(x)", 3, 0, 10),
                                                  kernel("ncclDevKernel_AllReduce(x)", 3, 30, 40),
                                                  kernel("gemv", 1, 5, 20),
                                                  kernel("norm", 1, 20, 35)};
  const TimelineSummary s = summarizeTimeline(activities);
  EXPECT_DOUBLE_EQ(s.communicationUs, 20.0);
  EXPECT_DOUBLE_EQ(s.communicationHiddenUs, 10.0);
  EXPECT_NE(formatTimelineSummary(s).find("communication 20.0 us, 10.0 us of it hidden"),
            std::string::npos);
  EXPECT_DOUBLE_EQ(summarizeTimeline({}).spanUs, 0.0);
}

TEST(Timeline, ChromeTraceHasAProcessPerLabelAndAThreadPerStream) {
  const std::vector<LabelledTimeline> timelines = {
      {"batch 1", {kernel("void ns::a(int)", 7, 100, 110), kernel("b", 9, 105, 106)}},
      {"batch 8", {{DeviceActivity::Kind::Copy, "copy device to host", 4, 2000, 3500}}}};
  const nlohmann::json trace = nlohmann::json::parse(chromeTraceJson(timelines));
  const auto &events = trace.at("traceEvents");
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].at("ph"), "M");
  EXPECT_EQ(events[0].at("args").at("name"), "batch 1");
  EXPECT_EQ(events[1].at("name"), "a");
  EXPECT_EQ(events[1].at("tid"), 7);
  EXPECT_DOUBLE_EQ(events[1].at("ts").get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(events[1].at("dur").get<double>(), 10.0);
  EXPECT_EQ(events[1].at("args").at("name"), "void ns::a(int)");
  EXPECT_DOUBLE_EQ(events[2].at("ts").get<double>(), 5.0);
  EXPECT_EQ(events[3].at("pid"), 1);
  EXPECT_EQ(events[4].at("cat"), "copy");
  EXPECT_DOUBLE_EQ(events[4].at("dur").get<double>(), 1.5);
}

// A trace read back gives the timelines written (times relative to each label's first start),
// and bad traces are errors naming the file and the event.
TEST(Timeline, ChromeTraceReadsBack) {
  const std::vector<LabelledTimeline> written = {
      {"batch 1", {kernel("void ns::a(int)", 7, 100, 110), kernel("b", 9, 105, 106)}},
      {"batch 8", {{DeviceActivity::Kind::Copy, "copy device to host", 4, 2000, 3500}}}};
  auto read = readChromeTrace(chromeTraceJson(written), "t.json");
  ASSERT_TRUE(read.isOk()) << read.status().message();
  ASSERT_EQ(read->size(), 2u);
  EXPECT_EQ((*read)[0].label, "batch 1");
  ASSERT_EQ((*read)[0].activities.size(), 2u);
  const DeviceActivity &a = (*read)[0].activities[0];
  EXPECT_EQ(a.name, "void ns::a(int)"); // the full name, kept in args
  EXPECT_EQ(a.kind, DeviceActivity::Kind::Kernel);
  EXPECT_EQ(a.stream, 7u);
  EXPECT_EQ(a.startNs, 0u);
  EXPECT_EQ(a.endNs, 10000u);
  EXPECT_EQ((*read)[0].activities[1].startNs, 5000u);
  EXPECT_EQ((*read)[1].activities[0].kind, DeviceActivity::Kind::Copy);
  EXPECT_EQ((*read)[1].activities[0].endNs, 1500u);
  EXPECT_DOUBLE_EQ(summarizeTimeline((*read)[0].activities).spanUs, 10.0);

  auto error = [](const std::string &text) {
    auto r = readChromeTrace(text, "bad.json");
    return r.isOk() ? std::string("ok") : r.status().message();
  };
  EXPECT_NE(error("[1, 2").find("bad.json: not a JSON trace"), std::string::npos);
  EXPECT_EQ(error("{}"), "bad.json: no traceEvents array");
  EXPECT_NE(error(R"({"traceEvents": [{"ph": "X", "pid": 0, "tid": 1, "ts": 0}]})")
                .find("bad.json: traceEvents[0]: a complete event needs"),
            std::string::npos);
  EXPECT_NE(error(R"({"traceEvents": [{"ph": "X", "pid": 0, "tid": 1, "ts": -5, "dur": 1,
                                       "name": "k"}]})")
                .find("traceEvents[0]: ts or dur out of range"),
            std::string::npos);
  EXPECT_NE(error(R"({"traceEvents": [7]})").find("traceEvents[0]: not an event"),
            std::string::npos);
}

TEST(Timeline, ComparedSummariesListTheLargestChangesFirst) {
  const std::vector<DeviceActivity> base = {kernel("router", 1, 0, 8), kernel("gemv", 1, 8, 20)};
  const std::vector<DeviceActivity> candidate = {kernel("router", 1, 0, 5),
                                                 kernel("gemv", 1, 5, 18)};
  const std::string text =
      compareTimelineSummaries(summarizeTimeline(base), summarizeTimeline(candidate));
  EXPECT_NE(text.find("span 20.0 -> 18.0 us (-2.0)"), std::string::npos) << text;
  const size_t router = text.find("router"), gemv = text.find("gemv");
  ASSERT_NE(router, std::string::npos);
  ASSERT_NE(gemv, std::string::npos);
  EXPECT_LT(router, gemv) << text; // -3.0 before +1.0
  EXPECT_NE(text.find("8.0 (1)"), std::string::npos) << text;
  EXPECT_NE(text.find("-3.0"), std::string::npos) << text;
  EXPECT_NE(text.find("+1.0"), std::string::npos) << text;
}

} // namespace
} // namespace hybrid::bench
