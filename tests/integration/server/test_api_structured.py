"""Structured outputs end to end: the official openai SDK against a real server on the default model.

NOTE(tests): every schema here is finite (bounded strings, integers with bounds, bounded arrays), so a
constrained answer ends by itself within max_tokens by construction, at any temperature, on any CPU; what is
asserted is a property (schema-valid, one of the choices, matches the regex), never the model's exact text.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server.app import create_app
from tests.integration.server.conftest import (
    RunningServer, api_settings, keep_prior_draft_costs, parse_chunks, serve_app,
)

MODEL = "smollm2"
CHECKER = jsonschema.FormatChecker()
Short = Annotated[str, Field(max_length=16)]


@pytest.fixture(scope="module")
def smol(default_model: Path) -> Iterator[RunningServer]:
    with serve_app(create_app(api_settings(default_model, served_model_name=MODEL))) as running:
        yield keep_prior_draft_costs(running)


def chat(server: RunningServer, content: str, **kwargs: Any):
    kwargs.setdefault("max_tokens", 400)
    return server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                   **kwargs)


class Pet(BaseModel):
    name: Short
    species: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=40)
    toys: list[Short] = Field(max_length=3)


def test_parse_with_a_pydantic_model(smol: RunningServer) -> None:
    completion = smol.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet as JSON."}], response_format=Pet,
        max_tokens=400, temperature=0)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet)
    assert Pet.model_validate_json(message.content) == message.parsed


def test_json_object(smol: RunningServer) -> None:
    answer = chat(smol, "Give me a JSON object describing Paris.", response_format={"type": "json_object"},
                  max_tokens=120, temperature=0).choices[0]
    text = answer.message.content
    assert text.startswith("{") and not re.search(r'[,:]\s|^\s|\n', text)  # compact: no whitespace tokens
    if answer.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert answer.finish_reason == "length"
    # NOTE(tests): logit_bias comes after the mask, so +100 on "}" closes the object as soon as the grammar
    # allows it, which is right after the "{" it forces first (without the grammar "}" would come first).
    brace = smol.engine.tokenizer.encode("}")[0]
    closed = chat(smol, "Anything.", response_format={"type": "json_object"}, max_tokens=20, temperature=0,
                  logit_bias={str(brace): 100}).choices[0]
    assert closed.message.content == "{}" and closed.finish_reason == "stop"


SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 40000000}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"],
     "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -99, "maximum": 99},
                                      "y": {"type": "integer", "minimum": -99, "maximum": 99}},
     "required": ["kind", "x", "y"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "boolean"},
                                                          {"type": "integer", "minimum": 0, "maximum": 9}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"nickname": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["nickname"], "additionalProperties": False},
    {"$defs": {"person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                          "required": ["name", "age"], "additionalProperties": False}},
     "type": "object", "properties": {"author": {"$ref": "#/$defs/person"},
                                      "editors": {"type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 2}},
     "required": ["author", "editors"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"],
     "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 30}},
     "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error", 404, None, True]},
                                      "detail": {"type": "string", "maxLength": 24}},
     "required": ["status"], "additionalProperties": False},
]


def test_a_dozen_schemas_at_temperature_one_all_validate(smol: RunningServer) -> None:
    assert len(SCHEMAS) == 12

    async def ask(client: openai.AsyncOpenAI, index: int, schema: dict[str, Any]):
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=400,
            temperature=1.0, seed=index,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema,
                                                                    "strict": True}})

    async def all_of_them():
        async with smol.async_client() as client:
            return await asyncio.gather(*[ask(client, i, s) for i, s in enumerate(SCHEMAS)])

    for schema, completion in zip(SCHEMAS, asyncio.run(all_of_them())):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema, format_checker=CHECKER)


def test_regex_choice_and_gbnf_through_extra_body(smol: RunningServer) -> None:
    regex = chat(smol, "A product code?", temperature=1.0, extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{4}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", regex.choices[0].message.content)
    choices = ["red", "green", "blue"]
    choice = chat(smol, "Pick a colour.", temperature=1.0, extra_body={"structured_outputs": {"choice": choices}})
    assert choice.choices[0].message.content in choices and choice.choices[0].finish_reason == "stop"
    gbnf = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    answer = chat(smol, "How many?", temperature=1.0, extra_body={"grammar": gbnf})
    assert re.fullmatch(r"The answer is [0-9]{2}\.", answer.choices[0].message.content)
    old = chat(smol, "Yes or no?", temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert old.choices[0].message.content in ("yes", "no")


def test_completions_with_a_schema(smol: RunningServer) -> None:
    schema = SCHEMAS[0]
    for extra in ({"json_schema": schema}, {"response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "c", "schema": schema}}},
                  {"structured_outputs": {"json": json.dumps(schema)}}):
        completion = smol.client().completions.create(model=MODEL, prompt="The largest city of Japan, as JSON:",
                                                      max_tokens=200, temperature=1.0, extra_body=extra)
        assert completion.choices[0].finish_reason == "stop", extra
        jsonschema.validate(json.loads(completion.choices[0].text), schema)


def test_a_streamed_constrained_answer(smol: RunningServer) -> None:
    schema = SCHEMAS[6]
    stream = smol.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Who wrote it? JSON please."}], max_tokens=400,
        temperature=1.0, seed=5, stream=True, stream_options={"include_usage": True},
        response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": schema}})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["stop"] and sum(1 for d in deltas if d) > 3  # really streamed in pieces
    jsonschema.validate(json.loads("".join(deltas)), schema)
    assert chunks[-1].usage.completion_tokens >= sum(1 for d in deltas if d)


def test_eos_ends_a_constrained_answer(smol: RunningServer) -> None:
    # NOTE(tests): +100 on each eos id (after the mask) picks it exactly once the grammar is complete, i.e.
    # after one digit of [0-9]+; the eos itself is not text.
    for eos in sorted(smol.engine.eos_token_ids):
        answer = chat(smol, "A number?", temperature=0, max_tokens=30, logit_bias={str(eos): 100},
                      extra_body={"guided_regex": "[0-9]+"}).choices[0]
        assert re.fullmatch("[0-9]", answer.message.content) and answer.finish_reason == "stop"


def test_max_tokens_gives_length_and_the_text_so_far(smol: RunningServer) -> None:
    answer = chat(smol, "Describe a pet.", temperature=0, max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}}).choices[0]
    assert answer.finish_reason == "length"
    assert answer.message.content.startswith('{"') and answer.message.content != "{"
    with pytest.raises(openai.LengthFinishReasonError):
        smol.client().chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A pet."}],
                                             response_format=Pet, max_tokens=4)


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/{path}", json={"model": MODEL, **body}, timeout=60)


MESSAGES = [{"role": "user", "content": "Hi"}]
BAD_INPUTS = [
    # (body, param, text the message must contain)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}}}, "response_format", "nowhere"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "phone-number"}}}}, "response_format", "phone-number"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"not": {"type": "string"}}}, "guided_json", "not"),
    ({"guided_regex": "([a-z"}, "guided_regex", "regex"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_choice": "yes"}, "guided_choice", ""),
    ({"grammar": "root ::= undefined-rule"}, "grammar", "undefined-rule"),
    ({"guided_grammar": "root ::= \"a"}, "guided_grammar", ""),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"guided_regex": "a+", "json_schema": {"type": "object"}}, "json_schema", "one output constraint"),
]


@pytest.mark.parametrize("body, param, needle", BAD_INPUTS, ids=[b[1] + str(i) for i, b in enumerate(BAD_INPUTS)])
def test_bad_structured_inputs_are_400_naming_the_field(smol: RunningServer, body, param, needle) -> None:
    for path, base in (("chat/completions", {"messages": MESSAGES}), ("completions", {"prompt": "Hi"})):
        for stream in (False, True):
            r = _post(smol, path, {**base, **body, "max_tokens": 4, "stream": stream})
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert error["param"] == param and needle in error["message"], error
            assert error["type"] == "invalid_request_error"
    # the server goes on serving, constrained requests included
    ok = _post(smol, "chat/completions", {"messages": MESSAGES, "max_tokens": 8, "guided_choice": ["fine"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"


def test_the_compile_time_limit_is_a_400_and_the_server_goes_on(api_model: Path) -> None:
    # NOTE(tests): 300 properties with patterns take milliseconds to compile on any machine: over a 1 us limit by
    # construction (the tokenizer, built once per engine, is not counted).
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1}}}$"}
                                               for i in range(300)}, "required": ["p0"]}
    with serve_app(create_app(api_settings(api_model, grammar_compile_timeout_s=1e-6))) as server:
        r = httpx.post(f"{server.url}/chat/completions", timeout=60, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "response_format" and error["code"] == "grammar_compile_timeout"
        assert "time limit" in error["message"]
        ok = httpx.post(f"{server.url}/chat/completions", timeout=60,
                        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4})
        assert ok.status_code == 200


def test_text_response_format_is_plain_text(smol: RunningServer) -> None:
    plain = chat(smol, "Say hello.", max_tokens=8, temperature=0)
    text = chat(smol, "Say hello.", max_tokens=8, temperature=0, response_format={"type": "text"})
    # NOTE(tests): exact: the same request alone twice, the same row counts (conftest.keep_prior_draft_costs)
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_a_constrained_stream_over_raw_sse(smol: RunningServer) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "stream": True,
            "structured_outputs": {"choice": ["alpha", "beta"]}}
    with httpx.stream("POST", f"{smol.url}/chat/completions", json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = parse_chunks(lines)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text in ("alpha", "beta")
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["stop"]
