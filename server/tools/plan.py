"""One chat request's tool calling, decided in one place: the output format, the prompt messages, the grammar.

A model whose chat template renders tools gets its native format (tools and tool history through the
template, its own call markup parsed, a lazily triggered grammar for `auto`). Any other model gets the
generic format: the tools described in a system message and the whole answer enforced as JSON, as
llama.cpp's generic handler does. The grammar library stays in the engine: engine.structured_output.check_schema
says what a grammar makes of a schema.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.structured_output import SchemaCheck, check_schema
from engine.types import InvalidRequestError, StructuredOutput
from server.tools import grammar
from server.tools.formats import FORMATS, GENERIC, choose_format
from server.tools.grammar import Trigger

logger = logging.getLogger(__name__)
# What a tool whose schema no grammar can be built for is held to: a JSON object (its arguments).
ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}

class _Template(Protocol):
    supports_tools: bool
    tool_source: str


class _Tokenizer(Protocol):
    def special_token_id(self, token: str) -> int | None: ...


@dataclass(frozen=True)
class ToolRequest:
    """The request's tool fields, validated (server.openai.protocol builds it).

    Attributes:
        tools: OpenAI tool definitions ``{"type": "function", "function": {"name", "description",
            "parameters"}}``.
        choice: "none", "auto", "required" or "function" (then ``function`` names it).
        parallel: parallel_tool_calls (several calls in one answer); None when the request does not say.
        response_schema: the JSON Schema an answer that makes no call must follow (response_format
            json_schema or json_object beside tools that may be called), or None (free text).
    """

    tools: tuple[dict[str, Any], ...] = ()
    choice: str = "none"
    function: str | None = None
    parallel: bool | None = None
    response_schema: dict[str, Any] | None = None

    def allows_parallel(self, native: bool) -> bool:
        """Whether one answer may hold several calls.

        NOTE(tools): unsaid, a native format follows OpenAI's default (true); the generic format allows one
        call, as llama.cpp's server does: a model without tool training, free to go on, repeats its call
        until max_tokens (SmolLM2 at temperature 0 wrote four calls for "What's the weather in Paris?").
        """
        return (self.parallel if self.parallel is not None else native) and self.choice != "function"

    @property
    def calls_possible(self) -> bool:
        return bool(self.tools) and self.choice != "none"


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request is rendered, constrained and parsed.

    Attributes:
        format: the output format ("hermes", "llama3_json", "mistral" or "generic").
        messages: the conversation to render (tool history in the form the format needs).
        template_tools: the ``tools`` variable for the chat template (native formats only).
        structured: the grammar that enforces calls, or None (no calls possible, or free text).
        parser: the parser that reads calls from the output; None when no call can be made.
        preserved_tokens: special tokens the detokenizer must keep for the parser.
        max_calls: 1 when parallel_tool_calls is false.
        whole_answer: the grammar constrains the answer from its first token (a forced call, the generic
            format's JSON, a JSON answer beside the calls); False when text runs free until a call opens.
        tool_names: the names a call may have (the grammar's choice): a name cut by max_tokens is completed
            from them when its prefix names one tool.
    """

    format: str
    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None = None
    structured: StructuredOutput | None = None
    parser: str | None = None
    preserved_tokens: tuple[str, ...] = ()
    max_calls: int | None = None
    whole_answer: bool = False
    tool_names: tuple[str, ...] = ()


