#include "hybrid/runtime/Timeline.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

namespace hybrid::bench {
namespace {

using Interval = std::pair<uint64_t, uint64_t>; // [start, end) in ns

// Sorted, disjoint intervals covering the same instants.
std::vector<Interval> merged(std::vector<Interval> intervals) {
  std::sort(intervals.begin(), intervals.end());
  std::vector<Interval> out;
  for (const Interval &i : intervals) {
    if (i.second <= i.first)
      continue;
    if (!out.empty() && i.first <= out.back().second)
      out.back().second = std::max(out.back().second, i.second);
    else
      out.push_back(i);
  }
  return out;
}

uint64_t length(const std::vector<Interval> &disjoint) {
  uint64_t total = 0;
  for (const Interval &i : disjoint)
    total += i.second - i.first;
  return total;
}

// The length of the intersection of two sorted disjoint interval lists.
uint64_t overlap(const std::vector<Interval> &a, const std::vector<Interval> &b) {
  uint64_t total = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const uint64_t start = std::max(a[i].first, b[j].first);
    const uint64_t end = std::min(a[i].second, b[j].second);
    if (start < end)
      total += end - start;
    (a[i].second < b[j].second ? i : j)++;
  }
  return total;
}

bool isCommunication(const std::string &name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return char(std::tolower(c)); });
  return lower.find("nccl") != std::string::npos;
}

double us(uint64_t ns) { return double(ns) / 1e3; }

// What summaries and traces call an activity: a kernel by its short name, the others as named.
std::string displayName(const DeviceActivity &a) {
  return a.kind == DeviceActivity::Kind::Kernel ? shortActivityName(a.name) : a.name;
}

} // namespace

std::string shortActivityName(const std::string &full) {
  std::string name = full;
  for (const std::string anonymous = "(anonymous namespace)";;) {
    const size_t at = name.find(anonymous);
    if (at == std::string::npos)
      break;
    name.replace(at, anonymous.size(), "anonymous");
  }
  // Calls `at(i)` for each position of `text` outside template arguments, until it says stop.
  auto outsideTemplates = [](const std::string &text, auto at) {
    int depth = 0;
    for (size_t i = 0; i < text.size(); ++i) {
      if (text[i] == '<')
        ++depth;
      else if (text[i] == '>')
        --depth;
      else if (depth == 0 && !at(i))
        return;
    }
  };
  // The arguments: from the '(' that opens them.
  std::string head = name;
  outsideTemplates(name, [&](size_t i) {
    if (name[i] != '(' || i == 0)
      return true;
    head = name.substr(0, i);
    return false;
  });
  // Namespaces and a leading return type ("void "): up to the last "::" or space.
  size_t begin = 0;
  outsideTemplates(head, [&](size_t i) {
    if (head[i] == ' ')
      begin = i + 1;
    else if (head[i] == ':' && i + 1 < head.size() && head[i + 1] == ':')
      begin = i + 2;
    return true;
  });
  const std::string shortName = head.substr(begin);
  return shortName.empty() ? full : shortName;
}

