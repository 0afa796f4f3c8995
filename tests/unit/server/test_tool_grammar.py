"""Tool-call grammars, checked with llguidance itself on a real BPE tokenizer (no model): what each format
and tool_choice accepts and what it refuses, token by token as the engine would feed it."""

from __future__ import annotations

import json

import pytest

from engine.builder.tokenizer import synthetic_tokenizer
from engine.types import InvalidRequestError
from server.tools.formats import generic as generic_fmt
from server.tools.formats import hermes as hermes_fmt
from server.tools.formats import llama3 as llama3_fmt
from server.tools.formats import mistral as mistral_fmt
from server.tools.grammar import Trigger
from server.tools.plan import ToolRequest, choose_format, generic_instructions, plan_tools

llguidance = pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: no arguments
NESTED = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}}, "required": ["who"],
    "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
                         "additionalProperties": False}}}}}

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
T = '{"name": "get_time", "arguments": {"tz": "UTC"}}'


@pytest.fixture(scope="module")
def tokenizer():
    hf, _ = synthetic_tokenizer(512)
    hf.add_special_tokens(["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"])
    return hf


@pytest.fixture(scope="module")
def qwen_like():
    hf, _ = synthetic_tokenizer(512, added_tokens=("<tool_call>", "</tool_call>"))  # added, not special, as Qwen
    return hf, llguidance.LLTokenizer(hf.to_str(), eos_token=2)


@pytest.fixture(scope="module")
def lltok(tokenizer):
    return llguidance.LLTokenizer(tokenizer.to_str(), eos_token=2)


def accepts(lltok, tokenizer, lark: str, *pieces: str | int) -> bool:
    """Whether the grammar takes ``pieces`` (text, or a special token id) and may end there."""
    err = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark), lltok)
    assert not err, err
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    for piece in pieces:
        ids = [piece] if isinstance(piece, int) else tokenizer.encode(piece).ids
        if not matcher.consume_tokens(ids):
            return False
    return matcher.is_accepting()


def test_generic_required_is_a_valid_call_and_nothing_else(lltok, tokenizer) -> None:
    g = generic_fmt.generic_grammar([WEATHER, TIME], required=True, parallel=False)
    assert accepts(lltok, tokenizer, g, '{"tool_call": ' + W + "}")
    assert accepts(lltok, tokenizer, g, '{"tool_call": ' + T + "}")
    assert not accepts(lltok, tokenizer, g, '{"response": "hi"}')
    assert not accepts(lltok, tokenizer, g, '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}')
    assert not accepts(lltok, tokenizer, g, '{"tool_call": {"name": "nope", "arguments": {}}}')
    assert not accepts(lltok, tokenizer, g, '{"tool_calls": [' + W + "]}")
    assert not accepts(lltok, tokenizer, g, "Sure, " + W)


def test_generic_parallel_auto_and_named(lltok, tokenizer) -> None:
    parallel = generic_fmt.generic_grammar([WEATHER, TIME], required=True, parallel=True)
    assert accepts(lltok, tokenizer, parallel, '{"tool_calls": [' + W + ", " + T + "]}")
    assert not accepts(lltok, tokenizer, parallel, '{"tool_calls": []}')  # at least one call
    auto = generic_fmt.generic_grammar([WEATHER], required=False, parallel=False)
    assert accepts(lltok, tokenizer, auto, '{"response": "It is sunny."}')
    assert accepts(lltok, tokenizer, auto, '{"tool_call": ' + W + "}")
    assert not accepts(lltok, tokenizer, auto, "It is sunny.")
    named = plan_tools([{"role": "user", "content": "hi"}], ToolRequest((WEATHER, TIME), "function", "get_time"),
                       _Template(False), _NoSpecials()).structured
    assert named is not None and named.kind == "lark" and named.param == "tools"
    assert accepts(lltok, tokenizer, named.spec, '{"tool_call": ' + T + "}")
    assert not accepts(lltok, tokenizer, named.spec, '{"tool_call": ' + W + "}")


