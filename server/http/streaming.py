"""Engine outputs -> SSE chunks or one collected response; a client that goes away aborts its request.

Owns the lifetime of one engine request on the HTTP side (start, peek, stream/collect, abort).
Builds wire objects only through server.openai.protocol. No onnxruntime import.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
from sse_starlette import EventSourceResponse
from starlette.requests import Request

from engine.types import EngineError, FinishReason, RequestOutput, TokenLogprob
from server.openai import protocol
from server.responses.protocol import response_usage
from server.responses.events import Event, ResponseAssembler
from server.engine_client import EngineClient
from server.errors import EngineNotReadyError, ServerError, error_for
from server.metrics import REJECTED, RequestTracker
from server.reasoning import DeltaSource

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


async def _race_disconnect(request: Request, awaitable: Any) -> Any:
    """Await `awaitable`, but cancel it and raise ClientDisconnectedError if the client leaves first."""
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
                 tracker: RequestTracker) -> None:
        self.engine = engine
        self.request_id = request_id
        self.tracker = tracker
        self.finished = False
        self._closed = False
        self._agen = engine.generate(prompt_ids, params, request_id)
        self._first: RequestOutput | None = None
        self._cut: ServerError | None = None
        tracker.submitted()

    async def start(self, request: Request) -> None:
        """Wait for the first output so that 400/429/503 can still be HTTP statuses."""
        try:
            self._first = await _race_disconnect(request, self._agen.__anext__())
        except StopAsyncIteration:
            exc = EngineRequestError("the engine ended the request without output")
            await self.fail(exc)
            raise exc from None
        except BaseException as exc:
            await self.fail(exc)
            raise
        self._observe(self._first)

    async def fail(self, exc: BaseException) -> None:
        """Record the outcome `exc` stands for, then abort and close."""
        self.tracker.finish(outcome_of(exc))
        await self.close()

    def _observe(self, out: RequestOutput) -> None:
        self.tracker.on_output(out)
        if out.finished:
            self.finished = True
            self.tracker.finish(_final_status(out))

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The peeked first output, then the rest, up to and including the finished one."""
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

    def account(self, out: RequestOutput) -> None:
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_generated_tokens = max(self.num_generated_tokens, out.num_generated_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)

    def usage(self) -> dict[str, Any]:
        return protocol.usage(self.num_prompt_tokens, self.num_generated_tokens, self.num_cached_tokens)


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# NOTE(server): events are framed here, as bytes, exactly as sse-starlette would frame the same text with
# sep="\n" ("data: " + line + "\n\n"): json.dumps escapes CR and LF inside strings, so the JSON is one
# line. sse-starlette passes bytes through as they are, skipping its per-event ServerSentEvent encoding.
_DONE = b"data: [DONE]\n\n"
_SLOT = "\x00ortserve-slot\x00"  # a string no chunk contains; json.dumps writes its NULs as \u0000


def _event(obj: dict[str, Any]) -> bytes:
    """One framed SSE event carrying `obj` as compact JSON."""
    return b"data: " + _dump(obj).encode("utf-8") + b"\n\n"


class _ChunkTemplate:
    """A chunk whose only varying part is one string field, serialized once around that field.

    Built from the protocol's own dict (the field set to _SLOT), so render(text) is byte for byte
    _event() of the same dict with the field set to text, at the cost of one json.dumps of a string.
    """

    def __init__(self, chunk: dict[str, Any]) -> None:
        head, slot, tail = _event(chunk).partition(_dump(_SLOT).encode("utf-8"))
        if not slot or _dump(_SLOT).encode("utf-8") in tail:
            raise ValueError("a chunk template needs exactly one _SLOT field")
        self._head, self._tail = head, tail

    def render(self, text: str) -> bytes:
        return self._head + _dump(text).encode("utf-8") + self._tail


def check_error(out: RequestOutput) -> None:
    if out.finish_reason == FinishReason.ERROR:
        raise EngineRequestError(out.error or "the engine failed while running this request")


def _error_events(exc: Exception) -> list[bytes]:
    """The end of a failed chat or completions stream: an OpenAI error event, then [DONE]."""
    return [_event(error_for(exc)[1]), _DONE]


async def with_error_event(events: AsyncIterator[bytes], run: EngineRun,
                            error_events: Callable[[Exception], list[bytes]] = _error_events) -> AsyncIterator[bytes]:
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


