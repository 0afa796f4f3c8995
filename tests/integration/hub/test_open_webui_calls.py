"""Open WebUI's Ollama connection, replayed: the calls its backend makes to an Ollama server and the response fields
it reads, against a model hub. Open WebUI itself is not run here (it is heavy to install); this test follows its
code (open-webui/open-webui, backend/open_webui/routers/ollama.py and utils/models.py):

- adding a connection, ``verify_connection``: GET {url}/api/version with the key as a Bearer token; its ``version``
  is compared as integers (``re.sub(r"^v|-.*", "", version).split(".")``, in ``get_ollama_versions``);
- listing, ``get_all_models``: GET {url}/api/tags, each model keyed by ``model`` (merged across connections), then
  GET {url}/api/ps, whose ``name`` and ``expires_at`` (``datetime.fromisoformat``) mark the loaded ones; the model
  list (``get_all_base_models``) shows ``id = model["model"]`` and ``name = model["name"]``;
- chatting, ``generate_chat_completion``: ":latest" appended to a name without a tag, the name looked up among the
  listed ones (``get_ollama_url``: 400 MODEL_NOT_FOUND otherwise), then POST {url}/api/chat streamed as NDJSON; the
  last line's counts and durations become its usage (utils/response.py: "prompt_token/s" is prompt_eval_count
  over prompt_eval_duration);
- unloading, ``unload_model``: POST {url}/api/generate {"model", "keep_alive": 0, "prompt": ""}.

perf/openwebui_check.sh runs the real Open WebUI against a real hub (docs/perf/open-webui.md).

Real parts: a real server (two chat models, each in its engine process: the tiny synthetic one twice, no
download) behind an API key.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from server.app import create_app
from server.settings import ModelSpec
from tests.integration.server.conftest import api_settings, serve_app

KEY = "owui-key-0123"


class OpenWebUIConnection:
    """The calls Open WebUI's backend makes to one Ollama connection, with the fields it reads."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.models: dict[str, dict] = {}  # request.app.state.OLLAMA_MODELS: model["model"] -> model

    def _get(self, path: str) -> dict:
        r = httpx.get(f"{self.url}{path}", timeout=30, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {self.key}"})
        assert r.status_code == 200, (path, r.status_code, r.text)
        return r.json()

    def verify(self) -> tuple[int, ...]:
        data = self._get("/api/version")
        return tuple(map(int, re.sub(r"^v|-.*", "", data["version"]).split(".")))

    def get_all_models(self) -> list[dict]:
        response = self._get("/api/tags")
        merged: dict[str, dict] = {}
        for model in response.get("models", []):
            model["urls"] = [0]
            merged.setdefault(model["model"], model)
        loaded = self._get("/api/ps")
        expires = {m["name"]: m["expires_at"] for m in loaded["models"] if "expires_at" in m}
        for m in merged.values():
            if m["name"] in expires:
                m["expires_at"] = int(datetime.fromisoformat(expires[m["name"]]).timestamp())
        self.models = merged
        return [{"id": m["model"], "name": m["name"], "object": "model", "owned_by": "ollama", "ollama": m}
                for m in merged.values()]

    def chat(self, model: str, content: str) -> list[dict]:
        if ":" not in model:
            model = f"{model}:latest"
        assert model in self.models, f"Open WebUI: model {model!r} not found (get_ollama_url)"
        payload = {"model": model, "messages": [{"role": "user", "content": content}], "stream": True,
                   "options": {"temperature": 0, "num_predict": 6}}
        with httpx.stream("POST", f"{self.url}/api/chat", content=json.dumps(payload), timeout=120,
                          headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"}) as r:
            assert r.status_code == 200, r.read()
            return [json.loads(line) for line in r.iter_lines() if line.strip()]

    def unload(self, model: str) -> dict:
        if ":" not in model:
            model = f"{model}:latest"
        assert model in self.models, f"Open WebUI: model {model!r} not found (unload_model)"
        r = httpx.post(f"{self.url}/api/generate", timeout=60, headers={"Authorization": f"Bearer {self.key}"},
                       content=json.dumps({"model": model, "keep_alive": 0, "prompt": ""}))
        assert r.status_code == 200, r.text
        return r.json()


def test_open_webui_lists_loads_chats_and_unloads(tiny_model: Path) -> None:
    settings = api_settings(tiny_model, served_model_name="tiny-a", api_key=KEY, max_batch=2,
                            models=[ModelSpec(model=str(tiny_model), name="tiny-b")])
    with serve_app(create_app(settings)) as running:
        owui = OpenWebUIConnection(running.base, KEY)
        assert owui.verify() >= (0, 1, 0)
        with pytest.raises(AssertionError, match="401"):
            OpenWebUIConnection(running.base, "wrong").verify()  # a wrong key: the connection is refused

        listed = owui.get_all_models()
        assert [(m["id"], m["name"]) for m in listed] == [("tiny-a:latest", "tiny-a:latest"),
                                                            ("tiny-b:latest", "tiny-b:latest")]
        assert not any("expires_at" in m["ollama"] for m in listed)  # nothing loaded yet
        # its picker's tooltip shows size / 2**30 GB: the model's bytes on disk, as Ollama's /api/tags gives them,
        # the same loaded or not
        on_disk = sum(p.stat().st_size for p in tiny_model.iterdir() if p.is_file())
        assert [m["ollama"]["size"] for m in listed] == [on_disk, on_disk]
        assert all(m["ollama"]["details"]["family"] for m in listed)

        # the model id Open WebUI's list shows, as its chat sends it
        lines = owui.chat("tiny-b:latest", "hi")
        assert lines[-1]["done"] and not any(line["done"] for line in lines[:-1])
        assert all("content" in line["message"] for line in lines)
        assert lines[-1]["eval_count"] >= 1
        # its "prompt_token/s" is prompt_eval_count / prompt_eval_duration (utils/response.py,
        # convert_response_ollama_to_openai): this first request's load is load_duration's, not the prompt's
        final = lines[-1]
        assert final["load_duration"] > 0 and final["prompt_eval_duration"] > 0 and final["eval_duration"] > 0
        assert final["load_duration"] + final["prompt_eval_duration"] + final["eval_duration"] \
            <= final["total_duration"]
        listed = {m["id"]: m for m in owui.get_all_models()}
        expires = listed["tiny-b:latest"]["ollama"].get("expires_at")
        assert isinstance(expires, int) and expires > datetime.now().timestamp()  # loaded, until its keep-alive
        assert "expires_at" not in listed["tiny-a:latest"]["ollama"]
        assert listed["tiny-b:latest"]["ollama"]["size"] == on_disk
        # /api/ps's size is the memory a loaded model holds (weights, KV and its process: our estimate)
        ps = owui._get("/api/ps")["models"]
        assert [m["name"] for m in ps] == ["tiny-b:latest"] and ps[0]["size"] > on_disk

        owui.unload("tiny-b")  # Open WebUI's own canonical name: "tiny-b:latest"
        assert all("expires_at" not in m["ollama"] for m in owui.get_all_models())


def test_open_webui_shows_a_model_before_its_first_load(tiny_model: Path) -> None:
    """Its model page asks /api/show (proxied as POST {url}/api/show {"model"}) of a listed model, loaded or not:
    a known embedding model's capabilities are known before it is pulled or loaded."""
    settings = api_settings(tiny_model, served_model_name="tiny-a",
                            models=[ModelSpec(model="all-minilm-l6-v2", name="minilm")])
    with serve_app(create_app(settings)) as running:
        shown = {}
        for model in ("tiny-a:latest", "minilm:latest"):
            r = httpx.post(f"{running.base}/api/show", json={"model": model}, timeout=30)
            assert r.status_code == 200, r.text
            shown[model] = r.json()["capabilities"]
        assert shown == {"tiny-a:latest": ["completion", "tools"], "minilm:latest": ["embedding"]}
        assert httpx.get(f"{running.base}/health", timeout=10).json()["models"] == []  # nothing was loaded


def test_open_webui_sends_tool_results_by_their_call_ids(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The second request of Open WebUI's native tool calling over its Ollama connection (perf/openwebui_check.sh
    TOOLS=1 runs the real one): its OpenAI-shaped conversation converted to /api/chat (utils/payload.py,
    convert_messages_openai_to_ollama): the assistant's calls keep their ids (Open WebUI makes one for each call
    of our answer, utils/response.py), arguments as objects, content ""; each result is a "tool" message with the
    call's ``tool_call_id`` and no ``tool_name``. Two calls of one tool: each result answers its own call (both
    used to be matched to the tool's last call). (Open WebUI sends its ``tools`` too; left out here: with them the
    prompt outgrows the tiny model's 256-token context.)"""
    settings = api_settings(tiny_model, served_model_name="tiny-a")
    messages = [
        {"role": "user", "content": "Read a.py and b.py."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"index": 0, "id": "call_0b5e", "function": {"name": "read_file", "arguments": {"path": "a.py"}}},
            {"index": 1, "id": "call_77c1", "function": {"name": "read_file", "arguments": {"path": "b.py"}}}]},
        {"role": "tool", "content": "print(1)\n", "tool_call_id": "call_0b5e"},
        {"role": "tool", "content": "print(22)\n", "tool_call_id": "call_77c1"},
    ]
    with serve_app(create_app(settings)) as running, caplog.at_level(logging.INFO, logger="server.http.prepare"):
        r = httpx.post(f"{running.base}/api/chat", timeout=120, json={
            "model": "tiny-a:latest", "messages": messages, "stream": False,
            "options": {"temperature": 0, "num_predict": 4}})
        assert r.status_code == 200, r.text
        assert r.json()["done"] and r.json()["message"]["role"] == "assistant"
        # a tool_call_id that names no call of the conversation (an Ollama client's own): matched as before
        r = httpx.post(f"{running.base}/api/chat", timeout=120, json={
            "model": "tiny-a:latest", "stream": False,
            "messages": [*messages[:3], {**messages[3], "tool_call_id": "call_elsewhere"}],
            "options": {"temperature": 0, "num_predict": 4}})
        assert r.status_code == 200, r.text
    received = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("tool results")]
    assert received == ["tool results received: call_0b5e (9 chars); call_77c1 (10 chars)",
                        "tool results received: call_0b5e (9 chars); call_77c1 (10 chars)"]
