"""Helpers shared by the generation routes: engine lookup, model check, prompt preparation.

No onnxruntime import; tokenizing and templating run in a worker thread, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
from starlette.requests import Request

from engine.types import InvalidRequestError, PromptTooLongError, SamplingParams
from server import protocol
from server.engine_client import EngineClient
from server.errors import ModelNotFoundError
from server.metrics import RequestTracker
from server.settings import Settings
from server.state import ServerState, get_state
from server.streaming import EngineRun, StreamContext
from server.tools.parsers import make_parser
from server.tools.plan import ToolPlan, ToolRequest, plan_tools
from server.tools.stream import ToolCallStream

# Completions give 16 tokens by default (OpenAI's documented default); chat runs to the context end.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def engine_for(request: Request, model: str | None) -> tuple[ServerState, EngineClient]:
    """The ready engine (503 while loading) after checking the requested model name (404)."""
    state = get_state(request)
    engine = state.require_engine()
    state.require_chat_model(model)  # an embedding model asked to chat: 400 naming it
    if not state.accepts_model(model):
        raise ModelNotFoundError(model or "", state.served_model_name, also=state.embedding_names())
    return state, engine


def start_tracking(request: Request, state: ServerState) -> RequestTracker:
    """A latency tracker for this request, also reachable by the error handlers (request.state)."""
    tracker = state.metrics.tracker()
    request.state.ortserve_tracker = tracker
    return tracker


def _encode(engine: EngineClient, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
    """Tokenize `text`; a string that is not valid Unicode is the client's error (400), not ours.

    ``add_special_tokens``: what the tokenizer adds around a text (BOS for Gemma, Llama): a completion prompt
    gets it, as llama.cpp and vLLM give it; a rendered chat template already holds its special tokens. A text
    too long for the context by its length alone is refused before any of it is tokenized.
    """
    at_least = engine.tokenizer.min_num_tokens(text)
    if at_least >= engine.max_model_len:
        raise PromptTooLongError(at_least, engine.max_model_len, lower_bound=True, param=param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # NOTE(server): JSON allows a lone "\ud800" escape; Python keeps it as a surrogate that no tokenizer
        # (nor UTF-8) can take. Found by tests/reliability/test_fuzz_chat.py.
        raise InvalidRequestError(f"{param} must be valid Unicode text, but it contains the lone surrogate "
                                  f"{text[exc.start]!r} (an unpaired \\uD800-\\uDFFF escape)",
                                  param=param, code="invalid_value") from None
    return list(engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _render_and_encode(engine: EngineClient, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> list[int]:
    text = engine.chat_template.render(messages, tools=tools, add_generation_prompt=True)
    return _encode(engine, text, "messages")


# NOTE(server): conversations longer than this are turned into template messages in a worker thread: at 135,000
# messages that is ~0.1-0.3 s of Python the event loop would otherwise spend away from every other stream.
THREADED_MESSAGES = 1000


async def chat_prompt_ids(engine: EngineClient, messages: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Render the chat template and tokenize, in a worker thread (long prompts take milliseconds)."""
    return await anyio.to_thread.run_sync(_render_and_encode, engine, messages, tools)


def _plan_and_encode(engine: EngineClient, messages: list[dict[str, Any]],
                     tools: ToolRequest) -> tuple[ToolPlan, list[int]]:
    plan = plan_tools(messages, tools, engine.chat_template, engine.tokenizer)
    return plan, _render_and_encode(engine, plan.messages, plan.template_tools)


async def chat_prompt(engine: EngineClient, messages: list[dict[str, Any]],
                      tools: ToolRequest) -> tuple[ToolPlan, list[int]]:
    """The tool plan (format, grammar, parser) and the prompt ids, in a worker thread."""
    return await anyio.to_thread.run_sync(_plan_and_encode, engine, messages, tools)


