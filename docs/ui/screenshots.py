"""Redraw docs/ui/chat.png and docs/ui/status.png: the chat page against a running `make serve`.

    make serve &                      # the default model on 127.0.0.1:8000
    .venv/bin/python docs/ui/screenshots.py --url http://127.0.0.1:8000

Drives Debian's chromium (as the browser tests do) and, for the status view, a minute of load from four
concurrent streams sent with the openai client, so the charts have something to show.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from tests.integration.ui.conftest import ChatPage, chromium, wait_until  # noqa: E402

OUT = Path(__file__).resolve().parent
QUESTION = "Write a Python function that reverses a string, and explain it in two sentences."


def load(url: str, model: str, seconds: float, streams: int) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    deadline = time.monotonic() + seconds

    def one(i: int) -> None:
        while time.monotonic() < deadline:
            stream = client.chat.completions.create(model=model, max_tokens=96 + 32 * i, stream=True, messages=[
                {"role": "user", "content": f"Tell me a story about the number {i}."}])
            for _ in stream:
                pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--load-s", type=float, default=60.0)
    args = parser.parse_args()
    with chromium() as driver:
        page = ChatPage(driver, args.url).open()
        model = page.model_name()
        page.set_field("system-prompt", "You are a concise programming assistant.")
        page.set_field("temperature", "0")
        page.send(QUESTION)
        page.wait_answer_done()
        time.sleep(0.5)
        driver.save_screenshot(str(OUT / "chat.png"))

        driver.set_window_size(1280, 1000)
        page.find("#tab-status").click()
        load(args.url, model, args.load_s, streams=4)
        time.sleep(6)  # the charts show the load ending too
        wait_until(lambda: page.find("#stat-running").get_attribute("data-value") == "0", "idle")
        driver.save_screenshot(str(OUT / "status.png"))

if __name__ == "__main__":
    main()
