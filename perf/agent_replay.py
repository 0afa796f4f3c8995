"""Why an agent's run went as it did: record every request a real agent sends to a running server, then replay any
of them with the model's log-probabilities (issue 46; docs/agents.md quotes what this prints).

    # a running server: ortserve serve --model qwen2.5-coder-1.5b --max-batch 2 --default-temperature 0 --api-key K
    .venv/bin/python -m perf.agent_replay record codex@0.171.0 --base http://127.0.0.1:8000 --key K --out codex.jsonl
    .venv/bin/python -m perf.agent_replay replay codex.jsonl --base http://127.0.0.1:8000 --key K --turn 2 --tokens 30

``record`` runs the agent's own recipe (tests/integration/agents/agent_recipes.py: its command, environment and config in a
scratch folder with hello.py, the task of the tests) against a recording proxy in front of the server; each request
(path and body) and the server's answer (as the bytes it sent) become one JSON line. ``replay`` sends one recorded
request again as a chat completion (a Messages or Responses request converted the way the server converts it),
greedy and not streamed, with ``logprobs`` and ``top_logprobs`` 5, and prints each generated token with the five
best; ``--prefix`` continues after a forced start of the answer instead (the rendered prompt through /tokenize,
then /v1/completions). The log-probabilities are the model's own, before the repetition penalty of its
generation_config (which greedy decoding applies). Nothing here is imported by the product or its tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive", "accept-encoding"}


def _proxy_handler(upstream: str, out: Path, lock: threading.Lock) -> type[BaseHTTPRequestHandler]:
    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _forward(self, method: str) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else b""
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            answer = bytearray()
            with httpx.Client(timeout=None) as client, \
                    client.stream(method, upstream + self.path, content=raw, headers=headers) as r:
                self.send_response(r.status_code)
                for key, value in r.headers.items():
                    if key.lower() not in HOP_HEADERS and key.lower() != "content-encoding":
                        self.send_header(key, value)
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for chunk in r.iter_raw():
                    answer += chunk
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                status = r.status_code
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            with lock, out.open("a") as f:
                f.write(json.dumps({"method": method, "path": self.path, "status": status, "body": body,
                                    "answer": answer.decode(errors="replace")}) + "\n")

        def do_GET(self) -> None:  # noqa: N802
            self._forward("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._forward("POST")

    return Proxy


def record(entry: str, base: str, key: str, out: Path, model: str, variant: list[str], timeout_s: float) -> None:
    """Run one agent release's recipe against a recording proxy in front of ``base``."""
    from tests.integration.agents.agent_recipes import RECIPES, Place, run_to_end, scratch_folder

    name, version = entry.split("@", 1)
    out.write_text("")
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _proxy_handler(base.rstrip("/"), out, threading.Lock()))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            scratch, home = scratch_folder(Path(tmp))
            run = RECIPES[name](version, Place(f"http://127.0.0.1:{proxy.server_address[1]}", model, key, scratch,
                                               home), *variant)
            done = run_to_end(run.cmd, scratch, run.env, timeout_s)
            print(f"exit {done.returncode}\nstdout: {done.stdout[-1500:]}\nstderr: {done.stderr[-800:]}")
    finally:
        proxy.shutdown()
    for index, line in enumerate(out.read_text().splitlines()):
        seen = json.loads(line)
        print(f"{index}: {seen['method']} {seen['path']} -> {seen['status']}")


def proxy(base: str, port: int, out: Path) -> None:
    """Only the recording proxy, on ``port`` in front of ``base``, until stopped (a client that is no recipe's,
    such as Open WebUI: perf/openwebui_check.sh's RECORD)."""
    out.write_text("")
    server = ThreadingHTTPServer(("127.0.0.1", port), _proxy_handler(base.rstrip("/"), out, threading.Lock()))
    server.serve_forever()


