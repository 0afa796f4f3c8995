"""The device chooses the model dtype (issue 45): each family's own, --dtype over it, the reason said; under --provider
auto the device is found without loading its backend here (in a child process)."""

from __future__ import annotations

import pytest

from ep import device as ep_device
from ep import model_dtype
from ep import profiles
from ep.profiles import choose_dtype


@pytest.mark.parametrize("provider, dtype", [("cuda", "float16"), ("amdgpu", "float16"), ("migraphx", "float16"),
                                             ("webgpu", "float16"), ("cpu", "float32"), ("openvino", "float32")])
def test_each_family_converts_to_its_own_dtype(provider: str, dtype: str) -> None:
    choice = model_dtype.choose_model_dtype(provider)
    assert choice.dtype == dtype
    assert f"the {profiles.profile_class(provider).family} device's default" in choice.reason
    assert "--dtype overrides it" in choice.describe()


def test_dtype_overrides_the_device_and_says_what_the_device_would_take() -> None:
    choice = model_dtype.choose_model_dtype("cuda", requested="float32")
    assert choice.dtype == "float32"
    assert choice.reason == "--dtype float32; the cuda device (--provider cuda) would take float16"
    assert model_dtype.choose_model_dtype("cpu", requested="float32").reason == "--dtype float32"
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        choose_dtype(profiles.CpuProfile, "bfloat16")


def test_auto_without_a_device_library_is_the_cpu_and_probes_nothing(monkeypatch) -> None:
    model_dtype.device_family.cache_clear()
    monkeypatch.setattr(ep_device, "find_ep_libraries", lambda providers, ep_library=None: [])
    monkeypatch.setattr(model_dtype, "probe_device", lambda *a: pytest.fail("probed without a device library"))
    choice = model_dtype.choose_model_dtype("auto")
    model_dtype.device_family.cache_clear()
    assert choice.dtype == "float32" and "no device EP library is installed" in choice.reason


def test_auto_probes_in_a_child_process_and_survives_a_failed_probe(monkeypatch) -> None:
    """The real probe (a spawned child runs select_device): on a machine without GPUs it finds the CPU EP."""
    model_dtype.device_family.cache_clear()
    monkeypatch.setattr(ep_device, "find_ep_libraries", lambda providers, ep_library=None: [("cuda", "x", "test")])
    family, how = model_dtype.device_family("auto")
    model_dtype.device_family.cache_clear()
    assert family in (profiles.CpuProfile, profiles.CudaProfile, profiles.HipProfile, profiles.AmdgpuProfile,
                      profiles.WebGpuProfile)
    assert how.startswith("--provider auto selected [0] ")


def test_standin_cuda_machine_serves_qwen_coder_in_float16_without_a_flag(monkeypatch) -> None:
    """Stand-in for a CUDA machine (no GPU here): auto finds the CUDA EP's library and its probe picks a CUDA device;
    `ortserve serve --model qwen2.5-coder-1.5b` then resolves the model in float16 with no --dtype."""
    from engine.builder.errors import UnknownModelError
    from server import __main__ as cli

    model_dtype.device_family.cache_clear()
    monkeypatch.setattr(ep_device, "find_ep_libraries", lambda providers, ep_library=None: [("cuda", "x", "test")])
    monkeypatch.setattr(model_dtype, "probe_device", lambda provider, selector, ep_library: (
        "cuda", "[0] CUDAExecutionProvider: GPU NVIDIA 10de:2335 (stand-in)"))
    asked: dict = {}

    def resolve(model, cache_dir=None, progress=True, *, dtype=None):
        asked.update(model=model, dtype=dtype)
        raise UnknownModelError("stand-in: stop before any download")

    monkeypatch.setattr("engine.builder.resolve_model", resolve)
    monkeypatch.setattr("ep.flags.apply", lambda *a, **k: None)  # (no backend env flags set in the test process)
    monkeypatch.setattr("ep.flags.apply_cuda_int4_gemm", lambda *a, **k: None)
    code = cli.main(["serve", "--model", "qwen2.5-coder-1.5b", "--port", "1"])
    model_dtype.device_family.cache_clear()
    assert code == 1
    assert asked == {"model": "qwen2.5-coder-1.5b", "dtype": "float16"}
