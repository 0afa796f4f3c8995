"""A model's own sampling defaults (its generation_config.json, as vLLM's --generation-config auto reads it) and
their order against a request's fields and --default-temperature; the pulled folder that records them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from engine.builder.folder import MARKER_FILE, has_generation_defaults, marker_matches, write_generation_defaults
from engine.model_loader import generation_defaults
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.sampling_fields import with_defaults

QWEN = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": True, "max_length": 2048,
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}


def test_the_sampling_fields_of_a_generation_config_are_read() -> None:
    assert generation_defaults(QWEN) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}
    assert generation_defaults({"min_p": 0, "top_k": 40.0}) == {"min_p": 0.0, "top_k": 40}
    assert generation_defaults({"bos_token_id": 1, "do_sample": False, "max_length": 2048}) == {}


@pytest.mark.parametrize("field,value", [("temperature", 3.0), ("top_p", 0.0), ("top_k", -1), ("top_k", 2.5),
                                         ("min_p", 1.5), ("repetition_penalty", 0.0), ("temperature", "0.7"),
                                         ("temperature", True)])
def test_a_value_out_of_range_is_left_out_with_a_warning(field: str, value: object,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.model_loader"):
        assert generation_defaults({field: value, "top_p": 0.9} if field != "top_p" else {field: value}) == \
            ({"top_p": 0.9} if field != "top_p" else {})
    assert f"ignoring {field}=" in caplog.text


def test_the_request_then_the_server_then_the_model_then_the_api() -> None:
    model = generation_defaults(QWEN)
    unset = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}]})
    params = with_defaults(unset, model).to_sampling_params(16, 64)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.7, 0.8, 20, 1.1)
    greedy = with_defaults(unset, model, default_temperature=0.0).to_sampling_params(16, 64)
    assert (greedy.temperature, greedy.repetition_penalty) == (0.0, 1.1)  # --default-temperature beats the model
    asked = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "temperature": 1.2,
                                                  "repetition_penalty": 1.0, "top_k": 0})
    mine = with_defaults(asked, model, default_temperature=0.0).to_sampling_params(16, 64)
    assert (mine.temperature, mine.top_p, mine.top_k, mine.repetition_penalty) == (1.2, 0.8, 0, 1.0)
    plain = with_defaults(unset, {}).to_sampling_params(16, 64)  # --generation-config none: the APIs' defaults
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert with_defaults(unset, {}) is unset
    completion = with_defaults(CompletionRequest.model_validate({"prompt": "x"}), model)
    assert completion.to_sampling_params(16, 64).repetition_penalty == 1.1


def test_a_folder_gets_the_defaults_in_place_and_stays_valid(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "do_sample": False}))
    (folder / "model.onnx").write_bytes(b"x" * 10)
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    marker = {"source": "pkg==1", "builder_version": 4}
    (folder / MARKER_FILE).write_text(json.dumps({**marker, "files": sizes}))
    defaults = {"do_sample": True, "temperature": 0.7, "repetition_penalty": 1.1}
    assert marker_matches(folder, marker) and not has_generation_defaults(folder, defaults)
    write_generation_defaults(folder, defaults)
    assert json.loads((folder / "generation_config.json").read_text()) == {"eos_token_id": [2], **defaults}
    assert has_generation_defaults(folder, defaults) and marker_matches(folder, marker)
    before = (folder / MARKER_FILE).stat().st_mtime_ns
    write_generation_defaults(folder, defaults)  # already there: nothing is written
    assert (folder / MARKER_FILE).stat().st_mtime_ns == before
    assert sorted(p.name for p in folder.iterdir()) == sorted([MARKER_FILE, "generation_config.json", "model.onnx"])
