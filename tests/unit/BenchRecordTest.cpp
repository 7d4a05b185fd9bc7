// Benchmark records and the baseline comparison (BenchRecord.h): a record survives a round trip,
// rows are matched by name and judged against the threshold, and bad files are refused with the
// file and field named.
#include "hybrid/runtime/BenchRecord.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

namespace hybrid::bench {
namespace {

BenchRecord record(std::vector<std::pair<std::string, double>> rows) {
  BenchRecord r;
  r.gpu = "NVIDIA H200";
  r.date = "2026-11-29T22:55:00Z";
  r.commit = "abc1234";
  r.command = "hybrid-bench dsa-indexer --batch 1,64";
  for (auto &[name, time] : rows)
    r.rows.push_back({name, time, "{\"batch\": 1, \"floor_us\": 4.0}"});
  return r;
}

TEST(BenchRecord, RoundTripsThroughJson) {
  const BenchRecord original = record({{"dsa-indexer batch=1", 59.9}, {"dsa-indexer batch=64", 1200.6}});
  auto parsed = parseBenchRecord(toJson(original), "baseline.json");
  ASSERT_TRUE(parsed.isOk()) << parsed.status().message();
  EXPECT_EQ(parsed->gpu, original.gpu);
  EXPECT_EQ(parsed->date, original.date);
  EXPECT_EQ(parsed->commit, original.commit);
  EXPECT_EQ(parsed->command, original.command);
  ASSERT_EQ(parsed->rows.size(), 2u);
  EXPECT_EQ(parsed->rows[1].name, "dsa-indexer batch=64");
  EXPECT_DOUBLE_EQ(parsed->rows[1].microseconds, 1200.6);
  EXPECT_EQ(parsed->rows[0].fieldsJson, "{\"batch\":1,\"floor_us\":4.0}");
  EXPECT_TRUE(parseBenchRecord(toJson(record({})), "empty.json").isOk());
}

// A command line may hold bytes that are not UTF-8: the record replaces them, never throws.
TEST(BenchRecord, BytesThatAreNotUtf8AreReplaced) {
  BenchRecord r = record({{"a", 1}});
  r.command = "hybrid-bench --json \xff\xfe.json";
  auto parsed = parseBenchRecord(toJson(r), "weird.json");
  ASSERT_TRUE(parsed.isOk()) << parsed.status().message();
  EXPECT_EQ(parsed->command, "hybrid-bench --json \uFFFD\uFFFD.json");
}

TEST(BenchRecord, ComparesRowsByNameAgainstTheThreshold) {
  const BenchRecord baseline =
      record({{"a", 100}, {"b", 100}, {"c", 100}, {"d", 100}, {"gone", 10}});
  const BenchRecord current =
      record({{"a", 105}, {"b", 105.1}, {"c", 90}, {"d", 96}, {"fresh", 7}});
  const Comparison c = compareRecords(baseline, current, 0.05);
  ASSERT_EQ(c.rows.size(), 6u);
  using V = RowComparison::Verdict;
  EXPECT_EQ(c.rows[0].verdict, V::Same); // exactly 5% slower is within the threshold
  EXPECT_DOUBLE_EQ(c.rows[0].ratio, 1.05);
  EXPECT_EQ(c.rows[1].verdict, V::Slower);
  EXPECT_EQ(c.rows[2].verdict, V::Faster);
  EXPECT_EQ(c.rows[3].verdict, V::Same);
  EXPECT_EQ(c.rows[4].verdict, V::New);
  EXPECT_EQ(c.rows[4].name, "fresh");
  EXPECT_EQ(c.rows[5].verdict, V::Missing);
  EXPECT_EQ(c.rows[5].name, "gone");
  EXPECT_EQ(c.slower, 1);
  EXPECT_EQ(c.missing, 1);
  const std::string table = formatComparison(c, baseline, 0.05);
  EXPECT_NE(table.find("against NVIDIA H200, 2026-11-29T22:55:00Z, commit abc1234"),
            std::string::npos);
  EXPECT_NE(table.find("1.051x  SLOWER"), std::string::npos) << table;
  EXPECT_NE(table.find("1 of 6 rows slower than the baseline, 1 not measured"), std::string::npos);
  // A zero threshold flags any slowdown.
  EXPECT_EQ(compareRecords(baseline, current, 0.0).slower, 2);
}

TEST(BenchRecord, BadFilesNameTheFileAndField) {
  auto error = [](const std::string &text) {
    auto parsed = parseBenchRecord(text, "docs/performance/x.json");
    EXPECT_FALSE(parsed.isOk());
    return parsed.isOk() ? std::string() : parsed.status().message();
  };
  EXPECT_NE(error("{").find("docs/performance/x.json: malformed JSON"), std::string::npos);
  EXPECT_NE(error("[]").find("expected a JSON object"), std::string::npos);
  // A number beyond double is nlohmann's out_of_range, not a parse_error (found by fuzzing).
  EXPECT_NE(error(R"({"gpu": "g", "rows": [1e999]})").find("x.json: malformed JSON"),
            std::string::npos);
  EXPECT_NE(error(R"({"gpu": 1})").find("x.json: gpu: missing or not a string"),
            std::string::npos);
  const std::string head = R"({"gpu": "g", "date": "d", "commit": "c", "command": "x", )";
  EXPECT_NE(error(head + R"("rows": {}})").find("rows: missing or not an array"),
            std::string::npos);
  EXPECT_NE(error(head + R"("rows": [{"name": "a", "microseconds": -1}]})")
                .find("rows[0].microseconds: missing or not a positive number"),
            std::string::npos);
  EXPECT_NE(error(head + R"("rows": [{"name": "a", "microseconds": 1},
                                     {"name": "a", "microseconds": 2}]})")
                .find("rows[1].name: 'a' also names rows[0]"),
            std::string::npos);
  auto missing = readBenchRecord("/nonexistent/baseline.json");
  ASSERT_FALSE(missing.isOk());
  EXPECT_EQ(missing.status().message(), "/nonexistent/baseline.json: cannot open");
}

// The baselines kept in docs/performance/ stay readable by --compare.
TEST(BenchRecord, StoredBaselinesParse) {
  int files = 0;
  for (const auto &entry : std::filesystem::directory_iterator(HYBRID_BASELINE_DIR)) {
    if (entry.path().extension() != ".json")
      continue;
    ++files;
    auto record = readBenchRecord(entry.path().string());
    ASSERT_TRUE(record.isOk()) << record.status().message();
    EXPECT_FALSE(record->rows.empty()) << entry.path();
    EXPECT_FALSE(record->gpu.empty()) << entry.path();
  }
  EXPECT_GE(files, 1);
}

} // namespace
} // namespace hybrid::bench
