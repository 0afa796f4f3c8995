"""Hugging Face tokenizer.json/tokenizer_config.json from GGUF vocabularies, and the synthetic tokenizer.

Byte-level BPE only (GGUF tokenizer.ggml.model "gpt2"). Imports tokenizers, never onnx/onnxruntime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.builder.errors import UnsupportedTokenizerError

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ggml token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def make_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` value.

    NOTE(builder): "smollm" is llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: every digit alone (\\p{N}), then
    the GPT-2 regex; that is exactly the SmolLM2 HF tokenizer's Digits(individual) + ByteLevel(regex).
    """
    if pre == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in ("gpt-2", "gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3"):
        return _split_then_bytes(_LLAMA3_SPLIT)
    if pre == "qwen2":
        return _split_then_bytes(_QWEN2_SPLIT)
    raise UnsupportedTokenizerError(
        f"tokenizer.ggml.pre {pre!r} is not supported (supported: smollm, gpt-2, llama-bpe, qwen2)")


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
