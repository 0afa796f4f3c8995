"""The model's tokenizer (tokenizer.json via Hugging Face ``tokenizers``) and its special tokens.

No onnxruntime import.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from engine.types import ModelLoadError


class Tokenizer:
    """Encode/decode text for one model.

    Args:
        hf: the loaded ``tokenizers.Tokenizer``.
    """

    def __init__(self, hf: HFTokenizer) -> None:
        self.hf = hf
        # token text -> id, added tokens included: read once (a model hub loads tokenizers beside running streams)
        self.vocab: dict[str, int] = read_vocab(hf)
        # L and the characters that can vanish (see token_bound); None: no bound for this tokenizer.
        self.max_chars_per_token, self._vanishing = token_bound(hf, self.vocab) or (None, "")

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as exc:  # tokenizers raises plain Exception subclasses for bad files
            raise ModelLoadError(f"cannot read tokenizer {path}: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        """Size including added tokens."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are recognized.

        ``add_special_tokens`` adds what the tokenizer's post-processor adds (e.g. BOS); rendered chat
        templates already contain their special tokens, so the default is False.
        """
        # NOTE(engine): encode_batch, because `encode` holds the GIL for the whole call (seconds for a long
        # text), which would freeze every other thread, the event loop included; encode_batch releases it.
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` that costs no tokenizing (0 when the tokenizer gives no
        bound; see ``token_bound``)."""
        if self.max_chars_per_token is None:
            return 0
        num_kept = len(text) - sum(text.count(char) for char in self._vanishing)
        return math.ceil(num_kept / self.max_chars_per_token)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def special_token_id(self, token: str) -> int | None:
        """The id of ``token`` if a grammar must name it as a token rather than spell it, else None.

        That is a special added token (``[TOOL_CALLS]``), and also any added token written ``<...>`` (Qwen's
        ``<tool_call>`` is added but not special): NOTE(tools): llguidance treats those as special too, so
        their bytes never match grammar text.
        """
        token_id = self.hf.token_to_id(token)
        if token_id is None:
            return None
        added = self.hf.get_added_tokens_decoder().get(token_id)
        if added is None:
            return None
        return token_id if added.special or (token.startswith("<") and token.endswith(">")) else None


class HeldTokenizers:
    """Tokenizers this process keeps once parsed, by file: a model hub holds every listed model's.

    NOTE(hub): ``tokenizers`` parses a tokenizer.json holding the interpreter lock the whole time (0.9 s for Gemma 3's
    262k tokens on a quiet core, 2.7 s on a busy 2-core machine), so a model loaded on demand would stall every
    stream the server process is sending meanwhile. The hub parses each listed model's tokenizer once, right after
    start-up, and keeps it (about 130 MiB of RSS for Gemma 3's, 10-20 MiB for 50k-token vocabularies); loading the
    model then parses nothing in the server process. A file changed since it was held is parsed again.
    """

    def __init__(self) -> None:
        self._held: dict[Path, tuple[tuple[int, int], Tokenizer]] = {}
        self._locks: dict[Path, threading.Lock] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(path: str | Path) -> tuple[Path, tuple[int, int]]:
        path = Path(path).expanduser().resolve()
        try:
            stat = path.stat()
        except OSError as exc:
            raise ModelLoadError(f"cannot read tokenizer {path}: {exc}") from exc
        return path, (stat.st_mtime_ns, stat.st_size)

    def _path_lock(self, path: Path) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(path, threading.Lock())

    def hold(self, path: str | Path, tokenizer: Tokenizer | None = None) -> Tokenizer:
        """Keep ``path``'s tokenizer: ``tokenizer`` when given (already parsed from that file), else the file parsed
        now (blocking: call it from a thread). Holding it again returns the one held."""
        resolved, version = self._key(path)
        with self._path_lock(resolved):
            held = self._held.get(resolved)
            if held is not None and held[0] == version:
                return held[1]
            tokenizer = tokenizer or Tokenizer.from_file(resolved)
            self._held[resolved] = (version, tokenizer)
            return tokenizer

    def load(self, path: str | Path) -> Tokenizer:
        """The held tokenizer of ``path`` when its file is unchanged (waiting for one being parsed for holding),
        else the file parsed now and not kept."""
        resolved, version = self._key(path)
        with self._lock:
            lock = self._locks.get(resolved)
        if lock is not None:
            with lock:
                held = self._held.get(resolved)
            if held is not None and held[0] == version:
                return held[1]
        return Tokenizer.from_file(resolved)

    def held(self, path: str | Path) -> bool:
        resolved, version = self._key(path)
        held = self._held.get(resolved)
        return held is not None and held[0] == version

    def release(self, path: str | Path) -> None:
        resolved = Path(path).expanduser().resolve()
        with self._lock:
            self._held.pop(resolved, None)


# The process's held tokenizers (the server's: see HeldTokenizers).
HELD_TOKENIZERS = HeldTokenizers()


