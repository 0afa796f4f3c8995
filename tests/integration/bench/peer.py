"""A tiny real OpenAI-compatible streaming server, the bench tests' peer (not a model of ortserve).

Run as a script: `python peer.py --port N`. Behaviour is chosen per request by the `model` string,
"peer;ttft=0.08;itl=0.02;fail429=3;drop=4", so one process serves every test:
  ttft=S     delay before the first content chunk (s)      itl=S      delay between content chunks (s)
  fail429=K  every K-th request of this model gets a 429    fail500=K  ... a 500
  drop=K     every K-th request's connection is cut after `drop_after` content chunks (default 3)
  cut=K      every K-th request's stream ends cleanly but with no finish_reason and no [DONE]
  stall=K    every K-th request waits 60 s before its first chunk
  errevent=K every K-th request sends an {"error": ...} event after its first chunk
  usage=0    never send the usage chunk
Each content chunk is exactly one "token" ("w17 "); max_tokens of them are sent (the peer ignores EOS
by construction). prompt_tokens is the whitespace word count of the prompt. GET /peer/stats?model=M
returns what the peer saw for that model string.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


class _ModelStats:
    def __init__(self) -> None:
        self.num_requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[dict] = []


def _parse(model: str) -> dict[str, float]:
    opts: dict[str, float] = {"ttft": 0.0, "itl": 0.0, "drop_after": 3, "usage": 1}
    for part in model.split(";")[1:]:
        key, _, value = part.partition("=")
        opts[key.strip()] = float(value)
    return opts


def _every(opts: dict[str, float], key: str, n: int) -> bool:
    k = int(opts.get(key, 0))
    return k > 0 and n % k == 0


def create_app() -> FastAPI:
    app = FastAPI()
    stats: dict[str, _ModelStats] = {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "peer", "object": "model", "created": 0, "owned_by": "test"}]}

    @app.get("/peer/stats")
    async def peer_stats(model: str) -> dict:
        s = stats.get(model, _ModelStats())
        return {"num_requests": s.num_requests, "max_in_flight": s.max_in_flight, "requests": s.requests}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        model = body.get("model", "peer")
        opts = _parse(model)
        s = stats.setdefault(model, _ModelStats())
        s.num_requests += 1
        n = s.num_requests
        prompt = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        s.requests.append({"n": n, "t_arrival": time.time(), "max_tokens": body.get("max_tokens"),
                           "ignore_eos": body.get("ignore_eos"), "min_tokens": body.get("min_tokens"),
                           "stream_options": body.get("stream_options"), "temperature": body.get("temperature"),
                           "prompt_words": len(prompt.split()), "prompt": prompt})
        if _every(opts, "fail429", n):
            return JSONResponse({"error": {"message": "busy", "type": "rate_limit", "code": 429}}, status_code=429,
                                headers={"Retry-After": "1"})
        if _every(opts, "fail500", n):
            return JSONResponse({"error": {"message": "boom", "type": "server_error", "code": 500}},
                                status_code=500)
        max_tokens = int(body.get("max_tokens") or 16)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) and opts["usage"] != 0
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(content: str | None, finish: str | None = None, *, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": content or "", "finish_reason": finish, "logprobs": None}
            data = {"id": f"peer-{n}", "object": obj, "created": 0, "model": model, "choices": [choice]}
            return f"data: {json.dumps(data)}\n\n"

        async def events():
            s.in_flight += 1
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
            try:
                if chat:
                    yield chunk(None, role=True)
                await asyncio.sleep(60.0 if _every(opts, "stall", n) else opts["ttft"])
                for i in range(max_tokens):
                    if i > 0:
                        await asyncio.sleep(opts["itl"])
                    if _every(opts, "drop", n) and i == int(opts["drop_after"]):
                        raise ConnectionAbortedError("peer drops this stream on purpose")
                    if _every(opts, "errevent", n) and i == 1:
                        yield f"data: {json.dumps({'error': {'message': 'peer failed mid-stream'}})}\n\n"
                        return
                    yield chunk(f"w{i} ")
                if _every(opts, "cut", n):
                    return
                yield chunk(None, "length")
                if include_usage:
                    usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": max_tokens,
                             "total_tokens": len(prompt.split()) + max_tokens}
                    data = {"id": f"peer-{n}", "object": obj, "created": 0, "model": model, "choices": [],
                            "usage": usage}
                    yield f"data: {json.dumps(data)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                s.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level="critical", access_log=False)
