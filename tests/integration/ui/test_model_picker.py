"""The chat page's model picker against a model hub (`ortserve serve` with a --config models list, its own process):
it lists the hub's chat models (not its embedding model), marks the loaded ones from /v1/models' `loaded`, and the
model picked is the one a chat talks to (the server's per-model metrics say which answered).

Real parts: Debian's chromium through Selenium, the CLI server, the default model and the tiny synthetic one (no
download for it); the embedding model is only listed (never loaded here).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from selenium.webdriver.support.ui import Select

from tests.integration.server.conftest import metrics_samples, serve_process
from tests.integration.ui.conftest import ChatPage, wait_until


def _options(page: ChatPage) -> list[tuple[str, str, str]]:
    """The picker's options as (value, text, data-loaded), read in one go."""
    return [tuple(o) for o in page.js(
        "return [...document.querySelectorAll('#model-picker option')]"
        ".map(o => [o.value, o.textContent, o.dataset.loaded]);")]


def _loaded(page: ChatPage) -> dict[str, bool]:
    return {value: loaded == "true" for value, _, loaded in _options(page)}


def _answered(base: str, model: str) -> float:
    """Chat requests the server finished for ``model`` (any outcome)."""
    m = metrics_samples(httpx.get(f"{base}/metrics", timeout=10).text, model)
    return sum(v for k, v in m.items() if k.startswith("ortserve_requests_total{"))


def test_the_picker_lists_the_hubs_models_marks_loaded_ones_and_chats_with_the_one_picked(
        browser, default_model: Path, tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "models.yaml"
    config.write_text(json.dumps({"models": [{"model": str(tiny_model), "name": "tiny"},
                                             {"model": "all-minilm-l6-v2", "kind": "embedding"}]}))
    with serve_process(default_model, "--served-model-name", "smollm2", "--config", str(config),
                       "--max-batch", "2", "--idle-unload-s", "600") as server:
        page = ChatPage(browser, server.base).open()
        # 1. every chat model, none loaded yet (a hub loads on the first request), the default one picked
        wait_until(lambda: [v for v, _, _ in _options(page)] == ["smollm2", "tiny"], lambda: f"{_options(page)}")
        assert _loaded(page) == {"smollm2": False, "tiny": False}
        assert page.find("#model-picker").is_displayed() and not page.find("#model-name").is_displayed()
        assert Select(page.find("#model-picker")).first_selected_option.get_attribute("value") == "smollm2"
        page.set_field("temperature", "0")
        page.set_field("max-tokens", "8")
        page.set_field("extra", '{"ignore_eos": true}')  # the tiny model's random weights may end at once

        # 2. a chat with the default model loads it: the picker marks it loaded, and only it
        page.send("Name a colour.")
        assert page.wait_answer_done().get_attribute("data-state") == "done"
        wait_until(lambda: _loaded(page) == {"smollm2": True, "tiny": False}, lambda: f"the mark: {_options(page)}")
        assert ("smollm2", "smollm2 (loaded)", "true") in _options(page)
        assert _answered(server.base, "smollm2") == 1 and _answered(server.base, "tiny") == 0

        # 3. the second model, picked: the chat goes to it, it answers, and it is marked loaded
        Select(page.find("#model-picker")).select_by_value("tiny")
        page.send("And another one?")
        answer = page.wait_answer_done()
        assert answer.get_attribute("data-state") == "done"
        assert int(answer.find_element("css selector", ".stats").get_attribute("data-tokens")) == 8
        assert _answered(server.base, "tiny") == 1 and _answered(server.base, "smollm2") == 1
        wait_until(lambda: _loaded(page) == {"smollm2": True, "tiny": True}, lambda: f"the marks: {_options(page)}")
        cards = {c["id"]: c for c in httpx.get(f"{server.base}/v1/models", timeout=10).json()["data"]}
        assert cards["tiny"]["loaded"] and not cards["all-minilm-l6-v2"]["loaded"]
        assert page.errors() == [] and page.console_errors() == []

        # 4. a reload keeps the pick (this browser's), and the context length is the picked model's
        page.driver.refresh()
        wait_until(lambda: page.find("#model-picker").get_attribute("value") == "tiny", "the kept pick")
        wait_until(lambda: f"/ {cards['tiny']['max_model_len']} tokens" in page.find("#context-used").text,
                   lambda: page.find("#context-used").text)
