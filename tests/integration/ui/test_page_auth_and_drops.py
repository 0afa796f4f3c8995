"""The chat page against `ortserve serve` processes: with --api-key it asks for the key, keeps it in the
browser and works once given it; a server that dies mid-answer is a message in the page, not a hang.

The tiny synthetic model (no download) and tests/integration/server/paced_serve.py (a sleep before every
decode step) keep an answer streaming long enough to be cut, whatever the machine's speed.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from tests.integration.server.conftest import serve_process
from tests.integration.ui.conftest import ChatPage, wait_until

KEY = "page-test-key-0123"


def test_with_an_api_key_the_page_asks_for_it_and_then_works(browser, tiny_model: Path) -> None:
    with serve_process(tiny_model, "--served-model-name", "tiny", "--api-key", KEY) as server:
        page = ChatPage(browser, server.base).open()
        wait_until(page.key_dialog_open, "the key dialog")
        assert "API key" in page.find("#key-message").text
        page.find("#key-input").send_keys("wrong-key")
        page.find("#key-save").click()
        # A refused key: the dialog asks again.
        wait_until(lambda: "refused" in page.find("#key-message").text and page.key_dialog_open(), "a second ask")
        page.find("#key-input").send_keys(KEY)
        page.find("#key-save").click()
        assert page.model_name() == "tiny"
        assert page.driver.execute_script("return localStorage.getItem('ortserve.apiKey')") == KEY
        page.set_field("max-tokens", "8")
        page.send("hi")
        assert page.wait_answer_done().get_attribute("data-state") == "done"
        assert page.errors() == []

        # A reload keeps the key: no dialog, and the status view reads /metrics.
        page.driver.refresh()
        assert page.model_name() == "tiny" and not page.key_dialog_open()
        page.find("#tab-status").click()
        wait_until(lambda: page.find("#stat-running").get_attribute("data-value") == "0", "a status reading")


def test_a_server_that_dies_mid_answer_is_shown_as_a_lost_connection(browser, tiny_model: Path) -> None:
    # NOTE: paced at 0.05 s a decode step, 200 tokens take 10 s at least: still streaming when it is killed.
    with serve_process(tiny_model, "--served-model-name", "tiny", decode_delay_s=0.05) as server:
        page = ChatPage(browser, server.base).open()
        assert page.model_name() == "tiny"
        page.set_field("max-tokens", "200")
        page.set_field("extra", json.dumps({"ignore_eos": True}))
        page.send("Tell me everything.")
        wait_until(lambda: page.answer_state() == "streaming" and page.answer_text(), "streamed text")
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        wait_until(lambda: page.answer_state() == "dropped", lambda: f"the page to see the connection drop: "
                   f"{page.answer_state()}, {page.errors()}, {page.driver.get_log('browser')}")
        assert any(e.startswith("Connection problem: the connection was lost mid-answer") for e in page.errors())
        assert page.find("#send").is_displayed() and page.find("#prompt").is_enabled()
