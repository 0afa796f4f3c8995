"""The Responses API's tools on the wire: function tools, namespace tools flattened into them (and their names
mapped back), hosted tools skipped or refused, tool_choice; and the field-naming 400 helpers of the Responses
protocol modules. Must not import onnxruntime or any engine module other than engine.types.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import ValidationError

from engine.types import InvalidRequestError
from server.openai.base import OpenAIBaseModel

logger = logging.getLogger("server.responses.protocol")

# Tool types the Responses API runs on OpenAI's side. Offered ones are skipped (a warning is logged), so that
# clients which always offer them (Codex CLI sends web_search on every turn) still work; forcing one is a 400.
HOSTED_TOOL_TYPES = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
                     "file_search", "code_interpreter", "computer_use_preview", "computer_use", "image_generation",
                     "mcp", "local_shell", "shell", "apply_patch", "tool_search", "custom")


def invalid(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def typed(model: type[OpenAIBaseModel], data: Any, param: str) -> Any:
    """Validate `data` as `model`; the first problem becomes a 400 naming `param` and the field inside it."""
    if not isinstance(data, dict):
        raise invalid(f"{param} must be an object, got {type(data).__name__}", param, "invalid_type")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        where = ".".join(str(p) for p in first.get("loc", ()) if isinstance(p, str))
        full = f"{param}.{where}" if where else param
        if isinstance(cause, InvalidRequestError):
            raise invalid(str(cause), cause.param or full, cause.code or "invalid_value") from None
        if first.get("type") == "missing":
            raise invalid(f"'{full}' is a required property", full, "missing_required_parameter") from None
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise invalid(f"{full}: {message}", full) from None


def validated(model: type[OpenAIBaseModel], data: dict[str, Any]) -> Any:
    """A request body validated as `model` outside FastAPI's own validation (a WebSocket message, a request the
    server builds from a client's fields); its first problem is a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequestError):
            raise invalid(str(cause), cause.param or "", cause.code or "invalid_value") from None
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise invalid(f"{where}: {message}" if where else message, where or "",
                      "missing_required_parameter" if first.get("type") == "missing" else "invalid_value") from None


class FunctionTool(OpenAIBaseModel):
    """A function tool as the Responses API spells it (flat, unlike chat's {"function": {...}})."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        # NOTE(server): the Responses API calls function tools strict unless told otherwise (and echoes them so), but
        # only a tool the client itself marks strict must be enforced exactly, else be refused (a 400): one it
        # leaves unmarked is enforced as far as the grammar can, as a chat tool is (server.tools.plan).
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}

    def echo(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": True if self.strict is None else self.strict}


class ToolNames:
    """Flat chat names of a request's function tools, and back: functions inside a ``namespace`` tool keep
    their own name where it is unique among the tools, else become ``<namespace>__<name>``; calls carry the
    function's own name and its ``namespace`` on the way out, as the client declared them."""

    def __init__(self) -> None:
        self._flat: dict[tuple[str | None, str], str] = {}
        self._declared: dict[str, tuple[str | None, str]] = {}

    def add(self, namespace: str | None, name: str, taken: set[str]) -> str:
        flat = name if name not in taken else f"{namespace}__{name}"[:64]
        self._flat[(namespace, name)] = flat
        self._declared[flat] = (namespace, name)
        return flat

    def flat(self, namespace: str | None, name: str) -> str:
        """The chat name of ``namespace``'s function ``name`` (unknown pairs: the name as it is)."""
        return self._flat.get((namespace, name), self._flat.get((None, name), name))

    def declared(self, flat: str) -> tuple[str | None, str]:
        """(namespace, name) of the chat name ``flat``."""
        return self._declared.get(flat, (None, flat))


def builtin_refused(kind: Any, param: str) -> InvalidRequestError:
    return invalid(f"built-in tool type {kind!r} is not supported: ortserve runs no hosted tools (web search, "
                    f"file search, code interpreter, computer use, ...); declare a tool of type 'function' and "
                    f"run it yourself", param, "unsupported_tool_type")


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """Responses tool_choice -> chat tool_choice ({"type": "function", "name"} -> {"function": {"name"}})."""
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid(f"tool_choice must be 'none', 'auto', 'required' or an object, got {choice!r}",
                          "tool_choice")
        return choice
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise invalid("tool_choice.name must be a string naming one of the tools", "tool_choice.name",
                          "invalid_type")
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise invalid(f"tool_choice.mode must be 'auto' or 'required', got {mode!r}", "tool_choice.mode")
        return mode
    raise builtin_refused(kind, "tool_choice.type")


def allowed_names(choice: Any) -> set[str] | None:
    """The tool names an {"type": "allowed_tools"} choice keeps (None: every tool)."""
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return None
    allowed = choice.get("tools")
    if not isinstance(allowed, list):
        raise invalid("tool_choice.tools must be a list of {'type': 'function', 'name'}", "tool_choice.tools",
                      "invalid_type")
    names = set()
    for index, entry in enumerate(allowed):
        if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(entry.get("name"), str):
            raise builtin_refused(entry.get("type") if isinstance(entry, dict) else entry,
                                  f"tool_choice.tools[{index}]")
        names.add(entry["name"])
    return names


def _function_tool(data: Any, index: int) -> FunctionTool:
    where = f"tools[{index}]"
    if isinstance(data, dict) and data.get("type") != "function":
        raise builtin_refused(data.get("type"), f"{where}.type")
    return typed(FunctionTool, data, where)


def function_tools(raw: list[Any]) -> tuple[list[FunctionTool], ToolNames]:
    """The request's function tools, namespaces flattened, and their chat names (ToolNames); hosted tools
    are skipped with a warning, other tool types refused naming them."""
    found: list[tuple[str | None, FunctionTool]] = []
    skipped: list[str] = []
    for index, data in enumerate(raw):
        where = f"tools[{index}]"
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "namespace":
            if not isinstance(data.get("name"), str) or not isinstance(data.get("tools"), list):
                raise invalid(f"{where}: a namespace tool needs a name and a list of tools", where, "invalid_type")
            for inner, tool in enumerate(data["tools"]):
                if isinstance(tool, dict) and tool.get("type") != "function":
                    skipped.append(f"{data['name']}.{tool.get('name') or tool.get('type')}")
                    continue
                found.append((data["name"], typed(FunctionTool, tool, f"{where}.tools[{inner}]")))
        elif kind in HOSTED_TOOL_TYPES:
            skipped.append(str(kind))
        else:
            found.append((None, _function_tool(data, index)))
    if skipped:
        logger.warning("responses: skipping tools this server cannot run (it runs no hosted tools, and only "
                       "function tools are called): %s", ", ".join(skipped))
    counts: dict[str, int] = {}
    for _, tool in found:
        counts[tool.name] = counts.get(tool.name, 0) + 1
    taken = {name for name, count in counts.items() if count > 1}
    names, tools = ToolNames(), []
    for namespace, tool in found:
        flat = names.add(namespace, tool.name, taken if namespace is not None else set())
        tools.append(tool if flat == tool.name else tool.model_copy(update={"name": flat}))
    return tools, names
