// /v1/completions bodies: JSON, then every field the server reads.
#include "hybrid/runtime/Server.h"

#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  (void)hybrid::parseCompletionRequest(std::string(reinterpret_cast<const char *>(data), size), 16);
  return 0;
}
