"""The CPU fast paths change no result: prefill logits of the last position only (the graph's optional
logits_to_keep input) and masks cut to the positions in use (GQA's total_sequence_length), so that a step's cost
follows the tokens in use, not max_model_len."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from engine.config import EngineConfig
from engine.kv_cache import HostKVAllocator, KVCache, KVShape
from engine.model_loader import check_graph, create_session, read_model_folder
from engine.row_chunks import LOGITS_TO_KEEP
from engine.runner import Runner

LENGTH = 128


@pytest.fixture(scope="module")
def model(tiny_model):
    folder = read_model_folder(tiny_model)
    session, _ = create_session(folder, EngineConfig(max_batch=4, prefill_chunk=32))
    return folder, session, check_graph(folder, session)


def make_runner(model, slots=4, length=LENGTH):
    folder, session, io = model
    kv = KVCache(KVShape(folder.num_layers, slots, folder.num_kv_heads, length, folder.head_size, io.kv_dtype),
                 HostKVAllocator())
    return Runner(session, io, kv, prefill_chunk=32, max_position=length)


def _plain_run(session, ids, keep=None):
    """One prompt through session.run with fresh KV; returns the logits output."""
    past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    feeds = {p.name: np.zeros((1, p.shape[1], LENGTH, p.shape[3]), np.float32) for p in past}
    mask = np.zeros((1, LENGTH), np.int64)
    mask[0, :len(ids)] = 1
    feeds.update(input_ids=np.array([ids], np.int64), attention_mask=mask,
                 position_ids=np.arange(len(ids), dtype=np.int64)[None])
    if keep is not None:
        feeds[LOGITS_TO_KEEP] = np.array([keep], np.int64)
    return session.run(["logits"], feeds)[0]


def test_logits_to_keep_is_optional_and_keeps_the_last_positions(model):
    _, session, _ = model
    assert LOGITS_TO_KEEP in {i.name for i in session.get_overridable_initializers()}
    assert LOGITS_TO_KEEP not in {i.name for i in session.get_inputs()}  # callers may ignore it
    ids = np.random.default_rng(0).integers(3, 500, 9).tolist()
    full = _plain_run(session, ids)  # [1, 9, V]: the default keeps every position
    assert full.shape[1] == 9
    last = _plain_run(session, ids, keep=1)
    assert last.shape == (1, 1, full.shape[2])
    np.testing.assert_allclose(last[0, 0], full[0, -1], rtol=1e-5, atol=1e-5)
    three = _plain_run(session, ids, keep=3)
    np.testing.assert_allclose(three[0], full[0, -3:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_plain_run(session, ids, keep=0), full, rtol=0, atol=0)


def test_runner_prefill_uses_it_and_returns_the_last_positions_logits(model):
    runner = make_runner(model)
    assert runner.keep_last
    ids = np.random.default_rng(1).integers(3, 500, 20).tolist()
    got = runner.prefill(0, ids, 0).copy()
    full = _plain_run(model[1], ids)
    np.testing.assert_allclose(got, full[0, -1], rtol=1e-5, atol=1e-5)


def _decode_steps(runner, prompts, steps):
    for slot, prompt in enumerate(prompts):
        runner.prefill(slot, prompt, 0)
    tokens = [[int(t)] for t in range(5, 5 + len(prompts))]
    out = []
    for i in range(steps):
        pos = [len(p) + i for p in prompts]
        logits = runner.decode(list(range(len(prompts))), [t[-1] for t in tokens], pos).copy()
        out.append(logits)
        for t, row in zip(tokens, logits):
            t.append(int(np.argmax(row)))
    return out


def test_narrow_decode_mask_gives_the_same_logits_as_the_full_width_mask(model):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 500, n).tolist() for n in (7, 19, 12)]  # rows of different lengths
    narrow = make_runner(model)
    assert narrow._narrow_mask
    full = make_runner(model)
    full._narrow_mask = False  # the mask as wide as the KV buffer, as before
    for a, b in zip(_decode_steps(narrow, prompts, 6), _decode_steps(full, prompts, 6)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_narrow_mask_binding_has_the_rows_ones_and_the_longest_rows_width(model):
    runner = make_runner(model)
    runner.mask_ones[:3] = [4, 9, 2]
    binding = runner.session.io_binding()
    runner._bind_narrow_mask(binding, 0, 3)
    mask = runner._mask_scratch[:3 * 9].reshape(3, 9)
    assert mask.sum(axis=1).tolist() == [4, 9, 2]
    assert mask[0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert isinstance(binding, ort.IOBinding)


def _mask_bytes_per_run(runner, prompt):
    """mask_bytes after each kind of run: a first chunk, a chunk after a past, a one-row decode, a two-row decode
    and a draft check, on one runner."""
    seen = []
    logits = runner.prefill(0, prompt[:20], 0)
    seen.append(runner.mask_bytes)
    logits = runner.prefill(0, prompt[20:], 20)
    seen.append(runner.mask_bytes)
    token, pos = int(np.argmax(logits)), len(prompt)
    token = int(np.argmax(runner.decode([0], [token], [pos])[0]))
    seen.append(runner.mask_bytes)
    runner.prefill(1, prompt[:5], 0)
    runner.decode([0, 1], [token, 7], [pos + 1, 5])
    seen.append(runner.mask_bytes)
    runner.verify(0, [token, 8, 9], pos + 2)
    seen.append(runner.mask_bytes)
    return seen


def test_every_run_reads_a_mask_as_wide_as_the_tokens_in_use_whatever_max_model_len(model):
    # counted, not timed: a run's mask (and GQA's total_sequence_length) must not grow with the KV buffers' length
    prompt = np.random.default_rng(4).integers(3, 500, 30).tolist()
    short, long = make_runner(model, length=LENGTH), make_runner(model, length=16 * LENGTH)
    assert short._narrow_mask and long._narrow_mask
    assert _mask_bytes_per_run(long, prompt) == _mask_bytes_per_run(short, prompt) == [
        8 * 20, 8 * 30, 8 * 31, 8 * 2 * 32, 8 * 35]


def test_narrow_chunk_and_draft_check_masks_give_the_same_tokens_as_full_width_ones(model):
    # prefill chunks (the first and one after a past) and a draft check of 4 tokens: narrow vs full-width mask
    prompt = np.random.default_rng(5).integers(3, 500, 45).tolist()
    results = []
    for narrow in (True, False):
        runner = make_runner(model)
        runner._narrow_mask = narrow
        first = runner.prefill(0, prompt[:32], 0).copy()
        last = runner.prefill(0, prompt[32:], 32).copy()
        check = runner.verify(0, [int(np.argmax(last)), 11, 12, 13], len(prompt)).copy()
        results.append((first, last, check))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        assert np.argmax(a, axis=-1).tolist() == np.argmax(b, axis=-1).tolist()
