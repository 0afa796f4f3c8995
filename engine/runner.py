"""Runs the decoder with IOBinding over the shared KV cache: prefill chunks and batched decode -> logits.

Owns the preallocated input/logits buffers and the per-slot KV lengths; only the core thread calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from engine.device_kv import RowCopier, batch_buckets, bucket_for
from engine.graph_capture import DeviceAllocator, DeviceDecodeIO
from engine.kv_cache import KVCache
from engine.model_loader import GraphIO

log = logging.getLogger(__name__)

# NOTE(engine): ortserve-built graphs have this optional int64 [1] input (an overridable initializer,
# default 0 = every position): 1 makes a prefill chunk compute only its last position's logits. Folders from
# other builders lack it and get all positions, of which the last is used.
LOGITS_TO_KEEP = "logits_to_keep"

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
    # (a plugin EP's, or a CPU allocator registered for it), or hip-python on AMD; ep/ decides, else fallback.
    if selected is None or (selected.host_accessible_memory is None and selected.provider == "cpu"):
        return host_input
    from ep import host_memory

    def allocate(shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, ort.OrtValue]:
        buf = host_memory.alloc_host_accessible(shape, dtype, selected)
        allocate.source = "cpu" if buf is None else buf.source  # type: ignore[attr-defined]
        if buf is None:
            return host_input(shape, dtype)
        return buf.array, buf.ortvalue

    return allocate


class Runner:
    """Binds inputs and KV rows, runs ``session``, returns float32 logits views.

    Two binding modes:
      * row views (KV rows can be bound as views): a decode step runs the slot range ``[lo, hi)`` as a
        batch of ``hi - lo``; a prefill chunk runs its slot alone, shape ``[1, S]``;
      * whole buffer (opaque device KV): a decode run covers the rows ``[0, b)`` of the smallest batch bucket
        ``b`` that holds the running slots (``engine.device_kv``: the KV buffers bound as their prefix; with
        graph capture one captured step per bucket); without prefix views, all slots. With ``staging`` and
        ``copier`` a prompt goes in chunks of many tokens through a batch-1 staging row whose KV is then
        copied into the slot (see ``_prefill_staged``); without them, one token per run (``_prefill_whole``).

    NOTE(engine): GQA derives each row's length from its mask (seqlens_k = ones - 1) and writes the new
    token's KV at ``ones - 1``. A row with no work ("idle") gets ``ones = slot_len + 1``: its dummy KV
    lands at the row's first unused position, which the owner overwrites before it ever attends to it
    (a live request's KV never passes max_model_len - 1), and its attention span stays short. So the
    KV length is max_model_len, no reserved tail.

    Args:
        session: the decoder session.
        io: graph input/output names.
        kv: the KV cache (its ``shape.num_slots`` rows).
        prefill_chunk: the most tokens of one prefill run.
        max_position: positions fed to idle rows are clipped below this (the rotary cache length).
        whole_buffer: run all rows every step (forced when the KV cache is not CPU-addressable).
        input_allocator: where input_ids/position_ids/attention_mask live (host-accessible on devices).
        device_alloc: whole buffer only: give the decode inputs and the logits fixed device buffers (what a
            captured graph needs); the numpy buffers then stage the inputs, uploaded before each run.
        packed_input: with ``device_alloc``: the graph takes its decode inputs packed into this one int32
            ``[num_slots, 2]`` input (token id, seqlens_k) (see ``engine.graph_capture.capture_graph_bytes``).
        kv_view_device: whole buffer on opaque device KV: (device type, device id) to bind a KV buffer's
            prefix by its address (decode at the size of the work); None -> every decode run covers all
            slots. Host KV needs none (its prefixes are numpy views).
        staging: whole buffer: a one-slot KV cache for chunked prefill (``_prefill_staged``), with
            ``prefill_session`` (a session of the plain graph on the same device; default ``session``),
            ``prefill_io`` (its names; default ``io``) and ``copier`` (device row copies).
        graph_ids: with ``device_alloc`` and several buckets: run each bucket's captured step under its own
            ``gpu_graph_id`` (the bucket size).
    """

    def __init__(self, session: ort.InferenceSession, io: GraphIO, kv: KVCache, *, prefill_chunk: int,
                 max_position: int, whole_buffer: bool = False,
                 input_allocator: InputAllocator = host_input,
                 device_alloc: DeviceAllocator | None = None, packed_input: str | None = None,
                 kv_view_device: tuple[str, int] | None = None, staging: KVCache | None = None,
                 prefill_session: ort.InferenceSession | None = None, prefill_io: GraphIO | None = None,
                 copier: RowCopier | None = None, graph_ids: bool = False) -> None:
        self.session = session
        self.io = io
        self.kv = kv
        self.num_slots = kv.shape.num_slots
        self.length = kv.shape.length
        self.vocab_size = io.vocab_size
        self.prefill_chunk = prefill_chunk
        self.max_position = max_position
        self.whole_buffer = whole_buffer or not kv.addressable
        n, chunk, vocab = self.num_slots, prefill_chunk, self.vocab_size
        self.kv_view_device = None if kv.addressable else kv_view_device
        # NOTE(engine): decode widths; one (all slots) when a prefix of the KV can't be bound
        self.buckets = batch_buckets(n) if self.whole_buffer and (kv.addressable or self.kv_view_device) else (n,)
        self.copier = copier
        self.staging = staging if copier is not None else None
        # every layer's key and value buffers, in the order the row copier takes them
        self._kv_buffers = [*kv.keys, *kv.values]
        self._stage_buffers = [*self.staging.keys, *self.staging.values] if self.staging is not None else []
        self.prefill_session = prefill_session or session
        self.prefill_io = prefill_io or io
        self._staged: tuple[int, int] | None = None  # (slot, length) whose KV the staging row holds
        self._stage_binding: ort.IOBinding | None = None
        self._ones = np.ones(self.length, dtype=np.int64)
        self.stage_keep_last = LOGITS_TO_KEEP in {i.name for i in self.prefill_session.get_overridable_initializers()}
        # NOTE(engine): every buffer is allocated here once; steps write them in place.
        # The three decode inputs: whole-buffer bindings use their own OrtValues (host-accessible memory
        # on devices: zero copy); row views wrap numpy views of the same memory.
        self.mask, self._mask_value = input_allocator((n, self.length), np.int64)  # ones: a prefix per row
        self.decode_ids, self._ids_value = input_allocator((n, 1), np.int64)
        self.decode_pos, self._pos_value = input_allocator((n, 1), np.int64)
        self.mask_ones = np.zeros(n, dtype=np.int64)  # ones per row now
        self.slot_len = np.zeros(n, dtype=np.int64)  # valid KV positions per slot
        self.decode_logits = np.zeros((n, 1, vocab), dtype=np.float32)
        self.prefill_ids = np.zeros(chunk, dtype=np.int64)
        self.prefill_pos = np.zeros(chunk, dtype=np.int64)
        self.keep_last = LOGITS_TO_KEEP in {i.name for i in session.get_overridable_initializers()}
        self.prefill_logits = np.zeros((1 if self.keep_last else chunk) * vocab, dtype=np.float32)
        self._keep_one = ort.OrtValue.ortvalue_from_numpy(np.ones(1, dtype=np.int64))
        self._keep_n = np.ones(1, dtype=np.int64)  # logits_to_keep of a verify run, written before each
        self._keep_n_value = ort.OrtValue.ortvalue_from_numpy(self._keep_n)
        self._verify_logits = np.zeros(0, dtype=np.float32)  # [S * V], grown on demand
        self._decode_bindings: dict[tuple[int, int], ort.IOBinding] = {}
        self._prefill_bindings: dict[int, ort.IOBinding] = {}
        self._verify_bindings: dict[int, ort.IOBinding] = {}
        self.input_source = getattr(input_allocator, "source", "cpu")  # where the decode inputs live
        self.device_io: DeviceDecodeIO | None = None  # the full width's; one per bucket in _device_ios
        self._device_ios: dict[int, DeviceDecodeIO] = {}
        self._packed: np.ndarray | None = None
        self._run_options: dict[int, ort.RunOptions] = {}
        if device_alloc is not None:
            if not self.whole_buffer:
                raise ValueError("device decode buffers need whole-buffer mode")
            if packed_input:
                self._packed = np.zeros((n, 2), dtype=np.int32)  # (token id, seqlens_k = ones - 1) per row
            for b in self.buckets:
                # NOTE(engine): a prefix of a C-contiguous array is contiguous: each bucket stages rows [0, b)
                stage = {io.input_ids: self.decode_ids[:b], io.attention_mask: self.mask[:b]}
                if io.position_ids:
                    stage[io.position_ids] = self.decode_pos[:b]
                if self._packed is not None:
                    stage = {packed_input: self._packed[:b]}
                self._device_ios[b] = DeviceDecodeIO(session, stage, io.logits, (b, 1, vocab), device_alloc)
                if graph_ids and len(self.buckets) > 1:
                    self._run_options[b] = ort.RunOptions()
                    self._run_options[b].add_run_config_entry("gpu_graph_id", str(b))
            self.device_io = self._device_ios[n]
            self.input_source = "cpu->device"
        # NOTE(engine): with plain CPU inputs a decode step's mask is only as wide as its longest row: GQA
        # takes total_sequence_length from the mask width and its per-row cost grows with it (~15% of the
        # attention time at batch 8 with a 2048-long buffer). Row sums, and so the result, are unchanged.
        self._narrow_mask = not self.whole_buffer and self.device_io is None and self.input_source == "cpu"
        self._mask_scratch = np.zeros(n * self.length if self._narrow_mask else 0, dtype=np.int64)
        self._mask_cols = np.arange(self.length, dtype=np.int64)

    # -- public ----------------------------------------------------------------------------------------

    def decode(self, slots: Sequence[int], token_ids: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """One token for each of ``slots`` (ascending).

        Args:
            slots: KV rows, ascending.
            token_ids: the token fed to each row.
            positions: each token's position (= the row's KV length before this step).
        Returns:
            float32 ``[len(slots), vocab]`` logits, row i for ``slots[i]``; valid until the next decode.
        """
        if len(slots) == 1 and self._narrow_mask:
            return self._decode_one(slots[0], token_ids[0], positions[0])
        rows = np.asarray(slots, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        if self.whole_buffer:
            lo, hi = 0, bucket_for(self.buckets, int(rows[-1]) + 1)
        else:
            lo, hi = int(rows[0]), int(rows[-1]) + 1
        width = hi - lo
        if width > len(rows):  # idle rows in the range: a dummy token at their first unused position
            idle = np.setdiff1d(np.arange(lo, hi), rows, assume_unique=True)
            self.decode_ids[idle, 0] = 0
            self.decode_pos[idle, 0] = np.minimum(self.slot_len[idle], self.max_position - 1)
            self._set_ones(idle, self.slot_len[idle] + 1)
        self.decode_ids[rows, 0] = token_ids
        self.decode_pos[rows, 0] = pos
        self._set_ones(rows, pos + 1)
        binding = self._decode_bindings.get((lo, hi)) or self._make_decode_binding(lo, hi)
        if self._narrow_mask:
            self._bind_narrow_mask(binding, lo, hi)
        logits = self._run_decode(binding, width)  # [width, 1, V]
        self.slot_len[rows] = pos + 1
        if width > len(rows):
            return logits[rows - lo, 0]  # [n, V] (a gather copy)
        return logits[:width, 0]  # [n, V] view

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
        logits = self._run_decode(binding, 1)
        self.slot_len[slot] = ones
        return logits[:1, 0]

    @property
    def can_copy(self) -> bool:
        """KV can be copied between slots (host rows, or the device row copier)."""
        return self.kv.addressable or self.copier is not None

    def warmup(self) -> None:
        """Whole buffer: one run per bucket with every row idle, and one staged prefill run: compiles the
        kernels and, with graph capture, captures each bucket's decode step, so the first request doesn't
        pay for it. Row KV stays garbage (no slot is live)."""
        if not self.whole_buffer:
            return
        for b in self.buckets:
            rows = np.arange(b)
            self.decode_ids[:b, 0] = 0
            self.decode_pos[:b, 0] = np.minimum(self.slot_len[:b], self.max_position - 1)
            self._set_ones(rows, self.slot_len[:b] + 1)
            binding = self._decode_bindings.get((0, b)) or self._make_decode_binding(0, b)
            self._run_decode(binding, b)
        if self.staging is not None:
            self._run_staged([0, 0], 0)
            self._staged = None

    def prefill(self, slot: int, token_ids: Sequence[int], start: int, also: Sequence[int] = ()) -> np.ndarray:
        """Prompt tokens ``[start, start + S)`` of the request in ``slot``.

        Args:
            also: slots that must end up with the same KV (the other choices of an n > 1 request; their rows
                already hold positions ``[0, start)``): row views copy this chunk's positions into them after
                the run; the whole-buffer mode computes them in the same runs (it can't copy opaque rows).
        Returns:
            float32 ``[vocab]`` logits of the chunk's last token (a view, valid until the next prefill).
        """
        num = len(token_ids)
        if not 0 < num <= self.prefill_chunk:
            raise ValueError(f"a prefill chunk holds 1..{self.prefill_chunk} tokens, got {num}")
        if self.whole_buffer:
            if self.staging is not None:
                return self._prefill_staged(slot, token_ids, start, also)
            return self._prefill_whole(slot, token_ids, start, also)
        logits = self._run_chunk(slot, token_ids, start, all_logits=False)[-1]
        for other in also:
            self.copy_kv(slot, other, start, start + num)
        return logits

    def verify(self, slot: int, token_ids: Sequence[int], start: int) -> np.ndarray:
        """Tokens ``[start, start + S)`` of the request in ``slot`` with the logits of every one (speculative
        decoding: the last sampled token and a draft, checked in one run; row views only).

        The KV of all S tokens is written; the caller keeps only the accepted prefix (positions past it are
        garbage the request overwrites before it attends to them).

        Returns:
            float32 ``[S, vocab]`` logits, row i predicting the token after ``token_ids[i]`` (a view, valid until
            the next verify or prefill).
        """
        num = len(token_ids)
        if self.whole_buffer:
            raise ValueError("verify needs row views: GroupQueryAttention runs S > 1 tokens only at batch 1")
        if not 0 < num <= self.prefill_chunk:
            raise ValueError(f"a verify run holds 1..{self.prefill_chunk} tokens, got {num}")
        return self._run_chunk(slot, token_ids, start, all_logits=True)

    def copy_kv(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy KV positions ``[start, end)`` of slot ``src`` into slot ``dst`` (host rows; on an opaque device
        the whole row, whose positions ``[0, start)`` are then the same as dst's: a shared prefix)."""
        if self.kv.addressable:
            self.kv.copy_positions(src, dst, start, end)
        elif self.copier is not None:
            self.copier.copy(self._kv_buffers, src, self._kv_buffers, dst)
        else:
            raise ValueError("the KV cache is opaque and has no device row copier")
        if self._staged is not None and self._staged[0] == dst:
            self._staged = None
        self.slot_len[dst] = max(int(self.slot_len[dst]), end)

    def release(self, slot: int, keep: int = 0) -> None:
        """The slot's request left; its first ``keep`` KV positions stay valid (a prefix kept for reuse).

        NOTE(engine): an idle row's dummy token is written at ``slot_len`` (see the class note), so a kept
        prefix survives the steps that run this row idle.
        """
        self.slot_len[slot] = keep
        if self._staged is not None and self._staged[0] == slot:
            self._staged = None

    # -- internals -------------------------------------------------------------------------------------

    def _prefill_staged(self, slot: int, token_ids: Sequence[int], start: int, also: Sequence[int]) -> np.ndarray:
        """One chunk in the staging row (batch 1, S tokens: one run), then a device copy of that row into
        ``slot`` (and the slots in ``also``).

        NOTE(engine): the staging row keeps the KV of the last chunk it ran; a request's next chunk finds it
        there, so only a chunk after another request's (or after a prefix copied into the slot) first copies
        the slot's row in. The copy out after every chunk keeps the slot's row whole at all times: decode
        runs may bind it as an idle row, and their dummy token lands at its length, where the next chunk
        writes anyway.
        """
        assert self.staging is not None and self.copier is not None
        stage = self._stage_buffers
        if start > 0 and self._staged != (slot, start):
            self.copier.copy(self._kv_buffers, slot, stage, 0)
        logits = self._run_staged(token_ids, start)
        for dst in (slot, *also):
            self.copier.copy(stage, 0, self._kv_buffers, dst)
            self.slot_len[dst] = start + len(token_ids)
        self._staged = (slot, start + len(token_ids))
        return logits

    def _run_staged(self, token_ids: Sequence[int], start: int) -> np.ndarray:
        """Run ``token_ids`` at positions ``[start, start + S)`` over the staging row; the last one's logits."""
        assert self.staging is not None
        io, num = self.prefill_io, len(token_ids)
        binding = self._stage_binding
        if binding is None:
            binding = self._stage_binding = self.prefill_session.io_binding()
            for i, (k, v) in enumerate(zip(self.staging.keys, self.staging.values)):
                binding.bind_ortvalue_input(io.past_keys[i], k)
                binding.bind_ortvalue_input(io.past_values[i], v)
                binding.bind_ortvalue_output(io.present_keys[i], k)
                binding.bind_ortvalue_output(io.present_values[i], v)
            if self.stage_keep_last:
                binding.bind_ortvalue_input(LOGITS_TO_KEEP, self._keep_one)
                binding.bind_ortvalue_output(io.logits, _value(self.prefill_logits[:self.vocab_size].reshape(1, 1, self.vocab_size)))
        ids = self.prefill_ids[:num].reshape(1, num)
        pos = self.prefill_pos[:num].reshape(1, num)
        ids[0] = token_ids
        pos[0] = np.arange(start, start + num)
        binding.bind_ortvalue_input(io.input_ids, _value(ids))
        if io.position_ids:
            binding.bind_ortvalue_input(io.position_ids, _value(pos))
        # the plain graph takes the total length from the mask's width: all ones, prompt so far + chunk
        binding.bind_ortvalue_input(io.attention_mask, _value(self._ones[:start + num].reshape(1, start + num)))
        if self.stage_keep_last:
            logits = self.prefill_logits[:self.vocab_size].reshape(1, 1, self.vocab_size)
        else:
            logits = self.prefill_logits[:num * self.vocab_size].reshape(1, num, self.vocab_size)
            binding.bind_ortvalue_output(io.logits, _value(logits))
        self.prefill_session.run_with_iobinding(binding)
        return logits[0, -1]

    def _prefill_whole(self, slot: int, token_ids: Sequence[int], start: int, also: Sequence[int]) -> np.ndarray:
        # NOTE(engine): GQA refuses S > 1 with past context at batch > 1 ("batch_size must be 1 when
        # sequence_length > 1 and past context is given"), and an opaque buffer can't be bound one row at a
        # time, so whole-buffer mode feeds the prompt one token per run beside idle rows. Slow; correct.
        # Slots in ``also`` get the same token in the same run (their rows compute alike).
        slots = sorted({slot, *also})
        row = slots.index(slot)
        logits = None
        for i, token_id in enumerate(token_ids):
            logits = self.decode(slots, [token_id] * len(slots), [start + i] * len(slots))
        assert logits is not None
        return logits[row]

    def _run_chunk(self, slot: int, token_ids: Sequence[int], start: int, all_logits: bool) -> np.ndarray:
        """One row-view run of ``S = len(token_ids)`` tokens in ``slot``; returns float32 ``[1 or S, V]`` logits
        (only the last position's unless ``all_logits``; all of them when the graph lacks logits_to_keep)."""
        num = len(token_ids)
        ids = self.prefill_ids[:num].reshape(1, num)  # [1, S]
        pos = self.prefill_pos[:num].reshape(1, num)
        ids[0] = token_ids
        pos[0] = np.arange(start, start + num)
        self._set_ones(np.array([slot]), np.array([start + num]))
        if self.keep_last and all_logits:
            binding = self._verify_bindings.get(slot) or self._make_chunk_binding(slot, verify=True)
            self._keep_n[0] = num
            if len(self._verify_logits) < num * self.vocab_size:
                self._verify_logits = np.zeros(num * self.vocab_size, dtype=np.float32)
            logits = self._verify_logits[:num * self.vocab_size].reshape(1, num, self.vocab_size)  # [1, S, V]
            binding.bind_ortvalue_output(self.io.logits, ort.OrtValue.ortvalue_from_numpy(logits))
        else:
            binding = self._prefill_bindings.get(slot) or self._make_chunk_binding(slot)
            if self.keep_last:  # [1, 1, V], bound once in _make_chunk_binding
                logits = self.prefill_logits[:self.vocab_size].reshape(1, 1, self.vocab_size)
            else:
                logits = self.prefill_logits[:num * self.vocab_size].reshape(1, num, self.vocab_size)  # [1, S, V]
                binding.bind_ortvalue_output(self.io.logits, ort.OrtValue.ortvalue_from_numpy(logits))
        binding.bind_ortvalue_input(self.io.input_ids, ort.OrtValue.ortvalue_from_numpy(ids))
        if self.io.position_ids:
            binding.bind_ortvalue_input(self.io.position_ids, ort.OrtValue.ortvalue_from_numpy(pos))
        self.session.run_with_iobinding(binding)
        self.slot_len[slot] = start + num
        return logits[0]

    def _run_decode(self, binding: ort.IOBinding, width: int) -> np.ndarray:
        """Run a decode binding of rows ``[0, width)`` (whole buffer) or a row range of that width; returns
        its float32 ``[width, 1, V]`` logits."""
        if self.device_io is None:
            self.session.run_with_iobinding(binding)
            return self.decode_logits
        device_io = self._device_ios[width]
        if self._packed is not None:
            self._packed[:width, 0] = self.decode_ids[:width, 0]
            self._packed[:width, 1] = self.mask_ones[:width] - 1
        device_io.upload()
        run_options = self._run_options.get(width)
        if run_options is None:
            self.session.run_with_iobinding(binding)
        else:
            # NOTE(engine): onnxruntime's Python wrapper refuses address-bound buffers (a KV prefix) under
            # capture ("requires fixed WebGPU device OrtValues"); the session itself replays them correctly
            # (bench/perf/gpu/probe_buckets.py), so the bucket's step runs through the binding it was captured with.
            self.session._sess.run_with_iobinding(binding._iobinding, run_options)
        return device_io.read_logits()

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

    def _bind_narrow_mask(self, binding: ort.IOBinding, lo: int, hi: int) -> None:
        """Bind rows ``[lo, hi)`` of the mask cut to the longest row's ones: ``[hi - lo, max ones]``."""
        ones = self.mask_ones[lo:hi]  # [w]
        width = int(ones.max())
        mask = self._mask_scratch[:(hi - lo) * width].reshape(hi - lo, width)  # [w, W]
        np.less(self._mask_cols[:width], ones[:, None], out=mask)  # row r: ones[r] leading ones
        binding.bind_ortvalue_input(self.io.attention_mask, ort.OrtValue.ortvalue_from_numpy(mask))

    def _bind_kv(self, binding: ort.IOBinding, lo: int, hi: int) -> None:
        if self.kv_view_device is not None and lo == 0 and hi < self.num_slots:
            self._bind_kv_prefix(binding, hi)
            return
        keys, values = self.kv.rows(lo, hi)
        for i, (k, v) in enumerate(zip(keys, values)):
            # NOTE(engine): past and present are the same OrtValue: GQA updates the buffer in place.
            binding.bind_ortvalue_input(self.io.past_keys[i], k)
            binding.bind_ortvalue_input(self.io.past_values[i], v)
            binding.bind_ortvalue_output(self.io.present_keys[i], k)
            binding.bind_ortvalue_output(self.io.present_values[i], v)

    def _bind_kv_prefix(self, binding: ort.IOBinding, rows: int) -> None:
        """Bind rows ``[0, rows)`` of each opaque device KV buffer by its address (past and present alike)."""
        assert self.kv_view_device is not None
        device_type, device_id = self.kv_view_device
        s = self.kv.shape
        shape = [rows, s.num_kv_heads, s.length, s.head_size]
        for i, (k, v) in enumerate(zip(self.kv.keys, self.kv.values)):
            for past, present, value in ((self.io.past_keys[i], self.io.present_keys[i], k),
                                         (self.io.past_values[i], self.io.present_values[i], v)):
                binding.bind_input(past, device_type, device_id, s.dtype, shape, value.data_ptr())
                binding.bind_output(present, device_type, device_id, s.dtype, shape, value.data_ptr())

    def _make_decode_binding(self, lo: int, hi: int) -> ort.IOBinding:
        binding = self.session.io_binding()
        whole = lo == 0 and hi == self.num_slots
        if self.device_io is not None:
            self._device_ios[hi].bind(binding)
            self._bind_kv(binding, lo, hi)
            self._decode_bindings[(lo, hi)] = binding
            return binding
        ids = self._ids_value if whole else _value(self.decode_ids[lo:hi])
        pos = self._pos_value if whole else _value(self.decode_pos[lo:hi])
        mask = self._mask_value if whole else _value(self.mask[lo:hi])
        binding.bind_ortvalue_input(self.io.input_ids, ids)
        if self.io.position_ids:
            binding.bind_ortvalue_input(self.io.position_ids, pos)
        binding.bind_ortvalue_input(self.io.attention_mask, mask)
        binding.bind_ortvalue_output(self.io.logits, _value(self.decode_logits[:hi - lo]))
        self._bind_kv(binding, lo, hi)
        self._decode_bindings[(lo, hi)] = binding
        return binding

    def _make_chunk_binding(self, slot: int, verify: bool = False) -> ort.IOBinding:
        """A prefill binding of ``slot`` (logits of the last position), or with ``verify`` one whose
        logits_to_keep is ``_keep_n`` (its logits output is bound per run)."""
        binding = self.session.io_binding()
        binding.bind_ortvalue_input(self.io.attention_mask, _value(self.mask[slot:slot + 1]))
        if self.keep_last:
            binding.bind_ortvalue_input(LOGITS_TO_KEEP, self._keep_n_value if verify else self._keep_one)
            if not verify:
                binding.bind_ortvalue_output(self.io.logits,
                                             _value(self.prefill_logits[:self.vocab_size].reshape(1, 1, self.vocab_size)))
        self._bind_kv(binding, slot, slot + 1)
        (self._verify_bindings if verify else self._prefill_bindings)[slot] = binding
        return binding


def _value(array: np.ndarray) -> Any:
    """Zero-copy OrtValue over a contiguous numpy array (keeps the array alive)."""
    assert array.flags.c_contiguous
    return ort.OrtValue.ortvalue_from_numpy(array)
