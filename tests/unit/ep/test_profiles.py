"""Device profiles (ep/profiles.py): what each family resolves for a device report like the one ep/ makes, without the
device (a fake SelectedDevice: provider, memory infos, addressing). The AMDGPU design is checked exactly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from engine.config import EngineConfig
from ep import profiles
from ep.addressing import Addressing
from ep.names import EP_NAMES

GENAI = {"model": {"type": "llama", "context_length": 8192,
                   "decoder": {"inputs": {"input_ids": "input_ids", "position_ids": "position_ids"},
                               "outputs": {"logits": "logits"}}},
         "search": {"max_length": 2048}}


@dataclass(frozen=True)
class Memory:
    name: str
    device_id: int = 0
    device_vendor_id: int = 0


@dataclass(frozen=True)
class Record:
    device_type: str = "GPU"


@dataclass(frozen=True)
class FakeDevice:
    """The fields of ep.device.SelectedDevice a profile reads."""

    provider: str
    kv_addressing: Addressing
    default_memory: Memory | None
    host_accessible_memory: Memory | None = None
    device_id: int = 0
    record: Record = field(default_factory=Record)

    @property
    def ep_name(self) -> str:
        return EP_NAMES[self.provider]


def _device(provider: str, memory: str | None, addressing: Addressing, host: bool = False, **kw: Any) -> FakeDevice:
    return FakeDevice(provider, addressing, Memory(memory, **kw) if memory else None,
                      Memory("HostAccessible", kw.get("device_id", 0)) if host else None,
                      device_id=kw.get("device_id", 0))


def _resolved(profile: profiles.DeviceProfile, **config: Any) -> dict[str, Any]:
    c = profile.resolve(EngineConfig(**config))
    return {"matmul_row_groups": c.matmul_row_groups, "device_row_summary": c.device_row_summary,
            "fixed_chunk_shapes": c.fixed_chunk_shapes, "batched_prompts": c.batched_prompts,
            "one_row_session": c.one_row_session}


def _session(profile: profiles.DeviceProfile, options: dict[str, str] | None = None,
             graph_capture: bool = False) -> profiles.SessionSetup:
    return profile.session_setup(dict(options or {}), GENAI, input_names=None, output_names=None,
                                 graph_capture=graph_capture)


def test_plain_cpu_session() -> None:
    profile = profiles.host_profile("CPU")
    assert isinstance(profile, profiles.CpuProfile) and profile.selected is None
    assert profiles.host_profile("cuda") is None and profiles.host_profile("auto") is None
    assert profile.kv_rows == "host" and profile.prefix_views and not profile.host_accessible_inputs
    assert not profile.engine_capture and profile.switch_interval_ms is None
    assert profiles.engine_process_default("cpu") is False
    assert _resolved(profile) == {"matmul_row_groups": 0, "device_row_summary": False, "fixed_chunk_shapes": False,
                                  "batched_prompts": False, "one_row_session": False}
    assert profiles.make_profile(None).selected is None


def test_cpu_ep_device_takes_host_accessible_inputs_only_where_offered() -> None:
    plain = profiles.make_profile(_device("cpu", None, Addressing.HOST))
    offered = profiles.make_profile(_device("cpu", None, Addressing.HOST, host=True))
    assert type(plain) is profiles.CpuProfile and plain.cpu_ep
    assert not plain.host_accessible_inputs and offered.host_accessible_inputs


@pytest.mark.parametrize("int4", [True, False])
def test_cuda(int4: bool) -> None:
    profile = profiles.make_profile(_device("cuda", "Cuda", Addressing.POINTER, host=True, device_id=1,
                                            device_vendor_id=0x10DE), lambda: int4)
    assert type(profile) is profiles.CudaProfile
    assert profile.kv_rows == "pointer" and profile.engine_capture and profile.host_accessible_inputs
    assert profile.memory_device() == ("gpu", 1, 0x10DE)
    assert profile.prompt_sdpa_kernel == profiles.PROMPT_SDPA_KERNEL and profile.prompt_shapes
    assert profile.switch_interval_ms == profiles.DEVICE_SWITCH_INTERVAL_MS
    assert _resolved(profile, max_batch=8) == {"matmul_row_groups": 0, "device_row_summary": True,
                                               "fixed_chunk_shapes": int4, "batched_prompts": True,
                                               "one_row_session": int4}
    # explicit settings win; one_row_session=True cannot force the split where the fused kernels are off
    assert _resolved(profile, fixed_chunk_shapes=not int4, batched_prompts=False, device_row_summary=False,
                     one_row_session=True) == {"matmul_row_groups": 0, "device_row_summary": False,
                                               "fixed_chunk_shapes": not int4, "batched_prompts": False,
                                               "one_row_session": int4}
    assert _resolved(profile, one_row_session=False)["one_row_session"] is False
    assert profiles.reads_flag("cuda", profiles.CUDA_INT4_GEMM_FLAG)
    assert not profiles.reads_flag("cuda", profiles.MIGRAPHX_INT4_GEMV_FLAG)
    assert _session(profile, graph_capture=True).options == {profiles.CUDA_GRAPH_OPTION: "1"}
    assert _session(profile).options == {}


@pytest.mark.parametrize("name", ["amdgpu", "AMDGPU", "AMDGPUExecutionProvider"])
def test_amdgpu_names_one_profile(name: str) -> None:
    assert profiles.profile_class(name) is profiles.AmdgpuProfile
    assert profiles.engine_process_default(name) is True


def test_amdgpu_design() -> None:
    """Pointer rows on Linux, device id from the DEFAULT memory, host-accessible decode inputs (hipHostMalloc as the
    fallback), the EP's HIP graphs, the session config keys exactly, MIGRAPHX_ENABLE_INT4_GEMV."""
    profile = profiles.make_profile(_device("amdgpu", "default", Addressing.POINTER, host=True, device_id=2,
                                            device_vendor_id=0x1002))
    assert isinstance(profile, profiles.HipProfile) and profile.hip_host_memory and profile.host_accessible_inputs
    assert profile.memory_device() == ("gpu", 2, 0x1002)
    assert not profile.engine_capture and profile.ep_graphs(GENAI)
    assert not profile.ep_graphs(GENAI, {"enable_graph_capture": "0"})
    setup = _session(profile, {"enable_graph_capture": "1"})
    assert setup.entries == {
        "ep.migraphx.static_pad_seq": "1", "ep.migraphx.static_pad_seq_len": "2048",
        "ep.migraphx.static_pad_inputs": "input_ids:1,position_ids:1", "ep.migraphx.static_pad_outputs": "logits:1",
        "ep.migraphx.hip_graph_enable": "1", "ep.directml.enable_host_accessible": "1"}
    assert setup.options == {"model_arch": "llama"}  # -> ep.amdgpuexecutionprovider.model_arch
    assert profiles.reads_flag("amdgpu", profiles.MIGRAPHX_INT4_GEMV_FLAG)
    assert not profiles.reads_flag("amdgpu", profiles.CUDA_INT4_GEMM_FLAG)
    assert _resolved(profile) == {"matmul_row_groups": 0, "device_row_summary": False, "fixed_chunk_shapes": False,
                                  "batched_prompts": False, "one_row_session": False}


