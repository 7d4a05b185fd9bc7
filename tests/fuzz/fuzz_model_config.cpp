// config.json as the runtime reads it (synth::specFromConfigJson: the synthetic-weights path of
// hybrid-compile and the synthetic checkpoint generator): any bytes give a spec or an error.
#include "hybrid/runtime/SyntheticCheckpoint.h"

#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const std::string text(reinterpret_cast<const char *>(data), size);
  (void)hybrid::synth::specFromConfigJson(text, "config.json", 7);
  return 0;
}
