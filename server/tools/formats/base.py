"""The interface every tool-call format implements, and the parsing helpers they share.

A format reads the whole output so far and says what it holds: the content (text for the user) and the
calls (name + arguments as written). The streaming layer (server.tools.stream) re-parses at every step and
sends the difference, so each format keeps one promise: a partial parse never shows content or arguments
that a later parse would take back (a tag still being written stays hidden). Pure functions of strings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from server.tools.grammar import Trigger
from server.tools.formats.calls import ParsedMessage, hold_back
from server.tools.formats.loose import parse_loose

class ToolFormat:
    """One model family's tool-call format: its markers, its parser and its grammar.

    Usage::

        fmt = make_format("hermes")
        fmt.parse('<tool_call>\\n{"name": "f", "arguments": {}}\\n</tool_call>', final=True)
        # ParsedMessage(content='', calls=(ParsedCall(name='f', arguments='{}', complete=True),))

    Streamed, ``ToolCallStream(fmt).feed(piece)`` gives the content and tool-call deltas that are safe to send.

    Attributes:
        name: the registry key (the ``--tool-call-parser`` name).
        preserved_tokens: special tokens the format is written with; the detokenizer must keep them.
    """

    name: ClassVar[str] = ""
    preserved_tokens: ClassVar[tuple[str, ...]] = ()
    # Strings in a chat template's source that say the model writes this format (all must appear).
    template_markers: ClassVar[tuple[str, ...]] = ()
    # Calls written without the markers (fenced or bare JSON) are calls too (server.tools.formats.loose).
    accepts_loose: ClassVar[bool] = True

    def __init__(self, tool_names: Sequence[str] = ()) -> None:
        self.tool_names = tuple(tool_names)

    @classmethod
    def matches_template(cls, source: str) -> bool:
        """Whether a chat template's source says the model writes this format (as llama.cpp's chat.cpp tells)."""
        return bool(cls.template_markers) and all(marker in source for marker in cls.template_markers)

    def parse(self, text: str, final: bool) -> ParsedMessage:
        """What ``text`` holds: the format's own calls, else calls written without markers (to tools named in
        ``tool_names``), else content.

        Args:
            text: the whole output so far.
            final: no more text will come (the request finished); undecided markup becomes content.
        """
        native = self.parse_native(text, final)
        if not self.tool_names or not self.accepts_loose:
            return native

        loose = parse_loose(text, final, self.tool_names)
        if loose.calls and len(loose.calls) >= len(native.calls):
            return loose  # e.g. Hermes tags inside a fence: the fence is no content either
        if native.calls:
            return ParsedMessage(min(native.content, loose.content, key=len), native.calls)
        # NOTE(tools): both hold back what may still become a call (a tag, a fence, a JSON object): the shorter
        # content is the one that takes nothing back later.
        return native if len(native.content) <= len(loose.content) else loose

    def parse_native(self, text: str, final: bool) -> ParsedMessage:
        """What ``text`` holds in this format's own markup (the same promise as ``parse``)."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[dict[str, Any]], *, required: bool, parallel: bool,
                trigger: Callable[[str], Trigger], template_source: str = "",
                response: dict[str, Any] | None = None) -> str:
        """The Lark grammar that enforces calls to ``tools``.

        Args:
            tools: the tools a call may name (OpenAI tool definitions).
            required: the answer must be calls (tool_choice "required" or a named function).
            parallel: several calls may follow each other.
            trigger: ``Trigger`` for a markup string (with its special-token id when the tokenizer has one).
            template_source: the chat template's source (tells format versions apart).
            response: the JSON Schema of an answer that makes no call (a response_format beside the tools).
        """
        raise NotImplementedError


def content_before_calls(text: str, final: bool, *markers: str) -> str:
    """Plain text before any call: everything when final, else without a possible marker start or
    trailing whitespace (which a call that follows would drop)."""
    return text if final else hold_back(text, *markers).rstrip()


