"""The hub's catalog (server.hub.catalog), pure: models found in --models-dir, the --config file's models list and
its errors, names and aliases, the memory estimate of a folder, sizes and the default memory budget from a device
report (hand-built ep.device.DeviceRecords: no hardware, no session)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from ep.device import DeviceRecord
from server.hub.catalog import (PROCESS_OVERHEAD_BYTES, build_catalog, default_memory_budget, estimate_bytes,
                                parse_bytes)
from server.settings import Settings, load_settings

GIB = 1024**3


def _decoder(folder: Path, *, layers: int = 2, heads: int = 4, kv_heads: int = 2, hidden: int = 64,
             max_length: int = 1024, weights_bytes: int = 1000, dtype: str | None = None) -> Path:
    """A decoder folder as the builder writes it: genai_config.json and weights of a known size."""
    folder.mkdir(parents=True)
    config = {"model": {"context_length": 4096, "decoder": {
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "hidden_size": hidden}}, "search": {"max_length": max_length}}
    if dtype:
        config["ortserve"] = {"dtype": dtype}
    (folder / "genai_config.json").write_text(json.dumps(config))
    (folder / "model.onnx").write_bytes(b"x" * 10)
    (folder / "model.onnx.data").write_bytes(b"\0" * weights_bytes)
    (folder / "tokenizer.json").write_bytes(b"{}" * 500)  # not weights
    return folder


def _encoder(folder: Path, weights_bytes: int = 300) -> Path:
    folder.mkdir(parents=True)
    (folder / "embedding_config.json").write_text("{}")
    (folder / "model.onnx").write_bytes(b"\0" * weights_bytes)
    return folder


# --- --models-dir -------------------------------------------------------------------------------------------


def test_models_dir_finds_gguf_files_and_model_folders(tmp_path: Path) -> None:
    root = tmp_path / "models"
    _decoder(root / "qwen-chat")
    _encoder(root / "minilm")
    (root / "tiny.gguf").write_bytes(b"GGUF")
    (root / "notes.txt").write_text("not a model")
    (root / "empty-folder").mkdir()
    default = _decoder(tmp_path / "default")
    catalog = build_catalog(Settings(model=str(default), models_dir=str(root)), one_model=False)
    by_name = {m.name: m for m in catalog}
    assert list(by_name) == ["default", "minilm", "qwen-chat", "tiny"]  # --model first, then the folder, sorted
    assert by_name["qwen-chat"].kind == "chat" and by_name["minilm"].kind == "embedding"
    assert by_name["qwen-chat"].folder == (root / "qwen-chat").resolve()
    assert by_name["tiny"].kind is None and by_name["tiny"].folder is None  # a GGUF: converted on first use
    assert not any(m.pinned for m in catalog)


def test_models_dir_that_is_not_a_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a folder"):
        build_catalog(Settings(models_dir=str(tmp_path / "missing")), one_model=False)


def test_a_one_model_server_pins_its_model_and_embedding_model(tmp_path: Path) -> None:
    chat, enc = _decoder(tmp_path / "chat"), _encoder(tmp_path / "enc")
    catalog = build_catalog(Settings(model=str(chat), embedding_model=str(enc), served_model_name="smol"),
                            one_model=True)
    assert [(m.name, m.kind, m.pinned) for m in catalog] == [("smol", "chat", True), ("enc", "embedding", True)]
    assert str(chat) in catalog[0].names  # the folder routes too


# --- a --config file's models list --------------------------------------------------------------------------


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


def test_config_models_list_with_names_aliases_and_per_model_settings(tmp_path: Path) -> None:
    folder = _decoder(tmp_path / "gemma-folder")
    config = _yaml(tmp_path, f"""
models:
  - model: {folder}
    name: gemma
    aliases: [g3, gemma-small]
    max_model_len: 512
    max_batch: 2
    chat_template: gemma
    ttl_s: 30
  - model: all-minilm-l6-v2
    kind: embedding
    pinned: true
