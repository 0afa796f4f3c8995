"""Start a CPU `ortserve serve` in a subprocess for the investigations that drive it over HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, threads: int, *extra: str, ready_timeout_s: float = 120.0) -> subprocess.Popen:
    """``ortserve serve --model model --provider cpu --intra-op-threads threads *extra`` on 127.0.0.1:port, once
    /health answers 200 (RuntimeError when it exits first or is not ready within ``ready_timeout_s``)."""
    cmd = [sys.executable, "-m", "server", "serve", "--model", model, "--provider", "cpu", "--intra-op-threads",
           str(threads), *extra, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise RuntimeError("server did not become ready")
