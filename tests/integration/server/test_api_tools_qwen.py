"""Tool calls on a real instruct model (issue 34): Qwen2.5-Coder-1.5B-Instruct (`ortserve pull qwen2.5-coder-1.5b`)
served by `ortserve serve` and driven with the openai SDK, streamed and not.

Under `auto` the model writes its call as a fenced ```json block, as bare JSON or in <tool_call> tags; each
must come back as tool_calls with nothing of it in content. `required` ends when the model ends (its
end-of-generation token after a complete call) with finish_reason tool_calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.greedy_close import GreedyRun, assert_decided
from tests.integration.server.conftest import serve_process

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a text file and return its content.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
LIST_FILES = {"type": "function", "function": {
    "name": "list_files", "description": "List the files in a directory.",
    "parameters": {"type": "object", "properties": {"directory": {"type": "string"}}, "required": ["directory"]}}}
TOOLS = [WEATHER, READ_FILE, LIST_FILES]

PROMPTS = [
    ("What's the weather like in Paris right now?", "get_weather"),
    ("Is it raining in Tokyo? Check the weather for me.", "get_weather"),
    ("Tell me the temperature in New York in fahrenheit.", "get_weather"),
    ("Read the file hello.py and tell me what it prints.", "read_file"),
    ("Show me what is inside config/settings.yaml.", "read_file"),
    ("Which files are in the src directory?", "list_files"),
]


@pytest.fixture(scope="module")
def qwen_folder(request) -> Path:
    """The model folder from the `qwen_model` fixture (`ortserve pull qwen2.5-coder-1.5b`)."""
    try:
        return request.getfixturevalue("qwen_model")
    except pytest.FixtureLookupError:
        pytest.skip("no qwen_model fixture (ortserve pull qwen2.5-coder-1.5b) on this branch yet")


@pytest.fixture(scope="module")
def client(qwen_folder: Path):
    with serve_process(qwen_folder, "--served-model-name", "qwen", "--max-batch", "2",
                       ready_timeout_s=600) as served:
        yield openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0, timeout=600)


def _chat(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, [(name, arguments)], finish_reason), streamed or not."""
    return _chat_run(client, stream, **kwargs)[:3]


def _chat_run(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, list[tuple[str, dict]], str, GreedyRun]:
    """``_chat``'s answer and the tokens it was written with, each with its runner-up (for ``assert_decided``)."""
    body = {"model": "qwen", "temperature": 0, "max_tokens": 160, "tools": TOOLS, "logprobs": True,
            "top_logprobs": 2, **kwargs}
    if not stream:
        done = client.chat.completions.create(**body)
        message = done.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        run = GreedyRun.from_openai(done.choices[0].logprobs, done.choices[0].finish_reason)
        return message.content or "", calls, done.choices[0].finish_reason, run
    content, parts, reason, chunks = "", {}, None, []
    for chunk in client.chat.completions.create(**body, stream=True):
        chunks.append(chunk)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or ():
            entry = parts.setdefault(tc.index, ["", ""])
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
        reason = choice.finish_reason or reason
    calls = [(n, json.loads(a)) for n, a in (parts[i] for i in sorted(parts))]
    return content, calls, reason, GreedyRun.from_openai_stream(chunks)


def _tokens_until(run: GreedyRun, text: str) -> int:
    """How many of ``run``'s first tokens it takes to have written ``text`` (all of them if it never does)."""
    return next((n for n in range(1, len(run.tokens) + 1) if text in "".join(run.tokens[:n])), len(run.tokens))


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_are_parsed_however_the_model_writes_them(client: openai.OpenAI, stream: bool) -> None:
    parsed = []
    for prompt, tool in PROMPTS:
        content, calls, reason, run = _chat_run(client, stream, messages=[{"role": "user", "content": prompt}])
        # NOTE(tests): on every CPU: each choice up to the tool's name ("```json\n{\n  \"name\": \"get_weather\"")
        # beats its runner-up by >= 1.4 nats (AVX-512, INT4 level 4), checked here
        assert_decided(run, _tokens_until(run, f'"{tool}"'), what=f"the call of {tool} for {prompt!r}")
        assert "```" not in content and '"name"' not in content, (prompt, content)  # no call left in content
        ok = bool(calls) and calls[0][0] == tool and reason == "tool_calls"
        parsed.append(ok)
        print(f"{'ok ' if ok else 'NO '} {prompt!r}: {calls} {content[:80]!r}")
    assert sum(parsed) >= 5, parsed


