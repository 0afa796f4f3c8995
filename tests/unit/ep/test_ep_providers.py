"""Session options: the AMDGPU entries (exact), provider options from genai_config and --ep-option, WebGPU
graph capture. Where an AMD device cannot exist, ORT's real CPU OrtEpDevice carries the options instead
(tests say "stands_in_for_amd"): ORT then files them under ep.cpuexecutionprovider.*."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from ep import providers
from ep.device import DeviceRecord, SelectedDevice, record_of
from ep.names import EpOptionError

GENAI = {
    "model": {"type": "llama", "context_length": 8192,
              "decoder": {"session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                          "inputs": {"input_ids": "input_ids", "position_ids": "position_ids",
                                     "attention_mask": "attention_mask"},
                          "outputs": {"logits": "logits"}}},
    "search": {"max_length": 2048},
}
AMDGPU_ENTRIES = {
    "ep.migraphx.static_pad_seq": "1",
    "ep.migraphx.static_pad_seq_len": "2048",
    "ep.migraphx.static_pad_inputs": "input_ids:1,position_ids:1",
    "ep.migraphx.static_pad_outputs": "logits:1",
    "ep.migraphx.hip_graph_enable": "1",
    "ep.directml.enable_host_accessible": "1",
}


def _stand_in(provider: str, ep_name: str) -> SelectedDevice:
    """A SelectedDevice for `provider` whose OrtEpDevice is ORT's real CPU one."""
    cpu = next(d for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider")
    return SelectedDevice(provider, ep_name, cpu, 0, None, None, record_of(cpu, 0))


def _entry(so: ort.SessionOptions, key: str) -> str | None:
    try:
        return so.get_session_config_entry(key)
    except RuntimeError:  # ORT raises for an absent key
        return None


def _genai(**provider_options: dict[str, str]) -> dict:
    config = {**GENAI, "model": {**GENAI["model"], "decoder": {**GENAI["model"]["decoder"]}}}
    config["model"]["decoder"]["session_options"] = {
        "provider_options": [{name: opts} for name, opts in provider_options.items()]}
    return config


def test_parse_ep_options() -> None:
    assert providers.parse_ep_options(["a=1", "b=x=y", " c = 2 ", "a=3", "empty="]) == {
        "a": "3", "b": "x=y", "c": "2", "empty": ""}
    assert providers.parse_ep_options(None) == {}


@pytest.mark.parametrize("item", ["novalue", "=1", " =x"])
def test_malformed_ep_option_is_a_clear_error(item: str) -> None:
    with pytest.raises(EpOptionError) as info:
        providers.parse_ep_options(["ok=1", item])
    assert repr(item) in str(info.value) and "key=value" in str(info.value)


def test_amdgpu_entries_exact() -> None:
    assert providers.amdgpu_session_entries(GENAI) == AMDGPU_ENTRIES


def test_amdgpu_entries_follow_the_graph_names() -> None:
    config = _genai()
    config["model"]["decoder"]["inputs"] = {"input_ids": "ids", "position_ids": "pos"}
    config["model"]["decoder"]["outputs"] = {"logits": "lm_logits"}
    entries = providers.amdgpu_session_entries(config, input_names=["ids", "attention_mask"],
                                               output_names=["lm_logits"], hip_graph=False)
    assert entries["ep.migraphx.static_pad_inputs"] == "ids:1"  # the graph has no "pos"
    assert entries["ep.migraphx.static_pad_outputs"] == "lm_logits:1"
    assert entries["ep.migraphx.hip_graph_enable"] == "0"


def test_amdgpu_entries_fall_back_to_context_length() -> None:
    config = {"model": GENAI["model"], "search": {}}
    assert providers.amdgpu_session_entries(config)["ep.migraphx.static_pad_seq_len"] == "8192"
    with pytest.raises(EpOptionError):
        providers.amdgpu_session_entries({"model": {"decoder": {}}})


def test_genai_provider_options_pick_the_provider_in_any_spelling() -> None:
    config = _genai(AMDGPUExecutionProvider={"x": "1"}, cuda={"y": "2"}, amdgpu={"z": "3"})
    assert providers.genai_provider_options(config, "amdgpu") == {"x": "1", "z": "3"}
    assert providers.genai_provider_options(config, "webgpu") == {}


def test_amdgpu_session_options_stands_in_for_amd() -> None:
    config = _genai(amdgpu={"foo": "from-genai", "bar": "genai"})
    so = providers.make_session_options(_stand_in("amdgpu", "AMDGPUExecutionProvider"), config,
                                        ep_options={"foo": "from-cli"}, intra_op_threads=1)
    for key, value in AMDGPU_ENTRIES.items():
        assert _entry(so, key) == value
    # Provider options reach add_provider_for_devices: model_arch, genai's, then --ep-option on top.
    assert _entry(so, "ep.cpuexecutionprovider.model_arch") == "llama"
    assert _entry(so, "ep.cpuexecutionprovider.foo") == "from-cli"
    assert _entry(so, "ep.cpuexecutionprovider.bar") == "genai"
    assert so.intra_op_num_threads == 1


def test_genai_graph_capture_opt_out_turns_hip_graphs_off_stands_in_for_amd() -> None:
    config = _genai(amdgpu={"enable_graph_capture": "0"})
    so = providers.make_session_options(_stand_in("amdgpu", "AMDGPUExecutionProvider"), config)
    assert _entry(so, "ep.migraphx.hip_graph_enable") == "0"
    assert _entry(so, "ep.cpuexecutionprovider.enable_graph_capture") is None


def test_migraphx_gets_the_padding_entries_but_no_model_arch() -> None:
    so = providers.make_session_options(_stand_in("migraphx", "MIGraphXExecutionProvider"), GENAI)
    assert _entry(so, "ep.migraphx.static_pad_seq_len") == "2048"
    assert _entry(so, "ep.cpuexecutionprovider.model_arch") is None


@pytest.mark.parametrize("capture", [True, False])
def test_webgpu_graph_capture_only_when_asked(capture: bool) -> None:
    config = _genai(webgpu={"enableGraphCapture": "1"})  # the engine decides, not the config
    so = providers.make_session_options(_stand_in("webgpu", "WebGpuExecutionProvider"), config,
                                        graph_capture=capture)
    assert _entry(so, "ep.cpuexecutionprovider.enableGraphCapture") == ("1" if capture else None)
    assert so.enable_mem_pattern is (not capture)
    assert _entry(so, "ep.migraphx.static_pad_seq") is None


def test_plain_cpu_adds_no_provider() -> None:
    cpu = DeviceRecord(index=0, ep_name="CPUExecutionProvider")
    selected = SelectedDevice("cpu", "CPUExecutionProvider", None, 0, None, None, cpu)
    so = providers.make_session_options(selected, GENAI, ep_options={"x": "1"})
    assert _entry(so, "ep.cpuexecutionprovider.x") is None
    assert _entry(so, "ep.migraphx.static_pad_seq") is None
