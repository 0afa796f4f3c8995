"""Hugging Face tokenizer.json/tokenizer_config.json from GGUF vocabularies, and the synthetic tokenizer.

Byte-level BPE (GGUF tokenizer.ggml.model "gpt2", with llama.cpp's pre-tokenizers) and SentencePiece
("llama": scores, byte fallback, the ▁ space convention), each rebuilt to tokenize as llama.cpp does.
Imports tokenizers, never onnx/onnxruntime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from engine.builder.errors import UnsupportedTokenizerError
from engine.chat_template import BUILTIN_TEMPLATES

CHATML_TEMPLATE = BUILTIN_TEMPLATES["chatml"]
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ggml token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), in the original tokenizer.json forms (Oniguruma takes
# the case-insensitive groups llama.cpp had to spell out).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex (None: GPT-2's, inside ByteLevel); "digits" isolates every \p{N} first.
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling"), (None, False)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    (None, True)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "dbrx", "smaug-bpe", "chatglm-bpe"), (_LLAMA3_SPLIT, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "kormo"), (_QWEN2_SPLIT, False)),
    "qwen35": (_QWEN35_SPLIT, False),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (_GPT4O_SPLIT, False)),
    "tekken": (_TEKKEN_SPLIT, False),
}


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def make_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    r"""The pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` value.

    NOTE(builder): "smollm" (and starcoder, refact, ...) is llama.cpp's: every \p{N} alone, then the GPT-2 regex;
    that is exactly Digits(individual) + ByteLevel(regex), the SmolLM2 HF tokenizer's own pre-tokenizer.
    """
    if pre == "default":  # gpt2-model files without a pre name: llama.cpp's default split is GPT-2-like
        pre = "gpt-2"
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedTokenizerError(
            f"tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})")
    pattern, digits = _PRE_TOKENIZERS[pre]
    if pattern is not None:
        return _split_then_bytes(pattern)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if digits:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens a model folder names (tokenizer_config/genai_config)."""

    bos_id: int
    eos_id: int
    pad_id: int
    eog_ids: tuple[int, ...] = ()  # every end-of-generation id (engine.end_of_generation), eos among them

    @property
    def eos_token_ids(self) -> list[int]:
        """genai_config's / generation_config's ``eos_token_id`` list: eos first, then the other EOG ids."""
        return [self.eos_id] + sorted(set(self.eog_ids) - {self.eos_id})


def build_bpe_tokenizer(
    tokens: list[str],
    merges: list[tuple[str, str]],
    token_types: list[int] | None,
    *,
    pre: str,
    bos_id: int | None = None,
    add_bos: bool = False,
) -> Tokenizer:
    """A byte-level BPE tokenizer whose ids are the positions in ``tokens``.

    Args:
        tokens: the vocabulary, byte-level-unicode strings, id = index.
        merges: BPE merges, highest priority first.
        token_types: ggml token types per id (CONTROL -> special added token, USER_DEFINED -> added
            token); None means no added tokens.
        pre: llama.cpp pre-tokenizer name (see ``make_pre_tokenizer``).
        bos_id: prepended by the post-processor when ``add_bos``.
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise UnsupportedTokenizerError("the GGUF vocabulary has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = make_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if token_types is not None:
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(token_types) if t == TOKEN_CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(token_types) if t == TOKEN_USER_DEFINED]
        tok.add_special_tokens(special)
        tok.add_tokens(user)
    return tok


SPM_SPACE = "\u2581"  # ▁, SentencePiece's space


def spm_merges(tokens: list[str], scores: list[float], token_types: list[int] | None) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm), best first.

    llama.cpp repeatedly merges the adjacent pair whose concatenation is a vocabulary piece of the highest
    score. As BPE merges: every split (left, right) of a piece into two pieces, ranked by the piece's score
    (ties: lower piece id first, then shorter left part). Byte pieces (<0xXX>) are never merge results.
    """
    types = token_types or [TOKEN_NORMAL] * len(tokens)
    pieces = {t: i for i, t in enumerate(tokens) if types[i] != TOKEN_BYTE}
    ranked = []
    for piece, i in pieces.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def build_spm_tokenizer(
    tokens: list[str],
    scores: list[float],
    token_types: list[int] | None,
    *,
    bos_id: int | None,
    eos_id: int | None,
    add_bos: bool,
    add_eos: bool = False,
    add_space_prefix: bool = True,
    rstrip_specials: bool = False,
) -> Tokenizer:
    """A SentencePiece vocabulary (GGUF tokenizer.ggml.model "llama") as a tokenizers BPE with byte fallback.

    Mirrors llama.cpp's SPM path: control, unknown and user-defined pieces are split out first (added tokens);
    each remaining segment gets a leading space when ``add_space_prefix`` (llama.cpp prefixes the first segment
    and every segment after a special token), spaces become ▁, pieces merge by score, and characters no piece
    covers fall back to <0xXX> byte pieces. Decoding reverses ▁ and the bytes (and drops the prefix space).

    Args:
        rstrip_specials: llama.cpp's Phi-3 rule: whitespace after a special token is dropped.
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise UnsupportedTokenizerError("the GGUF vocabulary has duplicate tokens")
    if scores is None or len(scores) != len(tokens):
        raise UnsupportedTokenizerError("a SentencePiece GGUF needs tokenizer.ggml.scores, one per token")
    if not all(f"<0x{b:02X}>" in vocab for b in range(256)):
        raise UnsupportedTokenizerError("the SentencePiece vocabulary lacks byte pieces <0x00>..<0xFF> (byte fallback)")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, token_types), fuse_unk=False,
                               byte_fallback=True))
    steps = [normalizers.Prepend(SPM_SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPM_SPACE)])
    decode = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    _set_post_processor(tok, tokens, bos_id if add_bos else None, eos_id if add_eos else None)
    if token_types is not None:
        keep = {"<unk>", "<s>", "<|endoftext|>"}  # llama.cpp's exceptions to the Phi-3 rstrip rule
        special = [AddedToken(tokens[i], special=True, normalized=False,
                              rstrip=rstrip_specials and tokens[i] not in keep)
                   for i, t in enumerate(token_types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
        user = [AddedToken(tokens[i], special=False, normalized=False, rstrip=rstrip_specials)
                for i, t in enumerate(token_types) if t == TOKEN_USER_DEFINED]
        tok.add_special_tokens(special)
        tok.add_tokens(user)
    return tok


def _set_post_processor(tok: Tokenizer, tokens: list[str], bos_id: int | None, eos_id: int | None) -> None:
    """BOS/EOS added around a single text (and each text of a pair) when the GGUF asks for them."""
    if bos_id is None and eos_id is None:
        return
    pre = [tokens[bos_id]] if bos_id is not None else []
    post = [tokens[eos_id]] if eos_id is not None else []
    specials = [(tokens[i], i) for i in (bos_id, eos_id) if i is not None]
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(pre + ["$A"] + post), pair=" ".join(pre + ["$A"] + post + pre + ["$B"] + post),
        special_tokens=list(dict.fromkeys(specials)))


def synthetic_vocab(vocab_size: int, added_tokens: Sequence[str] = ()) -> tuple[list[str], list[tuple[str, str]], list[int]]:
    """A deterministic byte-level BPE vocabulary of exactly ``vocab_size`` tokens.

    Ids 0-2 are the ChatML specials (<|endoftext|>, <|im_start|>, <|im_end|>, as in SmolLM2), 3-258 the
    256 bytes, the rest merges of letter n-grams, so every id decodes to text and any text encodes.
    ``added_tokens`` (e.g. ``<tool_call>``, as Qwen has them) take the last ids, as non-special added tokens.
    """
    if vocab_size < len(CHATML_SPECIALS) + 256 + len(added_tokens):
        raise ValueError(f"vocab_size must be >= {len(CHATML_SPECIALS) + 256 + len(added_tokens)}, got {vocab_size}")
    if added_tokens:
        tokens, merges, types = synthetic_vocab(vocab_size - len(added_tokens))
        return tokens + list(added_tokens), merges, types + [TOKEN_USER_DEFINED] * len(added_tokens)
    b2u = bytes_to_unicode()
    tokens = list(CHATML_SPECIALS) + [b2u[b] for b in range(256)]
    types = [TOKEN_CONTROL] * len(CHATML_SPECIALS) + [TOKEN_NORMAL] * 256
    letters = [b2u[ord(c)] for c in "etaoinsrhldcumfpgwybvkxjqz"]
    starts = [b2u[ord(" ")]] + letters
    merges: list[tuple[str, str]] = []
    level = starts
    seen = set(tokens)
    while len(tokens) < vocab_size:
        next_level = []
        for left in level:
            for right in letters:
                merged = left + right
                if merged in seen:
                    continue
                merges.append((left, right))
                tokens.append(merged)
                types.append(TOKEN_NORMAL)
                seen.add(merged)
                next_level.append(merged)
                if len(tokens) == vocab_size:
                    return tokens, merges, types
        level = next_level
    return tokens, merges, types


def synthetic_tokenizer(vocab_size: int, added_tokens: Sequence[str] = ()) -> tuple[Tokenizer, SpecialTokens]:
    """A real byte-level BPE tokenizer with ChatML specials for synthetic models (bos 1, eos/pad 2)."""
    tokens, merges, types = synthetic_vocab(vocab_size, added_tokens)
    return build_bpe_tokenizer(tokens, merges, types, pre="smollm"), SpecialTokens(1, 2, 2)


def tokenizer_config(
    tokenizer: Tokenizer,
    special: SpecialTokens,
    *,
    chat_template: str | None,
    model_max_length: int,
    add_bos: bool = False,
) -> dict[str, Any]:
    """tokenizer_config.json contents (the Hugging Face keys the engine and onnxruntime-genai read)."""
    def name(i: int) -> str | None:
        return tokenizer.id_to_token(i)

    added = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    config: dict[str, Any] = {
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": name(special.bos_id),
        "eos_token": name(special.eos_id),
        "pad_token": name(special.pad_id),
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "GPT2Tokenizer",
    }
    if chat_template:
        config["chat_template"] = chat_template
    return config
