"""Fixtures of the reliability tests: real servers on the tiny model, a fault plan, OpenAI error checks.

`rel_server` is the server that gets abused (with a test-only fault injector in its engine); `fresh_server`
serves the same model and is never abused, so it gives the reference output of a fresh server.
`serve_process` (from tests/integration/server/conftest.py) runs `python -m server serve` as its own process.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.types import StepInfo
from server.app import create_app
from server.settings import Settings
from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close
from tests.integration.server.conftest import (  # noqa: F401 (fault_loader and serve_process re-exported)
    RunningServer, fault_loader, keep_prior_draft_costs, serve_app, serve_process,
)

PROMPT = [{"role": "user", "content": "Tell me a story about a robot"}]


class InjectedFault(RuntimeError):
    """What FaultPlan raises inside an engine step (stands for a device or runtime failure)."""


class FaultPlan:
    """A test-only `EngineConfig.fault_injector`: fails the next model runs that match what was armed.

    Usage: `plan.arm("decode", request_id)` fails the next decode run containing that request;
    `plan.arm("prefill")` fails the next prefill run of any request; `skip=n` lets n matching runs pass
    first. Called on the engine core thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[list] = []  # [kind, request_id or None, runs still to let pass]
        self.fired: list[StepInfo] = []

    def arm(self, kind: str, request_id: str | None = None, skip: int = 0) -> None:
        with self._lock:
            self._armed.append([kind, request_id, skip])

    def disarm(self) -> None:
        with self._lock:
            self._armed.clear()

    def __call__(self, info: StepInfo) -> None:
        with self._lock:
            for index, (kind, request_id, skip) in enumerate(self._armed):
                if info.kind == kind and (request_id is None or request_id in info.request_ids):
                    if skip > 0:
                        self._armed[index][2] -= 1
                        return
                    del self._armed[index]
                    self.fired.append(info)
                    raise InjectedFault(f"injected fault in {info.kind} step {info.step}")


def rel_settings(model: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"model": str(model), "served_model_name": "tiny", "max_batch": 8,
                              "max_queue": 64, "shutdown_grace_s": 2.0, "log_level": "warning"}
    values.update(overrides)
    return Settings(**values)


@dataclass
class AbusedServer:
    running: RunningServer
    faults: FaultPlan = field(default_factory=FaultPlan)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.running, name)


@pytest.fixture(scope="session")
def rel_server(tiny_model: Path) -> Iterator[AbusedServer]:
    """The tiny model behind a server whose engine carries a FaultPlan (disarmed after every use)."""
    plan = FaultPlan()
    with serve_app(create_app(rel_settings(tiny_model), loader=fault_loader(plan))) as running:
        yield AbusedServer(keep_prior_draft_costs(running), plan)


@pytest.fixture(autouse=True)
def _disarm_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "rel_server" in request.fixturenames:
        faults = request.getfixturevalue("rel_server").faults
        faults.disarm()
        faults.fired.clear()


@pytest.fixture(scope="session")
def fresh_server(tiny_model: Path) -> Iterator[RunningServer]:
    """The same model on a server nothing else touches: the reference for 'output of a fresh server'."""
    with serve_app(create_app(rel_settings(tiny_model))) as running:
        yield keep_prior_draft_costs(running)


def greedy_chat(base_url: str, messages: list[dict] | None = None, max_tokens: int = 24,
                headers: dict[str, str] | None = None) -> tuple[str, int]:
    """(text, completion_tokens) of one greedy, eos-ignoring chat completion."""
    body = {"model": "tiny", "messages": messages or PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]


def greedy_run(base_url: str, messages: list[dict] | None = None, max_tokens: int = 24) -> GreedyRun:
    """``greedy_chat``'s answer as tokens with each step's top-k (tests/greedy_close.py)."""
    body = {"model": "tiny", "messages": messages or PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": TOP_K}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    run = GreedyRun.from_openai(choice["logprobs"], choice["finish_reason"])
    assert len(run.tokens) == max_tokens and choice["message"]["content"]
    return run


def assert_answers_as_fresh(base_url: str, fresh_url: str, max_tokens: int = 24) -> None:
    """The same greedy chat alone on each server: ``base_url`` answers as the fresh server does.

    NOTE(tests): up to a near-tie of the tiny model (tests/greedy_close.py): each server times its own draft checks,
    so the two may run the request's tokens in different row counts. What a fault could leave behind (a stale KV
    row, a request's state in another's slot) parts the answers at a choice that is no near-tie.
    """
    assert_greedy_close(greedy_run(fresh_url, max_tokens=max_tokens), greedy_run(base_url, max_tokens=max_tokens),
                        TINY_MAX_GAP_NATS, "the abused server against a fresh one")


def assert_openai_error(status: int, body: bytes | str, *, expect_status: int | None = None) -> dict:
    """Asserts an OpenAI-shaped error body without any trace of Python internals; returns `error`."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    assert status >= 400, (status, text[:300])
    if expect_status is not None:
        assert status == expect_status, (status, text[:300])
    assert_no_internals(text)
    data = json.loads(text)
    assert set(data) == {"error"}, text[:300]
    error = data["error"]
    assert isinstance(error.get("message"), str) and error["message"], text[:300]
    assert isinstance(error.get("type"), str) and error["type"], text[:300]
    assert {"param", "code"} <= set(error), text[:300]
    return error


def assert_api_error(path: str, status: int, body: bytes | str) -> dict:
    """The error shape of ``path``'s API: Anthropic's on the Messages routes, Ollama's (``{"error": "..."}``) on
    its native /api/ routes, OpenAI's elsewhere; returns `error`."""
    if path.startswith("/api/"):
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        assert status >= 400, (status, text[:300])
        assert_no_internals(text)
        data = json.loads(text)
        assert set(data) == {"error"} and isinstance(data["error"], str) and data["error"], text[:300]
        return {"message": data["error"]}
    if not (path == "/v1/messages" or path.startswith("/v1/messages/")):
        return assert_openai_error(status, body)
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    assert status >= 400, (status, text[:300])
    assert_no_internals(text)
    data = json.loads(text)
    assert set(data) == {"type", "error"} and data["type"] == "error", text[:300]
    error = data["error"]
    assert isinstance(error.get("message"), str) and error["message"], text[:300]
    assert isinstance(error.get("type"), str) and error["type"], text[:300]
    return error


_INTERNALS = ("Traceback (most recent call last)", 'File "/', ".py\", line ", "site-packages")


def assert_no_internals(text: str) -> None:
    for marker in _INTERNALS:
        assert marker not in text, f"response leaks {marker!r}: {text[:500]}"


def wait_idle_engine(engine: Any, timeout_s: float = 10.0) -> Any:
    """Poll engine.stats() until nothing runs or waits and every slot is free; returns the stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = engine.stats()
        if (s.num_running == 0 and s.num_waiting == 0 and s.num_slots_free == s.num_slots_total) \
                or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")




def named_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """POST ``body`` as a stream to ``url`` (200 expected) and read its SSE events: ``(event name, data)``."""

    async def read() -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", url, json=body) as r:
                assert r.status_code == 200
                name = None
                async for line in r.aiter_lines():
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        events.append((name, json.loads(line[6:])))
        return events

    return asyncio.run(read())
