"""Host-accessible decode inputs for real: OrtValues shared with numpy whose in-place CPU writes reach a
real session without rebinding; device tensors; prefix bindings; the fallback path."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from ep import host_memory, providers
from ep.device import DeviceRecord, SelectedDevice, select_device
from ep.names import DeviceNotFoundError

GENAI = {"model": {"type": "llama", "decoder": {}}, "search": {"max_length": 64}}


def _run_twice_without_rebinding(session: ort.InferenceSession, buf: host_memory.HostBuffer) -> None:
    """Write, run, write again in place, run again with the same binding: both runs see the CPU's values."""
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", buf.ortvalue)
    binding.bind_output("y", "cpu")
    for step in range(2):
        values = np.arange(buf.array.size, dtype=buf.array.dtype).reshape(buf.array.shape) * (step + 3)
        buf.array[...] = values  # in place: never rebind buf.array
        session.run_with_iobinding(binding)
        np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], values + 1)


def _cpu_selected() -> SelectedDevice:
    return select_device("cpu")


@pytest.fixture(scope="module")
def openvino_cpu() -> SelectedDevice:
    """The OpenVINO plugin EP's CPU device (onnxruntime-ep-openvino, a test dependency)."""
    try:
        return select_device("openvino")
    except DeviceNotFoundError as e:
        # The plugin creates devices only for Intel hardware (PCI vendor 0x8086): an AMD CPU gets none.
        pytest.skip(f"no OpenVINO EP device on this machine: {e}")


def test_openvino_host_accessible_memory_is_shared_and_reaches_the_session(openvino_cpu, add_model) -> None:
    assert openvino_cpu.has_host_accessible
    assert openvino_cpu.host_accessible_memory.name == "OpenVINO_shared_CPU"
    buf = host_memory.alloc_host_accessible((1, 8), np.int64, openvino_cpu)
    assert buf is not None and buf.source == host_memory.SOURCE_EP
    assert buf.array.ctypes.data == buf.ortvalue.data_ptr()
    assert buf.device_id == openvino_cpu.device_id
    so = providers.make_session_options(openvino_cpu, GENAI)
    session = providers.create_session(add_model, openvino_cpu, so)
    _run_twice_without_rebinding(session, buf)


@pytest.fixture(scope="module")
def cpu_host_accessible_stands_in_for_openvino() -> SelectedDevice:
    """A device whose HOST_ACCESSIBLE memory info is a CPU one with an environment-registered allocator.

    It exercises the same ORT path as a plugin EP's host-accessible memory (ortvalue_from_shape_and_type
    with memory_info=, served by the environment's shared allocator for that memory info).
    """
    mem = ort.OrtMemoryInfo.create_v2("Cpu", ort.OrtMemoryInfoDeviceType.CPU, 0, 0,
                                      ort.OrtDeviceMemoryType.HOST_ACCESSIBLE, 0,
                                      ort.OrtAllocatorType.ORT_DEVICE_ALLOCATOR)
    ort.create_and_register_allocator(mem, None)
    record = DeviceRecord(index=0, ep_name="CPUExecutionProvider", host_accessible_device_id=0,
                          host_accessible_memory_name=mem.name)
    return SelectedDevice("cpu", "CPUExecutionProvider", None, 0, None, mem, record)


def test_host_accessible_buffer_shares_memory_stands_in_for_openvino(
        cpu_host_accessible_stands_in_for_openvino, add_model) -> None:
    selected = cpu_host_accessible_stands_in_for_openvino
    buf = host_memory.alloc_host_accessible((2, 5), np.int64, selected)
    assert buf is not None and buf.source == host_memory.SOURCE_EP and buf.device_id == 0
    assert buf.array.shape == (2, 5) and buf.array.dtype == np.int64
    assert buf.array.ctypes.data == buf.ortvalue.data_ptr()
    session = providers.create_session(add_model, _cpu_selected(), ort.SessionOptions())
    _run_twice_without_rebinding(session, buf)


def test_plain_cpu_offers_no_host_accessible_memory() -> None:
    assert host_memory.alloc_host_accessible((1, 1), np.int64, _cpu_selected()) is None


def test_cpu_fallback_buffer_is_shared_too(add_model) -> None:
    selected = _cpu_selected()
    buf = host_memory.alloc_cpu((1, 4), np.int64, selected.device_id)
    assert buf.source == host_memory.SOURCE_CPU and buf.array.ctypes.data == buf.ortvalue.data_ptr()
    session = providers.create_session(add_model, selected, ort.SessionOptions())
    _run_twice_without_rebinding(session, buf)


def test_bind_prefix_reads_the_first_elements(add_model) -> None:
    selected = _cpu_selected()
    session = providers.create_session(add_model, selected, ort.SessionOptions())
    buf = host_memory.alloc_cpu((4, 6), np.int64)
    binding = session.io_binding()
    binding.bind_output("y", "cpu")
    view = host_memory.bind_prefix(binding, "x", buf, (2, 6))
    view[...] = np.arange(12).reshape(2, 6)
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], np.arange(12).reshape(2, 6) + 1)
    np.testing.assert_array_equal(buf.array[:2], np.arange(12).reshape(2, 6))  # the view is the buffer
    view[...] = 7
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], np.full((2, 6), 8))
    full = host_memory.bind_prefix(binding, "x", buf, (4, 6))
    assert full.shape == (4, 6)
    # NOTE: a device-only output binding keeps the first run's tensor: rebind it when the shape changes.
    binding.bind_output("y", "cpu")
    session.run_with_iobinding(binding)
    assert binding.copy_outputs_to_cpu()[0].shape == (4, 6)
    with pytest.raises(ValueError, match="needs 30 elements"):
        host_memory.prefix_view(buf, (5, 6))


def test_alloc_device_on_cpu_is_numpy_backed_and_binds(add_model) -> None:
    selected = _cpu_selected()
    value = host_memory.alloc_device((2, 3), np.int64, selected, zero=True)
    assert value.device_name().lower() == "cpu" and value.shape() == [2, 3]
    np.testing.assert_array_equal(value.numpy(), np.zeros((2, 3), np.int64))
    session = providers.create_session(add_model, selected, ort.SessionOptions())
    out = host_memory.alloc_device((2, 3), np.int64, selected)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", value)
    binding.bind_ortvalue_output("y", out)
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(out.numpy(), np.ones((2, 3), np.int64))
