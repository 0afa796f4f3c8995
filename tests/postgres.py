"""A throw-away PostgreSQL server for the tests: Debian's `postgresql` package (`make test` installs it), a cluster
made with initdb in a temporary folder, listening on 127.0.0.1 on a free port, run as a non-root user (PostgreSQL
refuses to run as root: as root the cluster belongs to the package's `postgres` user).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def postgres_bin() -> Path | None:
    """The folder of initdb and postgres (Debian keeps them in /usr/lib/postgresql/VERSION/bin), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def postgres_server(timeout_s: float = 60.0) -> Iterator[str]:
    """Start a fresh PostgreSQL cluster; yields its URL (``postgresql://USER@127.0.0.1:PORT/ortserve``)."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL is not installed (make test installs Debian's postgresql package)")
    user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    as_user = ["runuser", "-u", user, "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="ortserve-pg-"))
    data, run = root / "data", root / "run"
    run.mkdir()
    if os.geteuid() == 0:
        entry = pwd.getpwnam(user)
        for path in (root, run):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    port = _free_port()
    log = root / "log"
    proc = None
    try:
        subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-U", user, "--auth=trust",
                        "--encoding=UTF8", "--no-sync"], check=True, capture_output=True, timeout=120)
        with open(log, "w") as out:
            if os.geteuid() == 0:
                os.chown(log, pwd.getpwnam(user).pw_uid, -1)
            proc = subprocess.Popen([*as_user, str(bin_dir / "postgres"), "-D", str(data), "-p", str(port),
                                     "-h", "127.0.0.1", "-k", str(run), "-c", "fsync=off",
                                     "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
                                    stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            ready = subprocess.run([str(bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)],
                                   capture_output=True)
            if ready.returncode == 0:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        subprocess.run([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", user, "ortserve"],
                       check=True, capture_output=True)
        yield f"postgresql://{user}@127.0.0.1:{port}/ortserve"
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)