def read_vocab(hf: HFTokenizer) -> dict[str, int]:
    """``hf.get_vocab(with_added_tokens=True)``, read one token at a time.

    NOTE(engine): get_vocab builds the whole dict in one call that holds the interpreter lock (260 ms for Gemma 3's
    262k tokens on a loaded 2-core machine), stalling every stream the server process is sending meanwhile; this
    loop costs the same but lets other threads run between its steps. Added tokens win over the model's own entry
    of the same text, as in get_vocab.
    """
    vocab: dict[str, int] = {}
    id_to_token = hf.id_to_token
    for token_id in range(hf.get_vocab_size(with_added_tokens=True)):
        token = id_to_token(token_id)
        if token is not None:
            vocab.setdefault(token, token_id)
    for token_id, added in hf.get_added_tokens_decoder().items():
        vocab[added.content] = token_id
    return vocab


# --- how many characters one token can cover -----------------------------------------------------------
# NOTE(engine): a prompt that cannot fit the context is refused before it is tokenized (seconds and hundreds
# of MB for a few MB of text) when a bound proves it: if every character of the (normalized) text ends up in
# the string of some token, and no token's string is longer than L characters, the text has at least
# len(text) / L tokens. The pieces below are those known to keep every character; anything else (a
# normalizer or pre-tokenizer that drops characters, unknown-token fusing, added tokens that swallow the
# whitespace around them) gives no bound, and such a prompt is tokenized in full before the length check.

_KEEPING_NORMALIZERS = {"Prepend", "NFD", "NFKD", "Lowercase"}  # each character stays (maybe expanded)
# Unicode composition joins at most 4 code points into one: the longest canonical decomposition is 4 long
# (e.g. U+1FAF, omega with three diacritics).
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_MAX_COMPOSED = 4
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "UnicodeScripts"}
_SPLITTING_PRE_TOKENIZERS = {"Split", "Punctuation"}  # keep everything unless their behavior is "Removed"


def _normalizer_shrink(spec: dict[str, Any] | None) -> int | None:
    """The most a normalizer can shorten a text (1: never), or None when it may drop characters."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for item in spec.get("normalizers", []):
            item_factor = _normalizer_shrink(item)
            if item_factor is None:
                return None
            factor *= item_factor
        return factor
    if kind in _KEEPING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _MAX_COMPOSED
    if kind == "Replace":
        pattern = spec.get("pattern", {}).get("String")
        return 1 if isinstance(pattern, str) and len(spec.get("content", "")) >= len(pattern) else None
    return None


def _pre_tokenizer_keeps_all(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_all(item) for item in spec.get("pretokenizers", []))
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _vanishing_characters(hf: HFTokenizer, pre: dict[str, Any] | None, vocab: dict[str, int]) -> str | None:
    """The characters the model drops without a token ("" when it drops none), or None when it may drop
    characters it cannot spell or stand for several with one unknown-token."""
    model = hf.model
    if getattr(model, "byte_fallback", False):
        return ""
    if not isinstance(model, models.BPE):  # Unigram fuses unknown runs; WordPiece/WordLevel map words to one
        return None
    if model.unk_token is not None:
        return None if model.fuse_unk else ""
    if "ByteLevel" not in json.dumps(pre):
        return None
    # NOTE(engine): byte-level BPE without an unknown token drops the bytes missing from its vocabulary
    # (SmolLM2's lacks a few ASCII control characters). A character vanishes only if all of its UTF-8 bytes
    # are missing; with every continuation byte (0x80-0xBF) present, only one-byte characters can.
    from tokenizers.pre_tokenizers import ByteLevel

    def symbols(text: str) -> str:  # the byte-level spelling of `text`, one symbol per UTF-8 byte
        return ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)[0][0]

    if any(symbols(chr(c))[1] not in vocab for c in range(0x80, 0xC0)):  # U+0080-U+00BF end in 0x80-0xBF
        return None
    return "".join(chr(c) for c in range(0x80) if symbols(chr(c)) not in vocab)


def token_bound(hf: HFTokenizer, vocab: dict[str, int] | None = None) -> tuple[int, str] | None:
    """(L, vanishing) such that a text has at least (len(text) - its vanishing characters) / L tokens, or
    None when this tokenizer allows no such bound (see the note above).

    L is measured on the tokenizer: the longest token string of the vocabulary and the added tokens (in the
    tokenizer's own alphabet, which spells a character with at least one symbol: ByteLevel one per UTF-8
    byte, Metaspace "▁" for a space), times what the normalizer can shrink a text by.
    """
    normalizer, pre = (json.loads(part.__getstate__()) if part is not None else None
                       for part in (hf.normalizer, hf.pre_tokenizer))
    shrink = _normalizer_shrink(normalizer)
    vocab = hf.get_vocab(with_added_tokens=True) if vocab is None else vocab
    vanishing = _vanishing_characters(hf, pre, vocab)
    if (shrink is None or vanishing is None or not vocab or not _pre_tokenizer_keeps_all(pre)
            or any(t.lstrip or t.rstrip for t in hf.get_added_tokens_decoder().values())):
        return None
    return shrink * max(len(token) for token in vocab), vanishing
