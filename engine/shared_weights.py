"""One device copy of a decoder's weights, handed to every session the engine opens of that decoder.

Imports onnx, numpy and onnxruntime; ep/ lazily (device memory), as the sessions do. Never server/.

Where decode steps are captured on a pointer device (CUDA; HIP) the engine opens the decoder up to three times:
the captured decode graph, the same graph without the fused INT4 kernels for one-row steps, and the plain graph
for prompt chunks (``engine.placement``). Each session would load its own device copy of every initializer: on an
H100 the Llama-3.1-8B shape planned 38.4 GiB and used 55.7, and the Qwen2.5-32B shape did not fit 80 GB.

ONNX Runtime uses an initializer given with ``SessionOptions.add_initializer`` in place when it lives on the device
the session plans it for (``session_state_utils.SaveInitializedTensors``), and the value must not own its buffer.
So each large initializer is copied once into the device's DEFAULT memory, wrapped once more through DLPack (a
tensor over the same memory that owns nothing), and added to every session's options. A fused kernel's prepacked
layout stays its session's own.

Whether a device takes the values in place is not assumed: a one-node probe session is made with a shared weight,
the weight is changed, and the probe must see the change (an EP that compiles the graph with its weights into a
program of its own would not; then nothing is shared and each session loads its own, as before).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engine.context_length import GIB

log = logging.getLogger(__name__)

# NOTE(engine): smaller initializers (norm weights, shape constants, which ORT may plan on the CPU) stay each
# session's own: a few MiB at most, and a shared value planned elsewhere would only be copied again.
SHARE_MIN_BYTES = 1 << 20


@dataclass
class SharedWeights:
    """Device values of a decoder's large initializers, by name; ``add_to`` hands them to a session's options.

    The device memory under a value lives while this object or any session made with it does (the DLPack view
    keeps its owner alive), so the object may go once the sessions are made.
    """

    values: dict[str, ort.OrtValue]
    nbytes: int
    where: str  # the memory they live in, for logs
    owners: dict[str, Any] = field(default_factory=dict, repr=False)  # what owns each value's memory

    def add_to(self, options: ort.SessionOptions) -> None:
        """Give every shared initializer to a session about to be made (a name its graph lacks is ignored)."""
        for name, value in self.values.items():
            options.add_initializer(name, value)

    def describe(self) -> str:
        return f"{len(self.values)} initializers, {self.nbytes / GIB:.2f} GiB, one copy in {self.where}"


def load_shared_weights(model_file: Path, selected: Any, *, min_bytes: int | None = None) -> SharedWeights:
    """Copy ``model_file``'s initializers of ``min_bytes`` or more once into ``selected``'s DEFAULT memory.

    Args:
        model_file: the decoder's ONNX file; external data is read through a memory map, one tensor at a time.
        selected: the ``ep.device.SelectedDevice`` (None: the plain CPU session, whose values are host arrays: the
            stand-in tests run the same path there).
        min_bytes: the smallest initializer shared (None: ``SHARE_MIN_BYTES``).
    Returns:
        The shared weights (ask ``probe_sharing`` first whether the device uses them in place).
    """
    import onnx

    min_bytes = SHARE_MIN_BYTES if min_bytes is None else min_bytes
    start = time.perf_counter()
    proto = onnx.load(str(model_file), load_external_data=False)
    values: dict[str, ort.OrtValue] = {}
    owners: dict[str, Any] = {}
    total = 0
    maps: dict[str, np.memmap] = {}
    for tensor in proto.graph.initializer:
        array = _host_array(tensor, model_file.parent, maps)
        if array is None or array.nbytes < min_bytes:
            continue
        value, owner = _device_value(array, selected)
        values[tensor.name] = value
        owners[tensor.name] = owner
        total += array.nbytes
    where = "host memory" if selected is None else f"{selected.ep_name} memory {selected.default_memory.name}"
    shared = SharedWeights(values, total, where, owners)
    log.info("shared weights: %s (%.1f s)", shared.describe(), time.perf_counter() - start)
    return shared


def _host_array(tensor: Any, folder: Path, maps: dict[str, np.memmap]) -> np.ndarray | None:
    """The initializer's data as a host array: a view of its external data file's memory map, or its inline bytes
    (None: a type numpy cannot hold, or no data)."""
    from onnx import TensorProto, helper, numpy_helper

    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    except (KeyError, TypeError, ValueError):
        return None
    if dtype.kind not in "fiub" or tensor.data_type in (TensorProto.STRING, TensorProto.BFLOAT16):
        return None
    shape = tuple(int(d) for d in tensor.dims)
    if tensor.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor) if tensor.ByteSize() >= 1024 else None
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = info.get("location")
    if not location:
        return None
    if location not in maps:
        maps[location] = np.memmap(folder / location, dtype=np.uint8, mode="r")
    offset = int(info.get("offset", 0))
    length = int(info.get("length", int(np.prod(shape, dtype=np.int64)) * dtype.itemsize))
    return maps[location][offset:offset + length].view(dtype).reshape(shape)


def _device_value(array: np.ndarray, selected: Any) -> tuple[ort.OrtValue, Any]:
    """(a value over device memory holding ``array`` that owns nothing, the owner of that memory).

    NOTE(engine): ORT refuses a shared initializer whose tensor owns its buffer, and a session keeps only the
    C++ value, never the Python object that held the memory; a value made from a DLPack capsule owns no buffer and
    keeps the capsule's owner alive for as long as any session holds it.
    """
    from onnxruntime.capi import _pybind_state as C

    if selected is None:  # host memory (the stand-in): a numpy array of its own
        host = np.array(array, order="C")  # (a copy: the memory map is read-only)
        return ort.OrtValue(C.OrtValue.from_dlpack(host.__dlpack__(), False)), host
    from ep import host_memory

    owner = host_memory.alloc_device(array.shape, array.dtype, selected)
    host_memory.upload(array, owner, selected)
    return ort.OrtValue(C.OrtValue.from_dlpack(owner._ortvalue.to_dlpack(), False)), owner


def probe_sharing(selected: Any) -> str:
    """Why ``selected`` would not use a shared initializer in place ("" where it does, logged either way): a
    session of one MatMul with a shared weight runs before and after the weight changes and must see the change."""
    reason = _probe(selected)
    where = "the plain CPU session" if selected is None else selected.ep_name
    if reason:
        log.info("weights not shared between the decoder's sessions on %s: %s", where, reason)
    else:
        log.info("%s uses shared initializers in place: the decoder's sessions take one copy", where)
    return reason


def _probe(selected: Any) -> str:
    from onnx import TensorProto, helper, numpy_helper

    weight = np.arange(8, dtype=np.float32).reshape(2, 4)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "ortserve_share_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()
    x = np.ones((1, 2), np.float32)
    try:
        value, owner = _device_value(weight * 2, selected)
        options = _probe_options(selected)
        options.add_initializer("w", value)
        session = _probe_session(model, options, selected)
        first = session.run(None, {"x": x})[0]
        _write(owner, weight * 3, selected)
        second = session.run(None, {"x": x})[0]
    except Exception as exc:  # noqa: BLE001 - ORT raises several pybind classes; then nothing is shared
        return f"{type(exc).__name__}: {exc}"
    expected = x @ weight
    if not np.allclose(first, 2 * expected):
        return "the probe session did not read the shared weight"
    if not np.allclose(second, 3 * expected):
        return "the probe session holds its own copy of the weight (the EP copies initializers)"
    return ""


def _probe_options(selected: Any) -> ort.SessionOptions:
    if selected is None:
        options = ort.SessionOptions()
    else:
        from ep import providers as ep_providers

        options = ep_providers.make_session_options(selected, {}, intra_op_threads=1)
    options.add_session_config_entry("session.disable_prepacking", "1")  # (a CPU kernel would pack its own copy)
    options.log_severity_level = 3
    return options


def _probe_session(model: bytes, options: ort.SessionOptions, selected: Any) -> ort.InferenceSession:
    if selected is None:
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    from ep import providers as ep_providers

    return ep_providers.create_session(model, selected, options)


def _write(owner: Any, array: np.ndarray, selected: Any) -> None:
    if selected is None:
        owner[...] = array
        return
    from ep import host_memory

    host_memory.upload(array, owner, selected)