def tool_finish_reason(reason: str | None, calls: DeltaSource) -> str | None:
    """OpenAI's finish_reason for an answer read by a tool-call parser: 'tool_calls' when it made calls and
    ended by itself ('length' stays 'length': the last call may be cut)."""
    return "tool_calls" if calls.has_calls and reason == str(FinishReason.STOP) else reason


def _read_chat_events(run: EngineRun, ctx: StreamContext, calls: Sequence[DeltaSource]) -> AsyncIterator[bytes]:
    """As _chat_events, with each choice's text read by its own DeltaSource (``calls[index]``): content deltas,
    delta.tool_calls and the thinking (delta.reasoning_content and delta.reasoning)."""

    def chunk(index: int, delta: dict[str, Any], **extra: Any) -> bytes:
        return _event(protocol.chat_chunk(ctx.request_id, ctx.created, ctx.model, delta,
                                          with_usage_field=ctx.include_usage, index=index, **extra))

    async def events() -> AsyncIterator[bytes]:
        for index in range(ctx.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for out in run.outputs():
            ctx.account(out)
            check_error(out)
            parser = calls[out.index]
            done = out.finish_reason is not None  # this choice's last output
            deltas = parser.feed(out.text, final=done)
            if ctx.want_logprobs and out.logprobs:
                # NOTE(tools): a parser holds text back, so a step's logprobs ride on its first delta (or on an
                # empty content delta when the step's text is still held).
                logprobs = protocol.chat_logprobs(out.logprobs, ctx.token_text)
                first, deltas = (deltas[0], deltas[1:]) if deltas else ({"content": ""}, [])
                yield chunk(out.index, first, logprobs=logprobs)
            for delta in deltas:
                yield chunk(out.index, delta)
            if done:
                reason = tool_finish_reason(protocol.finish_reason_str(out.finish_reason), parser)
                yield chunk(out.index, {}, finish_reason=reason)
        if ctx.include_usage:
            yield _event(protocol.chat_usage_chunk(ctx.request_id, ctx.created, ctx.model, ctx.usage()))
        yield _DONE

    return with_error_event(events(), run)


def _chat_events(run: EngineRun, ctx: StreamContext) -> AsyncIterator[bytes]:
    async def events() -> AsyncIterator[bytes]:
        for index in range(ctx.n):
            yield _event(protocol.chat_chunk(ctx.request_id, ctx.created, ctx.model,
                                             {"role": "assistant", "content": ""},
                                             with_usage_field=ctx.include_usage, index=index))
        content = [_ChunkTemplate(protocol.chat_chunk(ctx.request_id, ctx.created, ctx.model, {"content": _SLOT},
                                                      with_usage_field=ctx.include_usage, index=index))
                   for index in range(ctx.n)]
        async for out in run.outputs():
            ctx.account(out)
            check_error(out)
            logprobs = (protocol.chat_logprobs(out.logprobs, ctx.token_text)
                        if ctx.want_logprobs and out.logprobs else None)
            if logprobs:
                yield _event(protocol.chat_chunk(ctx.request_id, ctx.created, ctx.model, {"content": out.text},
                                                 logprobs=logprobs, with_usage_field=ctx.include_usage,
                                                 index=out.index))
            elif out.text:
                yield content[out.index].render(out.text)
            if out.finish_reason is not None:
                # NOTE(server): exactly one chunk per choice carries finish_reason, with an empty delta (as OpenAI).
                yield _event(protocol.chat_chunk(ctx.request_id, ctx.created, ctx.model, {},
                                                 finish_reason=protocol.finish_reason_str(out.finish_reason),
                                                 with_usage_field=ctx.include_usage, index=out.index))
        if ctx.include_usage:
            yield _event(protocol.chat_usage_chunk(ctx.request_id, ctx.created, ctx.model, ctx.usage()))
        yield _DONE

    return with_error_event(events(), run)


def _completion_events(run: EngineRun, ctx: StreamContext) -> AsyncIterator[bytes]:
    async def events() -> AsyncIterator[bytes]:
        text = [_ChunkTemplate(protocol.completion_chunk(ctx.request_id, ctx.created, ctx.model, _SLOT,
                                                         with_usage_field=ctx.include_usage, index=index))
                for index in range(ctx.n)]
        text_offsets = [0] * ctx.n
        async for out in run.outputs():
            ctx.account(out)
            check_error(out)
            logprobs = None
            if ctx.want_logprobs and out.logprobs:
                logprobs = protocol.completion_logprobs(out.logprobs, ctx.token_text, text_offsets[out.index])
            text_offsets[out.index] += len(out.text)
            if logprobs:
                yield _event(protocol.completion_chunk(ctx.request_id, ctx.created, ctx.model, out.text,
                                                       logprobs=logprobs, with_usage_field=ctx.include_usage,
                                                       index=out.index))
            elif out.text:
                yield text[out.index].render(out.text)
            if out.finish_reason is not None:
                yield _event(protocol.completion_chunk(ctx.request_id, ctx.created, ctx.model, "",
                                                       finish_reason=protocol.finish_reason_str(out.finish_reason),
                                                       with_usage_field=ctx.include_usage, index=out.index))
        if ctx.include_usage:
            yield _event(protocol.completion_chunk(ctx.request_id, ctx.created, ctx.model, "",
                                                   usage_dict=ctx.usage(), with_choice=False))
        yield _DONE

    return with_error_event(events(), run)


# sse-starlette cancels a stream still open this long after the grace period: only one whose client has
# stopped reading, so that its error event and [DONE] cannot be sent (uvicorn's own limit is later still).
_FORCE_CANCEL_AFTER_GRACE_S = 1.0


def event_source(events: AsyncIterator[bytes], run: EngineRun, ping_s: float,
                 shutdown_grace_s: float) -> EventSourceResponse:
    """SSE response: `data: ...` events (framed bytes) separated by blank lines, keep-alive pings as comments.

    On server shutdown (sse-starlette sees uvicorn's exit signal) the stream may finish during
    `shutdown_grace_s`; one still running then is cut (EngineRun.cut): it ends with an OpenAI error event
    (code shutting_down) and `data: [DONE]`, and the chunked body is terminated, so clients read it to the end.
    """
    shutdown = anyio.Event()

    async def cut_when_the_grace_ends() -> None:
        await shutdown.wait()
        await anyio.sleep(shutdown_grace_s)
        await run.cut(CutAtShutdownError(f"The server is shutting down: this stream was ended after the "
                                         f"{shutdown_grace_s:g} s shutdown grace period.", code="shutting_down"))

    return EventSourceResponse(
        events,
        sep="\n",
        ping=ping_s,
        shutdown_event=shutdown,
        shutdown_grace_period=shutdown_grace_s + _FORCE_CANCEL_AFTER_GRACE_S,
        data_sender_callable=cut_when_the_grace_ends,
        headers={"Cache-Control": "no-cache"},
    )


def stream_chat(run: EngineRun, ctx: StreamContext, ping_s: float, shutdown_grace_s: float,
                readers: Sequence[DeltaSource] | None = None) -> EventSourceResponse:
    """The chat stream; with ``readers`` (the request can make calls, or the model thinks; one per choice) the
    text goes through its choice's reader."""
    events = _chat_events(run, ctx) if readers is None else _read_chat_events(run, ctx, readers)
    return event_source(events, run, ping_s, shutdown_grace_s)


def stream_completion(run: EngineRun, ctx: StreamContext, ping_s: float,
                      shutdown_grace_s: float) -> EventSourceResponse:
    return event_source(_completion_events(run, ctx), run, ping_s, shutdown_grace_s)


class TextDeltas:
    """The chat deltas of plain text: each output's text is one content delta (no tools, no parsing)."""

    has_calls = False

    def __init__(self) -> None:
        self._content: list[str] = []

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        if not piece:
            return []
        self._content.append(piece)
        return [{"content": piece}]

    def message(self) -> dict[str, Any]:
        return {"content": "".join(self._content), "tool_calls": None}


class EchoedDeltas:
    """A DeltaSource whose output starts with ``echo`` (the continued assistant message, vLLM's ``echo``): the
    echoed text is read like the rest (it may hold the start of the thinking, or of a call)."""

    def __init__(self, echo: str, inner: DeltaSource) -> None:
        self._echo = echo
        self._inner = inner

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        echo, self._echo = self._echo, ""
        return self._inner.feed(echo + piece, final)

    @property
    def has_calls(self) -> bool:
        return self._inner.has_calls

    def message(self) -> dict[str, Any]:
        return self._inner.message()


@dataclass
class Collected:
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob]
    more: list[Collected] = field(default_factory=list)  # n > 1: choices 1..n-1


