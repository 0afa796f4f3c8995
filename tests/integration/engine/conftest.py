"""Engines on the tiny synthetic model (real ONNX Runtime sessions), shared by the engine tests.

Each has a DecodeGate as its (test-only) fault injector, open unless a test shuts it: a test that needs a
request still running at some point shuts the gate instead of hoping the machine is slow enough.

NOTE(tests): each keeps the prior law of what a draft check costs (CheckCost.freeze) instead of timing this machine,
so whether a request drafts depends on its tokens alone, never on how loaded the machine is: the same request run
alone twice then runs the same row counts and gives the same tokens on every CPU (docs/development.md, "Tests on
model output").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from tests.conftest import DecodeGate


@pytest.fixture(scope="session")
def engine_gate() -> DecodeGate:
    return DecodeGate()


@pytest.fixture(scope="session")
def single_engine_gate() -> DecodeGate:
    return DecodeGate()


@pytest.fixture(scope="session")
def engine(tiny_model: Path, engine_gate: DecodeGate):
    """8 slots, a 16-token prefill budget (prompts longer than that are chunked); decode held by engine_gate."""
    eng = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=8, max_queue=16, prefill_chunk=16,
                                                              seed=0, fault_injector=engine_gate))
    eng._core.scheduler.check_cost.freeze()  # test only: see the module's note
    yield eng
    engine_gate.open()
    eng.shutdown()


@pytest.fixture(scope="session")
def single_engine(tiny_model: Path, single_engine_gate: DecodeGate):
    """1 slot, 2 waiting places, a 64-token prefill budget; decode held by single_engine_gate."""
    eng = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=1, max_queue=2, prefill_chunk=64,
                                                              fault_injector=single_engine_gate))
    eng._core.scheduler.check_cost.freeze()  # test only: see the module's note
    yield eng
    single_engine_gate.open()
    eng.shutdown()
