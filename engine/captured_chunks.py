"""Prompt chunks as captured device graphs (CUDA graphs) over a one-row staging KV, for pointer-addressed KV.

An uncaptured run costs its kernel launches whatever its length (H200, 1B INT4: 2.6-3.7 ms for 16-256 tokens,
``bench/perf/gpu/probe_buckets.py``), and a captured graph replays the addresses it was captured with, so a chunk
cannot be captured in the row of whichever slot it belongs to. So every chunk runs in one staging row: a graph per
piece length (``runner.chunk_shapes``: a chunk is its base-16 digits, at most 3 runs), captured at load; before a
chunk that follows a past the slot's row is copied in (unless the staging row already holds it), and after it the
staging row is copied back into the slot (``device_kv.AddressRowCopier.copy_rows``: 0.15 ms for a 33.6 MB row).

The graph is the decoder's with GroupQueryAttention's total length fixed at the KV length and ``logits_to_keep`` at
1 (``graph_capture.capture_graph_bytes(keep_last=True)``): a ``[1, S]`` run with a mask as wide as the KV row is a
chunk after a past of ``ones - S`` positions (none for a first chunk), which GQA takes at batch 1.

Imports onnxruntime; the sessions and buffers come from ``engine.placement``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from engine.device_kv import AddressRowCopier
from engine.graph_capture import DeviceAllocator, DeviceDecodeIO
from engine.kv_cache import KVCache
from engine.model_loader import GraphIO
from engine.runner import InputAllocator, chunk_pieces, chunk_shapes

# NOTE(engine): graph ids of the chunk session (its own session: ids need not differ from the decode buckets')
GRAPH_ID_BASE = 1000


class CapturedChunks:
    """Prompt chunks in a staging row, one captured graph per piece length.

    Args:
        session: a session of ``capture_graph_bytes(..., packed=False, keep_last=True)`` with graph capture on.
        io: its names.
        kv: the engine's KV cache (pointer rows).
        staging: a one-slot KV cache of the same shape on the same device.
        copier: copies rows between ``kv`` and ``staging`` (``AddressRowCopier.copy_rows``).
        max_chunk: the longest chunk (the runner's prefill_chunk): piece lengths ``chunk_shapes(max_chunk)``.
        allocate: device buffers for each length's inputs and logits.
        input_allocator: host(-accessible) memory for what the CPU writes (inputs, logits read back).
    """

    def __init__(self, session: ort.InferenceSession, io: GraphIO, kv: KVCache, staging: KVCache,
                 copier: AddressRowCopier, max_chunk: int, allocate: DeviceAllocator,
                 input_allocator: InputAllocator) -> None:
        self.session = session
        self.io = io
        self.kv = kv
        self.staging = staging
        self.copier = copier
        self.length = kv.shape.length
        self.vocab_size = io.vocab_size
        self.lengths = chunk_shapes(max_chunk)
        self.num_runs = 0  # piece runs (replays and captures)
        self._staged: tuple[int, int] | None = None  # (slot, length) whose KV the staging row holds
        self._logits, _ = input_allocator((1, 1, self.vocab_size), np.float32)
        past = tuple(zip(io.past_keys, io.past_values))
        present = tuple(zip(io.present_keys, io.present_values))
        self._pieces: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, DeviceDecodeIO, ort.IOBinding,
                                      ort.RunOptions]] = {}
        for num in self.lengths:
            ids, _ = input_allocator((1, num), np.int64)
            pos, _ = input_allocator((1, num), np.int64)
            mask, _ = input_allocator((1, self.length), np.int64)
            stage = {io.input_ids: ids, io.attention_mask: mask}
            if io.position_ids:
                stage[io.position_ids] = pos
            device_io = DeviceDecodeIO(session, stage, io.logits, (1, 1, self.vocab_size), allocate, self._logits)
            binding = session.io_binding()
            device_io.bind(binding)
            staging.bind_rows(binding, past, present, 0, 1)
            options = ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", str(GRAPH_ID_BASE + num))
            self._pieces[num] = (ids, pos, mask, device_io, binding, options)

    def run(self, slot: int, token_ids: Sequence[int], start: int) -> np.ndarray:
        """Tokens ``[start, start + S)`` of the request in ``slot``; returns the last one's float32 ``[vocab]``
        logits (valid until the next run). The slot's row holds the chunk's KV when it returns."""
        if start > 0 and self._staged != (slot, start):
            self.copier.copy_rows(self.kv, slot, self.staging, 0)
        at, logits = 0, None
        for num in chunk_pieces(len(token_ids)):
            logits = self._run_piece(token_ids[at:at + num], start + at)
            at += num
        assert logits is not None
        self.copier.copy_rows(self.staging, 0, self.kv, slot)
        self._staged = (slot, start + len(token_ids))
        return logits[0, 0]

    def forget(self, slot: int | None = None) -> None:
        """The slot's row changed (a copy into it, a release): the staging row no longer stands for it."""
        if slot is None or (self._staged is not None and self._staged[0] == slot):
            self._staged = None

    def warmup(self) -> int:
        """Capture every piece length's graph (CUDA captures at a graph id's second run); returns the runs."""
        runs = 0
        for num in self.lengths:
            for _ in range(2):
                self._run_piece([0] * num, 0)
                runs += 1
        self._staged = None
        return runs

    def _run_piece(self, token_ids: Sequence[int], start: int) -> np.ndarray:
        num = len(token_ids)
        ids, pos, mask, device_io, binding, options = self._pieces[num]
        ids[0] = token_ids
        pos[0] = np.arange(start, start + num)
        mask[0, :start + num] = 1
        mask[0, start + num:] = 0
        device_io.upload()
        self.num_runs += 1
        # NOTE(engine): through the binding it was captured with (see RunnerBase._run)
        self.session._sess.run_with_iobinding(binding._iobinding, options)
        return device_io.read_logits()
