"""Scaling out on one machine: deploy/router/ortserve-router.sh runs two real CPU replicas of the default model
behind a real vllm-router process (its pip package) on loopback; LiteLLM's proxy fronts the same replicas.

- requests through the router succeed, and a multi-turn chat keeps its prefix cache: with cache_aware routing
  (and with consistent_hash on X-Session-ID) turns 2-6 report cached_tokens > 0 on >= 90% of turns;
- LiteLLM serves both replicas as one model and passes their usage through;
- a replica killed mid-run (SIGKILL, last test: it takes one replica of the module's fleet): the streams it was
  running fail, every other stream finishes, and later requests all succeed on the other replica.

The replicas run through tests/integration/server/paced_serve.py (0.02 s before every decode step), so a stream
of N tokens lasts 0.02 * N s at least: "still running when the replica dies" holds by construction.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from deploy_tools import DEPLOY, ROOT
from replica_tools import free_port, free_port_run
from tests.integration.server.conftest import metrics_samples

SCRIPT = DEPLOY / "router" / "ortserve-router.sh"
LITELLM_CONFIG = DEPLOY / "router" / "litellm.yaml"
DECODE_DELAY_S = 0.02
STARTUP_TIMEOUT_S = 240.0
MODEL = "smollm2-135m-instruct"


@dataclass
class Fleet:
    proc: subprocess.Popen[bytes]
    run_dir: Path
    router: str  # http://127.0.0.1:PORT
    replicas: list[str]  # base URLs
    log: Path
    extra: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def client(self, base: str | None = None, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=f"{base or self.router}/v1", max_retries=0, timeout=120, **kwargs)

    def replica_pid(self, i: int) -> int:
        return int((self.run_dir / f"replica-{i}.pid").read_text())

    def logs(self) -> str:
        parts = [self.log.read_text(errors="replace")[-2000:]]
        for path in sorted(self.run_dir.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)




def _wait_ok(url: str, alive, timeout_s: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            pytest.fail(f"{what} exited:\n{logs()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{what} not ready after {timeout_s:.0f} s:\n{logs()}")


def _wait_workers_healthy(router: str, n: int, logs, timeout_s: float = 60.0) -> None:
    """Until the router's own view (GET /workers) has all `n` workers healthy: it may start routing while one
    still fails its first health checks, and then sends everything to the other."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = httpx.get(f"{router}/workers", timeout=5).json()["workers"]
        if len(workers) == n and all(w["is_healthy"] for w in workers):
            return
        time.sleep(0.25)
    pytest.fail(f"the router never saw {n} healthy workers: {workers}\n{logs()}")


def _metrics(base: str) -> dict[str, float]:
    return metrics_samples(httpx.get(f"{base}/metrics", timeout=10).text)  # ortserve_*: sum without (model_name)


def _requests_done(base: str) -> float:
    m = _metrics(base)
    return sum(v for k, v in m.items() if k.startswith("ortserve_requests_total{"))


def _prefix_hits(base: str) -> float:
    m = _metrics(base)
    return sum(v for k, v in m.items() if k.startswith("vllm:prefix_cache_hits_total"))


@pytest.fixture(scope="module")
def fleet(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """ortserve-router.sh as a user runs it: 2 paced CPU replicas of the default model and its router."""
    tmp = tmp_path_factory.mktemp("router")
    base_port = free_port_run(2)
    router_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTSERVE_") or k == "ORTSERVE_CACHE_DIR"}
    env.update(
        REPLICAS="2", BASE_PORT=str(base_port), ROUTER_PORT=str(router_port), ROUTER_METRICS_PORT=str(free_port()),
        # NOTE: 1, so that the kill test's second stream already goes to the other replica (the script's
        # default, 4, would first put five streams on one).
        POLICY="cache_aware", BALANCE_ABS_THRESHOLD="1", RUN_DIR=str(tmp / "run"), PYTHONPATH=str(ROOT),
        ORTSERVE=f"{sys.executable} -m tests.integration.server.paced_serve {DECODE_DELAY_S}",
        VLLM_ROUTER=str(Path(sys.executable).parent / "vllm-router"),
    )
    log = tmp / "script.log"
    argv = ["sh", str(SCRIPT), "--model", str(default_model), "--provider", "cpu", "--max-batch", "8",
            "--intra-op-threads", "1", "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    fleet = Fleet(proc, tmp / "run", f"http://127.0.0.1:{router_port}",
                  [f"http://127.0.0.1:{base_port + i}" for i in range(2)], log)
    try:
        for i, base in enumerate(fleet.replicas):
            _wait_ok(f"{base}/health", lambda: proc.poll() is None, STARTUP_TIMEOUT_S, f"replica {i}", fleet.logs)
        _wait_ok(f"{fleet.router}/health", lambda: proc.poll() is None, 60, "the router", fleet.logs)
        _wait_workers_healthy(fleet.router, len(fleet.replicas), fleet.logs)
        yield fleet
    finally:
        for extra in fleet.extra:
            if extra.poll() is None:
                extra.terminate()
                extra.wait(30)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the script stops the router, then drains the replicas
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for i in range(2):  # NOTE: never leave a replica behind, whatever the script did
            pid_file = fleet.run_dir / f"replica-{i}.pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _system_prompt(tag: str) -> str:
    """About 160 tokens of instructions that differ from the first words on, one per conversation."""
    rules = " ".join(f"Rule {i} of {tag}: answer in one short sentence about item {i}." for i in range(10))
    return f"{tag} conversation. You are a terse assistant. {rules}"


@dataclass
class Conversation:
    """A multi-turn chat and what each turn's usage said."""

    tag: str
    headers: dict[str, str] | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)

    def turn(self, client: openai.OpenAI, model: str = MODEL) -> None:
        if not self.messages:
            self.messages.append({"role": "system", "content": _system_prompt(self.tag)})
        self.messages.append({"role": "user", "content": f"Question {len(self.prompt_tokens)}: name one colour."})
        r = client.chat.completions.create(model=model, messages=self.messages, max_tokens=8, temperature=0,
                                           extra_headers=self.headers)
        assert r.choices[0].message.content
        self.messages.append({"role": "assistant", "content": r.choices[0].message.content})
        self.prompt_tokens.append(r.usage.prompt_tokens)
        self.cached_tokens.append(r.usage.prompt_tokens_details.cached_tokens or 0)

    def kept_prefix(self) -> list[bool]:
        """For turns 2 on: did the turn reuse its whole previous prompt (it landed on the replica holding the
        conversation)? A turn sent elsewhere reuses at most an older turn's prompt there, or nothing."""
        return [cached >= prev for prev, cached in zip(self.prompt_tokens, self.cached_tokens[1:])]