""")
    settings = load_settings({"model": "smollm2-135m-instruct", "max_batch": 8}, config_file=config)
    catalog = build_catalog(settings, one_model=False)
    gemma, minilm = catalog[1], catalog[2]
    assert (gemma.name, gemma.names[:3], gemma.kind) == ("gemma", ["gemma", "g3", "gemma-small"], "chat")
    assert (minilm.name, minilm.kind, minilm.pinned, minilm.folder) == ("all-minilm-l6-v2", "embedding", True, None)
    own = gemma.settings_for(settings)
    assert (own.model, own.served_model_name, own.max_model_len, own.max_batch, own.chat_template) == \
        (str(folder.resolve()), "gemma", 512, 2, "gemma")
    assert gemma.spec.ttl_s == 30
    assert minilm.settings_for(settings).max_batch == 8  # unset per model: the server's own


def test_a_bare_yaml_list_is_the_models_list(tmp_path: Path) -> None:
    config = _yaml(tmp_path, "- model: gemma3-270m\n- model: all-minilm-l6-v2\n  name: minilm\n")
    settings = load_settings({}, config_file=config)
    assert [(m.model, m.name) for m in settings.models] == [("gemma3-270m", None), ("all-minilm-l6-v2", "minilm")]


@pytest.mark.parametrize("item, field", [
    ("- model: gemma3-270m\n  colour: red\n", "colour"),  # an unknown key
    ("- model: gemma3-270m\n  kind: vision\n", "kind"),  # chat or embedding only
    ("- model: gemma3-270m\n  max_batch: 0\n", "max_batch"),  # >= 1
    ("- model: gemma3-270m\n  ttl_s: -5\n", "ttl_s"),  # >= 0
    ("- name: no-model\n", "model"),  # model is required
])
def test_config_errors_name_the_field(tmp_path: Path, item: str, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        load_settings({}, config_file=_yaml(tmp_path, item))
    assert any(field in map(str, error["loc"]) for error in info.value.errors()), info.value


def test_a_config_that_is_not_a_table_or_list_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must hold a table"):
        load_settings({}, config_file=_yaml(tmp_path, "just a string\n"))


def test_two_models_with_one_name_are_an_error(tmp_path: Path) -> None:
    a, b = _decoder(tmp_path / "a"), _decoder(tmp_path / "b")
    config = _yaml(tmp_path, f"- model: {a}\n  name: same\n- model: {b}\n  name: same\n")
    with pytest.raises(ValueError, match="two models are named 'same'"):
        build_catalog(load_settings({}, config_file=config), one_model=False)


def test_an_alias_shared_with_another_model_routes_to_the_first(tmp_path: Path) -> None:
    a, b = _decoder(tmp_path / "a"), _decoder(tmp_path / "b")
    config = _yaml(tmp_path, f"- model: {a}\n  aliases: [shared]\n- model: {b}\n  aliases: [shared]\n")
    catalog = build_catalog(load_settings({}, config_file=config), one_model=False)
    assert [m.name for m in catalog[1:]] == ["a", "b"]  # not an error: only a model's own name must be unique


# --- sizes and the memory estimate --------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [("8G", 8 * GIB), ("512M", 512 * 1024**2), ("1.5GiB", int(1.5 * GIB)),
                                            ("1000", 1000), ("64k", 64 * 1024), (" 2 T ", 2 * 1024**4)])
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "eight gigs", "8X", "-1G"])
def test_parse_bytes_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="memory_budget"):
        parse_bytes(text)


def test_estimate_is_weights_plus_kv_plus_the_process(tmp_path: Path) -> None:
    folder = _decoder(tmp_path / "m", layers=2, heads=4, kv_heads=2, hidden=64, max_length=1024, weights_bytes=1000)
    head_size = 64 // 4
    kv_1024x8 = 2 * 2 * 2 * head_size * 1024 * 8 * 4  # layers x (K, V) x kv_heads x head_size x len x slots x fp32
    assert estimate_bytes(folder, Settings(max_batch=8)) == 10 + 1000 + kv_1024x8 + PROCESS_OVERHEAD_BYTES
    # --max-model-len and --max-batch scale the KV, not the weights
    assert estimate_bytes(folder, Settings(max_batch=2, max_model_len=256)) == \
        10 + 1000 + kv_1024x8 // 16 + PROCESS_OVERHEAD_BYTES
    half = _decoder(tmp_path / "h", weights_bytes=1000, dtype="float16")
    assert estimate_bytes(half, Settings(max_batch=8)) == 10 + 1000 + kv_1024x8 // 2 + PROCESS_OVERHEAD_BYTES


def test_an_encoder_is_its_weights(tmp_path: Path) -> None:
    assert estimate_bytes(_encoder(tmp_path / "e", 300), Settings()) == 300 + PROCESS_OVERHEAD_BYTES


# --- the default memory budget (issue 37: device memory on a GPU, RAM on the CPU, less a margin) --------------


def _gpu(**fields) -> DeviceRecord:
    return DeviceRecord(index=0, ep_name=fields.pop("ep_name", "AMDGPUExecutionProvider"), device_type="GPU",
                        vendor_id=0x1002, **fields)


def test_the_budget_on_the_cpu_is_ram_less_a_margin() -> None:
    assert default_memory_budget(None, ram=24 * GIB) == (24 * GIB - 2 * GIB, "RAM")  # 10% is over 2 GiB: 2 GiB
    assert default_memory_budget(None, ram=8 * GIB)[0] == 8 * GIB - 8 * GIB // 10
    cpu = DeviceRecord(index=0, ep_name="CPUExecutionProvider", device_type="CPU")
    assert default_memory_budget(cpu, ram=8 * GIB) == (8 * GIB - 8 * GIB // 10, "RAM")


def test_the_budget_on_an_amd_gpu_is_its_vram_from_sysfs(tmp_path: Path) -> None:
    """ORT's Linux discovery reports the PCI bus id; the amdgpu driver reports the VRAM beside it."""
    device = tmp_path / "bus" / "pci" / "devices" / "0000:c1:00.0"
    device.mkdir(parents=True)
    (device / "mem_info_vram_total").write_text(f"{64 * GIB}\n")
    record = _gpu(pci_bus_id="C1:00.0", metadata=(("pci_bus_id", "C1:00.0"),))
    assert record.memory_bytes(sysfs=tmp_path) == 64 * GIB
    assert record.memory_bytes(sysfs=tmp_path / "elsewhere") is None


