"""The API over an engine in its own process (--engine-process): the same answers as in-process, structured output and
its 400, /metrics, and the engine process killed mid-stream or stopped with the server.

Real uvicorn servers on the synthetic model; "still running" holds by construction (tests.pacing.ProcessDecodeGate,
or paced_serve's sleep before each decode step).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from server.app import create_app
from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close
from tests.integration.server.conftest import RunningServer, api_settings, fault_loader, serve_app, serve_process
from tests.pacing import ProcessDecodeGate

HI = [{"role": "user", "content": "Tell me a long story"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
GRACEFUL_EXIT = (0, -signal.SIGTERM)


@pytest.fixture(scope="module")
def proc_gate() -> ProcessDecodeGate:
    return ProcessDecodeGate()


@pytest.fixture(scope="module")
def proc_server(api_model: Path, proc_gate: ProcessDecodeGate) -> Iterator[RunningServer]:
    """The synthetic model with its engine in its own process, loaded through the app's lifespan."""
    app = create_app(api_settings(api_model, engine_process=True), loader=fault_loader(proc_gate))
    with serve_app(app) as running:
        yield running
    proc_gate.open()


def _chat(running: RunningServer, **kwargs) -> openai.types.chat.ChatCompletion:
    return running.client().chat.completions.create(model="tiny", messages=HI, temperature=0, **kwargs)


