"""Tool-call parsers on strings: every format, whole and streamed in any split, markup never in content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tools.json_scan import partial_string, scan_object, value_end
from server.tools.formats import FORMATS as PARSERS
from server.tools.formats import make_format as make_parser
from server.tools.formats.calls import ParsedCall, hold_back
from server.tools.stream import ToolCallStream, new_call_id

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

# (format, output, expected content, expected [(name, arguments)])
CASES = [
    # Hermes / Qwen
    ("hermes", "Hello there.", "Hello there.", []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "days": 3}')]),
    ("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
     "Let me check.", [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    ("hermes", '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', None, [("ping", "{}")]),
    ("hermes", '<tool_call>{"name": "ping"}</tool_call>', None, [("ping", "{}")]),  # no arguments at all
    ("hermes", "Use <tool_call> tags? No.", "Use <tool_call> tags? No.", []),  # a tag in text: content at the end
    ("hermes", "<tool_call>\nnot json\n</tool_call> ok", "<tool_call>\nnot json\n</tool_call> ok", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None,
     [("f", '{"a": 1}')]),  # arguments written as a JSON string
    # Llama 3.x JSON
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", '{"city": "Oslo"}')]),
    ("llama3_json", '{"type": "function", "name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
     None, [("f", '{"x": 1}'), ("g", "{}")]),
    ("llama3_json", "The answer is 42.", "The answer is 42.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call is content
    # Mistral
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', None,
     [("get_weather", '{"city": "Rome"}')]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": [1, 2]}}]',
     "Sure.", [("a", "{}"), ("b", '{"k": [1, 2]}')]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[CALL_ID]abc123XYZ[ARGS]{}',
     None, [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]),
    ("mistral", "No tools needed.", "No tools needed.", []),
    # generic (ortserve's JSON format for models without native tool calls)
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Lima"}}]}', None,
     [("get_weather", '{"city": "Lima"}')]),
    ("generic", '{"tool_call": {"name": "get_time", "arguments": {"tz": "UTC"}}}', None,
     [("get_time", '{"tz": "UTC"}')]),
    ("generic", '{"tool_calls": [{"arguments": {"a": 1}, "name": "f"}, {"name": "g", "arguments": {}}]}', None,
     [("f", '{"a": 1}'), ("g", "{}")]),  # arguments before the name
    ("generic", '{"response": "Paris is the capital.\\nIt has \\u00e9 and \\ud83d\\ude00."}',
     "Paris is the capital.\nIt has é and 😀.", []),
    ("generic", "plain text (no grammar)", "plain text (no grammar)", []),
    # Qwen3-Coder XML
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>", None, [("get_weather", '{"city": "Paris", "days": 3}')]),
    ("qwen3_coder", "Checking.\n<tool_call>\n<function=get_time>\n<parameter=tz>\nEurope/Paris\n</parameter>\n"
     "</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>", "Checking.",
     [("get_time", '{"tz": "Europe/Paris"}'), ("ping", "{}")]),
    ("qwen3_coder", "No call.", "No call.", []),
    # Phi-4-mini
    ("phi4_mini", f'<|tool_call|>[{WEATHER}, {TIME}]<|/tool_call|>', None,
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    ("phi4_mini", "Just text.", "Just text.", []),
    # DeepSeek R1
    ("deepseek_r1", "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Let me look.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
]


def _calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []]


def _streamed(fmt: str, text: str, cuts: list[int]) -> tuple[ToolCallStream, list[dict]]:
    stream = ToolCallStream(make_parser(fmt))
    deltas: list[dict] = []
    last = 0
    for cut in sorted(set(cuts)):
        deltas += stream.feed(text[last:cut])
        last = cut
    deltas += stream.feed(text[last:], final=True)
    return stream, deltas


def _reassemble(deltas: list[dict]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """As the openai SDK's stream helper does: concatenate content, merge tool calls by index."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"name": "", "arguments": "", "ids": []})
            if "id" in tc:
                entry["ids"].append(tc["id"])
                entry["name"] = tc["function"]["name"]
            entry["arguments"] += tc["function"].get("arguments", "")
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], list(calls.values())


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_output(fmt: str, text: str, content: str | None, calls: list) -> None:
    stream, _ = _streamed(fmt, text, [])
    message = stream.message()
    assert message["content"] == content
    assert _calls(message) == calls
    for _, arguments in calls:
        json.loads(arguments)  # valid JSON text, as the wire requires


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_streamed_one_character_at_a_time_equals_whole(fmt: str, text: str, content: str | None, calls: list) -> None:
    stream, deltas = _streamed(fmt, text, list(range(1, len(text))))
    got_content, got_calls, entries = _reassemble(deltas)
    assert got_content == (content or "")
    assert got_calls == calls
    for entry in entries:  # exactly one header (id, name) per call
        assert len(entry["ids"]) == 1 and entry["ids"][0].startswith("call_")
    assert stream.message()["content"] == content


