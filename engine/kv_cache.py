"""The KV cache: per layer one key and one value buffer [num_slots, kv_heads, length, head_size].

Allocated once and bound as both past and present (past_present_share_buffer); a slot is a row. How a row can be
bound is the memory's addressing (``ep.addressing``):
  * host: numpy row views (the CPU EP);
  * pointer: the buffer's device address plus ``row * row_bytes`` (CUDA, HIP), bound by address;
  * opaque: a handle (WebGPU, DirectML): the whole buffer, or where the device allows it the prefix of its rows
    ``[0, n)`` (the handle with a smaller first dimension).
Allocation is behind ``KVAllocator`` so device memory (ep/) plugs in; only the core thread uses it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

log = logging.getLogger(__name__)

HOST, POINTER, OPAQUE = "host", "pointer", "opaque"  # ep.addressing.Addressing values

# (src row, dst row): copies whole rows of every layer's key and value buffer on the device (pointer memory)
RowCopy = Callable[[int, int], None]


class KVAllocator(Protocol):
    """Allocates one KV buffer. ``array`` is a numpy view of the same memory where the CPU can address it,
    else None. ``addressing`` says how rows are bound; ``device`` is the memory's ``onnxruntime.OrtDevice``
    (type, vendor and id) for bindings by address."""

    addressing: str
    device: ort.OrtDevice

    def allocate(self, shape: tuple[int, ...], dtype: Any) -> tuple[ort.OrtValue, np.ndarray | None]: ...


class HostKVAllocator:
    """Ordinary host memory: numpy zeros (lazily committed pages) wrapped zero-copy in an OrtValue.

    Args:
        addressing: ``host`` (rows bound as numpy views), or ``pointer``: the same memory bound by address +
            row offset, exactly as device pointers are (a CPU stand-in for CUDA/HIP rows in tests).
    """

    def __init__(self, addressing: str = HOST) -> None:
        self.addressing = addressing
        self.device = ort.OrtDevice.make("cpu", 0)

    def allocate(self, shape: tuple[int, ...], dtype: Any) -> tuple[ort.OrtValue, np.ndarray | None]:
        from ep.host_memory import host_zeros

        array = host_zeros(shape, dtype)  # small pages: a fresh row's first positions cost what they hold
        return ort.OrtValue.ortvalue_from_numpy(array), array


class DeviceKVAllocator:
    """Device memory through ``ep.host_memory.alloc_device``, bound by address (pointer) or as a handle (opaque).

    Args:
        selected: the ``ep.device.SelectedDevice``.
        session: the session whose allocator is the fallback when the shared allocator can't serve.
    """

    def __init__(self, selected: Any, session: ort.InferenceSession | None = None) -> None:
        self.selected = selected
        self.session = session
        self.addressing = str(selected.kv_addressing)
        self.device = memory_device(selected)

    def allocate(self, shape: tuple[int, ...], dtype: Any) -> tuple[ort.OrtValue, np.ndarray | None]:
        from ep import host_memory

        return host_memory.alloc_device(shape, dtype, self.selected, session=self.session, zero=True), None


def memory_device(selected: Any) -> ort.OrtDevice:
    """The OrtDevice of ``selected``'s DEFAULT memory: the hardware's type with the memory info's vendor and
    device id (what ORT keys a plugin EP's allocations by; "cuda" alone would say NVIDIA)."""
    return ort.OrtDevice.make(*selected.profile.memory_device())


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
    length: int  # positions per slot: the graph's static KV length, else max_model_len
    head_size: int
    dtype: Any

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * self.num_slots * self.row_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot in one buffer (a row: [kv_heads, length, head_size])."""
        return self.num_kv_heads * self.length * self.head_size * np.dtype(self.dtype).itemsize


class KVCache:
    """All layers' key/value buffers.

    Args:
        shape: sizes; each buffer is ``[num_slots, num_kv_heads, length, head_size]`` of ``dtype``.
        allocator: where the memory comes from (and how its rows are addressed).
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
        self.addressing = getattr(allocator, "addressing", HOST)
        self.device: ort.OrtDevice = getattr(allocator, "device", None) or ort.OrtDevice.make("cpu", 0)
        if self.addressing == HOST and not all(a is not None for a in self._key_arrays + self._value_arrays):
            raise ValueError("host KV needs numpy views of every buffer")
        self.row_copy: RowCopy | None = None  # pointer memory: set by the placement (engine.device_kv)
        log.info("KV cache: %d layers x 2 x %s %s = %.1f MiB (%s rows)", shape.num_layers, buf,
                 np.dtype(shape.dtype).name, shape.nbytes / 2**20, self.addressing)

    @property
    def addressable(self) -> bool:
        """The CPU addresses the buffers (numpy views of rows exist)."""
        return self.addressing == HOST

    @property
    def row_views(self) -> bool:
        """Any row range can be bound on its own (host views or device pointers)."""
        return self.addressing in (HOST, POINTER)

    @property
    def buffers(self) -> list[ort.OrtValue]:
        """Every layer's key buffer, then every value buffer (the row copiers' order)."""
        return [*self.keys, *self.values]

    def bind_rows(self, binding: ort.IOBinding, past: tuple[tuple[str, str], ...],
                  present: tuple[tuple[str, str], ...], lo: int, hi: int) -> None:
        """Bind slots ``[lo, hi)`` of every layer as past and present (the same memory: GQA updates it in place).

        Args:
            past, present: per layer the (key, value) input and output names.
        The whole buffer binds its own OrtValues. A row range: host views (zero copy), or the device address of
        row ``lo`` with shape ``[hi - lo, ...]``; opaque memory allows only ranges from row 0 (a prefix).
        """
        s = self.shape
        whole = lo == 0 and hi == s.num_slots
        if not whole and self.addressing == OPAQUE and lo != 0:
            raise ValueError(f"opaque KV binds only a prefix of its rows, not [{lo}, {hi})")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            for (past_name, present_name), value, arrays in ((
                    (past[i][0], present[i][0]), k, self._key_arrays), ((past[i][1], present[i][1]), v,
                                                                        self._value_arrays)):
                if whole:
                    binding.bind_ortvalue_input(past_name, value)
                    binding.bind_ortvalue_output(present_name, value)
                elif self.addressing == HOST:
                    view = ort.OrtValue.ortvalue_from_numpy(arrays[i][lo:hi])  # [hi - lo, H, L, D], contiguous
                    binding.bind_ortvalue_input(past_name, view)
                    binding.bind_ortvalue_output(present_name, view)
                else:
                    ptr = value.data_ptr() + lo * s.row_bytes  # opaque: lo == 0, the handle itself
                    self.bind_address(binding, past_name, present_name, ptr, hi - lo)

    def bind_address(self, binding: ort.IOBinding, input_name: str, output_name: str, ptr: int, rows: int, *,
                     output_ptr: int | None = None) -> None:
        """Bind ``rows`` rows at device address ``ptr`` as an input and an output (at ``output_ptr``; default the
        same memory)."""
        s = self.shape
        shape = [rows, s.num_kv_heads, s.length, s.head_size]
        device, dtype = self.device._get_c_device(), np.dtype(s.dtype).type
        # NOTE(engine): the wrapper's bind_input/bind_output build their OrtDevice from a name alone (no vendor),
        # so the address is bound through the C binding with the memory's own OrtDevice
        binding._iobinding.bind_input(input_name, device, dtype, shape, ptr)
        binding._iobinding.bind_output(output_name, device, dtype, shape, ptr if output_ptr is None else output_ptr)

    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy positions ``[start, end)`` of slot ``src`` into slot ``dst`` in every layer (keys and values).

        Host rows copy exactly those positions. Pointer rows copy the whole row on the device (``row_copy``):
        dst's positions ``[0, start)`` then hold src's, which the engine only asks for where they are the same
        (a shared prefix), and its positions past ``end`` become src's, which nothing attends to.
        """
        if src == dst or end <= start:
            return
        if self.addressing == HOST:
            for arrays in (self._key_arrays, self._value_arrays):
                for a in arrays:
                    a[dst, :, start:end] = a[src, :, start:end]  # [kv_heads, end - start, head_size]
            return
        if self.addressing == POINTER and self.row_copy is not None:
            self.row_copy(src, dst)
            return
        raise ValueError(f"{self.addressing} KV rows can't be copied here (no device row copier)")

    def key_array(self, layer: int) -> np.ndarray | None:
        """The numpy view of a layer's key buffer (tests and debugging), None when the CPU can't address it."""
        return self._key_arrays[layer]

    def value_array(self, layer: int) -> np.ndarray | None:
        return self._value_arrays[layer]
