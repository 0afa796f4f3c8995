"""Prefix caching (usage.prompt_tokens_details.cached_tokens, /metrics) and n > 1 choices through the
official openai client against a real server on the synthetic model."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.app import create_app
from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close
from tests.integration.server.conftest import RunningServer, api_settings, serve_app

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def long_text(seed: int, words: int = 120) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "lamp"])
                    for _ in range(words))


@pytest.fixture(scope="module")
def uncached_server(api_model: Path) -> Iterator[RunningServer]:
    with serve_app(create_app(api_settings(api_model, prefix_caching=False))) as running:
        yield running


def test_a_repeated_chat_prompt_reports_its_cached_tokens(api_server: RunningServer) -> None:
    client = api_server.client()
    messages = [{"role": "user", "content": long_text(1)}]
    before = api_server.metrics()
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, **GREEDY)
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, **GREEDY)
    prompt_tokens = second.usage.prompt_tokens
    assert first.usage.prompt_tokens == prompt_tokens > 100
    assert first.usage.prompt_tokens_details.cached_tokens < prompt_tokens // 2  # at most the template's start
    assert second.usage.prompt_tokens_details.cached_tokens == prompt_tokens - 2  # all but the last two tokens
    # NOTE(tests): exact: the same request alone twice; the reused prompt's last two tokens run as two rows, as a
    # cold prompt's last chunk does (engine/prefix_cache.py, MIN_RECOMPUTED), and drafting is priced alike
    # (conftest.keep_prior_draft_costs)
    assert second.choices[0].message.content == first.choices[0].message.content
    after = api_server.metrics()
    assert after["ortserve_prefix_cache_queries_total"] - before["ortserve_prefix_cache_queries_total"] \
        == 2 * prompt_tokens
    assert after["ortserve_prefix_cache_hits_total"] - before["ortserve_prefix_cache_hits_total"] >= prompt_tokens - 2

    # the next turn reuses the conversation so far; streamed usage carries the count too
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens > prompt_tokens
    assert prompt_tokens <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_completions_report_cached_tokens_streamed_and_not(api_server: RunningServer) -> None:
    client = api_server.client()
    prompt = long_text(2)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 2
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 2


def test_no_prefix_caching_reports_zero(uncached_server: RunningServer) -> None:
    client = uncached_server.client()
    messages = [{"role": "user", "content": long_text(3)}]
    for _ in range(2):
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **GREEDY)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert uncached_server.metrics()["ortserve_prefix_cache_hits_total"] == 0


def test_n_chat_choices_not_streamed(api_server: RunningServer) -> None:
    client = api_server.client()
    messages = [{"role": "user", "content": "three answers please " + long_text(4, 10)}]
    top = {"logprobs": True, "top_logprobs": TOP_K}
    single = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, **top, **GREEDY)
    three = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=3, **top, **GREEDY)
    assert [c.index for c in three.choices] == [0, 1, 2]
    # NOTE(tests): greedy: the three choices decode as rows of the same runs (exact), against one row alone (up to
    # a near-tie)
    assert len({c.message.content for c in three.choices}) == 1
    assert_greedy_close(GreedyRun.from_openai(single.choices[0].logprobs),
                        GreedyRun.from_openai(three.choices[0].logprobs), TINY_MAX_GAP_NATS, "n = 3 against n = 1")
    assert all(c.finish_reason == "length" for c in three.choices)
    assert three.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    assert three.usage.completion_tokens == 3 * 6

    seeded = {"temperature": 1.0, "seed": 99, "extra_body": {"ignore_eos": True}}
    a = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, n=4, **seeded)
    b = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, n=4, **seeded)
    texts = [c.message.content for c in a.choices]
    # NOTE(tests): exact: seeded sampling, the same request twice
    assert texts == [c.message.content for c in b.choices]  # seeded: reproducible, choice by choice
    assert len(set(texts)) > 1  # and the choices sample on their own


def test_n_chat_choices_streamed_with_an_index_each(api_server: RunningServer) -> None:
    client = api_server.client()
    messages = [{"role": "user", "content": "stream two " + long_text(5, 10)}]
    seeded = {"temperature": 1.0, "seed": 5, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, n=2, **seeded)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, n=2, stream=True,
                                                 stream_options={"include_usage": True}, **seeded))
    texts, roles, finishes = ["", ""], [0, 0], [[], []]
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1 and chunk.usage is None
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert roles == [1, 1] and finishes == [["length"], ["length"]]
    assert texts == [c.message.content for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_completion_choices_streamed_and_not(api_server: RunningServer) -> None:
    client = api_server.client()
    body = dict(model="tiny", prompt="two completions of " + long_text(6, 10), max_tokens=5, n=2, temperature=1.0,
                seed=11, extra_body={"ignore_eos": True})
    whole = client.completions.create(**body)
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 10
    texts = ["", ""]
    finishes = [0, 0]
    for chunk in client.completions.create(stream=True, **body):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] += choice.finish_reason is not None
    assert texts == [c.text for c in whole.choices] and finishes == [1, 1]


def test_the_engine_thread_reports_where_its_time_went(api_server: RunningServer) -> None:
    """/metrics splits the engine thread's time by step phase: a completion adds prefill and decode time, and
    the thread's CPU seconds never exceed the time it was measured over."""
    before = api_server.metrics()
    api_server.client().completions.create(model="tiny", prompt=long_text(9), max_tokens=12, **GREEDY)
    after = api_server.metrics()

    def grew(phase: str) -> float:
        key = f'ortserve_engine_step_phase_seconds_total{{phase="{phase}"}}'
        return after[key] - before.get(key, 0.0)

    assert grew("prefill") > 0 and grew("decode_run") > 0 and grew("decode_sample") > 0
    assert grew("decode_update") > 0 and grew("schedule") > 0 and grew("verify") >= 0
    cpu = after["ortserve_engine_thread_cpu_seconds_total"] - before.get("ortserve_engine_thread_cpu_seconds_total", 0)
    assert 0 < cpu
