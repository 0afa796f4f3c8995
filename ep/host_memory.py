"""Host-accessible decode-input buffers, device tensors for the KV cache, and binding prefix views.

Imports onnxruntime and numpy (hip-python optionally); never engine/ or server/.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from ep.device import SelectedDevice
from ep.names import MemoryUnavailableError

logger = logging.getLogger(__name__)

SOURCE_EP = "ep_host_accessible"  # the EP's HOST_ACCESSIBLE memory info, through ORT's shared allocator
SOURCE_HIP = "hip_host_malloc"  # hipHostMalloc(mapped | portable), through hip-python
SOURCE_CPU = "cpu"  # ordinary numpy memory (the fallback)


@dataclass(frozen=True)
class HostBuffer:
    """A tensor the CPU writes in place and a session reads without rebinding.

    ``array`` and ``ortvalue`` share one block of memory: write ``array[...] = ...`` (never rebind the name
    to a new array) and the next run that has ``ortvalue`` bound sees the values.
    """

    ortvalue: ort.OrtValue
    array: np.ndarray  # same memory as ortvalue, shape and dtype as allocated
    source: str  # SOURCE_EP | SOURCE_HIP | SOURCE_CPU
    device_id: int  # the selected device's id (the memory info's id for SOURCE_EP)


def alloc_host_accessible(shape: Sequence[int], dtype: Any, selected: SelectedDevice, *,
                          use_hip: bool = True) -> HostBuffer | None:
    """Allocate a decode input (input_ids, position_ids, attention_mask) the CPU can update in place.

    Tries, in order: the EP's HOST_ACCESSIBLE memory info (``OrtValue.ortvalue_from_shape_and_type(...,
    memory_info=...)``, same device id as the device's DEFAULT memory); then, for AMDGPU/MIGraphX with
    hip-python importable, hipHostMalloc'd mapped memory wrapped as a CPU OrtValue.

    Args:
        shape: e.g. (batch, 1) for input_ids, (batch, max_len) for the attention mask.
        dtype: numpy dtype, e.g. np.int64.
        selected: the device from ep.device.select_device.
        use_hip: allow the hip-python source.

    Returns:
        A HostBuffer, or None: then use ordinary buffers (``alloc_cpu``). The log says which path was taken.
    """
    shape = tuple(int(d) for d in shape)
    dtype = np.dtype(dtype)
    if selected.host_accessible_memory is not None:
        mem = selected.host_accessible_memory
        try:
            ortvalue = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype.type, memory_info=mem)
            array = _shared_view(ortvalue, shape, dtype)
            array[...] = 0  # NOTE(host_memory): allocators hand out recycled memory; callers expect zeros
        except Exception as e:  # noqa: BLE001 - ORT raises several pybind classes; fall back, say why
            logger.warning("%s: HOST_ACCESSIBLE memory %s could not be used (%s)", selected.ep_name, mem.name, e)
        else:
            logger.info("decode input %s %s: %s memory %s (device id %d)", shape, dtype, SOURCE_EP, mem.name,
                        int(mem.device_id))
            return HostBuffer(ortvalue, array, SOURCE_EP, int(mem.device_id))
    if use_hip and selected.profile.hip_host_memory:
        buf = _hip_host_buffer(shape, dtype, selected.device_id)
        if buf is not None:
            logger.info("decode input %s %s: %s on device %d", shape, dtype, SOURCE_HIP, selected.device_id)
            return buf
    logger.info("decode input %s %s: no host-accessible memory on %s; ordinary buffers", shape, dtype,
                selected.ep_name)
    return None


def alloc_cpu(shape: Sequence[int], dtype: Any, device_id: int = 0) -> HostBuffer:
    """An ordinary numpy-backed CPU OrtValue (the fallback); ``array`` is shared with it."""
    array = np.zeros(tuple(int(d) for d in shape), dtype=np.dtype(dtype))
    return HostBuffer(ort.OrtValue.ortvalue_from_numpy(array), array, SOURCE_CPU, device_id)


def host_zeros(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """Zeroed host memory for large buffers written a little at a time (KV rows), in small pages.

    numpy asks for transparent huge pages on every array of 4 MiB or more, so a buffer's first write to a
    place makes the kernel zero (and, with defrag, compact for) a whole 2 MiB page. A KV row's heads lie
    ``max_model_len`` positions apart, so a few positions copied into a fresh row at 8,192 positions touched a
    huge page per head and layer: 800 ms for a 24-token prefix on SmolLM2, against 5 ms in small pages. The
    memory is an anonymous mapping advised MADV_NOHUGEPAGE (zeroed on first touch, freed with the array), or
    ``np.zeros`` where the platform has no such advice.
    """
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is None or nbytes == 0:
        return np.zeros(tuple(shape), dtype=dt)
    block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block.madvise(advice)
    return np.frombuffer(block, dtype=dt).reshape(tuple(shape))  # the array keeps the mapping alive


def alloc_device(shape: Sequence[int], dtype: Any, selected: SelectedDevice, *,
                 session: ort.InferenceSession | None = None, zero: bool = False) -> ort.OrtValue:
    """Allocate a tensor in the device's DEFAULT memory (the KV cache: one max-length buffer per layer).

    Plain CPU (and CPU-side EPs that offer no DEFAULT memory): a numpy-backed OrtValue. Otherwise the
    environment's shared allocator for ``selected.default_memory``; if that fails and ``session`` is given,
    the session's own allocator (such a value may only be bound to that session).

    Args:
        shape: e.g. (batch, kv_heads, max_len, head_size).
        dtype: numpy dtype, e.g. np.float16.
        selected: the device from ep.device.select_device.
        session: fallback allocator owner.
        zero: fill with zeros (device memory starts uninitialized); copies a zero CPU tensor over.

    Returns:
        The OrtValue; ``.numpy()`` works only for CPU memory (device values: IOBinding/copy_tensors).

    Raises:
        MemoryUnavailableError: neither allocator could provide the memory; the message says why.
    """
    shape = [int(d) for d in shape]
    dtype = np.dtype(dtype)
    if selected.default_memory is None:
        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=dtype))
    try:
        value = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype.type, memory_info=selected.default_memory)
    except Exception as e:  # noqa: BLE001 - ORT raises several pybind classes
        if session is None:
            raise MemoryUnavailableError(
                f"{selected.ep_name}: cannot allocate {shape} {dtype} from {selected.default_memory.name}: {e}") from e
        try:
            value = session.create_ortvalue_from_shape_and_type(shape, dtype.type, selected.profile.device_type,
                                                                selected.device_id)
        except Exception as e2:  # noqa: BLE001
            raise MemoryUnavailableError(f"{selected.ep_name}: cannot allocate {shape} {dtype}: shared allocator: "
                                         f"{e}; session allocator: {e2}") from e2
    if zero:
        upload(np.zeros(shape, dtype=dtype), value, selected)
    return value


def upload(array: np.ndarray, value: ort.OrtValue, selected: SelectedDevice) -> None:
    """Copy a host array into a device value of its shape and dtype (``alloc_device``'s).

    Raises:
        MemoryUnavailableError: neither ORT's data transfer nor the value's own copy could write it.
    """
    # NOTE(host_memory): on WebGPU (ORT 1.31.1) both an upload with copy_tensors and
    # update_inplace take the data at call time and are ordered before the next run.
    array = np.ascontiguousarray(array)
    try:
        ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(array)], [value])
    except Exception:  # noqa: BLE001 - no data transfer registered for this pair: the EP's own copy
        try:
            value.update_inplace(array)
        except Exception as e:  # noqa: BLE001
            raise MemoryUnavailableError(
                f"{selected.ep_name}: cannot write {list(array.shape)} {array.dtype} to the device: {e}") from e


def prefix_view(buf: HostBuffer, shape: Sequence[int]) -> np.ndarray:
    """The first prod(shape) elements of ``buf`` viewed as ``shape`` (C order); writes reach ``buf``.

    Raises:
        ValueError: ``shape`` holds more elements than ``buf``.
    """
    shape = tuple(int(d) for d in shape)
    count = math.prod(shape)
    if count > buf.array.size:
        raise ValueError(f"prefix shape {shape} needs {count} elements; the buffer has {buf.array.size}")
    return buf.array.reshape(-1)[:count].reshape(shape)


def bind_prefix(binding: ort.IOBinding, name: str, buf: HostBuffer, shape: Sequence[int]) -> np.ndarray:
    """Bind input ``name`` to the first prod(shape) elements of ``buf`` and return that view.

    The whole buffer binds its own OrtValue (zero copy on every source). A shorter prefix is bound by
    address as CPU memory: all three sources are CPU-addressable, so that is valid, but a GPU EP then copies
    it to the device as it does for ordinary inputs.
    """
    shape = tuple(int(d) for d in shape)
    view = prefix_view(buf, shape)
    if shape == buf.array.shape:
        binding.bind_ortvalue_input(name, buf.ortvalue)
    else:
        binding.bind_input(name, "cpu", 0, buf.array.dtype.type, list(shape), view.ctypes.data)
    return view


def _shared_view(ortvalue: ort.OrtValue, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A numpy array over the OrtValue's own memory (host-accessible memory is CPU-addressable)."""
    array = ortvalue.numpy()
    if array.ctypes.data == ortvalue.data_ptr() and array.shape == shape:
        return array
    # NOTE(host_memory): numpy() copied; map the address instead. The OrtValue must outlive the view, so
    # the ctypes block holds a reference to it.
    nbytes = math.prod(shape) * dtype.itemsize
    block = (ctypes.c_ubyte * nbytes).from_address(ortvalue.data_ptr())
    block._owner = ortvalue  # type: ignore[attr-defined]
    return np.frombuffer(block, dtype=dtype).reshape(shape)


class _HipHostAllocation:
    """Frees hipHostMalloc'd memory when the last view of it goes away."""

    def __init__(self, hip: Any, pointer: Any) -> None:
        self._hip, self._pointer = hip, pointer

    def __del__(self) -> None:
        try:
            self._hip.hipHostFree(self._pointer)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _hip_host_buffer(shape: tuple[int, ...], dtype: np.dtype, device_id: int) -> HostBuffer | None:
    """hipHostMalloc(mapped | portable) memory wrapped as a CPU OrtValue; None without hip-python."""
    try:
        from hip import hip  # optional `rocm` extra
    except (ImportError, OSError):
        return None
    nbytes = max(1, math.prod(shape) * dtype.itemsize)
    try:
        hip.hipSetDevice(device_id)
        err, pointer = hip.hipHostMalloc(nbytes, hip.hipHostMallocMapped | hip.hipHostMallocPortable)
        if int(err) != 0:
            logger.warning("hipHostMalloc(%d bytes) failed: %s", nbytes, err)
            return None
        address = int(pointer)
    except Exception as e:  # noqa: BLE001 - a missing ROCm runtime shows up here
        logger.warning("hip-python is installed but hipHostMalloc failed: %s", e)
        return None
    block = (ctypes.c_ubyte * nbytes).from_address(address)
    block._owner = _HipHostAllocation(hip, pointer)  # type: ignore[attr-defined]
    array = np.frombuffer(block, dtype=dtype, count=math.prod(shape)).reshape(shape)
    array[...] = 0
    return HostBuffer(ort.OrtValue.ortvalue_from_numpy(array), array, SOURCE_HIP, device_id)
