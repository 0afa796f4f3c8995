"""The WebGPU plugin EP through ep/ on a real GPU: discovery, selection, device memory, IOBinding, graph capture.

Runs on the device machine only (ORTSERVE_DEVICE_TESTS=1, onnxruntime-ep-webgpu installed, a Vulkan GPU);
skipped elsewhere. Every check also lands in webgpu_findings.json under $OUT (or the test's tmp dir).
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from ep import device, host_memory, providers
from ep.device import SelectedDevice
from ep.names import DeviceNotFoundError

pytestmark = pytest.mark.device
GENAI = {"model": {"type": "llama", "decoder": {}}, "search": {"max_length": 64}}


@pytest.fixture(scope="module")
def findings(tmp_path_factory: pytest.TempPathFactory):
    data: dict = {"onnxruntime": ort.__version__}
    yield data
    out = Path(os.environ.get("OUT") or tmp_path_factory.mktemp("webgpu"))
    (out / "webgpu_findings.json").write_text(json.dumps(data, indent=2, default=str))


@pytest.fixture(scope="module")
def webgpu(findings) -> SelectedDevice:
    try:
        selected = device.select_device("webgpu")
    except DeviceNotFoundError as e:
        findings["select_error"] = str(e)
        pytest.skip(f"no WebGPU EP device here: {e}")
    findings["selected"] = {"record": selected.record.to_dict(), "device_id": selected.device_id,
                            "default_memory": _mem(selected.default_memory),
                            "host_accessible_memory": _mem(selected.host_accessible_memory)}
    return selected


def _mem(mem: ort.OrtMemoryInfo | None) -> dict | None:
    if mem is None:
        return None
    return {"name": mem.name, "device_id": mem.device_id, "device_mem_type": str(mem.device_mem_type),
            "vendor_id": mem.device_vendor_id, "mem_type": str(mem.mem_type),
            "allocator_type": str(mem.allocator_type)}


def _attempt(findings: dict, key: str, fn):
    """Run one check; record its result or its error under `key`; re-raise so the test fails."""
    try:
        result = fn()
        findings[key] = {"ok": True, "result": result}
        return result
    except Exception as e:
        findings[key] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        raise


def _to_device(value: np.ndarray, target: ort.OrtValue) -> None:
    if target.device_name().lower() == "cpu":  # ORT has no CPU->CPU data transfer for copy_tensors
        target.update_inplace(np.ascontiguousarray(value))
        return
    ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value))], [target])


def _to_cpu(source: ort.OrtValue) -> np.ndarray:
    if source.device_name().lower() == "cpu":
        return source.numpy().copy()
    shape = source.shape()
    dst = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=_np_type(source)))
    ort.copy_tensors([source], [dst])
    return dst.numpy()


def _np_type(value: ort.OrtValue):
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
            "tensor(int32)": np.int32}[value.data_type()]


def test_describe_and_auto_pick_webgpu(webgpu, findings) -> None:
    info = device.describe("auto", None, None, None)
    findings["describe"] = info
    findings["describe_text"] = device.format_description(info)
    auto = device.select_device("auto")
    findings["auto_pick"] = auto.ep_name
    assert auto.ep_name == "WebGpuExecutionProvider"
    by_ids = device.select_device("webgpu", f"{webgpu.record.vendor_id:04x}:{webgpu.record.device_id:04x}")
    assert by_ids.record == webgpu.record
    if webgpu.record.pci_bus_id:
        assert device.select_device("webgpu", webgpu.record.pci_bus_id).record == webgpu.record
    with pytest.raises(DeviceNotFoundError):
        device.select_device("webgpu", "7")


def test_device_memory_and_zero_fill(webgpu, findings) -> None:
    def check():
        kv = host_memory.alloc_device((1, 3, 64, 64), np.float16, webgpu, zero=True)
        first, later = _snapshot_readback(kv, np.float16)
        return {"device_name": kv.device_name(), "shape": kv.shape(), "data_type": kv.data_type(),
                "zeroed_immediate": bool((first == 0).all()), "zeroed_after_sleep": bool((later == 0).all()),
                "nonzero_after_sleep": int((later != 0).sum())}
    result = _attempt(findings, "alloc_device_shared_allocator", check)
    assert result["device_name"] == "webgpu" and result["shape"] == [1, 3, 64, 64]


def test_host_accessible_on_webgpu(webgpu, findings) -> None:
    buf = host_memory.alloc_host_accessible((1, 1), np.int64, webgpu)
    findings["host_accessible"] = None if buf is None else {"source": buf.source, "device": buf.ortvalue.device_name()}


def _session(selected: SelectedDevice, model: Path, capture: bool = False) -> ort.InferenceSession:
    so = providers.make_session_options(selected, GENAI, graph_capture=capture)
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    return providers.create_session(model, selected, so)


def _assignment(session: ort.InferenceSession) -> list:
    return [{"ep": sg.ep_name, "nodes": [n.op_type for n in sg.get_nodes()]}
            for sg in session.get_provider_graph_assignment_info()]


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.INT64])
def test_iobinding_device_input_cpu_output(webgpu, findings, tmp_path, make_add_model, elem) -> None:
    """The runner's pattern: KV-like device tensors in, logits bound to CPU memory out."""
    key = f"iobinding_{TensorProto.DataType.Name(elem).lower()}"
    np_type = np.float32 if elem == TensorProto.FLOAT else np.int64

    def check():
        session = _session(webgpu, make_add_model(tmp_path / "add.onnx", elem))
        x = np.arange(8, dtype=np_type).reshape(1, 8)
        plain = session.run(None, {"x": x})[0]
        dev_in = host_memory.alloc_device((1, 8), np_type, webgpu)
        _to_device(x, dev_in)
        binding = session.io_binding()
        binding.bind_ortvalue_input("x", dev_in)
        binding.bind_output("y", "cpu")
        session.run_with_iobinding(binding)
        cpu_out = binding.copy_outputs_to_cpu()[0]
        dev_out = host_memory.alloc_device((1, 8), np_type, webgpu)
        binding2 = session.io_binding()
        binding2.bind_ortvalue_input("x", dev_in)
        binding2.bind_ortvalue_output("y", dev_out)
        session.run_with_iobinding(binding2)
        via_copy = _to_cpu(dev_out)
        # Same buffer as input and output (how past/present share the KV buffer): runs accumulate?
        binding3 = session.io_binding()
        binding3.bind_ortvalue_input("x", dev_in)
        binding3.bind_ortvalue_output("y", dev_in)
        session.run_with_iobinding(binding3)
        session.run_with_iobinding(binding3)
        aliased = _to_cpu(dev_in)
        return {"providers": session.get_providers(), "assignment": _assignment(session),
                "plain_ok": bool(np.array_equal(plain, x + 1)), "cpu_output_ok": bool(np.array_equal(cpu_out, x + 1)),
                "device_output_ok": bool(np.array_equal(via_copy, x + 1)),
                "aliased_in_out_after_2_runs": aliased.tolist(), "aliased_ok": bool(np.array_equal(aliased, x + 2))}

    result = _attempt(findings, key, check)
    assert result["plain_ok"] and result["cpu_output_ok"] and result["device_output_ok"]


