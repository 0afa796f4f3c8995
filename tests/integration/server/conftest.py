"""Fixtures for the API tests: real uvicorn servers on 127.0.0.1 (free ports) serving real models.

`api_server` serves a small synthetic model (built from random weights, no download) loaded through the
app's own lifespan; `serve_app` runs any app (e.g. one sharing that engine) in a background thread;
`serve_process` runs `python -m server serve` as its own process (signals, exit codes, RSS).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app, engine_config_from
from server.settings import Settings


def metrics_samples(text: str, model: str | None = None) -> dict[str, float]:
    """Every sample of a /metrics text as {'name{label="v"}': value} (labels sorted).

    The ortserve_* series carry vLLM's model_name label; here they are summed over it (PromQL's
    ``sum without (model_name)``: the server's total, a one-model server's one series), or with ``model`` only
    that model's are kept, its label dropped. The vllm:* series keep their labels.
    """
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            if s.name.startswith("ortserve_"):
                assert "model_name" in labels, f"{s.name} has no model_name label"
                if labels.pop("model_name") != model and model is not None:
                    continue
            key = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            key = f"{s.name}{{{key}}}" if key else s.name
            samples[key] = samples.get(key, 0.0) + s.value if s.name.startswith("ortserve_") else s.value
    return samples


@dataclass
class RunningServer:
    base: str  # http://127.0.0.1:PORT
    app: FastAPI

    @property
    def url(self) -> str:
        return f"{self.base}/v1"

    @property
    def engine(self) -> Any:
        return self.app.state.ortserve.engine

    @property
    def model(self) -> str:
        return self.app.state.ortserve.served_model_name

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60)
        return openai.OpenAI(base_url=self.url, **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60)
        return openai.AsyncOpenAI(base_url=self.url, **kwargs)

    def metrics(self, model: str | None = None) -> dict[str, float]:
        """``metrics_samples`` of this server's /metrics (``model``: that model's ortserve_* series alone)."""
        return metrics_samples(httpx.get(f"{self.base}/metrics", timeout=10).text, model)

    def wait_idle(self, timeout_s: float = 1.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits; returns the last sample (asserted by callers)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if (m["ortserve_requests_running"] == 0 and m["ortserve_requests_waiting"] == 0) \
                    or time.monotonic() > deadline:
                return m
            time.sleep(0.02)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def wait_healthy(base: str, alive: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> None:
    """Poll GET {base}/health until it answers 200; RuntimeError once `alive()` is false or time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = None
        with contextlib.suppress(httpx.TransportError):
            status = httpx.get(f"{base}/health", timeout=2).status_code
        if status == 200:
            return
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"server did not become ready (health {status})")
        time.sleep(poll_s)


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM a test server process and reap it; SIGKILL if it has not exited within `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


ROOT = Path(__file__).resolve().parents[3]


@dataclass
class ServeProcess:
    base: str
    proc: subprocess.Popen
    log: Any  # the process's stderr, a temporary file

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()


def wait_for(check: Callable[[], Any], timeout_s: float = 120.0, every_s: float = 0.1) -> Any:
    """Call ``check`` every ``every_s`` until it returns something true, and return that; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every_s)


def summed_usage(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """What a batch's ``usage`` must be: its output file lines' usage summed, each line once, in the Batch shape
    (Responses lines: input/output tokens; chat, completions and embeddings lines: prompt/completion tokens)."""
    usages = [o["response"]["body"]["usage"] for o in outputs]

    def total(key: str, detail: str | None = None) -> int:
        return sum(((u.get(key) or {}).get(detail, 0) if detail else u.get(key, 0)) for u in usages)

    shape = "input" if usages and "input_tokens" in usages[0] else "prompt"
    i, o = (("input_tokens", "output_tokens") if shape == "input" else ("prompt_tokens", "completion_tokens"))
    return {"input_tokens": total(i), "input_tokens_details": {"cached_tokens": total(f"{i}_details", "cached_tokens")},
            "output_tokens": total(o), "output_tokens_details": {
                "reasoning_tokens": total(f"{o}_details", "reasoning_tokens")},
            "total_tokens": total("total_tokens")}


@contextlib.contextmanager
def serve_process(model: Path, *args: str, ready_timeout_s: float = 120.0, wait_ready: bool = True,
                  env: dict[str, str] | None = None, decode_delay_s: float | None = None,
                  with_stdout: bool = False) -> Iterator[ServeProcess]:
    """`python -m server serve --model MODEL ARGS` on a free 127.0.0.1 port until the block exits.

    Args:
        wait_ready: wait for /health 200 before yielding (False: for processes that are meant to fail).
        env: extra environment; ORTSERVE_* variables of the test's own environment are not passed on.
        decode_delay_s: run the CLI through tests/integration/server/paced_serve.py, whose engine sleeps this
            long before every decode step (a stream of N tokens then lasts N * decode_delay_s at least).
        with_stdout: the process's stdout (uvicorn's access log) goes to the same log as its stderr.
    """
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()  # NOTE: a tiny window in which another process could take the port
    launcher = ["-m", "server"] if decode_delay_s is None else \
        ["-m", "tests.integration.server.paced_serve", str(decode_delay_s)]
    cmd = [sys.executable, *launcher, "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--provider", "cpu", "--log-level", "warning", *args]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("ORTSERVE_") or k == "ORTSERVE_CACHE_DIR"}
    # NOTE: stderr goes to a file, not a pipe: a full pipe nobody reads would block the server.
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**base_env, "PYTHONPATH": str(ROOT), **(env or {})},
                            stdout=log if with_stdout else subprocess.DEVNULL, stderr=log, text=True)
    served = ServeProcess(f"http://127.0.0.1:{port}", proc, log)
    try:
        if wait_ready:
            try:
                wait_healthy(served.base, lambda: proc.poll() is None, ready_timeout_s, poll_s=0.1)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}: {served.stderr()[-2000:]}") from None
        yield served
    finally:
        if proc.poll() is None:
            stop_process(proc, 30)
        proc.wait(10)
        log.close()


@contextlib.contextmanager
def serve_app(app: FastAPI, ready_timeout_s: float = 120.0) -> Iterator[RunningServer]:
    """Run `app` under uvicorn in a thread until the block exits; waits for /health 200 first."""
    sock = free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{port}")
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, thread.is_alive, ready_timeout_s)
        yield RunningServer(base=base, app=app)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def keep_prior_draft_costs(running: RunningServer) -> RunningServer:
    """Make the in-process engine of ``running`` price draft checks by the prior law, never by this machine's clock.

    NOTE(tests): whether a request drafts (and so whether its tokens run as one row or as a draft check of several)
    then depends on its tokens alone, not on how loaded the machine is; the same request sent alone twice runs the
    same row counts and gets the same greedy text on every CPU (docs/development.md, "Tests on model output").
    """
    running.engine._core.scheduler.check_cost.freeze()  # test only: before any request
    return running


@pytest.fixture(scope="session")
def api_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic model with a 2048-token context (long streams for disconnect/concurrency tests)."""
    from engine.builder import SyntheticSpec, build_synthetic

    return build_synthetic(tmp_path_factory.mktemp("api") / "model", SyntheticSpec(max_length=2048))


def fault_loader(fault_injector: Callable[[Any], None]) -> Callable[[Settings], Any]:
    """An app loader that builds the real engine with this test-only fault injector (e.g. a DecodeGate)."""

    def load(settings: Settings) -> Any:
        from engine.async_engine import AsyncEngine

        config = replace(engine_config_from(settings), fault_injector=fault_injector)
        return AsyncEngine.from_model_dir(settings.model, config)

    return load


def api_settings(model: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"model": str(model), "served_model_name": "tiny", "max_batch": 8,
                              "max_queue": 16, "shutdown_grace_s": 2.0, "log_level": "warning"}
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="session")
def api_server(api_model: Path) -> Iterator[RunningServer]:
    """The synthetic model served by an app that loads its own engine (lifespan loader, real sessions)."""
    with serve_app(create_app(api_settings(api_model))) as running:
        yield keep_prior_draft_costs(running)


def parse_chunks(events: list[str]) -> list[dict]:
    """JSON chunks of an SSE stream that must end with exactly one [DONE]."""
    assert events and events[-1] == "[DONE]", events[-3:]
    assert events.count("[DONE]") == 1
    return [json.loads(e) for e in events[:-1]]