def test_the_budget_on_a_gpu_is_its_memory_less_a_margin() -> None:
    dxgi = _gpu(ep_name="DmlExecutionProvider", metadata=(("DxgiVideoMemory", "16384 MB"),))
    assert dxgi.memory_bytes() == 16 * GIB
    openvino = _gpu(ep_name="OpenVINOExecutionProvider", ep_metadata=(("GPU_DEVICE_TOTAL_MEM_SIZE", str(4 * GIB)),))
    assert openvino.memory_bytes() == 4 * GIB
    budget, source = default_memory_budget(dxgi, ram=256 * GIB)
    assert budget == 16 * GIB - 16 * GIB // 10 and source == "DmlExecutionProvider GPU memory"  # not the RAM
    assert default_memory_budget(openvino, ram=256 * GIB)[0] == 4 * GIB - 4 * GIB // 10
    big = _gpu(ep_metadata=(("GPU_DEVICE_TOTAL_MEM_SIZE", str(141 * GIB)),))
    assert default_memory_budget(big, ram=24 * GIB)[0] == 139 * GIB  # a margin of 2 GiB at most


def test_a_gpu_that_reports_no_memory_falls_back_to_ram_and_says_so() -> None:
    cuda = _gpu(ep_name="CUDAExecutionProvider", vendor="NVIDIA")
    assert cuda.memory_bytes() is None
    budget, source = default_memory_budget(cuda, ram=24 * GIB)
    assert budget == 22 * GIB and "reports no memory" in source and "--memory-budget" in source
    odd = _gpu(metadata=(("DxgiVideoMemory", "lots"),))
    assert odd.memory_bytes() is None
