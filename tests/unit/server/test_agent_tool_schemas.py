"""Tool schemas never refuse a turn (issue 46): every tool schema the agents send (captured from their real first
requests into tests/data/agent_tools/ by tests/integration/agents/capture_tools.py), and each keyword of JSON Schema
2020-12 that the grammar library cannot enforce, gives a grammar under tool_choice auto, required and a named tool,
in each tool-call format, checked by llguidance on a real BPE tokenizer. What the grammar leaves out is logged once
per request, naming tool and keyword; a strict tool with such a keyword is a 400 that names it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from engine.builder.tokenizer import synthetic_tokenizer
from engine.structured_output import check_schema
from engine.types import InvalidRequestError
from server.openai.messages import FunctionDefinition
from server.tools.plan import ToolRequest, enforceable_tools, plan_tools

llguidance = pytest.importorskip("llguidance")

CAPTURED = sorted((Path(__file__).resolve().parents[2] / "data" / "agent_tools").glob("*.json"))
# The agents whose captures must be there (a release may add files; none may go missing).
AGENTS = {"claude-code", "codex", "opencode", "qwen-code", "continue-cli", "aider", "mini-swe-agent", "smolagents"}

# JSON Schema 2020-12 keywords llguidance does not enforce (or not always), each valid in a tool's parameters.
KEYWORDS = {
    "propertyNames": {"type": "object", "properties": {"env": {
        "type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"}, "additionalProperties": {"type": "string"}}}},
    "patternProperties": {"type": "object", "properties": {"a": {"type": "string"}},
                          "patternProperties": {"^x-": {"type": "string"}, "^x-y": {"type": "integer"}}},
    "dependentSchemas": {"type": "object", "properties": {"card": {"type": "string"}, "address": {"type": "string"}},
                         "dependentSchemas": {"card": {"required": ["address"]}}},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                          "dependentRequired": {"a": ["b"]}},
    "if": {"type": "object", "properties": {"kind": {"enum": ["file", "dir"]}, "size": {"type": "integer"}},
           "if": {"properties": {"kind": {"const": "file"}}}, "then": {"required": ["size"]}, "else": {}},
    "$dynamicRef": {"$id": "https://example.com/tree", "$dynamicAnchor": "node", "type": "object",
                    "properties": {"name": {"type": "string"},
                                   "children": {"type": "array", "items": {"$dynamicRef": "#node"}}}},
    "unevaluatedProperties": {"type": "object", "properties": {"a": {"type": "string"}},
                              "unevaluatedProperties": False},
    "unevaluatedItems": {"type": "object", "properties": {"xs": {"type": "array", "prefixItems": [{"type": "string"}],
                                                                 "unevaluatedItems": False}}},
    "contentEncoding": {"type": "object", "properties": {"blob": {"type": "string", "contentEncoding": "base64",
                                                                  "contentMediaType": "image/png"}}},
    "format": {"type": "object", "properties": {f: {"type": "string", "format": f} for f in (
        "uri", "uri-reference", "iri", "idn-email", "json-pointer", "regex", "date-time", "email", "uuid")}},
    "oneOf": {"type": "object", "properties": {"target": {"oneOf": [{"type": "string"},
                                                                    {"type": "string", "minLength": 3}]}}},
    "not": {"type": "object", "properties": {"x": {"not": {"type": "null"}}}},
    "uniqueItems": {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "string"},
                                                            "uniqueItems": True}}},
    "contains": {"type": "object", "properties": {"xs": {"type": "array", "contains": {"const": "a"},
                                                         "minContains": 1}}},
    "$anchor": {"type": "object", "properties": {"p": {"$ref": "#pt"}},
                "$defs": {"point": {"$anchor": "pt", "type": "string"}}},
    "unresolvable $ref": {"type": "object", "properties": {"p": {"$ref": "#/$defs/nowhere"}}},
}


class _Template:
    def __init__(self, source: str = "") -> None:
        self.supports_tools, self.tool_source = bool(source), source


class _NoSpecials:
    def special_token_id(self, token: str) -> int | None:
        return None


# (format, template): Qwen's Hermes tags, Mistral's, Llama 3's, and the generic JSON answer.
TEMPLATES = [("hermes", _Template("<tool_call>")), ("mistral", _Template("[TOOL_CALLS] [ARGS]")),
             ("llama3_json", _Template("<|python_tag|>")), ("generic", _Template())]


@pytest.fixture(scope="module")
def lltok():
    hf, _ = synthetic_tokenizer(512)
    return llguidance.LLTokenizer(hf.to_str(), eos_token=2)


def _chat_tool(tool: dict) -> dict:
    function = {"name": tool["name"]}
    if tool.get("parameters") is not None:
        function["parameters"] = tool["parameters"]
    if "strict" in tool:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _captured() -> list[tuple[str, list[dict]]]:
    return [(path.stem, [_chat_tool(t) for t in json.loads(path.read_text())["tools"]]) for path in CAPTURED]


def _compiles(lltok, tools: list[dict], choice: str, function: str | None = None) -> None:
    for fmt, template in TEMPLATES:
        plan = plan_tools([{"role": "user", "content": "hi"}], ToolRequest(tuple(tools), choice, function),
                          template, _NoSpecials(), fmt)
        grammar = llguidance.LLMatcher.grammar_from_lark(plan.structured.spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        assert not error, (fmt, choice, function, error)


def test_every_agent_has_captured_tool_schemas() -> None:
    agents = {json.loads(p.read_text())["agent"] for p in CAPTURED}
    assert agents >= AGENTS, sorted(AGENTS - agents)


@pytest.mark.parametrize("name, tools", _captured(), ids=[p.stem for p in CAPTURED])
def test_each_agents_tools_compile_under_auto_required_and_named(lltok, name: str, tools: list[dict]) -> None:
    if not tools:
        pytest.skip(f"{name} sends no tools (its actions are in its text)")
    for tool in tools:  # the wire model takes them (a valid schema of an object)
        FunctionDefinition.model_validate(tool["function"])
    _compiles(lltok, tools, "auto")
    _compiles(lltok, tools, "required")
    for tool in tools:
        _compiles(lltok, tools, "function", tool["function"]["name"])


def test_the_captures_hold_the_keywords_that_refused_agents_before() -> None:
    """Claude Code 2.1.197 (propertyNames) and Qwen Code 0.24.4 (a oneOf) were refused with a 400 before."""
    relaxed = {(name, t["function"]["name"]): check_schema(t["function"].get("parameters", {})).relaxed
               for name, tools in _captured() for t in tools}
    assert any(k[0] == "claude-code@2.1.197" and "propertyNames" in v for k, v in relaxed.items()), relaxed
    assert any(k[0].startswith("qwen-code@") and "oneOf" in v for k, v in relaxed.items()), relaxed


@pytest.mark.parametrize("keyword", KEYWORDS)
def test_a_2020_12_keyword_never_refuses_and_is_logged(lltok, caplog, keyword: str) -> None:
    tools = [_chat_tool({"name": "probe", "parameters": KEYWORDS[keyword]}),
             _chat_tool({"name": "plain", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}})]
    FunctionDefinition.model_validate(tools[0]["function"])
    for choice, function in (("auto", None), ("required", None), ("function", "probe")):
        _compiles(lltok, tools, choice, function)
    check = check_schema(KEYWORDS[keyword])
    if check.exact:  # enforced as written (llguidance supports it here): nothing to say
        return
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="server.tools.plan"):
        enforceable_tools(ToolRequest(tuple(tools), "auto"))
    lines = [r.getMessage() for r in caplog.records if "not enforced" in r.getMessage()]
    assert len(lines) == 1 and "probe: " in lines[0] and "plain" not in lines[0], lines
    named = keyword.split()[-1].lstrip("$") if check.error is None else "any JSON object"
    assert named in lines[0], lines


@pytest.mark.parametrize("keyword", [k for k in KEYWORDS if not check_schema(KEYWORDS[k]).exact])
def test_a_strict_tool_with_such_a_keyword_is_refused_by_name(keyword: str) -> None:
    tools = (_chat_tool({"name": "probe", "parameters": KEYWORDS[keyword], "strict": True}),)
    for choice in ("auto", "required"):
        with pytest.raises(InvalidRequestError) as err:
            enforceable_tools(ToolRequest(tools, choice))
        check = check_schema(KEYWORDS[keyword])
        assert err.value.param == "tools" and "'probe' is strict" in str(err.value)
        assert (check.error or check.relaxed[0]) in str(err.value)


def test_a_response_format_beside_tools_is_still_enforced_exactly_or_refused() -> None:
    tools = (_chat_tool({"name": "plain", "parameters": {"type": "object"}}),)
    with pytest.raises(InvalidRequestError) as err:
        enforceable_tools(ToolRequest(tools, "auto", response_schema=KEYWORDS["propertyNames"]))
    assert err.value.param == "response_format" and "propertyNames" in str(err.value)