def _run_turns(client: openai.OpenAI, conversations: list[Conversation], turns: int = 6) -> None:
    """Every conversation up to `turns` turns, interleaved turn by turn (each replica serves the others meanwhile)."""
    while any(len(c.prompt_tokens) < turns for c in conversations):
        for c in conversations:
            if len(c.prompt_tokens) < turns:
                c.turn(client)


def _share_kept(conversations: list[Conversation]) -> float:
    kept = [k for c in conversations for k in c.kept_prefix()]
    return sum(kept) / len(kept)


def _start_router(fleet: Fleet, policy: str) -> str:
    """Another vllm-router process over the fleet's replicas; returns its base URL (stopped at teardown)."""
    port = free_port()
    log = fleet.run_dir / f"router-{policy}.log"
    with log.open("wb") as out:
        router = subprocess.Popen(
            [str(Path(sys.executable).parent / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
             "--policy", policy, "--worker-urls", *fleet.replicas, "--worker-startup-check-interval", "1",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=out, stderr=subprocess.STDOUT)
    fleet.extra.append(router)
    base = f"http://127.0.0.1:{port}"
    router_log = lambda: log.read_text(errors="replace")[-3000:]  # noqa: E731
    _wait_ok(f"{base}/health", lambda: router.poll() is None, 60, f"the {policy} router", router_log)
    _wait_workers_healthy(base, len(fleet.replicas), router_log)
    return base


def test_requests_through_the_router_succeed(fleet: Fleet) -> None:
    client = fleet.client()
    assert MODEL in {m.id for m in client.models.list()}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                       max_tokens=5, temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count."}],
                                                 max_tokens=5, temperature=0, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_cache_aware_routing_keeps_each_conversation_on_its_prefix(fleet: Fleet) -> None:
    conversations = [Conversation("Alpha"), Conversation("Bravo")]
    _run_turns(fleet.client(), conversations)
    assert _share_kept(conversations) >= 0.9, [(c.prompt_tokens, c.cached_tokens) for c in conversations]
    assert all(cached > 0 for c in conversations for cached in c.cached_tokens[1:])


def test_round_robin_loses_the_prefix_the_checks_above_look_for(fleet: Fleet) -> None:
    """The control: spread turn by turn over two replicas, a conversation's next turn lands where its previous
    one did not, so the criterion of the tests above fails; they measure routing, not the prefix cache alone."""
    router = _start_router(fleet, "round_robin")
    conversation = Conversation("Kilo")
    _run_turns(fleet.client(router), [conversation])
    assert _share_kept([conversation]) <= 0.5, (conversation.prompt_tokens, conversation.cached_tokens)


def test_consistent_hash_on_a_session_header_keeps_the_prefix(fleet: Fleet) -> None:
    client = fleet.client(_start_router(fleet, "consistent_hash"))
    # Sessions are hashed onto the two replicas (by their URLs, whose ports change from run to run): open
    # sessions until each replica holds one, then go on with the first session of each, both replicas serving.
    first_on: dict[int, Conversation] = {}
    for i in range(16):  # NOTE: all 16 on one replica has probability 2**-15
        before = [_requests_done(base) for base in fleet.replicas]
        conversation = Conversation(f"Session{i}", headers={"X-Session-ID": f"session-{i}"})
        conversation.turn(client)
        after = [_requests_done(base) for base in fleet.replicas]
        (replica,) = [r for r in range(2) if after[r] > before[r]]
        first_on.setdefault(replica, conversation)
        if len(first_on) == 2:
            break
    assert set(first_on) == {0, 1}
    conversations = list(first_on.values())
    _run_turns(client, conversations)
    assert _share_kept(conversations) >= 0.9, [(c.prompt_tokens, c.cached_tokens) for c in conversations]


def test_litellm_fronts_both_replicas_as_one_model(fleet: Fleet, tmp_path: Path) -> None:
    port = free_port()
    key = "sk-ortserve-test-0123456789abcdef"
    env = {**os.environ, "LITELLM_MASTER_KEY": key, "LITELLM_LOG": "ERROR",
           "ORTSERVE_REPLICA_0": f"{fleet.replicas[0]}/v1", "ORTSERVE_REPLICA_1": f"{fleet.replicas[1]}/v1",
           # NOTE: its bundled model-price map: without this LiteLLM fetches one from the internet at start.
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "NO_DOCS": "True"}
    log = tmp_path / "litellm.log"
    with log.open("wb") as out:
        proxy = subprocess.Popen(
            [str(Path(sys.executable).parent / "litellm"), "--config", str(LITELLM_CONFIG), "--host", "127.0.0.1",
             "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    fleet.extra.append(proxy)
    base = f"http://127.0.0.1:{port}"
    _wait_ok(f"{base}/health/liveliness", lambda: proxy.poll() is None, STARTUP_TIMEOUT_S, "the LiteLLM proxy",
             lambda: log.read_text(errors="replace")[-3000:])
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    before = [_requests_done(b) for b in fleet.replicas]
    hits_before = sum(_prefix_hits(b) for b in fleet.replicas)
    # NOTE: 16 requests spread at random over two replicas all land on one with probability 2 * 2**-16.
    reported = 0
    for i in range(16):
        r = client.chat.completions.create(model="ortserve", max_tokens=2, temperature=0,
                                           messages=[{"role": "user", "content": f"Say the number {i}."}])
        assert r.model == "ortserve" and r.choices[0].message.content
        reported += r.usage.prompt_tokens_details.cached_tokens or 0
    conversation = Conversation("Foxtrot")
    for _ in range(3):
        conversation.turn(client, model="ortserve")
    reported += sum(conversation.cached_tokens)
    served = [_requests_done(b) - n for b, n in zip(fleet.replicas, before)]
    assert sum(served) == 19 and min(served) > 0, served
    # The usage LiteLLM hands back is the replicas' own: cached tokens add up to their prefix-cache hits.
    assert reported == sum(_prefix_hits(b) for b in fleet.replicas) - hits_before
    proxy.terminate()
    proxy.wait(30)


@dataclass
class Stream:
    """One streamed chat request read on its own thread."""

    router: str
    prompt: str
    max_tokens: int
    started: threading.Event = field(default_factory=threading.Event)
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    error: str | None = None
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": self.prompt}], "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{self.router}/v1/chat/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            self.started.set()
                        if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                            self.finish_reason = chunk["choices"][0]["finish_reason"]
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.started.set()

    @property
    def completed(self) -> bool:
        return self.error is None and self.done and self.finish_reason == "length"


def test_a_replica_killed_mid_run_fails_only_its_running_streams(fleet: Fleet) -> None:
    """Runs last: it kills replica 1 of the module's fleet."""
    # NOTE: paced at 0.02 s a decode step, 500 tokens take 10 s at least after their first: the streams opened
    # here (a few seconds) are all still running when the kill comes right after the last one started.
    max_tokens = 500
    streams: list[Stream] = []
    topics = ["volcanoes", "sailing ships", "bread", "jazz", "glaciers", "bees", "lighthouses", "comets"]
    running = [0.0, 0.0]
    t0 = time.monotonic()
    for topic in topics:  # open streams one at a time until both replicas run some
        stream = Stream(fleet.router, f"Write a long essay about {topic}.", max_tokens)
        stream.start()
        assert stream.started.wait(120), f"no token from the stream about {topic}"
        assert stream.error is None, stream.error
        streams.append(stream)
        running = [_metrics(base)["ortserve_requests_running"] for base in fleet.replicas]
        if min(running) >= 1:
            break
    assert time.monotonic() - t0 < max_tokens * DECODE_DELAY_S, "the streams took too long to start"
    assert min(running) >= 1 and sum(running) == len(streams), (running, len(streams))
    os.kill(fleet.replica_pid(1), signal.SIGKILL)
    for stream in streams:
        assert stream.thread is not None
        stream.thread.join(180)
    outcomes = [(s.finish_reason, s.done, s.error) for s in streams]
    failed = [s for s in streams if not s.completed]
    # Exactly the streams replica 1 was running fail (cut off: an error, or no [DONE]); the others finish.
    assert len(failed) == running[1], (running, outcomes)
    # The run goes on: new requests, some resuming prompts the dead replica held, all succeed.
    client = fleet.client()
    for topic in topics:
        r = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": f"Write a long essay about {topic}."}])
        assert r.choices[0].message.content, topic
    assert fleet.proc.poll() is None, "the router script stopped"
