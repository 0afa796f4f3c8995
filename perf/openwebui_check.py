"""The checks of perf/openwebui_check.sh: through a running Open WebUI's own HTTP API, with an Ollama connection to a
running ortserve hub, that it lists ortserve's models, shows two, chats with one (not streamed and streamed), shows
it loaded, embeds with another and unloads. One line per check; exit status 1 when one fails.

    ORT=http://127.0.0.1:18434 OWUI=http://127.0.0.1:18080 MODELS="a b" CHAT_MODEL=a EMBED_MODEL=b \\
        .venv/bin/python -m perf.openwebui_check [--screenshot picker.png]

With --tools (and ORT_LOG, ortserve's log at --log-level debug), Open WebUI's native tool calling through each of
its two connections to ortserve, the OpenAI one and the Ollama one (run_tool_checks).

Open WebUI's routes (open_webui/routers/ollama.py, main.py): /ollama/api/* proxies one Ollama connection;
/api/models is the model picker's list; /api/chat/completions is its chat (OpenAI-shaped, sent to the Ollama
connection as /api/chat). With WEBUI_AUTH=false, POST /api/v1/auths/signin with empty fields gives the built-in
admin's token.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

PROMPT = "What is the capital of France? Answer in one sentence."


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def check(self, name: str, ok: bool, detail: str) -> bool:
        print(f"{'ok  ' if ok else 'FAIL'}  {name}: {detail}", flush=True)
        if not ok:
            self.failed.append(name)
        return ok


def tagged(name: str) -> str:
    return name if ":" in name else name + ":latest"


def sign_in(owui: str) -> dict[str, str]:
    r = httpx.post(f"{owui}/api/v1/auths/signin", json={"email": "", "password": ""}, timeout=30)
    r.raise_for_status()
    return {"Authorization": f"Bearer {r.json()['token']}"}


def run_checks(ort: str, owui: str, models: list[str], chat_model: str, embed_model: str,
               picture: str | None) -> int:
    c = Checks()
    client = httpx.Client(base_url=owui, headers=sign_in(owui), timeout=300)
    expected = [tagged(m) for m in models]
    chat_id = tagged(chat_model)

    owui_version = client.get("/api/version").json().get("version")
    ours = httpx.get(f"{ort}/api/version", timeout=30).json()
    print(f"Open WebUI {owui_version}; ortserve {ours.get('ortserve')} (reports Ollama {ours.get('version')})")

    r = client.get("/ollama/api/version")
    c.check("/ollama/api/version", r.status_code == 200 and r.json().get("version") == ours.get("version"),
            f"{r.status_code} {r.text[:120]}")

    r = client.get("/ollama/api/tags")
    tags = r.json().get("models", []) if r.status_code == 200 else []
    names = [m.get("name") for m in tags]
    c.check("/ollama/api/tags lists every ortserve model", names == expected,
            f"{[(m.get('name'), m.get('size'), (m.get('details') or {}).get('family')) for m in tags]} "
            f"(name, bytes on disk, family)")

    r = client.get("/api/models")
    listed = {m["id"]: m for m in r.json().get("data", [])} if r.status_code == 200 else {}
    c.check("/api/models (the model picker) lists them, owned_by ollama",
            all(listed.get(m, {}).get("owned_by") == "ollama" for m in expected),
            f"{r.status_code} {[(i, m.get('owned_by')) for i, m in listed.items()]}")

    shown = {}
    for model in (chat_id, tagged(embed_model)):
        r = client.post("/ollama/api/show", json={"model": model})
        shown[model] = r.json().get("capabilities") if r.status_code == 200 else r.status_code
    c.check("/ollama/api/show (capabilities)", "completion" in (shown[chat_id] or [])
            and "embedding" in (shown[tagged(embed_model)] or []), f"{shown}")

    payload: dict[str, Any] = {"model": chat_id, "messages": [{"role": "user", "content": PROMPT}], "stream": False,
                               "params": {"temperature": 0, "max_tokens": 24}}
    start = time.perf_counter()
    r = client.post("/api/chat/completions", json=payload)
    took = time.perf_counter() - start
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    text = ((body.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
    usage = body.get("usage") or {}
    c.check(f"/api/chat/completions to {chat_id}, not streamed", r.status_code == 200 and bool(text.strip()),
            f"{r.status_code} in {took:.1f} s (the first request loads it): {text!r}; load "
            f"{usage.get('load_duration', 0) / 1e9:.2f} s, prompt {usage.get('prompt_token/s')} tok/s, "
            f"eval {usage.get('response_token/s')} tok/s")

    chunks, pieces = 0, []
    with client.stream("POST", "/api/chat/completions", json={**payload, "stream": True}) as s:
        status = s.status_code
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            for choice in json.loads(line[6:]).get("choices") or []:
                pieces.append((choice.get("delta") or {}).get("content") or "")
    streamed = "".join(pieces)
    c.check(f"/api/chat/completions to {chat_id}, streamed", status == 200 and streamed == text,
            f"{status}, {chunks} SSE chunks: {streamed!r} ({'the same' if streamed == text else 'not the same'} "
            f"greedy text)")

    r = client.get("/ollama/api/ps")
    loaded = {m.get("name"): m for m in r.json().get("models", [])} if r.status_code == 200 else {}
    c.check(f"/ollama/api/ps shows {chat_id} loaded", "expires_at" in loaded.get(chat_id, {}),
            f"{ {n: m.get('expires_at') for n, m in loaded.items()} }")

    r = client.post("/ollama/api/embed", json={"model": tagged(embed_model), "input": ["Paris", "Berlin"]})
    vectors = r.json().get("embeddings", []) if r.status_code == 200 else []
    c.check(f"/ollama/api/embed to {tagged(embed_model)}", len(vectors) == 2 and len(vectors[0]) > 0,
            f"{r.status_code}, {len(vectors)} vectors of {len(vectors[0]) if vectors else 0} dimensions")

    if picture:  # while the chat model is loaded (the picker marks it)
        c.check("a screenshot of the model picker", screenshot(owui, picture), picture)

    r = client.post("/ollama/api/unload", json={"model": chat_id})
    after = [m.get("name") for m in client.get("/ollama/api/ps").json().get("models", [])]
    c.check(f"/ollama/api/unload {chat_id}", r.status_code == 200 and chat_id not in after,
            f"{r.status_code} {r.text[:80]}; loaded now: {after}")

    print(f"{len(c.failed)} failed: {c.failed}" if c.failed else "all checks passed")
    return 1 if c.failed else 0


# --- native tool calling (TOOLS=1) -----------------------------------------------------------------------------

TOOL_ID = "ortserve_files"
# A workspace Tool as Open WebUI's editor makes one: a Tools class whose typed, docstring'd methods become the
# tools' specs (get_local_tool_specs). It knows one file, with a number the model cannot guess.
TOOL_SOURCE = '''"""
title: ortserve files
description: Reads the files of a small project.
"""


class Tools:
    def __init__(self):
        pass

    def read_file(self, path: str) -> str:
        """
        Read a file of the user's project and return its text.
        :param path: the file's path, such as hello.py
        """
        files = {"hello.py": 'print("hello from ortserve, 7316")\\n'}
        name = path.strip().replace("\\\\", "/").split("/")[-1]
        return files.get(name, f"no such file: {path}")
'''
TASK = "Read hello.py and tell me what it prints."
_ACCESS = re.compile(r'"(GET|POST|HEAD|PUT|DELETE) (/\S*?)(?:\?\S*)? HTTP/1\.1" (\d{3})')


def server_side(log: str) -> dict[str, Any]:
    """What ortserve's log says about a piece of it: each request's (method, path, status), the tools each chat
    request offered (a debug line of server/http/prepare.py), the calls parsed from the model's output, the tool
    results received and the finished requests' token counts."""
    return {"statuses": [(m[1], m[2], int(m[3])) for m in _ACCESS.finditer(log)],
            "offered": re.findall(r"tools offered: (.*)", log),
            "calls": re.findall(r"tool calls parsed \((\w+) format\): (.*)", log),
            "results": re.findall(r"tool results received: (.*)", log),
            "finished": re.findall(r"request (\S+) finished \((\w+)\): (\d+) prompt tokens, (\d+) cached, "
                                   r"(\d+) generated", log)}


