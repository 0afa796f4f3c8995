"""Constrained decoding with llguidance: compiles StructuredOutput specs and fills token bitmasks.

The only module that imports llguidance. Owns one LLTokenizer per engine (built on first use, off the core
thread), an LRU of compiled grammars, compilation in worker threads under a time limit, the per-request
GrammarConstraint (fill / accept / rollback / is_done) and the batched mask fill. No onnxruntime import;
the sampler applies the masks (engine.sampling_law.apply_token_bitmask), this module only computes them.
Beside each grammar a KeyTracker (engine.json_keys) keeps any JSON object from repeating a key, which no
grammar can express for keys it does not list.

Bitmask layout (llguidance's): int32 ``[rows, ceil(vocab / 32)]``; bit ``j`` of word ``i`` (little-endian)
allows token ``32 * i + j``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from engine.json_keys import KeyTracker
from engine.json_schema import LENIENT_JSON_OPTIONS, close_objects
from engine.types import InvalidRequestError, StructuredOutput

log = logging.getLogger(__name__)

# NOTE(engine): compact JSON (no whitespace between tokens at all): "," and ":" separators, so a token budget
# goes to content, not to indentation. A schema's own "x-guidance" options still win over these defaults.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
ANY_JSON_OBJECT = '{"type": "object"}'
_MAX_ERROR_CHARS = 600
_TIMEOUT_CODE = "grammar_compile_timeout"
_INVALID_CODE = "invalid_structured_output"
_JSON_KINDS = ("json_object", "json_schema")
_QUOTE_BYTE = 0x22


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


class GrammarError(Exception):
    """A spec that llguidance cannot compile (raised in a worker; becomes an InvalidRequestError)."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def to_grammar(kind: str, spec: str) -> str:
    """llguidance's grammar text for one StructuredOutput kind and spec (no tokenizer needed).

    Raises:
        GrammarError: the spec is malformed (not JSON where JSON is expected, an empty choice list, GBNF
            that does not convert). Grammars that parse here may still fail to compile (LLMatcher).
    """
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON ({exc})") from None
        if schema is True:  # the schema that accepts everything
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError(f"the JSON schema must be an object (or true), got {_short(schema)}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema), defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"choice must be a JSON list of strings ({exc})") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError(f"choice must be a non-empty list of strings, got {_short(choices)}")
        # NOTE(engine): Lark string literals take JSON's escapes, so json.dumps quotes any choice safely.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    if kind == "gbnf":
        try:
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))
        except Exception as exc:  # the converter raises its own GbnfToLarkError and plain ValueErrors
            raise GrammarError(f"the GBNF grammar does not parse: {exc}") from None
    raise GrammarError(f"unknown structured output kind {kind!r}")


@dataclass(frozen=True)
class SchemaCheck:
    """What llguidance makes of one JSON Schema (objects closed, as every grammar here closes them).

    Attributes:
        relaxed: what a lenient grammar leaves unenforced, each once: keywords
            (``"propertyNames"``, ``"if"``), ``"oneOf"`` (enforced as an anyOf), ``"format: <name>"`` (any
            string); empty when the schema is enforced as written.
        error: why even a lenient grammar cannot be built (a ref that does not resolve, an unsatisfiable or
            unsupported combination), or None.
    """

    relaxed: tuple[str, ...] = ()
    error: str | None = None

    @property
    def exact(self) -> bool:
        """The grammar enforces the schema as written (a strict tool or response_format needs this)."""
        return not self.relaxed and self.error is None


def check_schema(schema: Any) -> SchemaCheck:
    """How a grammar would enforce ``schema`` (a JSON Schema: dict or bool); no tokenizer needed, cached.

    Usage::

        check_schema({"type": "object", "propertyNames": {"pattern": "^a"}})
        # SchemaCheck(relaxed=("propertyNames",), error=None)
    """
    if schema is False:
        return SchemaCheck(error="the schema is false: no value is valid")
    return _check_schema_text(json.dumps({} if schema is True else schema))


