"""Record the tool schemas each installed agent release sends, into tests/data/agent_tools/ (the lenient-schema
test compiles every one of them: tests/unit/server/test_agent_tool_schemas.py).

Each agent runs its recipe (agent_recipes.py) against a stand-in server on 127.0.0.1 that records every request and
answers each POST with a 400 in its API's own shape, so the agent stops after its first request; GET /v1/models
lists the model. What every agent asked for (method and path) is saved beside its tools.

Usage: .venv/bin/python -m tests.integration.agents.capture_tools [NAME@VERSION ...]   (default: every release)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.integration.agents.agent_recipes import PIP_AGENTS, RECIPES, Place, manifest, scratch_folder

OUT = Path(__file__).resolve().parents[2] / "data" / "agent_tools"
MODEL = "qwen2.5-coder-1.5b"


class _Recorder(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self.seen.append({"method": "GET", "path": self.path})
        if self.path.rstrip("/").endswith("/models"):
            self._answer(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "ortserve"}]})
        else:
            self._answer(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        self.seen.append({"method": "POST", "path": self.path, "body": body})
        message = "captured by tests/integration/agents/capture_tools.py"
        if self.path.startswith("/v1/messages"):
            self._answer(400, {"type": "error", "error": {"type": "invalid_request_error", "message": message}})
        else:
            self._answer(400, {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                         "code": None}})


def tools_of(path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Each tool of a request as {"name", "parameters"} (its JSON Schema as sent; descriptions left out)."""
    out = []
    for tool in body.get("tools") or []:
        if "function" in tool:  # chat completions
            out.append({"name": tool["function"]["name"], "parameters": tool["function"].get("parameters"),
                        **({"strict": tool["function"]["strict"]} if "strict" in tool["function"] else {})})
        elif "input_schema" in tool:  # messages
            out.append({"name": tool["name"], "parameters": tool["input_schema"]})
        elif tool.get("type") == "function":  # responses
            out.append({"name": tool["name"], "parameters": tool.get("parameters"),
                        **({"strict": tool["strict"]} if "strict" in tool else {})})
        elif tool.get("type") == "namespace":  # responses: a namespace of functions (Codex)
            out += [{"name": t["name"], "namespace": tool.get("name"), "parameters": t.get("parameters"),
                     **({"strict": t["strict"]} if "strict" in t else {})}
                    for t in tool.get("tools") or [] if t.get("type") == "function"]
    return out


def capture(entry: str, *variant: str) -> dict[str, Any]:
    name, version = entry.split("@", 1)
    _Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            scratch, home = scratch_folder(Path(tmp))
            place = Place(f"http://127.0.0.1:{server.server_address[1]}", MODEL, "sk-capture", scratch, home)
            run = RECIPES[name](version, place, *variant)
            try:
                done = subprocess.run(run.cmd, cwd=scratch, env=run.env, stdin=subprocess.DEVNULL,
                                      capture_output=True, text=True, timeout=120, check=False)
                tail = (done.stdout + done.stderr)[-600:]
            except subprocess.TimeoutExpired:
                tail = "(still running after 120 s)"
    finally:
        server.shutdown()
    tools: dict[str, dict[str, Any]] = {}
    for request in _Recorder.seen:
        if request["method"] == "POST" and isinstance(request.get("body"), dict):
            for tool in tools_of(request["path"], request["body"]):
                tools.setdefault(f"{tool.get('namespace')}.{tool['name']}", tool)
    return {"agent": name, "version": version, "variant": list(variant),
            "requests": sorted({f"{r['method']} {r['path'].split('?')[0]}" for r in _Recorder.seen}),
            "tools": list(tools.values()), "_exit": tail}


def main(entries: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    jobs = [(e,) for e in entries] if entries else \
        [(e,) for e in manifest("npm")] + [(e,) for e in manifest("pip") if e.split("@")[0] != "smolagents"] + \
        [(e, kind) for e in manifest("pip") if e.split("@")[0] == "smolagents" for kind in ("ToolCallingAgent",
                                                                                         "CodeAgent")]
    for job in jobs:
        result = capture(*job)
        tail = result.pop("_exit")
        label = job[0] + "".join(f"-{v}" for v in job[1:])
        print(f"{label}: {len(result['tools'])} tools; requests {result['requests']}", file=sys.stderr)
        if not result["tools"]:
            print(f"  (no tools captured) {tail!r}", file=sys.stderr)
            if result["agent"] not in PIP_AGENTS:
                continue
        (OUT / f"{label}.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
