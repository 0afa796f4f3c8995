"""LoadPriority: a hub's loading engine process runs its load at a higher nice value, and no thread that serves
afterwards keeps it. Linux only (nice values are per thread there); read back with os.getpriority per thread id, as
/proc/<pid>/task/<tid>/stat shows them. Also ``read_vocab``, the tokenizer's vocabulary read one token at a time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.load_priority import LoadPriority, can_restore_nice, thread_nice

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread nice values are Linux's")


def _in_thread(fn):
    """fn() on a fresh thread (so this test's own thread keeps its nice value); returns its result."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def _started_thread_nice() -> tuple[int, threading.Event, int]:
    """Start a lasting thread (as ORT's pool threads are) and return its id, the event that ends it, and its nice."""
    ready, stop = threading.Event(), threading.Event()
    tid: list[int] = []

    def run() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        stop.wait()

    threading.Thread(target=run, daemon=True).start()
    ready.wait()
    return tid[0], stop, thread_nice(tid[0])


@pytest.mark.skipif(not can_restore_nice(), reason="this process cannot lower a nice value again")
def test_the_load_runs_lower_and_every_thread_it_started_goes_back() -> None:
    def scenario() -> dict:
        me = threading.get_native_id()
        base = thread_nice(me)
        priority = LoadPriority(5)
        assert priority.restorable
        during = priority.call(lambda: thread_nice(threading.get_native_id()), starts_threads=True)
        tid, stop, started = _started_thread_nice()  # a pool thread created during the load inherits its nice
        priority.restore()
        result = {"base": base, "during": during, "started": started, "started_after": thread_nice(tid),
                  "me_after": thread_nice(me)}
        stop.set()
        priority.restore()  # idempotent
        return result

    r = _in_thread(scenario)
    assert r["during"] == min(19, r["base"] + 5) and r["started"] == r["during"]
    assert r["started_after"] == r["base"] and r["me_after"] == r["base"]


def test_nice_zero_changes_nothing() -> None:
    def scenario() -> tuple[int, int, int]:
        base = thread_nice(threading.get_native_id())
        priority = LoadPriority(0)
        inside = priority.call(lambda: thread_nice(threading.get_native_id()), starts_threads=False)
        priority.restore()
        return base, inside, thread_nice(threading.get_native_id())

    base, inside, after = _in_thread(scenario)
    assert base == inside == after


def test_errors_reach_the_caller() -> None:
    priority = LoadPriority(3)
    try:
        with pytest.raises(ValueError, match="bad folder"):
            priority.call(lambda: (_ for _ in ()).throw(ValueError("bad folder")), starts_threads=False)
    finally:
        priority.restore()


UNPRIVILEGED = """
import threading
from engine.load_priority import LoadPriority, can_restore_nice, thread_nice
me = threading.get_native_id()
base = thread_nice(me)
assert not can_restore_nice()
priority = LoadPriority(5)
folder = priority.call(lambda: thread_nice(threading.get_native_id()), starts_threads=False)
session = priority.call(lambda: thread_nice(threading.get_native_id()), starts_threads=True)
priority.restore()
print(base, folder, session, thread_nice(me))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to drop "
                    "CAP_SYS_NICE")
def test_without_the_right_to_restore_only_the_folder_read_runs_lower() -> None:
    """Most containers cannot lower a nice value again: there the session (whose pool threads would keep the nice
    value) is created at the process's priority, and only the model folder is read lower, on a throwaway thread."""
    cmd = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice", sys.executable, "-c", UNPRIVILEGED]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    base, folder, session, after = map(int, result.stdout.split())
    assert folder == min(19, base + 5)
    assert session == base and after == base


def test_read_vocab_is_get_vocab() -> None:
    from tokenizers import AddedToken

    from engine.builder.tokenizer import synthetic_tokenizer
    from engine.tokenizer import read_vocab

    hf, _ = synthetic_tokenizer(600)
    hf.add_special_tokens([AddedToken("<tool_call>", special=True)])
    hf.add_tokens(["hello"])  # an added token whose text may also be the model's
    assert read_vocab(hf) == hf.get_vocab(with_added_tokens=True)
