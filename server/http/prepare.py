"""Helpers shared by the generation routes: engine lookup, model check, prompt preparation.

No onnxruntime import; tokenizing and templating run in a worker thread, never on the event loop.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
from starlette.requests import Request

from engine.config import DEFAULT_SPECULATIVE_TOKENS
from engine.types import InvalidRequestError, PromptTooLongError, SamplingParams, StructuredOutput
from server.openai import protocol
from server.openai.sampling_fields import SamplingFieldsT, with_defaults
from server.engine_client import EngineClient
from server.metrics import RequestTracker
from server.prompt import RenderedPrompt, TemplateOptions, render_prompt
from server.reasoning import DeltaSource, EchoedDeltas, ReasoningDeltas, ReasoningFormat, TextDeltas
from server.settings import Settings
from server.state import ServerState, get_state
from server.http.run import EngineRun, StreamContext
from server.tools.grammar import Trigger, json_answer_grammar, with_thinking
from server.tools.formats import make_format
from server.tools.plan import ToolPlan, ToolRequest, plan_tools
from server.tools.stream import ToolCallStream

logger = logging.getLogger(__name__)

# Completions give 16 tokens by default (OpenAI's documented default); chat runs to the context end.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


async def engine_for(request: Request, model: str | None,
                     keep_alive_s: float | None = None) -> tuple[ServerState, EngineClient]:
    """The engine of the requested chat model (server.hub.registry: 404 for an unknown name, 400 for an embedding
    model, 503 while it loads past the bound), loaded on demand; the request holds it until its response ends.

    Args:
        keep_alive_s: Ollama's keep_alive / LM Studio's ttl for the model (None: its default).
    """
    state = get_state(request)
    entry = await state.acquire(request, model, "chat", keep_alive_s)
    request.state.ortserve_model = entry.name
    return state, entry.engine if entry.engine is not None else state.require_engine()


def start_tracking(request: Request, state: ServerState) -> RequestTracker:
    """A latency tracker for this request, also reachable by the error handlers (request.state)."""
    tracker = state.metrics.tracker()
    tracker.model_name = state.metric_model(request)
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


def _render_and_encode(engine: EngineClient, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       options: TemplateOptions) -> tuple[RenderedPrompt, list[int]]:
    rendered = render_prompt(engine.chat_template, messages, tools, options)
    return rendered, _encode(engine, rendered.text, "messages")


def _template_floor(engine: EngineClient) -> int:
    """The fewest tokens the chat template renders for one user or one assistant message with empty content, halved
    (a margin for templates whose text can merge across message boundaries); 0 when the template can't be measured.
    """
    def count(roles: str) -> int:
        messages = [{"role": "user" if r == "u" else "assistant", "content": ""} for r in roles]
        return len(engine.tokenizer.encode(render_prompt(engine.chat_template, messages, None, TemplateOptions()).text))

    try:
        ua, uau, uaua = count("ua"), count("uau"), count("uaua")
        return max(0, min(uau - ua, uaua - uau) // 2)
    except Exception:  # noqa: BLE001 - a template that refuses these conversations: no floor, no early refusal
        return 0


_FLOORS: weakref.WeakKeyDictionary[EngineClient, int] = weakref.WeakKeyDictionary()  # engine -> _template_floor


def refuse_uncontainable_chat(state: ServerState, data: Any) -> None:
    """Raise PromptTooLongError for a decoded chat body (before it is validated) whose user and assistant messages
    cannot fit the context by their count alone: each renders at least ``_template_floor`` tokens. A 4 MB body of
    140,000 small messages is refused here instead of after seconds of validation that hold the interpreter."""
    engine = state.engine
    messages = data.get("messages") if isinstance(data, dict) else None
    if engine is None or state.status != "ready" or not isinstance(messages, list) or len(messages) < 64:
        return
    floor = _FLOORS.get(engine)
    if floor is None:
        floor = _FLOORS[engine] = _template_floor(engine)
    if not floor:
        return
    count = sum(1 for m in messages if isinstance(m, dict) and m.get("role") in ("user", "assistant"))
    if count * floor >= engine.max_model_len:
        raise PromptTooLongError(count * floor, engine.max_model_len, lower_bound=True, param="messages")


# NOTE(server): conversations longer than this are turned into template messages in a worker thread: at 135,000
# messages that is ~0.1-0.3 s of Python the event loop would otherwise spend away from every other stream.
THREADED_MESSAGES = 1000


def _plan_and_encode(engine: EngineClient, messages: list[dict[str, Any]], tools: ToolRequest, options: TemplateOptions,
                     tool_format: str | None = None) -> tuple[ToolPlan, RenderedPrompt, list[int]]:
    plan = plan_tools(messages, tools, engine.chat_template, engine.tokenizer, tool_format)
    return (plan, *_render_and_encode(engine, plan.messages, plan.template_tools, options))


async def chat_prompt(engine: EngineClient, messages: list[dict[str, Any]], tools: ToolRequest,
                      options: TemplateOptions = TemplateOptions(),
                      tool_format: str | None = None) -> tuple[ToolPlan, RenderedPrompt, list[int]]:
    """The tool plan (format, grammar, parser), the rendered prompt and its ids, in a worker thread (long prompts
    take milliseconds). ``tool_format``: --tool-call-parser."""
    return await anyio.to_thread.run_sync(_plan_and_encode, engine, messages, tools, options, tool_format)


# NOTE(server): a prompt this short tokenizes in tens of microseconds, less than the hop to a worker thread and back
# costs the event loop (measured with perf/front_end.py: 64 arrivals of 25-word prompts); longer ones go to a thread.
INLINE_PROMPT_CHARS = 1024


async def completion_prompt_ids(engine: EngineClient, prompt: str | list[int]) -> list[int]:
    """Tokenize a text prompt (in a worker thread unless it is short); token-id prompts are checked and passed
    through."""
    if isinstance(prompt, str):
        if len(prompt) <= INLINE_PROMPT_CHARS:
            return _encode(engine, prompt, "prompt", True)
        return await anyio.to_thread.run_sync(_encode, engine, prompt, "prompt", True)
    for index, token_id in enumerate(prompt):
        if token_id < 0:
            raise InvalidRequestError(f"prompt token ids must be >= 0, got {token_id} at {index}", param="prompt",
                                      code="invalid_value")
    return list(prompt)


def sampling_defaults(body: SamplingFieldsT, settings: Settings, engine: EngineClient) -> SamplingFieldsT:
    """``body`` with the sampling fields it leaves unset filled in: --default-temperature, then the model's
    generation_config.json (--generation-config auto), then the APIs' defaults."""
    return with_defaults(body, engine.sampling_defaults if settings.generation_config == "auto" else {},
                         settings.default_temperature)


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
    """A chat request made ready for the engine: its prompt, sampling parameters and tool plan.

    ``reasoning``: the thinking format of the output (None: no split); ``echo``: text the answer starts with
    (the continued assistant message, with ``echo``).
    """

    prompt_ids: list[int]
    params: SamplingParams
    plan: ToolPlan
    reasoning: ReasoningFormat | None = None
    echo: str = ""

    @property
    def plain(self) -> bool:
        """The output is plain text as it comes (no calls, no thinking, no echo): the fast streaming path."""
        return self.plan.parser is None and self.reasoning is None and not self.echo

    def delta_source(self) -> DeltaSource:
        """A fresh reader of one choice's output: thinking split off first, then the answer read by the tool-call
        parser (or as plain text). Feed it the output; its ``message()`` is the whole answer."""
        inner: DeltaSource = (ToolCallStream(make_format(self.plan.parser, self.plan.tool_names), self.plan.max_calls,
                                             self.plan.tool_names)
                              if self.plan.parser else TextDeltas())
        source = ReasoningDeltas(self.reasoning, inner) if self.reasoning is not None else inner
        return EchoedDeltas(self.echo, source) if self.echo else source

    def delta_sources(self) -> list[DeltaSource]:
        """One fresh reader per choice (``params.n``)."""
        return [self.delta_source() for _ in range(self.params.n)]


