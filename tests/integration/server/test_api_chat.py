"""Chat and completions against a real server and model: the openai SDK and the raw SSE wire format."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from server.app import create_app, load_engine
from tests.integration.server.conftest import RunningServer, api_settings, free_socket, parse_chunks, serve_app

HI = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_chat_non_stream_shape_and_usage(api_server: RunningServer) -> None:
    r = api_server.client().chat.completions.create(model="tiny", messages=HI, max_tokens=7, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert r.usage.completion_tokens == 7
    prompt_ids = api_server.engine.tokenizer.encode(api_server.engine.chat_template.render(HI))
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_stream_is_well_formed_with_usage(api_server: RunningServer) -> None:
    client = api_server.client()
    full = client.chat.completions.create(model="tiny", messages=HI, max_tokens=40, **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({(c.id, c.created, c.model, c.object) for c in chunks}) == 1
    assert chunks[0].object == "chat.completion.chunk"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    # The usage chunk comes last, with no choices; every other chunk has usage null.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # NOTE(tests): exact: the same request alone twice, the same row counts (conftest.keep_prior_draft_costs)
    assert text == full.choices[0].message.content  # greedy: streaming changes nothing


def test_sse_wire_format(api_server: RunningServer) -> None:
    body = {"model": "tiny", "messages": HI, "max_tokens": 12, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", f"{api_server.url}/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode("utf-8")
    # Events are "data: <json>" blocks separated by blank lines, ending with data: [DONE].
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    data_blocks = [b for b in blocks if not b.startswith(":")]
    assert all(b.startswith("data: ") and "\n" not in b for b in data_blocks)
    assert data_blocks[-1] == "data: [DONE]"
    chunks = [json.loads(b[len("data: "):]) for b in data_blocks[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in chunks[0]  # only with stream_options.include_usage
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["delta"] == {}


def test_completions_text_and_token_ids(api_server: RunningServer) -> None:
    client = api_server.client()
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=9, **GREEDY)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 9
    ids = api_server.engine.tokenizer.encode("Once upon a time")
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=9, **GREEDY)
    # NOTE(tests): exact: the same request alone twice, the same row counts (conftest.keep_prior_draft_costs)
    assert r2.choices[0].text == r.choices[0].text
    assert r2.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices].count("length") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_completions_default_is_16_tokens(api_server: RunningServer) -> None:
    r = api_server.client().completions.create(model="tiny", prompt="abc", **GREEDY)
    assert r.usage.completion_tokens == 16


def test_models_and_unknown_model(api_server: RunningServer) -> None:
    client = api_server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_prompt_too_long_is_400_naming_both_numbers(api_server: RunningServer) -> None:
    long_text = "hello world " * 1500
    n = len(api_server.engine.tokenizer.encode(api_server.engine.chat_template.render(
        [{"role": "user", "content": long_text}])))
    assert n > api_server.engine.max_model_len
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            api_server.client().chat.completions.create(model="tiny", max_tokens=4, stream=stream,
                                                        messages=[{"role": "user", "content": long_text}])
        message = info.value.body["message"]
        assert str(n) in message and str(api_server.engine.max_model_len) in message
        assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        api_server.client().completions.create(model="tiny", prompt=long_text, max_tokens=4)
    assert info.value.body["param"] == "prompt" and info.value.body["code"] == "context_length_exceeded"
    # Token-id prompts are checked against the vocabulary, never passed through blindly.
    with pytest.raises(openai.BadRequestError) as info:
        api_server.client().completions.create(model="tiny", prompt=[1, 2, 10**6], max_tokens=4)
    assert info.value.body["param"] == "prompt"


def test_out_of_range_values_are_400(api_server: RunningServer) -> None:
    client = api_server.client()
    for bad, param in [({"temperature": 2.5}, "temperature"), ({"top_p": 1.5}, "top_p"),
                       ({"max_tokens": 0}, "max_tokens"), ({"extra_body": {"top_k": -1}}, "top_k"),
                       ({"logit_bias": {"100000": 5}}, "logit_bias")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=HI, **bad)
        assert info.value.body["param"] == param and "got" in info.value.body["message"]


def test_bad_json_over_the_wire_is_400(api_server: RunningServer) -> None:
    r = httpx.post(f"{api_server.url}/chat/completions", content=b'{"model": "tiny", "messages": [',
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_partial_stop_strings_never_leak(api_server: RunningServer) -> None:
    client = api_server.client()
    text = client.chat.completions.create(model="tiny", messages=HI, max_tokens=60, **GREEDY) \
        .choices[0].message.content
    # NOTE(tests): every request below is that one alone again, the same row counts: the same greedy text
    # (conftest.keep_prior_draft_costs)
    # A 4-character window (ASCII letters only) whose first occurrence is well inside the text.
    k = next(i for i in range(3, len(text) - 4)
             if text[i:i + 4].isascii() and text[i:i + 4].isalpha() and text.find(text[i:i + 4]) == i)
    stop = text[k:k + 4]
    for stream in (True, False):
        if stream:
            chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=60, stop=[stop],
                                                         stream=True, **GREEDY))
            got = "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
            assert reason == ["stop"]
        else:
            r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=60, stop=stop, **GREEDY)
            got, reason = r.choices[0].message.content, [r.choices[0].finish_reason]
            assert reason == ["stop"]
        assert got == text[:k], (stop, got, text[:k])
    # A stop string that starts matching but never completes: the held-back text is released in full.
    never = text[k:k + 2] + "\x00\x01"
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=60, stop=never,
                                                 stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_seed_makes_sampling_reproducible(api_server: RunningServer) -> None:
    client = api_server.client()

    def sample(seed: int) -> str:
        return client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, temperature=1.0,
                                              seed=seed).choices[0].message.content

    assert sample(1234) == sample(1234)
    assert sample(-5) == sample(-5)  # negative seeds (valid in OpenAI's API) work too


def test_logprobs(api_server: RunningServer) -> None:
    r = api_server.client().chat.completions.create(model="tiny", messages=HI, max_tokens=6, logprobs=True,
                                                    top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-5)


def test_unsupported_features_are_clear_400s(api_server: RunningServer) -> None:
    client = api_server.client()
    with pytest.raises(openai.BadRequestError) as info:  # more choices than the server runs at once
        client.chat.completions.create(model="tiny", messages=HI, n=9)
    assert info.value.body["param"] == "n" and "at most 8" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=HI, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            tool_choice={"type": "function", "function": {"name": "g"}})
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", best_of=2)
    assert "beam search" in info.value.body["message"]


def test_health_version_and_metric_names(api_server: RunningServer) -> None:
    assert httpx.get(f"{api_server.base}/health").json()["status"] == "ok"
    assert httpx.get(f"{api_server.base}/version").json()["version"]
    names = set(api_server.metrics())
    for name in ("ortserve_requests_running", "ortserve_requests_waiting", "ortserve_kv_slots_free",
                 "ortserve_time_to_first_token_seconds_count", "ortserve_inter_token_latency_seconds_count",
                 "ortserve_e2e_request_latency_seconds_count", "ortserve_request_queue_time_seconds_count",
                 "ortserve_prompt_tokens_total", "ortserve_generation_tokens_total",
                 'ortserve_requests_total{status="stop"}', 'ortserve_requests_total{status="length"}'):
        assert name in names, name
    m = api_server.metrics()
    assert m["ortserve_kv_slots_free"] == 8
    assert m["ortserve_generation_tokens_total"] > 0 and m["ortserve_time_to_first_token_seconds_count"] > 0


def test_keepalive_pings_are_sse_comments(api_server: RunningServer, api_model) -> None:
    # A second app on the same engine, pinging every millisecond so that pings interleave with data.
    with serve_app(create_app(api_settings(api_model, sse_ping_s=0.001), engine=api_server.engine)) as pinging:
        body = {"model": "tiny", "messages": HI, "max_tokens": 600, "stream": True, "temperature": 0,
                "ignore_eos": True}
        with httpx.stream("POST", f"{pinging.url}/chat/completions", json=body, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
        comments = [line for line in lines if line.startswith(":")]
        assert comments, "no keep-alive comment was sent"
        assert all(line.startswith(": ") or line.startswith("data: ") for line in lines)
        chunks = parse_chunks([line[6:] for line in lines if line.startswith("data: ")])
        assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
        # The SDK ignores the comments and sees the same text as without pings.
        client = pinging.client()
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=600, stream=True, **GREEDY))
        plain = api_server.client().chat.completions.create(model="tiny", messages=HI, max_tokens=600, **GREEDY)
        # NOTE(tests): exact: one engine, the same request alone twice (conftest.keep_prior_draft_costs)
        assert streamed == plain.choices[0].message.content


def test_health_is_503_until_the_engine_is_loaded(api_model) -> None:
    gate = threading.Event()

    def gated_loader(settings):
        gate.wait(30)
        return load_engine(settings)

    app = create_app(api_settings(api_model), loader=gated_loader)
    sock = free_socket()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.get(f"{base}/health", timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": HI}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        gate.set()
        while httpx.get(f"{base}/health", timeout=5).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(f"{base}/health", timeout=5).json()["status"] == "ok"
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        gate.set()
        server.should_exit = True
        thread.join(30)
        sock.close()
