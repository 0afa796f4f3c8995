"""Runner on a real session: rows never touch each other, idle rows write only their first unused
position, and the whole-buffer mode (opaque device KV) computes the same tokens as row views."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.kv_cache import HostKVAllocator, KVCache, KVShape
from engine.model_loader import check_graph, create_session, read_model_folder
from engine.bucket_runner import BucketRunner
from engine.runner import Runner
from tests.greedy_close import TINY_MAX_GAP_NATS, GreedyRun, assert_greedy_close


@pytest.fixture(scope="module")
def model(tiny_model):
    folder = read_model_folder(tiny_model)
    session, _ = create_session(folder, EngineConfig(max_batch=4, prefill_chunk=16))
    return folder, session, check_graph(folder, session)


def make_runner(model, whole_buffer=False, slots=4):
    folder, session, io = model
    kv = KVCache(KVShape(folder.num_layers, slots, folder.num_kv_heads, 128, folder.head_size, io.kv_dtype),
                 HostKVAllocator())
    cls = BucketRunner if whole_buffer else Runner
    return cls(session, io, kv, prefill_chunk=16, max_position=128)


def greedy_run(runner, slot, prompt, steps, chunk=16) -> GreedyRun:
    """``steps`` greedy tokens of ``prompt`` in ``slot``, with each step's top-k (tests/greedy_close.py)."""
    start = 0
    while start < len(prompt):
        logits = runner.prefill(slot, prompt[start:start + chunk], start)
        start += len(prompt[start:start + chunk])
    rows = [logits.copy()]
    for i in range(steps - 1):
        rows.append(runner.decode([slot], [int(np.argmax(rows[-1]))], [len(prompt) + i])[0].copy())
    return GreedyRun.from_logits(rows)


def greedy(runner, slot, prompt, steps, chunk=16):
    return list(greedy_run(runner, slot, prompt, steps, chunk).tokens)


def test_decode_with_an_idle_row_between_leaves_its_kv_alone(model):
    runner = make_runner(model)
    rng = np.random.default_rng(0)
    for slot in range(3):
        runner.prefill(slot, rng.integers(3, 500, 10 + slot).tolist(), 0)
    before = [runner.kv.key_array(0)[1].copy(), runner.kv.value_array(0)[1].copy()]
    n1 = int(runner.slot_len[1])
    runner.decode([0, 2], [5, 6], [10, 12])  # slot 1 is idle inside the range [0, 3)
    after = [runner.kv.key_array(0)[1], runner.kv.value_array(0)[1]]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a[:, :n1], b[:, :n1])  # its valid prefix is untouched
        np.testing.assert_array_equal(a[:, n1 + 1:], b[:, n1 + 1:])  # and nothing past its first free slot
    assert runner.slot_len.tolist()[:3] == [11, n1, 13]
    assert not np.array_equal(runner.kv.key_array(0)[0][:, 10], 0)  # the active rows really wrote


def test_slot_does_not_change_the_result(model):
    prompt = np.random.default_rng(1).integers(3, 500, 37).tolist()
    # NOTE(tests): exact: the same row counts on both (prompt runs of >= 2 rows: 16 + 16 + 5 against 7 x 5 + 2,
    # a row's result doesn't depend on how many >= 2 share its run; then one row alone)
    assert greedy(make_runner(model), 0, prompt, 12) == greedy(make_runner(model), 3, prompt, 12, chunk=5)


def test_whole_buffer_mode_equals_row_views(model):
    prompt = np.random.default_rng(2).integers(3, 500, 21).tolist()
    rows = make_runner(model)
    whole = make_runner(model, whole_buffer=True)
    # NOTE(tests): slot 2 decodes in the 4-row bucket there, alone here: equal up to a near-tie
    expected = greedy_run(rows, 2, prompt, 10)
    assert_greedy_close(expected, greedy_run(whole, 2, prompt, 10), TINY_MAX_GAP_NATS, "whole buffer, slot 2")
    # and beside another stream in the same batch
    other = np.random.default_rng(3).integers(3, 500, 9).tolist()
    greedy(whole, 0, other, 3)
    assert_greedy_close(expected, greedy_run(whole, 1, prompt, 10), TINY_MAX_GAP_NATS, "whole buffer, slot 1")


def test_prefill_chunk_bounds(model):
    runner = make_runner(model)
    with pytest.raises(ValueError, match="1..16"):
        runner.prefill(0, list(range(3, 20)), 0)
