"""Reasoning output on a thinking chat template (tests/integration/server/templates/think_hermes.jinja, through
--chat-template): the thinking comes apart from the answer as `reasoning_content` and `reasoning`, whole and
streamed, on chat, Responses and Messages; tool calls after a think block parse; `enable_thinking: false` and
the other chat_template_kwargs reach the template.

The synthetic model writes random text, so where a test needs a thinking block in the output, a regex
(structured_outputs) makes the engine generate it: the text is real engine output, read by the server's parser.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from server.app import create_app

from tests.integration.server.conftest import RunningServer, api_settings, serve_app

TEMPLATE = Path(__file__).parent / "templates" / "think_hermes.jinja"
HI = [{"role": "user", "content": "Hi"}]
THOUGHT, ANSWER = "The user greets me.", "Hello there."
THINK_THEN_ANSWER = {"structured_outputs": {"regex": r"<think>\nThe user greets me\.\n</think>\n\nHello there\."}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def thinking(api_model: Path) -> Iterator[RunningServer]:
    with serve_app(create_app(api_settings(api_model, chat_template=str(TEMPLATE)))) as running:
        yield running


def _extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


def test_thinking_is_apart_from_the_answer(thinking: RunningServer) -> None:
    r = thinking.client().chat.completions.create(model="tiny", messages=HI, max_tokens=60,
                                                  extra_body=THINK_THEN_ANSWER)
    message = r.choices[0].message
    assert message.content == ANSWER and r.choices[0].finish_reason == "stop"
    assert _extra(message, "reasoning_content") == THOUGHT and _extra(message, "reasoning") == THOUGHT


def test_streamed_thinking_comes_first_under_both_names(thinking: RunningServer) -> None:
    stream = thinking.client().chat.completions.create(model="tiny", messages=HI, max_tokens=60, stream=True,
                                                       extra_body=THINK_THEN_ANSWER)
    kinds, thought, answer = [], "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        if _extra(delta, "reasoning_content"):
            assert _extra(delta, "reasoning") == _extra(delta, "reasoning_content")
            thought += _extra(delta, "reasoning_content")
            kinds.append("reasoning")
        if delta.content:
            answer += delta.content
            kinds.append("content")
    assert thought == THOUGHT and answer == ANSWER
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning") and "content" in kinds


def test_a_prompt_that_opens_the_block(thinking: RunningServer) -> None:
    """DeepSeek-R1 style: the template writes <think> into the generation prompt, the output has no open tag."""
    r = thinking.client().chat.completions.create(
        model="tiny", messages=HI, max_tokens=60,
        extra_body={"chat_template_kwargs": {"think_open": True},
                    "structured_outputs": {"regex": r"The user greets me\.\n</think>\n\nHello there\."}})
    message = r.choices[0].message
    assert message.content == ANSWER and _extra(message, "reasoning_content") == THOUGHT


def _rendered(server: RunningServer, **fields) -> str:
    r = httpx.post(f"{server.base}/tokenize", json={"model": "tiny", "messages": HI, **fields}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == server.engine.max_model_len
    return httpx.post(f"{server.base}/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()["prompt"]


def test_enable_thinking_false_reaches_the_template(thinking: RunningServer) -> None:
    plain, off = _rendered(thinking), _rendered(thinking, chat_template_kwargs={"enable_thinking": False})
    assert plain.endswith("<|im_start|>assistant\n") and off == plain + "<think>\n\n</think>\n\n"
    # the block the template closed leaves the whole output to the answer (no split after it)
    r = thinking.client().chat.completions.create(
        model="tiny", messages=HI, max_tokens=30,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "structured_outputs": {"regex": "Hi there"}})
    assert r.choices[0].message.content == "Hi there" and _extra(r.choices[0].message, "reasoning_content") is None
    assert r.usage.prompt_tokens == len(thinking.engine.tokenizer.encode(off))


def test_reasoning_content_in_the_history_reaches_the_template(thinking: RunningServer) -> None:
    history = [*HI, {"role": "assistant", "content": "Hello.", "reasoning_content": "Be nice."},
               {"role": "user", "content": "And?"}]
    assert "<think>\nBe nice.\n</think>\n\nHello." in _rendered(thinking, messages=history)
    renamed = [*HI, {"role": "assistant", "content": "Hello.", "reasoning": "Be nice."}, history[2]]
    assert _rendered(thinking, messages=renamed) == _rendered(thinking, messages=history)


PREFILL = "<think>\nThe user wants the weather: the tool tells it.\n</think>\n\n"


def _forced_call(server: RunningServer, stream: bool):
    """The thinking is the prefill (echoed, continued); the engine writes the forced call after it."""
    return server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"},
                                {"role": "assistant", "content": PREFILL}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80,
        stream=stream, extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True})


def test_a_tool_call_after_a_think_block_parses(thinking: RunningServer) -> None:
    r = _forced_call(thinking, stream=False)
    message = r.choices[0].message
    assert _extra(message, "reasoning_content") == "The user wants the weather: the tool tells it."
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert not (message.content or "").strip()

    thought, arguments, names = "", "", []
    for chunk in _forced_call(thinking, stream=True):
        delta = chunk.choices[0].delta
        thought += _extra(delta, "reasoning_content") or ""
        for part in delta.tool_calls or ():
            names += [part.function.name] if part.function.name else []
            arguments += part.function.arguments or ""
    assert thought == "The user wants the weather: the tool tells it." and names == ["get_weather"]
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_responses_reasoning_items(thinking: RunningServer) -> None:
    r = thinking.client().responses.create(model="tiny", input="Hi", max_output_tokens=60, extra_body=THINK_THEN_ANSWER)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT and r.output_text == ANSWER
    with thinking.client().responses.stream(model="tiny", input="Hi", max_output_tokens=60,
                                            extra_body=THINK_THEN_ANSWER) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == THOUGHT and events[-1].response.output[0].type == "reasoning"
    # sent back (Codex does, with encrypted_content), the thinking reaches the next turn's template
    turn2 = [{"role": "user", "content": "Hi"}, r.output[0].model_dump(exclude_none=True),
             {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And?"}]
    again = thinking.client().responses.create(model="tiny", input=turn2, max_output_tokens=2, temperature=0)
    rendered = _rendered(thinking, messages=[
        *HI, {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}, {"role": "user", "content": "And?"}])
    assert again.usage.input_tokens == len(thinking.engine.tokenizer.encode(rendered))


def test_messages_thinking_blocks(thinking: RunningServer) -> None:
    client = anthropic.Anthropic(base_url=thinking.base, api_key="unused", max_retries=0)
    m = client.messages.create(model="tiny", max_tokens=60, messages=HI, extra_body=THINK_THEN_ANSWER)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == THOUGHT and m.content[1].text == ANSWER and m.stop_reason == "end_turn"
    with client.messages.stream(model="tiny", max_tokens=60, messages=HI, extra_body=THINK_THEN_ANSWER) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and "text_delta" in kinds
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in final.content] == \
        [("thinking", THOUGHT, None), ("text", None, ANSWER)]
    # `thinking: disabled` tells the template to skip it
    off = client.messages.count_tokens(model="tiny", messages=HI, thinking={"type": "disabled"})
    on = client.messages.count_tokens(model="tiny", messages=HI)
    tokens = thinking.engine.tokenizer.encode
    assert off.input_tokens == len(tokens(_rendered(thinking, chat_template_kwargs={"enable_thinking": False})))
    assert on.input_tokens == len(tokens(_rendered(thinking)))