@pytest.mark.parametrize("stream", [False, True])
def test_required_ends_when_the_model_ends(client: openai.OpenAI, stream: bool) -> None:
    content, calls, reason = _chat(client, stream, tool_choice="required", max_tokens=400,
                                   messages=[{"role": "user", "content": "What's the weather in Berlin?"}])
    assert reason == "tool_calls" and 1 <= len(calls) <= 3, (reason, calls)
    assert all(name in {"get_weather", "read_file", "list_files"} for name, _ in calls)


def test_named_tool(client: openai.OpenAI) -> None:
    _, calls, reason = _chat(client, False, tool_choice={"type": "function", "function": {"name": "read_file"}},
                             messages=[{"role": "user", "content": "Open notes.txt please."}])
    assert reason == "tool_calls" and [name for name, _ in calls] == ["read_file"]
    jsonschema.validate(calls[0][1], READ_FILE["function"]["parameters"])


def test_parallel_calls(client: openai.OpenAI) -> None:
    _, calls, reason = _chat(client, False, tool_choice="required", max_tokens=300, parallel_tool_calls=True,
                             messages=[{"role": "user", "content": "Get the weather in Paris and in Rome."}])
    assert reason == "tool_calls" and 1 <= len(calls) <= 3
    for name, arguments in calls:
        assert name == "get_weather"
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_a_tool_result_is_answered(client: openai.OpenAI) -> None:
    """The model's call and its result sent back, then the answer: the second request as OpenAI's own function-
    calling example sends it, with the conversation and without ``tools``.

    NOTE(tools): with the tools offered again, this model calls get_weather a second time instead of answering,
    and so does llama.cpp on the same file: ortserve's prompt for this conversation equals the GGUF template's
    (jinja2, arguments as an object, as llama.cpp's server renders them) text for text and id for id, and
    llama.cpp's greedy answer is ``{{"name": "get_weather", "arguments": {"location": "Paris, France"}}``
    (about two thirds of the first token's probability on the openings of a call, across the system prompts,
    questions and result shapes tried). Without tools both answer from the result. A wrong rendering of the call
    or of the result (arguments as a JSON string, a tool turn the template does not know) still fails here.
    """
    messages = [{"role": "user", "content": "What's the temperature in Paris in Celsius?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"location": "Paris, France"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature_c": 21})}]
    done = client.chat.completions.create(model="qwen", temperature=0, max_tokens=160, messages=messages,
                                          logprobs=True, top_logprobs=2)
    message, reason = done.choices[0].message, done.choices[0].finish_reason
    # NOTE(tests): on every CPU: "The temperature in Paris is 21 degrees Celsius." and its end win each choice by
    # >= 0.99 nats (AVX-512, INT4 level 4), checked here; asked about "the weather" with a sky in the result, the
    # answer's wording came by 0.12 ("temperature" or "weather"), so the question asks for what the result holds
    run = GreedyRun.from_openai(done.choices[0].logprobs, reason)
    assert_decided(run, len(run.tokens), what="the answer from the tool's result")
    assert reason == "stop" and not message.tool_calls, (reason, message)
    assert "21" in message.content, message.content


def test_json_schema_answer_keys_are_unique(client: openai.OpenAI) -> None:
    """An open object (extra keys allowed) that the model ends itself: valid JSON, no key twice.

    NOTE(tools): asked for "any other facts you like", this model writes one long prose value (or, given more
    tokens, keys that restate earlier ones: "climate", then "climate_type"...) until max_tokens; a cut answer is
    finish_reason length and never valid JSON, so the request names its fields and bounds the extras.
    """
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": True}
    done = client.chat.completions.create(
        model="qwen", temperature=0, max_tokens=200,
        messages=[{"role": "user", "content": 'Answer in JSON: "city" is the capital of Italy, "population" its '
                                              'population as an integer, and add two or three other short facts '
                                              'as extra keys.'}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    text, reason = done.choices[0].message.content, done.choices[0].finish_reason
    assert reason == "stop", (reason, text)  # "length": cut by max_tokens, not JSON yet

    def no_repeats(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), keys
        return dict(pairs)

    answer = json.loads(text, object_pairs_hook=no_repeats)
    jsonschema.validate(answer, schema)
    assert set(answer) - {"city", "population"}, answer  # the open object was used
