"""Fixtures for the bench harness tests: the streaming peer server (peer.py) in its own process."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.server.conftest import stop_process

PEER = Path(__file__).with_name("peer.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Peer:
    url: str  # the OpenAI base URL, ending in /v1
    pid: int


@pytest.fixture(scope="session")
def peer() -> Peer:
    """A running peer (peer.py) in its own process, so its timers don't share our GIL."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(PEER), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"peer did not start (exit code {proc.poll()})")
            time.sleep(0.1)
        yield Peer(url=url, pid=proc.pid)
    finally:
        stop_process(proc, 10)


@pytest.fixture
def peer_stats(peer: Peer):
    """peer_stats(model) -> what the peer saw for that model string (see peer.py)."""
    base = peer.url.removesuffix("/v1")

    def get(model: str) -> dict:
        return httpx.get(f"{base}/peer/stats", params={"model": model}, timeout=5).json()

    return get
