"""POST /v1/messages and /v1/messages/count_tokens through the official `anthropic` SDK, on the default model
(SmolLM2, real text): text, a system prompt, tool_use -> tool_result round trips, forced tools whose input
follows the schema, streaming through the SDK's helpers, token counts, stop reasons, prefix reuse across turns,
and errors in Anthropic's shape with the right 4xx (the server keeps serving)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from server.app import create_app

from tests.integration.server.conftest import RunningServer, api_settings, keep_prior_draft_costs, serve_app

MODEL = "smollm2"
GREEDY = {"temperature": 0}  # the SDK no longer offers sampling parameters; the API still takes them
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "Get the time in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                         "required": ["city"]}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol(default_model: Path) -> Iterator[RunningServer]:
    settings = api_settings(default_model, served_model_name=MODEL, api_key="sk-test")
    with serve_app(create_app(settings)) as running:
        yield keep_prior_draft_costs(running)


@pytest.fixture(scope="module")
def client(smol: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smol.base, api_key="sk-test", max_retries=0, timeout=120)


def _prompt_tokens(message) -> int:
    u = message.usage
    return u.input_tokens + u.cache_read_input_tokens + (u.cache_creation_input_tokens or 0)


def test_text_with_a_system_prompt(client: anthropic.Anthropic, smol: RunningServer) -> None:
    m = client.messages.create(model=MODEL, max_tokens=24, system="You are a helpful assistant. Answer briefly.",
                               messages=[{"role": "user", "content": "Name a color."}], extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    [block] = m.content
    assert block.type == "text" and block.text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 24
    engine = smol.engine
    rendered = engine.chat_template.render([
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "Name a color."}])
    assert _prompt_tokens(m) == len(engine.tokenizer.encode(rendered))
    # system as text blocks, and content as blocks, are the same prompt
    same = client.messages.count_tokens(
        model=MODEL, system=[{"type": "text", "text": "You are a helpful assistant. Answer briefly."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}])
    assert same.input_tokens == _prompt_tokens(m)


def test_count_tokens_is_the_prompt_that_runs(client: anthropic.Anthropic) -> None:
    fields = {"model": MODEL, "system": "Be brief.", "messages": ASK, "tools": [WEATHER]}
    counted = client.messages.count_tokens(**fields)
    m = client.messages.create(max_tokens=4, **fields, extra_body=GREEDY)
    assert counted.input_tokens == _prompt_tokens(m) > 0


def test_forced_tool_input_follows_its_schema_and_the_result_round_trips(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=[WEATHER, TIME],
                               tool_choice={"type": "tool", "name": "get_weather"})
    [call] = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_") and m.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "18 degrees and sunny"}]}]}]
    answer = client.messages.create(model=MODEL, max_tokens=30, messages=history, tools=[WEATHER, TIME],
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")
    # an error result is accepted too
    history[-1]["content"][0].update(is_error=True, content="city not found")
    again = client.messages.create(model=MODEL, max_tokens=8, messages=history, tools=[WEATHER, TIME],
                                   extra_body=GREEDY)
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_any_tool_and_one_call_at_most(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=[WEATHER, TIME],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time") and m.stop_reason == "tool_use"
    jsonschema.validate(calls[0].input, {"get_weather": WEATHER, "get_time": TIME}[calls[0].name]["input_schema"])


def test_stream_helpers_and_event_order(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "Count to five."}],
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "Count to five."}],
                                extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream if event.type not in ("text", "thinking", "input_json")]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start" and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    # the streamed and the whole answer are the same (greedy; NOTE(tests): exact: the same request alone twice,
    # the same row counts, conftest.keep_prior_draft_costs)
    whole = client.messages.create(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "Count to five."}],
                                   extra_body=GREEDY)
    assert whole.content[0].text == text and whole.usage.output_tokens == final.usage.output_tokens


def test_streamed_tool_use_is_input_json_deltas(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=80, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                 and e.delta.type == "input_json_delta"]
    [call] = final.content
    assert call.type == "tool_use" and len(fragments) > 1 and final.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "Write a sentence about the sea."}]
    free = client.messages.create(model=MODEL, max_tokens=20, messages=ask, extra_body=GREEDY).content[0].text
    words = free.split()
    assert len(words) >= 3, free
    # NOTE(tests): greedy, the same request alone again (the same row counts: conftest.keep_prior_draft_costs): the
    # same text comes again, up to the stop sequence
    stop = " " + words[2]
    m = client.messages.create(model=MODEL, max_tokens=20, messages=ask, stop_sequences=[stop], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == free[:free.index(stop)]


def test_max_tokens_beyond_the_context_is_served_up_to_it(api_model: Path) -> None:
    with serve_app(create_app(api_settings(api_model, max_model_len=96))) as tiny:
        c = anthropic.Anthropic(base_url=tiny.base, api_key="unused", max_retries=0)
        # (the SDK asks for a stream when max_tokens is this large, as Claude Code streams)
        with c.messages.stream(model="tiny", max_tokens=32000, messages=[{"role": "user", "content": "Hi"}],
                               extra_body={"ignore_eos": True}) as stream:
            m = stream.get_final_message()
        assert m.stop_reason == "max_tokens" and _prompt_tokens(m) + m.usage.output_tokens == 96


def test_prefix_reuse_across_turns(client: anthropic.Anthropic) -> None:
    system = "You are a helpful assistant. " * 20
    turn1 = [{"role": "user", "content": "Name a fruit."}]
    first = client.messages.create(model=MODEL, max_tokens=12, system=system, messages=turn1, extra_body=GREEDY)
    turn2 = [*turn1, {"role": "assistant", "content": first.content[0].text},
             {"role": "user", "content": "And a vegetable?"}]
    second = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=turn2, extra_body=GREEDY)
    assert second.usage.cache_read_input_tokens >= _prompt_tokens(first)
    assert second.usage.input_tokens == _prompt_tokens(second) - second.usage.cache_read_input_tokens


def test_what_agents_send_is_accepted(client: anthropic.Anthropic) -> None:
    """Claude Code's fields (thinking, context_management, output_config, metadata, cache_control), a system
    message inside `messages` (the API takes it; Claude Code 2.1 sends one after the user's), thinking blocks
    and block types a text model cannot use in the history."""
    m = client.messages.create(
        model=MODEL, max_tokens=6,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [
                      {"type": "text", "text": "Hi"},
                      {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                   "data": "iVBORw0KGgo="}}]},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet back.", "signature": "x"},
                                                    {"type": "redacted_thinking", "data": "abc"},
                                                    {"type": "text", "text": "Hello!"}]},
                  {"role": "user", "content": "Bye"},
                  {"role": "system", "content": "The user's directory is /tmp."}],
        thinking={"type": "adaptive"}, metadata={"user_id": "u"}, output_config={"effort": "high"},
        extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                    "some_future_field": {"x": 1}, **GREEDY})
    assert m.stop_reason in ("end_turn", "max_tokens")


def test_prefill_is_continued(client: anthropic.Anthropic, smol: RunningServer) -> None:
    ask = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "The answer is"}]
    m = client.messages.create(model=MODEL, max_tokens=4, messages=ask, extra_body=GREEDY)
    engine = smol.engine
    prompt = engine.chat_template.render(ask, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("The answer is") and _prompt_tokens(m) == len(engine.tokenizer.encode(prompt))


def test_structured_output_config(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
              "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=30, messages=[{"role": "user", "content": "Pick a color."}],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)


@pytest.mark.parametrize("body,fragment", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "developer", "content": "Hi"}]}, "role"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "Only a system message"}]}, "user or assistant"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "tool_use_id"),
    ({"max_tokens": 5, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"name": "x", "input_schema": {"type": "string"}}]}, "object"),
    ({"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": "Trailing "}]}, "trailing whitespace"),
    ({"max_tokens": 5, "messages": ASK, "stop_sequences": "x"}, "stop_sequences"),
])
def test_bad_input_is_a_400_in_anthropic_shape(smol: RunningServer, client: anthropic.Anthropic, body: dict,
                                               fragment: str) -> None:
    r = httpx.post(f"{smol.base}/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": "sk-test"},
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"], error
    if "max_tokens" in body:  # (the SDK itself refuses a call without max_tokens)
        with pytest.raises(anthropic.BadRequestError):  # the SDK reads the same shape
            client.messages.create(model=MODEL, **body)
    assert client.messages.create(model=MODEL, max_tokens=2, messages=ASK).stop_reason  # still serving


def test_auth_unknown_model_and_routes_in_anthropic_shape(smol: RunningServer) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK}
    url = f"{smol.base}/v1/messages"
    for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    for headers in ({"x-api-key": "sk-test"}, {"authorization": "Bearer sk-test"}):
        assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200
    r = httpx.post(url, json={**body, "model": "claude-sonnet-4"}, headers={"x-api-key": "sk-test"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert "smollm2" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/batches", json=body, headers={"x-api-key": "sk-test"}, timeout=30)
    assert r.status_code == 404 and r.json()["type"] == "error"
    r = httpx.post(url, content=b"{not json", headers={"x-api-key": "sk-test"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(f"{smol.url}/chat/completions", json={"messages": ASK}, headers={"x-api-key": "wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error" and "type" not in r.json()


def test_a_prompt_too_long_says_so_in_anthropic_words(api_model: Path) -> None:
    with serve_app(create_app(api_settings(api_model, max_model_len=64))) as tiny:
        c = anthropic.Anthropic(base_url=tiny.base, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as info:
            c.messages.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "word " * 200}])
        message = info.value.body["error"]["message"]
        assert message.startswith("prompt is too long: ") and "> 64 maximum" in message
