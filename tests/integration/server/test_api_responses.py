"""POST /v1/responses with the official openai SDK (and openai-agents) on the default model, real server.

Never asserts the model's text: prompts are checked by their token counts (usage.input_tokens equals the
chat template rendered over the messages the request stands for), premises hold by construction
(ignore_eos, a call forced by tool_choice, a grammar that closes the answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest

from server.app import create_app
from tests.integration.server.conftest import RunningServer, api_settings, serve_app

MODEL = "smollm2"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
QUESTION = "What is the weather in Paris?"
GREEDY = {"temperature": 0}
LONG = {"temperature": 0, "extra_body": {"ignore_eos": True}}  # runs to max_output_tokens by construction


@pytest.fixture(scope="module")
def state_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("state") / "state.db"


@pytest.fixture(scope="module")
def smol(default_model: Path, state_db: Path) -> Iterator[RunningServer]:
    with serve_app(create_app(api_settings(default_model, served_model_name=MODEL, state_url=str(state_db)))) as running:
        yield running


def stored_count(state_db: Path) -> int:
    """Responses in the server's state store (its SQLite file)."""
    with contextlib.closing(sqlite3.connect(state_db)) as db:
        return db.execute("SELECT count(*) FROM responses").fetchone()[0]


def prompt_tokens(server: RunningServer, messages: list[dict[str, Any]]) -> int:
    """Tokens of the chat template rendered over `messages`: what usage.input_tokens must count."""
    engine = server.engine
    return len(engine.tokenizer.encode(engine.chat_template.render(messages, add_generation_prompt=True)))


def message_text(response: Any) -> str:
    [item] = [o for o in response.output if o.type == "message"]
    assert item.role == "assistant" and [c.type for c in item.content] == ["output_text"]
    return item.content[0].text


def check_usage(response: Any) -> None:
    u = response.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens >= 1
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens and u.output_tokens_details.reasoning_tokens == 0


def test_string_input_with_instructions(smol: RunningServer) -> None:
    r = smol.client().responses.create(model=MODEL, input="Name three colors.", instructions="Answer in French.",
                                       max_output_tokens=12, **LONG)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL and r.created_at > 0
    assert (r.instructions, r.max_output_tokens, r.temperature) == ("Answer in French.", 12, 0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == message_text(r) and r.output_text
    assert r.output[0].id.startswith("msg_") and r.output[0].status == "incomplete"
    check_usage(r)
    assert r.usage.output_tokens == 12
    # The instructions came first, as a system message, then the input as the user's.
    assert r.usage.input_tokens == prompt_tokens(smol, [{"role": "system", "content": "Answer in French."},
                                                        {"role": "user", "content": "Name three colors."}])


def test_item_input_is_the_same_conversation_as_chat(smol: RunningServer) -> None:
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "You are terse."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"},
                                                        {"type": "input_text", "text": "Count to three."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "1, 2, 3."}]},
        {"role": "user", "content": "Now to five."},
    ]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!\nCount to three."},
                {"role": "assistant", "content": "1, 2, 3."}, {"role": "user", "content": "Now to five."}]
    client = smol.client()
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=16, **GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, **GREEDY)
    assert r.usage.input_tokens == chat.usage.prompt_tokens == prompt_tokens(smol, messages)
    assert r.output_text == chat.choices[0].message.content  # same prompt, greedy: the same answer
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


def _dedupe(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]


def test_stream_events_arrive_in_order_and_add_up(smol: RunningServer) -> None:
    client = smol.client()
    with client.responses.stream(model=MODEL, input="Tell me a story.", max_output_tokens=20, **LONG) as stream:
        events = list(stream)
    assert _dedupe([e.type for e in events]) == [*TEXT_EVENTS, "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert "".join(deltas) == message_text(final) == events[-2].item.content[0].text
    assert [e.text for e in events if e.type == "response.output_text.done"] == ["".join(deltas)]
    assert final.usage.output_tokens == 20 and final.status == "incomplete"
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1
    # The same request without streaming: the same body but for the ids and the clock.
    body = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=20, **LONG)
    assert body.output_text == "".join(deltas)
    # (but for the prompt tokens this second run reused from the first)
    assert body.usage.input_tokens_details.cached_tokens > final.usage.input_tokens_details.cached_tokens
    assert body.usage.model_dump(exclude={"input_tokens_details"}) == final.usage.model_dump(
        exclude={"input_tokens_details"})