def _text(item: dict[str, Any]) -> str:
    for key in ("output", "content"):
        value = item.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return "".join(part.get("text", "") for part in value if isinstance(part, dict))
    return ""


def run_tool_checks(ort: str, owui: str, chat_model: str, ort_log: Path) -> int:
    c = Checks()
    client = httpx.Client(base_url=owui, headers=sign_in(owui), timeout=1800)
    owui_version = client.get("/api/version").json().get("version")
    ours = httpx.get(f"{ort}/api/version", timeout=30).json()
    print(f"Open WebUI {owui_version}; ortserve {ours.get('ortserve')}; model {chat_model}")

    # its two connections list the same model under two ids: the Ollama one tagged, the OpenAI one as /v1/models
    connections = {"OpenAI": (chat_model, "openai", "/v1/chat/completions"),
                   "Ollama": (tagged(chat_model), "ollama", "/api/chat")}
    r = client.get("/api/models")
    listed = {m["id"]: m for m in r.json().get("data", [])} if r.status_code == 200 else {}
    c.check("/api/models lists the model through both connections",
            all(listed.get(mid, {}).get("owned_by") == owner for mid, owner, _ in connections.values()),
            f"{r.status_code} {[(i, m.get('owned_by')) for i, m in listed.items()]}")

    r = client.post("/api/v1/tools/create", json={"id": TOOL_ID, "name": "ortserve files", "content": TOOL_SOURCE,
                                                  "meta": {"description": "Reads the files of a small project."}})
    created = r.status_code
    exported = {t["id"]: t for t in client.get("/api/v1/tools/export").json()}  # the stored tool, with its specs
    specs = (exported.get(TOOL_ID) or {}).get("specs") or []
    c.check(f"/api/v1/tools/create {TOOL_ID} (a workspace Tool in Python)",
            created == 200 and [s.get("name") for s in specs] == ["read_file"],
            f"{created}; its specs (/api/v1/tools/export): {json.dumps(specs)}")

    # each chat model's advanced param "Function Calling: Native": a model entry over the base model, as the
    # admin's model settings save one
    for name, (mid, _, _) in connections.items():
        r = client.post("/api/v1/models/create", json={
            "id": mid, "name": mid, "base_model_id": None, "meta": {}, "params": {"function_calling": "native"}})
        c.check(f"/api/v1/models/create {mid} ({name} connection): function_calling native", r.status_code == 200,
                f"{r.status_code} {r.text[:160]}")
    params = {mid: (client.get("/api/v1/models/model", params={"id": mid}).json() or {}).get("params")
              for mid, _, _ in connections.values()}  # (/api/models shows only public params)
    c.check("/api/v1/models/model: both models' params say native",
            all((p or {}).get("function_calling") == "native" for p in params.values()), f"{params}")

    for name, (mid, _, path) in connections.items():
        chat_tools(c, client, ort_log, name, mid, path)

    print(f"{len(c.failed)} failed: {c.failed}" if c.failed else "all checks passed")
    return 1 if c.failed else 0