def test_generic_auto_answer_follows_a_response_schema_with_refs(lltok, tokenizer) -> None:
    """tools + response_format: an answer without a call is {"response": <the schema's value>}, refs resolved."""
    schema = {"$defs": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "type": "object", "properties": {"city": {"$ref": "#/$defs/city"}, "temp": {"type": "integer"}},
              "required": ["city", "temp"]}
    g = generic_fmt.generic_grammar([WEATHER], required=False, parallel=False, response=schema)
    assert accepts(lltok, tokenizer, g, '{"response": {"city": "Paris", "temp": 21}}')
    assert accepts(lltok, tokenizer, g, '{"tool_call": ' + W + "}")
    assert not accepts(lltok, tokenizer, g, '{"response": "It is sunny."}')  # text no longer fits
    assert not accepts(lltok, tokenizer, g, '{"response": {"city": "Oslo", "temp": 21}}')  # the ref's enum holds
    assert not accepts(lltok, tokenizer, g, '{"response": {"city": "Paris", "temp": 21, "x": 1}}')  # closed
    request = ToolRequest((WEATHER,), "auto", response_schema=schema)
    llama3 = _Template(True, "{{ '<|python_tag|>' }}")  # a Llama 3 call is bare JSON, like the answer
    with pytest.raises(InvalidRequestError) as info:
        plan_tools([{"role": "user", "content": "hi"}], request, llama3, _NoSpecials())
    assert info.value.param == "response_format"


def test_native_auto_with_a_response_schema_is_that_json_or_calls(lltok, tokenizer) -> None:
    """Hermes (text and special-token tags) and Mistral: the answer follows the schema or is calls; no free text."""
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"]}
    hermes = hermes_fmt.hermes_grammar([WEATHER], trigger=Trigger("<tool_call>"), close=Trigger("</tool_call>"),
                                    required=False, parallel=False, response=schema)
    assert accepts(lltok, tokenizer, hermes, '{"sunny": true}')
    assert accepts(lltok, tokenizer, hermes, f"<tool_call>\n{W}\n</tool_call>")
    assert not accepts(lltok, tokenizer, hermes, "It is sunny.")
    assert not accepts(lltok, tokenizer, hermes, '{"sunny": true, "x": 1}')
    tc = tokenizer.token_to_id("[TOOL_CALLS]")
    mistral = mistral_fmt.mistral_grammar([WEATHER], trigger=Trigger("[TOOL_CALLS]", tc), args_token=None,
                                      required=False, parallel=True, response=schema)
    assert accepts(lltok, tokenizer, mistral, '{"sunny": false}')
    assert accepts(lltok, tokenizer, mistral, tc, f"[{W}]")
    assert not accepts(lltok, tokenizer, mistral, "Plain answer.")
    planned = plan_tools([{"role": "user", "content": "hi"}], ToolRequest((WEATHER,), "auto", response_schema=schema),
                         _Template(True, "{{ '<tool_call>' }}"), _NoSpecials())
    assert planned.format == "hermes" and planned.structured is not None
    assert accepts(lltok, tokenizer, planned.structured.spec, '{"sunny": true}')


def test_no_parameters_means_empty_arguments_and_refs_resolve(lltok, tokenizer) -> None:
    g = generic_fmt.generic_grammar([PING, NESTED], required=True, parallel=False)
    assert accepts(lltok, tokenizer, g, '{"tool_call": {"name": "ping", "arguments": {}}}')
    assert not accepts(lltok, tokenizer, g, '{"tool_call": {"name": "ping", "arguments": {"x": 1}}}')
    assert accepts(lltok, tokenizer, g, '{"tool_call": {"name": "book", "arguments": {"who": {"name": "Ada"}}}}')
    assert not accepts(lltok, tokenizer, g, '{"tool_call": {"name": "book", "arguments": {"who": {"nom": "Ada"}}}}')