def test_stream_of_a_closed_answer_ends_with_response_completed(smol: RunningServer) -> None:
    """A bounded schema: the grammar closes the answer (and ends the request) well within the limit."""
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
              "required": ["sunny", "level"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}
    with smol.client().responses.stream(model=MODEL, input="Is it sunny?", text={"format": fmt},
                                        max_output_tokens=64, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _dedupe([e.type for e in events]) == [*TEXT_EVENTS, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.status == "completed" and final.incomplete_details is None and final.output[0].status == "completed"
    assert final.output_text == deltas and final.usage.output_tokens < 64
    jsonschema.validate(json.loads(deltas), schema)


def test_sse_wire_format_names_each_event_and_sends_no_done(smol: RunningServer) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", f"{smol.url}/responses", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode("utf-8")
    blocks = [b for b in text.split("\n\n") if b.strip() and not b.startswith(":")]
    assert "[DONE]" not in text
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == event_line[7:]


def _forced_call(client: openai.OpenAI, **extra: Any) -> Any:
    return client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=64, **GREEDY, **extra)


def _check_call(item: Any) -> dict:
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    return arguments


def test_function_call_round_trip(smol: RunningServer) -> None:
    client = smol.client()
    first = _forced_call(client)
    assert first.status == "completed" and [o.type for o in first.output] == ["function_call"]
    call = first.output[0]
    _check_call(call)
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 21})}
    history = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result]
    answer = client.responses.create(model=MODEL, input=history, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=32, **GREEDY)
    assert [o.type for o in answer.output] == ["message"] and answer.output_text
    # The same conversation as a chat request: the same prompt, hence the same greedy answer.
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=32, tool_choice="none", **GREEDY,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        messages=[{"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens > prompt_tokens(smol, history[:1])
    assert answer.output_text == chat.choices[0].message.content

    # The same conversation through previous_response_id: the same prompt, hence the same greedy answer.
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER],
                                      tool_choice="none", max_output_tokens=32, **GREEDY)
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == answer.usage.input_tokens
    assert chained.output_text == answer.output_text


