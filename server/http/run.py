"""A request's life on the HTTP side, for every protocol: start (so 400/429/503 stay HTTP statuses), the
outputs, a client that leaves aborts the request, a stream cut at shutdown, and closing.

No onnxruntime import, and no wire protocol's: each protocol's package builds its own events from these outputs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import anyio
from starlette.requests import Request

from engine.types import EngineError, FinishReason, RequestOutput, SpecDecodeStats
from server.engine_client import EngineClient
from server.errors import EngineNotReadyError, ServerError, error_for
from server.metrics import REJECTED, RequestTracker

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientDisconnectedError(ServerError):
    """The client went away before the response started (nobody reads this answer)."""

    status_code = 499
    error_type = "client_closed_request"


class EngineRequestError(EngineError):
    """The engine ended a request with finish_reason=ERROR (-> 500, or an error event in a stream)."""


class CutAtShutdownError(EngineNotReadyError):
    """The server's shutdown grace period ended before this request did (503, code shutting_down)."""


async def _until_disconnected(request: Request) -> None:
    # NOTE(server): the body was already read; the next ASGI message is http.disconnect, which
    # uvicorn sends when the client leaves (or after the response has completed).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _race_disconnect(request: Request | None, awaitable: Any) -> Any:
    """Await `awaitable`, but cancel it and raise ClientDisconnectedError if the client leaves first (no request:
    work no client waits for, a background response)."""
    if request is None:
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # NOTE(server): wait for the cancelled work to unwind (the engine's generator aborts the
            # request on cancellation) so that closing the generator afterwards cannot race it.
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})
    if task.cancelled() or not task.done():
        raise ClientDisconnectedError("client disconnected")
    return task.result()


async def race_disconnect(request: Request, awaitable: Any) -> Any:
    """Await a non-streamed request's work; a client that leaves first cancels it (ClientDisconnectedError, 499):
    the decisions, rerank and score routes, whose engine reads need no EngineRun."""
    return await _race_disconnect(request, awaitable)


def outcome_of(exc: BaseException) -> str:
    """The ortserve_requests_total status an exception stands for: abort, rejected or error."""
    if not isinstance(exc, Exception) or isinstance(exc, CutAtShutdownError):  # the client or the server left
        return str(FinishReason.ABORT)
    status = error_for(exc)[0]
    if status == ClientDisconnectedError.status_code:
        return str(FinishReason.ABORT)
    return REJECTED if status < 500 else str(FinishReason.ERROR)


def _final_status(out: RequestOutput) -> str:
    return str(out.finish_reason or FinishReason.STOP)


