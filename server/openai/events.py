"""The Chat Completions and Completions events: engine outputs -> OpenAI chunks (streamed) or one collected
answer. Builds wire objects only through server.openai.protocol. No onnxruntime import.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request

from engine.types import FinishReason, TokenLogprob
from server.errors import error_for
from server.http.run import EngineRun, StreamContext, check_error, collected, with_error_event
from server.http.sse import DONE, SLOT, ChunkTemplate, data_event, event_source
from server.openai import protocol
from server.reasoning import DeltaSource


def usage(ctx: StreamContext) -> dict[str, Any]:
    return protocol.usage(ctx.num_prompt_tokens, ctx.num_generated_tokens, ctx.num_cached_tokens)


def error_events(exc: Exception) -> list[bytes]:
    """The end of a failed chat or completions stream: an OpenAI error event, then [DONE]."""
    return [data_event(error_for(exc)[1]), DONE]


def tool_finish_reason(reason: str | None, calls: DeltaSource) -> str | None:
    """OpenAI's finish_reason for an answer read by a tool-call parser: 'tool_calls' when it made calls and
    ended by itself ('length' stays 'length': the last call may be cut)."""
    return "tool_calls" if calls.has_calls and reason == str(FinishReason.STOP) else reason


def _read_chat_events(run: EngineRun, ctx: StreamContext, calls: Sequence[DeltaSource]) -> AsyncIterator[bytes]:
    """As _chat_events, with each choice's text read by its own DeltaSource (``calls[index]``): content deltas,
    delta.tool_calls and the thinking (delta.reasoning_content and delta.reasoning)."""

    def chunk(index: int, delta: dict[str, Any], **extra: Any) -> bytes:
        return data_event(protocol.chat_chunk(ctx.request_id, ctx.created, ctx.model, delta,
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
            yield data_event(protocol.chat_usage_chunk(ctx.request_id, ctx.created, ctx.model, usage(ctx),
                                                           ctx.metrics()))
        yield DONE

    return with_error_event(events(), run, error_events)


def _chat_events(run: EngineRun, ctx: StreamContext) -> AsyncIterator[bytes]:
    async def events() -> AsyncIterator[bytes]:
        for index in range(ctx.n):
            yield data_event(protocol.chat_chunk(ctx.request_id, ctx.created, ctx.model,
                                             {"role": "assistant", "content": ""},
                                             with_usage_field=ctx.include_usage, index=index))
        content = [ChunkTemplate(protocol.chat_chunk(ctx.request_id, ctx.created, ctx.model, {"content": SLOT},
                                                      with_usage_field=ctx.include_usage, index=index))
                   for index in range(ctx.n)]
        async for out in run.outputs():
            ctx.account(out)
            check_error(out)
            logprobs = (protocol.chat_logprobs(out.logprobs, ctx.token_text)
                        if ctx.want_logprobs and out.logprobs else None)
            if logprobs:
                yield data_event(protocol.chat_chunk(ctx.request_id, ctx.created, ctx.model, {"content": out.text},
                                                 logprobs=logprobs, with_usage_field=ctx.include_usage,
                                                 index=out.index))
            elif out.text:
                yield content[out.index].render(out.text)
            if out.finish_reason is not None:
                # NOTE(server): exactly one chunk per choice carries finish_reason, with an empty delta (as OpenAI).
                yield data_event(protocol.chat_chunk(ctx.request_id, ctx.created, ctx.model, {},
                                                 finish_reason=protocol.finish_reason_str(out.finish_reason),
                                                 with_usage_field=ctx.include_usage, index=out.index))
        if ctx.include_usage:
            yield data_event(protocol.chat_usage_chunk(ctx.request_id, ctx.created, ctx.model, usage(ctx),
                                                           ctx.metrics()))
        yield DONE

    return with_error_event(events(), run, error_events)


def _completion_events(run: EngineRun, ctx: StreamContext) -> AsyncIterator[bytes]:
    async def events() -> AsyncIterator[bytes]:
        text = [ChunkTemplate(protocol.completion_chunk(ctx.request_id, ctx.created, ctx.model, SLOT,
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
                yield data_event(protocol.completion_chunk(ctx.request_id, ctx.created, ctx.model, out.text,
                                                       logprobs=logprobs, with_usage_field=ctx.include_usage,
                                                       index=out.index))
            elif out.text:
                yield text[out.index].render(out.text)
            if out.finish_reason is not None:
                yield data_event(protocol.completion_chunk(ctx.request_id, ctx.created, ctx.model, "",
                                                       finish_reason=protocol.finish_reason_str(out.finish_reason),
                                                       with_usage_field=ctx.include_usage, index=out.index))
        if ctx.include_usage:
            yield data_event(protocol.completion_chunk(ctx.request_id, ctx.created, ctx.model, "",
                                                   usage_dict=usage(ctx), with_choice=False, metrics=ctx.metrics()))
        yield DONE

    return with_error_event(events(), run, error_events)


def stream_chat(run: EngineRun, ctx: StreamContext, ping_s: float, shutdown_grace_s: float,
                readers: Sequence[DeltaSource] | None = None) -> EventSourceResponse:
    """The chat stream; with ``readers`` (the request can make calls, or the model thinks; one per choice) the
    text goes through its choice's reader."""
    events = _chat_events(run, ctx) if readers is None else _read_chat_events(run, ctx, readers)
    return event_source(events, run, ping_s, shutdown_grace_s)


def stream_completion(run: EngineRun, ctx: StreamContext, ping_s: float,
                      shutdown_grace_s: float) -> EventSourceResponse:
    return event_source(_completion_events(run, ctx), run, ping_s, shutdown_grace_s)


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
