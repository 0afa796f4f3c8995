"""MIGRAPHX_ENABLE_INT4_GEMV: defaults, the real off switch, pass-through, fdot2, and the ordering rules."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ep import flags
from ep.names import UnknownProviderError

FLAG = "MIGRAPHX_ENABLE_INT4_GEMV"


@pytest.mark.parametrize("provider", ["amdgpu", "AMDGPUExecutionProvider", "migraphx", "auto"])
def test_on_by_default_where_migraphx_may_run(provider: str) -> None:
    env: dict[str, str] = {}
    report = flags.apply(provider, None, env=env, probe_gpus=False)
    assert env[FLAG] == "1"
    assert report.enabled and report.relevant and report.value == "1" and report.previous is None
    assert report.effective is True


@pytest.mark.parametrize("provider", ["cpu", "webgpu", "openvino", "cuda"])
def test_other_providers_leave_the_environment_alone(provider: str) -> None:
    env = {"UNRELATED": "x"}
    report = flags.apply(provider, None, env=env, probe_gpus=False)
    assert env == {"UNRELATED": "x"}
    assert not report.relevant and not report.enabled
    assert any("Not read by" in m for m in report.messages)


@pytest.mark.parametrize("previous", ["0", "1", "false", ""])
def test_off_switch_unsets_whatever_value_was_there(previous: str) -> None:
    """MIGraphX treats any value, "0" too, as on: the only real off is an unset variable."""
    env = {FLAG: previous}
    report = flags.apply("amdgpu", False, env=env, probe_gpus=False)
    assert FLAG not in env
    assert not report.enabled and report.value is None and report.previous == previous
    assert report.requested is False
    assert any("'0' too" in m for m in report.messages)


def test_explicit_on_overrides_a_user_zero() -> None:
    env = {FLAG: "0"}
    report = flags.apply("migraphx", True, env=env, probe_gpus=False)
    assert env[FLAG] == "1" and report.previous == "0"


def test_passthrough_variables_are_reported_and_untouched() -> None:
    env = {"MIGRAPHX_INT4_GEMV_CONFIG": "/tmp/gemv.json", "MIGRAPHX_INT4_GEMV_TRACE": "1"}
    report = flags.apply("amdgpu", None, env=env, probe_gpus=False)
    assert dict(report.passthrough) == {"MIGRAPHX_INT4_GEMV_CONFIG": "/tmp/gemv.json", "MIGRAPHX_INT4_GEMV_TRACE": "1"}
    assert env["MIGRAPHX_INT4_GEMV_CONFIG"] == "/tmp/gemv.json" and env["MIGRAPHX_INT4_GEMV_TRACE"] == "1"
    assert report.to_dict()["passthrough"] == dict(report.passthrough)


def test_unknown_provider_is_refused_before_touching_env() -> None:
    env: dict[str, str] = {}
    with pytest.raises(UnknownProviderError):
        flags.apply("rocm", None, env=env, probe_gpus=False)
    assert env == {}


@pytest.mark.parametrize(("arch", "expected"), [
    ("gfx90a", True), ("gfx1151", True), ("gfx1201", True), ("gfx942", True), ("gfx1100", True),
    ("gfx90a:sramecc+:xnack-", True), ("GFX1151", True),
    ("gfx900", False), ("gfx1010", False), ("gfx803", False),
    ("gfx9999", None), ("", None),
])
def test_fdot2_table(arch: str, expected: bool | None) -> None:
    assert flags.has_fdot2(arch) is expected


def test_maps_parsing_matches_backend_basenames_only(tmp_path: Path) -> None:
    """libdrm_amdgpu (loaded by any GPU stack) must not count as the backend."""
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000001000 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libdrm_amdgpu.so.1.0.0\n"
        "7f0000001000-7f0000002000 r-xp 00001000 08:01 2 /opt/rocm/lib/libmigraphx_gpu.so.2012000\n"
        "7f0000002000-7f0000003000 r--p 00000000 08:01 3 /opt/ep/libamdgpu-ep.so (deleted)\n"
        "7f0000003000-7f0000004000 rw-p 00000000 00:00 0 \n"
        "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]\n")
    found = flags.loaded_libraries(maps_path=str(maps))
    assert found == ("/opt/ep/libamdgpu-ep.so", "/opt/rocm/lib/libmigraphx_gpu.so.2012000")
    assert flags.loaded_libraries(maps_path=str(tmp_path / "absent")) is None


def test_late_flag_is_reported_with_a_parameterized_pattern() -> None:
    """onnxruntime is loaded in this test process, so a pattern naming it stands for a loaded backend."""
    import onnxruntime  # noqa: F401  (the library the pattern names must be mapped)

    pattern = ("onnxruntime_pybind11_state*",)
    env: dict[str, str] = {}
    report = flags.apply("amdgpu", None, env=env, library_patterns=pattern, probe_gpus=False)
    assert report.late and report.effective is None
    assert any("onnxruntime_pybind11_state" in p for p in report.loaded_libraries)
    assert any("cannot take effect" in m for m in report.messages)
    # The same process, the real patterns: no MIGraphX backend here, so not late.
    assert not flags.apply("amdgpu", None, env={}, probe_gpus=False).late


def test_late_flag_with_a_real_library_loaded_in_a_fresh_process(run_python, backend_named_library) -> None:
    lib = backend_named_library("libmigraphx_ortserve_test.so")
    code = f"""