def test_hermes_auto_is_free_text_until_the_tag_then_a_call(lltok, tokenizer) -> None:
    g = hermes_fmt.hermes_grammar([WEATHER], trigger=Trigger("<tool_call>"), close=Trigger("</tool_call>"),
                               required=False, parallel=True)
    assert accepts(lltok, tokenizer, g, "Just text, with <b>tags</b> and {braces}.")
    assert accepts(lltok, tokenizer, g, "")
    assert accepts(lltok, tokenizer, g, f"Checking.\n<tool_call>\n{W}\n</tool_call>")
    assert accepts(lltok, tokenizer, g, f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{W}\n</tool_call>")
    assert not accepts(lltok, tokenizer, g, "Checking.\n<tool_call>\nnot json")  # enforced after the trigger
    assert not accepts(lltok, tokenizer, g, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(lltok, tokenizer, g, f"<tool_call>\n{W}\n</tool_call> and more text")


def test_hermes_required_single_call(lltok, tokenizer) -> None:
    g = hermes_fmt.hermes_grammar([WEATHER, TIME], trigger=Trigger("<tool_call>"), close=Trigger("</tool_call>"),
                               required=True, parallel=False)
    assert accepts(lltok, tokenizer, g, f"<tool_call>\n{T}\n</tool_call>")
    assert not accepts(lltok, tokenizer, g, "Hi")
    assert not accepts(lltok, tokenizer, g, f"<tool_call>\n{T}\n</tool_call>\n<tool_call>\n{W}\n</tool_call>")


def test_hermes_tags_as_added_tokens(qwen_like, tokenizer) -> None:
    """Qwen has <tool_call> as an added (not special) token; llguidance matches such tokens only by id."""
    from engine.tokenizer import Tokenizer

    assert Tokenizer(tokenizer).special_token_id("[TOOL_CALLS]") is not None
    tokenizer, lltok = qwen_like
    tc, end = tokenizer.token_to_id("<tool_call>"), tokenizer.token_to_id("</tool_call>")
    assert Tokenizer(tokenizer).special_token_id("<tool_call>") == tc and lltok.is_special_token(tc)
    assert Tokenizer(tokenizer).special_token_id("hello") is None
    g = hermes_fmt.hermes_grammar([WEATHER], trigger=Trigger("<tool_call>", tc), close=Trigger("</tool_call>", end),
                               required=False, parallel=False)
    assert accepts(lltok, tokenizer, g, "Sure. ", tc, f"\n{W}\n", end)
    assert accepts(lltok, tokenizer, g, "Plain <b>text</b>")
    assert not accepts(lltok, tokenizer, g, "Sure. ", tc, "\nnot json")
    assert not accepts(lltok, tokenizer, g, "Sure. ", tc, f"\n{W}\n", end, tc)  # one call only


def test_mistral_with_special_tokens(lltok, tokenizer) -> None:
    tc, args = tokenizer.token_to_id("[TOOL_CALLS]"), tokenizer.token_to_id("[ARGS]")
    v3 = mistral_fmt.mistral_grammar([WEATHER], trigger=Trigger("[TOOL_CALLS]", tc), args_token=None, required=False,
                                 parallel=True)
    assert accepts(lltok, tokenizer, v3, "Plain answer.")
    assert accepts(lltok, tokenizer, v3, "Let me see. ", tc, f"[{W}, {W}]")
    assert not accepts(lltok, tokenizer, v3, tc, '[{"name": "x"}]')
    v11 = mistral_fmt.mistral_grammar([WEATHER, TIME], trigger=Trigger("[TOOL_CALLS]", tc),
                                  args_token=Trigger("[ARGS]", args), required=True, parallel=True)
    assert accepts(lltok, tokenizer, v11, tc, "get_time", args, '{"tz": "UTC"}', tc, "get_weather", args,
                   '{"city": "Oslo", "unit": "fahrenheit"}')
    assert not accepts(lltok, tokenizer, v11, "text first")


def test_llama3_json(lltok, tokenizer) -> None:
    tag = tokenizer.token_to_id("<|python_tag|>")
    call = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
    auto = llama3_fmt.llama3_grammar([TIME], required=False, python_tag=Trigger("<|python_tag|>", tag))
    assert accepts(lltok, tokenizer, auto, "The time zone is unknown.")
    assert accepts(lltok, tokenizer, auto, call)
    assert accepts(lltok, tokenizer, auto, tag, call)
    assert not accepts(lltok, tokenizer, auto, '{"name": "get_time", "arguments": {"tz": "UTC"}}')
    required = llama3_fmt.llama3_grammar([TIME], required=True, python_tag=None)
    assert not accepts(lltok, tokenizer, required, "The time zone is unknown.")


class _Template:
    def __init__(self, supports: bool, source: str = "") -> None:
        self.supports_tools, self.tool_source = supports, source


class _NoSpecials:
    def special_token_id(self, token: str) -> int | None:
        return None


def test_choose_format_and_plans() -> None:
    assert choose_format(_Template(False, "<tool_call>")) == "generic"  # tools are not rendered: generic
    assert choose_format(_Template(True, "... <tool_call> ...")) == "hermes"
    assert choose_format(_Template(True, "[TOOL_CALLS] [ARGS]")) == "mistral"
    assert choose_format(_Template(True, "<|python_tag|>")) == "llama3_json"
    assert choose_format(_Template(True, "tools: {{ tools }}")) == "generic"
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
               {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]
    generic = plan_tools(history, ToolRequest((WEATHER,), "auto"), _Template(False), _NoSpecials())
    assert generic.format == "generic" and generic.template_tools is None and generic.parser == "generic"
    assert generic.messages[0]["role"] == "system" and "get_weather" in generic.messages[0]["content"]
    assert json.loads(generic.messages[2]["content"]) == {"tool_call": {"name": "get_weather",
                                                                        "arguments": {"city": "Paris"}}}
    assert generic.messages[3] == {"role": "user", "content": "get_weather returned: sunny\nget_weather returned: 22 C"}
    assert len(generic.messages) == 4  # the two tool results are one user message
    prose = plan_tools(history, ToolRequest((WEATHER,), "none"), _Template(False), _NoSpecials())
    assert prose.messages[1] == {"role": "assistant", "content": 'I called get_weather with {"city": "Paris"}.'}
    assert prose.structured is None and prose.parser is None and prose.messages[0] == history[0]  # no tool text
    native = plan_tools(history, ToolRequest((WEATHER,), "none"), _Template(True, "<tool_call>"), _NoSpecials())
    assert native.format == "hermes" and native.structured is None and native.parser is None
    assert native.template_tools == [WEATHER]
    assert native.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object
    assert native.messages[2] == history[2]
    single = plan_tools(history[:1], ToolRequest((WEATHER,), "required", parallel=False), _Template(True, "<tool_call>"),
                        _NoSpecials())
    assert single.max_calls == 1 and single.preserved_tokens == ("<tool_call>", "</tool_call>")
    assert "Call a tool" in generic_instructions(ToolRequest((WEATHER,), "required"))


def test_the_template_sees_each_tools_name_description_and_parameters_only() -> None:
    """`strict` (Codex sends `strict: false` on every Responses tool) and fields of other APIs are for the server,
    not the model: the template's tools hold name, description and parameters (as llama.cpp renders them)."""
    sent = {"type": "function", "function": {**WEATHER["function"], "strict": False, "defer_loading": False}}
    bare = {"type": "function", "function": {"name": "ping", "strict": True}}
    for choice in ("auto", "none"):
        planned = plan_tools([{"role": "user", "content": "hi"}], ToolRequest((sent, bare), choice),
                             _Template(True, "<tool_call>"), _NoSpecials())
        assert planned.template_tools == [WEATHER, {"type": "function", "function": {"name": "ping"}}], choice
    assert sent["function"]["strict"] is False  # the request's own tools are left as they came


def test_arguments_without_an_additional_properties_rule_take_no_invented_keys(lltok, tokenizer) -> None:
    # TIME's parameters say nothing of other keys: generation treats them as closed (engine.json_schema).
    g = generic_fmt.generic_grammar([TIME], required=True, parallel=False)
    assert accepts(lltok, tokenizer, g, '{"tool_call": ' + T + "}")
    assert not accepts(lltok, tokenizer, g, '{"tool_call": {"name": "get_time", "arguments": {"tz": "UTC", "x": 1}}}')


def test_parallel_calls_default_to_the_format(lltok, tokenizer) -> None:
    """Unsaid, the generic format allows one call (llama.cpp's default) and native formats several (OpenAI's)."""
    ask = [{"role": "user", "content": "weather?"}]
    unsaid = plan_tools(ask, ToolRequest((WEATHER, TIME), "required"), _Template(False), _NoSpecials())
    assert unsaid.max_calls == 1
    assert accepts(lltok, tokenizer, unsaid.structured.spec, '{"tool_call": ' + W + "}")
    assert not accepts(lltok, tokenizer, unsaid.structured.spec, '{"tool_calls": [' + W + ", " + T + "]}")
    asked = plan_tools(ask, ToolRequest((WEATHER, TIME), "required", parallel=True), _Template(False), _NoSpecials())
    assert asked.max_calls is None
    assert accepts(lltok, tokenizer, asked.structured.spec, '{"tool_calls": [' + W + ", " + T + "]}")
    native = plan_tools(ask, ToolRequest((WEATHER, TIME), "required"), _Template(True, "<tool_call>"), _NoSpecials())
    assert native.max_calls is None


@pytest.mark.parametrize("special", [False, True])
def test_hermes_auto_enforces_a_call_opened_without_markers(qwen_like, special: bool) -> None:
    """Issue 34: Qwen2.5-Coder writes ```json {"name": ...} ``` or the bare object under auto; once ``{"name"``
    appears, the lazy grammar keeps the call valid against the tool's schema (and the text after it is free)."""
    tokenizer, lltok = qwen_like
    tc, end = tokenizer.token_to_id("<tool_call>"), tokenizer.token_to_id("</tool_call>")
    g = hermes_fmt.hermes_grammar([WEATHER, TIME], trigger=Trigger("<tool_call>", tc if special else None),
                                  close=Trigger("</tool_call>", end if special else None), required=False,
                                  parallel=True)
    assert accepts(lltok, tokenizer, g, f"```json\n{W}\n```")
    assert accepts(lltok, tokenizer, g, W)
    assert accepts(lltok, tokenizer, g, '```json\n{\n  "name": "get_time",\n  "parameters": {"tz": "UTC"}\n}\n```')
    assert accepts(lltok, tokenizer, g, 'Text with {"other": 1} and {braces}.')
    assert not accepts(lltok, tokenizer, g, '```json\n{"name": "get_weather", "arguments": {"town": "Paris"}}')
    assert not accepts(lltok, tokenizer, g, '{"name": "delete_all", "arguments": {}}')


@pytest.mark.parametrize("required", [False, True])
def test_whitespace_after_the_last_call_then_the_end(lltok, tokenizer, required: bool) -> None:
    """Issue 34: after ``</tool_call>`` Qwen writes ``\\n`` and then its end token; the grammar for several calls
    took that newline for the start of another call, so the model could only write more calls."""
    g = hermes_fmt.hermes_grammar([WEATHER, TIME], trigger=Trigger("<tool_call>"), close=Trigger("</tool_call>"),
                                  required=required, parallel=True)
    assert accepts(lltok, tokenizer, g, f"<tool_call>\n{W}\n</tool_call>\n")
    assert accepts(lltok, tokenizer, g, f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>\n\n")
    assert not accepts(lltok, tokenizer, g, f"<tool_call>\n{W}\n</tool_call>\n\n\n\n\n\n")  # bounded


def _text_trigger(text: str) -> Trigger:
    return Trigger(text)


@pytest.mark.parametrize("required", [False, True])
def test_new_formats_grammars_take_their_calls(lltok, tokenizer, required: bool) -> None:
    """Qwen3-Coder XML, Phi-4-mini and DeepSeek R1: each format's grammar takes its own call, and refuses a
    call to a tool that was not offered."""
    from server.tools.formats import make_format

    outputs = {
        "qwen3_coder": ("<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n"
                        "</tool_call>", "<tool_call>\n<function=rm>\n</function>\n</tool_call>"),
        "phi4_mini": (f"<|tool_call|>[{T}]<|/tool_call|>", '<|tool_call|>[{"name": "rm", "arguments": {}}]<|/tool_call|>'),
        "deepseek_r1": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
                        '{"tz": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>rm\n```json\n{}\n```"
                        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    }
    for name, (good, bad) in outputs.items():
        g = make_format(name).grammar([WEATHER, TIME], required=required, parallel=True, trigger=_text_trigger)
        assert accepts(lltok, tokenizer, g, good), name
        assert accepts(lltok, tokenizer, g, good + "\n"), name
        assert not accepts(lltok, tokenizer, g, bad), name
        assert accepts(lltok, tokenizer, g, "Plain text.") != required, name


def test_format_from_template_and_override() -> None:
    from server.tools.formats import choose_format

    qwen3_coder = "<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>"
    assert choose_format(_Template(True, qwen3_coder)) == "qwen3_coder"
    assert choose_format(_Template(True, "<｜tool▁calls▁begin｜> <tool_call>")) == "deepseek_r1"
    assert choose_format(_Template(True, "<|tool|>{{ tools }}<|/tool|>")) == "phi4_mini"
    assert choose_format(_Template(True, "<|start_header_id|>ipython<|end_header_id|>")) == "llama3_json"
    assert choose_format(_Template(True, "<tool_call>"), override="mistral") == "mistral"
    assert choose_format(_Template(False, ""), override="hermes") == "hermes"
    with pytest.raises(KeyError, match="known"):
        choose_format(_Template(True, "<tool_call>"), override="nope")