def chat_tools(c: Checks, client: httpx.Client, ort_log: Path, connection: str, model_id: str, path: str) -> None:
    """One chat as Open WebUI's page starts one (a new chat: parent_id null, the user message and the assistant
    message's id), with tool_ids; without a socket session the request waits for the whole tool loop. Then
    ortserve's log of it and the assistant message Open WebUI saved."""
    start = ort_log.stat().st_size
    user_id, assistant_id = str(uuid.uuid4()), str(uuid.uuid4())
    payload = {"model": model_id, "stream": True, "messages": [{"role": "user", "content": TASK}],
               "tool_ids": [TOOL_ID], "params": {"temperature": 0},
               "parent_id": None, "id": assistant_id,
               "user_message": {"id": user_id, "parentId": None, "childrenIds": [assistant_id], "role": "user",
                                "content": TASK, "timestamp": int(time.time()), "models": [model_id]}}
    began = time.perf_counter()
    r = client.post("/api/chat/completions", json=payload)
    took = time.perf_counter() - began
    time.sleep(1)
    with open(ort_log, encoding="utf-8", errors="replace") as f:
        f.seek(start)
        seen = server_side(f.read())
    body: Any = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text[:300]
    c.check(f"{connection}: /api/chat/completions to {model_id} with tool_ids", r.status_code == 200,
            f"{r.status_code} in {took:.0f} s: {json.dumps(body)[:200] if not isinstance(body, str) else body!r}")

    chats = [s for s in seen["statuses"] if s[1] == path]
    c.check(f"{connection}: every request to ortserve 2xx, two or more to {path}",
            len(chats) >= 2 and all(200 <= s[2] < 300 for s in seen["statuses"]), f"{seen['statuses']}")
    c.check(f"{connection}: each chat request carried tools",
            len(seen["offered"]) >= len(chats) >= 1 and all("read_file" in o for o in seen["offered"]),
            f"{seen['offered']}")
    c.check(f"{connection}: the model's tool call parsed", any("read_file" in call for _, call in seen["calls"]),
            f"{seen['calls']}")
    c.check(f"{connection}: its result back in a later request", bool(seen["results"]), f"{seen['results']}")
    for rid, finish, prompt, cached, generated in seen["finished"]:
        print(f"      {rid}: {prompt} prompt tokens, {cached} cached, {generated} generated ({finish})")

    chat_id = body.get("chat_id") if isinstance(body, dict) else None
    message: dict[str, Any] = {}
    for chat in client.get("/api/v1/chats/").json() if not chat_id else [{"id": chat_id}]:
        full = client.get(f"/api/v1/chats/{chat['id']}").json().get("chat") or {}
        message = ((full.get("history") or {}).get("messages") or {}).get(assistant_id) or message
    output = message.get("output") or []
    kinds = [item.get("type") for item in output]
    ran = [item for item in output if item.get("type") == "function_call_output"]
    c.check(f"{connection}: Open WebUI ran the tool (its saved message)", bool(ran) and "function_call" in kinds,
            f"output items {kinds}; tool output {[_text(i)[:80] for i in ran]}")
    answer = message.get("content") or ""
    print(f"      answer ({'with' if '7316' in answer else 'without'} the number): {answer.strip()!r}")
    if message.get("error"):
        print(f"      error: {message['error']}")


