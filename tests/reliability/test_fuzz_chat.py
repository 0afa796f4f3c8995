"""Fuzzing the generation endpoints with hypothesis: random unicode (lone surrogates too), huge strings, deep
nesting, wrong types, NaN and infinities as raw JSON, negative and huge numbers, empty and 10,000-message
conversations. Never a 5xx, never a hang, every error in the OpenAI shape.

What the fuzzer found is kept as explicit regression cases (REGRESSIONS) that run every time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from tests.reliability.conftest import AbusedServer, assert_no_internals, assert_openai_error

REQUEST_TIMEOUT_S = 30.0  # a request slower than this on the tiny model counts as a hang
FUZZ = settings(max_examples=400, deadline=None, derandomize=bool(os.environ.get("CI")),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def http(rel_server: AbusedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=rel_server.base, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


def check_response(r: httpx.Response, stream: bool) -> None:
    """No 5xx; errors OpenAI-shaped; successes well-formed (a stream ends with [DONE])."""
    if currently_in_test_context():  # statistics for --hypothesis-show-statistics
        event(f"status {r.status_code}")
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert_openai_error(r.status_code, r.content)
        return
    assert r.status_code == 200, r.status_code
    assert_no_internals(r.text)
    if not stream:
        data = r.json()
        assert data["choices"] and "usage" in data
        return
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text[-300:]
    for item in events[:-1]:
        chunk = json.loads(item)
        assert "error" not in chunk, chunk  # an engine failure would show here


def post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    body = text.encode("utf-8", "surrogatepass")  # lone surrogates travel as the raw JSON escape anyway
    return http.post(path, content=body, headers={"Content-Type": "application/json"})


def send(http: httpx.Client, path: str, payload: Any) -> None:
    # NOTE: allow_nan writes NaN/Infinity/-Infinity as bare tokens: what a careless JS or Python client sends.
    text = json.dumps(payload, allow_nan=True)
    stream = isinstance(payload, dict) and payload.get("stream") is True
    check_response(post_raw(http, path, text), stream)


# --- strategies ---------------------------------------------------------------------------------------
# Payloads are either plausible (they reach the engine and generate) or plausible with one field or the
# conversation replaced by chaos, or chaos outright.

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
NICE_TEXT = st.text(max_size=48)  # any unicode but surrogates
TEXT = st.text(alphabet=st.one_of(st.characters(), SURROGATES), max_size=64)
HUGE_TEXT = st.builds(lambda piece, n: piece * n, st.text(min_size=1, max_size=2), st.integers(10_000, 300_000))
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70), st.integers(-5, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, -0.0, 1e308, -1e308, 5e-324, 2**63, -(2**63)]),
)


def nested(depth: int) -> Any:
    value: Any = "deep"
    for i in range(depth):
        value = [value] if i % 2 else {"x": value}
    return value


JSON = st.recursive(st.none() | st.booleans() | NUMBERS | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=12)
# NOTE: nesting deeper than ~200 is sent as raw text (RAW_TOKENS): json.dumps and hypothesis' printer recurse.
CHAOS = st.one_of(JSON, st.integers(1, 150).map(nested), HUGE_TEXT)

NICE_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                      "content": st.one_of(NICE_TEXT, st.lists(st.fixed_dictionaries(
                                          {"type": st.just("text"), "text": NICE_TEXT}), min_size=1, max_size=3))},
                                     optional={"name": NICE_TEXT})
ODD_MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["tool", "function", "", "USER"]), CHAOS),
     "content": st.one_of(TEXT, HUGE_TEXT, st.none(), CHAOS,
                          st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | CHAOS,
                                                          "text": TEXT | CHAOS}), max_size=3))},
    optional={"name": TEXT | CHAOS, "tool_calls": CHAOS})
# A long conversation costs the fuzzer nothing to build: one message repeated.
ODD_MESSAGES = st.one_of(
    st.lists(st.one_of(NICE_MESSAGE, ODD_MESSAGE, CHAOS), max_size=6),
    # NOTE: only short messages are repeated (10,000 copies of a huge one would be gigabytes on the client).
    st.builds(lambda m, n: [m] * n, st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                                                           "content": TEXT}), st.sampled_from([0, 1, 500, 10_000])),
    CHAOS,
)

NICE_FIELDS = {
    "model": st.just("tiny"),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 600),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**64),
    "stop": st.one_of(NICE_TEXT, st.lists(NICE_TEXT, max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=4),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.05, 2),
    "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.floats(-100, 100), max_size=3),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "stream": st.booleans(),
    "user": NICE_TEXT,
}
ODD_KEYS = sorted(NICE_FIELDS) + ["messages", "max_tokens", "n", "best_of", "use_beam_search", "stream_options",
                                  "response_format", "tools", "tool_choice", "max_completion_tokens", NICE_TEXT]


def _replace(body: dict, key: Any, value: Any) -> dict:
    return {**body, key: value} if isinstance(key, str) else body


NICE_CHAT = st.fixed_dictionaries({"messages": st.lists(NICE_MESSAGE, min_size=1, max_size=4),
                                   "max_tokens": st.integers(1, 6)}, optional=NICE_FIELDS)
CHAT_BODY = st.one_of(
    NICE_CHAT,
    NICE_CHAT,  # NOTE: twice, so that about a third of the payloads reach the engine
    st.builds(_replace, NICE_CHAT, st.sampled_from(ODD_KEYS).flatmap(lambda k: k if isinstance(k, st.SearchStrategy)
                                                                      else st.just(k)), CHAOS | NUMBERS | TEXT),
    st.builds(_replace, NICE_CHAT, st.just("messages"), ODD_MESSAGES),
    st.builds(lambda b: {k: v for k, v in b.items() if k != "messages"}, NICE_CHAT),
    CHAOS,
)
NICE_COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(NICE_TEXT.filter(bool), st.lists(st.integers(0, 511), min_size=1, max_size=8)),
     "max_tokens": st.integers(1, 6)}, optional=NICE_FIELDS)
COMPLETION_BODY = st.one_of(
    NICE_COMPLETION,
    NICE_COMPLETION,
    st.builds(_replace, NICE_COMPLETION, st.sampled_from([*ODD_KEYS[:-1], "prompt", "echo", "suffix"]),
              CHAOS | NUMBERS | TEXT),
    st.builds(_replace, NICE_COMPLETION, st.just("prompt"),
              st.one_of(TEXT, HUGE_TEXT, st.lists(st.integers(-3, 600), max_size=8), st.lists(NUMBERS, max_size=3),
                        st.lists(TEXT, max_size=3), st.lists(st.lists(st.integers(0, 600), max_size=3), max_size=3))),
    CHAOS,
)


@FUZZ
@given(payload=CHAT_BODY)
def test_fuzzed_chat_payloads_never_5xx(http: httpx.Client, payload: Any) -> None:
    send(http, "/v1/chat/completions", payload)


@FUZZ
@given(payload=COMPLETION_BODY)
def test_fuzzed_completion_payloads_never_5xx(http: httpx.Client, payload: Any) -> None:
    send(http, "/v1/completions", payload)


RAW_TOKENS = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 400, "-0", "0.0e-400",
                              "true", "null", '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"', "[]", "{}", "1.5",
                              "[" * 5000 + "]" * 5000, '{"a": ' * 3000 + "1" + "}" * 3000,
                              '[{"role": "user", "content": ' + "[" * 2000 + "]" * 2000 + "}]"])


@FUZZ
@given(field=st.sampled_from(["temperature", "top_p", "max_tokens", "seed", "top_k", "presence_penalty",
                              "logit_bias", "stop", "n", "model", "messages", "stream"]),
       token=RAW_TOKENS)
def test_raw_json_tokens_in_any_field_never_5xx(http: httpx.Client, field: str, token: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body.pop(field, None)
    text = json.dumps(body)[:-1] + f', "{field}": {token}}}'
    check_response(post_raw(http, "/v1/chat/completions", text), stream=(field, token) == ("stream", "true"))


# --- regressions and named edge cases (what the fuzzer found, and the explicit cases) -----------

HI = [{"role": "user", "content": "hi"}]

REGRESSIONS: dict[str, tuple[str, str, int]] = {
    # Found by the fuzzer: a lone surrogate reached the tokenizer (TypeError -> 500); now a 400.
    "lone_surrogate_content": ("/v1/chat/completions",
                               '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400),
    "lone_surrogate_prompt": ("/v1/completions", '{"model": "tiny", "prompt": "\\udfff", "max_tokens": 2}', 400),
    "lone_surrogate_text_part": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": '
                                 '[{"type": "text", "text": "\\udc00"}]}], "max_tokens": 2}', 400),
    "lone_surrogate_system": ("/v1/chat/completions", '{"messages": [{"role": "system", "content": "\\ud83d"}, '
                              '{"role": "user", "content": "hi"}], "max_tokens": 2}', 400),
    "paired_surrogates_are_fine": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": '
                                   '"\\ud83d\\ude00"}], "max_tokens": 2}', 200),
    "lone_surrogate_stop": ("/v1/chat/completions", json.dumps({"messages": HI, "max_tokens": 2})[:-1]
                            + ', "stop": ["\\ud800"]}', 200),
    "lone_surrogate_model": ("/v1/chat/completions", '{"model": "\\ud800", "messages": [], "max_tokens": 2}', 400),
    "nan_temperature": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                        '"temperature": NaN}', 400),
    "infinite_top_p": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
                       400),
    "nan_logit_bias": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                       '"logit_bias": {"5": NaN}}', 400),
    "huge_integer_literal": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                             '"max_tokens": ' + "9" * 5000 + "}", 400),
    "deep_nesting": ("/v1/chat/completions", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", 400),
    "empty_conversation": ("/v1/chat/completions", '{"messages": []}', 400),
    "ten_thousand_messages": ("/v1/chat/completions", json.dumps({"messages": HI * 10_000, "max_tokens": 2}), 400),
    "not_an_object": ("/v1/chat/completions", "[1, 2, 3]", 400),
    "empty_body": ("/v1/chat/completions", "", 400),
    "negative_max_tokens": ("/v1/completions", '{"prompt": "hi", "max_tokens": -1}', 400),
    "negative_prompt_id": ("/v1/completions", '{"prompt": [-1], "max_tokens": 2}', 400),
    "huge_prompt_id": ("/v1/completions", '{"prompt": [' + str(2**70) + '], "max_tokens": 2}', 400),
    "huge_seed_is_fine": ("/v1/chat/completions", json.dumps({"messages": HI, "max_tokens": 2, "seed": -(2**70)}),
                          200),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regression(http: httpx.Client, name: str) -> None:
    path, text, expected = REGRESSIONS[name]
    r = post_raw(http, path, text)
    assert r.status_code == expected, (r.status_code, r.text[:300])
    check_response(r, stream=False)


def test_a_two_million_character_message_is_413_or_400(http: httpx.Client) -> None:
    for piece, n in (("\U0001F600", 2_000_000), ("ab", 1_000_000)):
        r = post_raw(http, "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": piece * n}]}))
        assert r.status_code in (400, 413), r.status_code
        check_response(r, stream=False)


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-6])
def test_a_vanishing_temperature_is_greedy(http: httpx.Client, temperature: float) -> None:
    """Found by the fuzzer: float32(logits / 5e-324) overflowed to NaN probabilities (garbage tokens)."""
    def text(t: float) -> str:
        body = {"messages": HI, "max_tokens": 12, "temperature": t, "seed": 3, "ignore_eos": True}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    # NOTE(tests): exact: the same request alone twice, the same row counts (conftest.keep_prior_draft_costs)
    assert text(temperature) == text(0.0)
