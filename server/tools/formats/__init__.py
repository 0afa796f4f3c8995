"""Tool-call formats: one class per model family (its markers, parser and grammar), a registry, and the
choice of format from the model's chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from server.tools.formats.base import ToolFormat
from server.tools.formats.calls import ParsedCall, ParsedMessage
from server.tools.formats.deepseek_r1 import DeepSeekR1Format
from server.tools.formats.generic import GenericFormat
from server.tools.formats.hermes import HermesFormat
from server.tools.formats.llama3 import Llama3JsonFormat
from server.tools.formats.mistral import MistralFormat
from server.tools.formats.phi4_mini import Phi4MiniFormat
from server.tools.formats.qwen3_coder import Qwen3CoderFormat

GENERIC = GenericFormat.name
# NOTE(tools): in the order llama.cpp's common/chat.cpp tests templates: the most specific markup first
# (Qwen3-Coder's template also holds "<tool_call>", Hermes's own marker).
FORMATS: dict[str, type[ToolFormat]] = {
    cls.name: cls for cls in (DeepSeekR1Format, Qwen3CoderFormat, HermesFormat, Phi4MiniFormat, Llama3JsonFormat,
                              MistralFormat, GenericFormat)
}


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


def choose_format(template: _Template, override: str | None = None) -> str:
    """The format named by ``override`` (``--tool-call-parser``); else the native format when the template
    renders tools and says which format its model writes (``ToolFormat.matches_template``); else generic."""
    if override is not None:
        make_format(override)  # KeyError names the known ones
        return override
    if not template.supports_tools:
        return GENERIC
    source = template.tool_source
    for name, cls in FORMATS.items():
        if cls.matches_template(source):
            return name
    return GENERIC


__all__ = ["FORMATS", "GENERIC", "ParsedCall", "ParsedMessage", "ToolFormat", "choose_format", "make_format"]