def test_migraphx_is_the_hip_family_without_model_arch() -> None:
    profile = profiles.make_profile(_device("migraphx", "MIGraphX", Addressing.POINTER))
    assert type(profile) is profiles.HipProfile
    setup = _session(profile, {"enable_graph_capture": "0"})
    assert setup.entries["ep.migraphx.hip_graph_enable"] == "0" and setup.options == {}


def test_webgpu() -> None:
    profile = profiles.make_profile(_device("webgpu", "WebGPU_Buf", Addressing.OPAQUE, device_id=3))
    assert type(profile) is profiles.WebGpuProfile
    assert profile.kv_rows == "opaque" and profile.prefix_views and profile.engine_capture
    assert profile.memory_device() == ("webgpu", 3) and profile.device_type == "webgpu"
    assert _resolved(profile, max_batch=8) == {"matmul_row_groups": 2, "device_row_summary": False,
                                               "fixed_chunk_shapes": False, "batched_prompts": False,
                                               "one_row_session": False}
    assert _resolved(profile, max_batch=16)["matmul_row_groups"] == 0
    captured = _session(profile, graph_capture=True)
    assert captured.options == {"validationMode": "disabled", profiles.WEBGPU_GRAPH_CAPTURE_OPTION: "1"}
    assert not captured.mem_pattern
    plain = _session(profile, {profiles.WEBGPU_GRAPH_CAPTURE_OPTION: "1"})
    assert plain.options == {"validationMode": "disabled"} and plain.mem_pattern


def test_openvino_on_the_host() -> None:
    profile = profiles.make_profile(_device("openvino", None, Addressing.HOST, host=True))
    assert type(profile) is profiles.OpenVinoProfile
    assert profiles.engine_process_default("openvino") is False
    assert profile.kv_rows == "host" and profile.host_accessible_inputs and profile.switch_interval_ms is None
    assert not profile.engine_capture and not profile.ep_graphs(GENAI)


def test_generic_profile_for_a_family_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A known EP without a family gets the whole-buffer path's defaults: opaque unknown memory, no capture."""
    monkeypatch.delitem(profiles.FAMILIES, "openvino")
    profile = profiles.make_profile(_device("openvino", "openvino_gpu", Addressing.OPAQUE))
    assert type(profile) is profiles.DeviceProfile
    assert profile.kv_rows == "opaque" and not profile.prefix_views and not profile.engine_capture
    assert profile.engine_process and profile.switch_interval_ms == profiles.DEVICE_SWITCH_INTERVAL_MS
    assert _session(profile, graph_capture=True).note  # says capture is not wired here


def test_auto_is_decided_once_a_device_is_chosen() -> None:
    assert profiles.profile_class("auto") is None and profiles.engine_process_default("auto") is None
    assert profiles.may_read_flag("auto", profiles.MIGRAPHX_INT4_GEMV_FLAG)
    assert profiles.may_read_flag("auto", profiles.CUDA_INT4_GEMM_FLAG)
    assert not profiles.reads_flag("auto", profiles.CUDA_INT4_GEMM_FLAG)
    assert not profiles.may_read_flag("cpu", profiles.MIGRAPHX_INT4_GEMV_FLAG)


def test_step_budget_is_the_devices_unless_asked() -> None:
    """The engine step's token budget: 256 tokens, 512 on WebGPU (its staged prompt runs cost about the same up to
    512 tokens), never under max_batch + 1 (a prompt chunk beside a full decode batch); a set one stays."""
    webgpu = profiles.make_profile(_device("webgpu", "WebGPU_Buf", Addressing.OPAQUE, device_id=3))
    cpu = profiles.make_profile(None)
    assert webgpu.resolve(EngineConfig(max_batch=8)).prefill_chunk == 512
    assert cpu.resolve(EngineConfig(max_batch=8)).prefill_chunk == profiles.DEFAULT_PREFILL_BUDGET == 256
    assert cpu.resolve(EngineConfig(max_batch=256)).prefill_chunk == 257
    assert webgpu.resolve(EngineConfig(max_batch=8, prefill_chunk=64)).prefill_chunk == 64
    with pytest.raises(ValueError, match="prefill_chunk"):
        EngineConfig(max_batch=8, prefill_chunk=8)