def _allow_thinking(structured: StructuredOutput, fmt: ReasoningFormat,
                    engine: EngineClient) -> StructuredOutput:
    """A whole-answer constraint (a forced call, the generic format's JSON, a JSON answer) that first lets a
    thinking model think; other constraints (a client's regex or grammar) stay as they are."""
    def trigger(text: str) -> Trigger:
        return Trigger(text, engine.tokenizer.special_token_id(text))

    if structured.kind == "lark":
        spec = structured.spec
    elif structured.kind in ("json_schema", "json_object"):
        spec = json_answer_grammar(json.loads(structured.spec) if structured.kind == "json_schema"
                                   else {"type": "object"})
    else:
        return structured
    spec = with_thinking(spec, trigger(fmt.open_tag), trigger(fmt.close_tag), starts_open=fmt.starts_open)
    return replace(structured, kind="lark", spec=spec)


def _log_tool_results(messages: Sequence[dict[str, Any]]) -> None:
    """Log the tool results that end the conversation (what the client ran since the model's last calls)."""
    results = []
    for message in reversed(messages):
        if message.get("role") != "tool":
            break
        results.append(message)
    if results:
        logger.info("tool results received: %s", "; ".join(
            f"{m.get('tool_call_id') or '?'} ({len(m.get('content') or '')} chars)" for m in reversed(results)))


