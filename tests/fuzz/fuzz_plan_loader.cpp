// Plans: the FlatBuffers verifier, then every structural and semantic check of the loader.
#include "hybrid/runtime/Plan.h"

#include <span>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  (void)hybrid::LoadedPlan::fromBytes(
      std::span<const std::byte>(reinterpret_cast<const std::byte *>(data), size), "fuzz.hyplan");
  return 0;
}
