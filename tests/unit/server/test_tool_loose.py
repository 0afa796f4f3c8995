"""Tool calls that real models write without their format's markers (issue 34): fenced and bare JSON under auto.

The outputs are Qwen2.5-Coder-1.5B-Instruct's own (Q4_K_M, through its Hermes template, temperature 0 and
0.7), and the shapes llama.cpp's chat parsers accept; each is read whole and streamed in every split.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tools.formats import make_format
from server.tools.stream import ToolCallStream

TOOLS = ("get_weather", "read_file", "list_files")
W_ARGS = '{"location": "Paris, France", "unit": "celsius"}'
W = f'{{"name": "get_weather", "arguments": {W_ARGS}}}'
R = '{"name": "read_file", "arguments": {"path": "hello.py"}}'

# (output, expected content, expected [(name, arguments)])
REAL = [
    # Qwen2.5-Coder's fenced form
    (f"```json\n{W}\n```", None, [("get_weather", W_ARGS)]),
    # ... and its bare form (llama.cpp's greedy path)
    (W, None, [("get_weather", W_ARGS)]),
    # indented, "parameters", and a sentence first
    ('I will check the weather.\n\n```json\n{\n  "name": "get_weather",\n  "parameters": {\n    "location": "Tokyo"\n  }\n}\n```',
     "I will check the weather.", [("get_weather", '{\n    "location": "Tokyo"\n  }')]),
    # an array of calls (parallel)
    (f"[{W}, {R}]", None, [("get_weather", W_ARGS), ("read_file", '{"path": "hello.py"}')]),
    # two fenced blocks
    (f"```json\n{W}\n```\n\n```json\n{R}\n```", None, [("get_weather", W_ARGS), ("read_file", '{"path": "hello.py"}')]),
    # a fenced xml block holding Hermes tags
    (f"```xml\n<tool_call>\n{R}\n</tool_call>\n```", None, [("read_file", '{"path": "hello.py"}')]),
    (f"```tool_call\n{R}\n```", None, [("read_file", '{"path": "hello.py"}')]),
    # text after the call stays content
    (f"```json\n{R}\n```\nThis reads the file.", "This reads the file.", [("read_file", '{"path": "hello.py"}')]),
    # Hermes's tags (the native format of Qwen; other families write them too)
    (f"<tool_call>\n{W}\n</tool_call>", None, [("get_weather", W_ARGS)]),
    # the doubled braces of its template's example call, as Qwen2.5-Coder writes them after a tool result (the
    # wrapper's last brace is often missing), and closed
    ('{{"name": "get_weather", "arguments": {"location": "Paris, France"}}', None,
     [("get_weather", '{"location": "Paris, France"}')]),
    (f"{{{W}}}", None, [("get_weather", W_ARGS)]),
]

NOT_CALLS = [
    "I can use get_weather to look that up. Which city?",           # names a tool: text
    '```json\n{"name": "Paris", "population": 2100000}\n```',          # JSON, not a call
    '{"name": "delete_everything", "arguments": {}}',                  # not an offered tool
    '{"name": "get_weather"}',                                          # no arguments: a mention
    "```python\ndef f():\n    return {\"name\": 1}\n```",              # code
    "Use [1, 2] and {a: b} here.",
    "The answer is `x` and ``y``.",
    '{ {"a": 1} }',                                                      # nested JSON, not a call
]


def _calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []]


def _stream(text: str, cuts: list[int], fmt: str = "hermes") -> tuple[ToolCallStream, list[dict]]:
    stream = ToolCallStream(make_format(fmt, TOOLS), tool_names=TOOLS)
    deltas, last = [], 0
    for cut in sorted(set(cuts)):
        deltas += stream.feed(text[last:cut])
        last = cut
    deltas += stream.feed(text[last:], final=True)
    return stream, deltas


def _reassemble(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            entry = calls.setdefault(tc["index"], ["", ""])
            entry[0] += tc["function"].get("name", "")
            entry[1] += tc["function"].get("arguments", "")
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize(("text", "content", "calls"), REAL)
@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_real_outputs_become_calls(fmt: str, text: str, content: str | None, calls: list) -> None:
    whole = make_format(fmt, TOOLS).parse(text, final=True)
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    assert whole.content == (content or "")
    stream, deltas = _stream(text, list(range(len(text))), fmt)  # one character at a time
    got_content, got_calls = _reassemble(deltas)
    assert got_calls == calls and _calls(stream.message()) == calls
    assert got_content == (content or "") and stream.message()["content"] == content
    assert "```" not in got_content and "{" not in got_content


@pytest.mark.parametrize("text", NOT_CALLS)
def test_text_that_is_not_a_call_stays_text(text: str) -> None:
    assert make_format("hermes", TOOLS).parse(text, final=True).calls == ()
    stream, deltas = _stream(text, list(range(len(text))))
    assert _reassemble(deltas) == (text, [])
    assert stream.message() == {"content": text, "tool_calls": None}


def test_a_possible_call_is_held_back_then_released() -> None:
    fmt = make_format("hermes", TOOLS)
    assert fmt.parse("Sure.\n```js", final=False).content == "Sure."        # maybe ```json
    assert fmt.parse("Sure.\n```jsx\n", final=False).content == "Sure.\n```jsx"  # not a call language
    assert fmt.parse('Sure. {"name": "get_wea', final=False).content == "Sure."
    assert fmt.parse('Sure. {"name": "gex', final=False).content == 'Sure. {"name": "gex'  # no tool starts so
    assert fmt.parse('{"name": "get_weather", "arguments": {"loc', final=False).calls[0].name == "get_weather"


def test_without_tool_names_nothing_loose_is_a_call() -> None:
    assert make_format("hermes").parse(W, final=True).calls == ()


@settings(max_examples=60, deadline=None)
@given(index=st.integers(0, len(REAL) - 1), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_any_split_streams_the_whole_answer(index: int, cuts: list[int]) -> None:
    text, content, calls = REAL[index]
    _, deltas = _stream(text, [c for c in cuts if c <= len(text)])
    assert _reassemble(deltas) == (content or "", calls)
