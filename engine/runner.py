"""Runs the decoder with IOBinding over the shared KV cache: prefill chunks and batched decode -> logits.

``engine.model_runner.ModelRunner`` is what the core and the scheduler see. Two runners implement it, one per way a
device lets KV rows be bound (``engine.kv_cache``; which one a device gets is decided in ``engine.placement``):
  * ``Runner`` (this module): row views, any row range bound on its own: host memory (numpy views) or device
    memory addressed by pointer (CUDA, HIP: the buffer's address plus a row offset);
  * ``engine.bucket_runner.BucketRunner``: opaque device buffers (WebGPU, DirectML): a prefix of the rows,
    staging and device row copies.
Both own their preallocated input/logits buffers and the per-slot KV lengths; only the core thread calls them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from engine.kv_cache import KVCache
from engine.model_loader import GraphIO
from engine.row_chunks import PROMPT_SHAPES, RowChunks, _value
from engine.run_interrupt import RunInterrupt

log = logging.getLogger(__name__)

HOST_SOURCE = "cpu"  # an input allocator's ``source`` for ordinary numpy memory (ep.host_memory.SOURCE_CPU)
# (shape, dtype) -> (numpy array, OrtValue over the same memory)
InputAllocator = Callable[[tuple[int, ...], Any], tuple[np.ndarray, ort.OrtValue]]


def host_input(shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, ort.OrtValue]:
    """An ordinary numpy buffer and its zero-copy CPU OrtValue."""
    array = np.zeros(shape, dtype=dtype)
    return array, ort.OrtValue.ortvalue_from_numpy(array)


def make_input_allocator(selected: Any) -> InputAllocator:
    """Decode inputs in the device's HOST_ACCESSIBLE memory where ep/ offers it, else host memory.

    The allocator's ``source`` attribute says which was taken last ("ep_host_accessible",
    "hip_host_malloc" or "cpu": the fallback, ordinary inputs).
    """
    # NOTE(lead): keyed on what the device offers, not on whether it is a plugin EP: HOST_ACCESSIBLE memory
    # (a plugin EP's, or a CPU allocator registered for it), or hip-python on AMD; the profile and ep/ decide.
    if selected is None or not selected.profile.host_accessible_inputs:
        return host_input
    from ep import host_memory

    def allocate(shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, ort.OrtValue]:
        buf = host_memory.alloc_host_accessible(shape, dtype, selected)
        allocate.source = HOST_SOURCE if buf is None else buf.source  # type: ignore[attr-defined]
        if buf is None:
            return host_input(shape, dtype)
        return buf.array, buf.ortvalue

    return allocate


class RunnerBase:
    """What both runners share: the decode input buffers (written in place), the per-row mask bookkeeping, the
    prefill buffers and the KV lengths of the slots.

    NOTE(engine): GQA derives each row's length from its mask (seqlens_k = ones - 1) and writes the new
    token's KV at ``ones - 1``. A row with no work ("idle") in a decode run gets ``ones = slot_len + 1``: its
    dummy KV lands at the row's first unused position, which the owner overwrites before it ever attends to
    it (a live request's KV never passes max_model_len - 1), and its attention span stays short. So the KV
    length is max_model_len, no reserved tail.

    Args:
        session: the decoder session.
        io: graph input/output names.
        kv: the KV cache (its ``shape.num_slots`` rows).
        prefill_chunk: the most tokens of one prefill run.
        max_position: positions fed to idle rows are clipped below this (the rotary cache length).
        input_allocator: where input_ids/position_ids/attention_mask (and the decode logits, where the runner
            writes them on the host) live: host-accessible memory on devices that offer it.
    """

    whole_buffer = False
    # The last decode's rows as the device summarized them: (argmax int64 [n], log-normalizer float32 [n], the
    # argmax's log-probability float32 [n]), the rows ``decode`` ran; None where the decode graph has no row summary.
    decode_summary: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    max_prefills_per_step = 0
    min_prefix_reuse: int | None = None
    # (session, ms) of each run since the core last took them; None: not kept (the step trace is off)
    run_log: list[tuple[str, float]] | None = None
    chunks: RowChunks | None = None  # runs of S tokens in a row (row-view KV only)
    # NOTE(engine): the attention mask a run binds is cut to the positions in use where the runner can (host KV,
    # plain CPU inputs: ``Runner``); the full-width row is the fallback (device inputs cross whole).
    _narrow_mask = False
    mask_bytes = 0  # bytes of attention mask the last run read: rows x width x 8 (what a step pays for its context)
    prompt_budget = 0  # tokens of whole prompts a step runs together beside prefill_chunk (the scheduler's)

    def __init__(self, session: ort.InferenceSession, io: GraphIO, kv: KVCache, *, prefill_chunk: int,
                 max_position: int, input_allocator: InputAllocator = host_input) -> None:
        self.session = session
        # NOTE(engine): the core arms it around runs of batch rows only; an interactive request's arrival stops them
        self.interrupt = RunInterrupt(ort.RunOptions())
        self.io = io
        self.kv = kv
        self.num_slots = kv.shape.num_slots
        self.length = kv.shape.length
        self.vocab_size = io.vocab_size
        self.prefill_chunk = prefill_chunk
        self.max_position = max_position
        n, chunk = self.num_slots, prefill_chunk
        self._past = tuple(zip(io.past_keys, io.past_values))
        self._present = tuple(zip(io.present_keys, io.present_values))
        # NOTE(engine): every buffer is allocated here once; steps write them in place.
        self.mask, self._mask_value = input_allocator((n, self.length), np.int64)  # ones: a prefix per row
        self.decode_ids, self._ids_value = input_allocator((n, 1), np.int64)
        self.decode_pos, self._pos_value = input_allocator((n, 1), np.int64)
        self.input_source = getattr(input_allocator, "source", HOST_SOURCE)  # where the decode inputs live
        self.mask_ones = np.zeros(n, dtype=np.int64)  # ones per row now
        self.slot_len = np.zeros(n, dtype=np.int64)  # valid KV positions per slot
        self.prefill_ids = np.zeros(chunk, dtype=np.int64)
        self.prefill_pos = np.zeros(chunk, dtype=np.int64)
        # NOTE(engine): IOBinding copies a host input to the device that consumes it when it is BOUND, not when
        # the session runs: a device session would keep reading the values of the first binding while the CPU
        # writes new ones in place (seen on the CUDA EP: every decode step fed the first step's token, and a
        # prefill read the mask of an earlier run). So on a device every host input of a cached binding is bound
        # again before each run (one host->device copy, as a plain run makes); host sessions read in place.
        self.rebind_inputs = not kv.addressable
        self._host_inputs: dict[int, list[tuple[str, ort.OrtValue]]] = {}  # id(binding) -> inputs to re-bind

    def release(self, slot: int, keep: int = 0) -> None:
        """The slot's request left; its first ``keep`` KV positions stay valid (a prefix kept for reuse).

        NOTE(engine): an idle row's dummy token is written at ``slot_len`` (see the class note), so a kept
        prefix survives the steps that run this row idle.
        """
        self.slot_len[slot] = keep

    def warmup(self) -> None:
        """Run what the first request would otherwise compile (nothing by default)."""

    @property
    def can_batch_prompts(self) -> bool:
        return self.chunks is not None and self.chunks.batch_prompts

    @property
    def max_batched_prompt(self) -> int:
        """The longest token list ``prefill_prompts`` takes: its padded run fits a chunk and the KV rows."""
        if not self.can_batch_prompts:
            return 0
        cap = min(self.prefill_chunk, self.length, PROMPT_SHAPES[-1])
        return max((s for s in PROMPT_SHAPES if s <= cap), default=0) if self.chunks.prompt_shapes else cap

    def prefill_prompts(self, slots: Sequence[int], token_lists: Sequence[Sequence[int]]) -> None:
        """The prompts of new requests, ``token_lists[i]`` at positions ``[0, len)`` of ``slots[i]`` (ascending),
        together (``RowChunks.prompts``); no logits: each request's next token (its prompt's last) goes
        through a decode step, which samples its first output token."""
        assert self.chunks is not None and self.chunks.batch_prompts
        self.chunks.prompts(slots, token_lists)

    def _bind_host(self, binding: ort.IOBinding, name: str, value: ort.OrtValue) -> None:
        """Bind a host input whose memory the CPU keeps writing (re-bound before each run on a device)."""
        binding.bind_ortvalue_input(name, value)
        if self.rebind_inputs:
            self._host_inputs.setdefault(id(binding), []).append((name, value))

    def _run(self, binding: ort.IOBinding, session: ort.InferenceSession | None = None,
             run_options: ort.RunOptions | None = None) -> None:
        """Run ``binding`` (on ``session``, default the decoder's) with its host inputs' current values."""
        for name, value in self._host_inputs.get(id(binding), ()):
            binding.bind_ortvalue_input(name, value)
        session = session or self.session
        if run_options is None and self.interrupt.armed:
            run_options = self.interrupt.options  # a batch run an interactive arrival may stop
        t0 = time.perf_counter() if self.run_log is not None else 0.0
        if run_options is None:
            session.run_with_iobinding(binding)
        else:
            # NOTE(engine): onnxruntime's Python wrapper refuses address-bound buffers (a KV prefix) under
            # capture ("requires fixed WebGPU device OrtValues"); the session itself replays them correctly
            # (docs/perf/GPU.md), so a captured step runs through the binding it was captured with.
            session._sess.run_with_iobinding(binding._iobinding, run_options)
        if self.run_log is not None:  # the step trace (engine.step_trace): each run's session and time
            ms = round((time.perf_counter() - t0) * 1e3, 3)
            self.run_log.append((self._session_names().get(id(session), "other"), ms))

    def _session_names(self) -> dict[int, str]:
        """id(session) -> what it runs, for ``run_log`` (a runner with more sessions names them too)."""
        return {id(self.session): "decode"}

    def _check_chunk(self, num: int, what: str = "prefill chunk") -> None:
        if not 0 < num <= self.prefill_chunk:
            raise ValueError(f"a {what} holds 1..{self.prefill_chunk} tokens, got {num}")

    def _write_decode_inputs(self, rows: np.ndarray, token_ids: Sequence[int], pos: np.ndarray, lo: int,
                             hi: int) -> None:
        """Token, position and mask of rows ``[lo, hi)`` for a decode run: ``rows`` get their tokens, the other
        rows of the range a dummy token at their first unused position."""
        if hi - lo > len(rows):  # idle rows in the range
            idle = np.setdiff1d(np.arange(lo, hi), rows, assume_unique=True)
            self.decode_ids[idle, 0] = 0
            self.decode_pos[idle, 0] = np.minimum(self.slot_len[idle], self.max_position - 1)
            self._set_ones(idle, self.slot_len[idle] + 1)
        self.decode_ids[rows, 0] = token_ids
        self.decode_pos[rows, 0] = pos
        self._set_ones(rows, pos + 1)

    def _set_ones(self, rows: np.ndarray, ones: np.ndarray) -> None:
        """Make row r of the mask hold ``ones[i]`` leading ones (touching only the changed span)."""
        for r, new in zip(rows.tolist(), ones.tolist()):
            self._set_row_ones(r, new)

    def _set_row_ones(self, row: int, ones: int) -> None:
        old = int(self.mask_ones[row])
        if ones > old:
            self.mask[row, old:ones] = 1
        elif ones < old:
            self.mask[row, ones:old] = 0
        self.mask_ones[row] = ones

    def _chunk_inputs(self, token_ids: Sequence[int], start: int) -> tuple[np.ndarray, np.ndarray]:
        """``[1, S]`` token ids and positions of a chunk at ``start`` (views of the prefill buffers)."""
        num = len(token_ids)
        ids = self.prefill_ids[:num].reshape(1, num)
        pos = self.prefill_pos[:num].reshape(1, num)
        ids[0] = token_ids
        pos[0] = np.arange(start, start + num)
        return ids, pos


class Runner(RunnerBase):
    """Row views: a decode step runs the slot range ``[lo, hi)`` as a batch of ``hi - lo``; a prefill chunk or a
    draft check runs its slot alone, shape ``[1, S]``, straight into the slot's row.

    The rows are numpy views of host KV, or device addresses (``kv.addressing == "pointer"``: the buffer's
    address plus ``row * row_bytes``, bound through IOBinding): the same code on the CPU EP, CUDA and HIP. KV
    copies between slots are numpy slices on the host and device row copies (``KVCache.row_copy``) on a device.
    With host-accessible memory (``input_allocator``) the decode inputs and logits live there: the CPU writes the
    inputs in place and reads the logits where the run wrote them, with no extra copy.

    Args: see ``RunnerBase``; ``fixed_shapes``, ``max_verify``, ``batch_prompts`` and ``prompt_shapes``: see
    ``RowChunks``.
    """

    def __init__(self, session: ort.InferenceSession, io: GraphIO, kv: KVCache, *, prefill_chunk: int,
                 max_position: int, input_allocator: InputAllocator = host_input, fixed_shapes: bool = False,
                 max_verify: int = 0, batch_prompts: bool = False, prompt_shapes: bool | None = None) -> None:
        if not kv.row_views:
            raise ValueError(f"row views need host or pointer KV; this KV cache is {kv.addressing} "
                             "(engine.bucket_runner.BucketRunner runs opaque buffers)")
        super().__init__(session, io, kv, prefill_chunk=prefill_chunk, max_position=max_position,
                         input_allocator=input_allocator)
        n, vocab = self.num_slots, self.vocab_size
        self.buckets = (n,)
        # NOTE(engine): the logits beside the inputs: host-accessible (pinned) memory on a device copies 4x
        # faster than pageable memory (float32 logits at batch 64: docs/perf/GPU.md)
        self.decode_logits, _ = input_allocator((n, 1, vocab), np.float32)
        self.logits_source = getattr(input_allocator, "source", HOST_SOURCE)
        self.chunks = RowChunks(self, session, io, fixed_shapes=fixed_shapes, max_verify=max_verify,
                                batch_prompts=batch_prompts, prompt_shapes=prompt_shapes)
        self._decode_bindings: dict[tuple[int, int], ort.IOBinding] = {}
        # NOTE(engine): with plain CPU inputs over host KV a decode step's mask is only as wide as its longest
        # row: GQA takes total_sequence_length from the mask width and its per-row cost grows with it (~15% of
        # the attention time at batch 8 with a 2048-long buffer). Row sums, and so the result, are unchanged.
        # On a device the mask crosses to it whole either way (no difference measured on CUDA).
        self._narrow_mask = kv.addressable and self.input_source == HOST_SOURCE
        self._mask_scratch = np.zeros(n * self.length if self._narrow_mask else 0, dtype=np.int64)
        self._mask_cols = np.arange(self.length, dtype=np.int64)

    @property
    def can_copy(self) -> bool:
        return self.kv.addressable or self.kv.row_copy is not None

    def warmup(self) -> None:
        """Device rows: one decode run with every row idle and a 2-token chunk in slot 0 (which holds nothing
        yet), so the first request doesn't pay for the kernels' first runs; with fixed shapes every chunk
        piece's length too."""
        self.chunks.warm_shapes()
        if self.kv.addressable:
            return
        none = np.zeros(0, dtype=np.int64)
        self._write_decode_inputs(none, [], none, 0, self.num_slots)
        self._run(self._decode_bindings.get((0, self.num_slots)) or self._make_decode_binding(0, self.num_slots))
        self.chunks.run(0, [0, 0], 0, all_logits=False)
        self.slot_len[0] = 0

    @property
    def can_verify(self) -> bool:
        return True

    @property
    def keep_last(self) -> bool:
        """The graph computes the logits of a chunk's last position only (``logits_to_keep``)."""
        return self.chunks.keep_last

    def decode(self, slots: Sequence[int], token_ids: Sequence[int], positions: Sequence[int],
               logits: bool = True) -> np.ndarray:
        """One token for each of ``slots`` (ascending).

        Args:
            slots: KV rows, ascending.
            token_ids: the token fed to each row.
            positions: each token's position (= the row's KV length before this step).
            logits: ignored (host logits cost nothing to keep; see ``ModelRunner.decode``).
        Returns:
            float32 ``[len(slots), vocab]`` logits, row i for ``slots[i]``; valid until the next decode.
        """
        if len(slots) == 1 and self._narrow_mask:
            return self._decode_one(slots[0], token_ids[0], positions[0])
        rows = np.asarray(slots, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        self._write_decode_inputs(rows, token_ids, pos, lo, hi)
        binding = self._decode_bindings.get((lo, hi)) or self._make_decode_binding(lo, hi)
        if self._narrow_mask:
            self._bind_narrow_mask(binding, lo, hi)
        else:
            self.mask_bytes = (hi - lo) * self.length * 8
        self._run(binding)
        self.slot_len[rows] = pos + 1
        if hi - lo > len(rows):
            return self.decode_logits[rows - lo, 0]  # [n, V] (a gather copy)
        return self.decode_logits[:hi - lo, 0]  # [n, V] view

    def _decode_one(self, slot: int, token_id: int, position: int) -> np.ndarray:
        """``decode`` of one row with plain CPU inputs, in scalar steps.

        NOTE(engine): the common single-stream step. A decode step streams every weight through the caches,
        so the Python around it runs cold, and numpy's fancy indexing and a freshly computed mask cost
        0.5-0.6 ms of a 25-30 ms Gemma 3 270M step on 2 AVX2 cores; scalar writes and a view of the row's
        mask (its ones are a prefix of the row: the narrow mask itself, contiguous) cost a third of that.
        """
        ones = position + 1
        self.decode_ids[slot, 0] = token_id
        self.decode_pos[slot, 0] = position
        self._set_row_ones(slot, ones)
        binding = self._decode_bindings.get((slot, slot + 1)) or self._make_decode_binding(slot, slot + 1)
        binding.bind_cpu_input(self.io.attention_mask, self.mask[slot:slot + 1, :ones])
        self.mask_bytes = ones * 8
        self._run(binding)
        self.slot_len[slot] = ones
        return self.decode_logits[:1, 0]

    def prefill(self, slot: int, token_ids: Sequence[int], start: int, also: Sequence[int] = ()) -> np.ndarray:
        """Prompt tokens ``[start, start + S)`` of the request in ``slot``, run in the slot's own row.

        Args:
            also: slots that must end up with the same KV (the other choices of an n > 1 request; their rows
                already hold positions ``[0, start)``): this chunk's positions are copied into them after the run.
        Returns:
            float32 ``[vocab]`` logits of the chunk's last token (a view, valid until the next prefill).
        """
        self._check_chunk(len(token_ids))
        logits = self.chunks.run(slot, token_ids, start, all_logits=False)[-1]
        for other in also:
            self.copy_kv(slot, other, start, start + len(token_ids))
        return logits

    def verify(self, slot: int, token_ids: Sequence[int], start: int) -> np.ndarray:
        """Tokens ``[start, start + S)`` of the request in ``slot`` with the logits of every one (speculative
        decoding: the last sampled token and a draft, checked in one run).

        The KV of all S tokens is written; the caller keeps only the accepted prefix (positions past it are
        garbage the request overwrites before it attends to them).

        Returns:
            float32 ``[S, vocab]`` logits, row i predicting the token after ``token_ids[i]`` (a view, valid until
            the next verify or prefill).
        """
        self._check_chunk(len(token_ids), "verify run")
        return self.chunks.run(slot, token_ids, start, all_logits=True)

    def copy_kv(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy KV positions ``[start, end)`` of slot ``src`` into slot ``dst`` (see ``KVCache.copy_positions``)."""
        self.kv.copy_positions(src, dst, start, end)
        self.slot_len[dst] = max(int(self.slot_len[dst]), end)

    def _bind_narrow_mask(self, binding: ort.IOBinding, lo: int, hi: int) -> None:
        """Bind rows ``[lo, hi)`` of the mask cut to the longest row's ones: ``[hi - lo, max ones]``."""
        ones = self.mask_ones[lo:hi]  # [w]
        width = int(ones.max())
        mask = self._mask_scratch[:(hi - lo) * width].reshape(hi - lo, width)  # [w, W]
        np.less(self._mask_cols[:width], ones[:, None], out=mask)  # row r: ones[r] leading ones
        binding.bind_ortvalue_input(self.io.attention_mask, ort.OrtValue.ortvalue_from_numpy(mask))
        self.mask_bytes = mask.nbytes

    def _make_decode_binding(self, lo: int, hi: int) -> ort.IOBinding:
        binding = self.session.io_binding()
        whole = lo == 0 and hi == self.num_slots
        ids = self._ids_value if whole else _value(self.decode_ids[lo:hi])
        pos = self._pos_value if whole else _value(self.decode_pos[lo:hi])
        mask = self._mask_value if whole else _value(self.mask[lo:hi])
        self._bind_host(binding, self.io.input_ids, ids)
        if self.io.position_ids:
            self._bind_host(binding, self.io.position_ids, pos)
        if not self._narrow_mask:  # (a narrow mask is bound per run)
            self._bind_host(binding, self.io.attention_mask, mask)
        binding.bind_ortvalue_output(self.io.logits, _value(self.decode_logits[:hi - lo]))
        self.kv.bind_rows(binding, self._past, self._present, lo, hi)
        self._decode_bindings[(lo, hi)] = binding
        return binding
