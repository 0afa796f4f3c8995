"""The native tool path end to end: a synthetic model (random weights, no download) whose chat template renders
tools in the Hermes/Qwen style and whose tokenizer has <tool_call> tokens, served for real and driven with the
openai SDK. Random weights write no sensible text, so every property here holds by construction: a forced call
is enforced by the grammar; in `auto` a logit_bias on <tool_call> makes the model open a call, and from that
trigger on the lazy grammar makes it a valid one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from server.app import create_app
from tests.integration.server.conftest import RunningServer, api_settings, serve_app

# A Hermes/Qwen-style template written for this test: tools in the system turn, calls as <tool_call> blocks,
# tool results as <tool_response> in a user turn.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
You may call functions. Their signatures are in <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, answer with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}{% for tc in m.tool_calls %}<tool_call>
{"name": {{ tc.function.name | tojson }}, "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% if not loop.last %}
{% endif %}{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "roll", "parameters": {
        "type": "object", "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 100}},
        "required": ["sides"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    from engine.builder import SyntheticSpec, build_synthetic

    folder = build_synthetic(tmp_path_factory.mktemp("hermes") / "model", SyntheticSpec(
        max_length=1024, chat_template=HERMES_TEMPLATE, added_tokens=("<tool_call>", "</tool_call>")))
    with serve_app(create_app(api_settings(folder, served_model_name="hermes"))) as running:
        yield running


def _ask(server: RunningServer, **kwargs):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 200)  # the synthetic vocabulary spells JSON in short tokens
    kwargs.setdefault("parallel_tool_calls", False)
    return server.client().chat.completions.create(model="hermes", tools=TOOLS, **kwargs)


def _check(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_the_template_is_native_and_renders_tools_and_history(hermes: RunningServer) -> None:
    from server.tools.plan import ToolRequest, choose_format, plan_tools

    engine = hermes.engine
    assert engine.chat_template.supports_tools and choose_format(engine.chat_template) == "hermes"
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    plan = plan_tools(history, ToolRequest(tuple(TOOLS), "auto"), engine.chat_template, engine.tokenizer)
    prompt = engine.chat_template.render(plan.messages, tools=plan.template_tools)
    assert '"name": "roll"' in prompt  # the tools, through the template
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}' in prompt
    assert "<tool_response>\n-3 C\n</tool_response>" in prompt


@pytest.mark.parametrize("seed", range(4))
def test_required_is_a_valid_native_call(hermes: RunningServer, seed: int) -> None:
    r = _ask(hermes, tool_choice="required", temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check(choice.message.tool_calls)


def test_auto_lazy_trigger_enforces_the_call_once_the_tag_is_written(hermes: RunningServer) -> None:
    tag = hermes.engine.tokenizer.token_to_id("<tool_call>")
    for seed in range(3):
        # The bias makes <tool_call> the first token; nothing forces what follows except the lazy grammar.
        r = _ask(hermes, tool_choice="auto", temperature=1.0, seed=seed, logit_bias={str(tag): 100})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        _check(choice.message.tool_calls)


def test_auto_without_the_trigger_is_free_text(hermes: RunningServer) -> None:
    tag = hermes.engine.tokenizer.token_to_id("<tool_call>")
    for seed in range(2):
        # eos banned too: 24 tokens of text by construction (an early eos would prove nothing here)
        eos = hermes.engine.tokenizer.token_to_id("<|im_end|>")
        r = _ask(hermes, tool_choice="auto", temperature=1.0, seed=seed, max_tokens=24,
                 logit_bias={str(tag): -100, str(eos): -100})
        choice = r.choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason == "length"
        assert choice.message.content and "<tool_call>" not in choice.message.content


def test_streamed_native_calls_equal_the_whole_answer(hermes: RunningServer) -> None:
    kwargs = {"tool_choice": {"type": "function", "function": {"name": "roll"}}, "temperature": 0,
              "max_tokens": 200, "parallel_tool_calls": False}
    whole = _ask(hermes, **kwargs).choices[0].message
    with hermes.client().chat.completions.stream(model="hermes", messages=ASK, tools=TOOLS, **kwargs) as stream:
        chunks = [event for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.tool_calls] and whole.tool_calls[0].function.name == "roll"
    assert final.choices[0].finish_reason == "tool_calls"
    text = "".join(c.chunk.choices[0].delta.content or "" for c in chunks if c.chunk.choices)
    assert "<tool_call>" not in text and "</tool_call>" not in text and not text.strip()
