#!/usr/bin/env python3
"""Writes the tokenizer test data of tests/data/tokenizer/ (TokenizerTest reads it; no Python at
test time). Needs `pip install tokenizers tiktoken`; run from anywhere:

    tools/scripts/make-tokenizer-testdata.py

1. Trains a small byte-level BPE with the `tokenizers` library on a fixed multilingual text.
2. Writes three checkpoint-style directories:
   - bpe_deepseek/: tokenizer.json with DeepSeek-V3's pre-tokenizer layout (a Sequence of Split
     regexes, then ByteLevel without its own regex), merges as [a, b] arrays, DeepSeek's special
     tokens, and a tokenizer_config.json;
   - bpe_gpt2/: the same vocabulary behind a plain ByteLevel pre-tokenizer (GPT-2's regex),
     merges in the "a b" string form, GPT-2's <|endoftext|>;
   - tiktoken_kimi/: the same vocabulary as a tiktoken.model (base64 bytes + rank) with Kimi's
     special tokens in tokenizer_config.json's added_tokens_decoder.
3. Writes goldens.json: for ~30 tricky strings the ids the Python libraries produce (tokenizers
   for the tokenizer.json directories, tiktoken with Kimi's pattern for the tiktoken one), with and
   without special tokens parsed.
The output is deterministic for given library versions (recorded in goldens.json).
"""
import base64
import json
import os
import sys

import tiktoken
import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data",
                    "tokenizer")
VOCAB_SIZE = 1200

# Kimi's split pattern, tokenization_kimi.py (moonshotai/Kimi-K2-Instruct, Kimi-Linear), pat_str.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# DeepSeek-V3's tokenizer.json pre-tokenizer: three Isolated splits, then ByteLevel(use_regex=false).
DEEPSEEK_SPLITS = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]

DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<think>", "</think>"]
KIMI_SPECIAL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                "<|im_middle|>"]

CORPUS = """The quick brown fox jumps over the lazy dog. It's a test; we're sure they'll pass, I'd say.
Hello, world! HELLO WORLD. CamelCaseIdentifier snake_case_name kebab-case-name.
Numbers: 0 1 12 123 1234 12345 3.14159 2025-01-31 1,000,000 $99.99 100% 42nd.
def encode(text: str) -> list[int]:
    return [ord(c) for c in text if c != ' ']

for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++ loop
    indented line with\ttabs\tand   multiple   spaces
中文分词测试：今天天气很好，我们去公园散步吧。模型的注意力机制非常重要。
日本語のテキスト：こんにちは、世界！カタカナとひらがな。
한국어 문장도 조금 있습니다. Ελληνικά κείμενα. Русский текст для проверки.
Emoji: 😀 😃 👍🏽 🎉🎉 ❤️ 👨‍👩‍👧 🇫🇷 — em dash, “quotes”, ‘single’, ellipsis…
Accents: café naïve résumé Ångström façade jalapeño über straße.
Mixed:混合English和中文123个token，with emoji 🚀 and code `x = y + 1`.
Whitespace runs:\n\n\n   \t  \r\n end.
"""

TEST_STRINGS = [
    "",
    "Hello, world!",
    "hello world",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "It's they're we've I'm you'll he'd",
    "IT'S LOUD",
    "CamelCaseIdentifier snake_case",
    "12345678901",
    "3.14159 and 2025-01-31",
    "$99.99 100%",
    "中文分词测试",
    "今天天气很好，我们去公园",
    "こんにちは、世界！",
    "混合English和中文123个token",
    "😀👍🏽🎉",
    "👨‍👩‍👧 family",
    "🇫🇷 flag",
    "café naïve résumé",
    "Ελληνικά Русский 한국어",
    "def f(x):\n    return x * 2\n",
    "a\tb\t\tc",
    "line1\n\n\nline2\r\nline3",
    "   \n  ",
    "x = y + 1 // comment",
    "unseen: ʃʒ ŋ ȸ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\u200bzero\u200bwidth",
    "tabs\tand  spaces   mixed \t\n",
    "emoji🚀inside",
]

# Strings with special tokens (parsed as single ids when special tokens are allowed).
SPECIAL_STRINGS = {
    "bpe_deepseek": [
        "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi there<｜Assistant｜></think>",
        "<｜User｜>中文<｜Assistant｜><think>\n好的</think>答案<｜end▁of▁sentence｜>",
        "text <think> more",
    ],
    "bpe_gpt2": [
        "Hello<|endoftext|>World",
        "<|endoftext|><|endoftext|> twice",
    ],
    "tiktoken_kimi": [
        "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>你好<|im_end|><|im_assistant|>assistant<|im_middle|>",
        "[BOS]start[EOS]",
        "not <|im_end special",
    ],
}


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def train():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in DEEPSEEK_SPLITS] +
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = CORPUS.splitlines(keepends=True)
    # Repeat with small variations so merges across words and scripts get counts.
    data = lines * 3 + [line.lower() for line in lines] + [line.upper() for line in lines]
    tok.train_from_iterator(data, trainer=trainer)
    return tok


