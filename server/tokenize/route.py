"""POST /tokenize and POST /detokenize in vLLM's shape; the chat form renders the template as chat does."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request

from engine.types import InvalidRequestError
from server.tokenize.protocol import DetokenizeRequest, TokenizeRequest, tokenize_response
from server.http.prepare import chat_prompt, completion_prompt_ids, engine_for

router = APIRouter(tags=["tokenize"])


@router.post("/tokenize", summary="Tokenize a prompt or a chat (vLLM's shape)")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    _, engine = await engine_for(request, body.model)
    if body.prompt is not None:
        if body.add_special_tokens is False:
            ids = await anyio.to_thread.run_sync(engine.tokenizer.encode, body.prompt)
        else:
            ids = await completion_prompt_ids(engine, body.prompt)
    else:
        chat = body.chat()
        _, rendered, ids = await chat_prompt(engine, chat.template_messages(), chat.tool_request(),
                                             chat.template_options())
        if body.add_special_tokens:
            ids = await anyio.to_thread.run_sync(lambda: engine.tokenizer.encode(rendered.text,
                                                                                 add_special_tokens=True))
    strs = [engine.tokenizer.decode([i], skip_special_tokens=False) for i in ids] if body.return_token_strs else None
    return tokenize_response(list(ids), engine.max_model_len, strs)


@router.post("/detokenize", summary="Token ids back to text (vLLM's shape)")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    _, engine = await engine_for(request, body.model)
    for index, token_id in enumerate(body.tokens):
        if not 0 <= token_id < engine.vocab_size:
            raise InvalidRequestError(f"tokens[{index}] must be a token id in [0, {engine.vocab_size}), got "
                                      f"{token_id}", param=f"tokens[{index}]", code="invalid_value")
    # NOTE(server): special tokens stay in the text (as vLLM's /detokenize keeps them): a rendered prompt
    # round-trips.
    text = await anyio.to_thread.run_sync(lambda: engine.tokenizer.decode(body.tokens, skip_special_tokens=False))
    return {"prompt": text}
