"""Sessions through ep.providers on real ONNX Runtime: plain CPU, ORT's CPU OrtEpDevice carrying the AMDGPU
options (stands_in_for_amd), and the error for a model ORT refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ep import providers
from ep.device import SelectedDevice, record_of, select_device
from ep.names import EpError, SessionCreateError

GENAI = {"model": {"type": "llama", "decoder": {"inputs": {"input_ids": "x"}, "outputs": {"logits": "y"}}},
         "search": {"max_length": 32}}


def test_cpu_session_runs(add_model: Path) -> None:
    selected = select_device("cpu")
    so = providers.make_session_options(selected, GENAI, intra_op_threads=1)
    session = providers.create_session(add_model, selected, so)
    assert session.get_providers() == ["CPUExecutionProvider"]
    x = np.arange(6, dtype=np.int64).reshape(2, 3)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x + 1)


def test_ep_device_session_with_amdgpu_options_stands_in_for_amd(add_model: Path) -> None:
    """The AMDGPU entries and provider options go through add_provider_for_devices to a real session."""
    cpu = next(d for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider")
    selected = SelectedDevice("amdgpu", "AMDGPUExecutionProvider", cpu, 0, None, None, record_of(cpu, 0))
    so = providers.make_session_options(selected, GENAI, input_names=["x"], output_names=["y"],
                                        ep_options={"extra": "1"})
    assert so.get_session_config_entry("ep.migraphx.static_pad_inputs") == "x:1"
    session = providers.create_session(add_model, selected, so)
    assert "CPUExecutionProvider" in session.get_providers()
    x = np.array([[41]], dtype=np.int64)
    assert session.run(None, {"x": x})[0].item() == 42


def test_a_model_ort_refuses_is_a_session_create_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx model")
    selected = select_device("cpu")
    with pytest.raises(SessionCreateError) as info:
        providers.create_session(broken, selected, providers.make_session_options(selected, GENAI))
    assert str(broken) in str(info.value) and "CPUExecutionProvider" in str(info.value)
    assert isinstance(info.value, EpError)
