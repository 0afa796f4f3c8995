"""The KV cache: per layer one key and one value buffer [num_slots, kv_heads, length, head_size].

Allocated once and bound as both past and present (past_present_share_buffer); a slot is a row.
Allocation is behind ``KVAllocator`` so device memory (ep/) plugs in; only the core thread uses it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

log = logging.getLogger(__name__)


class KVAllocator(Protocol):
    """Allocates one KV buffer. ``array`` is a numpy view of the same memory where the CPU can address
    it (rows can then be bound as views), else None (the buffer is opaque: bind it whole)."""

    def allocate(self, shape: tuple[int, ...], dtype: Any) -> tuple[ort.OrtValue, np.ndarray | None]: ...


class HostKVAllocator:
    """Ordinary host memory: numpy zeros (lazily committed pages) wrapped zero-copy in an OrtValue."""

    def allocate(self, shape: tuple[int, ...], dtype: Any) -> tuple[ort.OrtValue, np.ndarray | None]:
        array = np.zeros(shape, dtype=dtype)
        return ort.OrtValue.ortvalue_from_numpy(array), array


class DeviceKVAllocator:
    """Device memory through ``ep.host_memory.alloc_device`` (opaque: bound whole, never as row views).

    Args:
        selected: the ``ep.device.SelectedDevice``.
        session: the session whose allocator is the fallback when the shared allocator can't serve.
    """

    def __init__(self, selected: Any, session: ort.InferenceSession | None = None) -> None:
        self.selected = selected
        self.session = session

    def allocate(self, shape: tuple[int, ...], dtype: Any) -> tuple[ort.OrtValue, np.ndarray | None]:
        from ep import host_memory

        return host_memory.alloc_device(shape, dtype, self.selected, session=self.session, zero=True), None


def make_kv_allocator(selected: Any, session: ort.InferenceSession | None = None) -> KVAllocator:
    """Host memory for the plain CPU path and CPU-side EPs (no DEFAULT device memory), else the device."""
    if selected is None or getattr(selected, "default_memory", None) is None:
        return HostKVAllocator()
    return DeviceKVAllocator(selected, session)


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_slots: int
    num_kv_heads: int
    length: int  # positions per slot (max_model_len plus the idle tail where needed)
    head_size: int
    dtype: Any

    @property
    def nbytes(self) -> int:
        per_buffer = self.num_slots * self.num_kv_heads * self.length * self.head_size
        return 2 * self.num_layers * per_buffer * np.dtype(self.dtype).itemsize


class KVCache:
    """All layers' key/value buffers.

    Args:
        shape: sizes; each buffer is ``[num_slots, num_kv_heads, length, head_size]`` of ``dtype``.
        allocator: where the memory comes from.
    """

    def __init__(self, shape: KVShape, allocator: KVAllocator) -> None:
        self.shape = shape
        buf = (shape.num_slots, shape.num_kv_heads, shape.length, shape.head_size)
        self.keys: list[ort.OrtValue] = []
        self.values: list[ort.OrtValue] = []
        self._key_arrays: list[np.ndarray | None] = []
        self._value_arrays: list[np.ndarray | None] = []
        for _ in range(shape.num_layers):
            for values, arrays in ((self.keys, self._key_arrays), (self.values, self._value_arrays)):
                value, array = allocator.allocate(buf, shape.dtype)
                values.append(value)
                arrays.append(array)
        self.addressable = all(a is not None for a in self._key_arrays + self._value_arrays)
        log.info("KV cache: %d layers x 2 x %s %s = %.1f MiB (%s)", shape.num_layers, buf,
                 np.dtype(shape.dtype).name, shape.nbytes / 2**20,
                 "host, row views" if self.addressable else "device, whole buffer")

    def rows(self, lo: int, hi: int) -> tuple[list[ort.OrtValue], list[ort.OrtValue]]:
        """OrtValues for slots ``[lo, hi)`` of every layer (keys, values); zero-copy views on the host.

        The whole buffer is returned as is; a row range needs ``addressable``.
        """
        if lo == 0 and hi == self.shape.num_slots:
            return self.keys, self.values
        if not self.addressable:
            raise ValueError("the KV cache is not CPU-addressable; bind the whole buffer")
        # NOTE(engine): a slice on the first axis of a C-contiguous array is contiguous: no copy.
        keys = [ort.OrtValue.ortvalue_from_numpy(a[lo:hi]) for a in self._key_arrays]
        values = [ort.OrtValue.ortvalue_from_numpy(a[lo:hi]) for a in self._value_arrays]
        return keys, values

    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy positions ``[start, end)`` of slot ``src`` into slot ``dst`` in every layer (keys and values).

        Needs ``addressable`` (a host row copy); opaque device buffers can't be sliced from here.
        """
        if not self.addressable:
            raise ValueError("the KV cache is not CPU-addressable; rows can't be copied")
        if src == dst or end <= start:
            return
        for arrays in (self._key_arrays, self._value_arrays):
            for a in arrays:
                a[dst, :, start:end] = a[src, :, start:end]  # [kv_heads, end - start, head_size]

    def key_array(self, layer: int) -> np.ndarray | None:
        """The numpy view of a layer's key buffer (tests and debugging), None when opaque."""
        return self._key_arrays[layer]

    def value_array(self, layer: int) -> np.ndarray | None:
        return self._value_arrays[layer]
