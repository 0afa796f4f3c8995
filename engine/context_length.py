"""The default context (max_model_len): the model's trained context, reduced only to what the KV memory budget
allows for max_batch rows; and whether the weights and that KV fit in the memory they will live in at all, checked
before anything loads (``check_fits``). Pure arithmetic plus one read of the host's available memory; no onnxruntime
import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

KV_MEMORY_FRACTION = 0.5  # of the host memory available at load, the default KV budget
CONTEXT_STEP = 256  # a reduced context is a multiple of this
MIN_CONTEXT = 256  # a budget that allows less than this per row is an error, not a silently tiny context
FALLBACK_CONTEXT = 2048  # a model folder that names no trained context

GIB = 1 << 30
# NOTE(engine): what a loaded model costs beyond its weights file and KV: the interpreter, the tokenizer, ONNX Runtime's
# arenas and a prompt chunk's activations (an 8B model on the CPU: ~0.6 GiB beside 6.4 GiB of weights and its KV).
LOAD_OVERHEAD_BYTES = 1 << 30


@dataclass(frozen=True)
class ContextChoice:
    """How max_model_len was chosen.

    Attributes:
        value: the context in tokens (prompt + output) of each of the ``num_rows`` KV rows.
        trained: the model's trained context (genai_config's context_length).
        requested: --max-model-len, or None for the default.
        num_rows: KV rows (--max-batch).
        kv_bytes_per_token: KV bytes one token takes in one row (keys and values of every layer).
        budget_bytes: the KV memory budget, None where the value was requested.
        budget_source: where the budget came from (for the log line).
    """

    value: int
    trained: int
    requested: int | None
    num_rows: int
    kv_bytes_per_token: int
    budget_bytes: int | None
    budget_source: str = ""

    def describe(self) -> str:
        """The start-up log line."""
        kv_gib = self.value * self.num_rows * self.kv_bytes_per_token / GIB
        if self.requested is not None:
            return (f"max_model_len {self.value} (--max-model-len; trained context {self.trained}): KV "
                    f"{kv_gib:.2f} GiB for {self.num_rows} rows")
        budget = f"KV budget {self.budget_bytes / GIB:.2f} GiB ({self.budget_source})"
        if self.value < self.trained:
            return (f"max_model_len {self.value}: the model's trained context {self.trained} reduced to what the "
                    f"{budget} allows for --max-batch {self.num_rows} rows ({self.kv_bytes_per_token / 1024:.0f} "
                    f"KiB a token a row); a smaller --max-batch or a larger --kv-cache-memory-gib gives more")
        return (f"max_model_len {self.value}: the model's trained context (KV {kv_gib:.2f} GiB for "
                f"{self.num_rows} rows, within the {budget})")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for one token of one row."""
    return 2 * num_layers * num_kv_heads * head_size * dtype_bytes


def available_host_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else the free physical pages; None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def choose_context(trained: int, *, requested: int | None, num_rows: int, kv_bytes_per_token: int,
                   budget_bytes: int | None = None, budget_source: str = "--kv-cache-memory-gib",
                   weights_bytes: int = 0) -> ContextChoice:
    """max_model_len for ``num_rows`` rows: ``requested`` as given, else ``trained`` where the budget holds it,
    else the largest multiple of CONTEXT_STEP the budget holds.

    Args:
        trained: the model's trained context in tokens (0: unknown, FALLBACK_CONTEXT).
        requested: --max-model-len (checked against ``trained`` by the caller), or None.
        budget_bytes: the KV memory budget; None -> KV_MEMORY_FRACTION of the host's available memory once the
            weights (``weights_bytes``, which load into that memory after this choice) are taken from it.
    Raises:
        ValueError: the budget holds fewer than MIN_CONTEXT tokens a row (the message says what to change).
    """
    trained = trained or FALLBACK_CONTEXT
    if requested is not None:
        return ContextChoice(requested, trained, requested, num_rows, kv_bytes_per_token, None)
    if budget_bytes is None:
        available = available_host_memory_bytes()
        if available is None:  # nothing to go by: the trained context, as asked
            return ContextChoice(trained, trained, None, num_rows, kv_bytes_per_token, 0, "host memory unknown")
        budget_bytes = int(max(0, available - weights_bytes) * KV_MEMORY_FRACTION)
        budget_source = f"{KV_MEMORY_FRACTION:.0%} of the {available / GIB:.1f} GiB of host memory available" + (
            f" less the {weights_bytes / GIB:.1f} GiB of weights" if weights_bytes else "")
    per_row = budget_bytes // max(1, num_rows * kv_bytes_per_token)
    if per_row >= trained:
        return ContextChoice(trained, trained, None, num_rows, kv_bytes_per_token, budget_bytes, budget_source)
    value = per_row // CONTEXT_STEP * CONTEXT_STEP
    if value < min(trained, MIN_CONTEXT):
        raise ValueError(
            f"the KV budget {budget_bytes / GIB:.2f} GiB ({budget_source}) holds only {per_row} tokens a row for "
            f"{num_rows} rows ({kv_bytes_per_token} bytes a token a row); lower --max-batch, or set "
            f"--max-model-len or --kv-cache-memory-gib")
    return ContextChoice(value, trained, None, num_rows, kv_bytes_per_token, budget_bytes, budget_source)


class ModelTooLargeError(ValueError):
    """The weights and the KV cache cannot fit in the memory they would live in."""


def check_fits(*, weights_bytes: int, kv_bytes: int, available_bytes: int | None, where: str,
               overhead_bytes: int = LOAD_OVERHEAD_BYTES, weight_copies: int = 1) -> str:
    """Refuse a model before it loads when its weights and KV cache cannot fit.

    Args:
        weights_bytes: the weights' size (the model folder's graph and weights files).
        kv_bytes: the KV cache the chosen context and rows take.
        available_bytes: the memory they would live in (None: unknown, nothing is checked).
        where: that memory, for the message (e.g. "host memory available (MemAvailable)").
        weight_copies: how many copies of the weights the sessions hold there (``engine.placement``: one per
            decoder session, or one shared plus a fused kernel's prepacked layout).
    Returns:
        The start-up line that says what was checked.
    Raises:
        ModelTooLargeError: the message names every size and what to change.
    """
    all_weights = weights_bytes * weight_copies
    need = all_weights + kv_bytes + overhead_bytes
    copies = f"{weight_copies} x " if weight_copies > 1 else ""
    sizes = (f"weights {copies}{weights_bytes / GIB:.2f} GiB + KV cache {kv_bytes / GIB:.2f} GiB + "
             f"{overhead_bytes / GIB:.2f} GiB runtime = {need / GIB:.2f} GiB")
    if available_bytes is None:
        return f"memory: {sizes}; the {where} is unknown, so not checked"
    if need > available_bytes:
        what = "the weights alone do not fit: a smaller quantization or a device with more memory is needed" \
            if all_weights + overhead_bytes > available_bytes else \
            "lower --max-model-len or --max-batch, or set --kv-cache-memory-gib, for a smaller KV cache"
        raise ModelTooLargeError(
            f"the model needs {sizes}, but the {where} is {available_bytes / GIB:.2f} GiB: {what}")
    return f"memory: {sizes}, within the {available_bytes / GIB:.2f} GiB of {where}"
