"""Huge prompts (a few MB of text): refused without freezing the other streams, and without keeping the
memory they took.

A prompt longer than the context by its length alone is refused before it is tokenized (a bound from the
tokenizer's longest token); one that needs tokenizing to tell is tokenized off the event loop without
holding the GIL, and the memory it took is given back afterwards.
"""

from __future__ import annotations

import functools
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.server.conftest import ServeProcess, serve_process
from tests.reliability.conftest import assert_openai_error, rss_bytes

pytestmark = pytest.mark.slow

# Tokens: long enough that a 600 kB prompt passes the length bound (65,536 x 13 characters, the synthetic
# tokenizer's longest token) and is tokenized before it is refused.
CONTEXT = 65_536
WORDS = "the of and to in is was for on that with as by at from his it an were are which this be or has".split()


def text_of(num_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = []
    size = 0
    while size < num_chars:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:num_chars]


def chat_body(num_chars: int, seed: int = 0) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": 4,
                       "messages": [{"role": "user", "content": text_of(num_chars, seed)}]}).encode()


@functools.cache
def huge_bodies() -> tuple[bytes, bytes]:
    """A chat and a completions request just under the default 4 MiB body limit."""
    completion = json.dumps({"model": "tiny", "max_tokens": 4, "prompt": text_of(4 * 2**20 - 1024, seed=1)})
    return chat_body(4 * 2**20 - 1024), completion.encode()


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny synthetic model with a 64k-token context (2 layers: its KV cache is 32 MiB a slot)."""
    from engine.builder import SyntheticSpec, build_synthetic

    return build_synthetic(tmp_path_factory.mktemp("long") / "model", SyntheticSpec(max_length=CONTEXT))


def post(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"Content-Type": "application/json"})


def assert_too_long(response: httpx.Response, param: str, untokenized: bool) -> None:
    error = assert_openai_error(response.status_code, response.content, expect_status=400)
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    # "at least N tokens": the bound refused it before any tokenizing; "N tokens": it was tokenized first.
    assert ("the prompt has at least" in error["message"]) == untokenized, error["message"]


@pytest.fixture(scope="module")
def paced_server(long_model: Path) -> Iterator[ServeProcess]:
    """The server in its own process (the test's client shares no GIL with it), its engine paced at 0.02 s a
    decode step (tests/integration/server/paced_serve.py): a stream of N tokens lasts 0.02 * N s at least, on
    any machine."""
    with serve_process(long_model, "--served-model-name", "tiny", "--max-batch", "2", decode_delay_s=0.02) as server:
        yield server


def test_huge_prompts_do_not_stall_a_running_stream(paced_server: ServeProcess) -> None:
    """The largest gap between chunks of a running stream while 4 MB prompts arrive stays under 0.3 s (or,
    on a machine so loaded that the same stream's own gaps without them reach 0.1 s, under 3x those)."""
    max_tokens = 5000  # paced at 0.02 s a token: the stream runs for 100 s at least, longer than this test
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "ignore_eos": True}
    gaps: dict[str, list[float]] = {"before": [], "huge": [], "after": []}
    phase = "before"
    answers: list[httpx.Response] = []

    huge_chat, huge_completion = huge_bodies()

    def send_huge_prompts() -> None:
        with httpx.Client(base_url=paced_server.base, timeout=120) as http:
            for _ in range(3):
                answers.append(post(http, "/v1/chat/completions", huge_chat))
            answers.append(post(http, "/v1/completions", huge_completion))

    sender = threading.Thread(target=send_huge_prompts)
    with httpx.Client(base_url=paced_server.base, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            last = None
            num_after = 0
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                assert '"finish_reason":null' in line or '"role"' in line, "the stream ended: premise broken"
                now = time.monotonic()
                if last is not None:
                    gaps[phase].append(now - last)
                last = now
                if phase == "before" and len(gaps["before"]) == 30:
                    phase = "huge"
                    sender.start()
                elif phase == "huge" and not sender.is_alive():
                    phase = "after"
                elif phase == "after":
                    num_after += 1
                    if num_after == 30:
                        break  # leave: the stream is aborted
    sender.join()
    own = max(gaps["before"] + gaps["after"])
    worst = max(gaps["huge"])
    print(f"largest gap: {worst * 1000:.0f} ms while huge prompts arrived ({len(gaps['huge'])} chunks), "
          f"{own * 1000:.0f} ms otherwise")
    assert worst < max(0.3, 3 * own), (worst, own)
    assert len(answers) == 4
    for answer in answers[:3]:
        assert_too_long(answer, "messages", untokenized=True)
    assert_too_long(answers[3], "prompt", untokenized=True)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the RSS from /proc")
def test_repeated_huge_prompts_give_their_memory_back(long_model: Path) -> None:
    """RSS after repeated huge prompts, refused untokenized (4 MB) or after tokenizing (600 kB, 360k tokens,
    in a 64k context), grows by less than 15%."""
    huge_chat, huge_completion = huge_bodies()
    warm_up, medium_chat = chat_body(150_000, seed=3), chat_body(600_000, seed=2)
    with serve_process(long_model, "--served-model-name", "tiny", "--max-batch", "1") as server:
        with httpx.Client(base_url=server.base, timeout=300) as http:
            # Warm up: the request path, and one long prompt (150 kB), which sets up what any long prompt needs
            # once (the tokenizer's thread pool, the worker threads' malloc arenas).
            for _ in range(3):
                r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200
            assert_too_long(post(http, "/v1/chat/completions", warm_up), "messages", untokenized=False)
            time.sleep(1.0)  # the server gives back what the warm-up left 0.5 s after it
            before = rss_bytes(server.proc.pid)
            rss = []
            for _ in range(4):
                assert_too_long(post(http, "/v1/chat/completions", huge_chat), "messages", untokenized=True)
                assert_too_long(post(http, "/v1/completions", huge_completion), "prompt", untokenized=True)
                assert_too_long(post(http, "/v1/chat/completions", medium_chat), "messages", untokenized=False)
                rss.append(rss_bytes(server.proc.pid))
        # The server gives the memory back shortly after a large request: wait for it (at most 10 s).
        deadline = time.monotonic() + 10
        while rss_bytes(server.proc.pid) >= 1.15 * before and time.monotonic() < deadline:
            time.sleep(0.1)
        after = rss_bytes(server.proc.pid)
        print(f"RSS MiB: {before >> 20} before, {[r >> 20 for r in rss]} after each round, {after >> 20} at the end")
        assert after < 1.15 * before, ([before >> 20], [r >> 20 for r in rss], after >> 20)