@functools.lru_cache(maxsize=512)
def _check_schema_text(text: str) -> SchemaCheck:
    schema = json.loads(text)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            close_objects(schema), defaults={**JSON_OPTIONS, **LENIENT_JSON_OPTIONS})
        failed, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except ValueError as exc:
        return SchemaCheck(error=_clip(str(exc)))
    if failed:
        return SchemaCheck(error=_clip("; ".join(warnings)))
    relaxed: list[str] = []
    for warning in warnings:
        found = _UNIMPLEMENTED.search(warning)
        fmt = _UNKNOWN_FORMAT.search(warning)
        if found:
            names = json.loads(found.group(1))
        elif fmt:
            names = [f"format: {fmt.group(1)}"]
        elif warning.startswith("oneOf"):
            names = ["oneOf"]
        else:
            names = [_clip(warning)]
        relaxed += [n for n in names if n not in relaxed]
    return SchemaCheck(tuple(relaxed))


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _clip(message: str) -> str:
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + " ..."


class GrammarConstraint:
    """One request's grammar state: which tokens may come next, advanced by each sampled token.

    Only the core thread uses it once the request is queued. ``fill`` writes one bitmask row; ``accept``
    advances by a sampled token (False: the grammar rejects it, the constraint is in error from then on).
    With ``keys`` (and the ``vocab`` it reads tokens from), ``fill`` also clears the tokens that would repeat
    a key in a JSON object.
    """

    __slots__ = ("_matcher", "num_accepted", "_keys", "_vocab", "_token_ids")

    def __init__(self, matcher: Any, keys: KeyTracker | None = None, vocab: VocabBytes | None = None) -> None:
        self._matcher = matcher
        self.num_accepted = 0
        self._keys = keys if vocab is not None else None
        self._vocab = vocab
        self._token_ids: list[int] = []  # accepted tokens, to replay the key tracker after a rollback

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 ``[rows, words]``, C-contiguous)."""
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
        if self._keys is not None:
            self.mask_repeated_keys(target)

    def mask_repeated_keys(self, target: np.ndarray) -> None:
        """Clear, in one filled bitmask row (int32 ``[words]``), the tokens that would close a JSON key already
        written in its object.

        NOTE(engine): only tokens holding a quote can close a key (163 of SmolLM2's 49k), and none at all until
        some open object has a key. Inside a key (the hot case) the used keys name the texts that may precede
        the closing quote, and those are looked up in the vocabulary (VocabBytes.by_head); only the few tokens
        that escape or hold more keys are probed one by one. Elsewhere the grammar-allowed tokens with enough
        quotes to open and close a key are probed. Should every allowed token repeat a key (a schema whose only
        key pattern is used up), the row is left as the grammar made it: a repeat then beats an empty mask.
        """
        keys, vocab = self._keys, self._vocab
        assert keys is not None and vocab is not None
        need = keys.quotes_needed()
        if not need:
            return
        heads = keys.closing_heads()
        clears = [vocab.by_head[h] for h in heads if h in vocab.by_head] if heads is not None else []
        ids, word_ids, shifts = vocab.complex_ids if heads is not None else vocab.quote_ids[min(need, 3)]
        allowed = ids[(target[word_ids] >> shifts) & 1 != 0].tolist()  # the grammar allows them
        if allowed:
            found = [allowed[i] for i in keys.repeats([vocab.bytes_of(t) for t in allowed])]
            if found:
                clears.append(_word_masks(np.array(found, dtype=np.int64)))
        if not clears:
            return
        words = target.view(np.uint32)
        saved = [(word_ids, words[word_ids]) for word_ids, _ in clears]  # fancy indexing copies
        for word_ids, clear in clears:
            words[word_ids] &= clear
        if not words.any():
            for word_ids, values in reversed(saved):
                words[word_ids] = values

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar rejects it (then ``error`` says why)."""
        ok = self._matcher.consume_token(int(token_id))
        if ok:
            self.num_accepted += 1
            if self._keys is not None:
                self._token_ids.append(int(token_id))
                self._feed_keys(int(token_id))
        return ok

    def _feed_keys(self, token_id: int) -> None:
        keys, vocab = self._keys, self._vocab
        assert keys is not None and vocab is not None
        if vocab.special[token_id]:
            if not keys.json_only:
                keys.restart_text()  # a marker token (a tool call's) ends any JSON read so far
        else:
            keys.feed(vocab.bytes_of(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding rejects drafts this way)."""
        if num_tokens > self.num_accepted or not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens ({self.num_accepted} accepted)")
        self.num_accepted -= num_tokens
        if self._keys is not None and num_tokens:
            del self._token_ids[len(self._token_ids) - num_tokens:]
            self._keys.reset()  # replayed from the start: rollbacks are rare and outputs short
            for token_id in self._token_ids:
                self._feed_keys(token_id)

    def checkpoint(self) -> tuple[int, Any]:
        """Where the constraint stands now, for ``restore``: speculative decoding advances it through draft tokens
        to mask each position of a check (or of a draft), then takes them back."""
        return self.num_accepted, (self._keys.snapshot() if self._keys is not None else None)

    def restore(self, checkpoint: tuple[int, Any]) -> None:
        """Undo every token accepted since ``checkpoint`` (the matcher rolls back; the key tracker returns to its
        snapshot instead of replaying the output, as ``rollback`` does)."""
        num_accepted, keys = checkpoint
        num_tokens = self.num_accepted - num_accepted
        if num_tokens < 0 or (num_tokens and not self._matcher.rollback(num_tokens)):
            raise ValueError(f"cannot roll back {num_tokens} tokens ({self.num_accepted} accepted)")
        self.num_accepted = num_accepted
        if self._keys is not None:
            del self._token_ids[num_accepted:]
            self._keys.restore(keys)

    def allows(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, in order, the grammar would accept from here (state unchanged)."""
        return self._matcher.validate_tokens(list(token_ids))

    @property
    def is_done(self) -> bool:
        """The grammar is complete and allows nothing more (end the request: finish_reason "stop")."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (an end-of-sequence token is allowed here)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the constraint failed (a rejected token, a resource limit), or None."""
        return _clip(self._matcher.get_error()) if self._matcher.is_error() else None


def _word_masks(token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bitmask words holding ``token_ids`` and, per word, the mask that clears those tokens' bits (uint32, for
    ``words[word_ids] &= clear``)."""
    word_ids, inverse = np.unique(token_ids >> 5, return_inverse=True)
    bits = np.zeros(len(word_ids), dtype=np.uint32)
    np.bitwise_or.at(bits, inverse, (np.uint32(1) << (token_ids & 31).astype(np.uint32)))
    return word_ids, ~bits


def _bit_index(token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, bitmask word of each, bit of each): to read a row's bits of ``token_ids`` in one step."""
    return token_ids, token_ids >> 5, token_ids & 31


class VocabBytes:
    """The vocabulary as the key tracker reads it: each token's bytes, which are special, which hold a quote.

    Args:
        tokenizer: llguidance's LLTokenizer (special tokens and the padding past the tokenizer's own
            vocabulary are special: they never carry JSON text).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        n = tokenizer.vocab_size
        self.special = np.array([tokenizer.is_special_token(i) for i in range(n)], dtype=bool)  # [vocab]
        # NOTE(engine): one pass over the vocabulary at start-up (0.3 s for Gemma 3's 262k tokens, in the
        # tokenizer worker); only the bytes of the tokens holding a quote are kept.
        self._quoted: dict[int, bytes] = {}
        for i in np.flatnonzero(~self.special).tolist():
            data = tokenizer.decode_bytes([i])
            if _QUOTE_BYTE in data:
                self._quoted[i] = data
        ids = np.array(sorted(self._quoted), dtype=np.int32)
        counts = np.array([self._quoted[i].count(b'"') for i in ids.tolist()], dtype=np.int32)
        # quote_ids[k]: the token ids holding at least k quotes (k = 1, 2, 3), ascending, as _bit_index
        self.quote_ids = {k: _bit_index(ids[counts >= k]) for k in (1, 2, 3)}
        # Inside a key: the tokens whose first quote closes it, grouped by the text before that quote, as
        # (word indexes, bits) to clear; the others (a backslash before the quote, or two more quotes after it:
        # perhaps another key) are probed one by one.
        heads: dict[bytes, list[int]] = collections.defaultdict(list)
        complex_ids = []
        for i, data in self._quoted.items():
            q = data.index(b'"')
            if b"\\" in data[:q] or data.count(b'"', q + 1) >= 2:
                complex_ids.append(i)
            else:
                heads[data[:q]].append(i)
        self.by_head = {head: _word_masks(np.array(group, dtype=np.int64)) for head, group in heads.items()}
        self.complex_ids = _bit_index(np.array(sorted(complex_ids), dtype=np.int32))

    def bytes_of(self, token_id: int) -> bytes:
        data = self._quoted.get(token_id)
        return data if data is not None else self._tokenizer.decode_bytes([token_id])


class StructuredOutputBackend:
    """Compiles specs for one engine and fills the masks of its constrained rows.

    Usage::

        backend = StructuredOutputBackend(tokenizer.hf, vocab_size=49152, eos_token_ids={2})
        constraint = await backend.constraint_for(StructuredOutput("json_object"))  # event loop
        bitmask = backend.allocate_bitmask(8)
        backend.fill([(constraint, 0)], bitmask)  # core thread, before sampling
        constraint.accept(token_id)  # core thread, after sampling

    Args:
        hf_tokenizer: the model's ``tokenizers.Tokenizer`` (serialized once, when first needed).
        vocab_size: the logits width (the runner's); masks cover ``max(vocab_size, tokenizer size)`` tokens.
        eos_token_ids: every id that ends the request (the engine's); the grammar allows them once complete.
        compile_timeout_s: a grammar not compiled within this many seconds is a 400.
        cache_size: compiled grammars kept (least recently used dropped first).
        max_workers: compile threads.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], *,
                 compile_timeout_s: float = 10.0, cache_size: int = 64, max_workers: int = 2) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = max(vocab_size, hf_tokenizer.get_vocab_size(with_added_tokens=True))
        self.words = bitmask_words(self.vocab_size)
        self.eos_token_ids = sorted(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="ortserve-grammar")
        self._lock = threading.Lock()
        self._tokenizer_future: concurrent.futures.Future | None = None
        # (kind, spec) -> Future[template LLMatcher] (never advanced; each request gets a deep copy)
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = \
            collections.OrderedDict()
        self._executor: Any = None  # llguidance.LLExecutor, made on the first parallel fill
        self._vocab: VocabBytes | None = None  # made with the LLTokenizer
        # NOTE(engine): measured on 2 shared cores (docs/perf/structured.md): LLExecutor's threads gain nothing
        # over filling row by row there (8 JSON rows: ~140 us either way) and add scheduling outliers beside
        # ORT's own threads, so rows are filled in parallel only with cores to spare.
        self.parallel_min_rows = 4 if (os.cpu_count() or 1) >= 8 else 1 << 30
        self.limits = llguidance.LLParserLimits(verbose_errors=False)

    # -- compiling (event loop and worker threads) ------------------------------------------------------

    def start(self) -> concurrent.futures.Future:
        """Start building the LLTokenizer in a worker (idempotent); seconds for a 50k-262k vocabulary."""
        with self._lock:
            if self._tokenizer_future is None:
                self._tokenizer_future = self._pool.submit(self._build_tokenizer)
            return self._tokenizer_future

    def _build_tokenizer(self) -> Any:
        t0 = time.perf_counter()
        tokenizer = llguidance.LLTokenizer(self._hf.to_str(), n_vocab=self.vocab_size,
                                           eos_token=self.eos_token_ids or None)
        self._vocab = VocabBytes(tokenizer)
        log.info("grammar tokenizer ready: %d tokens, eos %s (%.2f s)", tokenizer.vocab_size,
                 tokenizer.eos_tokens, time.perf_counter() - t0)
        return tokenizer

    def _constraint(self, kind: str, template: Any) -> GrammarConstraint:
        """A request's constraint: a copy of the compiled ``template`` and a fresh key tracker."""
        return GrammarConstraint(template.deep_copy(), KeyTracker(json_only=kind in _JSON_KINDS), self._vocab)

    def _compile(self, kind: str, spec: str) -> Any:
        """Worker thread: the template matcher of one spec (raises GrammarError)."""
        tokenizer = self.start().result()
        grammar = to_grammar(kind, spec)
        # NOTE(engine): LLMatcher never raises for grammar errors; it is built in an error state instead.
        # Building it releases the GIL (0.1-1 s for very large grammars), bounded by self.limits.
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def compile_future(self, spec: StructuredOutput) -> concurrent.futures.Future:
        """The (cached or new) compilation of ``spec``: a Future of its template matcher."""
        key = (spec.kind, spec.spec)
        # NOTE(engine): the tokenizer job is queued before any compile job (the pool is FIFO), so a compile that
        # waits for it never holds the worker that would build it.
        self.start()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, *key)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    async def constraint_for(self, spec: StructuredOutput) -> GrammarConstraint:
        """A fresh constraint for one request, compiling ``spec`` unless cached.

        Raises:
            InvalidRequestError: (param ``spec.param``) the spec does not compile, names an unsupported
                feature, or did not compile within ``compile_timeout_s`` (code "grammar_compile_timeout").
        """
        # NOTE(engine): the tokenizer is built once per engine and its time is not the grammar's; asyncio.wait
        # never cancels the futures, so a compile shared by several requests survives one caller leaving.
        tokenizer_future = asyncio.wrap_future(self.start())
        await asyncio.wait({tokenizer_future})
        tokenizer_future.result()
        key = (spec.kind, spec.spec)
        future = self.compile_future(spec)
        wrapped = asyncio.wrap_future(future)
        done, _ = await asyncio.wait({wrapped}, timeout=self.compile_timeout_s)
        if not done:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]  # a later request compiles afresh (and is timed afresh)
            raise InvalidRequestError(
                f"{spec.param}: the {_describe(spec.kind)} did not compile within the time limit of "
                f"{self.compile_timeout_s:g} s", param=spec.param, code=_TIMEOUT_CODE)
        try:
            template = wrapped.result()
        except GrammarError as exc:
            raise InvalidRequestError(f"{spec.param}: the {_describe(spec.kind)} cannot be enforced: "
                                      f"{_clip(str(exc))}", param=spec.param, code=_INVALID_CODE) from None
        return self._constraint(spec.kind, template)

    def constraint_sync(self, spec: StructuredOutput) -> GrammarConstraint:
        """``constraint_for`` without an event loop (tests, the bench); waits for the compile."""
        try:
            template = self.compile_future(spec).result(self.compile_timeout_s)
        except GrammarError as exc:
            raise InvalidRequestError(f"{spec.param}: the {_describe(spec.kind)} cannot be enforced: "
                                      f"{_clip(str(exc))}", param=spec.param, code=_INVALID_CODE) from None
        return self._constraint(spec.kind, template)

    # -- masks (core thread) --------------------------------------------------------------------------

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        """An int32 ``[rows, words]`` bitmask, every token allowed."""
        return np.full((rows, self.words), -1, dtype=np.int32)

    def fill(self, rows: Sequence[tuple[GrammarConstraint, int]], bitmask: np.ndarray) -> None:
        """Fill ``bitmask[row]`` for each (constraint, row); several rows in parallel (releases the GIL).

        Args:
            rows: the constrained rows of this step.
            bitmask: int32 ``[n, words]``, C-contiguous; rows not named are left as they are.
        """
        if len(rows) < self.parallel_min_rows:
            for constraint, row in rows:
                constraint.fill(bitmask, row)
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        assert bitmask.flags.c_contiguous and bitmask.dtype == np.int32
        self._executor.unsafe_compute_mask_ptr([(c._matcher, row) for c, row in rows], bitmask.ctypes.data,
                                               self.words * 4, bitmask.shape[0])
        for constraint, row in rows:
            if constraint._keys is not None:
                constraint.mask_repeated_keys(bitmask[row])

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _describe(kind: str) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object format", "regex": "regex",
            "choice": "choice list", "lark": "Lark grammar", "gbnf": "GBNF grammar"}.get(kind, kind)
