"""Provider-name normalization and the error classes the CLI maps to a non-zero exit."""

from __future__ import annotations

import pytest

from ep.names import (
    AUTO_ORDER, EP_NAMES, EpError, UnknownProviderError, normalize_provider, provider_of_ep_name,
)


@pytest.mark.parametrize("spelling", ["amdgpu", "AMDGPU", "AMDGPUExecutionProvider", "amdgpuexecutionprovider",
                                      "  AmdGpu  "])
def test_amdgpu_spellings_normalize_to_amdgpu(spelling: str) -> None:
    assert normalize_provider(spelling) == "amdgpu"


@pytest.mark.parametrize(("spelling", "short"), [
    ("webgpu", "webgpu"), ("WebGpuExecutionProvider", "webgpu"), ("OpenVINOExecutionProvider", "openvino"),
    ("OpenVINOExecutionProvider.AUTO", "openvino"), ("MIGraphX", "migraphx"), ("CUDAExecutionProvider", "cuda"),
    ("CPU", "cpu"), ("CPUExecutionProvider", "cpu"),
])
def test_other_providers_normalize(spelling: str, short: str) -> None:
    assert normalize_provider(spelling) == short


def test_every_ep_name_round_trips() -> None:
    for short, ep_name in EP_NAMES.items():
        assert normalize_provider(ep_name) == short


def test_unknown_provider_lists_the_known_ones() -> None:
    with pytest.raises(UnknownProviderError) as info:
        normalize_provider("rocm")
    message = str(info.value)
    assert "'rocm'" in message
    for short in EP_NAMES:
        assert short in message
    assert isinstance(info.value, EpError) and isinstance(info.value, ValueError)


def test_auto_only_where_allowed() -> None:
    assert normalize_provider("AUTO", allow_auto=True) == "auto"
    with pytest.raises(UnknownProviderError):
        normalize_provider("auto")
    with pytest.raises(UnknownProviderError):
        normalize_provider("executionprovider")


def test_provider_of_ep_name_is_none_for_foreign_eps() -> None:
    assert provider_of_ep_name("QNNExecutionProvider") is None
    assert provider_of_ep_name("AMDGPUExecutionProvider") == "amdgpu"


def test_auto_order_is_amdgpu_migraphx_cuda_webgpu_cpu() -> None:
    assert AUTO_ORDER == ("amdgpu", "migraphx", "cuda", "webgpu", "cpu")


def test_names_and_flags_import_no_onnxruntime(run_python) -> None:
    """Validating --provider and applying flags must not load any backend."""
    code = "import json, sys, ep.names, ep.flags; print(json.dumps('onnxruntime' in sys.modules))"
    assert run_python(code) is False
