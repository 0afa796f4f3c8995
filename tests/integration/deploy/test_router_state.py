"""Two replicas that share one PostgreSQL (--state-url) behind a real vllm-router (deploy/router/ortserve-router.sh,
round_robin): a conversation of stored responses goes on whichever replica a turn lands on, and a response made on
one replica is read from the other."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from deploy_tools import DEPLOY, ROOT
from replica_tools import free_port, free_port_run

SCRIPT = DEPLOY / "router" / "ortserve-router.sh"
STARTUP_TIMEOUT_S = 240.0
MODEL = "smollm2-135m-instruct"


def _wait_ok(url: str, proc: subprocess.Popen, timeout_s: float, logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the router script exited: {logs.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{url} not ready after {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def fleet(default_model: Path, postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str,
                                                                                                             list[str]]]:
    tmp = tmp_path_factory.mktemp("router-state")
    base_port, router_port = free_port_run(2), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTSERVE_") or k == "ORTSERVE_CACHE_DIR"}
    env.update(REPLICAS="2", BASE_PORT=str(base_port), ROUTER_PORT=str(router_port),
               ROUTER_METRICS_PORT=str(free_port()), POLICY="round_robin", RUN_DIR=str(tmp / "run"),
               PYTHONPATH=str(ROOT), ORTSERVE=f"{sys.executable} -m server",
               VLLM_ROUTER=str(Path(sys.executable).parent / "vllm-router"))
    log = tmp / "script.log"
    argv = ["sh", str(SCRIPT), "--model", str(default_model), "--provider", "cpu", "--max-batch", "4",
            "--intra-op-threads", "1", "--log-level", "warning", "--state-url", postgres_url]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    replicas = [f"http://127.0.0.1:{base_port + i}" for i in range(2)]
    router = f"http://127.0.0.1:{router_port}"
    try:
        for base in replicas:
            _wait_ok(f"{base}/health", proc, STARTUP_TIMEOUT_S, log)
        _wait_ok(f"{router}/health", proc, 60, log)
        deadline = time.monotonic() + 60
        while not all(w["is_healthy"] for w in httpx.get(f"{router}/workers", timeout=5).json()["workers"]):
            assert time.monotonic() < deadline, "the router never saw both replicas healthy"
            time.sleep(0.25)
        yield router, replicas
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_previous_response_id_across_two_replicas_behind_the_router(fleet: tuple[str, list[str]]) -> None:
    router, replicas = fleet
    previous = None
    for turn in range(4):
        r = client(router).responses.create(model=MODEL, input=f"Turn {turn}.", max_output_tokens=3, temperature=0,
                                            previous_response_id=previous)
        previous = r.id
        for base in replicas:  # both replicas read it, whichever made it
            assert client(base).responses.retrieve(r.id).output_text == r.output_text
    alone = client(replicas[0]).responses.create(model=MODEL, input="Turn 4.", max_output_tokens=2, temperature=0)
    follow = client(replicas[1]).responses.create(model=MODEL, input="Turn 4.", max_output_tokens=2, temperature=0,
                                                  previous_response_id=previous)
    assert follow.usage.input_tokens > alone.usage.input_tokens + 4 * 4  # four earlier turns came first
    counts = [sum(v for k, v in _samples(base).items() if k.startswith("ortserve_requests_total{"))
              for base in replicas]
    assert all(c >= 2 for c in counts), counts  # round_robin: both replicas answered turns


def _samples(base: str) -> dict[str, float]:
    from tests.integration.server.conftest import metrics_samples

    return metrics_samples(httpx.get(f"{base}/metrics", timeout=10).text)
