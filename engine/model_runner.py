"""ModelRunner: what the core and the scheduler see of a model runner (no onnxruntime import).

Two runners implement it, one per way a device lets KV rows be bound (``engine.kv_cache``; which one a device gets is
decided in ``engine.placement``): ``engine.runner.Runner`` (row views) and ``engine.bucket_runner.BucketRunner``
(opaque device buffers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class ModelRunner(Protocol):
    """What a step runs through. Slots are KV rows; every method's arrays are valid until its next call."""

    num_slots: int
    prefill_chunk: int  # the most tokens of one prompt run, the scheduler's step budget
    vocab_size: int
    buckets: tuple[int, ...]  # the decode widths it runs (several: requests should take the lowest free slots)
    whole_buffer: bool  # every decode run covers a prefix of the rows, not just the running ones
    input_source: str  # where the decode inputs live ("cpu", "ep_host_accessible", "cpu->device", ...)
    logits_source: str  # where the logits are written ("cpu", "ep_host_accessible", "device->cpu")
    # the last decode's rows: (argmax, log-normalizer, the argmax's log-probability), where the device computes them
    decode_summary: tuple[np.ndarray, np.ndarray, np.ndarray] | None

    @property
    def can_copy(self) -> bool:
        """KV can be copied between slots (prefix reuse from another slot, n > 1 choices)."""

    @property
    def can_verify(self) -> bool:
        """A request's row can run S > 1 tokens with every position's logits (speculative decoding)."""

    def decode(self, slots: Sequence[int], token_ids: Sequence[int], positions: Sequence[int],
               logits: bool = True) -> np.ndarray | None:
        """``logits=False``: the caller needs only ``decode_summary``; a runner that has one may then leave the
        logits on the device and return None (the others return them anyway)."""

    def prefill(self, slot: int, token_ids: Sequence[int], start: int, also: Sequence[int] = ()) -> np.ndarray: ...

    def verify(self, slot: int, token_ids: Sequence[int], start: int) -> np.ndarray: ...

    def copy_kv(self, src: int, dst: int, start: int, end: int) -> None: ...

    @property
    def can_batch_prompts(self) -> bool:
        """``prefill_prompts`` runs several new requests' prompts together."""

    max_batched_prompt: int  # the most tokens of one prompt ``prefill_prompts`` takes
    # the most requests whose prompt chunks one step should run (0: as many as the token budget holds)
    max_prefills_per_step: int
    # the shortest cached prefix worth reusing on this runner (None: the engine's rule, engine.core_process)
    min_prefix_reuse: int | None
    # (session, ms) of each run since the core last took them (the step trace); None: not kept
    run_log: list[tuple[str, float]] | None

    def prefill_prompts(self, slots: Sequence[int], token_lists: Sequence[Sequence[int]]) -> None: ...

    def release(self, slot: int, keep: int = 0) -> None: ...

    def warmup(self) -> None: ...
