"""Wire models: OpenAI request fields -> SamplingParams, with 400-class errors that name the parameter."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from engine.types import InvalidRequestError, SamplingParams
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.sampling_fields import BEAM_SEARCH_MESSAGE

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def test_full_mapping_to_sampling_params() -> None:
    req = chat(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3, stop=["\n\n", ""],
               presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
               logit_bias={"5": -100, "7": 2.5}, logprobs=True, top_logprobs=3, stop_token_ids=[9])
    p = req.to_sampling_params(default_max_tokens=100, max_model_len=2048)
    assert p == SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3,
                               stop=("\n\n",), stop_token_ids=(9,), presence_penalty=0.5, frequency_penalty=-0.5,
                               repetition_penalty=1.1, logit_bias=((5, -100.0), (7, 2.5)), logprobs=True,
                               top_logprobs=3)


def test_defaults_and_max_tokens_resolution() -> None:
    p = chat().to_sampling_params(default_max_tokens=100, max_model_len=2048)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop) == (100, 1.0, 1.0, 0, ())
    assert chat(stop="END").to_sampling_params(5, 50).stop == ("END",)
    # max_completion_tokens wins over max_tokens; both are clamped to the context.
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params(100, 2048).max_tokens == 9
    assert chat(max_tokens=10_000).to_sampling_params(100, 512).max_tokens == 512


@pytest.mark.parametrize("fields,param", [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"1": 500.0}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_out_of_range_names_param_and_value(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat(**fields).to_sampling_params(16, 2048)
    assert info.value.param == param
    assert param in str(info.value)


@pytest.mark.parametrize("fields,param,needle", [
    ({"n": 0}, "n", "n must be >= 1"),
    ({"best_of": 3}, "best_of", "beam search"),
    ({"best_of": 0}, "best_of", "best_of must be >= 1, got 0"),  # a bad value, not a beam search request
    ({"use_beam_search": True}, "use_beam_search", "shared max-length buffer"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     "tools", "two functions named 'f'"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"guided_regex": "a+", "grammar": "root ::= \"a\""}, "grammar", "one output constraint"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"function_call": "auto"}, "function_call", "use tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
])
def test_unsupported_fields_are_refused_by_name(fields: dict, param: str, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    cause = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, InvalidRequestError) and cause.param == param
    assert needle in str(cause)


def test_beam_search_message_explains_the_kv_layout() -> None:
    assert "KV cache" in BEAM_SEARCH_MESSAGE and "shared" in BEAM_SEARCH_MESSAGE


def test_harmless_values_of_unsupported_fields_pass() -> None:
    req = chat(response_format={"type": "text"}, tools=[], tool_choice="none", best_of=1, n=1)
    assert req.to_sampling_params(4, 64).max_tokens == 4


def test_content_parts_and_roles() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]})
    assert req.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                                       {"role": "assistant", "content": ""}]
    with pytest.raises(ValidationError, match="only 'text' content parts"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    with pytest.raises(ValidationError, match="needs content"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user"}]})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "wizard", "content": "x"}]})


def test_strict_types() -> None:
    for bad in ({"max_tokens": "10"}, {"stream": "true"}, {"temperature": "0.5"}, {"stop": 5}):
        with pytest.raises(ValidationError):
            chat(**bad)
    assert chat(temperature=1).temperature == 1  # ints are fine where floats are expected


def test_unknown_fields_are_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="server.openai.base"):
        req = chat(frobnicate=True, guided_decoding_backend="xgrammar")
    assert req.to_sampling_params(3, 64).max_tokens == 3
    assert "frobnicate" in caplog.text and "guided_decoding_backend" in caplog.text


def test_include_usage_only_when_streaming() -> None:
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True).include_usage


def test_completion_prompts() -> None:
    assert CompletionRequest.model_validate({"prompt": "hello"}).prompt_text_or_ids() == "hello"
    assert CompletionRequest.model_validate({"prompt": ["hello"]}).prompt_text_or_ids() == "hello"
    assert CompletionRequest.model_validate({"prompt": [1, 2, 3]}).prompt_text_or_ids() == [1, 2, 3]
    assert CompletionRequest.model_validate({"prompt": [[4, 5]]}).prompt_text_or_ids() == [4, 5]
    for bad in ({"prompt": ["a", "b"]}, {"prompt": ""}, {"prompt": "x", "echo": True},
                {"prompt": "x", "suffix": "y"}, {"prompt": "x", "best_of": 2}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)


def test_completion_logprobs_and_default_max_tokens() -> None:
    p = CompletionRequest.model_validate({"prompt": "x", "logprobs": 2}).to_sampling_params(16, 2048)
    assert (p.max_tokens, p.logprobs, p.top_logprobs) == (16, True, 2)
    p = CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params(16, 2048)
    assert (p.logprobs, p.top_logprobs) == (False, 0)


def test_completion_logprobs_out_of_range_names_logprobs() -> None:
    """On /v1/completions the field is `logprobs` (chat's top_logprobs is its engine name)."""
    for value in (21, -1):
        with pytest.raises(ValidationError) as info:
            CompletionRequest.model_validate({"prompt": "Hello", "logprobs": value})
        cause = info.value.errors()[0]["ctx"]["error"]
        assert isinstance(cause, InvalidRequestError) and cause.param == "logprobs"
        assert f"logprobs must be in [0, 20], got {value}" == str(cause)


@pytest.mark.parametrize("model,base", [(ChatCompletionRequest, {"messages": USER}),
                                        (CompletionRequest, {"prompt": "hi"})])
def test_null_is_absent_on_every_optional_field(model, base: dict) -> None:
    """OpenAI marks its optional request fields nullable and SDKs send null for "not set": every optional
    field, whatever it is, takes its default on null (the list comes from the model, so new fields are covered)."""
    optional = [name for name, field in model.model_fields.items() if not field.is_required()]
    assert {"n", "stream", "stop", "temperature", "top_p", "seed", "logprobs", "stream_options", "user",
            "presence_penalty", "frequency_penalty", "logit_bias", "max_tokens"} <= set(optional)
    absent = model.model_validate(base)
    for name in optional:
        nulled = model.model_validate({**base, name: None})
        assert getattr(nulled, name) == getattr(absent, name), name
        assert nulled.to_sampling_params(16, 2048) == absent.to_sampling_params(16, 2048), name
    everything = model.model_validate({**base, **dict.fromkeys(optional)})
    assert everything.to_sampling_params(16, 2048) == absent.to_sampling_params(16, 2048)
    assert not everything.stream and not everything.include_usage


def test_null_in_nested_optional_fields_and_required_fields() -> None:
    req = chat(stream=True, stream_options={"include_usage": None},
               messages=[{"role": "user", "content": "hi", "name": None}, {"role": "assistant", "content": None}])
    assert not req.include_usage and req.messages[0].name is None
    for required in ({"messages": None}, {"messages": [{"role": None, "content": "hi"}]},
                     {"messages": [{"role": "user", "content": None}]}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(required)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": None})


def test_the_schema_says_optional_fields_take_null() -> None:
    for model in (ChatCompletionRequest, CompletionRequest):
        schema = model.model_json_schema()
        for name, prop in schema["properties"].items():
            nullable = any(v.get("type") == "null" for v in prop.get("anyOf", [prop]))
            assert nullable == (name not in schema["required"]), (model.__name__, name)


# --- tools -------------------------------------------------------------------------------------------

def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "d",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                                         "strict": True}}


