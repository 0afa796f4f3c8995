"""One copy of the decoder's weights for all its sessions (engine.shared_weights), on the CPU EP standing in for
CUDA and HIP device memory: the same ``SessionOptions.add_initializer`` path, with host arrays where the device
path puts DLPack views of device memory (tests/integration/ep/test_cuda_engine.py runs it on the CUDA EP)."""

from __future__ import annotations

import asyncio

import numpy as np

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.model_loader import check_graph, create_session, read_model_folder
from engine.shared_weights import load_shared_weights, probe_sharing
from engine.types import SamplingParams

from tests.integration.engine.test_runner import greedy, make_runner
from tests.integration.engine.test_device_kv import _collect, _tokens


def _sessions(folder, weights, n=2):
    config = EngineConfig(max_batch=4, prefill_chunk=16)
    out = []
    for _ in range(n):
        session, _ = create_session(folder, config, weights=weights)
        out.append((folder, session, check_graph(folder, session)))
    return out


def test_the_probe_finds_shared_weights_used_in_place_stand_in_for_cuda():
    assert probe_sharing(None) == ""


def test_two_sessions_read_one_shared_copy_in_place_stand_in_for_cuda(tiny_model):
    """Both sessions compute what a session of its own computes; then one shared weight changes in place, and
    both sessions (not the unshared one) see it: they hold no copy of their own."""
    folder = read_model_folder(tiny_model)
    weights = load_shared_weights(folder.model_file, None, min_bytes=0)
    assert "embed.scales" in weights.values and "layers.0.qkv_proj.qweight" in weights.values
    assert weights.nbytes == sum(a.nbytes for a in weights.owners.values())
    own = make_runner(_sessions(folder, None, 1)[0])
    a, b = (make_runner(m) for m in _sessions(folder, weights))
    prompt = np.random.default_rng(5).integers(3, 500, 23).tolist()
    expected = greedy(own, 0, prompt, 8)
    assert greedy(a, 0, prompt, 8) == expected and greedy(b, 1, prompt, 8) == expected

    scales = weights.owners["embed.scales"]  # GatherBlockQuantized: read as given, never prepacked
    scales *= 0  # every embedding row becomes zero
    zeroed_a, zeroed_b = a.prefill(2, prompt[:16], 0).copy(), b.prefill(2, prompt[:16], 0).copy()
    unshared = own.prefill(2, prompt[:16], 0).copy()
    np.testing.assert_array_equal(zeroed_a, zeroed_b)
    assert not np.allclose(zeroed_a, unshared), "the shared sessions did not see the changed weight"


def test_the_engine_serves_the_same_tokens_with_shared_weights_stand_in_for_cuda(tiny_model, caplog, monkeypatch):
    """``share_weights=True`` on the CPU: probe, one host copy of every initializer, the session takes it; the
    tokens are those of the engine without."""
    caplog.set_level("INFO")
    monkeypatch.setattr("engine.shared_weights.SHARE_MIN_BYTES", 0)  # the tiny model's tensors are all small
    prompt = np.random.default_rng(7).integers(3, 500, 30).tolist()
    params = SamplingParams(max_tokens=10, temperature=0.0)
    runs = {}
    for flag in (True, False):
        engine = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=2, share_weights=flag,
                                                                     speculative_tokens=0))
        try:
            runs[flag] = _tokens(asyncio.run(_collect(engine, prompt, params, f"s{flag}")))
        finally:
            engine.shutdown()
    assert len(runs[True]) == 10 and runs[True] == runs[False]
    shared = [r.message for r in caplog.records if r.message.startswith("shared weights:")]
    assert len(shared) == 1 and not shared[0].startswith("shared weights: 0 "), shared
