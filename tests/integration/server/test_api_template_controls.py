"""Chat template controls with vLLM's names (add_generation_prompt, continue_final_message, echo,
chat_template_kwargs) and vLLM's /tokenize and /detokenize, on the synthetic model's ChatML template."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.server.conftest import RunningServer

PREFILL = [{"role": "user", "content": "What is the best book"}, {"role": "assistant", "content": "Whill"}]


def _tokenize(server: RunningServer, **body) -> dict:
    r = httpx.post(f"{server.base}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_template_continue_final_message_mutual_exclusion(api_server: RunningServer) -> None:
    """llama.cpp's server test of the same name: both flags at once is a 400."""
    r = httpx.post(f"{api_server.url}/chat/completions", timeout=30, json={
        "max_tokens": 8, "messages": PREFILL, "add_generation_prompt": True, "continue_final_message": True})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "continue_final_message" and error["type"] == "invalid_request_error"
    assert "add_generation_prompt" in error["message"]


def test_continue_final_message_continues_the_prefill(api_server: RunningServer) -> None:
    engine = api_server.engine
    continued = engine.chat_template.render(PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("<|im_start|>assistant\nWhill")
    client = api_server.client()
    extra = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
    r = client.chat.completions.create(model="tiny", messages=PREFILL, max_tokens=3, temperature=0, extra_body=extra)
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(continued))
    assert _tokenize(api_server, messages=PREFILL, add_generation_prompt=False,
                     continue_final_message=True)["count"] == r.usage.prompt_tokens
    # echo: the answer starts with the continued message, streamed or not (NOTE(tests): exact: the same request
    # alone each time, the same row counts: conftest.keep_prior_draft_costs)
    echoed = client.chat.completions.create(model="tiny", messages=PREFILL, max_tokens=3, temperature=0,
                                            extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == "Whill" + r.choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=PREFILL, max_tokens=3, temperature=0, stream=True,
                                            extra_body={**extra, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == echoed.choices[0].message.content


def test_add_generation_prompt_false(api_server: RunningServer) -> None:
    engine = api_server.engine
    without = engine.chat_template.render(PREFILL[:1], add_generation_prompt=False)
    assert not without.endswith("assistant\n")
    assert _tokenize(api_server, messages=PREFILL[:1], add_generation_prompt=False)["tokens"] == \
        engine.tokenizer.encode(without)
    r = api_server.client().chat.completions.create(model="tiny", messages=PREFILL[:1], max_tokens=2,
                                                    extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(without))


def test_chat_template_kwargs_reach_the_template(api_server: RunningServer) -> None:
    assert _tokenize(api_server, messages=PREFILL[:1], chat_template_kwargs={"enable_thinking": False})["count"] == \
        _tokenize(api_server, messages=PREFILL[:1])["count"]  # ChatML takes no such variable: nothing changes
    for kwargs in ({"messages": []}, {"add_generation_prompt": False}, {"bos_token": "x"}):
        r = httpx.post(f"{api_server.url}/chat/completions", timeout=30,
                       json={"messages": PREFILL[:1], "chat_template_kwargs": kwargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


@pytest.mark.parametrize("body", [
    {"messages": PREFILL[:1], "continue_final_message": True, "add_generation_prompt": False},  # last is the user's
    {"messages": PREFILL, "echo": "yes"},
])
def test_bad_template_controls_are_400s(api_server: RunningServer, body: dict) -> None:
    r = httpx.post(f"{api_server.url}/chat/completions", json={"max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text


def test_tokenize_and_detokenize_in_vllms_shape(api_server: RunningServer) -> None:
    engine = api_server.engine
    text = _tokenize(api_server, prompt="Hello world", return_token_strs=True)
    assert text["tokens"] == engine.tokenizer.encode("Hello world", add_special_tokens=True)
    assert text["count"] == len(text["tokens"]) and text["max_model_len"] == engine.max_model_len
    assert "".join(text["token_strs"]) == "Hello world"
    assert _tokenize(api_server, prompt="Hello world")["token_strs"] is None
    chat = _tokenize(api_server, messages=PREFILL[:1])
    r = api_server.client().chat.completions.create(model="tiny", messages=PREFILL[:1], max_tokens=1)
    assert chat["count"] == r.usage.prompt_tokens
    back = httpx.post(f"{api_server.base}/detokenize", json={"tokens": chat["tokens"]}, timeout=30).json()
    assert back["prompt"] == engine.chat_template.render(PREFILL[:1])
    for bad, status in (({"tokens": [-1]}, 400), ({"tokens": [10 ** 9]}, 400), ({}, 400)):
        assert httpx.post(f"{api_server.base}/detokenize", json=bad, timeout=30).status_code == status
    for bad in ({}, {"prompt": "x", "messages": PREFILL}, {"messages": []}, {"prompt": "x", "model": "nope"}):
        r = httpx.post(f"{api_server.base}/tokenize", json=bad, timeout=30)
        assert r.status_code in (400, 404) and "error" in r.json(), (bad, r.text)


def test_openai_client_sees_the_400(api_server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError):
        api_server.client().chat.completions.create(
            model="tiny", messages=PREFILL, max_tokens=2,
            extra_body={"add_generation_prompt": True, "continue_final_message": True})