def test_streamed_function_call(smol: RunningServer) -> None:
    client = smol.client()
    with client.responses.stream(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=64, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _dedupe([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    [call] = final.output
    arguments = _check_call(call)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(deltas) == arguments and events[-3].arguments == call.arguments == deltas
    assert events[2].item.call_id == call.call_id and events[2].item.arguments == ""
    assert _forced_call(client).output[0].arguments == call.arguments  # streamed == collected


def test_text_format_json_schema(smol: RunningServer) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                        "maxItems": 3}},
              "required": ["name", "age", "pets"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    r = smol.client().responses.create(model=MODEL, input="Describe a person as JSON.", text={"format": fmt},
                                       max_output_tokens=200, temperature=1.0)
    assert r.status == "completed", r.output_text  # the grammar closes the object well within the limit
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


def test_text_format_json_object_and_the_sdk_parse_helper(smol: RunningServer) -> None:
    from pydantic import BaseModel

    client = smol.client()
    r = client.responses.create(model=MODEL, input="Give me a JSON object about a cat.", max_output_tokens=120,
                                text={"format": {"type": "json_object"}}, **GREEDY)
    if r.status == "completed":  # an open object may run to the limit; a closed one must parse
        assert isinstance(json.loads(r.output_text), dict)
    else:
        assert r.output_text.lstrip().startswith("{")

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        legs: Literal[2, 4]

    parsed = client.responses.parse(model=MODEL, input="Describe a pet.", text_format=Pet, max_output_tokens=64,
                                    temperature=1.0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Pet)


@pytest.mark.parametrize("seed", range(4))
def test_tools_with_auto_and_a_text_format_answer_by_call_or_by_schema(smol: RunningServer, seed: int) -> None:
    """What an openai-agents Agent with tools and an output_type sends on every turn: tool_choice auto and a
    json_schema text.format. Each answer is a valid call or a message that follows the schema."""
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}
    r = smol.client().responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], text={"format": fmt},
                                       max_output_tokens=96, temperature=1.0, extra_body={"seed": seed})
    assert r.status == "completed" and r.output
    kinds = [o.type for o in r.output]
    if "function_call" in kinds:
        assert set(kinds) == {"function_call"}
        for item in r.output:
            _check_call(item)
    else:
        assert kinds == ["message"]
        jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id_continues_the_conversation(smol: RunningServer) -> None:
    client = smol.client()
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=10, **LONG)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=5, **LONG)
    # The first turn's input and output, then the new input; its instructions are not carried over.
    assert second.usage.input_tokens == prompt_tokens(smol, [
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    third = client.responses.create(model=MODEL, input="Spell it.", previous_response_id=second.id,
                                    instructions="Use capitals.", max_output_tokens=5, **LONG)
    assert third.usage.input_tokens == prompt_tokens(smol, [
        {"role": "system", "content": "Use capitals."},
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Spell it."}])
    items = client.responses.input_items.list(third.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Spell it.")]


def test_get_and_delete(smol: RunningServer) -> None:
    client = smol.client()
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, metadata={"k": "v"}, **LONG)
    assert r.metadata == {"k": "v"} and r.store is True
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    deleted = client.responses.delete(r.id)
    assert deleted is None  # the SDK returns nothing; the wire body is checked below
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["type"] == "invalid_request_error" and r.id in info.value.body["message"]
    other = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2, **LONG)
    raw = httpx.delete(f"{smol.url}/responses/{other.id}", timeout=10)
    assert raw.status_code == 200 and raw.json() == {"id": other.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(smol: RunningServer, state_db: Path) -> None:
    client = smol.client()
    before = stored_count(state_db)
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, store=False, **LONG)
    assert r.store is False and r.output_text
    with client.responses.stream(model=MODEL, input="Hello", max_output_tokens=4, store=False, **LONG) as stream:
        streamed = list(stream)[-1].response
    assert streamed.store is False and stored_count(state_db) == before
    for response_id in (r.id, streamed.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=2)
    assert info.value.body["code"] == "previous_response_not_found"


@pytest.mark.parametrize("tool", [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
                                  {"type": "code_interpreter", "container": {"type": "auto"}},
                                  {"type": "computer_use_preview", "display_width": 1, "display_height": 1,
                                   "environment": "linux"}])
def test_hosted_tools_are_skipped_when_offered_and_refused_when_forced(smol: RunningServer, tool: dict) -> None:
    client = smol.client()
    r = client.responses.create(model=MODEL, input="x", tools=[WEATHER, tool], max_output_tokens=2, **LONG)
    assert [t.type for t in r.tools] == ["function"] and r.status == "incomplete"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", tools=[WEATHER, tool], tool_choice={"type": tool["type"]})
    body = info.value.body
    assert body["param"] == "tool_choice.type" and repr(tool["type"]) in body["message"]
    assert body["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "file_search_call", "id": "fs_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}}},
     "text.format"),
    ({"instructions": "no input"}, "input"),
])
def test_bad_requests_are_400s_naming_the_field(smol: RunningServer, body: dict, param: str) -> None:
    r = httpx.post(f"{smol.url}/responses", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert set(error) == {"message", "type", "param", "code"}


def test_openai_agents_runner_with_one_function_tool(smol: RunningServer) -> None:
    """An Agent on the SDK's default (Responses) model class: a forced call, the tool runs, the answer."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from pydantic import BaseModel

    cities: list[str] = []

    # NOTE(tests): the tool is enabled until it has run once, so the first turn must call it (tool_choice
    # required) and the second must answer; the answer's output_type is a bounded schema, so the grammar
    # ends it well within max_tokens (the agents SDK refuses an incomplete response).
    @function_tool(is_enabled=lambda ctx, agent: not cities)
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return f"It is sunny and 21 degrees in {city}."

    class Weather(BaseModel):
        sunny: bool

    async def run() -> Any:
        async with smol.async_client() as client:
            agent = Agent(name="weather", instructions="You answer questions about the weather.",
                          tools=[get_weather], output_type=Weather,
                          model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                          model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                       temperature=0, max_tokens=64))
            return await Runner.run(agent, QUESTION, run_config=RunConfig(tracing_disabled=True), max_turns=3)

    result = asyncio.run(run())
    assert len(cities) == 1 and cities[0] in ("Paris", "Rome")
    assert isinstance(result.final_output, Weather)
    assert len(result.raw_responses) == 2
    first, second = result.raw_responses
    assert [o.type for o in first.output] == ["function_call"] and [o.type for o in second.output] == ["message"]
    assert all(r.usage.input_tokens > 0 and r.usage.output_tokens > 0 for r in result.raw_responses)
