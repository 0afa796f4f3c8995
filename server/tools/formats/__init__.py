"""Tool-call formats: one class per model family (its markers, parser and grammar), a registry, and the
choice of format from the model's chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from server.tools.formats.base import ParsedCall, ParsedMessage, ToolFormat
from server.tools.formats.generic import GenericFormat
from server.tools.formats.hermes import HermesFormat
from server.tools.formats.llama3 import Llama3JsonFormat
from server.tools.formats.mistral import MistralFormat

GENERIC = GenericFormat.name
FORMATS: dict[str, type[ToolFormat]] = {
    cls.name: cls for cls in (HermesFormat, Llama3JsonFormat, MistralFormat, GenericFormat)
}
# Markers in a tool-capable template's source -> its native format (first match wins).
_NATIVE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))


class _Template(Protocol):
    supports_tools: bool
    tool_source: str


def make_format(name: str, tool_names: Sequence[str] = ()) -> ToolFormat:
    """The format registered as ``name``, reading calls to ``tool_names`` also when written without markers
    (KeyError names the known formats)."""
    try:
        return FORMATS[name](tool_names)
    except KeyError:
        raise KeyError(f"unknown tool-call format {name!r}; known: {sorted(FORMATS)}") from None


def choose_format(template: _Template) -> str:
    """Native format when the template renders tools and writes a known call markup; else generic."""
    if not template.supports_tools:
        return GENERIC
    source = template.tool_source
    for marker, name in _NATIVE_MARKERS:
        if marker in source:
            return name
    return GENERIC


__all__ = ["FORMATS", "GENERIC", "ParsedCall", "ParsedMessage", "ToolFormat", "choose_format", "make_format"]
