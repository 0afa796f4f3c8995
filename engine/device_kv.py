"""Device-side KV work: batch buckets and row copies between slots, for both kinds of device memory.

Opaque device KV (WebGPU) can't be bound one row at a time, but a buffer can be bound as its prefix
``[b, H, L, D]`` (the buffer's own address with a smaller shape), and rows can be copied on the device by a
small graph (Gather, then ScatterND writing in place: ``RowCopier``). With these the bucket runner
(``engine.bucket_runner``)
  * decodes at the size of the work: one captured step per batch bucket (1, 2, 4, ... max_batch) over the
    prefix of rows that holds the running requests (the scheduler fills the lowest free slots first);
  * prefills a prompt in chunks of many tokens in a batch-1 staging row (GroupQueryAttention takes S > 1 new
    tokens with a past at batch 1 only) and copies that row into the request's slot;
  * copies KV between slots (prefix reuse from another slot, n > 1 choices).
Pointer-addressed device KV (CUDA, HIP) binds any row by address, so only its copies between slots need the
device: ``AddressRowCopier``, a graph of Identity nodes bound to the source and destination rows.

Imports onnxruntime and onnx (to build the copy graph); ep/ only through the session the caller opened.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

log = logging.getLogger(__name__)

SRC_ROW = "src_row"  # int64 [1]: the row of the source buffers
DST_ROW = "dst_row"  # int64 [1, 1]: the row of the destination buffers


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The decode widths a bucketed runner captures: powers of two below ``max_batch``, then ``max_batch``."""
    buckets, b = [], 1
    while b < max_batch:
        buckets.append(b)
        b *= 2
    return (*buckets, max_batch)


def bucket_for(buckets: Sequence[int], rows: int) -> int:
    """The smallest bucket that holds ``rows`` rows (the last one holds all)."""
    for b in buckets:
        if b >= rows:
            return b
    return buckets[-1]


def row_copy_graph_bytes(num_buffers: int, dtype: Any, heads: int, length: int) -> bytes:
    """A graph that copies one row of each of ``num_buffers`` 4-D buffers into a row of another buffer.

    Inputs ``src_i`` ``[s, H, L, D]``, ``dst_i`` ``[d, H, L, D]``, ``src_row`` int64 ``[1]`` and ``dst_row``
    int64 ``[1, 1]``; output ``out_i`` = ``dst_i`` with row ``dst_row`` replaced by row ``src_row`` of
    ``src_i``. Bind ``out_i`` to the same buffer as ``dst_i`` and the copy happens in place (ScatterND skips
    its copy of the data when its output is its input, on WebGPU and on the CPU EP); ``src_i`` may be that
    buffer too (Gather reads the row before ScatterND writes).

    NOTE(engine): ScatterND's work is split by index: with one index per row (indices ``[1, 1]``) one thread
    wrote all H * L * D elements of a row, a few hundred ms for a 1B model's 1,024-position row. One
    index per (head, position), ``[H * L, 3]`` (the destination row, then a constant grid), gives every D-wide
    vector its own thread: ~300x faster (docs/perf/GPU.md).
    """
    from onnx import TensorProto, helper, numpy_helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    h, pos = np.meshgrid(np.arange(heads), np.arange(length), indexing="ij")
    inits = [numpy_helper.from_array(np.stack([h.ravel(), pos.ravel()], 1).astype(np.int64), "hl"),  # [H*L, 2]
             numpy_helper.from_array(np.array([heads * length, 1], np.int64), "col_shape")]
    nodes = [helper.make_node("Expand", [DST_ROW, "col_shape"], ["dst_col"], name="dst_col"),  # [H*L, 1]
             helper.make_node("Concat", ["dst_col", "hl"], ["indices"], name="indices", axis=1)]  # [H*L, 3]
    inputs, outputs = [], []
    for i in range(num_buffers):
        src, dst, row, out = f"src_{i}", f"dst_{i}", f"row_{i}", f"out_{i}"
        inputs += [helper.make_tensor_value_info(src, elem, [f"s{i}", heads, length, f"d{i}"]),
                   helper.make_tensor_value_info(dst, elem, [f"n{i}", heads, length, f"d{i}"])]
        outputs.append(helper.make_tensor_value_info(out, elem, [f"n{i}", heads, length, f"d{i}"]))
        if i == 0:
            inits.append(numpy_helper.from_array(np.array([heads * length, -1], np.int64), "upd_shape"))
        nodes += [helper.make_node("Gather", [src, SRC_ROW], [row], axis=0, name=f"gather_{i}"),  # [1, H, L, D]
                  helper.make_node("Reshape", [row, "upd_shape"], [f"upd_{i}"], name=f"reshape_{i}"),  # [H*L, D]
                  helper.make_node("ScatterND", [dst, "indices", f"upd_{i}"], [out], name=f"scatter_{i}")]
    inputs += [helper.make_tensor_value_info(SRC_ROW, TensorProto.INT64, [1]),
               helper.make_tensor_value_info(DST_ROW, TensorProto.INT64, [1, 1])]
    graph = helper.make_graph(nodes, "ortserve_kv_row_copy", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="ortserve")
    model.ir_version = 8
    return model.SerializeToString()