def plan_tools(messages: Sequence[dict[str, Any]], request: ToolRequest, template: _Template,
               tokenizer: _Tokenizer, format_name: str | None = None) -> ToolPlan:
    """Render, constrain and parse plan for one request.

    Args:
        messages: ``[{"role", "content": str, "tool_calls"?: [...], "tool_call_id"?: str, "name"?: str}]``
            with tool-call arguments as JSON text (as on the wire).
        request: the validated tool fields (a plain ``ToolRequest()`` when the request has none).
        template: the model's chat template (``supports_tools``, ``tool_source``).
        tokenizer: tells which markup strings are special tokens.
        format_name: the output format (``--tool-call-parser``) instead of the one the template shows.
    """
    fmt = choose_format(template, format_name)
    native = fmt != GENERIC
    rendered = _native_history(messages) if native else _generic_history(messages, request)
    if not request.calls_possible:
        return ToolPlan(fmt, rendered, template_tools(request.tools) if native and request.tools else None)
    targets = enforceable_tools(request)
    required = request.choice in ("required", "function")
    parallel = request.allows_parallel(native)
    if request.response_schema is not None and fmt == "llama3_json" and not required:
        # NOTE(tools): Llama 3's call is a bare JSON object, so a JSON answer could not be told from a call.
        raise InvalidRequestError(
            "response_format cannot be combined with tools that may be called on this model (its Llama 3 tool "
            "calls are bare JSON objects, like the answer); send tool_choice 'required' or 'none', or leave out "
            "one of them", param="response_format", code="unsupported_parameter")
    spec = _grammar(fmt, targets, required=required, parallel=parallel, template=template, tokenizer=tokenizer,
                    response=request.response_schema)
    return ToolPlan(
        fmt, rendered, template_tools(request.tools) if native else None,
        structured=StructuredOutput("lark", spec, param="tools"),
        parser=fmt, preserved_tokens=FORMATS[fmt].preserved_tokens, max_calls=None if parallel else 1,
        whole_answer=required or not native or request.response_schema is not None,
        tool_names=tuple(t["function"]["name"] for t in targets))


def enforceable_tools(request: ToolRequest) -> list[dict[str, Any]]:
    """The tools a call may name (the named one, or all), as the grammar enforces them.

    NOTE(tools): a tool's schema never refuses a turn unless the client asked for it to be exact. A keyword the
    grammar cannot enforce (Claude Code 2.1.197's ``propertyNames``, a ``oneOf`` llguidance cannot prove exclusive,
    ``if``/``then``/``else``, ...) is left out and the rest enforced (the grammar is lenient, json_rule); a schema
    no grammar can be built for at all holds the call to a JSON object. Either is logged once per request, naming
    the tool and the keyword, as llama.cpp loosens what it cannot convert and vLLM leaves ``auto`` unconstrained.
    A ``strict: true`` tool (and a response_format beside the tools) must be enforced as written, or it is a 400
    naming the keyword, as OpenAI refuses keywords outside its strict subset.

    Raises:
        InvalidRequestError: (param "tools" or "response_format") a strict schema the grammar cannot enforce.
    """
    if request.response_schema is not None:
        check = check_schema(request.response_schema)
        if not check.exact:
            raise InvalidRequestError(f"response_format: the JSON schema cannot be enforced: {_what(check)}",
                                      param="response_format", code="invalid_structured_output")
    targets, relaxed = [], []
    for index, tool in enumerate(request.tools):
        function = tool["function"]
        strict = function.get("strict") is True
        if not strict and request.function is not None and function["name"] != request.function:
            continue
        check = check_schema(grammar.parameters_of(tool))
        if strict and not check.exact:
            raise InvalidRequestError(
                f"tools[{index}]: the tool {function['name']!r} is strict, and its parameters cannot be enforced: "
                f"{_what(check)} (leave out strict to have the rest enforced)", param="tools",
                code="invalid_structured_output")
        if request.function is not None and function["name"] != request.function:
            continue
        if check.error is not None:
            relaxed.append(f"{function['name']}: any JSON object ({check.error})")
            tool = {**tool, "function": {**function, "parameters": ANY_ARGUMENTS}}
        elif check.relaxed:
            relaxed.append(f"{function['name']}: {', '.join(check.relaxed)}")
        targets.append(tool)
    if relaxed:
        logger.info("tools: not enforced (the grammar cannot; the rest of each schema is): %s", "; ".join(relaxed))
    return targets


def _what(check: SchemaCheck) -> str:
    return check.error if check.error is not None else "the keywords " + ", ".join(check.relaxed)


def _grammar(fmt: str, tools: list[dict[str, Any]], *, required: bool, parallel: bool, template: _Template,
             tokenizer: _Tokenizer, response: dict[str, Any] | None = None) -> str:
    def trigger(text: str) -> Trigger:
        return Trigger(text, tokenizer.special_token_id(text))

    return FORMATS[fmt]().grammar(tools, required=required, parallel=parallel, trigger=trigger,
                                  template_source=template.tool_source, response=response)


# --- prompt messages --------------------------------------------------------------------------------