async def completion_prompt_ids(engine: EngineClient, prompt: str | list[int]) -> list[int]:
    """Tokenize a text prompt in a worker thread; token-id prompts are checked and passed through."""
    if isinstance(prompt, str):
        return await anyio.to_thread.run_sync(_encode, engine, prompt, "prompt", True)
    for index, token_id in enumerate(prompt):
        if token_id < 0:
            raise InvalidRequestError(f"prompt token ids must be >= 0, got {token_id} at {index}", param="prompt",
                                      code="invalid_value")
    return list(prompt)


def checked_params(engine: EngineClient, prompt_ids: Sequence[int], params: SamplingParams,
                   prompt_param: str) -> SamplingParams:
    """Raise PromptTooLongError (400, naming both numbers) instead of ever truncating the prompt.

    Args:
        prompt_param: the wire field the prompt came from ('messages' or 'prompt'), named in errors.
    """
    try:
        engine.check_prompt(prompt_ids, params)
    except InvalidRequestError as exc:
        if exc.param in ("messages", "prompt"):
            exc.param = prompt_param
        raise
    for token_id, _ in params.logit_bias:
        if token_id >= engine.vocab_size:
            raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {engine.vocab_size}), got {token_id}",
                                      param="logit_bias", code="invalid_value")
    return params


def remaining_context(engine: EngineClient, num_prompt_tokens: int) -> int:
    return max(1, engine.max_model_len - num_prompt_tokens)


@dataclass(frozen=True)
class PreparedChat:
    """A chat request made ready for the engine: its prompt, sampling parameters and tool plan."""

    prompt_ids: list[int]
    params: SamplingParams
    plan: ToolPlan

    def tool_calls(self) -> ToolCallStream | None:
        """A fresh reader of the output's tool calls when the request can make calls (None: plain text)."""
        return ToolCallStream(make_parser(self.plan.parser), self.plan.max_calls) if self.plan.parser else None

    def tool_call_streams(self) -> list[ToolCallStream] | None:
        """One fresh reader per choice (``params.n``), or None when the request makes no calls."""
        return [ToolCallStream(make_parser(self.plan.parser), self.plan.max_calls, self.plan.tool_names)
                for _ in range(self.params.n)] if self.plan.parser else None


async def prepare_chat(engine: EngineClient, settings: Settings, body: protocol.ChatCompletionRequest) -> PreparedChat:
    """Tool plan, template + tokenize (in a thread) and the checked SamplingParams; shared by chat and Responses."""
    messages = (await anyio.to_thread.run_sync(body.template_messages) if len(body.messages) > THREADED_MESSAGES
                else body.template_messages())
    plan, prompt_ids = await chat_prompt(engine, messages, body.tool_request())
    default_max_tokens = settings.default_max_tokens or remaining_context(engine, len(prompt_ids))
    params = body.to_sampling_params(default_max_tokens, engine.max_model_len)
    if plan.structured is not None or plan.preserved_tokens:
        params = replace(params, structured=plan.structured or params.structured,
                         preserved_tokens=plan.preserved_tokens)
    params = checked_params(engine, prompt_ids, params, "messages")
    return PreparedChat(prompt_ids, params, plan)


async def start_run(request: Request, state: ServerState, engine: EngineClient, tracker: RequestTracker,
                    id_prefix: str, prompt_ids: list[int], params: SamplingParams,
                    include_usage: bool, request_id: str | None = None) -> tuple[EngineRun, StreamContext]:
    """Hand the request to the engine (429/503 still become HTTP statuses here) and build its response
    context; the caller streams it or collects it. `request_id` defaults to a new `<id_prefix>-<hex>`."""
    request_id = request_id or protocol.new_id(id_prefix)
    run = EngineRun(engine, request_id, prompt_ids, params, tracker)
    await run.start(request)
    ctx = StreamContext(
        request_id=request_id,
        created=protocol.now_s(),
        model=state.served_model_name,
        include_usage=include_usage,
        token_text=lambda token_id: engine.tokenizer.decode([token_id]),
        want_logprobs=params.logprobs,
        n=params.n,
    )
    return run, ctx
