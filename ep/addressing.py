"""How a device's memory is addressed, decided from its DEFAULT memory info (not from the provider's name).

The engine's KV cache is one ``[slots, kv_heads, max_len, head_size]`` buffer per layer; how a single slot (a row)
of it can be bound decides the engine's device path (``engine.placement``):

* ``host``: the CPU addresses the memory (the CPU EP and CPU-side plugin EPs, which offer no DEFAULT device
  memory): rows are numpy views.
* ``pointer``: device memory addressed by plain pointers (CUDA's ``cudaMalloc``, HIP's ``hipMalloc`` under
  MIGraphX or the AMDGPU EP on Linux): a row is the buffer's address plus ``row * row_bytes``, bound through
  IOBinding like any device pointer.
* ``opaque``: an allocation is a handle, not an address (WebGPU buffers, DirectML resources, WebNN tensors):
  only the buffer itself (or a prefix of its rows, at offset 0) can be bound.

Pure Python; no onnxruntime import.
"""

from __future__ import annotations

import sys
from enum import Enum


class Addressing(str, Enum):
    HOST = "host"
    POINTER = "pointer"
    OPAQUE = "opaque"

    def __str__(self) -> str:
        return self.value


# OrtMemoryInfo names (lower case) of allocators that hand out plain device pointers: ORT's CUDA allocator
# ("Cuda"; the CUDA plugin reports "CUDA"), HIP's (ROCm, MIGraphX: "Hip", "MIGraphX").
POINTER_MEMORY = frozenset({"cuda", "hip", "migraphx"})
# ... and of allocators whose values are handles: WebGPU buffers ("WebGPU_Buffer"; the plugin EP reports
# "WebGPU_Buf"), DirectML resources ("DML"), WebNN tensors, OpenVINO's remote GPU tensors.
OPAQUE_MEMORY = frozenset({"webgpu_buffer", "webgpu_buf", "dml", "webnn_tensor", "openvino_gpu"})
AMD_VENDOR_ID = 0x1002


def memory_addressing(default_memory_name: str | None, vendor_id: int = 0, *, platform: str | None = None,
                      ) -> Addressing:
    """The addressing of a device's DEFAULT memory.

    Args:
        default_memory_name: ``OrtMemoryInfo.name`` of the EP device's DEFAULT memory (None: it offers none,
            so the device works on host memory).
        vendor_id: the memory's (hardware's) PCI vendor id.
        platform: ``sys.platform`` (a parameter for tests).

    NOTE(ep): the AMDGPU umbrella EP names its memory "default" and hands allocations to the backend it picks
    at run time: on Linux that is MIGraphX or HIP (hipMalloc pointers), on Windows DirectML (resources). A
    name this table does not know is treated as opaque: the whole-buffer path works on any device.
    """
    if default_memory_name is None:
        return Addressing.HOST
    name = default_memory_name.strip().lower()
    if name in POINTER_MEMORY:
        return Addressing.POINTER
    if name in OPAQUE_MEMORY:
        return Addressing.OPAQUE
    platform = sys.platform if platform is None else platform
    if vendor_id == AMD_VENDOR_ID and platform.startswith("linux"):
        return Addressing.POINTER
    return Addressing.OPAQUE
