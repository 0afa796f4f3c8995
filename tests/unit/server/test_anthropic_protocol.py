"""The Messages API wire format (server/anthropic/protocol.py, server/anthropic/events.py) without a model: the
conversion to a chat request, the errors it names, and the events and message one answer becomes."""

from __future__ import annotations

import json
import logging

import pytest

from engine.types import InvalidRequestError, PromptTooLongError
from server.anthropic.events import MessageAssembler
from server.anthropic.protocol import MessagesRequest, error_body, from_openai_error, stop_reason

TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 16,
                                           "messages": [{"role": "user", "content": "Hi"}], **fields})


def chat(**fields):
    return request(**fields).to_chat()


def test_system_blocks_and_turns_become_chat_messages() -> None:
    c = chat(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
             messages=[{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                       {"role": "user", "content": "three"},  # consecutive turns of a role merge
                       {"role": "assistant", "content": "ok"},
                       {"role": "user", "content": "four"},
                       {"role": "system", "content": "late"}])  # a later system message joins the user turn
    assert c.template_messages() == [
        {"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "one\n\ntwo\n\nthree"},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "four\n\nlate"}]
    assert c.max_completion_tokens == 16 and c.add_generation_prompt and not c.continue_final_message


def test_leading_system_messages_join_the_system_prompt() -> None:
    c = chat(system="A", messages=[{"role": "system", "content": "B"}, {"role": "user", "content": "Hi"}])
    assert c.template_messages() == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "Hi"}]


def test_tool_use_and_tool_result_blocks() -> None:
    c = chat(tools=[TOOL], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "boom"}]},
                                     {"type": "text", "text": "Thanks"}]}])
    assert c.template_messages() == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": "Thanks"}]
    assert c.tools[0].function.parameters == TOOL["input_schema"]


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, ("auto", None)), ({"type": "any"}, ("required", None)), ({"type": "none"}, ("none", None)),
    ({"type": "tool", "name": "get_weather"}, ("function", "get_weather")),
])
def test_tool_choice(choice: dict, expected: tuple) -> None:
    tools = chat(tools=[TOOL], tool_choice=choice).tool_request()
    assert (tools.choice, tools.function) == expected and tools.parallel is None
    one = chat(tools=[TOOL], tool_choice={**choice, "disable_parallel_tool_use": True})
    assert one.tool_request().parallel is False


def test_a_final_assistant_message_is_a_prefill() -> None:
    c = chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello,"}])
    assert c.continue_final_message and not c.add_generation_prompt
    empty = chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": []}])
    assert empty.add_generation_prompt and [m["role"] for m in empty.template_messages()] == ["user"]


def test_what_does_not_apply_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="server.anthropic.protocol"):
        c = chat(tools=[TOOL, {"type": "web_search_20250305", "name": "web_search"},
                        {"type": "bash_20250124", "name": "bash"}],
                 messages=[{"role": "user", "content": [{"type": "image", "source": {}}, {"type": "text", "text": "x"},
                                                        {"type": "future_block", "x": 1}]}],
                 thinking={"type": "adaptive", "display": "omitted"}, metadata={"user_id": "u"},
                 context_management={"edits": []}, output_config={"effort": "high"}, service_tier="auto")
    assert [t.function.name for t in c.tools] == ["get_weather"] and c.reasoning_effort == "high"
    assert c.template_messages() == [{"role": "user", "content": "x"}]
    assert "'image'" in caplog.text and "'future_block'" in caplog.text and "web_search" in caplog.text
    with pytest.raises(InvalidRequestError) as info:
        chat(tools=[TOOL, {"type": "bash_20250124", "name": "bash"}], tool_choice={"type": "tool", "name": "bash"})
    assert info.value.param == "tool_choice.name"


