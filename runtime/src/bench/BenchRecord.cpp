#include "hybrid/runtime/BenchRecord.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

namespace hybrid::bench {
namespace {

using Json = nlohmann::json;

StatusOr<std::string> stringField(const Json &object, const std::string &field,
                                  const std::string &where) {
  const auto it = object.find(field);
  if (it == object.end() || !it->is_string())
    return Status::error(where + field + ": missing or not a string");
  return it->get<std::string>();
}

} // namespace

// A JSON string literal; bytes that are not UTF-8 (a command line can hold any) become U+FFFD
// instead of throwing.
std::string quoted(const std::string &text) {
  return Json(text).dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string toJson(const BenchRecord &record) {
  std::ostringstream out;
  out << "{\n  \"gpu\": " << quoted(record.gpu) << ",\n  \"date\": " << quoted(record.date)
      << ",\n  \"commit\": " << quoted(record.commit)
      << ",\n  \"command\": " << quoted(record.command) << ",\n  \"rows\": [";
  for (size_t i = 0; i < record.rows.size(); ++i) {
    const BenchRow &row = record.rows[i];
    char time[64];
    std::snprintf(time, sizeof time, "%.6g", row.microseconds);
    out << (i ? ",\n" : "\n") << "    {\"name\": " << quoted(row.name)
        << ", \"microseconds\": " << time
        << ", \"fields\": " << (row.fieldsJson.empty() ? "{}" : row.fieldsJson) << "}";
  }
  out << (record.rows.empty() ? "]\n}\n" : "\n  ]\n}\n");
  return out.str();
}

StatusOr<BenchRecord> parseBenchRecord(const std::string &text, const std::string &source) {
  const std::string where = source + ": ";
  Json root;
  try {
    root = Json::parse(text);
  } catch (const Json::exception &e) {
    // parse_error for bad syntax, out_of_range for a number beyond double (found by fuzzing).
    return Status::error(where + "malformed JSON: " + e.what());
  }
  if (!root.is_object())
    return Status::error(where + "expected a JSON object with gpu, date, commit, command, rows");
  BenchRecord record;
  HYBRID_ASSIGN_OR_RETURN(record.gpu, stringField(root, "gpu", where));
  HYBRID_ASSIGN_OR_RETURN(record.date, stringField(root, "date", where));
  HYBRID_ASSIGN_OR_RETURN(record.commit, stringField(root, "commit", where));
  HYBRID_ASSIGN_OR_RETURN(record.command, stringField(root, "command", where));
  const auto rows = root.find("rows");
  if (rows == root.end() || !rows->is_array())
    return Status::error(where + "rows: missing or not an array");
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < rows->size(); ++i) {
    const Json &row = (*rows)[i];
    const std::string at = where + "rows[" + std::to_string(i) + "].";
    if (!row.is_object())
      return Status::error(where + "rows[" + std::to_string(i) + "]: not an object");
    BenchRow parsed;
    HYBRID_ASSIGN_OR_RETURN(parsed.name, stringField(row, "name", at));
    const auto time = row.find("microseconds");
    if (time == row.end() || !time->is_number() || !std::isfinite(time->get<double>()) ||
        time->get<double>() <= 0)
      return Status::error(at + "microseconds: missing or not a positive number");
    parsed.microseconds = time->get<double>();
    const auto fields = row.find("fields");
    parsed.fieldsJson = fields != row.end() && fields->is_object()
                            ? fields->dump(-1, ' ', false, Json::error_handler_t::replace)
                            : "{}";
    if (!seen.emplace(parsed.name, i).second)
      return Status::error(at + "name: '" + parsed.name + "' also names rows[" +
                           std::to_string(seen[parsed.name]) + "]");
    record.rows.push_back(std::move(parsed));
  }
  return record;
}

StatusOr<BenchRecord> readBenchRecord(const std::string &path) {
  std::ifstream file(path, std::ios::binary);
  if (!file)
    return Status::error(path + ": cannot open");
  std::ostringstream text;
  text << file.rdbuf();
  return parseBenchRecord(text.str(), path);
}

Status writeBenchRecord(const BenchRecord &record, const std::string &path) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file << toJson(record);
  if (!file)
    return Status::error(path + ": cannot write");
  return Status::ok();
}

Comparison compareRecords(const BenchRecord &baseline, const BenchRecord &current,
                          double threshold) {
  std::map<std::string, const BenchRow *> before;
  for (const BenchRow &row : baseline.rows)
    before.emplace(row.name, &row);
  Comparison comparison;
  std::map<std::string, bool> measured;
  for (const BenchRow &row : current.rows) {
    RowComparison c;
    c.name = row.name;
    c.current = row.microseconds;
    measured[row.name] = true;
    const auto it = before.find(row.name);
    if (it == before.end()) {
      c.verdict = RowComparison::Verdict::New;
    } else {
      c.baseline = it->second->microseconds;
      c.ratio = c.current / c.baseline;
      c.verdict = c.ratio > 1 + threshold   ? RowComparison::Verdict::Slower
                  : c.ratio < 1 - threshold ? RowComparison::Verdict::Faster
                                            : RowComparison::Verdict::Same;
      comparison.slower += c.verdict == RowComparison::Verdict::Slower;
    }
    comparison.rows.push_back(c);
  }
  for (const BenchRow &row : baseline.rows)
    if (!measured.count(row.name)) {
      RowComparison c;
      c.name = row.name;
      c.baseline = row.microseconds;
      c.verdict = RowComparison::Verdict::Missing;
      ++comparison.missing;
      comparison.rows.push_back(c);
    }
  return comparison;
}

std::string formatComparison(const Comparison &comparison, const BenchRecord &baseline,
                             double threshold) {
  std::ostringstream out;
  out << "against " << baseline.gpu << ", " << baseline.date << ", commit " << baseline.commit
      << " (threshold " << threshold * 100 << "%)\n";
  char line[512];
  for (const RowComparison &c : comparison.rows) {
    const char *verdict = "";
    switch (c.verdict) {
    case RowComparison::Verdict::Same:
      verdict = "same";
      break;
    case RowComparison::Verdict::Slower:
      verdict = "SLOWER";
      break;
    case RowComparison::Verdict::Faster:
      verdict = "faster";
      break;
    case RowComparison::Verdict::New:
      verdict = "new (no baseline row)";
      break;
    case RowComparison::Verdict::Missing:
      verdict = "missing (not measured)";
      break;
    }
    if (c.verdict == RowComparison::Verdict::New)
      std::snprintf(line, sizeof line, "%-72s %12s %12.2f %8s  %s\n", c.name.c_str(), "-",
                    c.current, "-", verdict);
    else if (c.verdict == RowComparison::Verdict::Missing)
      std::snprintf(line, sizeof line, "%-72s %12.2f %12s %8s  %s\n", c.name.c_str(), c.baseline,
                    "-", "-", verdict);
    else
      std::snprintf(line, sizeof line, "%-72s %12.2f %12.2f %7.3fx  %s\n", c.name.c_str(),
                    c.baseline, c.current, c.ratio, verdict);
    out << line;
  }
  out << comparison.slower << " of " << comparison.rows.size() << " rows slower than the baseline"
      << (comparison.missing ? ", " + std::to_string(comparison.missing) + " not measured" : "")
      << "\n";
  return out.str();
}

} // namespace hybrid::bench