def test_tool_request_defaults_and_choices() -> None:
    assert chat().tool_request().choice == "none" and not chat().tool_request().calls_possible
    auto = chat(tools=[TOOL]).tool_request()
    assert (auto.choice, auto.function, auto.parallel, auto.calls_possible) == ("auto", None, None, True)
    assert auto.tools[0]["function"]["parameters"]["properties"] == {"city": {"type": "string"}}
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 parallel_tool_calls=False).tool_request()
    assert (named.choice, named.function, named.parallel) == ("function", "get_weather", False)
    assert not chat(tools=[TOOL], tool_choice="none").tool_request().calls_possible
    # tools + response_format is fine when no call can be made
    assert chat(tools=[TOOL], tool_choice="none", response_format={"type": "json_object"}).structured_output()
    # beside tools that may be called, a JSON schema or json_object shapes the answer that makes no call
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    with_schema = chat(tools=[TOOL], response_format={"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": schema}})
    assert with_schema.tool_request().response_schema == schema
    assert chat(tools=[TOOL], response_format={"type": "json_object"}).tool_request().response_schema == \
        {"type": "object"}
    assert chat(tools=[TOOL]).tool_request().response_schema is None


@pytest.mark.parametrize("fields,param,needle", [
    ({"tools": [{**TOOL, "type": "retrieval"}]}, None, "function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, None, "1-64 characters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "properties": 3}}}]},
     None, "not a valid JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     None, "must describe an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _deep(300)}}]}, None,
     "at most 64"),  # refused before the recursive schema check could overflow the stack
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tools": [TOOL], "guided_regex": "a+"}, "guided_regex", "cannot be combined"),
    ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "a+"}, "guided_regex", "cannot be combined"),
])
def test_bad_tools_are_refused(fields: dict, param: str | None, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    assert needle in str(info.value)
    if param is not None:
        cause = info.value.errors()[0]["ctx"]["error"]
        assert isinstance(cause, InvalidRequestError) and cause.param == param


def test_tool_history_messages() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": [{"type": "text", "text": "warm"}]},
    ]})
    messages = req.template_messages()
    assert messages[0] == {"role": "user", "content": "weather?"}  # plain messages stay as they were
    assert messages[1]["content"] == "" and [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == \
        ['{"city": "Oslo"}', '{"city": "Rome"}']
    assert messages[2] == {"role": "tool", "content": "cold", "tool_call_id": "call_1"}
    assert messages[3] == {"role": "tool", "content": "warm", "tool_call_id": "call_2", "name": "get_weather"}
    with pytest.raises(ValidationError, match="tool_call_id"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "tool", "content": "x"}]})
    with pytest.raises(ValidationError, match="only assistant messages carry tool_calls"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]})
    with pytest.raises(ValidationError, match="deprecated"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "function", "name": "f", "content": "x"}]})