@pytest.mark.parametrize("fmt,text,content,calls", [c for c in CASES if c[3]])
@given(data=st.data())
@settings(max_examples=25, deadline=None)
def test_streamed_in_random_pieces_equals_whole(fmt: str, text: str, content: str | None, calls: list,
                                                data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=12))
    _, deltas = _streamed(fmt, text, cuts)
    got_content, got_calls, _ = _reassemble(deltas)
    assert (got_content, got_calls) == (content or "", calls)


@pytest.mark.parametrize("fmt,marker", [("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]"),
                                        ("llama3_json", "<|python_tag|>")])
def test_markup_split_across_deltas_never_reaches_content(fmt: str, marker: str) -> None:
    body = WEATHER if fmt != "llama3_json" else '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    if fmt == "mistral":
        body = f"[{body}]"
    prefix = "" if fmt == "llama3_json" else "Checking. "
    text = prefix + marker + ("\n" if fmt == "hermes" else "") + body + ("\n</tool_call>" if fmt == "hermes" else "")
    for cut in range(len(prefix), len(prefix) + len(marker) + 1):
        stream = ToolCallStream(make_parser(fmt))
        deltas = stream.feed(text[:cut]) + stream.feed(text[cut:cut + 3]) + stream.feed(text[cut + 3:], final=True)
        content = "".join(d.get("content", "") for d in deltas)
        assert content == prefix.rstrip(), (cut, deltas)
        assert _reassemble(deltas)[1][0][0] == "get_weather"


def test_arguments_stream_in_fragments_and_name_comes_first() -> None:
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    stream = ToolCallStream(make_parser("hermes"))
    deltas = []
    for i in range(len(text)):
        deltas += stream.feed(text[i])
    deltas += stream.feed("", final=True)
    calls = [d["tool_calls"][0] for d in deltas]
    assert all("content" not in d for d in deltas)
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["type"] == "function"
    fragments = [c["function"]["arguments"] for c in calls[1:]]
    assert len(fragments) > 5 and all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert "".join(fragments) == '{"city": "Paris", "days": 3}'


def test_number_at_the_end_is_not_complete_until_final() -> None:
    parser = make_parser("generic")
    partial = parser.parse('{"tool_call": {"name": "f", "arguments": {"n": 12', final=False)
    assert partial.calls == (ParsedCall("f", '{"n": 12', False),)
    assert value_end("12", 0, final=False) is None and value_end("12", 0, final=True) == 2


def test_cut_by_max_tokens_keeps_the_partial_call() -> None:
    text = '{"tool_calls": [{"name": "f", "arguments": {"city": "Par'
    stream, deltas = _streamed("generic", text, [10, 30, 45])
    message = stream.message()
    assert _calls(message) == [("f", '{"city": "Par')] and message["content"] is None
    assert _reassemble(deltas)[1] == [("f", '{"city": "Par')]


def test_max_calls_keeps_the_first_only() -> None:
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    stream = ToolCallStream(make_parser("hermes"), max_calls=1)
    stream.feed(text, final=True)
    assert [c["function"]["name"] for c in stream.message()["tool_calls"]] == ["get_weather"]


def test_generic_response_streams_decoded_text() -> None:
    text = '{"response": "caf\\u00e9 \\"quoted\\" \\ud83d\\ude00 end"}'
    _, deltas = _streamed("generic", text, list(range(1, len(text))))
    pieces = [d["content"] for d in deltas]
    assert "".join(pieces) == 'café "quoted" 😀 end'
    assert all("\\" not in p and "\ufffd" not in p for p in pieces)
    for p in pieces:
        p.encode("utf-8")  # never half a surrogate pair


def test_partial_string_and_object_scan() -> None:
    assert partial_string('"ab') == "ab"
    assert partial_string('"ab\\') == "ab"
    assert partial_string('"ab\\u00') == "ab"
    assert partial_string('"ab\\ud83d') == "ab"
    assert partial_string('"ab\\ud83d\\ude00') == "ab😀"
    assert partial_string("12") is None
    scan = scan_object('{"a": [1, 2], "b": {"c"', 0)
    assert [m.key for m in scan.members] == ["a", "b"] and scan.members[1].end is None and scan.end is None
    assert scan_object("{} ", 0).end == 2
    assert scan_object('{"a" 1}', 0).invalid


def test_hold_back() -> None:
    assert hold_back("Hi <tool", "<tool_call>") == "Hi "
    assert hold_back("Hi <", "<tool_call>") == "Hi "
    assert hold_back("Hi <b>", "<tool_call>") == "Hi <b>"
    assert hold_back("a [TOOL", "[TOOL_CALLS]", "<tool_call>") == "a "


def test_registry_and_ids() -> None:
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "generic", "qwen3_coder", "phi4_mini", "deepseek_r1"}
    with pytest.raises(KeyError, match="known"):
        make_parser("nope")
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 29 and i.startswith("call_") and i[5:].isalnum() for i in ids)
