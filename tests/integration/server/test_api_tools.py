"""Tool calling on the default model (SmolLM2-135M: no tools in its template, so the generic format), through
the official openai SDK against a real server: forced calls always valid, auto, none, streaming, round trip."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from server.app import create_app
from tests.integration.server.conftest import RunningServer, api_settings, keep_prior_draft_costs, serve_app

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone",
                                      "parameters": {"type": "object", "properties": {
                                          "timezone": {"type": "string", "maxLength": 32}},
                                          "required": ["timezone"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def smol(default_model: Path) -> Iterator[RunningServer]:
    with serve_app(create_app(api_settings(default_model, served_model_name="smollm2"))) as running:
        yield keep_prior_draft_costs(running)


def _ask(server: RunningServer, **kwargs):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 96)
    return server.client().chat.completions.create(model="smollm2", tools=TOOLS, **kwargs)


def _check_calls(calls, names=tuple(SCHEMAS), allow_none: bool = False) -> None:
    """Every call names a known tool and its arguments validate against that tool's schema."""
    assert calls or allow_none, "expected at least one tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(6))
def test_required_call_is_valid_every_time_at_temperature_1(smol: RunningServer, seed: int) -> None:
    r = _ask(smol, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("seed", range(2))
def test_required_parallel_calls_are_each_valid(smol: RunningServer, seed: int) -> None:
    # NOTE(tools): with parallel calls allowed the 135M model sometimes repeats calls until max_tokens (seed 5
    # of 10 did, here); then the last call is cut ("length") and only the complete ones are checked.
    r = _ask(smol, tool_choice="required", temperature=1.0, seed=seed, max_tokens=160)
    choice = r.choices[0]
    calls = choice.message.tool_calls
    assert choice.finish_reason in ("tool_calls", "length") and calls
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    _check_calls(complete, allow_none=True)


@pytest.mark.parametrize("seed", range(3))
def test_named_function_is_the_one_called(smol: RunningServer, seed: int) -> None:
    r = _ask(smol, tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]  # exactly one call, to it
    _check_calls(choice.message.tool_calls, names=("get_time",))


@pytest.mark.parametrize("seed", range(3))
def test_auto_is_text_or_valid_calls(smol: RunningServer, seed: int) -> None:
    r = _ask(smol, tool_choice="auto", temperature=1.0, seed=seed, max_tokens=64)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "tool_calls":
            _check_calls(choice.message.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length")
        text = choice.message.content
        assert isinstance(text, str) and text
        assert not text.lstrip().startswith("{"), text  # the JSON envelope never reaches the user


def test_none_never_calls(smol: RunningServer) -> None:
    r = _ask(smol, tool_choice="none", temperature=0, max_tokens=24)
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert choice.message.content


def test_streamed_calls_reassemble_to_the_non_streamed_ones(smol: RunningServer) -> None:
    kwargs = {"tool_choice": "required", "temperature": 0, "max_tokens": 96}
    whole = _ask(smol, **kwargs).choices[0].message
    client = smol.client()
    with client.chat.completions.stream(model="smollm2", messages=ASK, tools=TOOLS, **kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    # NOTE(tests): exact: the same request alone twice, the same row counts (conftest.keep_prior_draft_costs)
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert not streamed.message.content  # nothing of the JSON leaked into content
    _check_calls(streamed.message.tool_calls)
    # The raw chunks: the id and name come once per call, in its first chunk; the rest are argument fragments.
    chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, stream=True, **kwargs))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    heads = [d for d in deltas if d.id]
    assert len(heads) == len(whole.tool_calls) and all(h.function.name and h.type == "function" for h in heads)
    assert sum(1 for d in deltas if not d.id and d.function.arguments) >= 2
    assert all((c.choices[0].delta.content or "") == "" for c in chunks)


def test_n_choices_each_make_valid_calls_streamed_and_whole(smol: RunningServer) -> None:
    """n > 1 with tools: each choice is read by its own parser; streamed, each choice's tool-call deltas
    (by choice index) reassemble to valid calls."""
    kwargs = {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0, "seed": 3, "n": 3}
    whole = _ask(smol, **kwargs)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls)
    with smol.client().chat.completions.stream(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=96,
                                               **kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert sorted(c.index for c in final.choices) == [0, 1, 2]
    for choice in final.choices:
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        _check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("seed", range(4))
def test_auto_with_a_response_format_is_a_call_or_an_answer_that_follows_the_schema(smol: RunningServer,
                                                                                     seed: int) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = _ask(smol, temperature=1.0, seed=seed, parallel_tool_calls=False,
             response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        _check_calls(choice.message.tool_calls)
    else:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_round_trip_call_then_tool_result_then_text(smol: RunningServer) -> None:
    first = _ask(smol, tool_choice="required", parallel_tool_calls=False, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    assert "content" not in history[1]  # content null: the SDK's message as it comes, sent back
    answer = _ask(smol, messages=history, tool_choice="none", temperature=0, max_tokens=32).choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    answer = _ask(smol, messages=history, tool_choice="auto", temperature=0, max_tokens=32).choices[0]
    if answer.message.tool_calls and answer.finish_reason == "tool_calls":
        _check_calls(answer.message.tool_calls)
    else:
        assert answer.message.content and not answer.message.content.lstrip().startswith("{")
    # Without tools at all, the same history still renders (the calls and results in the generic form).
    r = smol.client().chat.completions.create(model="smollm2", messages=history, max_tokens=16, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_cut_by_max_tokens_is_length_with_the_call_so_far(smol: RunningServer) -> None:
    r = _ask(smol, tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
             max_tokens=12)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    calls = choice.message.tool_calls or []
    assert all(c.function.name == "get_weather" for c in calls)  # a partial call, never invented text


def test_langchain_bind_tools_invoke_and_stream(smol: RunningServer) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city (unit: celsius or fahrenheit)."""
        return "18"

    llm = ChatOpenAI(model="smollm2", base_url=smol.url, api_key="unused", temperature=0, max_tokens=96,
                     max_retries=0)
    bound = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
    whole = bound.invoke("What is the weather in Paris?")
    assert [c["name"] for c in whole.tool_calls] == ["get_weather"]
    assert set(whole.tool_calls[0]["args"]) == {"city", "unit"} and whole.content == ""
    merged = None
    for chunk in bound.stream("What is the weather in Paris?"):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and merged.content == ""
    # NOTE(tests): exact: the same request alone twice, the same row counts (conftest.keep_prior_draft_costs)
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]


@pytest.mark.parametrize("kwargs,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "required": "city"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),  # only a JSON answer can sit beside calls
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400_with_param_and_the_server_keeps_serving(smol: RunningServer, kwargs: dict,
                                                                          param: str) -> None:
    body = {"tools": TOOLS, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        smol.client().chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, **body)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    assert _ask(smol, tool_choice="none", max_tokens=2, temperature=0).choices[0].message.content is not None


def test_a_schema_keyword_the_grammar_cannot_enforce_is_relaxed_unless_the_tool_is_strict(smol: RunningServer) -> None:
    """`not` (and propertyNames, if/then/else, ...: tests/unit/server/test_agent_tool_schemas.py) is left out of the
    grammar and the rest of the schema enforced, with a log line naming tool and keyword; a strict tool is a 400
    naming the keyword, as OpenAI's strict mode refuses keywords outside its subset."""
    params = {"type": "object", "properties": {"x": {"not": {"type": "string"}}, "city": {"type": "string"}},
              "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r = smol.client().chat.completions.create(model="smollm2", messages=ASK, tools=tools, tool_choice=choice,
                                                  max_tokens=32, temperature=0)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "f" and "city" in json.loads(call.function.arguments)
    strict = [{"type": "function", "function": {"name": "f", "parameters": params, "strict": True}}]
    with pytest.raises(openai.BadRequestError) as info:
        smol.client().chat.completions.create(model="smollm2", messages=ASK, tools=strict, tool_choice="auto",
                                              max_tokens=4)
    assert info.value.body["param"] == "tools"
    assert "'f' is strict" in info.value.body["message"] and "not" in info.value.body["message"]


def test_a_call_cut_by_max_tokens_keeps_what_was_written(smol: RunningServer) -> None:
    """Greedy forced calls cut after 1..18 tokens: once the call's name has begun it is there, named after the
    one tool it can be (completed from its prefix when the cut falls inside the name), with the arguments
    written so far; the streamed deltas add up to the same call, and finish_reason stays 'length'.

    NOTE(tests): exact: each cut is the same request alone, the same row counts up to the cut
    (conftest.keep_prior_draft_costs)."""
    final = _ask(smol, tool_choice="required", temperature=0, max_tokens=96).choices[0].message.tool_calls[0]
    seen_call = False
    for max_tokens in range(1, 19):
        r = _ask(smol, tool_choice="required", temperature=0, max_tokens=max_tokens)
        choice = r.choices[0]
        assert choice.finish_reason == "length"
        calls = choice.message.tool_calls or []
        if seen_call:
            assert calls, f"the call vanished at max_tokens={max_tokens}"
        if not calls:
            assert not choice.message.content  # nothing of the JSON shows as text
            continue
        seen_call = True
        assert [c.function.name for c in calls] == [final.function.name]
        assert final.function.arguments.startswith(calls[0].function.arguments)
        if max_tokens % 3:
            continue  # the streamed form is checked on every third cut
        stream = smol.client().chat.completions.create(model="smollm2", tools=TOOLS, messages=ASK, stream=True,
                                                       tool_choice="required", temperature=0, max_tokens=max_tokens)
        name, arguments, reasons = "", "", []
        for chunk in stream:
            for delta_call in chunk.choices[0].delta.tool_calls or ():
                name += delta_call.function.name or ""
                arguments += delta_call.function.arguments or ""
            reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
        assert (name, arguments, reasons) == (calls[0].function.name, calls[0].function.arguments, ["length"])
    assert seen_call
