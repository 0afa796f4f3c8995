"""How a chat request becomes prompt text: the template controls (vLLM's names) and what the rendered prompt says
about the output (its reasoning format, the echoed prefill).

Shared by chat, Responses, Messages and /tokenize. No onnxruntime import; the caller runs it in a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.types import InvalidRequestError
from server.engine_client import ChatTemplateLike
from server.reasoning import ReasoningFormat, reasoning_format

# Template variables a request's chat_template_kwargs may not replace (the renderer sets them itself).
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                         "bos_token", "eos_token", "pad_token", "unk_token"})


@dataclass(frozen=True)
class TemplateOptions:
    """The chat template controls of one request.

    Attributes:
        add_generation_prompt: end the prompt with the assistant turn's opening (default).
        continue_final_message: the answer continues the last (assistant) message instead.
        echo: the answer starts with that last assistant message's text (vLLM's chat ``echo``).
        kwargs: more template variables (``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``, and
            ``reasoning_effort``).
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                                      "True: the answer either starts a new assistant turn or continues the last "
                                      "message", param="continue_final_message", code="invalid_value")
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(self.kwargs))
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved} (the request's own fields "
                                      "set them)", param="chat_template_kwargs", code="invalid_value")


@dataclass(frozen=True)
class RenderedPrompt:
    """The prompt text and what it tells about the output.

    Attributes:
        text: the rendered prompt.
        echo: text the answer starts with (the continued assistant message, with ``echo``), else "".
        reasoning: the thinking format of the answer (None: the model does not think, or not in a known way);
            with an echo, as it stands where the echoed text starts.
        generation: the same where the generated tokens start (after the echoed text): what a grammar allows.
    """

    text: str
    echo: str = ""
    reasoning: ReasoningFormat | None = None
    generation: ReasoningFormat | None = None


def render_prompt(template: ChatTemplateLike, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  options: TemplateOptions) -> RenderedPrompt:
    """Render ``messages`` with the request's template controls.

    Raises:
        InvalidRequestError: the template failed, or continue_final_message has no assistant message to continue.
    """
    last = messages[-1] if messages else {}
    continuing = options.continue_final_message
    if continuing and last.get("role") != "assistant":
        raise InvalidRequestError("continue_final_message needs the last message to be the assistant's (the text "
                                  "the answer continues)", param="continue_final_message", code="invalid_value")
    text = template.render(messages, tools=tools, add_generation_prompt=options.add_generation_prompt,
                           continue_final_message=continuing, **options.kwargs)
    # NOTE(server): as vLLM, echo repeats the last message when it is the assistant's (the prefill continued).
    echo = (last.get("content") or "") if options.echo and last.get("role") == "assistant" else ""
    # NOTE(reasoning): the answer is then the echoed text plus the output, so the thinking state is the one
    # before the echoed text.
    head = text[:len(text) - len(echo)] if echo and continuing and text.endswith(echo) else text
    source = template.source or ""
    generation = reasoning_format(source, text)
    return RenderedPrompt(text, echo, reasoning_format(source, head) if head != text else generation, generation)
