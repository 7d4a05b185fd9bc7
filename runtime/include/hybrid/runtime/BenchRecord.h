// Benchmark records and baselines (issue 14): what `hybrid-bench ... --json` writes and what
// `--compare BASELINE.json` reads. A record says where and when it was measured (GPU, UTC date,
// commit, command) and holds one row per measured shape; a row is identified by its name (the
// kernel and every shape parameter) and compared by its time. Baselines live in
// docs/performance/.
#pragma once

#include "hybrid/runtime/Status.h"

#include <string>
#include <vector>

namespace hybrid::bench {

struct BenchRow {
  std::string name;          // e.g. "dsa-indexer batch=64 context=131072 heads=64 dim=128 ..."
  double microseconds = 0;   // the compared time (lower is better)
  std::string fieldsJson;    // every figure of the row, a JSON object ("{}" when none)
};

struct BenchRecord {
  std::string gpu, date, commit, command;
  std::vector<BenchRow> rows;
};

// The record as a JSON document; parse reads it back (source names the file in errors: every
// error names the field, e.g. "rows[3].microseconds").
std::string toJson(const BenchRecord &record);
StatusOr<BenchRecord> parseBenchRecord(const std::string &text, const std::string &source);
StatusOr<BenchRecord> readBenchRecord(const std::string &path);
Status writeBenchRecord(const BenchRecord &record, const std::string &path);

// Every current row against the baseline row of the same name: ratio = current / baseline time.
struct RowComparison {
  enum class Verdict { Same, Slower, Faster, New, Missing };
  std::string name;
  double baseline = 0, current = 0, ratio = 0;
  Verdict verdict = Verdict::Same;
};
struct Comparison {
  std::vector<RowComparison> rows; // current rows in order, then baseline rows not measured
  int slower = 0;                  // rows slower than the threshold allows
  int missing = 0;                 // baseline rows without a current one
};
// Slower: ratio > 1 + threshold; Faster: ratio < 1 - threshold (threshold >= 0, e.g. 0.05).
Comparison compareRecords(const BenchRecord &baseline, const BenchRecord &current,
                          double threshold);
// A table: one line per row with its verdict, then a summary line.
std::string formatComparison(const Comparison &comparison, const BenchRecord &baseline,
                             double threshold);

} // namespace hybrid::bench
