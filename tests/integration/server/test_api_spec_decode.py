"""Each response's own draft checks over HTTP (--per-request-spec-decode-metrics, vLLM's flag and shape): chat and
completions, streamed (the last chunk, with the usage) and not, the Responses and Messages APIs through their official
clients, n > 1, and a server without the flag whose responses carry no `metrics` at all. The tiny model drafts for
itself (its greedy drafts are all kept), so every check's numbers are known to add up."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from engine.spec_decode import policy
from server.app import create_app

from tests.integration.server.conftest import RunningServer, api_settings, serve_app

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
ASK = [{"role": "user", "content": "Count to ten."}]


@pytest.fixture(scope="module")
def drafted(api_model: Path) -> Iterator[RunningServer]:
    settings = api_settings(api_model, draft_model=str(api_model), draft_p_min=0.0, speculative_tokens=0,
                            per_request_spec_decode_metrics="detailed")
    with serve_app(create_app(settings)) as running:
        # NOTE(tests): drafts are priced by measured time; whether a row drafts must not depend on the machine's load
        running.engine._core.scheduler.check_cost.freeze()
        yield running


def spec(body: Any) -> dict[str, Any]:
    """`metrics.speculative_decoding` of a response (an SDK object or a dict), checked for consistency (the rules
    vLLM's own test of the flag asserts)."""
    extra = body if isinstance(body, dict) else (body.model_extra or {})
    metrics = extra["metrics"]["speculative_decoding"]
    histogram = metrics["acceptance_histogram"]
    assert len(histogram) == metrics["num_spec_tokens"] + 1
    assert metrics["num_spec_steps"] == sum(histogram) == len(metrics["per_step_drafted"])
    assert metrics["num_accepted_draft_tokens"] == sum(a * n for a, n in enumerate(histogram)) \
        == sum(metrics["per_step_accepted"])
    assert metrics["num_draft_tokens"] == sum(metrics["per_step_drafted"])
    if metrics["num_spec_steps"]:
        assert math.isclose(metrics["mean_acceptance_length"],
                            1 + metrics["num_accepted_draft_tokens"] / metrics["num_spec_steps"])
        assert math.isclose(metrics["draft_acceptance_rate"],
                            metrics["num_accepted_draft_tokens"] / metrics["num_draft_tokens"])
    return metrics


def test_a_chat_completion_carries_its_draft_checks(drafted: RunningServer) -> None:
    r = drafted.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=24, **GREEDY)
    m = spec(r)
    assert m["num_spec_steps"] >= 2 and m["num_spec_tokens"] == 16
    # its own drafts are all kept, and every token came from the prompt's run, a check, or a decode step
    assert m["num_accepted_draft_tokens"] == m["num_draft_tokens"] > 0
    assert m["num_accepted_draft_tokens"] + m["num_spec_steps"] < r.usage.completion_tokens == 24
    assert m["per_step_accepted"] == m["per_step_drafted"]


def test_a_stream_carries_them_on_its_last_chunk_with_the_usage(drafted: RunningServer) -> None:
    chunks = list(drafted.client().chat.completions.create(
        model="tiny", messages=ASK, max_tokens=24, stream=True, stream_options={"include_usage": True}, **GREEDY))
    with_metrics = [c for c in chunks if (c.model_extra or {}).get("metrics") is not None]
    assert with_metrics == [chunks[-1]] and chunks[-1].usage.completion_tokens == 24
    assert spec(chunks[-1])["num_accepted_draft_tokens"] > 0
    # without include_usage no chunk carries them (as vLLM)
    plain = list(drafted.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=8, stream=True,
                                                          **GREEDY))
    assert not any((c.model_extra or {}).get("metrics") for c in plain)


def test_completions_streamed_and_not_and_n_choices_add_up(drafted: RunningServer) -> None:
    client = drafted.client()
    one = client.completions.create(model="tiny", prompt="a b c d e f", max_tokens=20, **GREEDY)
    single = spec(one)
    assert single["num_spec_steps"] > 0
    chunks = list(client.completions.create(model="tiny", prompt="a b c d e f", max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert spec(chunks[-1])["num_spec_steps"] > 0 and chunks[-1].usage.completion_tokens == 20
    # n = 2 greedy choices: the request's checks are both choices' together
    two = client.completions.create(model="tiny", prompt="a b c d e f", max_tokens=20, n=2, **GREEDY)
    both = spec(two)
    assert both["num_accepted_draft_tokens"] + both["num_spec_steps"] <= two.usage.completion_tokens == 40


def test_the_responses_and_messages_apis_carry_them_beside_their_usage(drafted: RunningServer) -> None:
    r = drafted.client().responses.create(model="tiny", input="Count to ten.", max_output_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert spec(r)["num_spec_steps"] > 0
    fetched = drafted.client().responses.retrieve(r.id)  # stored as it was answered
    assert spec(fetched) == spec(r)
    client = anthropic.Anthropic(base_url=drafted.base, api_key="unused", max_retries=0, timeout=60)
    m = client.messages.create(model="tiny", max_tokens=24, messages=ASK,
                               extra_body={"temperature": 0, "ignore_eos": True})
    assert spec(m)["num_spec_steps"] > 0
    deltas = [e for e in client.messages.create(model="tiny", max_tokens=24, messages=ASK, stream=True,
                                                extra_body={"temperature": 0, "ignore_eos": True})
              if e.type == "message_delta"]
    assert len(deltas) == 1 and spec(deltas[0])["num_spec_steps"] > 0


def test_a_request_without_checks_and_a_server_without_the_flag(drafted: RunningServer, api_model: Path) -> None:
    off = drafted.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=8,
                                                   extra_body={"ignore_eos": True, "speculative": False},
                                                   temperature=0)
    m = spec(off)
    assert m["num_spec_steps"] == m["num_draft_tokens"] == 0 and set(m["acceptance_histogram"]) == {0}
    assert m["mean_acceptance_length"] is None and m["draft_acceptance_rate"] is None
    with serve_app(create_app(api_settings(api_model, draft_model=str(api_model)))) as plain:
        r = plain.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=8, **GREEDY)
        assert "metrics" not in (r.model_extra or {})


PICK = {"type": "function", "function": {
    "name": "pick", "description": "Pick a color.",
    "parameters": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                    "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["color", "n"], "additionalProperties": False}}}


def test_json_schema_answers_and_forced_tool_calls_draft_inside_their_grammar(drafted: RunningServer,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Constrained requests draft too (only what their grammar allows) and stay valid: a JSON schema answer and a
    required tool call, each with its draft checks in the response."""
    # NOTE(tests): the tool call's prompt (its schema in the system prompt) is long enough that the draft model's
    # catch-up prices its first probe out of a short answer (engine.spec_decode.policy); this test is about grammars,
    # so every request's first probe is free here
    monkeypatch.setattr(policy, "FREE_PROBE_STEPS", float("inf"))
    client = drafted.client()
    schema = PICK["function"]["parameters"]
    r = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"color", "n"}
    assert spec(r)["num_accepted_draft_tokens"] > 0
    call = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=80, temperature=0, tools=[PICK],
                                          tool_choice="required", parallel_tool_calls=False)
    [tool_call] = call.choices[0].message.tool_calls
    assert tool_call.function.name == "pick" and call.choices[0].finish_reason == "tool_calls"
    assert json.loads(tool_call.function.arguments)["color"] in ("red", "green", "blue")
    assert spec(call)["num_accepted_draft_tokens"] > 0