def test_thinking_disabled_and_output_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = chat(thinking={"type": "disabled"}, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert c.chat_template_kwargs == {"enable_thinking": False}
    assert c.structured_output().kind == "json_schema" and json.loads(c.structured_output().spec) == schema


@pytest.mark.parametrize("fields,param", [
    ({"messages": []}, "messages"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x "}]}, "messages"),
    ({"tool_choice": {"type": "tool"}, "tools": [TOOL]}, "tool_choice.name"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools[0].function.name"),
    ({"stop_sequences": ["x"], "temperature": 3}, "temperature"),
    ({"output_config": {"format": {"type": "yaml"}}}, "output_config.format"),
])
def test_errors_name_the_messages_field(fields: dict, param: str) -> None:
    with pytest.raises((InvalidRequestError, ValueError)) as info:
        request(**fields).to_chat().to_sampling_params(16, 2048)
    error = info.value
    cause = error if isinstance(error, InvalidRequestError) else error.errors()[0]["ctx"]["error"]
    assert cause.param is None or cause.param.startswith(param.split(".")[0]), (cause.param, param)


def test_error_shapes() -> None:
    assert error_body(429, "slow down") == {"type": "error", "error": {"type": "rate_limit_error",
                                                                        "message": "slow down"}}
    assert error_body(404, "x")["error"]["type"] == "not_found_error"
    assert error_body(500, "x")["error"]["type"] == "api_error"
    exc = PromptTooLongError(9000, 8192)
    body = from_openai_error(400, {"error": {"message": str(exc), "code": "context_length_exceeded"}}, exc)
    assert body["error"]["message"].startswith("prompt is too long: 9000 tokens > 8192 maximum")


def test_stop_reasons() -> None:
    assert stop_reason("length", None, True) == "max_tokens"
    assert stop_reason("stop", "END", False) == "stop_sequence"
    assert stop_reason("stop", None, True) == "tool_use"
    assert stop_reason("stop", None, False) == "end_turn"


def test_the_assembler_builds_blocks_and_events_in_order() -> None:
    asm = MessageAssembler("msg_1", "m")
    usage = {"input_tokens": 3, "output_tokens": 0, "cache_read_input_tokens": 2, "cache_creation_input_tokens": 0}
    events = asm.start(usage)
    for delta in ({"reasoning_content": "Hmm"}, {"reasoning_content": "."}, {"content": "\n"}, {"content": "Let me"},
                  {"content": " check."}, {"content": "\n"},
                  {"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                                   "function": {"name": "get_weather", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}):
        events += asm.feed(delta)
    events += asm.finish("stop", None, {**usage, "output_tokens": 9})
    assert [e["type"] for e in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "thinking_delta", "text_delta", "text_delta", "text_delta", "input_json_delta",
        "input_json_delta"]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert asm.message()["content"] == [
        {"type": "thinking", "thinking": "Hmm.", "signature": ""}, {"type": "text", "text": "\nLet me check.\n"},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Oslo"}}]
    assert asm.message()["usage"]["output_tokens"] == 9


def test_an_empty_answer_still_has_its_text_block() -> None:
    asm = MessageAssembler("msg_1", "m")
    asm.start({})
    events = asm.feed({"content": "  "}) + asm.finish("length", None, {})
    assert asm.message()["content"] == [{"type": "text", "text": "  "}] and asm.message()["stop_reason"] == "max_tokens"
    assert [e["type"] for e in events][:3] == ["content_block_start", "content_block_delta", "content_block_stop"]


def test_claude_codes_billing_header_is_not_part_of_the_system_prompt() -> None:
    c = chat(system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.425; cc_entrypoint=cli;"},
                     {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
                     {"type": "text", "text": "\nBe brief."}])
    assert c.template_messages()[0] == {"role": "system", "content": "You are a Claude agent.\n\n\nBe brief."}
    mentioned = chat(system="See the x-anthropic-billing-header: it is a header.")  # not at the start: kept
    assert mentioned.template_messages()[0]["content"].startswith("See the")


def test_a_deferred_tool_is_not_shown_to_the_model_unless_forced() -> None:
    deferred = {"name": "DeferredToolPlaceholder", "description": "never call this tool", "defer_loading": True,
                "input_schema": {"type": "object", "properties": {}}}
    assert [t.function.name for t in chat(tools=[TOOL, deferred]).tools] == ["get_weather"]
    forced = chat(tools=[TOOL, deferred], tool_choice={"type": "tool", "name": "DeferredToolPlaceholder"})
    assert [t.function.name for t in forced.tools] == ["get_weather", "DeferredToolPlaceholder"]
    assert chat(tools=[deferred]).tools is None or not chat(tools=[deferred]).tools
