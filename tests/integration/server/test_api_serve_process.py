"""`python -m server serve` as its own process: startup order, SIGTERM with a grace period, load failure.

The SIGTERM tests run the engine paced (tests/integration/server/paced_serve.py: a sleep before each decode
step), so that a stream is still running when the signal arrives or the grace period ends, by construction.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai

from tests.integration.server.conftest import serve_process

HI = [{"role": "user", "content": "hi"}]
# uvicorn re-raises the SIGTERM it handled once shutdown is complete, so the process ends "by SIGTERM"
# (what process managers expect); 0 is fine too. Anything else (a crash, a hang killed later) is not.
GRACEFUL_EXIT = (0, -signal.SIGTERM)


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


def _data_lines(lines: Iterator[str], count: int | None = None) -> list[str]:
    """The payloads of the next `count` (or all remaining) `data:` lines of an SSE stream."""
    data = []
    for line in lines:
        if line.startswith("data: "):
            data.append(line[6:])
            if len(data) == count:
                break
    return data


def test_sigterm_lets_running_streams_finish(api_model: Path) -> None:
    """SIGTERM mid-stream: no new connections, and the stream runs to its end within the grace period."""
    # NOTE: paced at 0.02 s a decode step, the 97 tokens left after the third chunk take 1.9 s at least, on
    # any machine: the stream is still running when the signal arrives.
    with serve_process(api_model, "--served-model-name", "tiny", "--shutdown-grace-s", "120",
                       decode_delay_s=0.02) as server:
        body = {"model": "tiny", "messages": HI, "max_tokens": 100, "stream": True, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            data = _data_lines(lines, 3)
            server.proc.send_signal(signal.SIGTERM)
            assert _refused(server.base), "the server kept accepting connections after SIGTERM"
            data += _data_lines(lines)
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["usage"]["completion_tokens"] == 100
        assert server.proc.wait(30) in GRACEFUL_EXIT


def test_sigterm_ends_streams_well_formed_when_the_grace_period_ends(api_model: Path) -> None:
    """A stream still running when the grace period ends gets an OpenAI error event and `data: [DONE]`, and its
    chunked body is terminated: httpx and the openai SDK both read it to the end, without an incomplete read."""
    grace_s = 1.0
    # NOTE: paced at 0.05 s a decode step, 1900 tokens take 95 s at least: far longer than the grace period on
    # any machine, so both streams are still running when it ends.
    with serve_process(api_model, "--served-model-name", "tiny", "--shutdown-grace-s", str(grace_s),
                       decode_delay_s=0.05) as server:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1900, "stream": True,
                "temperature": 0, "ignore_eos": True}
        sdk_chunks: list = []
        sdk_error: list[BaseException] = []
        sdk_started = threading.Event()

        def read_with_the_sdk() -> None:
            client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60)
            try:
                for chunk in client.chat.completions.create(
                        model="tiny", messages=HI, max_tokens=1900, stream=True, temperature=0,
                        extra_body={"ignore_eos": True}):
                    sdk_chunks.append(chunk)
                    if len(sdk_chunks) == 3:
                        sdk_started.set()
            except BaseException as exc:  # noqa: BLE001 (asserted below)
                sdk_error.append(exc)
            finally:
                sdk_started.set()

        sdk_reader = threading.Thread(target=read_with_the_sdk)
        sdk_reader.start()
        with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            data = _data_lines(lines, 3)
            assert sdk_started.wait(60) and not sdk_error, sdk_error
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            data += _data_lines(lines)  # to the end: an incomplete body would raise here
        ended_s = time.monotonic() - signalled
        sdk_reader.join(60)

        # httpx (a completions stream): its chunks, then the error event and [DONE]; no finish_reason.
        assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
        error = json.loads(data[-2])["error"]
        assert error["code"] == "shutting_down" and error["type"] == "service_unavailable", error
        assert set(error) == {"message", "type", "param", "code"}
        chunks = [json.loads(d) for d in data[:-2]]
        assert len(chunks) >= 3 and all(c["object"] == "text_completion" for c in chunks)
        assert not any(c["choices"][0]["finish_reason"] for c in chunks)
        # The openai SDK (a chat stream): its chunks, then the error event raised as an APIError (not a
        # connection error).
        assert len(sdk_chunks) >= 3
        assert len(sdk_error) == 1 and type(sdk_error[0]) is openai.APIError, sdk_error
        assert sdk_error[0].body["code"] == "shutting_down"
        # Within the grace period (plus sse-starlette's half-second shutdown poll); a generous bound for a
        # slow machine, far below the 95 s the streams would otherwise run.
        assert ended_s < grace_s + 15
        assert server.proc.wait(30) in GRACEFUL_EXIT
        assert "ASGI callable returned without completing response" not in server.stderr()


def test_a_model_that_fails_to_load_exits_1(api_model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(api_model, broken)
    (broken / "model.onnx").write_bytes(b"this is not an onnx file")
    with serve_process(broken, wait_ready=False) as server:
        assert server.proc.wait(60) == 1
        assert "loading the model failed" in server.stderr()


def test_an_unknown_model_name_exits_1_before_listening(tmp_path: Path) -> None:
    with serve_process(tmp_path / "no-such-model", wait_ready=False) as server:
        assert server.proc.wait(60) == 1
        assert "cannot resolve model" in server.stderr()
