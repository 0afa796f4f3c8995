"""Start a CPU `ortserve serve` in a subprocess for the investigations that drive it over HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, threads: int | None, *extra: str, ready_timeout_s: float = 120.0,
                 log: Path | None = None, cwd: Path | None = None, provider: str = "cpu",
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """``ortserve serve --model model --provider provider --intra-op-threads threads *extra`` on 127.0.0.1:port,
    once /health answers 200 (RuntimeError when it exits first or is not ready within ``ready_timeout_s``).

    ``threads`` None leaves the thread count to the server; ``log``: its stderr goes there (and its tail into the
    error), else to this process's stderr; ``cwd``: where it runs; ``env``: its environment (default: this one's).
    """
    cmd = [sys.executable, "-m", "server", "serve", "--model", model, "--provider", provider,
           *(["--intra-op-threads", str(threads)] if threads is not None else []), *extra,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    stderr = log.open("w") if log is not None else sys.stderr
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = f": {log.read_text()[-2000:]}" if log is not None else ""
            raise RuntimeError(f"server exited with {proc.returncode}{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise RuntimeError("server did not become ready")
