"""The Responses API's wire side without a model: request -> chat request, the item/event assembler, the store."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from engine.types import InvalidRequestError
from server.responses.protocol import (COMPACTION_INTRO, COMPACTION_PREFIX, ResponsesRequest, TextConfig, chat_messages,
                                       parse_items, responses_param)
from server.responses.events import ResponseAssembler

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def invalid(**fields) -> InvalidRequestError:
    """The 400 that validating the request raises (pydantic carries it as the cause of its error)."""
    with pytest.raises(ValidationError) as info:
        request(**fields)
    cause = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, InvalidRequestError)
    return cause


def refused(**fields) -> InvalidRequestError:
    """The 400 that turning a valid request into a chat request raises."""
    with pytest.raises(InvalidRequestError) as info:
        request(**fields).to_chat_request()
    return info.value


# --- request -> chat request ------------------------------------------------------------------------


def test_string_input_and_instructions_become_system_then_user() -> None:
    chat = request(input="What is 2+2?", instructions="Answer briefly.", max_output_tokens=7, temperature=0.5,
                   top_p=0.9, user="u1").to_chat_request()
    assert chat.template_messages() == [{"role": "system", "content": "Answer briefly."},
                                        {"role": "user", "content": "What is 2+2?"}]
    params = chat.to_sampling_params(default_max_tokens=100, max_model_len=2048)
    assert (params.max_tokens, params.temperature, params.top_p) == (7, 0.5, 0.9)


def test_history_goes_between_instructions_and_input() -> None:
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "answer"}]
    chat = request(input="second", instructions="sys").to_chat_request(history)
    assert [m["content"] for m in chat.template_messages()] == ["sys", "first", "answer", "second"]


def test_items_with_text_parts_and_function_calls_become_chat_messages() -> None:
    items = parse_items([
        {"role": "developer",
         "content": [{"type": "input_text", "text": "be "}, {"type": "input_text", "text": "nice"}]},
        {"type": "message", "role": "user", "content": "weather in Paris and Rome?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "21C"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "18C"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # sent back by agents; nothing in it applies
        {"type": "function_call", "call_id": "call_c", "name": "get_weather", "arguments": "{}"},
    ])
    messages = chat_messages(items)
    assert messages == [
        {"role": "system", "content": "be \nnice"},  # parts joined by a newline, as vLLM and llama.cpp join them
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_a", "content": "21C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "18C"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
    ]


@pytest.mark.parametrize("item,param,needle", [
    ({"type": "file_search_call", "id": "x"}, "input[0].type", "'file_search_call'"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input[0].content[0].type",
     "'input_image'"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id", "required"),
    ({"role": "robot", "content": "x"}, "input[0].role", "input[0].role"),
    ("just a string", "input[0]", "must be an object"),
])
def test_bad_items_name_the_item_and_field(item, param: str, needle: str) -> None:
    error = invalid(input=[item])
    assert error.param == param
    assert needle in str(error)


def test_function_tools_and_tool_choice_map_onto_chat() -> None:
    chat = request(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                   stream=True).to_chat_request()
    body = chat.model_dump(exclude_none=True)
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city", "parameters": TOOL["parameters"]}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False and body["stream"] is True
    # only the client's own strict reaches the grammar's plan (a strict tool is enforced exactly or refused)
    strict = request(tools=[{**TOOL, "strict": True}]).to_chat_request().model_dump(exclude_none=True)
    assert strict["tools"][0]["function"]["strict"] is True


def test_text_format_maps_onto_response_format() -> None:
    schema = {"type": "json_schema", "name": "w", "strict": True, "schema": {"type": "object"}}
    assert TextConfig(format=schema).chat_response_format() == {
        "type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True}}
    assert TextConfig(format={"type": "json_object"}).chat_response_format() == {"type": "json_object"}
    assert TextConfig(format={"type": "text"}).chat_response_format() is None
    assert TextConfig().chat_response_format() is None


def test_text_format_does_not_apply_to_a_forced_call_and_shapes_the_answer_with_auto() -> None:
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        assert request(tools=[TOOL], tool_choice=choice, text=fmt).to_chat_request().response_format is None
    assert request(tools=[TOOL], tool_choice="none", text=fmt).to_chat_request().response_format is not None
    # auto (an agent with tools and an output type): a call, or an answer that follows the schema
    auto = request(tools=[TOOL], text=fmt).to_chat_request()
    assert auto.tool_request().calls_possible and auto.tool_request().response_schema == {"type": "object"}


def test_allowed_tools_keeps_the_named_tools_with_its_mode() -> None:
    other = {**TOOL, "name": "get_time"}
    chat = request(tools=[TOOL, other], tool_choice={"type": "allowed_tools", "mode": "required",
                                                     "tools": [{"type": "function", "name": "get_time"}]})
    body = chat.to_chat_request().model_dump(exclude_none=True)
    assert [t["function"]["name"] for t in body["tools"]] == ["get_time"] and body["tool_choice"] == "required"


@pytest.mark.parametrize("tool_type", ["web_search", "web_search_preview", "file_search", "code_interpreter",
                                       "computer_use_preview", "image_generation", "mcp"])
def test_offered_hosted_tools_are_skipped_and_forced_ones_refused(tool_type: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="server.responses.protocol"):
        chat = request(tools=[TOOL, {"type": tool_type}]).to_chat_request()
    assert [t.function.name for t in chat.tools] == ["get_weather"]
    assert tool_type in caplog.text and "skipping" in caplog.text
    error = refused(tools=[TOOL], tool_choice={"type": tool_type})
    assert error.param == "tool_choice.type" and repr(tool_type) in str(error)


def test_an_unknown_tool_type_is_refused_naming_it() -> None:
    error = invalid(tools=[TOOL, {"type": "no_such_tool"}])
    assert error.param == "tools[1].type" and "'no_such_tool'" in str(error)


@pytest.mark.parametrize("fields,param", [
    ({"background": True, "store": False}, "background"),
    ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
    ({"conversation": {"name": "x"}}, "conversation.id"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
])
def test_what_cannot_be_served_is_a_400_naming_it(fields: dict, param: str) -> None:
    assert invalid(**fields).param == param


def test_chat_errors_are_renamed_to_the_responses_fields() -> None:
    assert refused(tool_choice="required").param == "tool_choice"
    with pytest.raises(InvalidRequestError) as info:
        request(max_output_tokens=0).to_chat_request().to_sampling_params(16, 2048)
    assert responses_param(info.value.param) == "max_output_tokens"
    assert responses_param("messages[3].content") == "input"
    assert responses_param("response_format") == "text.format"
    assert responses_param("temperature") == "temperature"


def test_fields_that_do_not_apply_are_accepted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="server.responses.protocol"):
        chat = request(reasoning={"summary": "auto"}, truncation="auto", include=["x"], store=False,
                       metadata={"k": "v"}, prompt_cache_key="k", client_metadata={"a": "b"}).to_chat_request()
    assert "truncation" in caplog.text and "client_metadata" in caplog.text
    assert chat.template_messages() == [{"role": "user", "content": "hi"}]


def test_sampling_extensions_pass_through() -> None:
    chat = request(top_k=5, seed=3, ignore_eos=True).to_chat_request()
    params = chat.to_sampling_params(16, 2048)
    assert (params.top_k, params.seed, params.ignore_eos) == (5, 3, True)


def test_echo_defaults_match_openai() -> None:
    echo = request().echo()
    assert echo["tool_choice"] == "auto" and echo["parallel_tool_calls"] is True and echo["store"] is True
    assert echo["text"] == {"format": {"type": "text"}} and echo["tools"] == [] and echo["metadata"] == {}
    # the fields OpenResponses' Response schema requires beyond those
    assert (echo["presence_penalty"], echo["frequency_penalty"], echo["top_logprobs"], echo["service_tier"]) == \
        (0.0, 0.0, 0, "default")
    assert echo["max_tool_calls"] is None and echo["safety_identifier"] is None and echo["prompt_cache_key"] is None
    assert echo["background"] is False and echo["conversation"] is None
    echoed = request(presence_penalty=0.5, prompt_cache_key="k", safety_identifier="u1", conversation="conv_1").echo()
    assert (echoed["presence_penalty"], echoed["prompt_cache_key"], echoed["safety_identifier"]) == (0.5, "k", "u1")
    assert echoed["conversation"] == {"id": "conv_1"}


def test_a_compaction_item_this_server_made_is_read_back_and_others_are_dropped() -> None:
    items = parse_items([{"type": "compaction", "encrypted_content": COMPACTION_PREFIX + "They chose Rust."},
                         {"type": "compaction", "encrypted_content": "gAAAA-opaque"},
                         {"role": "user", "content": "Go on."}])
    assert chat_messages(items) == [{"role": "user", "content": f"{COMPACTION_INTRO}\n\nThey chose Rust."},
                                    {"role": "user", "content": "Go on."}]


# --- the assembler ----------------------------------------------------------------------------------


def _assembler() -> ResponseAssembler:
    return ResponseAssembler({"id": "resp_1", "created_at": 1, "model": "m"})


USAGE = {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}


def test_text_events_in_order_with_sequence_numbers() -> None:
    asm = _assembler()
    events = asm.start()
    for piece in ["Hel", "lo", "!"]:
        events += asm.feed({"content": piece})
    events += asm.finish("stop", USAGE)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[-1]["response"] == asm.response()  # one builder for the stream's end and the body
    body = asm.response()
    assert body["status"] == "completed" and body["usage"] == USAGE and body["incomplete_details"] is None
    [item] = body["output"]
    assert item["type"] == "message" and item["status"] == "completed" and item["role"] == "assistant"
    assert item["content"] == [{"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}]
    assert {e.get("item_id") for e in events[3:9]} == {item["id"]}


def test_text_then_two_calls_close_each_item_before_the_next() -> None:
    asm = _assembler()
    events = asm.feed({"content": "Checking."})
    events += asm.feed({"content": "\n"})
    events += asm.feed({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                        "function": {"name": "f", "arguments": ""}}]})
    events += asm.feed({"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]})
    events += asm.feed({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]})
    events += asm.feed({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                        "function": {"name": "g", "arguments": "{}"}}]})
    events += asm.finish("stop", USAGE)
    types = [e["type"] for e in events]
    assert types == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    message, call_a, call_b = asm.response()["output"]
    assert message["content"][0]["text"] == "Checking.\n"
    assert call_a == {"id": call_a["id"], "type": "function_call", "status": "completed", "call_id": "call_a",
                      "name": "f", "arguments": '{"x": 1}'}
    assert (call_b["call_id"], call_b["arguments"]) == ("call_b", "{}")
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert events[10]["arguments"] == '{"x": 1}' and events[10]["name"] == "f"


def test_whitespace_before_a_call_makes_no_message_item() -> None:
    asm = _assembler()
    events = asm.feed({"content": "\n "})
    assert events == []
    asm.feed({"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "f", "arguments": "{}"}}]})
    asm.finish("stop", USAGE)
    assert [item["type"] for item in asm.response()["output"]] == ["function_call"]


def test_leading_whitespace_of_text_is_kept_and_an_empty_answer_is_one_empty_message() -> None:
    asm = _assembler()
    deltas = [e["delta"] for e in asm.feed({"content": " "}) + asm.feed({"content": "Hi"})
              if e["type"] == "response.output_text.delta"]
    assert deltas == [" Hi"]
    empty = _assembler()
    types = [e["type"] for e in empty.finish("stop", USAGE)]
    assert types[0] == "response.output_item.added" and types[-1] == "response.completed"
    assert empty.response()["output"][0]["content"][0]["text"] == ""


def test_the_token_limit_makes_an_incomplete_response() -> None:
    asm = _assembler()
    asm.feed({"content": "cut sh"})
    events = asm.finish("length", USAGE)
    assert events[-1]["type"] == "response.incomplete"
    body = asm.response()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"


def test_a_failure_ends_with_response_failed() -> None:
    asm = _assembler()
    asm.start()
    asm.feed({"content": "partial"})
    [event] = asm.fail("The engine failed: boom")
    assert event["type"] == "response.failed" and event["sequence_number"] == 5
    assert event["response"]["status"] == "failed"
    assert event["response"]["error"] == {"code": "server_error", "message": "The engine failed: boom"}
    assert event["response"]["output"][0]["content"][0]["text"] == "partial"


# --- Codex CLI's requests ------------------------------------------------------------------------------


def _fn(name: str) -> dict:
    return {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}}


def test_namespace_tools_are_flattened_and_calls_carry_their_namespace_back() -> None:
    body = request(tools=[_fn("search"), {"type": "namespace", "name": "agents", "description": "Sub-agents.",
                                          "tools": [_fn("spawn"), _fn("search")]},
                          {"type": "web_search", "external_web_access": False}],
                   input=[{"role": "user", "content": "hi"},
                          {"type": "function_call", "call_id": "c1", "name": "search", "namespace": "agents",
                           "arguments": "{}"},
                          {"type": "function_call_output", "call_id": "c1", "output": "found"}])
    chat = body.to_chat_request()
    assert [t.function.name for t in chat.tools] == ["search", "spawn", "agents__search"]
    assert chat.template_messages()[1]["tool_calls"][0]["function"]["name"] == "agents__search"
    names = body.tool_names
    assert names.declared("agents__search") == ("agents", "search") and names.declared("spawn") == ("agents", "spawn")
    assert names.declared("search") == (None, "search")
    asm = ResponseAssembler({"id": "resp_1"}, names)
    events = asm.feed({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "agents__search",
                                                                               "arguments": "{}"}}]})
    assert events[0]["item"]["name"] == "search" and events[0]["item"]["namespace"] == "agents"


def test_codex_developer_messages_and_reasoning_items() -> None:
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
             {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Skills."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Greet."}],
              "encrypted_content": "gAAAA..."},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
             {"type": "reasoning", "id": "rs_2", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}]
    chat = request(input=items, tools=[TOOL], include=["reasoning.encrypted_content"],
                   reasoning={"effort": "low", "summary": "auto"}).to_chat_request()
    messages = chat.template_messages()
    assert messages[0] == {"role": "system", "content": "Rules.\n\nSkills."}
    assert messages[2] == {"role": "assistant", "content": "Hello", "reasoning_content": "Greet."}
    assert messages[3]["reasoning_content"] == "Use the tool." and messages[3]["tool_calls"][0]["id"] == "c1"
    assert chat.reasoning_effort == "low"
    off = request(reasoning={"effort": "none"}).to_chat_request()
    assert off.chat_template_kwargs == {"enable_thinking": False}


def test_reasoning_deltas_become_a_reasoning_item() -> None:
    asm = ResponseAssembler({"id": "resp_1"})
    events = asm.start() + asm.feed({"reasoning_content": "Hm"}) + asm.feed({"reasoning_content": "m."})
    events += asm.feed({"content": "Hi"}) + asm.finish("stop", {"input_tokens": 1})
    kinds = [e["type"] for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.reasoning_text.delta",
                          "response.reasoning_text.delta", "response.reasoning_text.done"]
    output = asm.response()["output"]
    assert [o["type"] for o in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Hmm."}] and output[0]["summary"] == []