def test_session_allocator_path(webgpu, findings, tmp_path, make_add_model) -> None:
    def check():
        session = _session(webgpu, make_add_model(tmp_path / "add.onnx", TensorProto.FLOAT))
        value = session.create_ortvalue_from_shape_and_type([1, 8], np.float32, "webgpu", webgpu.device_id)
        return {"device_name": value.device_name(), "is_webgpu_buffer": bool(value._is_webgpu_buffer)}
    _attempt(findings, "session_allocator", check)


def test_graph_capture_replays_with_updated_inputs(webgpu, findings, tmp_path, make_add_model) -> None:
    """Fixed shapes, every binding a WebGPU value, inputs updated in place between replays."""
    def check():
        model = make_add_model(tmp_path / "add_fixed.onnx", TensorProto.FLOAT, shape=[1, 8])
        session = _session(webgpu, model, capture=True)
        dev_in = host_memory.alloc_device((1, 8), np.float32, webgpu)
        dev_out = host_memory.alloc_device((1, 8), np.float32, webgpu)
        binding = session.io_binding()
        binding.bind_ortvalue_input("x", dev_in)
        binding.bind_ortvalue_output("y", dev_out)
        results = []
        for step in range(4):
            x = np.full((1, 8), float(step), dtype=np.float32)
            _to_device(x, dev_in)
            session.run_with_iobinding(binding)
            results.append(bool(np.array_equal(_to_cpu(dev_out), x + 1)))
        return {"capture_enabled": bool(session._sess.is_webgpu_graph_capture_enabled()),
                "replays_ok": results, "assignment": _assignment(session)}

    result = _attempt(findings, "graph_capture", check)
    assert all(result["replays_ok"])


