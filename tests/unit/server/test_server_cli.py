"""The `ortserve` command line: subcommands, flags generated from Settings, errors before anything loads."""

from __future__ import annotations

import pytest

from server.__main__ import build_parser, main, settings_from_args


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("ORTSERVE_") and name != "ORTSERVE_CACHE_DIR":
            monkeypatch.delenv(name)


def test_serve_flags_become_settings(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("ORTSERVE_MAX_QUEUE", "5")
    cfg = tmp_path / "c.toml"
    cfg.write_text("max_batch = 3\nport = 7000\n")
    args = build_parser().parse_args(["serve", "--model", "/tmp/m", "--port", "8123", "--no-int4-gemv",
                                      "--provider", "AMDGPUExecutionProvider", "--device", "1",
                                      "--ep-library", "/opt/libamdgpu-ep.so", "--config", str(cfg)])
    s = settings_from_args(args)
    assert (s.model, s.port, s.int4_gemv, s.provider, s.device) == ("/tmp/m", 8123, False,
                                                                     "AMDGPUExecutionProvider", "1")
    assert (s.ep_library, s.max_queue, s.max_batch) == ("/opt/libamdgpu-ep.so", 5, 3)


def test_serve_help_lists_flags_and_env(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--host", "--port", "--provider", "--device", "--api-key", "--max-batch",
                 "--max-queue", "--max-model-len", "--ep-library", "--no-int4-gemv", "ORTSERVE_MAX_BATCH"):
        assert flag in out


def test_invalid_settings_exit_2_before_loading(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--port", "0"]) == 2
    assert "port" in capsys.readouterr().err
    assert main(["serve", "--max-batch", "many"]) == 2


def test_unknown_subcommand_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_bench_is_delegated(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_convert_reports_a_missing_file(tmp_path, capsys: pytest.CaptureFixture) -> None:
    assert main(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "out"), "--quiet"]) == 1
    assert "missing.gguf" in capsys.readouterr().err


def test_unknown_provider_is_refused_before_anything_loads(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--provider", "quantum"]) == 2
    assert "quantum" in capsys.readouterr().err


def test_pull_of_an_unknown_name_exits_1(capsys: pytest.CaptureFixture) -> None:
    assert main(["pull", "no-such-model", "--quiet"]) == 1
    assert "no-such-model" in capsys.readouterr().err