def write_json(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=1, sort_keys=False)
        f.write("\n")


def goldens_for(name, encode_plain, encode_special, decode):
    cases = []
    for text in TEST_STRINGS:
        ids = encode_plain(text)
        assert decode(ids) == text, (name, text)
        cases.append({"text": text, "ids": ids, "special": False})
    for text in SPECIAL_STRINGS[name]:
        cases.append({"text": text, "ids": encode_special(text), "special": True})
        cases.append({"text": text, "ids": encode_plain(text), "special": False})
    return cases


def main():
    base = train()
    spec = json.loads(base.to_str())
    vocab = spec["model"]["vocab"]
    n = len(vocab)
    assert sorted(vocab.values()) == list(range(n))
    goldens = {"versions": {"tokenizers": tokenizers.__version__, "tiktoken": tiktoken.__version__},
               "tokenizers": {}}

    # bpe_deepseek: as trained, plus DeepSeek's special tokens (ids n, n+1, ...).
    deepseek = Tokenizer.from_str(base.to_str())
    deepseek.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in DEEPSEEK_SPECIAL])
    os.makedirs(os.path.join(ROOT, "bpe_deepseek"), exist_ok=True)
    deepseek.save(os.path.join(ROOT, "bpe_deepseek", "tokenizer.json"))
    write_json(os.path.join(ROOT, "bpe_deepseek", "tokenizer_config.json"), {
        "bos_token": DEEPSEEK_SPECIAL[0], "eos_token": DEEPSEEK_SPECIAL[1],
        "tokenizer_class": "LlamaTokenizerFast"})
    plain_deepseek = Tokenizer.from_str(base.to_str())  # no added tokens: nothing to parse
    goldens["tokenizers"]["bpe_deepseek"] = goldens_for(
        "bpe_deepseek",
        lambda t: plain_deepseek.encode(t, add_special_tokens=False).ids,
        lambda t: deepseek.encode(t, add_special_tokens=False).ids,
        lambda ids: deepseek.decode(ids, skip_special_tokens=False))

    # bpe_gpt2: the same vocabulary and merges behind GPT-2's ByteLevel regex, merges as strings.
    gpt2_spec = json.loads(base.to_str())
    gpt2_spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                  "use_regex": True}
    gpt2_spec["model"]["merges"] = [" ".join(pair) for pair in gpt2_spec["model"]["merges"]]
    gpt2 = Tokenizer.from_str(json.dumps(gpt2_spec))
    plain_gpt2 = Tokenizer.from_str(json.dumps(gpt2_spec))
    gpt2.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    os.makedirs(os.path.join(ROOT, "bpe_gpt2"), exist_ok=True)
    gpt2.save(os.path.join(ROOT, "bpe_gpt2", "tokenizer.json"))
    with open(os.path.join(ROOT, "bpe_gpt2", "tokenizer.json"), encoding="utf-8") as f:
        saved = json.load(f)
    saved["model"]["merges"] = [" ".join(p) if isinstance(p, list) else p
                                for p in saved["model"]["merges"]]
    write_json(os.path.join(ROOT, "bpe_gpt2", "tokenizer.json"), saved)
    gpt2 = Tokenizer.from_file(os.path.join(ROOT, "bpe_gpt2", "tokenizer.json"))
    goldens["tokenizers"]["bpe_gpt2"] = goldens_for(
        "bpe_gpt2",
        lambda t: plain_gpt2.encode(t, add_special_tokens=False).ids,
        lambda t: gpt2.encode(t, add_special_tokens=False).ids,
        lambda ids: gpt2.decode(ids, skip_special_tokens=False))

    # tiktoken_kimi: ranks = the BPE ids of the same vocabulary, Kimi's specials after them.
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes(byte_of[c] for c in token): rank for token, rank in vocab.items()}
    specials = {t: n + i for i, t in enumerate(KIMI_SPECIAL)}
    os.makedirs(os.path.join(ROOT, "tiktoken_kimi"), exist_ok=True)
    with open(os.path.join(ROOT, "tiktoken_kimi", "tiktoken.model"), "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token).decode() + " " + str(rank) + "\n")
    write_json(os.path.join(ROOT, "tiktoken_kimi", "tokenizer_config.json"), {
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for t, i in specials.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer"})
    enc = tiktoken.Encoding(name="kimi_test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                            special_tokens=specials)
    goldens["tokenizers"]["tiktoken_kimi"] = goldens_for(
        "tiktoken_kimi",
        lambda t: enc.encode_ordinary(t),
        lambda t: enc.encode(t, allowed_special="all"),
        lambda ids: enc.decode(ids))

    write_json(os.path.join(ROOT, "goldens.json"), goldens)
    print("wrote", ROOT, "vocabulary", n, file=sys.stderr)


if __name__ == "__main__":
    main()
