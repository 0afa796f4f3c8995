"""`python -m server serve` as its own process: startup order, SIGTERM with a grace period, load failure."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.server.conftest import free_socket

ROOT = Path(__file__).resolve().parents[3]
HI = [{"role": "user", "content": "hi"}]
# uvicorn re-raises the SIGTERM it handled once shutdown is complete, so the process ends "by SIGTERM"
# (what process managers expect); 0 is fine too. Anything else (a crash, a hang killed later) is not.
GRACEFUL_EXIT = (0, -signal.SIGTERM)


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic model deep enough that a long stream takes seconds on a CPU (shutdown timing)."""
    from engine.builder import SyntheticSpec, build_synthetic

    spec = SyntheticSpec(hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=768,
                         max_length=2048)
    return build_synthetic(tmp_path_factory.mktemp("slow") / "model", spec)


@contextlib.contextmanager
def serve_process(model: Path, *flags: str, wait_ready: bool = True) -> Iterator[tuple[subprocess.Popen, str]]:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()  # NOTE: a tiny window in which another process could take the port
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith("ORTSERVE_") or k == "ORTSERVE_CACHE_DIR"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--model", str(model), "--port", str(port),
         "--served-model-name", "tiny", "--provider", "cpu", "--log-level", "warning", *flags],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while wait_ready:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {proc.communicate(timeout=5)[0][-3000:]}")
            time.sleep(0.1)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _refused(base: str, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{base}/health", timeout=0.5)
        except httpx.ConnectError:
            return True
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    return False


def test_sigterm_lets_running_streams_finish(slow_model: Path) -> None:
    with serve_process(slow_model, "--shutdown-grace-s", "20") as (proc, base):
        body = {"model": "tiny", "messages": HI, "max_tokens": 150, "stream": True, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            data = []
            while len(data) < 3:
                line = next(lines)
                if line.startswith("data: "):
                    data.append(line[6:])
            proc.send_signal(signal.SIGTERM)
            assert _refused(base), "the server kept accepting connections after SIGTERM"
            data += [line[6:] for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["usage"]["completion_tokens"] == 150
        assert proc.wait(30) in GRACEFUL_EXIT


def test_sigterm_aborts_streams_after_the_grace_period(slow_model: Path) -> None:
    with serve_process(slow_model, "--shutdown-grace-s", "0.5") as (proc, base):
        body = {"model": "tiny", "messages": HI, "max_tokens": 1900, "stream": True, "temperature": 0,
                "ignore_eos": True}
        data: list[str] = []
        started = time.monotonic()
        with contextlib.suppress(httpx.TransportError):  # the cut may show as an incomplete body
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data.append(line[6:])
                        if len(data) == 3:
                            proc.send_signal(signal.SIGTERM)
        assert "[DONE]" not in data  # cut short, not run to 1900 tokens
        assert proc.wait(20) in GRACEFUL_EXIT
        assert time.monotonic() - started < 15


def test_a_model_that_fails_to_load_exits_1(slow_model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(slow_model, broken)
    (broken / "model.onnx").write_bytes(b"this is not an onnx file")
    with serve_process(broken, wait_ready=False) as (proc, _base):
        assert proc.wait(60) == 1
        assert "loading the model failed" in proc.stdout.read()


def test_an_unknown_model_name_exits_1_before_listening(tmp_path: Path) -> None:
    with serve_process(tmp_path / "no-such-model", wait_ready=False) as (proc, _base):
        assert proc.wait(60) == 1
        assert "cannot resolve model" in proc.stdout.read()
