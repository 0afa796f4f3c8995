"""The default context: the trained one, reduced only to what the KV budget holds for max_batch rows."""

from __future__ import annotations

import pytest

from engine.context_length import CONTEXT_STEP, GIB, choose_context, kv_bytes_per_token

# Qwen2.5-1.5B in float32: 28 layers, 2 KV heads of 128 -> 56 KiB a token a row
QWEN_TOKEN = kv_bytes_per_token(28, 2, 128, 4)


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer():
    assert QWEN_TOKEN == 57_344
    assert kv_bytes_per_token(30, 3, 64, 2) == 2 * 30 * 3 * 64 * 2


def test_the_trained_context_when_the_budget_holds_it():
    choice = choose_context(32768, requested=None, num_rows=8, kv_bytes_per_token=QWEN_TOKEN,
                            budget_bytes=16 * GIB)
    assert choice.value == 32768 and "trained context" in choice.describe()


def test_a_small_budget_reduces_the_context_to_a_step_multiple_and_says_why():
    choice = choose_context(32768, requested=None, num_rows=8, kv_bytes_per_token=QWEN_TOKEN,
                            budget_bytes=5 * GIB)
    assert choice.value % CONTEXT_STEP == 0
    assert choice.value * 8 * QWEN_TOKEN <= 5 * GIB < (choice.value + CONTEXT_STEP) * 8 * QWEN_TOKEN
    line = choice.describe()
    assert "32768" in line and str(choice.value) in line and "--max-batch 8" in line
    # fewer rows, more context each
    assert choose_context(32768, requested=None, num_rows=2, kv_bytes_per_token=QWEN_TOKEN,
                          budget_bytes=5 * GIB).value == 32768


def test_a_requested_length_is_kept_and_the_budget_not_asked():
    choice = choose_context(32768, requested=4096, num_rows=64, kv_bytes_per_token=QWEN_TOKEN, budget_bytes=1)
    assert choice.value == 4096 and "--max-model-len" in choice.describe()


def test_a_budget_below_the_minimum_is_an_error_naming_the_settings():
    with pytest.raises(ValueError, match="--max-batch"):
        choose_context(32768, requested=None, num_rows=8, kv_bytes_per_token=QWEN_TOKEN, budget_bytes=GIB // 100)


def test_without_a_budget_half_the_available_host_memory_is_used():
    choice = choose_context(1 << 20, requested=None, num_rows=1, kv_bytes_per_token=1024)
    assert choice.budget_bytes > 0 and "available" in choice.describe()


def test_the_default_budget_is_half_of_what_the_weights_leave(monkeypatch):
    monkeypatch.setattr("engine.context_length.available_host_memory_bytes", lambda: 20 * GIB)
    choice = choose_context(131072, requested=None, num_rows=2, kv_bytes_per_token=QWEN_TOKEN,
                            weights_bytes=6 * GIB)
    assert choice.budget_bytes == 7 * GIB and "less the 6.0 GiB of weights" in choice.describe()


def test_a_model_that_cannot_fit_is_refused_with_every_size_named():
    from engine.context_length import ModelTooLargeError, check_fits

    line = check_fits(weights_bytes=6 * GIB, kv_bytes=GIB, available_bytes=20 * GIB, where="host memory available")
    assert "within the 20.00 GiB of host memory available" in line and "weights 6.00 GiB" in line
    with pytest.raises(ModelTooLargeError) as kv:
        check_fits(weights_bytes=6 * GIB, kv_bytes=16 * GIB, available_bytes=20 * GIB, where="host memory available")
    assert "weights 6.00 GiB + KV cache 16.00 GiB" in str(kv.value) and "20.00 GiB" in str(kv.value)
    assert "lower --max-model-len or --max-batch" in str(kv.value)
    with pytest.raises(ModelTooLargeError, match="the weights alone do not fit"):
        check_fits(weights_bytes=40 * GIB, kv_bytes=GIB, available_bytes=20 * GIB, where="CUDA device memory")
    assert "not checked" in check_fits(weights_bytes=GIB, kv_bytes=GIB, available_bytes=None, where="device memory")


def test_every_copy_of_the_weights_the_sessions_hold_is_counted():
    """The 32B shape: 19.5 GiB of weights fit twice beside 16 GiB of KV in 72 GiB, not three times."""
    from engine.context_length import ModelTooLargeError, check_fits

    line = check_fits(weights_bytes=int(19.5 * GIB), kv_bytes=16 * GIB, available_bytes=72 * GIB,
                      where="CUDA device memory", weight_copies=2)
    assert "weights 2 x 19.50 GiB + KV cache 16.00 GiB" in line
    with pytest.raises(ModelTooLargeError, match="lower --max-model-len") as three:
        check_fits(weights_bytes=int(19.5 * GIB), kv_bytes=16 * GIB, available_bytes=72 * GIB,
                   where="CUDA device memory", weight_copies=3)
    assert "weights 3 x 19.50 GiB" in str(three.value)
    with pytest.raises(ModelTooLargeError, match="the weights alone do not fit"):
        check_fits(weights_bytes=30 * GIB, kv_bytes=GIB, available_bytes=72 * GIB, where="CUDA device memory",
                   weight_copies=3)