async def collect(run: EngineRun, ctx: StreamContext, request: Request) -> Collected:
    """Run a non-streaming request to the end; a client that leaves aborts it. Returns choice 0 (the others,
    n > 1, in its ``more``)."""

    async def gather() -> Collected:
        choices = [Collected("", None, []) for _ in range(ctx.n)]
        parts: list[list[str]] = [[] for _ in range(ctx.n)]
        async for out in run.outputs():
            ctx.account(out)
            check_error(out)
            choice = choices[out.index]
            parts[out.index].append(out.text)
            if out.logprobs:
                choice.logprobs.extend(out.logprobs)
            if out.finish_reason is not None:
                choice.finish_reason = protocol.finish_reason_str(out.finish_reason)
        for choice, texts in zip(choices, parts):
            choice.text = "".join(texts)
        choices[0].more = choices[1:]
        return choices[0]

    return await collected(run, request, gather())


async def collected(run: EngineRun, request: Request, gathering: Awaitable[T]) -> T:
    """Await a non-streamed request's gathering; a client that leaves aborts it; always close the run."""
    try:
        return await _race_disconnect(request, gathering)
    except BaseException as exc:
        run.tracker.finish(outcome_of(exc))
        raise
    finally:
        await run.close()


# --- the Responses API (POST /v1/responses) ------------------------------------------------------------


