// Helpers for the .cpp files of the libraries that report failures as Status (runtime, cache):
// error text for errno values and arbitrary bytes, and the exception barrier of public entry
// points. Include only from sources built with -fexceptions (the compiler links these libraries
// but is built without exceptions).
#pragma once

#include "hybrid/runtime/Status.h"

#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <system_error>

namespace hybrid {

inline std::string errnoMessage(int error) { return std::system_category().message(error); }

// What escapeBytes does with bytes >= 0x80: keep them (text known to be UTF-8) or escape them
// (bytes that may be anything).
enum class NonAscii { Keep, Escape };

// Escapes bytes as \xNN so an error stays one printable line: control characters and DEL always,
// non-ASCII bytes as asked.
inline std::string escapeBytes(std::string_view text, NonAscii nonAscii) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f || (nonAscii == NonAscii::Escape && byte >= 0x80)) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out;
}

// Runs a public entry point, turning an escaping exception (allocation failure) into a Status
// "<context>: <what>".
template <typename Fn> auto catchExceptions(std::string_view context, Fn &&fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::exception &error) {
    return Status::error(std::string(context) + ": " + error.what());
  } catch (...) {
    return Status::error(std::string(context) + ": unknown exception");
  }
}

} // namespace hybrid
