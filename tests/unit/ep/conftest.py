"""Fixtures for the device-layer unit tests: fresh interpreters and real shared libraries under backend names."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _real_shared_library() -> Path:
    """A small real ELF library that loads anywhere: onnxruntime's providers_shared (libc/libstdc++ only)."""
    spec = importlib.util.find_spec("onnxruntime")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "capi" / "libonnxruntime_providers_shared.so"


@pytest.fixture
def backend_named_library(tmp_path: Path) -> Callable[[str], Path]:
    """Copy a real shared library to tmp under a given file name (e.g. one a backend pattern matches)."""

    def make(name: str) -> Path:
        target = tmp_path / name
        shutil.copyfile(_real_shared_library(), target)
        return target

    return make


@pytest.fixture
def run_python() -> Callable[[str], dict]:
    """Run code in a fresh interpreter (a process with no backend loaded yet); it prints one JSON line."""

    def run(code: str, extra_env: dict[str, str] | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MIGRAPHX_")}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.update(extra_env or {})
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    return run
