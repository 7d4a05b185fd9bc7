// Benchmark records (--compare reads them): JSON, then every field.
#include "hybrid/runtime/BenchRecord.h"

#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  auto record = hybrid::bench::parseBenchRecord(
      std::string(reinterpret_cast<const char *>(data), size), "fuzz.json");
  if (record.isOk())
    (void)hybrid::bench::compareRecords(*record, *record, 0.05);
  return 0;
}
