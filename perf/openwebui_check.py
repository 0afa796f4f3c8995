"""The checks of perf/openwebui_check.sh: through a running Open WebUI's own HTTP API, with an Ollama connection to a
running ortserve hub, that it lists ortserve's models, shows two, chats with one (not streamed and streamed), shows
it loaded, embeds with another and unloads. One line per check; exit status 1 when one fails.

    ORT=http://127.0.0.1:18434 OWUI=http://127.0.0.1:18080 MODELS="a b" CHAT_MODEL=a EMBED_MODEL=b \\
        .venv/bin/python -m perf.openwebui_check [--screenshot picker.png]

Open WebUI's routes (open_webui/routers/ollama.py, main.py): /ollama/api/* proxies one Ollama connection;
/api/models is the model picker's list; /api/chat/completions is its chat (OpenAI-shaped, sent to the Ollama
connection as /api/chat). With WEBUI_AUTH=false, POST /api/v1/auths/signin with empty fields gives the built-in
admin's token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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
    args = parser.parse_args()
    return run_checks(os.environ["ORT"], os.environ["OWUI"], os.environ["MODELS"].split(), os.environ["CHAT_MODEL"],
                      os.environ["EMBED_MODEL"], args.screenshot)


if __name__ == "__main__":
    sys.exit(main())
