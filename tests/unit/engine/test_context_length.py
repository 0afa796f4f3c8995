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
