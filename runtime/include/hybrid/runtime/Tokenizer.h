// Byte-level BPE tokenizers of Hub checkpoints, and the chat formats of the models we serve
// (docs/tokenizer.md).
//
// Two file formats, one algorithm:
// - `tokenizer.json` (Hugging Face tokenizers): model.type "BPE" over GPT-2's byte -> character
//   table, merges ranked by their order; a pre-tokenizer of ByteLevel and/or Split regexes
//   (a Sequence of them); added tokens split out first.
// - `tiktoken.model` (Kimi): lines "<base64 bytes> <rank>", merges ranked by the rank of the
//   merged bytes; special tokens from tokenizer_config.json's added_tokens_decoder; the split
//   pattern from its "pat_str" field, else Kimi's (tokenization_kimi.py).
// Split patterns run on PCRE2 in UTF mode with Unicode properties; the Rust-regex class
// intersections tiktoken patterns use ([A&&[^B]]) are rewritten to lookaheads first.
//
//   auto tokenizer = hybrid::Tokenizer::load("Kimi-Linear-48B-A3B-Instruct");
//   auto ids = (*tokenizer)->encode("Hello");             // special tokens parsed in the text
//   std::string text = (*tokenizer)->decode(*ids);        // invalid UTF-8 -> U+FFFD at the end
//
// A Tokenizer is immutable after load and safe to use from several threads at once.
#pragma once

#include "hybrid/runtime/Status.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hybrid {

// The hand-written chat formats (no Jinja; the sources are cited in ChatTemplate.cpp).
enum class ChatFormat {
  None,        // no chat format known: /v1/chat/completions is refused
  Kimi,        // <|im_system|>system<|im_middle|>...<|im_end|> (Kimi K2, Kimi-Linear)
  DeepSeekV3,  // <｜begin▁of▁sentence｜>{system}<｜User｜>...<｜Assistant｜>...<｜end▁of▁sentence｜>
  DeepSeekV32, // V3.2's encoding_dsv32.py, chat (non-thinking) mode: <｜Assistant｜></think>
};

// "kimi", "deepseek-v3", "deepseek-v3.2", "none"; parseChatFormat also takes "auto" -> nullopt.
std::string_view chatFormatName(ChatFormat format);
StatusOr<std::optional<ChatFormat>> parseChatFormat(std::string_view name);

struct ChatMessage {
  std::string role; // system, user, assistant (Kimi also: tool)
  std::string content;
  std::string name; // optional; Kimi puts it between <|im_...|> and <|im_middle|>
};

// Renders a conversation in a model's format, ending with the assistant's turn opened when
// addGenerationPrompt. Fails on a role the format has no place for, naming it.
StatusOr<std::string> renderChat(ChatFormat format, std::span<const ChatMessage> messages,
                                 bool addGenerationPrompt = true);

class Tokenizer {
public:
  // From a checkpoint directory: tokenizer.json if present, else tiktoken.model (with
  // tokenizer_config.json when present). The chat format comes from the special tokens and the
  // config's chat_template (see detectChatFormat in docs/tokenizer.md). Errors name the file and
  // field.
  static StatusOr<std::unique_ptr<Tokenizer>> load(const std::string &directory);
  // The same from bytes in memory; `origin` names them in errors (fuzz targets, tests).
  // tokenizerConfig may be empty (no tokenizer_config.json).
  static StatusOr<std::unique_ptr<Tokenizer>> fromHfJson(std::string_view tokenizerJson,
                                                         std::string_view tokenizerConfig,
                                                         std::string_view origin);
  static StatusOr<std::unique_ptr<Tokenizer>> fromTiktoken(std::string_view model,
                                                           std::string_view tokenizerConfig,
                                                           std::string_view origin);
  ~Tokenizer();
  Tokenizer(const Tokenizer &) = delete;
  Tokenizer &operator=(const Tokenizer &) = delete;

  // UTF-8 text -> ids. With parseSpecial, exact occurrences of the added tokens' strings become
  // their ids (longest match first, as the Hugging Face library does); without, all text is
  // ordinary text (tiktoken's encode_ordinary). Fails on text that is not valid UTF-8.
  StatusOr<std::vector<int64_t>> encode(std::string_view text, bool parseSpecial = true) const;
  // ids -> the raw bytes they stand for (special tokens as their strings unless skipped). Fails
  // on an id outside the vocabulary.
  StatusOr<std::string> decodeBytes(std::span<const int64_t> ids, bool skipSpecial = false) const;
  // decodeBytes, then invalid UTF-8 replaced by U+FFFD (one per maximal invalid subsequence, as
  // Python's errors="replace" and Rust's from_utf8_lossy).
  StatusOr<std::string> decode(std::span<const int64_t> ids, bool skipSpecial = false) const;

  // One past the largest id (regular or special).
  int64_t vocabSize() const;
  std::optional<int64_t> tokenId(std::string_view token) const; // regular or added token
  bool isSpecial(int64_t id) const;
  ChatFormat chatFormat() const;
  // The BOS id a completion prompt starts with when tokenizer_config.json asks for one
  // (add_bos_token with bos_token, as DeepSeek's); nullopt otherwise.
  std::optional<int64_t> promptBosToken() const;
  // Tokens that end a turn in the chat format (Kimi: <|im_end|>, [EOS]; DeepSeek:
  // <｜end▁of▁sentence｜>): the stop tokens of a chat completion.
  std::vector<int64_t> endOfTurnTokens() const;

  struct Impl;

private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns generated ids into text piece by piece for streaming: bytes of a character split over
// tokens are held until the character is complete; bytes that cannot start or continue a
// character come out as U+FFFD at once; finish() turns what is held into U+FFFD. The
// concatenated output equals Tokenizer::decode of all the ids.
class IncrementalDecoder {
public:
  explicit IncrementalDecoder(const Tokenizer &tokenizer, bool skipSpecial = false)
      : tokenizer_(tokenizer), skipSpecial_(skipSpecial) {}
  StatusOr<std::string> push(int64_t id);
  std::string finish();

private:
  const Tokenizer &tokenizer_;
  bool skipSpecial_;
  std::string pending_;
};

// Valid UTF-8 with each maximal invalid subsequence replaced by U+FFFD. With `complete` false a
// trailing sequence that is a valid but unfinished character start is left in `rest` instead.
std::string utf8Lossy(std::string_view bytes, bool complete = true, std::string *rest = nullptr);

} // namespace hybrid
