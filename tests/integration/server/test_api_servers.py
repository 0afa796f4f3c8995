"""`ortserve serve --api-server-count 2`: two API processes in front of one engine process, on the real default
model (SmolLM2). Many concurrent streamed and non-streamed requests answer as a one-process server answers, both API
processes serve (the ``ortserve-api-server`` header), a client that leaves frees its row, SIGTERM and a killed parent
leave no process behind, and combinations that cannot work are refused at start-up.

"Still running" holds by construction: the engine is paced (paced_serve: a sleep before each decode step).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.greedy_close import TOP_K, GreedyRun, assert_greedy_close
from tests.integration.server.conftest import ServeProcess, metrics_samples, serve_process

PROMPTS = [f"Name {n} animals that live in the sea." for n in range(2, 12)]
MAX_TOKENS = 12
GRACEFUL_EXIT = (0, -signal.SIGTERM)
pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from /proc")


def _children(pid: int) -> list[int]:
    """Every process below ``pid`` (API processes, the engine process, multiprocessing's resource tracker)."""
    found = [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return found + [g for c in found for g in _children(c)]


def _gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    """The pids still alive (not exited, not zombies) after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
            except FileNotFoundError:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two(default_model: Path) -> Iterator[ServeProcess]:
    with serve_process(default_model, "--served-model-name", "smol", "--api-server-count", "2", "--max-batch", "8",
                       decode_delay_s=0.02) as server:
        yield server


def _answers(base: str, n_requests: int) -> list[tuple[str, GreedyRun, str]]:
    """``n_requests`` concurrent greedy chats over PROMPTS, every other one streamed: (text, tokens with their
    top-k log-probabilities, answering process)."""
    asked = dict(model="smol", max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=TOP_K)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, GreedyRun, str]:
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        if i % 2:
            raw = await client.chat.completions.with_raw_response.create(messages=messages, **asked)
            answer = raw.parse()
            choice = answer.choices[0]
            assert answer.usage.completion_tokens <= MAX_TOKENS and choice.finish_reason
            return (choice.message.content, GreedyRun.from_openai(choice.logprobs, choice.finish_reason),
                    raw.headers.get("ortserve-api-server", ""))
        async with client.chat.completions.with_streaming_response.create(messages=messages, stream=True,
                                                                          **asked) as raw:
            choices = [c.choices[0] for c in [c async for c in await raw.parse()] if c.choices]
            finish = [c.finish_reason for c in choices if c.finish_reason]
            assert finish
            content = [entry for c in choices if c.logprobs for entry in c.logprobs.content or ()]
            return ("".join(c.delta.content or "" for c in choices),
                    GreedyRun.from_openai({"content": content}, finish[0]), raw.headers.get("ortserve-api-server", ""))

    async def run() -> list[tuple[str, GreedyRun, str]]:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n_requests)))

    return asyncio.run(run())


def test_concurrent_requests_answer_as_one_process_does_and_both_processes_serve(
        two: ServeProcess, default_model: Path) -> None:
    answers = _answers(two.base, 24)
    with serve_process(default_model, "--served-model-name", "smol", "--max-batch", "8") as one:
        reference = _answers(one.base, len(PROMPTS))
    assert {process for _, _, process in reference} == {""}  # one process: no header
    assert all(text and "".join(run.tokens) == text for text, run, _ in answers + reference)  # logprobs came
    # NOTE(tests): which requests share a decode batch differs between the two servers and from run to run, and a
    # lone row rounds differently from a row among others on AVX2 (tests/greedy_close.py): equal up to a near-tie.
    # An answer routed to the wrong request parts from its prompt's reference at a choice that is no near-tie.
    for i, (text, run, _) in enumerate(answers):
        _, expected, _ = reference[i % len(PROMPTS)]
        assert_greedy_close(expected, run, what=f"request {i} ({PROMPTS[i % len(PROMPTS)]!r}: {text!r})")
    served = Counter(process for _, _, process in answers)
    assert set(served) == {"0", "1"}, served


def test_health_models_and_engine_gauges_answer_from_either_process(two: ServeProcess) -> None:
    seen: dict[str, dict[str, float]] = {}
    for _ in range(40):  # new connections land on either process
        with httpx.Client(timeout=10) as http:
            health = http.get(f"{two.base}/health")
            models = http.get(f"{two.base}/v1/models")
            metrics = http.get(f"{two.base}/metrics")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert [m["id"] for m in models.json()["data"]] == ["smol"]
        seen[metrics.headers["ortserve-api-server"]] = metrics_samples(metrics.text)
        if len(seen) == 2:
            break
    assert set(seen) == {"0", "1"}
    for samples in seen.values():  # the engine's gauges, as the one engine process reports them
        assert samples["ortserve_kv_slots_free"] == 8 and samples["ortserve_requests_running"] == 0
    assert seen["0"]["ortserve_engine_steps_total"] == seen["1"]["ortserve_engine_steps_total"] > 0


def test_a_client_that_leaves_frees_its_row(two: ServeProcess) -> None:
    # paced at 0.02 s a decode step, 1900 tokens take 38 s at least: the stream runs when the client leaves
    body = {"model": "smol", "messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 1900,
            "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{two.base}/v1/chat/completions", json=body) as r:
            process = r.headers["ortserve-api-server"]
            for n, line in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
                if n == 2:
                    running = metrics_samples(httpx.get(f"{two.base}/metrics", timeout=10).text)
                    assert running["ortserve_requests_running"] == 1 and running["ortserve_kv_slots_free"] == 7
                    break  # leaving closes the connection mid-stream
    assert process in ("0", "1")
    deadline = time.monotonic() + 10
    while True:
        m = metrics_samples(httpx.get(f"{two.base}/metrics", timeout=10).text)
        if m["ortserve_kv_slots_free"] == 8 and m["ortserve_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_sigterm_finishes_a_stream_then_leaves_no_process(default_model: Path) -> None:
    with serve_process(default_model, "--served-model-name", "smol", "--api-server-count", "2",
                       "--shutdown-grace-s", "60", decode_delay_s=0.02) as server:
        children = _children(server.proc.pid)
        assert len(children) >= 3  # two API processes and the engine process (and the resource tracker)
        body = {"model": "smol", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 60,
                "stream": True, "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
        data = []
        with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, (r.read(), server.stderr()[-3000:])
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data.append(line[6:])
                    if len(data) == 3:
                        server.proc.send_signal(signal.SIGTERM)
        assert len(data) >= 2, (data, server.stderr()[-3000:])
        assert data[-1] == "[DONE]" and '"completion_tokens":60' in data[-2]  # drained, not cut
        assert server.proc.wait(60) in GRACEFUL_EXIT
        assert _gone(children) == []
        log = server.stderr()
        assert "Traceback" not in log and "has exited" not in log, log[-3000:]


def test_a_killed_parent_leaves_no_process(default_model: Path) -> None:
    with serve_process(default_model, "--served-model-name", "smol", "--api-server-count", "2") as server:
        children = _children(server.proc.pid)
        server.proc.kill()
        server.proc.wait(10)
        assert _gone(children, 30.0) == []


def test_a_dead_api_process_stops_the_server_with_a_clear_log(default_model: Path) -> None:
    with serve_process(default_model, "--served-model-name", "smol", "--api-server-count", "2",
                       "--log-level", "info") as server:
        children = _children(server.proc.pid)
        pids = re.search(r"2 API processes \(pids (\d+), (\d+)\)", server.stderr())
        assert pids is not None, server.stderr()[-3000:]
        os.kill(int(pids.group(2)), signal.SIGKILL)
        assert server.proc.wait(60) == 1
        assert _gone(children) == []
        assert f"API process 1 (pid {pids.group(2)}) has exited" in server.stderr()


@pytest.mark.parametrize(("args", "words"), [
    (("--no-engine-process",), "--no-engine-process"),
    (("--embedding-model", "all-minilm-l6-v2"), "embeddings"),
    (("--models", "smollm2-135m-instruct"), "several models"),
])
def test_combinations_that_cannot_work_are_refused_at_start_up(default_model: Path, args: tuple, words: str) -> None:
    with serve_process(default_model, "--api-server-count", "2", *args, wait_ready=False) as server:
        assert server.proc.wait(60) == 2
        assert words in server.stderr() and "--api-server-count 2" in server.stderr()
