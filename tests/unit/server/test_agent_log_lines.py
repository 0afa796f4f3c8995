"""The log lines an operator (and tests/integration/agents) reads an agent's turns by: the calls parsed from the
model's output, the tool results the client sent back, and each request's prompt and cached tokens."""

from __future__ import annotations

import logging

import pytest

from server.http.prepare import _log_tool_results
from server.tools.formats import make_format
from server.tools.stream import ToolCallStream

CLAUDE_CODE_TOOLS = ("Agent", "Bash", "Edit", "Read", "Skill", "ToolSearch", "Write")
# Qwen2.5-Coder-1.5B-Instruct's answer to Claude Code's first request ("Read hello.py and tell me what it prints."):
# a call to Read, in its template's Hermes tags; the arguments as Claude Code received them (sampled at temperature 1).
QWEN_READ_CALL = ('<tool_call>\n{"name": "Read", "arguments": {"file_path": "/tmp/agents/cc2/scratch/hello.py", '
                  '"offset": 0}}\n</tool_call>')


def test_a_parsed_call_is_logged_once_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    stream = ToolCallStream(make_format("hermes", CLAUDE_CODE_TOOLS), tool_names=CLAUDE_CODE_TOOLS)
    with caplog.at_level(logging.INFO, logger="server.tools.stream"):
        for i in range(0, len(QWEN_READ_CALL), 7):
            stream.feed(QWEN_READ_CALL[i:i + 7])
        assert not caplog.records  # nothing while the output grows
        stream.feed("", final=True)
    [record] = [r for r in caplog.records if r.levelno == logging.INFO]
    assert record.getMessage() == ('tool calls parsed (hermes format): Read {"file_path": '
                                   '"/tmp/agents/cc2/scratch/hello.py", "offset": 0}')


def test_plain_text_logs_no_call(caplog: pytest.LogCaptureFixture) -> None:
    stream = ToolCallStream(make_format("hermes", CLAUDE_CODE_TOOLS), tool_names=CLAUDE_CODE_TOOLS)
    with caplog.at_level(logging.INFO, logger="server.tools.stream"):
        stream.feed("hello.py prints 168.", final=True)
    assert not caplog.records


def test_the_tool_results_that_end_the_conversation_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    messages = [
        {"role": "user", "content": "Read hello.py"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_1"}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "     1\tprint(6)\n"},
    ]
    with caplog.at_level(logging.INFO, logger="server.http.prepare"):
        _log_tool_results(messages)
        _log_tool_results(messages[:2])  # no result at the end: nothing
    assert [r.getMessage() for r in caplog.records] == ["tool results received: toolu_1 (16 chars)"]