def chat_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A recorded request as the chat completion the server runs for it."""
    if path.startswith("/v1/chat/completions"):
        return dict(body)
    if path.startswith("/v1/messages"):
        from server.anthropic.protocol import MessagesRequest
        chat = MessagesRequest.model_validate(body).to_chat()
    elif path.startswith("/v1/responses"):
        from server.responses.protocol import ResponsesRequest
        chat = ResponsesRequest.model_validate(body).to_chat_request()
    else:
        raise SystemExit(f"no replay for {path}")
    return chat.model_dump(exclude_none=True, by_alias=True)


def show(tokens: list[tuple[str, float, list[tuple[str, float]]]]) -> None:
    for token, logprob, top in tokens:
        print(f"{token!r:>24} {logprob:7.2f}   " + "  ".join(f"{t!r} {lp:.2f}" for t, lp in top))


def replay(path: Path, base: str, key: str, turn: int, num_tokens: int, prefix: str | None) -> None:
    requests = [json.loads(line) for line in path.read_text().splitlines()]
    posts = [r for r in requests if r["method"] == "POST"]
    seen = posts[turn]
    body = chat_body(seen["path"], seen["body"])
    for field in ("stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p"):
        body.pop(field, None)
    headers = {"authorization": f"Bearer {key}"}
    client = httpx.Client(base_url=base.rstrip("/"), headers=headers, timeout=None)
    if prefix is None:
        r = client.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": num_tokens,
                                                      "temperature": 0, "logprobs": True, "top_logprobs": 5})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        print(f"turn {turn} ({seen['path']}): {r.json()['usage']}; finish {choice['finish_reason']}")
        print(f"content: {choice['message'].get('content')!r}\ntool_calls: {choice['message'].get('tool_calls')}")
        show([(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top_logprobs"]])
              for t in choice["logprobs"]["content"]])
        return
    rendered = client.post("/tokenize", json={**{k: v for k, v in body.items() if k in ("model", "messages", "tools",
                                                                                          "tool_choice")},
                                              "return_token_strs": True})
    rendered.raise_for_status()
    prompt = "".join(rendered.json()["token_strs"]) + prefix
    r = client.post("/v1/completions", json={"model": body.get("model"), "prompt": prompt, "max_tokens": num_tokens,
                                             "temperature": 0, "logprobs": 5})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    print(f"turn {turn} after {prefix!r}: {choice['text']!r}")
    show([(t, l, sorted(top.items(), key=lambda kv: -kv[1]))
          for t, l, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run an agent's recipe through a recording proxy")
    rec.add_argument("entry", help="NAME@VERSION, as in the Makefile's AGENT_CLIS / AGENT_PIPS")
    rec.add_argument("variant", nargs="*", help="the recipe's extra arguments (smolagents: ToolCallingAgent)")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--timeout-s", type=float, default=1800)
    rep = sub.add_parser("replay", help="one recorded request again, with log-probabilities")
    rep.add_argument("file", type=Path)
    rep.add_argument("--turn", type=int, default=0, help="which POST of the recording (0: the first)")
    rep.add_argument("--tokens", type=int, default=30)
    rep.add_argument("--prefix", help="force the answer's start (rendered prompt + PREFIX through /v1/completions)")
    pro = sub.add_parser("proxy", help="only the recording proxy, until stopped")
    pro.add_argument("--port", type=int, required=True)
    pro.add_argument("--out", type=Path, required=True)
    for p in (rec, rep, pro):
        p.add_argument("--base", default="http://127.0.0.1:8000")
        p.add_argument("--key", default="")
        p.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = parser.parse_args()
    if args.command == "proxy":
        proxy(args.base, args.port, args.out)
    elif args.command == "record":
        record(args.entry, args.base, args.key, args.out, args.model, args.variant, args.timeout_s)
    else:
        replay(args.file, args.base, args.key, args.turn, args.tokens, args.prefix)


if __name__ == "__main__":
    sys.exit(main())