TimelineSummary summarizeTimeline(std::span<const DeviceActivity> activities) {
  TimelineSummary summary;
  if (activities.empty())
    return summary;
  uint64_t first = std::numeric_limits<uint64_t>::max(), last = 0;
  std::map<uint32_t, std::vector<const DeviceActivity *>> byStream;
  std::vector<Interval> communication, other;
  for (const DeviceActivity &a : activities) {
    first = std::min(first, a.startNs);
    last = std::max(last, a.endNs);
    byStream[a.stream].push_back(&a);
    (isCommunication(a.name) ? communication : other).push_back({a.startNs, a.endNs});
  }
  summary.spanUs = us(last - first);
  std::map<std::string, TimelineSummary::Name> names;
  for (auto &[stream, list] : byStream) {
    std::sort(list.begin(), list.end(), [](const DeviceActivity *a, const DeviceActivity *b) {
      return a->startNs != b->startNs ? a->startNs < b->startNs : a->endNs < b->endNs;
    });
    std::vector<Interval> intervals;
    uint64_t coveredUntil = 0; // the latest end of the stream's earlier activities
    for (const DeviceActivity *a : list) {
      intervals.push_back({a->startNs, a->endNs});
      TimelineSummary::Name &n = names[displayName(*a)];
      ++n.count;
      n.totalUs += us(a->endNs > a->startNs ? a->endNs - a->startNs : 0);
      const uint64_t from = std::max(a->startNs, coveredUntil);
      if (a->endNs > from)
        n.exposedUs += us(a->endNs - from);
      coveredUntil = std::max(coveredUntil, a->endNs);
    }
    summary.streams.push_back(
        {stream, static_cast<int64_t>(list.size()), us(length(merged(std::move(intervals))))});
  }
  std::sort(summary.streams.begin(), summary.streams.end(),
            [](const auto &a, const auto &b) { return a.busyUs > b.busyUs; });
  for (auto &[name, n] : names) {
    n.name = name;
    summary.names.push_back(n);
  }
  std::sort(summary.names.begin(), summary.names.end(),
            [](const auto &a, const auto &b) { return a.exposedUs > b.exposedUs; });
  const std::vector<Interval> talking = merged(std::move(communication));
  summary.communicationUs = us(length(talking));
  summary.communicationHiddenUs = us(overlap(talking, merged(std::move(other))));
  return summary;
}

std::string formatTimelineSummary(const TimelineSummary &summary, int topNames) {
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "span %.1f us, %zu streams\n", summary.spanUs,
                summary.streams.size());
  out += line;
  for (const auto &s : summary.streams) {
    std::snprintf(line, sizeof line, "  stream %u: %lld activities, busy %.1f us (%.0f%%)\n", s.id,
                  static_cast<long long>(s.activities), s.busyUs,
                  summary.spanUs > 0 ? 100.0 * s.busyUs / summary.spanUs : 0.0);
    out += line;
  }
  std::snprintf(line, sizeof line, "  %-48s %6s %11s %11s %11s\n", "name", "count", "exposed us",
                "a launch", "total us");
  out += line;
  int shown = 0;
  for (const auto &n : summary.names) {
    if (shown++ == topNames)
      break;
    std::snprintf(line, sizeof line, "  %-48.48s %6lld %11.1f %11.2f %11.1f\n", n.name.c_str(),
                  static_cast<long long>(n.count), n.exposedUs,
                  n.count > 0 ? n.exposedUs / double(n.count) : 0.0, n.totalUs);
    out += line;
  }
  if (summary.communicationUs > 0) {
    std::snprintf(line, sizeof line,
                  "communication %.1f us, %.1f us of it hidden behind other work (%.0f%%)\n",
                  summary.communicationUs, summary.communicationHiddenUs,
                  100.0 * summary.communicationHiddenUs / summary.communicationUs);
    out += line;
  }
  return out;
}

std::string chromeTraceJson(std::span<const LabelledTimeline> timelines) {
  nlohmann::json events = nlohmann::json::array();
  for (size_t pid = 0; pid < timelines.size(); ++pid) {
    const LabelledTimeline &t = timelines[pid];
    events.push_back(
        {{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", t.label}}}});
    uint64_t first = std::numeric_limits<uint64_t>::max();
    for (const DeviceActivity &a : t.activities)
      first = std::min(first, a.startNs);
    for (const DeviceActivity &a : t.activities) {
      const char *category = a.kind == DeviceActivity::Kind::Kernel ? "kernel"
                             : a.kind == DeviceActivity::Kind::Copy ? "copy"
                                                                    : "memset";
      events.push_back({{"ph", "X"},
                        {"name", displayName(a)},
                        {"cat", category},
                        {"pid", pid},
                        {"tid", a.stream},
                        {"ts", us(a.startNs - first)},
                        {"dur", us(a.endNs > a.startNs ? a.endNs - a.startNs : 0)},
                        {"args", {{"name", a.name}}}});
    }
  }
  // Names are the toolchain's, but a stray byte must not throw: replaced.
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ns"}}.dump(
             -1, ' ', false, nlohmann::json::error_handler_t::replace) +
         "\n";
}

} // namespace hybrid::bench
