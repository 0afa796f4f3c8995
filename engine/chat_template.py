"""Chat templates: render a model's Jinja ``chat_template`` (tokenizer_config.json) in a sandbox.

Mirrors transformers' apply_chat_template environment (trim_blocks, lstrip_blocks, loopcontrols,
tojson, raise_exception, strftime_now). No onnxruntime import.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.types import InvalidRequestError, ModelLoadError

# Special-token names from tokenizer_config.json that templates commonly reference.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")

# Built-in templates for ``--chat-template NAME`` (a model without one, e.g. a base model, or a wrong one).
BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Gemma's turns: no system role (its text opens the first user turn), "model" for the assistant.
    "gemma": (
        "{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
        "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
        "{% for message in turns %}"
        "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
        "{% if loop.first %}{{ system }}{% endif %}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "phi3": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
}
NO_TEMPLATE_MESSAGE = (
    "this model has no chat template, so /v1/chat/completions cannot format messages: send a plain prompt to "
    f"/v1/completions, or start the server with --chat-template (a Jinja file or one of: {', '.join(BUILTIN_TEMPLATES)})"
)


def chat_template_source(value: str) -> str:
    """The Jinja source for ``--chat-template``: a built-in name (``BUILTIN_TEMPLATES``) or a file path.

    Raises:
        ModelLoadError: neither a built-in name nor a readable file.
    """
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"--chat-template {value!r} is neither a built-in template "
                             f"({', '.join(BUILTIN_TEMPLATES)}) nor a readable Jinja file: {exc}") from exc
# A tool whose name appears in the rendered prompt only if the template renders the `tools` variable.
_PROBE_TOOL_NAME = "ortserve_probe_tool_7f3a"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_TOOL_NAME, "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special tokens it may reference.

    Usage::

        template = ChatTemplate.from_tokenizer_config(json.load(open("tokenizer_config.json")))
        prompt = template.render([{"role": "user", "content": "Hi"}])

    Args:
        source: the Jinja source, or None when the model ships no template (``render`` then raises).
        special_tokens: e.g. ``{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}``.
        tool_source: an optional separate template used when ``tools`` are given.
    Raises:
        ModelLoadError: the template does not compile.
    """

    def __init__(self, source: str | None, special_tokens: Mapping[str, str] | None = None,
                 tool_source: str | None = None) -> None:
        self.source = source
        self._tool_source = tool_source
        self.special_tokens = dict(special_tokens or {})
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source) if source else None
            self._tool_template = env.from_string(tool_source) if tool_source else None
        except jinja2.TemplateError as exc:
            raise ModelLoadError(f"the model's chat_template does not compile: {exc}") from exc

    @classmethod
    def from_tokenizer_config(cls, config: Mapping[str, Any]) -> ChatTemplate:
        """Build from a parsed tokenizer_config.json (``chat_template`` a string or a named list)."""
        raw = config.get("chat_template")
        source, tool_source = raw, None
        if isinstance(raw, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
            source = named.get("default") or next(iter(named.values()), None)
            tool_source = named.get("tool_use")
        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if isinstance(value, Mapping):  # AddedToken serialized as a dict
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(source if isinstance(source, str) else None, special, tool_source)

    @property
    def available(self) -> bool:
        return self._template is not None

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the template renders tool definitions passed as ``tools`` (decided once per model).

        NOTE(tools): decided by rendering a probe tool and looking for its name in the prompt, as llama.cpp's
        minja does: reading the Jinja source for "tools" would also match templates that only mention it.
        """
        template = self._tool_template or self._template
        if template is None:
            return False
        try:
            out = template.render(messages=[{"role": "user", "content": "probe"}], tools=[_PROBE_TOOL],
                                  add_generation_prompt=True, **self.special_tokens)
        except Exception:  # noqa: BLE001 - any failure means the template cannot take tools
            return False
        return _PROBE_TOOL_NAME in out

    @property
    def tool_source(self) -> str:
        """The Jinja source that renders tool requests (the tool_use template when the model has one)."""
        return self._tool_source or self.source or ""

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False, **extra: Any) -> str:
        """Render a conversation into the prompt text.

        Args:
            messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}]``.
            tools: OpenAI-style tool definitions, passed through as the ``tools`` variable.
            add_generation_prompt: end with the assistant turn's opening (e.g. ``<|im_start|>assistant\\n``).
            continue_final_message: end right after the last message's content (an assistant prefill the answer
                continues), without the end-of-turn markup the template writes after it.
            extra: more template variables (e.g. ``documents``, ``enable_thinking``).
        Returns:
            The prompt text (special tokens as text; tokenize it without adding special tokens).
        Raises:
            InvalidRequestError: no template, or the template rejected the messages (raise_exception,
                wrong types, sandbox violations).
        """
        template = self._tool_template if tools and self._tool_template is not None else self._template
        if template is None:
            raise InvalidRequestError(NO_TEMPLATE_MESSAGE, param="messages")
        variables = {**self.special_tokens, **extra}
        try:
            text = template.render(messages=list(messages), tools=list(tools) if tools else None,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template error: {exc}", param="messages") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise InvalidRequestError(f"chat template could not render these messages: {exc}",
                                      param="messages") from exc
        return _continued(text, messages) if continue_final_message else text


def _continued(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``text`` cut right after the last message's content (as transformers' ``continue_final_message``).

    NOTE(template): the content is found from the end, so the same words earlier in the conversation do not
    matter; a template that trims the content is matched by its trimmed form.
    """
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content:
        raise InvalidRequestError("continue_final_message needs a last message with text content to continue",
                                  param="messages", code="invalid_value")
    for candidate in (content, content.strip()):
        at = text.rfind(candidate) if candidate else -1
        if at >= 0:
            return text[:at + len(candidate)]
    raise InvalidRequestError("continue_final_message: the chat template does not write the last message's "
                              "content as it is, so the answer cannot continue it", param="messages",
                              code="invalid_value")