_MODEL_VISIBLE = ("name", "description", "parameters")


def template_tools(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``tools`` variable of the chat template: each function's name, description and parameters.

    NOTE(tools): what a client sets for the server about a tool (``strict``, which asks that calls follow the
    schema; fields of other APIs that ride along) is no part of what the model reads, so the template never
    shows it: llama.cpp's server renders the same three fields (common_chat_tools_to_json_oaicompat). Codex
    sends ``strict: false`` on every Responses tool, which would otherwise end each tool's JSON in the prompt.
    """
    return [{"type": "function",
             "function": {k: t["function"][k] for k in _MODEL_VISIBLE if t["function"].get(k) is not None}}
            for t in tools]



def _arguments_object(arguments: Any) -> Any:
    """Templates write ``arguments | tojson``: give them the object, not the wire's JSON text."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _native_history(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _arguments_object(call["function"]["arguments"])}}
                for call in message["tool_calls"]]
        out.append(message)
    return out


def _generic_calls_text(calls: list[dict[str, Any]], request: ToolRequest) -> str:
    """An assistant's calls in the generic format: the JSON the model is asked to write when it may call
    tools; otherwise plain sentences (a small model imitates JSON in its history even when asked for text)."""
    items = [{"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}
             for c in calls]
    if not request.calls_possible:
        return "\n".join(f"I called {item['name']} with {json.dumps(item['arguments'], ensure_ascii=False)}."
                         for item in items)
    body = {"tool_calls": items} if request.allows_parallel(False) or len(items) > 1 else {"tool_call": items[0]}
    return json.dumps(body, ensure_ascii=False)


def _generic_history(messages: Sequence[dict[str, Any]], request: ToolRequest) -> list[dict[str, Any]]:
    """Tool history for a template that knows no tools: calls as the assistant's text, tool results as one
    user message per run of results (for templates that insist on user/assistant alternation)."""
    names = {}
    out: list[dict[str, Any]] = []
    results_open = False  # the last message out is a user message of tool results
    for message in messages:
        role = message["role"]
        if role == "tool":
            name = message.get("name") or names.get(message.get("tool_call_id"))
            text = f"{name or 'The tool'} returned: {message.get('content', '')}"
            if results_open:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text})
            results_open = True
            continue
        if role == "user" and results_open:  # the user's words after the results: the same user turn
            results_open = False
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + (message.get("content") or "")}
            continue
        results_open = False
        if role == "assistant" and message.get("tool_calls"):
            for call in message["tool_calls"]:
                names[call.get("id")] = call["function"]["name"]
            out.append({"role": "assistant", "content": _generic_calls_text(message["tool_calls"], request)})
        else:
            out.append({"role": role, "content": message.get("content", "")})
    if request.calls_possible:
        out = _with_system(out, generic_instructions(request))
    return out


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}" if first["content"] else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def generic_instructions(request: ToolRequest) -> str:
    """The system text that describes the tools and the JSON answer the grammar will enforce."""
    tools = [t for t in request.tools if request.function is None or t["function"]["name"] == request.function]
    lines = ["You can use these tools (each with the JSON Schema of its arguments):"]
    for tool in tools:
        fn = tool["function"]
        entry = {"name": fn["name"], "description": fn.get("description", ""),
                 "parameters": fn.get("parameters", grammar.EMPTY_PARAMETERS)}
        lines.append(json.dumps(entry, ensure_ascii=False))
    parallel = request.allows_parallel(False)
    example = ({"tool_calls": [{"name": "<tool name>", "arguments": {"<argument>": "<value>"}}]} if parallel
               else {"tool_call": {"name": tools[0]["function"]["name"] if request.function else "<tool name>",
                                   "arguments": {"<argument>": "<value>"}}})
    call_text = json.dumps(example)
    lines.append("")
    if request.choice == "function":
        lines.append(f"Call the tool {request.function!r}. Answer with JSON only: {call_text}")
    elif request.choice == "required":
        lines.append(f"Call a tool. Answer with JSON only: {call_text}")
    else:
        lines.append(f"Answer with JSON only: either call tools with {call_text}, "
                     'or reply to the user with {"response": "<your reply>"}.')
    return "\n".join(lines)