def test_streams_and_n_choices_equal_the_in_process_server(api_server: RunningServer,
                                                           proc_server: RunningServer) -> None:
    assert proc_server.engine.engine_process and not api_server.engine.engine_process

    def streamed(running) -> tuple[str, GreedyRun]:
        chunks = list(running.client().chat.completions.create(
            model="tiny", messages=HI, max_tokens=24, stream=True, temperature=0, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True}, logprobs=True, top_logprobs=TOP_K))
        assert chunks[-1].usage.completion_tokens == 24
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, GreedyRun.from_openai_stream(chunks)

    (text, run), (_, expected) = streamed(proc_server), streamed(api_server)
    assert text and len(run.tokens) == 24
    # NOTE(tests): the engine process times its own draft checks (the in-process server keeps the prior law), so
    # the two may run this request's tokens in different row counts: equal up to a near-tie
    assert_greedy_close(expected, run, TINY_MAX_GAP_NATS, "the engine process's stream")
    # NOTE(tests): exact: seeded sampling, the same request on both
    kwargs = {"max_tokens": 10, "n": 3, "seed": 5, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    choices = [[c.message.content for c in r.client().chat.completions.create(model="tiny", messages=HI, **kwargs)
                .choices] for r in (api_server, proc_server)]
    assert choices[1] == choices[0] and len(set(choices[1])) > 1


def test_a_json_schema_answer_validates_and_a_bad_schema_is_a_400_before_any_output(
        proc_server: RunningServer) -> None:
    answer = _chat(proc_server, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "array", "uniqueItems": True}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            _chat(proc_server, max_tokens=8, stream=stream, response_format=bad)
        assert err.value.body["param"] == "response_format" and "uniqueItems" in err.value.body["message"]
    assert proc_server.engine.is_running


def test_metrics_count_the_engine_process_work(proc_server: RunningServer) -> None:
    before = proc_server.metrics()
    assert _chat(proc_server, max_tokens=12, extra_body={"ignore_eos": True}).usage.completion_tokens == 12
    m = proc_server.wait_idle(5.0)
    deadline = time.monotonic() + 5
    while m["ortserve_engine_steps_total"] == before["ortserve_engine_steps_total"] and time.monotonic() < deadline:
        time.sleep(0.02)
        m = proc_server.metrics()
    for name in ("ortserve_engine_steps_total", "ortserve_engine_thread_cpu_seconds_total",
                 "ortserve_engine_process_cpu_seconds_total", "ortserve_prompt_tokens_total"):
        assert m[name] > before.get(name, 0.0), name
    assert m["ortserve_generation_tokens_total"] - before["ortserve_generation_tokens_total"] == 12
    assert m["ortserve_kv_slots_free"] == 8


# NOTE: the full queue's 429 over an engine process: test_api_concurrency.test_full_queue_is_429_with_retry_after.


def _engine_child(server_pid: int) -> int:
    """The engine process among the server's children (multiprocessing's resource tracker is the other one)."""
    # NOTE: each thread has its own list: the engine is loaded (and its process started) in a worker thread
    children = [pid for task in Path(f"/proc/{server_pid}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    for pid in map(int, children):
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no engine process among {children}")


def _stream_data(base: str, body: dict, *, at: int, then: Callable[[], object], timeout_s: float) -> list[str]:
    """A streamed chat completion's SSE data payloads, calling ``then()`` once the ``at``-th has arrived."""
    data = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=timeout_s) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
                if len(data) == at:
                    then()
    return data


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # exited; reaped by whoever adopted it
            return True
        time.sleep(0.02)
    return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from /proc")
def test_a_killed_engine_process_ends_streams_with_503_and_health_says_so(api_model: Path) -> None:
    # NOTE: paced at 0.05 s a decode step, 1900 tokens take 95 s at least: the stream is running when the kill comes.
    with serve_process(api_model, "--served-model-name", "tiny", "--engine-process", "--shutdown-grace-s", "2",
                       decode_delay_s=0.05) as server:
        child = _engine_child(server.proc.pid)
        body = {"model": "tiny", "messages": HI, "max_tokens": 1900, "stream": True, "temperature": 0,
                "ignore_eos": True}
        t0 = time.monotonic()
        data = _stream_data(server.base, body, at=2, then=lambda: os.kill(child, signal.SIGKILL), timeout_s=30)
        assert time.monotonic() - t0 < 30 and data[-1] == "[DONE]" and data.count("[DONE]") == 1
        error = json.loads(data[-2])["error"]
        assert error["code"] == "engine_unavailable" and error["type"] == "service_unavailable", error
        health = httpx.get(f"{server.base}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        after = httpx.post(f"{server.base}/v1/chat/completions", json={**body, "stream": False}, timeout=10)
        assert after.status_code == 503
        assert _gone(child)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) in GRACEFUL_EXIT


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from /proc")
def test_sigterm_lets_a_stream_finish_then_stops_the_engine_process(api_model: Path) -> None:
    with serve_process(api_model, "--served-model-name", "tiny", "--engine-process", "--shutdown-grace-s", "120",
                       decode_delay_s=0.02) as server:
        child = _engine_child(server.proc.pid)
        body = {"model": "tiny", "messages": HI, "max_tokens": 60, "stream": True, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        data = _stream_data(server.base, body, at=3, then=lambda: server.proc.send_signal(signal.SIGTERM),
                            timeout_s=60)
        assert data[-1] == "[DONE]" and json.loads(data[-2])["usage"]["completion_tokens"] == 60
        assert server.proc.wait(30) in GRACEFUL_EXIT
        assert _gone(child, 5.0)  # stopped and joined by the server, not left behind
        assert "Traceback" not in server.stderr()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from /proc")
def test_a_killed_server_leaves_no_engine_process(api_model: Path) -> None:
    with serve_process(api_model, "--served-model-name", "tiny", "--engine-process") as server:
        child = _engine_child(server.proc.pid)
        server.proc.kill()
        server.proc.wait(10)
        assert _gone(child), "the engine process outlived the server"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from /proc")
def test_ctrl_c_to_the_process_group_stops_both_processes(api_model: Path, tmp_path: Path) -> None:
    """Ctrl-C in a terminal sends SIGINT to every process of the foreground group: the engine process ignores it,
    the server shuts down as on SIGTERM, stops the engine process and reaps it (no zombie, no orphan)."""
    import subprocess
    import sys

    from tests.integration.server.conftest import ROOT, free_socket, wait_healthy

    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--model", str(api_model), "--provider", "cpu",
                             "--port", str(port), "--log-level", "warning", "--engine-process"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=log, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", lambda: proc.poll() is None, 120)
        child = _engine_child(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) in (0, -signal.SIGINT)
        assert _gone(child, 5.0)
        log.seek(0)
        text = log.read()
        # NOTE: uvicorn re-raises the SIGINT it handled once shut down, which prints a KeyboardInterrupt traceback
        # (in-process too); nothing else may be logged
        assert "ERROR" not in text and "engine" not in text, text[-3000:]
        assert not text.strip() or text.strip().endswith("KeyboardInterrupt"), text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("mode", ["--engine-process", "--no-engine-process"])
def test_a_step_trace_records_the_steps_of_a_served_request(api_model: Path, tmp_path: Path, mode: str) -> None:
    """`--step-trace FILE` on a served model: the engine's steps (in whichever process it runs) account for the
    request's tokens, the server's event-loop probe and collections write whole lines beside them (one file, two
    writers with an engine process), and the server still streams and stops cleanly."""
    trace = tmp_path / "steps.jsonl"
    with serve_process(api_model, "--served-model-name", "tiny", mode, "--step-trace", str(trace),
                       "--speculative-tokens", "0") as server:
        body = {"model": "tiny", "prompt": "one two three four five", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) in GRACEFUL_EXIT
        assert "Traceback" not in server.stderr()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]  # every line whole
    steps = [r for r in lines if "decode" in r]
    # the first token comes from the prompt's last chunk, the other 23 from decode rows; warm-up runs no steps
    assert sum(sum(r["prefill"]) for r in steps) == prompt_tokens and sum(r["decode"] for r in steps) == 23
    assert all(r["runs"] for r in steps)
    others = [r for r in lines if "decode" not in r]
    assert all(r.get("proc") in ("engine", "server") and r["ms"] >= 0 and ("gc" in r or r.get("lag")) for r in others)
