// Tokenizer files: the first byte picks tokenizer.json (even) or tiktoken.model (odd); the rest
// is the file, then after a NUL byte a tokenizer_config.json. A loaded tokenizer then encodes
// and decodes a fixed text and the config bytes, with and without special tokens.
#include "hybrid/runtime/Tokenizer.h"

#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0)
    return 0;
  const std::string_view input(reinterpret_cast<const char *>(data) + 1, size - 1);
  const size_t split = input.find('\0');
  const std::string_view file = input.substr(0, split);
  const std::string_view config =
      split == std::string_view::npos ? std::string_view() : input.substr(split + 1);
  auto tokenizer = (data[0] & 1) ? hybrid::Tokenizer::fromTiktoken(file, config, "fuzz")
                                 : hybrid::Tokenizer::fromHfJson(file, config, "fuzz");
  if (!tokenizer)
    return 0;
  for (std::string_view text : {std::string_view("Hello, 世界 🚀 <|im_end|> 123  \n"), config}) {
    for (bool special : {true, false}) {
      auto ids = (*tokenizer)->encode(text, special);
      if (!ids)
        continue;
      (void)(*tokenizer)->decode(*ids);
      hybrid::IncrementalDecoder decoder(**tokenizer);
      for (int64_t id : *ids)
        (void)decoder.push(id);
      (void)decoder.finish();
    }
  }
  return 0;
}
