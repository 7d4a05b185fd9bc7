// Weight archives: the header, the entry table and the page-aligned data layout.
#include "FuzzFile.h"
#include "hybrid/runtime/WeightArchive.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  (void)hybrid::WeightArchive::open(hybrid::fuzz::writeInput(data, size, ".hyw"));
  return 0;
}
