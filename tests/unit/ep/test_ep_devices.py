"""--device selectors, the auto order and the device inventory: ORT's real device list on this CPU machine,
and hand-built records where an AMD device cannot exist here (tests say "stands_in_for_amd")."""

from __future__ import annotations

import pytest

from ep import device
from ep.device import DeviceRecord, Selector, choose, parse_selector
from ep.names import DeviceNotFoundError, EpLibraryError, EpOptionError, UnknownProviderError


def _amd_gpu(index: int, device_id: int, pci: str, mem_id: int, host: bool = True) -> DeviceRecord:
    return DeviceRecord(
        index=index, ep_name="AMDGPUExecutionProvider", ep_vendor="AMD", device_type="GPU", vendor="AMD",
        vendor_id=0x1002, device_id=device_id, pci_bus_id=pci, default_memory_device_id=mem_id,
        default_memory_name="AMDGPU", host_accessible_device_id=mem_id if host else None,
        host_accessible_memory_name="AMDGPU_HOST_ACCESSIBLE" if host else None)


def _other(ep_name: str, device_type: str = "GPU", vendor_id: int = 0x10DE) -> DeviceRecord:
    return DeviceRecord(index=0, ep_name=ep_name, device_type=device_type, vendor_id=vendor_id, device_id=0x2335,
                        default_memory_device_id=0, default_memory_name=ep_name)


@pytest.fixture(scope="module")
def cpu_record() -> DeviceRecord:
    """The CPU EP device exactly as ORT reports it on this machine."""
    records = device.list_devices("cpu")
    cpu = [r for r in records if r.ep_name == "CPUExecutionProvider"]
    assert len(cpu) == 1
    return cpu[0]


@pytest.fixture
def two_amd_gpus_stands_in_for_amd(cpu_record: DeviceRecord) -> list[DeviceRecord]:
    return [cpu_record, _amd_gpu(0, 0x744C, "0000:03:00.0", mem_id=0), _amd_gpu(1, 0x7480, "0000:c3:00.0", mem_id=1)]


@pytest.mark.parametrize(("text", "expected"), [
    ("0", Selector("0", index=0)),
    ("12", Selector("12", index=12)),
    ("0000:03:00.0", Selector("0000:03:00.0", pci_bus_id="0000:03:00.0")),
    ("03:00.0", Selector("03:00.0", pci_bus_id="0000:03:00.0")),
    ("0000:C3:00.1", Selector("0000:C3:00.1", pci_bus_id="0000:c3:00.1")),
    ("1002:744c", Selector("1002:744c", vendor_id=0x1002, device_id=0x744C)),
    ("0x1002:0x744C", Selector("0x1002:0x744C", vendor_id=0x1002, device_id=0x744C)),
])
def test_parse_selector(text: str, expected: Selector) -> None:
    assert parse_selector(text) == expected


@pytest.mark.parametrize("text", [None, "", "  "])
def test_no_selector(text: str | None) -> None:
    assert parse_selector(text) is None


@pytest.mark.parametrize("text", ["gpu0", "-1", "1002:744c:1", "zz:00.0", "0000:03:00.9"])
def test_malformed_selector_is_a_clear_error(text: str) -> None:
    with pytest.raises(EpOptionError) as info:
        parse_selector(text)
    assert repr(text) in str(info.value) and "PCI bus id" in str(info.value)


def test_auto_prefers_amdgpu_stands_in_for_amd(two_amd_gpus_stands_in_for_amd) -> None:
    picked = choose(two_amd_gpus_stands_in_for_amd, "auto", None)
    assert picked.ep_name == "AMDGPUExecutionProvider" and picked.index == 0


@pytest.mark.parametrize("text", ["1", "0000:c3:00.0", "c3:00.0", "1002:7480"])
def test_selectors_pick_the_second_gpu_stands_in_for_amd(two_amd_gpus_stands_in_for_amd, text: str) -> None:
    for provider in ("amdgpu", "auto"):
        picked = choose(two_amd_gpus_stands_in_for_amd, provider, parse_selector(text))
        assert picked.device_id == 0x7480 and picked.default_memory_device_id == 1


