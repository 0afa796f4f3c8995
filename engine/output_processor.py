"""OutputProcessor: the event-loop side's per-request state (queue, detokenizer, stop strings).

Turns CoreOutputs into RequestOutput deltas; runs only on the event loop. No onnxruntime import.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.types import CoreOutput, FinishReason, RequestOutput, SamplingParams, SpecDecodeStats


@dataclass(eq=False)
class RequestState:
    """One request as the event loop tracks it."""

    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    loop: asyncio.AbstractEventLoop | None = None  # the loop that consumes ``queue``
    seq: int = 0  # matches CoreOutput.seq (a reused request_id's late outputs are dropped)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | BaseException
    num_generated_tokens: int = 0  # all choices together
    # n > 1: the detokenizers of choices 1..n-1 (``detokenizer`` is choice 0's)
    more_detokenizers: list[IncrementalDetokenizer] = field(default_factory=list)
    choices_done: set[int] = field(default_factory=set)  # choices that have had their last output
    num_cached_tokens: int = 0
    # the draft checks of every choice so far (CoreOutput.spec_check): tokens drafted, and accepted, per check
    spec_drafted: list[int] = field(default_factory=list)
    spec_accepted: list[int] = field(default_factory=list)

    @property
    def num_choices(self) -> int:
        return 1 + len(self.more_detokenizers)

    def detokenizer_of(self, index: int) -> IncrementalDetokenizer:
        return self.detokenizer if index == 0 else self.more_detokenizers[index - 1]


class OutputProcessor:
    """Owns ``RequestState`` by request id; ``process`` is the one loop over a step's outputs."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state

    def remove(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def process(self, outputs: Iterable[CoreOutput]) -> list[tuple[str, int]]:
        """Detokenize, cut stop strings and queue one RequestOutput per CoreOutput (the exception instead for a
        request the core refused; nothing for the late outputs of a choice a stop string ended here).

        Returns:
            (request id, choice index) of the choices a stop string ended here; the core still runs them and
            must abort them.
        """
        to_abort: list[tuple[str, int]] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None or state.seq != out.seq:  # finished or cancelled on this side already
                continue
            if out.exception is not None:  # refused in the core (e.g. overloaded): the caller gets it raised
                state.queue.put_nowait(out.exception)
                del self.states[out.request_id]
                continue
            if out.index in state.choices_done:  # a choice a stop string ended here: the core's late outputs
                continue
            if out.index == 0 and out.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            state.num_generated_tokens += len(out.token_ids)
            if out.spec_check is not None:
                state.spec_drafted.append(out.spec_check[0])
                state.spec_accepted.append(out.spec_check[1])
            reason = out.finish_reason
            detokenizer = state.detokenizer_of(out.index)
            # NOTE(engine): STOP from the core means a stop token (eos, stop_token_ids), which is not text, unless
            # a grammar completed with that token.
            matched = detokenizer.update(
                out.token_ids, stop_terminated=reason is FinishReason.STOP and not out.grammar_complete)
            if matched is not None and reason is not FinishReason.STOP:
                if reason is None:
                    to_abort.append((out.request_id, out.index))
                reason = FinishReason.STOP
            if reason is not None:
                state.choices_done.add(out.index)
            finished = len(state.choices_done) == state.num_choices
            state.queue.put_nowait(RequestOutput(
                request_id=out.request_id, text=detokenizer.next_delta(finished=reason is not None),
                token_ids=out.token_ids, num_prompt_tokens=state.num_prompt_tokens,
                num_generated_tokens=state.num_generated_tokens, finished=finished, finish_reason=reason,
                logprobs=out.logprobs, error=out.error, first_scheduled_s=out.first_scheduled_s,
                index=out.index, num_cached_tokens=state.num_cached_tokens,
                stop_string=matched if reason is FinishReason.STOP else None,
                spec_decode=SpecDecodeStats(tuple(state.spec_drafted), tuple(state.spec_accepted))
                if finished and state.spec_drafted else None))
            if finished:
                del self.states[out.request_id]
        return to_abort

    def fail_all(self, exc: BaseException) -> None:
        """The engine died: every waiting consumer gets ``exc``."""
        for state in self.states.values():
            state.queue.put_nowait(exc)
        self.states.clear()


def merge_by_choice(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Queued deltas of one request, merged per choice (see merge_outputs); the finished one comes last."""
    if len(outputs) == 1 or all(o.index == 0 for o in outputs):
        return [merge_outputs(outputs)]
    by_choice: dict[int, list[RequestOutput]] = {}
    for out in outputs:
        by_choice.setdefault(out.index, []).append(out)
    merged = [merge_outputs(group) for group in by_choice.values()]
    # NOTE(engine): in the order of their (cumulative, all-choice) token counts, so counts never go back
    return sorted(merged, key=lambda o: (o.finished, o.num_generated_tokens))


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Several queued deltas of one choice of a request as one (a consumer that fell behind gets them at once)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    logprobs = None
    if any(o.logprobs for o in outputs):
        logprobs = tuple(lp for o in outputs for lp in (o.logprobs or ()))
    return RequestOutput(
        request_id=last.request_id, text="".join(o.text for o in outputs),
        token_ids=tuple(t for o in outputs for t in o.token_ids), num_prompt_tokens=last.num_prompt_tokens,
        num_generated_tokens=last.num_generated_tokens, finished=last.finished,
        finish_reason=last.finish_reason, logprobs=logprobs, error=last.error,
        first_scheduled_s=next((o.first_scheduled_s for o in outputs if o.first_scheduled_s is not None), None),
        index=last.index, num_cached_tokens=last.num_cached_tokens, stop_string=last.stop_string,
        spec_decode=last.spec_decode)
