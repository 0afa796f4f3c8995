"""vLLM's /tokenize and /detokenize wire format: a text prompt, or a chat (rendered by the chat template exactly
as /v1/chat/completions renders it), to token ids and back.

Must not import onnxruntime or any engine module other than engine.types.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from engine.types import InvalidRequestError
from server.openai.base import OpenAIBaseModel
from server.openai.protocol import ChatCompletionRequest, chat_request_from

_CHAT_FIELDS = ("model", "messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                "add_generation_prompt", "continue_final_message", "reasoning_effort")


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: either ``prompt`` (text) or ``messages`` (a chat, with the chat request's template fields)."""

    model: str | None = Field(None, description="The served model name (see GET /v1/models).")
    prompt: str | None = Field(None, description="Text to tokenize (the completions form).")
    messages: list[Any] | None = Field(None, description="A chat to render and tokenize (the chat form).")
    add_special_tokens: bool | None = Field(None, description="Add the tokenizer's special tokens (BOS) around "
                                            "the text; default true for a prompt, false for a chat (its template "
                                            "writes them).")
    return_token_strs: bool = Field(False, description="Also return each token's string.")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("send either 'prompt' (text) or 'messages' (a chat)", param="prompt",
                                      code="invalid_value")
        return self

    def chat(self) -> ChatCompletionRequest:
        """The chat request whose prompt this tokenizes (the same fields, checked the same way)."""
        body = {name: getattr(self, name) for name in _CHAT_FIELDS if getattr(self, name) is not None}
        return chat_request_from(body, lambda param: param, "messages")


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int] = Field(description="Token ids to turn back into text.")


def tokenize_response(token_ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    return {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids, "token_strs": token_strs}
