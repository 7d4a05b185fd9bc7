// The tokenizers against the encodings of the Python libraries (tests/data/tokenizer/goldens.json,
// written by tools/scripts/make-tokenizer-testdata.py with `tokenizers` and `tiktoken`), decoding
// and streaming decoding, the chat formats, and the loaders' errors on malformed files.
#include "hybrid/runtime/Tokenizer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace hybrid {
namespace {

using json = nlohmann::json;

std::string dataDir(const std::string &name) {
  return std::string(HYBRID_TEST_DATA_DIR) + "/tokenizer/" + name;
}

std::string readText(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

json goldens() { return json::parse(readText(dataDir("goldens.json"))); }

std::unique_ptr<Tokenizer> loadOrDie(const std::string &name) {
  auto tokenizer = Tokenizer::load(dataDir(name));
  EXPECT_TRUE(tokenizer.isOk()) << tokenizer.status().message();
  return tokenizer.isOk() ? std::move(*tokenizer) : nullptr;
}

class TokenizerGoldens : public testing::TestWithParam<std::string> {};

TEST_P(TokenizerGoldens, EncodingsEqualThePythonLibraries) {
  auto tokenizer = loadOrDie(GetParam());
  ASSERT_TRUE(tokenizer);
  const json cases = goldens()["tokenizers"][GetParam()];
  ASSERT_GE(cases.size(), 30u);
  for (const json &c : cases) {
    const std::string text = c["text"].get<std::string>();
    const bool special = c["special"].get<bool>();
    auto ids = tokenizer->encode(text, special);
    ASSERT_TRUE(ids.isOk()) << ids.status().message();
    EXPECT_EQ(*ids, c["ids"].get<std::vector<int64_t>>())
        << GetParam() << " special=" << special << " text: " << text;
    auto decoded = tokenizer->decode(*ids);
    ASSERT_TRUE(decoded.isOk()) << decoded.status().message();
    EXPECT_EQ(*decoded, text) << GetParam();
  }
}

INSTANTIATE_TEST_SUITE_P(AllFormats, TokenizerGoldens,
                         testing::Values("bpe_deepseek", "bpe_gpt2", "tiktoken_kimi"));

TEST(Tokenizer, SpecialTokensAreSingleIdsOnlyWhenParsed) {
  auto tokenizer = loadOrDie("tiktoken_kimi");
  ASSERT_TRUE(tokenizer);
  const auto end = tokenizer->tokenId("<|im_end|>");
  ASSERT_TRUE(end.has_value());
  EXPECT_TRUE(tokenizer->isSpecial(*end));
  EXPECT_EQ(tokenizer->encode("<|im_end|>").value(), std::vector<int64_t>{*end});
  auto ordinary = tokenizer->encode("<|im_end|>", /*parseSpecial=*/false).value();
  EXPECT_GT(ordinary.size(), 1u);
  EXPECT_EQ(tokenizer->decode(ordinary).value(), "<|im_end|>");
  // Skipped when decoding for a response.
  const std::vector<int64_t> ids = {*end, ordinary[0]};
  EXPECT_EQ(tokenizer->decode(ids, /*skipSpecial=*/true).value(),
            tokenizer->decode(std::vector<int64_t>{ordinary[0]}).value());
  EXPECT_EQ(tokenizer->endOfTurnTokens(),
            (std::vector<int64_t>{*end, tokenizer->tokenId("[EOS]").value()}));
}

TEST(Tokenizer, RefusesInvalidUtf8AndUnknownIds) {
  auto tokenizer = loadOrDie("bpe_gpt2");
  ASSERT_TRUE(tokenizer);
  auto bad = tokenizer->encode("ab\xff");
  ASSERT_FALSE(bad.isOk());
  EXPECT_EQ(bad.status().message(), "the text is not valid UTF-8");
  auto unknown = tokenizer->decode(std::vector<int64_t>{1, 99999});
  ASSERT_FALSE(unknown.isOk());
  EXPECT_EQ(unknown.status().message(), "token id 99999 is not in the vocabulary");
  EXPECT_EQ(tokenizer->encode("").value(), std::vector<int64_t>{});
}

TEST(Utf8Lossy, ReplacesMaximalInvalidSubsequences) {
  EXPECT_EQ(utf8Lossy("ok"), "ok");
  EXPECT_EQ(utf8Lossy("\xF0\x9F\x98" "A"), "\xEF\xBF\xBD" "A");        // cut emoji: one U+FFFD
  EXPECT_EQ(utf8Lossy("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");         // overlong: two
  EXPECT_EQ(utf8Lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"); // surrogate
  std::string rest;
  EXPECT_EQ(utf8Lossy("a\xE4\xB8", /*complete=*/false, &rest), "a");
  EXPECT_EQ(rest, "\xE4\xB8");
}

TEST(IncrementalDecoder, MultiByteCharactersComeOutWhole) {
  for (const std::string name : {"bpe_deepseek", "tiktoken_kimi"}) {
    auto tokenizer = loadOrDie(name);
    ASSERT_TRUE(tokenizer);
    const std::string text = "emoji🚀inside 👨‍👩‍👧 ꙮ 𝔘𝔫𝔦 中文分词测试 café";
    const auto ids = tokenizer->encode(text).value();
    IncrementalDecoder decoder(*tokenizer);
    std::string streamed;
    bool someTokenHeldBytes = false;
    for (int64_t id : ids) {
      const std::string piece = decoder.push(id).value();
      EXPECT_EQ(utf8Lossy(piece), piece) << "a piece is not whole UTF-8";
      someTokenHeldBytes |= tokenizer->decodeBytes(std::vector<int64_t>{id}).value() != piece;
      streamed += piece;
    }
    streamed += decoder.finish();
    EXPECT_EQ(streamed, text) << name;
    EXPECT_TRUE(someTokenHeldBytes) << name << ": no token split a character; the test is moot";
    // A character cut short at the end becomes U+FFFD, as in decode().
    IncrementalDecoder cut(*tokenizer);
    const int64_t firstByteOfRocket = tokenizer->tokenId("\xF0").value();
    EXPECT_EQ(cut.push(firstByteOfRocket).value(), "");
    EXPECT_EQ(cut.finish(), "\xEF\xBF\xBD");
  }
}

TEST(ChatTemplate, KimiFormat) {
  const std::vector<ChatMessage> messages = {{"user", "Hi", ""}};
  EXPECT_EQ(renderChat(ChatFormat::Kimi, messages).value(),
            "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot "
            "AI.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>");
  const std::vector<ChatMessage> turns = {{"system", "Be brief.", ""},
                                          {"user", "1+1?", ""},
                                          {"assistant", "2", ""},
                                          {"user", "2+2?", "alice"}};
  EXPECT_EQ(renderChat(ChatFormat::Kimi, turns, /*addGenerationPrompt=*/false).value(),
            "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
            "<|im_user|>user<|im_middle|>1+1?<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>2<|im_end|>"
            "<|im_user|>alice<|im_middle|>2+2?<|im_end|>");
  const std::vector<ChatMessage> tool = {{"tool", "{}", ""}};
  auto refused = renderChat(ChatFormat::Kimi, tool);
  ASSERT_FALSE(refused.isOk());
  EXPECT_EQ(refused.status().message(),
            "\"messages\"[0]: role \"tool\" is not supported by the kimi chat format (system, "
            "user, assistant)");
  // Rendered and encoded, every role marker is one special token.
  auto tokenizer = loadOrDie("tiktoken_kimi");
  ASSERT_TRUE(tokenizer);
  EXPECT_EQ(tokenizer->chatFormat(), ChatFormat::Kimi);
  const auto ids = tokenizer->encode(renderChat(ChatFormat::Kimi, messages).value()).value();
  int markers = 0;
  for (int64_t id : ids)
    markers += tokenizer->isSpecial(id) ? 1 : 0;
  EXPECT_EQ(markers, 8); // system and user: 3 each; the opened assistant turn: 2
  EXPECT_EQ(ids.front(), tokenizer->tokenId("<|im_system|>").value());
  EXPECT_EQ(ids.back(), tokenizer->tokenId("<|im_middle|>").value());
}

TEST(ChatTemplate, DeepSeekFormats) {
  const std::vector<ChatMessage> turns = {{"system", "You are helpful.", ""},
                                          {"user", "Hi", ""},
                                          {"assistant", "Hello!", ""},
                                          {"user", "Bye", ""}};
  EXPECT_EQ(renderChat(ChatFormat::DeepSeekV3, turns).value(),
            "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi<｜Assistant｜>Hello!"
            "<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜>");
  EXPECT_EQ(renderChat(ChatFormat::DeepSeekV32, turns).value(),
            "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi<｜Assistant｜></think>Hello!"
            "<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜></think>");
  auto empty = renderChat(ChatFormat::DeepSeekV3, {});
  ASSERT_FALSE(empty.isOk());
  EXPECT_EQ(empty.status().message(), "\"messages\" is empty");
  EXPECT_FALSE(renderChat(ChatFormat::None, turns).isOk());
  // bpe_deepseek has no chat_template in its tokenizer_config.json: V3.2, whose checkpoints ship
  // none; with a Jinja template (V3, V3.1) it is V3.
  auto tokenizer = loadOrDie("bpe_deepseek");
  ASSERT_TRUE(tokenizer);
  EXPECT_EQ(tokenizer->chatFormat(), ChatFormat::DeepSeekV32);
  const std::string text = readText(dataDir("bpe_deepseek") + "/tokenizer.json");
  auto v3 = Tokenizer::fromHfJson(text, R"({"chat_template": "{{bos_token}}..."})", "v3");
  ASSERT_TRUE(v3.isOk()) << v3.status().message();
  EXPECT_EQ((*v3)->chatFormat(), ChatFormat::DeepSeekV3);
  // add_bos_token: completion prompts start with BOS.
  auto bos = Tokenizer::fromHfJson(
      text, R"({"add_bos_token": true, "bos_token": {"content": "<｜begin▁of▁sentence｜>"}})", "b");
  ASSERT_TRUE(bos.isOk()) << bos.status().message();
  EXPECT_EQ((*bos)->promptBosToken(), tokenizer->tokenId("<｜begin▁of▁sentence｜>"));
  EXPECT_FALSE(tokenizer->promptBosToken().has_value());
  const auto ids = tokenizer->encode(renderChat(ChatFormat::DeepSeekV32, turns).value()).value();
  EXPECT_EQ(ids.front(), tokenizer->tokenId("<｜begin▁of▁sentence｜>").value());
  EXPECT_EQ(ids.back(), tokenizer->tokenId("</think>").value());
  EXPECT_EQ(parseChatFormat("deepseek-v3.2").value(), ChatFormat::DeepSeekV32);
  EXPECT_EQ(parseChatFormat("auto").value(), std::nullopt);
  EXPECT_FALSE(parseChatFormat("jinja").isOk());
}

// Malformed files: an error naming the file and the field, never a crash.
TEST(TokenizerLoader, ErrorsNameTheFileAndField) {
  const std::string good = readText(dataDir("bpe_gpt2") + "/tokenizer.json");
  auto hfError = [](const std::string &text, const std::string &config = "") {
    auto loaded = Tokenizer::fromHfJson(text, config, "t/tokenizer.json");
    return loaded.isOk() ? std::string("ok") : loaded.status().message();
  };
  EXPECT_EQ(hfError(good), "ok");
  EXPECT_EQ(hfError("{"), "t/tokenizer.json: not a JSON object");
  EXPECT_EQ(hfError(R"({"model": {"type": "WordPiece", "vocab": {}}})"),
            "t/tokenizer.json: model.type: only \"BPE\" (byte-level) is supported, not "
            "\"WordPiece\"");
  json spec = json::parse(good);
  auto mutated = [&](auto change) {
    json copy = spec;
    change(copy);
    return hfError(copy.dump());
  };
  EXPECT_EQ(mutated([](json &s) { s["model"]["merges"][3] = "nospace"; }),
            "t/tokenizer.json: model.merges[3]: expected \"a b\" or [\"a\", \"b\"]");
  EXPECT_EQ(mutated([](json &s) { s["model"]["merges"][0] = "Q Z"; }),
            "t/tokenizer.json: model.merges[0]: \"Q\", \"Z\" or their concatenation is not in "
            "model.vocab");
  EXPECT_EQ(mutated([](json &s) { s["model"]["vocab"]["!"] = "zero"; }),
            "t/tokenizer.json: model.vocab[\"!\"]: expected an integer id");
  EXPECT_EQ(mutated([](json &s) { s["model"]["vocab"]["!"] = 1LL << 40; }),
            "t/tokenizer.json: model.vocab[\"!\"]: id 1099511627776 is out of range");
  EXPECT_EQ(mutated([](json &s) {
              s["pre_tokenizer"] = {{"type", "Split"},
                                    {"pattern", {{"Regex", "(unclosed"}}},
                                    {"behavior", "Isolated"}};
            }),
            "t/tokenizer.json: pre_tokenizer.pattern: bad regex at offset 9: missing closing "
            "parenthesis");
  EXPECT_EQ(mutated([](json &s) { s["pre_tokenizer"] = {{"type", "Metaspace"}}; }),
            "t/tokenizer.json: pre_tokenizer.type: \"Metaspace\" is not supported (byte-level "
            "BPE: ByteLevel, Split, Sequence)");
  EXPECT_EQ(mutated([](json &s) { s["pre_tokenizer"] = nullptr; }),
            "t/tokenizer.json: pre_tokenizer: no ByteLevel pre-tokenizer: not a byte-level BPE");
  EXPECT_EQ(mutated([](json &s) { s["added_tokens"][0]["lstrip"] = true; }),
            "t/tokenizer.json: added_tokens[0].lstrip: true is not supported (only exact "
            "matches)");
  EXPECT_EQ(mutated([](json &s) { s["normalizer"] = {{"type", "NFC"}}; }),
            "t/tokenizer.json: normalizer: normalizers are not supported (byte-level BPE has "
            "none)");
  EXPECT_EQ(hfError(good, "[1]"), "t/tokenizer.json (tokenizer_config.json): not a JSON object");

  auto tiktokenError = [](const std::string &text, const std::string &config = "") {
    auto loaded = Tokenizer::fromTiktoken(text, config, "k/tiktoken.model");
    return loaded.isOk() ? std::string("ok") : loaded.status().message();
  };
  EXPECT_EQ(tiktokenError("IQ== 0\nIg== 1\n"), "ok");
  EXPECT_EQ(tiktokenError("IQ== 0\nIg== 1\n@@@@ 2\n"),
            "k/tiktoken.model: line 3: the token is not valid base64");
  EXPECT_EQ(tiktokenError("IQ== 0\nIg==\n"),
            "k/tiktoken.model: line 2: expected \"<base64 token> <rank>\"");
  EXPECT_EQ(tiktokenError("IQ== 0\nIg== 0\n"), "k/tiktoken.model: line 2: rank 0 appears twice");
  EXPECT_EQ(tiktokenError("IQ== 0\nIQ== 1\n"), "k/tiktoken.model: line 2: the token appears twice");
  EXPECT_EQ(tiktokenError("IQ== -1\n"),
            "k/tiktoken.model: line 1: the rank is not a non-negative integer");
  EXPECT_EQ(tiktokenError("IQ== 99999999\n"),
            "k/tiktoken.model: line 1: rank 99999999 leaves too large a gap after 0 tokens");
  EXPECT_EQ(tiktokenError(""), "k/tiktoken.model: no tokens");
  EXPECT_EQ(tiktokenError("IQ== 0\n", R"({"pat_str": "[a"})"),
            "k/tiktoken.model (tokenizer_config.json): pat_str: unterminated character class at "
            "offset 0");
  EXPECT_EQ(tiktokenError("IQ== 0\n", R"({"added_tokens_decoder": {"0": {"content": "<x>"}}})"),
            "k/tiktoken.model (tokenizer_config.json): added_tokens_decoder[\"0\"]: id 0 is a "
            "rank of the tiktoken.model");
  EXPECT_EQ(tiktokenError("IQ== 0\n", R"({"added_tokens_decoder": {"x": {"content": "<x>"}}})"),
            "k/tiktoken.model (tokenizer_config.json): added_tokens_decoder[\"x\"]: the key is "
            "not a token id in range");

  auto missing = Tokenizer::load(dataDir("no-such-dir"));
  ASSERT_FALSE(missing.isOk());
  EXPECT_EQ(missing.status().message(), dataDir("no-such-dir") + ": not a directory");
  auto empty = Tokenizer::load(HYBRID_TEST_DATA_DIR);
  ASSERT_FALSE(empty.isOk());
  EXPECT_EQ(empty.status().message(),
            std::string(HYBRID_TEST_DATA_DIR) + ": no tokenizer.json or tiktoken.model");
}

// A byte the vocabulary lacks is an encode error, not a crash.
TEST(TokenizerLoader, AMissingByteIsAnEncodeError) {
  auto tokenizer = Tokenizer::fromTiktoken("IQ== 0\nIg== 1\n", "", "k/tiktoken.model");
  ASSERT_TRUE(tokenizer.isOk()) << tokenizer.status().message();
  EXPECT_EQ((*tokenizer)->encode("!\"").value(), (std::vector<int64_t>{0, 1}));
  auto missing = (*tokenizer)->encode("a");
  ASSERT_FALSE(missing.isOk());
  EXPECT_EQ(missing.status().message(), "no token for the byte 0xa in the vocabulary");
}

} // namespace
} // namespace hybrid
