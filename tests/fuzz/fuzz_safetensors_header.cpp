// safetensors files: the 8-byte header length, the JSON header, every tensor's entry.
#include "FuzzFile.h"
#include "hybrid/runtime/Safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  auto file = hybrid::safetensors::File::open(hybrid::fuzz::writeInput(data, size, ".safetensors"));
  if (file.isOk())
    for (const auto &tensor : file->tensors())
      (void)file->bytes(tensor);
  return 0;
}
