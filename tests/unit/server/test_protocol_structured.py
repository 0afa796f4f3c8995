"""Structured-output wire fields -> engine.types.StructuredOutput (no model: mapping and refusals only)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.types import InvalidRequestError, StructuredOutput
from server.openai.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def completion(**fields):
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", "", "response_format")),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}},  # llama.cpp's form
     StructuredOutput("json_schema", json.dumps(SCHEMA), "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA), "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     StructuredOutput("json_schema", "true", "response_format")),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", json.dumps(SCHEMA), "structured_outputs")),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
     StructuredOutput("regex", "a+", "structured_outputs")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutput("choice", '["x", "y"]', "structured_outputs")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput("gbnf", 'root ::= "a"', "structured_outputs")),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object", "", "structured_outputs")),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json_schema", json.dumps(SCHEMA), "guided_json")),
    ({"guided_json": SCHEMA}, StructuredOutput("json_schema", json.dumps(SCHEMA), "guided_json")),
    ({"guided_regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+", "guided_regex")),
    ({"guided_choice": ["a"]}, StructuredOutput("choice", '["a"]', "guided_choice")),
    ({"guided_grammar": "start: /a+/"}, StructuredOutput("gbnf", "start: /a+/", "guided_grammar")),
    ({"json_schema": SCHEMA}, StructuredOutput("json_schema", json.dumps(SCHEMA), "json_schema")),
    ({"grammar": 'root ::= "a"'}, StructuredOutput("gbnf", 'root ::= "a"', "grammar")),
])
def test_each_field_maps_to_one_constraint_on_chat_and_completions(fields, expected):
    for request in (chat(**fields), completion(**fields)):
        assert request.to_sampling_params(8, 64).structured == expected


@pytest.mark.parametrize("fields, param, needle", [
    ({"response_format": {"type": "xml"}}, "response_format", "must be one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}}, "response_format",
     "name must be a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}},
     "response_format.json_schema.schema", "JSON schema"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "not supported"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"guided_regex": " "}, "guided_regex", "non-empty"),
    ({"grammar": ""}, "grammar", "non-empty"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one output constraint"),
])
def test_malformed_fields_are_refused_by_name(fields, param, needle):
    for build in (chat, completion):
        with pytest.raises(ValidationError) as info:
            build(**fields)
        cause = info.value.errors()[0]["ctx"]["error"]
        assert isinstance(cause, InvalidRequestError) and cause.param == param, cause
        assert needle in str(cause)
