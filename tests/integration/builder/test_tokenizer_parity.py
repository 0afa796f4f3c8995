"""The rebuilt tokenizer.json against an independent implementation of llama.cpp's BPE algorithm on the
GGUF's own vocabulary and merges (split specials, "smollm" pre-split, byte-level BPE by merge rank)."""

from __future__ import annotations

import unicodedata

import pytest
from tokenizers import Tokenizer

from engine.builder.convert import gguf_tokenizer
from engine.builder.gguf_reader import open_gguf
from engine.builder.tokenizer import TOKEN_CONTROL, bytes_to_unicode

CORPUS = [
    "Hello world",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "<|im_start|>assistant\n",
    "Digits: 0 1 12 123 1234567890 3.14159 -42 1e-5 ١٢٣ ½ ²",
    "whitespace  runs   and\t\ttabs\n\n\n  newline then spaces    \n \r\n end   ",
    "   leading spaces", "trailing spaces   ", " ", "", "\n",
    "Unicode: naïve café Zürich — “quotes” ‘single’ ñ ß Ω 漢字 日本語のテキスト 한국어 العربية עברית हिन्दी",
    "Emoji 🎉🚀👍🏽 👨‍👩‍👧 ☕️",
    "Contractions: don't I'm we'll they've she'd it's YOU'RE 'quoted' ''",
    "Code: def f(x):\n    return x**2 + 1  # comment\nif a<=b && c!=d: print(f\"{a}\")",
    "URL https://example.com/a?b=c&d=e#frag and mail name@example.org",
    "Mixed123abc 4x4 v2.0.1 CamelCaseWord snake_case_word",
    "<|endoftext|>text after eot<|im_end|><|im_start|>",
    "!!!??? ... --- *** ### $$$ %%% ^^^",
]


def _category(c: str) -> str:
    cat = unicodedata.category(c)
    if cat.startswith("L"):
        return "L"
    if cat.startswith("N"):
        return "N"
    return "S" if c in _WHITESPACE else "P"


# Unicode White_Space (what \s means in the Rust and llama.cpp regexes)
_WHITESPACE = set("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {
    chr(c) for c in range(0x2000, 0x200B)}


def gpt2_split(text: str) -> list[str]:
    """Hand-written GPT-2 pre-tokenizer regex:
    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    out, i, n = [], 0, len(text)
    while i < n:
        if text[i] == "'":
            for c in ("re", "ve", "ll", "s", "t", "m", "d"):
                if text.startswith(c, i + 1):
                    out.append(text[i : i + 1 + len(c)])
                    i += 1 + len(c)
                    break
            else:
                c = None
            if c is not None:
                continue
        j = i + 1 if text[i] == " " and i + 1 < n and _category(text[i + 1]) != "S" else i
        cls = _category(text[j])
        if cls in ("L", "N", "P"):
            k = j + 1
            while k < n and _category(text[k]) == cls:
                k += 1
            out.append(text[i:k])
            i = k
            continue
        k = i
        while k < n and _category(text[k]) == "S":
            k += 1
        if k < n and k - i > 1:  # \s+(?!\S): leave the last space for the next word
            k -= 1
        out.append(text[i:k])
        i = k
    return out


def smollm_split(text: str) -> list[str]:
    """llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM: each \\p{N} alone, then the GPT-2 regex on the rest."""
    pieces, cur = [], ""
    for ch in text:
        if _category(ch) == "N":
            if cur:
                pieces.append(cur)
            pieces.append(ch)
            cur = ""
        else:
            cur += ch
    if cur:
        pieces.append(cur)
    return [w for p in pieces for w in (gpt2_split(p) if _category(p[0]) != "N" or len(p) > 1 else [p])]


class ReferenceBPE:
    """llama.cpp's llm_tokenizer_bpe: merge the lowest-rank adjacent pair until none applies."""

    def __init__(self, tokens: list[str], merges: list[tuple[str, str]], token_types: list[int]) -> None:
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {m: r for r, m in enumerate(merges)}
        self.specials = sorted((t for t, ty in zip(tokens, token_types) if ty == TOKEN_CONTROL), key=len, reverse=True)
        self.b2u = bytes_to_unicode()

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i, start = 0, 0
        while i <= len(text):
            special = next((s for s in self.specials if text.startswith(s, i)), None) if i < len(text) else None
            if special is None and i < len(text):
                i += 1
                continue
            ids += self._encode_plain(text[start:i])
            if special is None:
                break
            ids.append(self.ids[special])
            i += len(special)
            start = i
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        ids = []
        for word in smollm_split(text):
            parts = [self.b2u[b] for b in word.encode("utf-8")]
            while len(parts) > 1:
                pairs = [(self.ranks.get((a, b), 1 << 30), k) for k, (a, b) in enumerate(zip(parts, parts[1:]))]
                rank, k = min(pairs)
                if rank == 1 << 30:
                    break
                parts[k : k + 2] = [parts[k] + parts[k + 1]]
            ids += [self.ids[p] for p in parts]
        return ids


@pytest.fixture(scope="module")
def tokenizers_pair(smollm2_gguf):
    """(rebuilt tokenizers.Tokenizer, ReferenceBPE) over the real GGUF's vocabulary."""
    model = open_gguf(smollm2_gguf, max_layers=1)
    meta = model.tokenizer
    return gguf_tokenizer(model)[0], ReferenceBPE(meta.tokens, meta.merges, meta.token_types)


def test_reference_splitter_sanity():
    assert gpt2_split("Hello  world's 12ab!?") == ["Hello", " ", " world", "'s", " 12", "ab", "!?"]
    assert smollm_split("a 123") == ["a", " ", "1", "2", "3"]


@pytest.mark.parametrize("text", CORPUS)
def test_token_ids_match_llamacpp_bpe(tokenizers_pair, text):
    tok, ref = tokenizers_pair
    assert tok.encode(text).ids == ref.encode(text)
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_saved_tokenizer_and_specials(smollm2_dir):
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    assert tok.encode("<|im_start|>user\n1 2<|im_end|>").ids == [1, 4093, 198, 33, 216, 34, 2]
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.decode([1, 2], skip_special_tokens=True) == ""
