"""Start, probe and stop real `ortserve serve` replicas the way the deploy files start them.

Replica "container" runs deploy/docker/entrypoint.sh with the CPU image's ORTSERVE_* environment; replica
"systemd" runs the ortserve@.service ExecStart line with the unit's Environment= and the example env files.
Both serve one synthetic model (random weights, no download) on the CPU; only paths, the port and the
provider differ from the deploy files.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[3]
# The Dockerfile/unit/kustomize helpers live beside the static tests (see conftest.py).
sys.path.insert(0, str(ROOT / "tests" / "unit" / "deploy"))

from deploy_tools import (  # noqa: E402
    DEPLOY,
    dockerfile_instructions,
    final_stage,
    unit_values,
)

STARTUP_TIMEOUT_S = 120.0
# A long drain, so that a slow or loaded machine still finishes the SIGTERM test's stream inside it; the
# stream ends as soon as the test has read it (seconds), so the drain costs nothing when all is well.
SHUTDOWN_GRACE_S = 90.0
# NOTE(deploy): the synthetic model's defaults with an 8192-token context, so that one stream with top-20
# logprobs (~1.4 KB a token, ~11 MB in all) is more than twice what loopback socket buffers hold (the
# default tcp_wmem maximum is 4 MiB): such a stream cannot end before its client reads it.
MODEL_MAX_LENGTH = 8192


@dataclass
class Replica:
    """One running server process and how to reach it."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else "(no log)"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range is 32768-60999


def free_port_run(n: int) -> int:
    """A port p such that p .. p+n-1 are all free on 127.0.0.1, for a script that serves on BASE_PORT + i.

    The run lies below the kernel's ephemeral range: a port there is never a client socket's local port.
    Inside the range, the second port of a run found with bind(0) (odd) is the even parity connect() picks
    first, and CI saw a replica fail to bind because the test's own health polls held it."""
    low = _ephemeral_low()
    for _ in range(200):
        base = random.randrange(10000, low - n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no run of {n} free ports below {low}")


def bin_dir(tmp: Path) -> Path:
    """A folder whose `ortserve` runs this checkout: the virtualenv's console script when installed
    (`make test` installs the package), else a two-line shim to `python -m server` for a bare checkout."""
    venv_bin = Path(sys.executable).parent
    if (venv_bin / "ortserve").is_file():
        return venv_bin
    shim_dir = tmp / "bin"
    shim_dir.mkdir(exist_ok=True)
    shim = shim_dir / "ortserve"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m server "$@"\n')
    shim.chmod(0o755)
    return shim_dir


def base_env(bin_dir: Path) -> dict[str, str]:
    """The test process's environment without any ORTSERVE_* setting, with `ortserve` first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTSERVE_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env


def container_env() -> dict[str, str]:
    """The ORTSERVE_* variables that Dockerfile.cpu's runtime stage sets (ENV key=value pairs)."""
    out: dict[str, str] = {}
    for keyword, args in final_stage(dockerfile_instructions(DEPLOY / "docker" / "Dockerfile.cpu")):
        if keyword == "ENV":
            for word in shlex.split(args):
                key, _, value = word.partition("=")
                if key.startswith("ORTSERVE_"):
                    out[key] = value
    return out


def systemd_command(instance: str) -> tuple[list[str], dict[str, str]]:
    """ortserve@<instance>.service's ExecStart argv and its Environment= values, specifiers left as %X."""
    template = DEPLOY / "systemd" / "ortserve@.service"
    (exec_start,) = unit_values(template, "Service", "ExecStart")
    argv = [word.replace("%i", instance) for word in shlex.split(exec_start)]
    environment = dict(value.split("=", 1) for value in unit_values(template, "Service", "Environment"))
    return argv, environment


def start(name: str, argv: list[str], env: dict[str, str], port: int, log_dir: Path) -> Replica:
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=log_dir)
    return Replica(name=name, port=port, proc=proc, log=log)


def wait_ready(replica: Replica, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Poll /health until 200; fail with the log if the process dies or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if replica.proc.poll() is not None:
            pytest.fail(f"{replica.name} exited with {replica.proc.returncode}:\n{replica.log_tail()}")
        try:
            if httpx.get(f"{replica.base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.25)
    pytest.fail(f"{replica.name} not ready after {timeout_s:.0f} s:\n{replica.log_tail()}")


def stop(replica: Replica) -> None:
    """SIGTERM the process we started, then SIGKILL it if the drain overruns."""
    if replica.proc.poll() is None:
        replica.proc.send_signal(signal.SIGTERM)
        try:
            replica.proc.wait(timeout=SHUTDOWN_GRACE_S + 15)
        except subprocess.TimeoutExpired:
            replica.proc.kill()
            replica.proc.wait(timeout=10)
