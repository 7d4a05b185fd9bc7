// For parsers that read a path: the fuzz input written to one private temporary file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <unistd.h>

namespace hybrid::fuzz {

inline std::string writeInput(const uint8_t *data, size_t size, const char *suffix) {
  static const std::string path =
      "/tmp/hybrid_fuzz_" + std::to_string(::getpid()) + suffix;
  if (FILE *file = std::fopen(path.c_str(), "wb")) {
    std::fwrite(data, 1, size, file);
    std::fclose(file);
  }
  return path;
}

} // namespace hybrid::fuzz