def test_index_out_of_range_lists_the_devices_stands_in_for_amd(two_amd_gpus_stands_in_for_amd) -> None:
    with pytest.raises(DeviceNotFoundError) as info:
        choose(two_amd_gpus_stands_in_for_amd, "amdgpu", parse_selector("2"))
    message = str(info.value)
    assert "--device '2'" in message
    assert "[0] AMDGPUExecutionProvider: GPU AMD 1002:744c pci=0000:03:00.0" in message
    assert "[1] AMDGPUExecutionProvider: GPU AMD 1002:7480 pci=0000:c3:00.0" in message
    assert "CPUExecutionProvider" in message


@pytest.mark.parametrize(("eps", "expected"), [
    (["CUDAExecutionProvider", "WebGpuExecutionProvider", "MIGraphXExecutionProvider"], "MIGraphXExecutionProvider"),
    (["CUDAExecutionProvider", "WebGpuExecutionProvider"], "CUDAExecutionProvider"),
    (["WebGpuExecutionProvider", "OpenVINOExecutionProvider"], "WebGpuExecutionProvider"),
    (["CUDAExecutionProvider", "OpenVINOExecutionProvider"], "CUDAExecutionProvider"),
    (["OpenVINOExecutionProvider", "QNNExecutionProvider"], "CPUExecutionProvider"),
])
def test_auto_order(cpu_record: DeviceRecord, eps: list[str], expected: str) -> None:
    records = [cpu_record] + [_other(name) for name in eps]
    assert choose(records, "auto", None).ep_name == expected


def test_named_provider_without_devices_says_so(cpu_record: DeviceRecord) -> None:
    with pytest.raises(DeviceNotFoundError) as info:
        choose([cpu_record], "webgpu", None)
    assert "no WebGpuExecutionProvider device" in str(info.value)
    assert "[0] CPUExecutionProvider" in str(info.value)


def test_failed_library_is_named_in_the_error(cpu_record: DeviceRecord) -> None:
    lib = device.EpLibrary("amdgpu", "/opt/ep/libamdgpu-ep.so", "AMDGPU_EP_PATH", registered=False,
                           error="no such file")
    with pytest.raises(DeviceNotFoundError) as info:
        choose([cpu_record], "amdgpu", None, [lib])
    assert "/opt/ep/libamdgpu-ep.so from AMDGPU_EP_PATH failed: no such file" in str(info.value)


def test_openvino_meta_devices_count_as_openvino(cpu_record: DeviceRecord) -> None:
    meta = DeviceRecord(index=0, ep_name="OpenVINOExecutionProvider.AUTO", vendor_id=0x8086)
    assert choose([cpu_record, meta], "openvino", None).ep_name == "OpenVINOExecutionProvider.AUTO"
    plain = DeviceRecord(index=0, ep_name="OpenVINOExecutionProvider", vendor_id=0x8086)
    assert choose([cpu_record, meta, plain], "openvino", None) is plain


def test_record_serializes_stands_in_for_amd() -> None:
    data = _amd_gpu(1, 0x7480, "0000:c3:00.0", mem_id=1).to_dict()
    assert data["provider"] == "amdgpu" and data["vendor_id"] == "1002" and data["device_id"] == "7480"
    assert data["default_memory"] == {"name": "AMDGPU", "device_id": 1}
    assert data["host_accessible"] is True


# --- the real inventory and selection on this machine ------------------------------------------------------


def test_real_cpu_record_has_no_memory_infos(cpu_record: DeviceRecord) -> None:
    assert cpu_record.device_type == "CPU" and cpu_record.index == 0
    assert cpu_record.default_memory_name is None and not cpu_record.host_accessible


