"""Wire models: OpenAI request fields -> SamplingParams, with 400-class errors that name the parameter."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from engine.types import InvalidRequestError, SamplingParams
from server.protocol import BEAM_SEARCH_MESSAGE, ChatCompletionRequest, CompletionRequest

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
    ({"use_beam_search": True}, "use_beam_search", "shared max-length buffer"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format", "response_format"),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice"),
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
    assert req.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
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
    with caplog.at_level(logging.DEBUG, logger="server.protocol"):
        req = chat(frobnicate=True, guided_json={"a": 1})
    assert req.to_sampling_params(3, 64).max_tokens == 3
    assert "frobnicate" in caplog.text and "guided_json" in caplog.text


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
