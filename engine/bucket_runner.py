"""The runner of decode steps over a prefix of the KV rows, per batch bucket: opaque device KV (WebGPU, DirectML),
and pointer KV whose decode steps are captured device graphs (CUDA graphs; HIP graphs under MIGraphX), which
replay fixed addresses. ``engine.runner`` has the interface and the row-view runner; ``engine.placement`` picks.

An opaque buffer is a handle, not an address, so no single row of it can be bound; only the buffer itself, or
where the device allows it its prefix of rows ``[0, b)`` (the handle with a smaller first dimension). So:
  * a decode run covers rows ``[0, b)`` of the smallest batch bucket ``b`` (1, 2, 4, ... max_batch) that holds
    the running slots (the scheduler gives requests the lowest free slots), one captured graph per bucket where
    the engine drives graph capture; without prefix views, all slots;
  * a prompt goes in chunks of many tokens through a batch-1 staging KV (GroupQueryAttention takes S > 1 new
    tokens with a past at batch 1 only) whose row a device copy (``engine.device_kv.RowCopier``) then puts
    into the slot; without a copier, one token per run beside the idle rows.
Pointer KV with captured decode steps (``row_chunks``) decodes the same way (every bucket's step bound once, at
fixed addresses: its KV prefix, its input and logits buffers), while prompt chunks and draft checks run straight
in their rows by address, uncaptured (``gpu_graph_id=-1``), and copies between slots are device row copies.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from engine.device_kv import RowCopier, batch_buckets, bucket_for
from engine.graph_capture import DeviceAllocator, DeviceDecodeIO
from engine.kv_cache import KVCache
from engine.model_loader import GraphIO
from engine.row_chunks import LOGITS_TO_KEEP, RowChunks, _value
from engine.runner import HOST_SOURCE, InputAllocator, RunnerBase, host_input

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodePath:
    """How decode steps run (a value record; ``engine.placement`` fills it from the device profile).

    Attributes:
        buckets: the device binds a buffer's prefix of rows: decode at the size of the work, in buckets
            (1, 2, 4, ... num_slots); False -> every decode run covers all slots.
        device_alloc: give the decode inputs and the logits fixed device buffers (what a captured graph needs);
            the numpy buffers then stage the inputs, uploaded before each run.
        packed_input: with ``device_alloc``: the graph takes its decode inputs packed into this one int32
            ``[num_slots, 2]`` input (token id, seqlens_k) (see ``engine.graph_capture.capture_graph_bytes``).
        graph_ids: with ``device_alloc`` and several buckets: run each bucket's captured step under its own
            ``gpu_graph_id`` (the bucket size).
        row_summary: with ``device_alloc``: the decode graph also outputs each row's argmax and log-normalizer
            (``engine.graph_capture.add_row_summary``); ``decode`` then leaves them in ``decode_summary``.
        bucket_sessions: bucket width -> the session its decode steps run on (another session of the same decode
            graph on the same device, e.g. the CUDA one-row step's without the fused INT4 kernels); the others run
            on the decoder's session.
    """

    buckets: bool = True
    device_alloc: DeviceAllocator | None = None
    packed_input: str | None = None
    graph_ids: bool = False
    row_summary: bool = False
    bucket_sessions: Mapping[int, ort.InferenceSession] | None = None


@dataclass(frozen=True)
class RowPrompts:
    """Prompt chunks and draft checks straight in the slot's own row (row-view KV: pointer), on ``session`` (the
    plain graph; None: the decoder's), uncaptured (``gpu_graph_id=-1`` where decode steps are captured).
    ``fixed_shapes``, ``max_verify``, ``batch_prompts``, ``prompt_shapes``: see ``engine.row_chunks.RowChunks``."""

    session: ort.InferenceSession | None = None
    io: GraphIO | None = None
    fixed_shapes: bool = False
    max_verify: int = 0
    batch_prompts: bool = False
    prompt_shapes: bool | None = None


@dataclass(frozen=True)
class StagedPrompts:
    """Prompt chunks through a one-slot staging KV (``_prefill_staged``) on ``session`` (a session of the plain
    graph on the same device; None: the decoder's), whose row ``copier`` copies into the slot on the device."""

    staging: KVCache
    copier: RowCopier
    session: ort.InferenceSession | None = None
    io: GraphIO | None = None


# Without a prompt path (None) a prompt goes one token per run beside the idle rows (``_prefill_whole``).
PromptPath = RowPrompts | StagedPrompts | None


class BucketRunner(RunnerBase):
    """Whole-buffer runs over opaque KV (also runs host KV, binding row prefixes as views: the CPU stand-in).

    Args:
        session, io, kv, prefill_chunk, max_position, input_allocator: see ``engine.runner.RunnerBase``.
        decode: how decode steps run (``DecodePath``).
        prompts: how prompt chunks run (``RowPrompts``, ``StagedPrompts``; None: one token per run).
    """

    whole_buffer = True

    def __init__(self, session: ort.InferenceSession, io: GraphIO, kv: KVCache, *, prefill_chunk: int,
                 max_position: int, input_allocator: InputAllocator = host_input,
                 decode: DecodePath = DecodePath(), prompts: PromptPath = None) -> None:
        super().__init__(session, io, kv, prefill_chunk=prefill_chunk, max_position=max_position,
                         input_allocator=input_allocator)
        self.decode_path, self.prompt_path = decode, prompts
        device_alloc, packed_input, graph_ids = decode.device_alloc, decode.packed_input, decode.graph_ids
        row_chunks = isinstance(prompts, RowPrompts)
        staged = prompts if isinstance(prompts, StagedPrompts) else None
        prefill_session = prompts.session if prompts is not None else None
        prefill_io = prompts.io if prompts is not None else None
        n, vocab = self.num_slots, self.vocab_size
        # NOTE(engine): decode widths; one (all slots) when a prefix of the KV can't be bound
        self.buckets = batch_buckets(n) if decode.buckets else (n,)
        self.bucket_sessions = {b: other for b, other in (decode.bucket_sessions or {}).items()
                                if b in self.buckets and other is not session}
        self.copier = staged.copier if staged is not None else None
        self.staging = staged.staging if staged is not None and staged.copier is not None else None
        # NOTE(engine): a staged chunk is a run of its own at the EP's uncaptured cost (on WebGPU the same
        # for 16-256 tokens alike, docs/perf/issue22/s5); several in one step stalled running streams 50-75 ms
        # when prompts arrived together, so one request's chunk per step where prompts are staged
        self.max_prefills_per_step = 1 if self.staging is not None else 0
        # NOTE(engine): and a reused prefix saves a staged run only when it is a chunk long: a shorter one leaves a
        # run of the rest (the same cost) and adds row copies (slot <- cache, staging <- slot), whose queued
        # device work the next steps wait for (WebGPU: steps of 56-110 ms beside 1-9 copies when repeated prompts
        # arrived together, docs/perf/GPU.md "Fifth pass")
        self.min_prefix_reuse = prefill_chunk if self.staging is not None else None
        self._kv_buffers = kv.buffers
        self._stage_buffers = self.staging.buffers if self.staging is not None else []
        self.prefill_session = prefill_session or session
        self.prefill_io = prefill_io or io
        self._staged: tuple[int, int] | None = None  # (slot, length) whose KV the staging row holds
        self._stage_binding: ort.IOBinding | None = None
        self._ones = np.ones(self.length, dtype=np.int64)
        self.stage_keep_last = LOGITS_TO_KEEP in {i.name for i in self.prefill_session.get_overridable_initializers()}
        self.prefill_logits = np.zeros((1 if self.stage_keep_last else prefill_chunk) * vocab, dtype=np.float32)
        self._keep_one = ort.OrtValue.ortvalue_from_numpy(np.ones(1, dtype=np.int64))
        self.chunks: RowChunks | None = None
        if row_chunks:
            if not kv.row_views:
                raise ValueError(f"row chunks need row-view KV; this KV cache is {kv.addressing}")
            skip = None
            if graph_ids:
                skip = ort.RunOptions()
                skip.add_run_config_entry("gpu_graph_id", "-1")  # NOTE(engine): ORT's "no capture" annotation
            self.chunks = RowChunks(self, self.prefill_session, self.prefill_io, skip,
                                    fixed_shapes=prompts.fixed_shapes, max_verify=prompts.max_verify,
                                    batch_prompts=prompts.batch_prompts, prompt_shapes=prompts.prompt_shapes)
        self.decode_logits = np.zeros((n, 1, vocab), dtype=np.float32)
        self.logits_source = HOST_SOURCE
        self._decode_bindings: dict[int, ort.IOBinding] = {}
        self.device_io: DeviceDecodeIO | None = None  # the full width's; one per bucket in _device_ios
        self._device_ios: dict[int, DeviceDecodeIO] = {}
        self._packed: np.ndarray | None = None
        self._run_options: dict[int, ort.RunOptions] = {}
        if device_alloc is not None and row_chunks:
            self._host_logits, _ = input_allocator((n, 1, vocab), np.float32)
        if device_alloc is not None:
            if packed_input:
                self._packed = np.zeros((n, 2), dtype=np.int32)  # (token id, seqlens_k = ones - 1) per row
            for b in self.buckets:
                # NOTE(engine): a prefix of a C-contiguous array is contiguous: each bucket stages rows [0, b)
                stage = {io.input_ids: self.decode_ids[:b], io.attention_mask: self.mask[:b]}
                if io.position_ids:
                    stage[io.position_ids] = self.decode_pos[:b]
                if self._packed is not None:
                    stage = {packed_input: self._packed[:b]}
                host_logits = None
                if row_chunks:  # NOTE(engine): pointer memory: copy_tensors into host-accessible memory (4x pageable)
                    host_logits = self._host_logits[:b] if b < n else self._host_logits
                self._device_ios[b] = DeviceDecodeIO(self.bucket_sessions.get(b, session), stage, io.logits,
                                                     (b, 1, vocab), device_alloc, host_logits,
                                                     summary=decode.row_summary)
                if graph_ids and len(self.buckets) > 1:
                    self._run_options[b] = ort.RunOptions()
                    self._run_options[b].add_run_config_entry("gpu_graph_id", str(b))
            self.device_io = self._device_ios[n]
            source = getattr(input_allocator, "source", HOST_SOURCE)
            self.input_source = f"{source}->device"
            self.logits_source = f"device->{source if row_chunks else 'cpu'}"

    @property
    def can_copy(self) -> bool:
        return self.copier is not None or self.kv.addressable or self.kv.row_copy is not None

    @property
    def can_verify(self) -> bool:
        # NOTE(engine): a draft check is S > 1 tokens in one row; GQA runs that at batch 1 only
        return self.chunks is not None

    def decode(self, slots: Sequence[int], token_ids: Sequence[int], positions: Sequence[int],
               logits: bool = True) -> np.ndarray | None:
        """One token for each of ``slots`` (ascending), in a run over rows ``[0, b)`` (see ``Runner.decode``);
        None with ``logits=False`` where the step has a row summary (its logits stay on the device)."""
        rows = np.asarray(slots, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        width = bucket_for(self.buckets, int(rows[-1]) + 1)
        self._write_decode_inputs(rows, token_ids, pos, 0, width)
        binding = self._decode_bindings.get(width) or self._make_decode_binding(width)
        out = self._run_decode(binding, width, logits)  # [width, 1, V] or None
        self.slot_len[rows] = pos + 1
        device_io = self._device_ios.get(width)
        if device_io is not None and device_io.row_argmax is not None:
            self.decode_summary = (device_io.row_argmax[rows], device_io.row_log_norm[rows],
                                   device_io.row_token_logprob[rows])
        if out is None:
            return None
        if width > len(rows):
            return out[rows, 0]  # [n, V] (a gather copy)
        return out[:width, 0]  # [n, V] view

    def warmup(self) -> None:
        """Two runs per bucket with every row idle, and one prefill run: compiles the kernels and, with graph
        capture, captures each bucket's decode step (WebGPU at its first run, CUDA at its second), so the first
        request doesn't pay for it. Row KV stays garbage (no slot is live)."""
        for _ in range(2 if self.device_io is not None else 1):
            for b in self.buckets:
                none = np.zeros(0, dtype=np.int64)
                self._write_decode_inputs(none, [], none, 0, b)
                binding = self._decode_bindings.get(b) or self._make_decode_binding(b)
                self._run_decode(binding, b)
        if self.chunks is not None:
            self.chunks.run(0, [0, 0], 0, all_logits=False)
            self.slot_len[0] = 0
            self.chunks.warm_shapes()
        elif self.staging is not None:
            self._run_staged([0, 0], 0)
            self._staged = None

    def prefill(self, slot: int, token_ids: Sequence[int], start: int, also: Sequence[int] = ()) -> np.ndarray:
        """Prompt tokens ``[start, start + S)`` of the request in ``slot``: a staged chunk copied into the slot,
        or without a copier one token per run (``also``: slots that end up with the same KV, computed in the same
        runs). Returns the float32 ``[vocab]`` logits of the chunk's last token."""
        self._check_chunk(len(token_ids))
        if self.chunks is not None:
            logits = self.chunks.run(slot, token_ids, start, all_logits=False)[-1]
            for other in also:
                self.copy_kv(slot, other, start, start + len(token_ids))
            return logits
        if self.staging is not None:
            return self._prefill_staged(slot, token_ids, start, also)
        return self._prefill_whole(slot, token_ids, start, also)

    def verify(self, slot: int, token_ids: Sequence[int], start: int) -> np.ndarray:
        """A draft check in the slot's own row (``row_chunks`` only; see ``Runner.verify``)."""
        if self.chunks is None:
            raise ValueError("verify needs row views: GroupQueryAttention runs S > 1 tokens only at batch 1")
        self._check_chunk(len(token_ids), "verify run")
        return self.chunks.run(slot, token_ids, start, all_logits=True)

    def copy_kv(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy slot ``src``'s row into slot ``dst`` on the device (the whole row: positions ``[0, start)`` are the
        same in both, a shared prefix, wherever the engine asks for a copy)."""
        if self.copier is not None:
            self.copier.copy(self._kv_buffers, src, self._kv_buffers, dst)
        else:
            self.kv.copy_positions(src, dst, start, end)
        if self._staged is not None and self._staged[0] == dst:
            self._staged = None
        self.slot_len[dst] = max(int(self.slot_len[dst]), end)

    def release(self, slot: int, keep: int = 0) -> None:
        super().release(slot, keep)
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
        io, num, vocab = self.prefill_io, len(token_ids), self.vocab_size
        binding = self._stage_binding
        if binding is None:
            binding = self._stage_binding = self.prefill_session.io_binding()
            self.staging.bind_rows(binding, tuple(zip(io.past_keys, io.past_values)),
                                   tuple(zip(io.present_keys, io.present_values)), 0, 1)
            if self.stage_keep_last:
                binding.bind_ortvalue_input(LOGITS_TO_KEEP, self._keep_one)
                binding.bind_ortvalue_output(io.logits, _value(self.prefill_logits[:vocab].reshape(1, 1, vocab)))
        ids, pos = self._chunk_inputs(token_ids, start)
        binding.bind_ortvalue_input(io.input_ids, _value(ids))
        if io.position_ids:
            binding.bind_ortvalue_input(io.position_ids, _value(pos))
        # the plain graph takes the total length from the mask's width: all ones, prompt so far + chunk
        binding.bind_ortvalue_input(io.attention_mask, _value(self._ones[:start + num].reshape(1, start + num)))
        if self.stage_keep_last:
            logits = self.prefill_logits[:vocab].reshape(1, 1, vocab)
        else:
            logits = self.prefill_logits[:num * vocab].reshape(1, num, vocab)
            binding.bind_ortvalue_output(io.logits, _value(logits))
        self._run(binding, self.prefill_session)
        return logits[0, -1]

    def _prefill_whole(self, slot: int, token_ids: Sequence[int], start: int, also: Sequence[int]) -> np.ndarray:
        # NOTE(engine): GQA refuses S > 1 with past context at batch > 1 ("batch_size must be 1 when
        # sequence_length > 1 and past context is given"), and an opaque buffer can't be bound one row at a
        # time, so without a row copier the prompt goes one token per run beside idle rows. Slow; correct.
        # Slots in ``also`` get the same token in the same run (their rows compute alike).
        slots = sorted({slot, *also})
        row = slots.index(slot)
        logits = None
        for i, token_id in enumerate(token_ids):
            logits = self.decode(slots, [token_id] * len(slots), [start + i] * len(slots))
        assert logits is not None
        return logits[row]

    def _run_decode(self, binding: ort.IOBinding, width: int, logits: bool = True) -> np.ndarray | None:
        """Run the decode binding of rows ``[0, width)``; returns its float32 ``[width, 1, V]`` logits (None with
        ``logits=False`` where the device's row summary stands for them)."""
        session = self.bucket_sessions.get(width)
        if self.device_io is None:
            self._run(binding, session)
            return self.decode_logits
        device_io = self._device_ios[width]
        if self._packed is not None:
            self._packed[:width, 0] = self.decode_ids[:width, 0]
            self._packed[:width, 1] = self.mask_ones[:width] - 1
        device_io.upload()
        self._run(binding, session, run_options=self._run_options.get(width))
        return device_io.read_logits(logits)

    def _session_names(self) -> dict[int, str]:
        names = super()._session_names()
        if self.prefill_session is not self.session:
            names[id(self.prefill_session)] = "prefill"
        names.update((id(other), f"decode_b{width}") for width, other in self.bucket_sessions.items())
        return names

    def _make_decode_binding(self, width: int) -> ort.IOBinding:
        binding = self.bucket_sessions.get(width, self.session).io_binding()
        if self.device_io is not None:
            self._device_ios[width].bind(binding)
        else:
            whole = width == self.num_slots
            self._bind_host(binding, self.io.input_ids, self._ids_value if whole else _value(self.decode_ids[:width]))
            if self.io.position_ids:
                self._bind_host(binding, self.io.position_ids,
                                self._pos_value if whole else _value(self.decode_pos[:width]))
            self._bind_host(binding, self.io.attention_mask, self._mask_value if whole else _value(self.mask[:width]))
            binding.bind_ortvalue_output(self.io.logits, _value(self.decode_logits[:width]))
        self.kv.bind_rows(binding, self._past, self._present, 0, width)
        self._decode_bindings[width] = binding
        return binding