import ctypes, json
from ep import flags
before = flags.apply("amdgpu", None, env={{}}, probe_gpus=False)
ctypes.CDLL({str(lib)!r})
after = flags.apply("amdgpu", None, env={{}}, probe_gpus=False)
print(json.dumps({{"before": before.to_dict(), "after": after.to_dict()}}))
"""
    out = run_python(code)
    assert out["before"]["late"] is False
    assert out["after"]["late"] is True and out["after"]["effective"] is None
    assert out["after"]["loaded_libraries"] == [str(lib)]
    assert any("libmigraphx_ortserve_test.so is already loaded" in m for m in out["after"]["messages"])


def test_flag_is_set_before_ep_registration(run_python) -> None:
    """The startup order: apply() in a process with no backend, then registration sees the variable."""
    code = """
import json, os
from ep import flags
report = flags.apply("auto", None, probe_gpus=False)
seen_at_registration = os.environ.get("MIGRAPHX_ENABLE_INT4_GEMV")
from ep import device
libraries = device.register_ep_libraries("all")
print(json.dumps({"late": report.late, "seen": seen_at_registration,
                  "registered": [lib.provider for lib in libraries if lib.registered]}))
"""
    out = run_python(code)
    assert out["late"] is False and out["seen"] == "1"


def test_describe_reports_a_late_flag(run_python, backend_named_library) -> None:
    """`ortserve devices` shows plainly that the flag cannot take effect once a backend is loaded."""
    lib = backend_named_library("libamdgpu-ep-test.so")
    code = f"""