class EngineRun:
    """One request inside the engine, seen from the HTTP side.

    Usage: `run = EngineRun(...); await run.start(request)` (raises engine errors while the HTTP
    status can still change), then `async for out in run.outputs()` and finally `await run.close()`.
    """

    def __init__(self, engine: EngineClient, request_id: str, prompt_ids: list[int], params: Any,
                 tracker: RequestTracker, priority: int = 0) -> None:
        self.engine = engine
        self.request_id = request_id
        self.tracker = tracker
        self.finished = False
        self._closed = False
        # priority > 0: a batch line (engine.async_engine.AsyncEngine.generate)
        self._agen = (engine.generate(prompt_ids, params, request_id, priority=priority) if priority
                      else engine.generate(prompt_ids, params, request_id))
        self._first: RequestOutput | None = None
        self._next: asyncio.Future[RequestOutput] | None = None  # the first output, still on its way (accept_s)
        self._cut: ServerError | None = None
        tracker.submitted()

    async def start(self, request: Request | None, accept_s: float | None = None) -> None:
        """Wait for the first output so that 400/429/503 can still be HTTP statuses.

        Args:
            accept_s: wait at most this long (None: until the first output). A prompt still being computed
                then (minutes, for an agent's 12k-token prompt on a CPU) lets the response start before its
                first output: a streamed answer sends its headers and first events, and its keep-alives, while
                the engine works, instead of nothing that a client's first-byte watchdog gives up on. The engine
                refuses a request (400/429/503) before it computes anything, so those stay HTTP statuses.
        """
        self._next = asyncio.ensure_future(self._agen.__anext__())
        try:
            await _race_disconnect(request, asyncio.wait({self._next}, timeout=accept_s))
        except BaseException as exc:
            await self.fail(exc)
            raise
        if self._next.done():
            self._first = await self._take_next()
            self._observe(self._first)

    @property
    def pending(self) -> bool:
        """The response started before the engine's first output (see ``start``'s accept_s)."""
        return self._next is not None

    async def _take_next(self) -> RequestOutput:
        """The first output; a failure closes the run (an error event or status follows)."""
        assert self._next is not None
        task, self._next = self._next, None
        try:
            return await task
        except StopAsyncIteration:
            exc = EngineRequestError("the engine ended the request without output")
            await self.fail(exc)
            raise exc from None
        except BaseException as exc:
            await self.fail(exc)
            raise

    async def fail(self, exc: BaseException) -> None:
        """Record the outcome `exc` stands for, then abort and close."""
        self.tracker.finish(outcome_of(exc))
        await self.close()

    def _observe(self, out: RequestOutput) -> None:
        self.tracker.on_output(out)
        if out.finished:
            self.finished = True
            self.tracker.finish(_final_status(out))
            # NOTE(server): one line per request: how much of its prompt came from the prefix cache (an agent's
            # turns resend the whole conversation; tests/integration/agents reads these lines).
            logger.info("request %s finished (%s): %d prompt tokens, %d cached, %d generated", self.request_id,
                        _final_status(out), out.num_prompt_tokens, out.num_cached_tokens, out.num_generated_tokens)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The peeked first output, then the rest, up to and including the finished one."""
        if self._next is not None:
            self._first = await self._take_next()
            self._observe(self._first)
        if self._first is not None:
            first, self._first = self._first, None
            yield first
            if first.finished:
                return
        async for out in self._agen:
            if self._cut is not None and out.finished and out.finish_reason == FinishReason.ABORT:
                if out.text or out.logprobs:  # what was generated before the cut still goes out
                    partial = replace(out, finished=False, finish_reason=None)
                    self._observe(partial)
                    yield partial
                raise self._cut
            self._observe(out)
            yield out
            if out.finished:
                return
        if not self.finished:
            raise EngineRequestError("the engine ended the request without a final output")

    async def cut(self, exc: ServerError) -> None:
        """End the request from outside (the shutdown grace is over): the engine aborts it, and `outputs()`
        raises `exc` after the text generated so far, so a stream still ends with an error event and [DONE]."""
        if self.finished or self._closed or self._cut is not None:
            return
        self._cut = exc
        await self.engine.abort(self.request_id)  # the consumer gets a final ABORT output at once

    async def close(self) -> None:
        """Abort the request in the engine unless it finished; idempotent and safe under cancellation."""
        if self._closed:
            return
        self._closed = True
        # NOTE(server): shielded, because this runs while the stream's task group is being cancelled
        # (client disconnect or shutdown); without the shield the abort would never be sent.
        with anyio.CancelScope(shield=True):
            if self._next is not None:  # the first output never came: cancelling it aborts the request
                self._next.cancel()
                await asyncio.wait({self._next})
                self._next = None
            if not self.finished:
                self.tracker.finish(str(FinishReason.ABORT))
                try:
                    await self.engine.abort(self.request_id)
                except Exception:  # the engine may already be gone; nothing is left to free then
                    logger.debug("abort of %s failed", self.request_id, exc_info=True)
            try:
                await self._agen.aclose()
            except Exception:
                logger.debug("closing the generator of %s failed", self.request_id, exc_info=True)


@dataclass
class StreamContext:
    """What every chunk of one response repeats, and how token ids become text for logprobs."""

    request_id: str
    created: int
    model: str
    include_usage: bool
    token_text: Callable[[int], str]
    want_logprobs: bool = False
    n: int = 1  # choices
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    # --per-request-spec-decode-metrics ("none": the response carries no `metrics`), the longest draft a check may
    # hold (its histogram's last bucket), and the request's draft checks once its finished output came
    spec_metrics: str = "none"
    num_spec_tokens: int = 0
    spec_decode: SpecDecodeStats | None = None

    def account(self, out: RequestOutput) -> None:
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_generated_tokens = max(self.num_generated_tokens, out.num_generated_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.spec_decode is not None:
            self.spec_decode = out.spec_decode

    def metrics(self) -> dict[str, Any] | None:
        """The response's `metrics` under --per-request-spec-decode-metrics (None when "none"), in vLLM's shape:
        ``{"speculative_decoding": ...}``, the request's draft checks (all choices'). ``acceptance_histogram[j]``
        counts the checks that kept exactly j draft tokens; the two rates are null where nothing was checked;
        "detailed" adds each check's counts, in order. Every protocol puts it beside its usage."""
        if self.spec_metrics == "none":
            return None
        stats = self.spec_decode or SpecDecodeStats()
        body: dict[str, Any] = {
            "mean_acceptance_length": stats.mean_acceptance_length,
            "draft_acceptance_rate": stats.draft_acceptance_rate,
            "acceptance_histogram": stats.acceptance_histogram(self.num_spec_tokens),
            "num_spec_steps": stats.num_spec_steps,
            "num_accepted_draft_tokens": stats.num_accepted_draft_tokens,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_spec_tokens": self.num_spec_tokens,
        }
        if self.spec_metrics == "detailed":
            body["per_step_accepted"] = list(stats.per_step_accepted)
            body["per_step_drafted"] = list(stats.per_step_drafted)
        return {"speculative_decoding": body}



def check_error(out: RequestOutput) -> None:
    if out.finish_reason == FinishReason.ERROR:
        raise EngineRequestError(out.error or "the engine failed while running this request")


async def with_error_event(events: AsyncIterator[bytes], run: EngineRun,
                            error_events: Callable[[Exception], list[bytes]]) -> AsyncIterator[bytes]:
    """End the stream with `error_events(exc)` on failure; always close the run."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        run.tracker.finish(outcome_of(exc))
        status, _, _ = error_for(exc)
        if isinstance(exc, CutAtShutdownError):
            logger.warning("stream %s cut: %s", run.request_id, exc)
        elif status >= 500:
            logger.error("stream %s failed: %s", run.request_id, exc)
        for event in error_events(exc):
            yield event
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()  # type: ignore[attr-defined]
        await run.close()


async def collected(run: EngineRun, request: Request, gathering: Awaitable[T]) -> T:
    """Await a non-streamed request's gathering; a client that leaves aborts it; always close the run."""
    try:
        return await _race_disconnect(request, gathering)
    except BaseException as exc:
        run.tracker.finish(outcome_of(exc))
        raise
    finally:
        await run.close()


async def drain(run: EngineRun, request: Request, batches: AsyncIterator[Any], result: Callable[[], T]) -> T:
    """A non-streamed request of a protocol that assembles events (Responses, Messages): run ``batches`` to the
    end (a client that leaves aborts it), then return ``result()``, the assembled answer."""

    async def gather() -> T:
        async for _ in batches:
            pass
        return result()

    return await collected(run, request, gather())
