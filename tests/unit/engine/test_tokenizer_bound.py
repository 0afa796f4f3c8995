"""Tokenizer.min_num_tokens: a lower bound on the token count from a text's length alone, so a prompt that
cannot fit is refused before it is tokenized. It must never exceed the real count (no fitting prompt may
be refused), and it must exist for the tokenizer families ortserve serves."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.builder.tokenizer import build_bpe_tokenizer, bytes_to_unicode, make_pre_tokenizer, synthetic_tokenizer
from engine.tokenizer import Tokenizer

LETTERS = "etaoinsrhldcumfpgwybvkxjqz"


def _byte_level(pre: str = "smollm", drop_controls: bool = False) -> HFTokenizer:
    """Byte-level BPE (GPT-2/SmolLM2/Qwen2 style) with ChatML specials, some merges up to 12-letter tokens;
    drop_controls leaves a few ASCII control bytes out of the vocabulary, as SmolLM2's does."""
    b2u = bytes_to_unicode()
    missing = {0x04, 0x06, 0x1D} if drop_controls else set()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [b2u[b] for b in range(256) if b not in missing]
    merges: list[tuple[str, str]] = []
    for word in ("the", "and", "ing", "tion", "information", "aaaaaaaaaaaa", "ĠĠĠĠ", "ĠĠĠĠĠĠĠĠ"):
        for end in range(2, len(word) + 1):
            left, right = word[:end - 1], word[end - 1]
            if word[:end] not in tokens:
                merges.append((left, right))
                tokens.append(word[:end])
    return build_bpe_tokenizer(tokens, merges, [3, 3, 3] + [1] * (len(tokens) - 3), pre=pre)


def _metaspace(normalizer: normalizers.Normalizer | None = None) -> HFTokenizer:
    """SentencePiece-style BPE (Llama 2 / Mistral / Gemma): "▁" for spaces, byte fallback."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + list(LETTERS)
    merges = []
    for word in ("▁the", "▁and", "▁information"):
        for end in range(2, len(word) + 1):
            if word[:end] not in tokens:
                merges.append((word[:end - 1], word[end - 1]))
                tokens.append(word[:end])
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token="<unk>",
                                 byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer or normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False),
                            AddedToken("</s>", special=True, normalized=False)])
    return tok


def _nfc_byte_level() -> HFTokenizer:
    tok = _byte_level()
    tok.normalizer = normalizers.NFC()  # Qwen2's tokenizer.json
    return tok


def _synthetic() -> HFTokenizer:
    return synthetic_tokenizer(512)[0]  # the tiny test model's tokenizer


BOUNDED = {"byte_level": _byte_level, "byte_level_missing_controls": lambda: _byte_level(drop_controls=True),
           "llama3_split": lambda: _byte_level("llama-bpe"), "metaspace": _metaspace, "nfc": _nfc_byte_level,
           "synthetic": _synthetic}
TOKENIZERS = {name: Tokenizer(make()) for name, make in BOUNDED.items()}

# Text made to be cheap in tokens: the longest tokens' text, special tokens, long space runs, characters a
# normalizer composes (e + combining acute, Hangul jamo, Greek with three diacritics), control characters a
# byte-level vocabulary may lack, and ordinary letters, digits and emoji.
PIECES = ["information", "aaaaaaaaaaaa", " " * 8, "        ", "the", " and", "<|im_start|>", "<|im_end|>", "<s>",
          "e\u0301", "\u1100\u1161\u11a8", "\u03c9\u0314\u0342\u0345", "\x04", "\x06", "\x1d", "\n", "7", "é",
          "😀", "\U00050000", "x"]
TEXTS = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=60).map("".join)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_the_bound_never_exceeds_the_real_count(name: str, text: str) -> None:
    tok = TOKENIZERS[name]
    assert tok.min_num_tokens(text) <= len(tok.encode(text))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_bound_holds_on_long_runs_of_the_cheapest_text(name: str) -> None:
    tok = TOKENIZERS[name]
    for piece in PIECES:
        text = piece * 2000
        assert tok.min_num_tokens(text) <= len(tok.encode(text)), repr(piece)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_bound_is_there_and_proves_a_huge_text_too_long(name: str) -> None:
    """Every supported family gets a bound, and 4 MB of text cannot pass for a 8192-token context."""
    tok = TOKENIZERS[name]
    assert tok.max_chars_per_token is not None
    assert tok.min_num_tokens("lorem ipsum " * 350_000) > 8192


def test_vanishing_characters_are_not_counted() -> None:
    """SmolLM2's vocabulary lacks a few ASCII control bytes, which BPE then drops: they count for nothing."""
    tok = TOKENIZERS["byte_level_missing_controls"]
    assert tok.encode("\x04" * 1000) == []
    assert tok.min_num_tokens("\x04" * 1000) == 0
    assert tok.min_num_tokens("\x04" * 1000 + "x") == 1
    assert TOKENIZERS["byte_level"].min_num_tokens("\x04" * 1000) > 0  # nothing vanishes there


def test_composing_normalizers_widen_the_bound() -> None:
    """NFC joins up to 4 code points into one: U+03C9 with three combining marks is one character then."""
    plain, nfc = TOKENIZERS["byte_level"], TOKENIZERS["nfc"]
    assert nfc.max_chars_per_token == 4 * plain.max_chars_per_token
    greek = "\u03c9\u0314\u0342\u0345" * 3000
    assert len(nfc.encode(greek)) < len(plain.encode(greek))
    assert nfc.min_num_tokens(greek) <= len(nfc.encode(greek))


def _no_bound_cases() -> dict[str, HFTokenizer]:
    whitespace = _byte_level()
    whitespace.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), make_pre_tokenizer("gpt2")])
    removed = _byte_level()
    removed.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+"), behavior="removed")
    stripping = _metaspace(normalizers.Sequence([normalizers.Strip(), normalizers.Replace(" ", "▁")]))
    regex_replace = _metaspace(normalizers.Replace(Regex(r"\s+"), "▁"))
    lstrip = _byte_level()
    lstrip.add_special_tokens([AddedToken("<mask>", special=True, lstrip=True)])
    fused = HFTokenizer(models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    unigram = HFTokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0))
    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    no_bytes = HFTokenizer(models.BPE(vocab={"a": 0}, merges=[]))  # drops whatever it cannot spell
    return {"whitespace_split": whitespace, "split_removed": removed, "strip": stripping,
            "regex_replace": regex_replace, "lstrip_added_token": lstrip, "fused_unknown": fused,
            "unigram": unigram, "wordpiece": wordpiece, "bpe_without_bytes": no_bytes}


@pytest.mark.parametrize("name,hf", sorted(_no_bound_cases().items()))
def test_tokenizers_that_can_drop_or_fuse_text_give_no_bound(name: str, hf: HFTokenizer) -> None:
    """Each of these turns some long text into few or no tokens, so length alone proves nothing."""
    tok = Tokenizer(hf)
    assert tok.max_chars_per_token is None
    assert tok.min_num_tokens("a " * 10_000) == 0
