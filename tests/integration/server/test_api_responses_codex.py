"""/v1/responses as Codex CLI drives it, through the `openai` SDK on the default model: developer messages, a
`namespace` tool beside plain function tools, an offered `web_search` (skipped), `include`, `reasoning`,
`store: false` with the whole history sent again on every turn, and prefix reuse across those turns."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from server.app import create_app

from tests.integration.server.conftest import RunningServer, api_settings, serve_app

MODEL = "smollm2"
SHELL = {"type": "function", "name": "exec_command", "description": "Runs a command.", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string", "maxLength": 40}},
                        "required": ["cmd"], "additionalProperties": False}}
SPAWN = {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.", "strict": False,
         "parameters": {"type": "object", "properties": {"task": {"type": "string", "maxLength": 40}},
                        "required": ["task"], "additionalProperties": False}}
CLOSE = {"type": "function", "name": "close_agent", "description": "Close a sub-agent.", "strict": False,
         "parameters": {"type": "object", "properties": {"id": {"type": "string", "maxLength": 10}},
                        "required": ["id"], "additionalProperties": False}}
TOOLS = [SHELL, {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [CLOSE, SPAWN]},
         {"type": "web_search", "external_web_access": False}]
CODEX_FIELDS = {"include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"}, "store": False,
                "parallel_tool_calls": True, "prompt_cache_key": "session-1"}
INSTRUCTIONS = "You are a coding agent running in a terminal. Be precise, safe and helpful. " * 8


def codex_input(prompt: str) -> list[dict]:
    return [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<skills></skills>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "<environment_context>/tmp</environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}]


@pytest.fixture(scope="module")
def smol(default_model: Path) -> Iterator[RunningServer]:
    with serve_app(create_app(api_settings(default_model, served_model_name=MODEL))) as running:
        yield running


def test_codex_request_streams_to_completion(smol: RunningServer) -> None:
    with smol.client().responses.stream(
            model=MODEL, input=codex_input("Say hi"), tools=TOOLS, tool_choice="auto", max_output_tokens=60,
            extra_body={"client_metadata": {"x-codex-installation-id": "abc"}, **CODEX_FIELDS}) as stream:
        events = list(stream)
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    response = final.response
    assert [t.type for t in response.tools] == ["function", "function", "function"]  # web_search skipped
    assert response.usage.input_tokens > 0 and response.output


def _forced_spawn(smol: RunningServer, prompt: str):
    return smol.client().responses.create(model=MODEL, input=codex_input(prompt), tools=TOOLS,
                                          tool_choice={"type": "function", "name": "spawn_agent"},
                                          max_output_tokens=60, extra_body=CODEX_FIELDS)


def test_a_namespaced_call_comes_back_with_its_namespace(smol: RunningServer) -> None:
    r = _forced_spawn(smol, "Start a helper that lists files.")
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "spawn_agent" and call.namespace == "multi_agent_v1"
    jsonschema.validate(json.loads(call.arguments), SPAWN["parameters"])


def test_turns_sent_again_whole_reuse_the_prefix(smol: RunningServer) -> None:
    """Codex sends the whole conversation on every turn (store: false): turn 2's cached tokens cover turn 1's
    prompt. Turn 2 carries the namespaced call, its output and a reasoning item with encrypted content."""
    first = _forced_spawn(smol, "Start a helper that lists files.")
    [call] = [item for item in first.output if item.type == "function_call"]
    turn2 = [*codex_input("Start a helper that lists files."),
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque-to-us"},
             call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "agent a1 started"}]
    second = smol.client().responses.create(model=MODEL, input=turn2, tools=TOOLS, max_output_tokens=8,
                                            temperature=0, extra_body=CODEX_FIELDS)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.status in ("completed", "incomplete")


def test_forcing_a_hosted_tool_is_a_400(smol: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        smol.client().responses.create(model=MODEL, input="x", tools=TOOLS, tool_choice={"type": "web_search"})
    assert info.value.body["param"] == "tool_choice.type"