import ctypes, json
ctypes.CDLL({str(lib)!r})
from ep import device
info = device.describe("amdgpu", None, None, None)
print(json.dumps({{"flags": info["flags"], "text": device.format_description(info)}}))
"""
    out = run_python(code)
    assert out["flags"]["late"] is True
    assert "cannot take effect" in out["text"]


def test_report_serializes() -> None:
    report = flags.apply("amdgpu", None, env={}, probe_gpus=False)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["flag"] == FLAG and data["enabled"] is True and data["gpus"] == []
    assert FLAG in report.summary()


@pytest.mark.parametrize(("provider", "max_batch", "requested", "expected"), [
    ("cuda", 8, None, "1"), ("auto", 8, None, "1"), ("cuda", 1, None, "0"), ("CUDAExecutionProvider", 8, False, "0"),
    ("cuda", 1, True, "1")])
def test_cuda_int4_gemm_on_where_a_batch_can_form(provider: str, max_batch: int, requested: bool | None,
                                                   expected: str) -> None:
    env: dict[str, str] = {}
    report = flags.apply_cuda_int4_gemm(provider, max_batch, requested, env=env)
    assert env == {"ORT_FPA_INTB_GEMM": expected} and report is not None and "ORT_FPA_INTB_GEMM" in report


def test_cuda_int4_gemm_keeps_the_users_environment_unless_asked() -> None:
    env = {"ORT_FPA_INTB_GEMM": "off"}
    assert "from the environment" in flags.apply_cuda_int4_gemm("cuda", 64, None, env=env)
    assert env == {"ORT_FPA_INTB_GEMM": "off"}
    flags.apply_cuda_int4_gemm("cuda", 64, True, env=env)
    assert env == {"ORT_FPA_INTB_GEMM": "1"}


@pytest.mark.parametrize("provider", ["webgpu", "amdgpu", "cpu"])
def test_cuda_int4_gemm_leaves_other_providers_alone(provider: str) -> None:
    env: dict[str, str] = {}
    assert flags.apply_cuda_int4_gemm(provider, 8, True, env=env) is None and env == {}


@pytest.mark.parametrize("before", [None, "1", "off"])
def test_cuda_int4_gemm_off_holds_for_the_block_and_restores_what_was_there(before: str | None) -> None:
    env = {} if before is None else {"ORT_FPA_INTB_GEMM": before}
    with flags.cuda_int4_gemm_off(env):
        assert env["ORT_FPA_INTB_GEMM"] == "0" and not flags.cuda_int4_gemm_on(env)
    assert env == ({} if before is None else {"ORT_FPA_INTB_GEMM": before})
    with pytest.raises(RuntimeError), flags.cuda_int4_gemm_off(env):
        raise RuntimeError("a session that failed to load")
    assert env.get("ORT_FPA_INTB_GEMM") == before


def _gpu_lines(records: list) -> list[str]:
    """The log lines at INFO or above that mention MIGraphX or CUDA (what a CPU-only start must not show)."""
    return [r.getMessage() for r in records
            if r.levelno >= logging.INFO and any(word in r.getMessage().upper()
                                                 for word in ("MIGRAPHX", "CUDA", "ORT_FPA_INTB_GEMM"))]


@pytest.mark.parametrize("provider", ["cpu", "auto"])
def test_a_cpu_only_start_logs_nothing_about_gpu_flags(provider: str, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    absent = (str(tmp_path / "no-such-device-node"),)  # auto on a machine with no GPU node
    with caplog.at_level(logging.DEBUG, logger="ep.flags"):
        flags.apply(provider, None, env={}, probe_gpus=False, device_nodes=absent)
        flags.apply_cuda_int4_gemm(provider, 8, None, env={}, device_nodes=absent)
    assert caplog.records, "apply() should still report, at DEBUG"
    assert _gpu_lines(caplog.records) == []


@pytest.mark.parametrize("provider, requested, node", [
    ("auto", None, True), ("amdgpu", None, False), ("cpu", True, False)])
def test_gpu_flags_are_reported_where_a_gpu_may_read_them(provider: str, requested: bool | None, node: bool,
                                                          tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Under auto with the GPU's device node present, for a provider named, or when the user set the flag."""
    (tmp_path / "kfd").touch()
    nodes = (str(tmp_path / ("kfd" if node else "absent")),)
    with caplog.at_level(logging.INFO, logger="ep.flags"):
        flags.apply(provider, requested, env={}, probe_gpus=False, device_nodes=nodes)
    assert any(FLAG in line for line in _gpu_lines(caplog.records))


@pytest.mark.parametrize("provider, node", [("auto", True), ("cuda", False)])
def test_cuda_int4_gemm_is_reported_where_a_cuda_gpu_may_read_it(provider: str, node: bool, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "nvidiactl").touch()
    nodes = (str(tmp_path / ("nvidiactl" if node else "absent")),)
    with caplog.at_level(logging.INFO, logger="ep.flags"):
        flags.apply_cuda_int4_gemm(provider, 8, None, env={}, device_nodes=nodes)
    assert any("ORT_FPA_INTB_GEMM" in line for line in _gpu_lines(caplog.records))