def screenshot(owui: str, path: str) -> bool:
    """The chat page with its model picker open (Debian's chromium through chromedriver, as tests/integration/ui)."""
    import tempfile

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,800", f"--user-data-dir={tempfile.mkdtemp()}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    try:
        driver.get(owui + "/")
        wait = WebDriverWait(driver, 60)
        # the "What's new" dialog of a first visit, then the picker's button (its label: the selected model)
        lets_go = "//button[contains(., \"Okay, Let's Go!\")]"
        wait.until(lambda d: d.find_elements(By.XPATH, lets_go))[0].click()
        wait.until(lambda d: d.find_elements(By.ID, "model-selector-model-button"))[0].click()
        wait.until(lambda d: d.find_elements(By.XPATH, "//input[@placeholder='Search a model']"))
        time.sleep(1)
        return driver.save_screenshot(path)
    except Exception as exc:  # a picture of whatever is shown, to see why
        driver.save_screenshot(path)
        print(f"the picker did not open ({type(exc).__name__}); the page as it was: {path}")
        return False
    finally:
        driver.quit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--screenshot", help="also save a picture of the chat page's model picker here (PNG)")
    parser.add_argument("--tools", action="store_true", help="check native tool calling through both connections")
    args = parser.parse_args()
    if args.tools:
        return run_tool_checks(os.environ["ORT"], os.environ["OWUI"], os.environ["CHAT_MODEL"],
                               Path(os.environ["ORT_LOG"]))
    return run_checks(os.environ["ORT"], os.environ["OWUI"], os.environ["MODELS"].split(), os.environ["CHAT_MODEL"],
                      os.environ["EMBED_MODEL"], args.screenshot)


if __name__ == "__main__":
    sys.exit(main())