def _snapshot_readback(source: ort.OrtValue, np_type) -> tuple[np.ndarray, np.ndarray]:
    """copy_tensors device -> CPU; returns (a copy taken right after the call, a copy taken 0.2 s later)."""
    import time

    dst_array = np.zeros(source.shape(), dtype=np_type)
    ort.copy_tensors([source], [ort.OrtValue.ortvalue_from_numpy(dst_array)])
    first = dst_array.copy()
    time.sleep(0.2)
    return first, dst_array.copy()


def test_copy_semantics(webgpu, findings, tmp_path, make_add_model) -> None:
    """When do copy_tensors uploads/readbacks land on WebGPU? Observations only, plus the decode-loop pattern."""
    import gc
    import time

    obs: dict = {}
    n = 4096
    a = host_memory.alloc_device((n,), np.float32, webgpu)
    first, later = _snapshot_readback(a, np.float32)
    obs["fresh_buffer"] = {"immediate_all_zero": bool((first == 0).all()), "later_all_zero": bool((later == 0).all()),
                           "later_nonzero_count": int((later != 0).sum())}
    src = np.arange(n, dtype=np.float32)
    ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(src)], [a])
    first, later = _snapshot_readback(a, np.float32)
    obs["upload_then_readback"] = {"immediate_ok": bool(np.array_equal(first, src)),
                                   "after_sleep_ok": bool(np.array_equal(later, src))}
    src2 = np.full(n, 5.0, dtype=np.float32)
    ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(src2)], [a])
    src2[:] = 9.0  # mutate the source right after the call: was the data taken at call time?
    time.sleep(0.2)
    _, later = _snapshot_readback(a, np.float32)
    obs["source_mutated_after_upload"] = {"device_has": sorted(set(later.tolist()))[:4]}
    ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(np.full(n, 3.0, dtype=np.float32))], [a])
    garbage = [np.full(n, 7.0, dtype=np.float32) for _ in range(64)]  # reuse the freed temporary's memory
    gc.collect()
    time.sleep(0.2)
    _, later = _snapshot_readback(a, np.float32)
    obs["temporary_source_freed"] = {"device_has": sorted(set(later.tolist()))[:4]}
    del garbage
    try:
        a.update_inplace(np.full(n, 11.0, dtype=np.float32))
        _, later = _snapshot_readback(a, np.float32)
        obs["update_inplace_numpy"] = {"ok": bool((later == 11.0).all())}
    except Exception as e:  # noqa: BLE001
        obs["update_inplace_numpy"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        stream = webgpu.ep_device.create_sync_stream()
        ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(src)], [a], stream)
        obs["copy_with_sync_stream"] = {"accepted": True, "handle": repr(stream.get_handle())}
    except Exception as e:  # noqa: BLE001
        obs["copy_with_sync_stream"] = {"error": f"{type(e).__name__}: {e}"}

    # The decode-loop pattern: upload the step's input with copy_tensors, run, logits bound to CPU memory.
    model = make_add_model(tmp_path / "add_loop.onnx", TensorProto.FLOAT, shape=[1, 8])
    session = _session(webgpu, model)
    dev_in = host_memory.alloc_device((1, 8), np.float32, webgpu)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", dev_in)
    out = np.zeros((1, 8), dtype=np.float32)
    binding.bind_output("y", "cpu", 0, np.float32, [1, 8], out.ctypes.data)
    loop_ok = []
    t0 = time.perf_counter()
    for step in range(32):
        x = np.full((1, 8), float(step), dtype=np.float32)
        ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(x)], [dev_in])
        session.run_with_iobinding(binding)
        loop_ok.append(bool(np.array_equal(out, x + 1)))
    obs["decode_loop_cpu_output_buffer"] = {"all_ok": all(loop_ok), "ok": loop_ok,
                                            "ms_per_step": (time.perf_counter() - t0) * 1000 / 32}
    # Past/present aliasing with a synchronized readback (IOBinding's own copy).
    alias = session.io_binding()
    alias.bind_ortvalue_input("x", dev_in)
    alias.bind_ortvalue_output("y", dev_in)
    ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 8), np.float32))], [dev_in])
    for _ in range(3):
        session.run_with_iobinding(alias)
    via_binding = alias.copy_outputs_to_cpu()[0]
    first, later = _snapshot_readback(dev_in, np.float32)
    obs["aliased_3_runs"] = {"copy_outputs_to_cpu": via_binding.ravel().tolist()[:2],
                             "copy_tensors_immediate": first.ravel().tolist()[:2],
                             "copy_tensors_after_sleep": later.ravel().tolist()[:2]}
    findings["copy_semantics"] = obs
    assert obs["decode_loop_cpu_output_buffer"]["all_ok"]
