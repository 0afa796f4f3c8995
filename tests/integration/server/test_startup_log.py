"""A real CPU-only `ortserve serve` start: its log says nothing about MIGraphX or CUDA (issue 35)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from ep import flags
from tests.integration.server.conftest import serve_process

GPU_WORDS = re.compile(r"migraphx|cuda|ORT_FPA_INTB_GEMM", re.IGNORECASE)


@pytest.mark.parametrize("provider", ["cpu", "auto"])
def test_a_cpu_only_start_logs_nothing_about_migraphx_or_cuda(api_model: Path, provider: str) -> None:
    if provider == "auto" and any(os.path.exists(node) for flag in flags.REGISTRY for node in flag.device_nodes):
        pytest.skip("this machine has a GPU device node: auto is not a CPU-only start here")
    with serve_process(api_model, "--provider", provider, "--log-level", "info") as server:
        log = server.stderr()
    assert "Application startup complete" in log  # the INFO log was on, and the start got that far
    assert [line for line in log.splitlines() if GPU_WORDS.search(line)] == []
