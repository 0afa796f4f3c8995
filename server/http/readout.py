"""Reading logits instead of generating: the engine run that decisions, rerank and score share.

Each prompt is an engine request that stops after the prompt (max_tokens=1, greedy, ``label_token_ids``): the
engine returns the next-token log-probabilities of the label tokens and nothing is generated. Protocol packages
(server/decisions, server/rerank) build the prompts and turn the readings into answers. No onnxruntime import.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from engine.types import SamplingParams
from server.engine_client import EngineClient
from server.http.run import EngineRequestError

# NOTE(server): the most label reads of one HTTP request in the engine at once; the rest wait here, not in the
# engine's bounded queue, so one request of 400 questions never takes the queue (429) from everyone else.
MAX_CONCURRENT_READS = 8


@dataclass(frozen=True)
class LabelRead:
    """One prompt whose next-token log-probabilities are read for ``label_ids`` (token ids, in order)."""

    prompt_ids: list[int]
    label_ids: tuple[int, ...]


@dataclass(frozen=True)
class LabelReading:
    """What the engine read: ``logprobs[i]`` is ``label_ids[i]``'s natural-log probability under the model's raw
    next-token distribution at the end of the prompt; ``num_cached_tokens`` of its ``num_prompt_tokens`` came from
    the prefix cache."""

    logprobs: tuple[float, ...]
    num_prompt_tokens: int
    num_cached_tokens: int


async def _read_one(engine: EngineClient, read: LabelRead, request_id: str) -> LabelReading:
    params = SamplingParams(max_tokens=1, temperature=0.0, label_token_ids=read.label_ids)
    last = None
    async for out in engine.generate(read.prompt_ids, params, request_id):
        if out.logprobs:
            last = out
        if out.finished and out.error is not None:
            raise EngineRequestError(out.error)
    if last is None or last.logprobs is None:
        raise EngineRequestError("the engine returned no label log-probabilities")
    top = last.logprobs[0].top
    return LabelReading(tuple(lp for _, lp in top), last.num_prompt_tokens, last.num_cached_tokens)


async def read_labels(engine: EngineClient, reads: Sequence[LabelRead], request_id: str,
                      max_concurrent: int = MAX_CONCURRENT_READS) -> list[LabelReading]:
    """The readings of ``reads``, in order.

    NOTE(server): the first read runs alone, the others after it, together: the prompts of one request share their
    head (the input of a decision, the query of a rerank), and once the first has left its KV in a slot the engine's
    prefix reuse gives every other prompt that head for a copy, so only its own tail is prefilled (N questions over
    one long input cost about one prefill of it). Cancelling the caller aborts every read in flight.

    Raises:
        What ``engine.generate`` raises (EngineOverloadedError, InvalidRequestError, EngineDeadError), and
        EngineRequestError when the engine failed a read.
    """
    if not reads:
        return []
    first = await _read_one(engine, reads[0], f"{request_id}-0")
    gate = asyncio.Semaphore(max_concurrent)

    async def bounded(i: int) -> LabelReading:
        async with gate:
            return await _read_one(engine, reads[i], f"{request_id}-{i}")

    tasks: list[asyncio.Task[LabelReading]] = []
    try:
        async with asyncio.TaskGroup() as group:  # one failure cancels the other reads
            tasks = [group.create_task(bounded(i)) for i in range(1, len(reads))]
    except* Exception as failed:  # noqa: BLE001 - re-raised as it is
        raise failed.exceptions[0] from None  # NOTE(server): the first error keeps its class (its HTTP status)
    return [first, *(task.result() for task in tasks)]
