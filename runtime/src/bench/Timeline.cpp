#include "hybrid/runtime/Timeline.h"

#include <algorithm>
#include <cctype>
#include <cmath>
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

  std::vector<const DeviceActivity *> byStart;
  for (const DeviceActivity &a : activities)
    byStart.push_back(&a);
  std::sort(byStart.begin(), byStart.end(), [](const DeviceActivity *a, const DeviceActivity *b) {
    return a->startNs != b->startNs ? a->startNs < b->startNs : a->endNs < b->endNs;
  });
  const DeviceActivity *latest = byStart.front(); // the activity reaching furthest so far
  for (const DeviceActivity *a : byStart) {
    if (a->startNs > latest->endNs) {
      const double gapUs = us(a->startNs - latest->endNs);
      summary.idleUs += gapUs;
      summary.gaps.push_back({gapUs, displayName(*latest), displayName(*a)});
    }
    if (a->endNs > latest->endNs)
      latest = a;
  }
  std::stable_sort(summary.gaps.begin(), summary.gaps.end(),
                   [](const auto &a, const auto &b) { return a.us > b.us; });
  if (summary.gaps.size() > kTimelineGaps)
    summary.gaps.resize(kTimelineGaps);
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
  if (summary.idleUs > 0) {
    std::snprintf(line, sizeof line, "idle %.1f us (no stream busy); longest:\n", summary.idleUs);
    out += line;
    for (const auto &g : summary.gaps) {
      std::snprintf(line, sizeof line, "  %9.1f us  %.60s -> %.60s\n", g.us, g.before.c_str(),
                    g.after.c_str());
      out += line;
    }
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

StatusOr<std::vector<LabelledTimeline>> readChromeTrace(const std::string &text,
                                                        const std::string &source) {
  try {
    const nlohmann::json trace = nlohmann::json::parse(text);
    if (!trace.is_object() || !trace.contains("traceEvents") || !trace["traceEvents"].is_array())
      return Status::error(source + ": no traceEvents array");
    std::map<int64_t, LabelledTimeline> byProcess;
    const auto &events = trace["traceEvents"];
    for (size_t i = 0; i < events.size(); ++i) {
      const nlohmann::json &e = events[i];
      const std::string where = source + ": traceEvents[" + std::to_string(i) + "]";
      if (!e.is_object() || !e.contains("ph") || !e["ph"].is_string() || !e.contains("pid") ||
          !e["pid"].is_number_integer())
        return Status::error(where + ": not an event with ph and an integer pid");
      LabelledTimeline &t = byProcess[e["pid"].get<int64_t>()];
      const std::string phase = e["ph"].get<std::string>();
      if (phase == "M") {
        if (e.value("name", "") == "process_name" && e.contains("args") && e["args"].is_object() &&
            e["args"].contains("name") && e["args"]["name"].is_string())
          t.label = e["args"]["name"].get<std::string>();
        continue;
      }
      if (phase != "X")
        continue;
      if (!e.contains("ts") || !e["ts"].is_number() || !e.contains("dur") ||
          !e["dur"].is_number() || !e.contains("tid") || !e["tid"].is_number_unsigned() ||
          !e.contains("name") || !e["name"].is_string())
        return Status::error(where + ": a complete event needs name, tid, ts and dur");
      const double ts = e["ts"].get<double>(), dur = e["dur"].get<double>();
      if (!(ts >= 0) || !(dur >= 0) || ts > 1e12 || dur > 1e12)
        return Status::error(where + ": ts or dur out of range");
      DeviceActivity a;
      const std::string category = e.value("cat", "kernel");
      a.kind = category == "copy"     ? DeviceActivity::Kind::Copy
               : category == "memset" ? DeviceActivity::Kind::Memset
                                      : DeviceActivity::Kind::Kernel;
      a.name = e.contains("args") && e["args"].is_object() && e["args"].contains("name") &&
                       e["args"]["name"].is_string()
                   ? e["args"]["name"].get<std::string>()
                   : e["name"].get<std::string>();
      a.stream = e["tid"].get<uint32_t>();
      a.startNs = static_cast<uint64_t>(ts * 1e3 + 0.5);
      a.endNs = a.startNs + static_cast<uint64_t>(dur * 1e3 + 0.5);
      t.activities.push_back(std::move(a));
    }
    std::vector<LabelledTimeline> out;
    for (auto &[pid, t] : byProcess) {
      if (t.label.empty())
        t.label = "process " + std::to_string(pid);
      out.push_back(std::move(t));
    }
    return out;
  } catch (const nlohmann::json::exception &e) {
    return Status::error(source + ": not a JSON trace: " + e.what());
  }
}

std::string compareTimelineSummaries(const TimelineSummary &base, const TimelineSummary &candidate,
                                     int topNames) {
  std::string out;
  char line[512];
  auto busiest = [](const TimelineSummary &s) {
    return s.streams.empty() ? 0.0 : s.streams[0].busyUs;
  };
  std::snprintf(line, sizeof line,
                "span %.1f -> %.1f us (%+.1f), busiest stream busy %.1f -> %.1f us (%+.1f), "
                "idle %.1f -> %.1f us (%+.1f)\n",
                base.spanUs, candidate.spanUs, candidate.spanUs - base.spanUs, busiest(base),
                busiest(candidate), busiest(candidate) - busiest(base), base.idleUs,
                candidate.idleUs, candidate.idleUs - base.idleUs);
  out += line;
  struct Row {
    std::string name;
    int64_t baseCount = 0, candidateCount = 0;
    double baseUs = 0, candidateUs = 0;
  };
  std::map<std::string, Row> rows;
  for (const auto &n : base.names) {
    Row &r = rows[n.name];
    r.baseCount = n.count;
    r.baseUs = n.exposedUs;
  }
  for (const auto &n : candidate.names) {
    Row &r = rows[n.name];
    r.candidateCount = n.count;
    r.candidateUs = n.exposedUs;
  }
  std::vector<Row> sorted;
  for (auto &[name, r] : rows) {
    r.name = name;
    sorted.push_back(r);
  }
  std::sort(sorted.begin(), sorted.end(), [](const Row &a, const Row &b) {
    return std::fabs(a.candidateUs - a.baseUs) > std::fabs(b.candidateUs - b.baseUs);
  });
  std::snprintf(line, sizeof line, "  %-48s %13s %13s %10s\n", "name (exposed us, launches)",
                "base", "candidate", "change");
  out += line;
  int shown = 0;
  for (const Row &r : sorted) {
    if (shown++ == topNames)
      break;
    char baseText[32], candidateText[32];
    std::snprintf(baseText, sizeof baseText, "%.1f (%lld)", r.baseUs,
                  static_cast<long long>(r.baseCount));
    std::snprintf(candidateText, sizeof candidateText, "%.1f (%lld)", r.candidateUs,
                  static_cast<long long>(r.candidateCount));
    std::snprintf(line, sizeof line, "  %-48.48s %13s %13s %+10.1f\n", r.name.c_str(), baseText,
                  candidateText, r.candidateUs - r.baseUs);
    out += line;
  }
  return out;
}

} // namespace hybrid::bench