@pytest.mark.parametrize("provider", ["cpu", "CPU", "CPUExecutionProvider"])
def test_select_cpu(provider: str) -> None:
    selected = device.select_device(provider, "0")
    assert selected.provider == "cpu" and selected.ep_device is None and selected.is_cpu_ep
    assert selected.device_id == 0 and selected.default_memory is None and not selected.has_host_accessible


def test_select_auto_matches_choose_over_the_real_list() -> None:
    selected = device.select_device("auto")
    records = device.list_devices("auto")
    assert selected.record == choose(records, "auto", None)


def test_select_cpu_index_out_of_range() -> None:
    with pytest.raises(DeviceNotFoundError) as info:
        device.select_device("cpu", "3")
    assert "[0] CPUExecutionProvider: CPU" in str(info.value)


def test_unknown_provider_at_selection() -> None:
    with pytest.raises(UnknownProviderError):
        device.select_device("tpu")


def test_missing_ep_library_names_the_path(tmp_path) -> None:
    missing = tmp_path / "libamdgpu-ep.so"
    with pytest.raises(EpLibraryError) as info:
        device.select_device("amdgpu", None, str(missing))
    assert str(missing) in str(info.value) and "no such file" in str(info.value)


def test_a_library_that_is_not_an_ep_says_why(backend_named_library) -> None:
    lib = backend_named_library("libamdgpu-ep.so")
    with pytest.raises(EpLibraryError) as info:
        device.select_device("amdgpu", None, str(lib))
    assert str(lib) in str(info.value) and "CreateEpFactories" in str(info.value)


def test_amdgpu_ep_path_that_is_missing_is_reported(tmp_path, monkeypatch) -> None:
    missing = str(tmp_path / "nowhere" / "libamdgpu-ep.so")
    monkeypatch.setenv("AMDGPU_EP_PATH", missing)
    with pytest.raises(DeviceNotFoundError) as info:
        device.select_device("amdgpu")
    assert f"{missing} from AMDGPU_EP_PATH failed: no such file" in str(info.value)


def test_describe_and_its_text(monkeypatch) -> None:
    monkeypatch.delenv("MIGRAPHX_ENABLE_INT4_GEMV", raising=False)  # describe() applies the flags
    info = device.describe("cpu", None, None, False)
    assert info["selected"]["ep_name"] == "CPUExecutionProvider" and info["error"] is None
    assert any(d["ep_name"] == "CPUExecutionProvider" for d in info["devices"])
    text = device.format_description(info)
    assert "would use: CPUExecutionProvider [0]" in text and "MIGRAPHX_ENABLE_INT4_GEMV" in text


def test_describe_reports_a_missing_device_instead_of_raising(monkeypatch) -> None:
    monkeypatch.delenv("MIGRAPHX_ENABLE_INT4_GEMV", raising=False)
    info = device.describe("webgpu", None, None, None)
    if any(d["provider"] == "webgpu" for d in info["devices"]):
        pytest.skip("this machine has a WebGPU device")
    assert info["selected"] is None and "no WebGpuExecutionProvider device" in info["error"]
    assert "would use: nothing" in device.format_description(info)


def test_an_nvidia_gpu_without_its_driver_reports_no_memory(tmp_path) -> None:
    """NVIDIA's memory comes from NVML by the PCI bus id (no sysfs file); without the driver (CI, this machine) the
    check gets None ("unknown"), never an error. tests/integration/ep/test_cuda_engine.py reads a real one."""
    import ctypes.util

    from ep.device import DeviceRecord, nvml_memory_bytes

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("an NVIDIA driver is here: the device test reads its memory")
    record = DeviceRecord(index=0, ep_name="CUDAExecutionProvider", device_type="GPU", vendor_id=0x10DE,
                          pci_bus_id="0000:00:06.0")
    assert nvml_memory_bytes("0000:00:06.0") is None
    assert record.memory_bytes(sysfs=tmp_path) is None
