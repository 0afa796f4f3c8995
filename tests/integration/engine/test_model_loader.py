"""Model folders the engine cannot serve fail at load with a clear ModelLoadError (real sessions)."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
from onnx import TensorProto, helper

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.model_loader import read_model_folder
from engine.types import ModelLoadError


@pytest.fixture
def folder(tiny_model, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_model, out)
    return out


def edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def load(path, **cfg):
    return AsyncEngine.from_model_dir(path, EngineConfig(max_batch=2, prefill_chunk=16, **cfg))


def test_the_tiny_model_loads_and_reports_its_facts(folder):
    info = read_model_folder(folder)
    # <|im_end|> (eos) and <|endoftext|>: llama.cpp ends generation on both (engine.end_of_generation)
    assert info.eog_token_ids == info.eos_token_ids == frozenset({0, 2})
    engine = load(folder)
    try:
        assert engine.max_model_len == 256 and engine.model_name == "model"
        assert engine.stats().num_slots_total == 2
    finally:
        engine.shutdown()


@pytest.mark.parametrize("missing", ["genai_config.json", "model.onnx", "tokenizer.json"])
def test_missing_files(folder, missing):
    (folder / missing).unlink()
    with pytest.raises(ModelLoadError, match=missing.replace(".", r"\.")):
        load(folder)


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nope")


def test_corrupt_onnx(folder):
    (folder / "model.onnx").write_bytes(b"\x08\x07garbage" * 100)
    with pytest.raises(ModelLoadError, match="model.onnx"):
        load(folder)


def test_corrupt_json_and_tokenizer(folder):
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load(folder)


def test_genai_config_without_decoder_fields(folder):
    edit_json(folder / "genai_config.json", lambda d: d["model"]["decoder"].pop("num_hidden_layers"))
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        load(folder)


def test_no_kv_inputs_under_the_configured_names(folder):
    edit_json(folder / "genai_config.json",
              lambda d: d["model"]["decoder"]["inputs"].update(past_key_names="past.%d.k"))
    with pytest.raises(ModelLoadError, match="no KV-cache inputs"):
        load(folder)


def test_unknown_graph_input(folder):
    model = onnx.load(str(folder / "model.onnx"))
    model.graph.input.append(helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["b", "s"]))
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    with pytest.raises(ModelLoadError, match="token_type_ids"):
        load(folder)


def test_model_without_group_query_attention(folder):
    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])
    y = helper.make_tensor_value_info("logits", TensorProto.INT64, ["b", "s"])
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "g", [x], [y])
    onnx.save_model(helper.make_model(graph), str(folder / "model.onnx"))
    with pytest.raises(ModelLoadError, match="GroupQueryAttention"):
        load(folder)


def test_max_model_len_beyond_context(folder):
    with pytest.raises(ModelLoadError, match="context_length"):
        load(folder, max_model_len=10_000)


def test_chat_template_that_does_not_compile(folder):
    edit_json(folder / "tokenizer_config.json", lambda d: d.update(chat_template="{% if %}"))
    with pytest.raises(ModelLoadError, match="chat_template"):
        load(folder)