def address_copy_graph_bytes(num_buffers: int, dtype: Any, row_shape: Sequence[int]) -> bytes:
    """A graph of ``num_buffers`` Identity nodes ``src_i -> dst_i`` of shape ``row_shape`` ([1, H, L, D]).

    Bound by address (a source row and a destination row of each buffer, ``AddressRowCopier``), one run copies
    a row of every layer's keys and values: a device-to-device copy per buffer (well under a decode step for a 1B
    model's row: docs/perf/GPU.md).
    """
    from onnx import helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    shape = [int(d) for d in row_shape]
    graph = helper.make_graph(
        [helper.make_node("Identity", [f"src_{i}"], [f"dst_{i}"], name=f"copy_{i}") for i in range(num_buffers)],
        "ortserve_kv_address_copy",
        [helper.make_tensor_value_info(f"src_{i}", elem, shape) for i in range(num_buffers)],
        [helper.make_tensor_value_info(f"dst_{i}", elem, shape) for i in range(num_buffers)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="ortserve")
    model.ir_version = 8
    return model.SerializeToString()


class AddressRowCopier:
    """Copies whole KV rows between slots of pointer-addressed buffers (CUDA, HIP; host memory in tests): one
    run of ``address_copy_graph_bytes`` with each Identity's input and output bound to a row's address.

    Use it as ``KVCache.row_copy`` (``copy(src_row, dst_row)``).

    Args:
        session: a session of ``address_copy_graph_bytes(len(kv.buffers), dtype, [1, H, L, D])`` on the KV's device.
        kv: the KV cache (pointer addressing).
    """

    def __init__(self, session: ort.InferenceSession, kv: Any) -> None:
        self.session = session
        self.kv = kv
        self.num_copies = 0
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}

    def __call__(self, src_row: int, dst_row: int) -> None:
        if src_row == dst_row:
            return
        binding = self._bindings.get((src_row, dst_row))
        if binding is None:  # NOTE(engine): one binding per (src, dst) pair, at most slots^2, made on first use
            binding = self._bindings[(src_row, dst_row)] = self.session.io_binding()
            row_bytes = self.kv.shape.row_bytes
            for i, value in enumerate(self.kv.buffers):
                base = value.data_ptr()
                self.kv.bind_address(binding, f"src_{i}", f"dst_{i}", base + src_row * row_bytes, 1,
                                     output_ptr=base + dst_row * row_bytes)
        self.session.run_with_iobinding(binding)
        self.num_copies += 1


class RowCopier:
    """Copies whole KV rows between device buffers with one run of the row-copy graph (``row_copy_graph_bytes``).

    A whole row is copied: the destination's positions past the source's valid length become the source's
    garbage, which is fine (no request attends past its own length), and positions the destination kept
    must equal the source's (a shared prefix), as they do for every copy the engine asks for.

    Args:
        session: a session of ``row_copy_graph_bytes(num_buffers, dtype, heads, length)`` on the KV's device.
        num_buffers: buffers per copy (2 x layers).
    """

    def __init__(self, session: ort.InferenceSession, num_buffers: int) -> None:
        self.session = session
        self.num_buffers = num_buffers
        self._src_row = np.zeros(1, dtype=np.int64)
        self._dst_row = np.zeros((1, 1), dtype=np.int64)
        # zero-copy CPU values over the two row arrays: a binding made once sees the rows written before each run
        self._rows = (ort.OrtValue.ortvalue_from_numpy(self._src_row), ort.OrtValue.ortvalue_from_numpy(self._dst_row))
        self._bindings: dict[tuple[tuple[int, ...], tuple[int, ...]], ort.IOBinding] = {}
        self.num_copies = 0

    def copy(self, src: Sequence[ort.OrtValue], src_row: int, dst: Sequence[ort.OrtValue], dst_row: int) -> None:
        """Row ``src_row`` of every ``src[i]`` into row ``dst_row`` of ``dst[i]`` (on the device, in place)."""
        if len(src) != self.num_buffers or len(dst) != self.num_buffers:
            raise ValueError(f"a row copy takes {self.num_buffers} buffers, got {len(src)} and {len(dst)}")
        if src_row == dst_row and all(s is d for s, d in zip(src, dst)):
            return
        # NOTE(engine): one binding per (source, destination) set of buffers (staging <-> KV, KV -> KV), made once;
        # the buffers live as long as the runner, so their ids are stable keys
        key = (tuple(map(id, src)), tuple(map(id, dst)))
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = self.session.io_binding()
            for i, (s, d) in enumerate(zip(src, dst)):
                binding.bind_ortvalue_input(f"src_{i}", s)
                binding.bind_ortvalue_input(f"dst_{i}", d)
                binding.bind_ortvalue_output(f"out_{i}", d)
            binding.bind_ortvalue_input(SRC_ROW, self._rows[0])
            binding.bind_ortvalue_input(DST_ROW, self._rows[1])
        self._src_row[0] = src_row
        self._dst_row[0, 0] = dst_row
        self.session.run_with_iobinding(binding)
        self.num_copies += 1
