"""Every Response object has every field OpenResponses' Response schema requires, with its type, in the answer and
in the stream's response.created / response.completed events, on the scenarios of OpenResponses' compliance suite:
a basic answer, a stream, a system prompt, a tool call (streamed too), a multi-turn input. An image input is
refused with a 400 naming the part (the default model reads text only). On the default model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from server.app import create_app
from tests.integration.server.conftest import RunningServer, api_settings, serve_app

MODEL = "smol"

NULLABLE_INT = {"type": ["integer", "null"]}
NULLABLE_STR = {"type": ["string", "null"]}
# The required properties of OpenResponses' ResponseResource, each with the type the schema gives it.
RESPONSE_SCHEMA = {
    "type": "object",
    "required": ["id", "object", "created_at", "completed_at", "status", "incomplete_details", "model",
                 "previous_response_id", "instructions", "output", "error", "tools", "tool_choice", "truncation",
                 "parallel_tool_calls", "text", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs",
                 "temperature", "reasoning", "user", "usage", "max_output_tokens", "max_tool_calls", "store",
                 "background", "service_tier", "metadata", "safety_identifier", "prompt_cache_key"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
        "completed_at": NULLABLE_INT, "status": {"type": "string"},
        "incomplete_details": {"type": ["object", "null"]}, "model": {"type": "string"},
        "previous_response_id": NULLABLE_STR, "instructions": {"type": ["string", "array", "null"]},
        "output": {"type": "array", "items": {"type": "object", "required": ["type"]}},
        "error": {"type": ["object", "null"]}, "tools": {"type": "array"},
        "tool_choice": {"type": ["string", "object"]}, "truncation": {"enum": ["auto", "disabled"]},
        "parallel_tool_calls": {"type": "boolean"}, "text": {"type": "object"}, "top_p": {"type": "number"},
        "presence_penalty": {"type": "number"}, "frequency_penalty": {"type": "number"},
        "top_logprobs": {"type": "integer"}, "temperature": {"type": "number"},
        "reasoning": {"type": ["object", "null"]}, "user": NULLABLE_STR,
        "usage": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["input_tokens", "output_tokens", "total_tokens", "input_tokens_details",
                                           "output_tokens_details"]}]},
        "max_output_tokens": NULLABLE_INT, "max_tool_calls": NULLABLE_INT, "store": {"type": "boolean"},
        "background": {"type": "boolean"}, "service_tier": {"type": "string"}, "metadata": {"type": "object"},
        "safety_identifier": NULLABLE_STR, "prompt_cache_key": NULLABLE_STR,
    },
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a location",
           "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                          "required": ["location"]}}
SCENARIOS = {
    "basic-response": {"input": [{"type": "message", "role": "user", "content": "Say hello in exactly 3 words."}]},
    "system-prompt": {"input": [
        {"type": "message", "role": "system", "content": "You are a pirate. Always respond in pirate speak."},
        {"type": "message", "role": "user", "content": "Say hello."}]},
    "tool-calling": {"input": [{"type": "message", "role": "user",
                                "content": "What's the weather like in San Francisco?"}],
                     "tools": [WEATHER], "tool_choice": "required"},
    "multi-turn": {"input": [
        {"type": "message", "role": "user", "content": "My name is Alice."},
        {"type": "message", "role": "assistant", "content": "Hello Alice! How can I help you today?"},
        {"type": "message", "role": "user", "content": "What is my name?"}]},
}


@pytest.fixture(scope="module")
def smol(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    settings = api_settings(default_model, served_model_name=MODEL,
                            state_url=str(tmp_path_factory.mktemp("state") / "state.db"))
    with serve_app(create_app(settings)) as running:
        yield running


def body(name: str, **more: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_output_tokens": 24, "temperature": 0, **SCENARIOS[name], **more}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_scenario_answers_a_response_of_the_schema(smol: RunningServer, name: str) -> None:
    r = httpx.post(f"{smol.url}/responses", json=body(name), timeout=120)
    assert r.status_code == 200, r.text
    response = r.json()
    jsonschema.validate(response, RESPONSE_SCHEMA)
    assert response["output"] and response["status"] in ("completed", "incomplete")
    if response["status"] == "completed":
        assert isinstance(response["completed_at"], int) and response["completed_at"] >= response["created_at"]
    if name == "tool-calling":
        assert "function_call" in [item["type"] for item in response["output"]]


@pytest.mark.parametrize("name", ["basic-response", "tool-calling"])
def test_each_streamed_scenario_carries_schema_responses_in_its_events(smol: RunningServer, name: str) -> None:
    events = []
    with httpx.stream("POST", f"{smol.url}/responses", json=body(name, stream=True), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    for event in events:
        if "response" in event:
            jsonschema.validate(event["response"], RESPONSE_SCHEMA)
    if name == "tool-calling":
        assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(kinds)
        assert any(e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
                   for e in events)


def test_an_image_input_is_refused_naming_the_part(smol: RunningServer) -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    r = httpx.post(f"{smol.url}/responses", timeout=60, json={"model": MODEL, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is this?"}, image]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[1].type", r.text


# OpenResponses' JsonSchemaResponseFormat: every field required, description and schema nullable.
JSON_SCHEMA_FORMAT = {"type": "object", "required": ["type", "name", "description", "schema", "strict"],
                      "properties": {"type": {"const": "json_schema"}, "name": {"type": "string"},
                                     "description": NULLABLE_STR, "schema": {"type": ["object", "null"]},
                                     "strict": {"type": "boolean"}}}


def test_a_json_schema_format_is_echoed_with_every_field_of_the_schema(smol: RunningServer) -> None:
    fmt = {"type": "json_schema", "name": "person",
           "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}
    r = httpx.post(f"{smol.url}/responses", timeout=120, json={
        "model": MODEL, "input": "A name, as JSON.", "max_output_tokens": 16, "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    echoed = r.json()["text"]["format"]
    jsonschema.validate(echoed, JSON_SCHEMA_FORMAT)
    assert echoed["description"] is None and echoed["strict"] is False and echoed["schema"] == fmt["schema"]
