"""Reasoning output: a thinking model's thinking split from its answer, in one place for every protocol.

Chat (`reasoning_content` and `reasoning`), Responses (`reasoning` items) and Messages (`thinking` blocks) all
read the output through one ReasoningDeltas, so tool calls are parsed from the answer only, never from the
thinking. Pure: strings in, strings out; no engine import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from server.tools.formats.calls import hold_back

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """How one request's output holds its thinking.

    Attributes:
        open_tag, close_tag: the markup around the thinking (``<think>`` and ``</think>``).
        start: where the output starts: "free" (the model may open a block first), "open" (the prompt ends
            inside an open block: DeepSeek-R1 style templates write ``<think>`` into the generation prompt, so
            the output begins with thinking and no open tag) or "closed" (the prompt's turn already holds a
            closed block: Qwen3 with ``enable_thinking: false``, or a prefill that thought; the output is
            all answer).
    """

    open_tag: str = THINK_OPEN
    close_tag: str = THINK_CLOSE
    start: str = "free"

    @property
    def tags(self) -> tuple[str, str]:
        return self.open_tag, self.close_tag

    @property
    def starts_open(self) -> bool:
        return self.start == "open"


def reasoning_format(template_source: str, prompt_text: str) -> ReasoningFormat | None:
    """The thinking format of a request, or None when the model does not think in a way we can tell apart.

    Args:
        template_source: the chat template's Jinja source (a template that thinks writes its tags).
        prompt_text: the rendered prompt, up to where the output starts (or where the echoed text starts).

    NOTE(reasoning): decided from the template, as llama.cpp's `--reasoning-format auto` does: a template
    that never writes ``<think>`` gets no split (a model may still write the tag; it then stays in the text).
    The prompt's tail says where the output starts: after a last ``<think>`` that no ``</think>`` follows, the
    block is open; a ``</think>`` followed by whitespace only closed this turn's block.
    """
    if THINK_OPEN not in template_source and THINK_OPEN not in prompt_text:
        return None
    last_open, last_close = prompt_text.rfind(THINK_OPEN), prompt_text.rfind(THINK_CLOSE)
    if last_open > last_close:
        return ReasoningFormat(start="open")
    if last_close >= 0 and not prompt_text[last_close + len(THINK_CLOSE):].strip():
        return ReasoningFormat(start="closed")
    return ReasoningFormat()


class ReasoningSplitter:
    """Feed the output as it grows; get ``(reasoning, answer)`` text that is safe to send now.

    Only a block at the start of the output is thinking (after optional whitespace); once it closes, the rest
    is the answer, whatever tags it holds. A tag still being written is held back. An output that ends inside
    the block (the token limit cut it) is all thinking.

    Usage::

        split = ReasoningSplitter(ReasoningFormat())  # start="free"
        split.feed("<think>Hmm")           # ("Hmm", "")
        split.feed("</think>\\n\\nHi")      # ("", "Hi")
        split.feed("", final=True)         # ("", "")
    """

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._open, self._close = fmt.tags
        # start -> think -> after -> answer, or start -> answer
        self._state = {"open": "think", "closed": "answer"}.get(fmt.start, "start")
        self._pending = ""  # text not yet given out (a tag prefix, or whitespace before the first tag)
        self.reasoning = ""
        self.answer = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        """Add ``piece``; ``final`` once nothing more will come. Returns the new (reasoning, answer) text."""
        text, self._pending = self._pending + piece, ""
        reasoning = answer = ""
        if self._state == "start":
            stripped = text.lstrip()
            if stripped.startswith(self._open):
                self._state, text = "think", stripped[len(self._open):]
            elif not final and self._open.startswith(stripped):  # whitespace, or the open tag being written
                self._pending = text
                return "", ""
            else:
                self._state = "answer"
        if self._state == "think":
            at = text.find(self._close)
            if at >= 0:
                reasoning, text, self._state = text[:at].rstrip(), text[at + len(self._close):], "after"
            elif final:
                reasoning, text = text.rstrip(), ""
            else:
                # NOTE(reasoning): a close tag being written, and trailing whitespace (the newline templates put
                # before the close tag), wait for the next piece.
                reasoning = hold_back(text, self._close).rstrip()
                self._pending, text = text[len(reasoning):], ""
            if not self.reasoning:
                reasoning = reasoning.lstrip()  # the newline after the open tag
        if self._state == "after":  # the whitespace between the close tag and the answer belongs to neither
            text = text.lstrip()
            if text or final:
                self._state = "answer"
        if self._state == "answer":
            answer = text
        self.reasoning += reasoning
        self.answer += answer
        return reasoning, answer


class DeltaSource(Protocol):
    """Turns the growing output into chat deltas ({"content"} / {"tool_calls"} / reasoning)."""

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]: ...

    @property
    def has_calls(self) -> bool: ...

    def message(self) -> dict[str, Any]: ...


def reasoning_delta(text: str) -> dict[str, Any]:
    """A chat delta of thinking, under both names clients read (`reasoning_content`: llama.cpp, DeepSeek,
    OpenCode, the AI SDK; `reasoning`: vLLM since its PR #27752, Ollama)."""
    return {"reasoning_content": text, "reasoning": text}


class ReasoningDeltas:
    """A DeltaSource that splits the thinking off first and hands only the answer to ``inner`` (plain text, or
    a tool-call parser), so calls are never read from the thinking."""

    def __init__(self, fmt: ReasoningFormat, inner: DeltaSource) -> None:
        self._split = ReasoningSplitter(fmt)
        self._inner = inner

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        reasoning, answer = self._split.feed(piece, final)
        deltas = [reasoning_delta(reasoning)] if reasoning else []
        if answer or final:
            deltas += self._inner.feed(answer, final)
        return deltas

    @property
    def has_calls(self) -> bool:
        return self._inner.has_calls

    @property
    def reasoning(self) -> str:
        return self._split.reasoning

    def message(self) -> dict[str, Any]:
        message = dict(self._inner.message())
        if self._split.reasoning:
            message.update(reasoning_delta(self._split.reasoning))
        return message


class TextDeltas:
    """The chat deltas of plain text: each output's text is one content delta (no tools, no parsing)."""

    has_calls = False

    def __init__(self) -> None:
        self._content: list[str] = []

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        if not piece:
            return []
        self._content.append(piece)
        return [{"content": piece}]

    def message(self) -> dict[str, Any]:
        return {"content": "".join(self._content), "tool_calls": None}


class EchoedDeltas:
    """A DeltaSource whose output starts with ``echo`` (the continued assistant message, vLLM's ``echo``): the
    echoed text is read like the rest (it may hold the start of the thinking, or of a call)."""

    def __init__(self, echo: str, inner: DeltaSource) -> None:
        self._echo = echo
        self._inner = inner

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        echo, self._echo = self._echo, ""
        return self._inner.feed(echo + piece, final)

    @property
    def has_calls(self) -> bool:
        return self._inner.has_calls

    def message(self) -> dict[str, Any]:
        return self._inner.message()
