"""The thinking split (server/reasoning.py) on strings: tags split across pieces, the three starts, streamed and
whole agreeing, tool calls read from the answer only; and the grammar that lets a forced answer think first."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.builder.tokenizer import synthetic_tokenizer
from server.reasoning import ReasoningDeltas, ReasoningFormat, ReasoningSplitter, reasoning_format
from server.reasoning import TextDeltas
from server.tools import grammar
from server.tools.formats import generic
from server.tools.grammar import Trigger
from server.tools.formats import make_format as make_parser
from server.tools.stream import ToolCallStream

llguidance = pytest.importorskip("llguidance")

OUTPUT = "<think>\nLet me see: <tool_call> is only a word here.\n</think>\n\nThe answer is 4."


def split(text: str, cuts: list[int], fmt: ReasoningFormat = ReasoningFormat()) -> tuple[str, str]:
    splitter, reasoning, answer, last = ReasoningSplitter(fmt), "", "", 0
    for cut in sorted(cuts) + [len(text)]:
        r, a = splitter.feed(text[last:cut])
        reasoning, answer, last = reasoning + r, answer + a, cut
    r, a = splitter.feed("", final=True)
    assert (reasoning + r, answer + a) == (splitter.reasoning, splitter.answer)
    return splitter.reasoning, splitter.answer


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(OUTPUT)), max_size=12))
def test_any_split_of_the_output_gives_the_same_parts(cuts: list[int]) -> None:
    assert split(OUTPUT, cuts) == ("Let me see: <tool_call> is only a word here.", "The answer is 4.")


@pytest.mark.parametrize("text,fmt,expected", [
    ("Hello", ReasoningFormat(), ("", "Hello")),
    ("  \n<think>a</think>b", ReasoningFormat(), ("a", "b")),
    ("Hi <think>a</think>", ReasoningFormat(), ("", "Hi <think>a</think>")),  # only a block at the start thinks
    ("<think>cut short by max_tokens", ReasoningFormat(), ("cut short by max_tokens", "")),
    ("a\n</think>\n\nb", ReasoningFormat(start="open"), ("a", "b")),
    ("<think>a</think>b", ReasoningFormat(start="closed"), ("", "<think>a</think>b")),
    ("<thi", ReasoningFormat(), ("", "<thi")),  # a tag that never completes is text in the end
    ("<think>a</think>b</think>c", ReasoningFormat(), ("a", "b</think>c")),
])
def test_splits(text: str, fmt: ReasoningFormat, expected: tuple[str, str]) -> None:
    assert split(text, [], fmt) == expected
    assert split(text, list(range(len(text))), fmt) == expected  # one character at a time


def test_partial_tags_are_held_back() -> None:
    s = ReasoningSplitter(ReasoningFormat())
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>Hmm </th") == ("Hmm", "")
    assert s.feed("ink>\n\n") == ("", "")
    assert s.feed("Hi") == ("", "Hi")


@pytest.mark.parametrize("prompt,start", [
    ("<|im_start|>assistant\n", "free"),
    ("<|im_start|>assistant\n<think>\n", "open"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "closed"),
    ("<think>old</think>past answer<|im_end|><|im_start|>assistant\n", "free"),
])
def test_the_prompt_says_where_the_output_starts(prompt: str, start: str) -> None:
    fmt = reasoning_format("{{ '<think>' }}", prompt)
    assert fmt is not None and fmt.start == start
    assert reasoning_format("{{ messages }}", "<|im_start|>assistant\n") is None  # a template that never thinks


def test_calls_are_read_from_the_answer_only() -> None:
    fake = '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>'
    real = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    text = f"<think>I could write {fake} but will not.</think>\n{real}"
    for step in (1, 7, len(text)):
        deltas = ReasoningDeltas(ReasoningFormat(), ToolCallStream(make_parser("hermes")))
        sent = [d for i in range(0, len(text), step) for d in deltas.feed(text[i:i + step])]
        sent += deltas.feed("", final=True)
        message = deltas.message()
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
        assert message["reasoning_content"] == message["reasoning"] == f"I could write {fake} but will not."
        thinking = "".join(d.get("reasoning_content", "") for d in sent)
        assert thinking == message["reasoning_content"] and deltas.has_calls
        arguments = "".join(c["function"].get("arguments", "") for d in sent for c in d.get("tool_calls", ()))
        assert json.loads(arguments) == {"city": "Oslo"}


def test_plain_text_under_a_thinking_template() -> None:
    deltas = ReasoningDeltas(ReasoningFormat(), TextDeltas())
    sent = deltas.feed("<think>x</think>") + deltas.feed("Hello") + deltas.feed("", final=True)
    assert sent == [{"reasoning_content": "x", "reasoning": "x"}, {"content": "Hello"}]
    assert deltas.message() == {"content": "Hello", "tool_calls": None, "reasoning_content": "x", "reasoning": "x"}


@pytest.fixture(scope="module")
def lltok():
    hf, _ = synthetic_tokenizer(512)
    return hf, llguidance.LLTokenizer(hf.to_str(), eos_token=2)


def _accepts(lltok, lark: str, text: str) -> bool:
    hf, tok = lltok
    err = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark), tok)
    assert not err, err
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    return matcher.consume_tokens(hf.encode(text).ids) and matcher.is_accepting()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
CALL = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}'


def test_a_forced_answer_may_think_first(lltok) -> None:
    forced = generic.generic_grammar([WEATHER], required=True, parallel=False)
    free = grammar.with_thinking(forced, Trigger("<think>"), Trigger("</think>"), starts_open=False)
    assert _accepts(lltok, free, CALL)
    assert _accepts(lltok, free, "<think>\nOslo, then.\n</think>\n\n" + CALL)
    assert not _accepts(lltok, free, "<think>never closed " + CALL)
    assert not _accepts(lltok, free, "Sure: " + CALL)
    opened = grammar.with_thinking(forced, Trigger("<think>"), Trigger("</think>"), starts_open=True)
    assert _accepts(lltok, opened, "Oslo, then.</think>\n" + CALL)
    assert not _accepts(lltok, opened, CALL)  # the prompt opened the block: it closes first
