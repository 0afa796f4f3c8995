"""Runs of S tokens in one slot's own row over row-view KV: prefill chunks, draft checks and new requests' prompts
run together (``RowChunks``), and the fixed run lengths they take (``chunk_pieces``, ``PROMPT_SHAPES``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import onnxruntime as ort

from engine.model_loader import GraphIO

if TYPE_CHECKING:
    from engine.kv_cache import KVCache

# NOTE(engine): ortserve-built graphs have this optional int64 [1] input (an overridable initializer,
# default 0 = every position): 1 makes a prefill chunk compute only its last position's logits. Folders from
# other builders lack it and get all positions, of which the last is used.
LOGITS_TO_KEEP = "logits_to_keep"

class ChunkOwner(Protocol):
    """What ``RowChunks`` uses of the runner that owns it (``engine.runner.RunnerBase``): its buffers, its
    per-slot KV lengths and its host-input binding."""

    kv: KVCache
    mask: np.ndarray  # int64 [num_slots, length]
    slot_len: np.ndarray  # int64 [num_slots]: valid KV positions per slot
    num_slots: int
    vocab_size: int
    prefill_chunk: int
    prompt_budget: int
    max_batched_prompt: int

    def _bind_host(self, binding: ort.IOBinding, name: str, value: ort.OrtValue) -> None: ...

    def _run(self, binding: ort.IOBinding, session: ort.InferenceSession | None = None,
             run_options: ort.RunOptions | None = None) -> None: ...

    def _set_ones(self, rows: np.ndarray, ones: np.ndarray) -> None: ...

    def _chunk_inputs(self, token_ids: Sequence[int], start: int) -> tuple[np.ndarray, np.ndarray]: ...


# NOTE(engine): on the CUDA EP the first run of a chunk length costs over 10x every later one (docs/perf/GPU.md),
# and nearly every prompt ends in a length not seen before:
# that was the ITL p99 of streams beside arriving prompts (84 ms) and most of a 64-stream burst's TTFT. With fixed
# shapes a chunk runs as pieces whose lengths are its base-16 digits (141 -> 128 + 13), each length warmed at load:
# 31 lengths up to 256, at most 2 runs per chunk below 256.
SHAPE_BASE = 16


# NOTE(engine): new requests' prompts run together as GroupQueryAttention's first prompt (no past: the mask as wide as
# the run), [k, S] filled up with token 0: with prompt shapes S is one of these lengths (at least the longest prompt)
# and k one of prompt_counts, each (k, S) warmed at load (RowChunks.warm_prompt_shapes).
PROMPT_SHAPES = (16, 32, 64, 128, 256)
# Row counts up to this run as they are; above it, multiples of it (and the rest in a second run).
PROMPT_COUNT_STEP = 8


def prompt_counts(num_slots: int) -> tuple[int, ...]:
    """The row counts of batched prompt runs with prompt shapes: 1 to PROMPT_COUNT_STEP, then its multiples.

    NOTE(engine): a burst's new requests take neighbouring rows, and each run costs its launches (2-3 ms on the
    CUDA EP whatever k is): counts in powers of two split 31 rows into 5 runs (16 + 8 + 4 + 2 + 1, 16.6 ms on the
    H200 where one run took 5.7); these split any range into at most 2 (24 + 7), for twice the warm-up runs.
    """
    step = PROMPT_COUNT_STEP
    return tuple(range(1, min(step, num_slots) + 1)) + tuple(range(2 * step, num_slots + 1, step))


def prompt_groups(slots: Sequence[int], counts: Sequence[int] | None) -> list[tuple[int, int]]:
    """``(first index, count)`` groups of ascending ``slots``: consecutive slots (rows bound as one range), each
    split into the largest of ``counts`` that fits, then the rest (None: any count, one group per range)."""
    groups, i = [], 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        while i < j:
            k = j - i if counts is None else max(c for c in counts if c <= j - i)
            groups.append((i, k))
            i += k
    return groups


def chunk_shapes(limit: int) -> list[int]:
    """The run lengths of fixed-shape chunks of at most ``limit`` tokens: d * 16**i <= limit, d in 1..15."""
    shapes, unit = [], 1
    while unit <= limit:
        shapes += [d * unit for d in range(1, SHAPE_BASE) if d * unit <= limit]
        unit *= SHAPE_BASE
    return shapes


def chunk_pieces(num: int) -> list[int]:
    """``num`` tokens as runs of ``chunk_shapes`` lengths, largest first: its nonzero base-16 digits."""
    pieces, unit = [], 1
    while num:
        num, digit = divmod(num, SHAPE_BASE)
        if digit:
            pieces.append(digit * unit)
        unit *= SHAPE_BASE
    return pieces[::-1]


class RowChunks:
    """Runs of S tokens in one slot's own row over row-view KV (host views or device addresses): prefill chunks
    (the last position's logits) and draft checks (every position's), ``[1, S]`` each.

    GroupQueryAttention takes S > 1 new tokens with a past at batch 1 only, so a chunk runs its row alone.

    Args:
        owner: the runner whose buffers (mask, prefill inputs, KV lengths) and host-input binding the runs use.
        session: the session to run (one of the plain graph, which takes any S).
        io: its names.
        run_options: for every run (``gpu_graph_id=-1`` beside captured decode steps: no capture of a chunk).
        fixed_shapes: run each chunk as ``chunk_pieces`` (lengths ``warm_shapes`` runs once at load).
        max_verify: the longest draft check (the tokens of one verify run), for ``warm_shapes``.
        batch_prompts: ``prompts`` runs new requests' prompts together (needs the graph's logits_to_keep).
        prompt_shapes: those runs take ``PROMPT_SHAPES`` widths and ``prompt_counts`` row counts, each warmed at load
            (None: as ``fixed_shapes``).
    """

    def __init__(self, owner: ChunkOwner, session: ort.InferenceSession, io: GraphIO,
                 run_options: ort.RunOptions | None = None, fixed_shapes: bool = False, max_verify: int = 0,
                 batch_prompts: bool = False, prompt_shapes: bool | None = None) -> None:
        self.owner = owner
        self.fixed_shapes = fixed_shapes
        self.prompt_shapes = fixed_shapes if prompt_shapes is None else prompt_shapes
        self.prompt_counts = prompt_counts(owner.num_slots) if self.prompt_shapes else None
        self.max_verify = max_verify
        self.num_runs = 0  # session runs made (a chunk with fixed shapes may take several)
        self.session = session
        self.io = io
        self.run_options = run_options
        vocab = owner.vocab_size
        self.keep_last = LOGITS_TO_KEEP in {i.name for i in session.get_overridable_initializers()}
        self.prefill_logits = np.zeros((1 if self.keep_last else owner.prefill_chunk) * vocab, dtype=np.float32)
        self._keep_one = ort.OrtValue.ortvalue_from_numpy(np.ones(1, dtype=np.int64))
        self._keep_n = np.ones(1, dtype=np.int64)  # logits_to_keep of a verify run, written before each
        self._keep_n_value = ort.OrtValue.ortvalue_from_numpy(self._keep_n)
        self._verify_logits = np.zeros(0, dtype=np.float32)  # [S * V], grown on demand
        self._past = tuple(zip(io.past_keys, io.past_values))
        self._present = tuple(zip(io.present_keys, io.present_values))
        self._bindings: dict[tuple[int, bool], ort.IOBinding] = {}
        self.batch_prompts = batch_prompts and self.keep_last
        self._prompt_bindings: dict[tuple[int, int], ort.IOBinding] = {}
        self.num_prompt_runs = self.num_prompt_rows = 0  # prompts' runs, and the rows they ran (warm-up included)
        self._prompt_logits = np.zeros((owner.num_slots, 1, vocab) if self.batch_prompts else (0,), dtype=np.float32)

    def prompts(self, slots: Sequence[int], token_lists: Sequence[Sequence[int]]) -> None:
        """Prompt tokens ``[0, len)`` of each of ``slots`` (ascending; rows holding no KV the request needs), in one
        run per ``prompt_groups`` group: ``[k, S]``, each row filled up with token 0 to the group's S (a
        ``PROMPT_SHAPES`` length with fixed shapes), the mask S wide and all ones, so GroupQueryAttention takes
        it as a first prompt of S tokens in every row, which it runs at any batch (a chunk after a past it runs
        at batch 1 only).

        NOTE(engine): the filler writes KV past the row's prompt, where nothing attends until the row's own next
        tokens overwrite it (as an idle decode row's dummy token does); real positions attend causally, so they
        never see it: the KV of each row's prompt is that of its prompt run alone (bit for bit on the CPU EP).
        The filler counts as tokens (not padding) so that no EP's handling of right padding is relied on.
        """
        owner = self.owner
        for at, k in prompt_groups(slots, self.prompt_counts):
            rows, lists = slots[at:at + k], token_lists[at:at + k]
            lengths = [len(t) for t in lists]
            longest = max(lengths)
            if not (0 < min(lengths) and longest <= owner.max_batched_prompt):
                raise ValueError(f"a batched prompt holds 1..{owner.max_batched_prompt} tokens, got {lengths}")
            width = next(s for s in PROMPT_SHAPES if s >= longest) if self.prompt_shapes else longest
            ids = np.zeros((k, width), dtype=np.int64)
            for r, tokens in enumerate(lists):
                ids[r, :len(tokens)] = tokens
            self._run_prompts(rows[0], k, ids, np.ones((k, width), dtype=np.int64))
            owner.slot_len[list(rows)] = lengths

    def _run_prompts(self, lo: int, k: int, ids: np.ndarray, mask: np.ndarray) -> None:
        self.num_runs += 1
        self.num_prompt_runs += 1
        self.num_prompt_rows += k
        owner, io = self.owner, self.io
        binding = self._prompt_bindings.get((lo, k))
        if binding is None:
            binding = self.session.io_binding()
            owner._bind_host(binding, LOGITS_TO_KEEP, self._keep_one)
            binding.bind_ortvalue_output(io.logits, _value(self._prompt_logits[:k]))  # (not read)
            owner.kv.bind_rows(binding, self._past, self._present, lo, lo + k)
            self._prompt_bindings[(lo, k)] = binding
        binding.bind_ortvalue_input(io.input_ids, ort.OrtValue.ortvalue_from_numpy(ids))
        binding.bind_ortvalue_input(io.attention_mask, ort.OrtValue.ortvalue_from_numpy(mask))
        owner.mask_bytes = mask.nbytes
        if io.position_ids:
            pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
            binding.bind_ortvalue_input(io.position_ids, ort.OrtValue.ortvalue_from_numpy(pos))
        owner._run(binding, self.session, self.run_options)

    def run(self, slot: int, token_ids: Sequence[int], start: int, all_logits: bool) -> np.ndarray:
        """Tokens ``[start, start + S)`` in ``slot``; returns float32 ``[1 or S, V]`` logits (only the last
        position's unless ``all_logits``; all of them when the graph lacks logits_to_keep). A view, valid until
        the next run (with fixed shapes: one run per piece, the last piece's logits, or all pieces' joined)."""
        pieces = chunk_pieces(len(token_ids)) if self.fixed_shapes else [len(token_ids)]
        if len(pieces) == 1:
            return self._run(slot, token_ids, start, all_logits)
        parts, at = [], 0
        for num in pieces:
            logits = self._run(slot, token_ids[at:at + num], start + at, all_logits)
            if all_logits:
                parts.append(logits.copy())  # the next piece's run reuses the buffer
            at += num
        return np.concatenate(parts) if all_logits else logits

    def warm_shapes(self, max_verify: int | None = None) -> int:
        """With fixed shapes, run every piece length once in slot 0 (which holds nothing yet), and the draft
        checks' up to ``max_verify`` tokens (None: the one given at construction); returns the runs made."""
        if not self.fixed_shapes:
            return self.warm_prompt_shapes()
        runs = [(num, False) for num in chunk_shapes(self.owner.prefill_chunk)]
        longest = self.max_verify if max_verify is None else max_verify
        runs += [(num, True) for num in chunk_shapes(longest)] if self.keep_last else []
        for num, verify in runs:
            self._run(0, [0] * num, 0, verify)
        self.owner.slot_len[0] = 0
        return len(runs) + self.warm_prompt_shapes()

    def warm_prompt_shapes(self) -> int:
        """With fixed shapes and batched prompts, run each ``[k, S]`` a step's budget can ask for once, in rows
        ``[0, k)`` (which hold nothing yet); returns the runs made."""
        if not (self.prompt_shapes and self.batch_prompts):
            return 0
        owner, made = self.owner, 0
        limit = max(2 * owner.prefill_chunk, PROMPT_SHAPES[0] * owner.num_slots, owner.prompt_budget)
        for width in (s for s in PROMPT_SHAPES if s <= owner.max_batched_prompt):
            for k in self.prompt_counts or ():
                if k * width > limit:
                    break
                self._run_prompts(0, k, np.zeros((k, width), dtype=np.int64), np.ones((k, width), dtype=np.int64))
                made += 1
        owner.slot_len[:] = 0
        return made

    def _run(self, slot: int, token_ids: Sequence[int], start: int, all_logits: bool) -> np.ndarray:
        self.num_runs += 1
        owner, io, num, vocab = self.owner, self.io, len(token_ids), self.owner.vocab_size
        ids, pos = owner._chunk_inputs(token_ids, start)
        ones = start + num
        owner._set_row_ones(slot, ones)
        verify = self.keep_last and all_logits
        binding = self._bindings.get((slot, verify)) or self._make_binding(slot, verify)
        if verify:
            self._keep_n[0] = num
            if len(self._verify_logits) < num * vocab:
                self._verify_logits = np.zeros(num * vocab, dtype=np.float32)
            logits = self._verify_logits[:num * vocab].reshape(1, num, vocab)  # [1, S, V]
            binding.bind_ortvalue_output(io.logits, ort.OrtValue.ortvalue_from_numpy(logits))
        elif self.keep_last:  # [1, 1, V], bound once in _make_binding
            logits = self.prefill_logits[:vocab].reshape(1, 1, vocab)
        else:
            logits = self.prefill_logits[:num * vocab].reshape(1, num, vocab)  # [1, S, V]
            binding.bind_ortvalue_output(io.logits, ort.OrtValue.ortvalue_from_numpy(logits))
        binding.bind_ortvalue_input(io.input_ids, ort.OrtValue.ortvalue_from_numpy(ids))
        if io.position_ids:
            binding.bind_ortvalue_input(io.position_ids, ort.OrtValue.ortvalue_from_numpy(pos))
        if owner._narrow_mask:  # the row's ones only: [1, start + S] (see _make_binding)
            binding.bind_cpu_input(io.attention_mask, owner.mask[slot:slot + 1, :ones])
        owner.mask_bytes = (ones if owner._narrow_mask else owner.length) * 8
        owner._run(binding, self.session, self.run_options)
        owner.slot_len[slot] = ones
        return logits[0]

    def _make_binding(self, slot: int, verify: bool) -> ort.IOBinding:
        """A chunk binding of ``slot`` (logits of the last position), or with ``verify`` one whose
        logits_to_keep is ``_keep_n`` (its logits output is bound per run)."""
        owner, io = self.owner, self.io
        binding = self.session.io_binding()
        # NOTE(engine): a chunk or a draft check after a past reads the mask only for its row's length (GQA's
        # seqlens_k) and its width (total_sequence_length); bound whole, every run of a long context paid for the
        # full max_model_len row (cast, sum, and GQA's sizes). Host rows bind the row's ones per run instead.
        if not owner._narrow_mask:
            owner._bind_host(binding, io.attention_mask, _value(owner.mask[slot:slot + 1]))
        if self.keep_last:
            owner._bind_host(binding, LOGITS_TO_KEEP, self._keep_n_value if verify else self._keep_one)
            if not verify:
                binding.bind_ortvalue_output(io.logits, _value(self.prefill_logits[:owner.vocab_size].reshape(
                    1, 1, owner.vocab_size)))
        owner.kv.bind_rows(binding, self._past, self._present, slot, slot + 1)
        self._bindings[(slot, verify)] = binding
        return binding


def _value(array: np.ndarray) -> Any:
    """Zero-copy OrtValue over a contiguous numpy array (keeps the array alive)."""
    assert array.flags.c_contiguous
    return ort.OrtValue.ortvalue_from_numpy(array)