def named_event(event: Event) -> bytes:
    """A Responses event: `event: <type>` then its JSON on one `data:` line (no [DONE] ends these streams)."""
    return b"event: " + event["type"].encode("ascii") + b"\ndata: " + _dump(event).encode("utf-8") + b"\n\n"


async def _response_event_lists(run: EngineRun, ctx: StreamContext, assembler: ResponseAssembler,
                                deltas: DeltaSource, on_finished: Callable[[ResponseAssembler], None],
                                ) -> AsyncIterator[list[Event]]:
    """The events of each engine output; `on_finished` runs (e.g. stores the response) before the last ones."""
    yield assembler.start()
    async for out in run.outputs():
        ctx.account(out)
        check_error(out)
        events: list[Event] = []
        for delta in deltas.feed(out.text, final=out.finished):
            events += assembler.feed(delta)
        if out.finished:
            events += assembler.finish(protocol.finish_reason_str(out.finish_reason),
                                       response_usage(ctx.num_prompt_tokens, ctx.num_generated_tokens,
                                                      ctx.num_cached_tokens))
            on_finished(assembler)
        yield events


def stream_response(run: EngineRun, ctx: StreamContext, assembler: ResponseAssembler, deltas: DeltaSource,
                    on_finished: Callable[[ResponseAssembler], None], ping_s: float,
                    shutdown_grace_s: float) -> EventSourceResponse:
    """A Responses stream: response.created ... response.completed (or .incomplete); an engine failure
    mid-stream ends it with response.failed. A client that goes away aborts the request."""

    async def events() -> AsyncIterator[bytes]:
        async for batch in _response_event_lists(run, ctx, assembler, deltas, on_finished):
            for event in batch:
                yield named_event(event)

    def failed(exc: Exception) -> list[bytes]:
        message = error_for(exc)[1]["error"]["message"]  # never a traceback: error_for hides our own bugs
        batch = assembler.fail(message, response_usage(ctx.num_prompt_tokens, ctx.num_generated_tokens,
                                                       ctx.num_cached_tokens))
        on_finished(assembler)
        return [named_event(event) for event in batch]

    return event_source(with_error_event(events(), run, failed), run, ping_s, shutdown_grace_s)


async def collect_response(run: EngineRun, ctx: StreamContext, request: Request, assembler: ResponseAssembler,
                           deltas: DeltaSource, on_finished: Callable[[ResponseAssembler], None]) -> dict[str, Any]:
    """Run a non-streamed Responses request to the end through the same assembler; returns the Response."""

    async def gather() -> dict[str, Any]:
        async for _ in _response_event_lists(run, ctx, assembler, deltas, on_finished):
            pass
        return assembler.response()

    return await collected(run, request, gather())