def _log_tools_offered(request: ToolRequest) -> None:
    """Log (debug) the tools a chat request offers and its tool_choice."""
    if request.tools and logger.isEnabledFor(logging.DEBUG):
        logger.debug("tools offered: %s (tool_choice %s)", ", ".join(t["function"]["name"] for t in request.tools),
                     request.function or request.choice)


async def prepare_chat(engine: EngineClient, settings: Settings, body: protocol.ChatCompletionRequest) -> PreparedChat:
    """Tool plan, template + tokenize (in a thread) and the checked SamplingParams; shared by chat, Responses and
    Messages."""
    messages = (await anyio.to_thread.run_sync(body.template_messages) if len(body.messages) > THREADED_MESSAGES
                else body.template_messages())
    _log_tool_results(messages)
    body = sampling_defaults(body, settings, engine)
    tool_request = body.tool_request()
    _log_tools_offered(tool_request)
    plan, rendered, prompt_ids = await chat_prompt(engine, messages, tool_request, body.template_options(),
                                                   settings.tool_call_parser)
    default_max_tokens = settings.default_max_tokens or remaining_context(engine, len(prompt_ids))
    params = body.to_sampling_params(default_max_tokens, engine.max_model_len)
    structured = plan.structured or params.structured
    fmt, at_generation = rendered.reasoning, rendered.generation
    if (structured is not None and at_generation is not None and at_generation.start != "closed"
            and (plan.whole_answer or plan.structured is None)):
        structured = _allow_thinking(structured, at_generation, engine)
    preserved = plan.preserved_tokens + (fmt.tags if fmt is not None else ())
    if structured is not params.structured or preserved:
        params = replace(params, structured=structured, preserved_tokens=preserved)
    params = checked_params(engine, prompt_ids, params, "messages")
    return PreparedChat(prompt_ids, params, plan, fmt, rendered.echo)


def request_priority(request: Request) -> int:
    """The engine priority of a request: 0 (interactive), or a batch line's (server.batches.runner runs its lines
    through the app with ``ortserve.priority`` in the ASGI scope, which no HTTP client can set)."""
    return int(request.scope.get("ortserve.priority", 0))


async def start_run(request: Request | None, state: ServerState, engine: EngineClient, tracker: RequestTracker,
                    id_prefix: str, prompt_ids: list[int], params: SamplingParams,
                    include_usage: bool, request_id: str | None = None,
                    accept_s: float | None = None, model: str | None = None) -> tuple[EngineRun, StreamContext]:
    """Hand the request to the engine (429/503 still become HTTP statuses here) and build its response
    context; the caller streams it or collects it. `request_id` defaults to a new `<id_prefix>-<hex>`;
    `accept_s`: EngineRun.start's (a stream may start before the first output). ``request`` None: work that no
    client waits for (a background response), of ``model``."""
    request_id = request_id or protocol.new_id(id_prefix)
    if request is not None:
        model = getattr(request.state, "ortserve_model", None) or model
    model = model or state.served_model_name
    tracker.model_name = model
    run = EngineRun(engine, request_id, prompt_ids, params, tracker,
                    request_priority(request) if request is not None else 0)
    await run.start(request, accept_s)
    ctx = StreamContext(
        request_id=request_id,
        created=protocol.now_s(),
        model=model,
        include_usage=include_usage,
        token_text=lambda token_id: engine.tokenizer.decode([token_id]),
        want_logprobs=params.logprobs,
        n=params.n,
        num_prompt_tokens=len(prompt_ids),
        spec_metrics=state.settings.per_request_spec_decode_metrics,
        num_spec_tokens=longest_draft(state.settings),
    )
    return run, ctx


def longest_draft(settings: Settings) -> int:
    """The most draft tokens one check may hold under these settings (prompt lookup's, the draft model's)."""
    ngram = DEFAULT_SPECULATIVE_TOKENS if settings.speculative_tokens is None else settings.speculative_tokens
    return max(ngram, settings.draft_max if settings.draft_model else 0)
