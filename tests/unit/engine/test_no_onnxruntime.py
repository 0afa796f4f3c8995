"""Modules that promise "no onnxruntime import" keep it: each is imported alone in a fresh interpreter, which then
must not hold onnxruntime in ``sys.modules`` (an import through any chain of the project's modules counts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# the engine's pure modules: the wire between the processes, the event-loop side, the core and what it is typed against
NO_ONNXRUNTIME = ("engine.core_wire", "engine.output_processor", "engine.types", "engine.model_runner", "engine.core",
                  "engine.scheduler", "engine.sampler", "engine.sampling_law", "engine.sampling_fast",
                  "engine.step_stats", "engine.constraint_masks", "engine.core_inbox", "engine.load_priority",
                  "engine.core_fanout")


@pytest.mark.parametrize("module", NO_ONNXRUNTIME)
def test_module_does_not_import_onnxruntime(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'onnxruntime'))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"{module} imports onnxruntime: {result.stdout.strip()}"


def test_the_check_sees_an_onnxruntime_import() -> None:
    """The check itself can fail: a module that does import onnxruntime is caught."""
    code = "import sys, engine.runner; print(sorted(m for m in sys.modules if m.split('.')[0] == 'onnxruntime'))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "'onnxruntime'" in result.stdout
