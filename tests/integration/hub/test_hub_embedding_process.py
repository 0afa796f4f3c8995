"""A hub's embedding model runs in an engine process of its own (issue 37: one engine per loaded model, each in its
own process that owns its device session): the same vectors as the in-process engine's, a killed process leaves
the chat model answering and reloads on the next request, unloading ends the process.

Real parts: a real server (the tiny synthetic chat model and all-minilm-l6-v2, pulled into the cache once), real
sessions on both sides of the comparison.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np

from engine.embedding import EmbeddingConfig, EmbeddingEngine
from server.app import create_app
from server.settings import ModelSpec
from tests.integration.embeddings.conftest import MINILM, minilm_model  # noqa: F401 - the fixture
from tests.integration.server.conftest import api_settings, serve_app

TEXTS = ["a red fox", "the blue whale sings", "x"]


def _embed(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/embeddings", json={"model": MINILM, "input": TEXTS}, timeout=120)


def _pid(base: str) -> int | None:
    return {m["name"]: m for m in httpx.get(f"{base}/health", timeout=10).json()["models"]}.get(MINILM, {}).get("pid")


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not Path(f"/proc/{pid}").exists()


def test_the_embedding_model_has_a_process_of_its_own(tiny_model: Path, minilm_model: Path) -> None:  # noqa: F811
    settings = api_settings(tiny_model, served_model_name="tiny", max_batch=1,
                            models=[ModelSpec(model=str(minilm_model), name=MINILM, kind="embedding")])
    with serve_app(create_app(settings)) as running:
        r = _embed(running.base)
        assert r.status_code == 200, r.text
        pid = _pid(running.base)
        assert pid is not None and pid != os.getpid() and Path(f"/proc/{pid}").exists()
        assert "spawn" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")  # a spawned child
        got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
        here = EmbeddingEngine.from_model_dir(minilm_model, EmbeddingConfig())
        try:
            want = np.stack(here.embed_sync(here.tokenize(TEXTS)))
        finally:
            here.shutdown()
        np.testing.assert_allclose(got, want, atol=1e-5)  # the same session's numbers, a process away

        # killed: the chat model keeps answering; the embedding model reloads on its next request
        os.kill(pid, signal.SIGKILL)
        assert _gone(pid)
        chat = httpx.post(f"{running.base}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        again = _embed(running.base)
        assert again.status_code == 200, again.text
        np.testing.assert_allclose(np.array([d["embedding"] for d in again.json()["data"]]), want, atol=1e-5)
        new_pid = _pid(running.base)
        assert new_pid not in (None, pid)

        # unloaded: its process ends
        r = httpx.post(f"{running.base}/models/unload", json={"model": MINILM}, timeout=60)
        assert r.status_code == 200, r.text
        assert _gone(new_pid) and _pid(running.base) is None
