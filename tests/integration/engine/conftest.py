"""Engines on the tiny synthetic model (real ONNX Runtime sessions), shared by the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig


@pytest.fixture(scope="session")
def engine(tiny_model: Path):
    """8 slots, a 16-token prefill budget (prompts longer than that are chunked)."""
    eng = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=8, max_queue=16, prefill_chunk=16,
                                                              seed=0))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def single_engine(tiny_model: Path):
    """1 slot, 2 waiting places, a 64-token prefill budget."""
    eng = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=1, max_queue=2, prefill_chunk=64))
    yield eng
    eng.shutdown()
