"""Fixtures for the chat page's browser tests: Debian's chromium, driven by Selenium through chromedriver,
against real servers on 127.0.0.1.

`browser` is one headless Chromium for the whole session (a fresh profile; `ChatPage.open` clears the page's
storage); `page_server` serves the default model (real text) with a DecodeGate, so that "the answer is
still streaming" holds by construction while a test looks at the page. `make test` installs chromium and
chromium-driver; without them these tests fail (they are not skipped).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement

from server.app import create_app
from tests.conftest import DecodeGate
from tests.integration.server.conftest import RunningServer, api_settings, fault_loader, serve_app

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# NOTE: the flags Chromium needs on these machines (root, no GPU, a closed network): without the
# background-networking ones it keeps trying to reach Google's hosts.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,860")
WAIT_S = 60.0  # generous: only a broken page waits this long


@contextlib.contextmanager
def chromium() -> Iterator[WebDriver]:
    """A headless Chromium with a fresh profile, driven through chromedriver, until the block exits."""
    for path in (CHROMIUM, CHROMEDRIVER):
        assert shutil.which(path), f"{path} is missing: `make test` installs Debian's chromium and chromium-driver"
    profile = tempfile.mkdtemp(prefix="ortserve-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # NOTE: an explicit driver path, so Selenium never looks for (or downloads) a driver of its own.
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="session")
def browser() -> Iterator[WebDriver]:
    with chromium() as driver:
        yield driver


def wait_until(condition: Callable[[], Any], what: str | Callable[[], str], timeout_s: float = WAIT_S) -> Any:
    """Poll `condition()` until it is truthy and return its value; fail naming `what` (a callable: what it
    returns then) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.05)


@dataclass
class ChatPage:
    """The chat page in the browser, with the few actions and readings the tests need."""

    driver: WebDriver
    base: str

    def open(self, path: str = "/") -> ChatPage:
        self.driver.get(f"{self.base}/health")  # same origin: clear what an earlier test left in storage
        self.driver.execute_script("localStorage.clear()")
        self.driver.get_log("browser")  # drop older console lines
        self.driver.get(f"{self.base}{path}")
        return self

    def find(self, selector: str) -> WebElement:
        return self.driver.find_element(By.CSS_SELECTOR, selector)

    def find_all(self, selector: str) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, selector)

    def model_name(self) -> str:
        return wait_until(lambda: (t := self.find("#model-name").text) != "loading…" and t, "the model's name")

    def set_field(self, element_id: str, value: str) -> None:
        """Set a settings field as typing would (an input event and a change event)."""
        self.driver.execute_script(
            "const f = document.getElementById(arguments[0]); f.value = arguments[1];"
            "f.dispatchEvent(new Event('input')); f.dispatchEvent(new Event('change'));", element_id, value)

    def send(self, text: str) -> None:
        box = self.find("#prompt")
        box.clear()
        box.send_keys(text)
        self.find("#send").click()

    def answers(self) -> list[WebElement]:
        return self.find_all(".msg.assistant")

    def last_answer(self) -> WebElement:
        return wait_until(lambda: self.answers()[-1] if self.answers() else None, "an answer")

    def js(self, script: str, *args: Any) -> Any:
        """Run `script` in the page (one read of the DOM: no element can go stale in between)."""
        return self.driver.execute_script(script, *args)

    def answer_state(self) -> str | None:
        return self.js("const a = document.querySelectorAll('.msg.assistant'); "
                       "return a.length ? a[a.length - 1].dataset.state : null;")

    def answer_text(self) -> str:
        return self.js("const a = document.querySelectorAll('.msg.assistant .body'); "
                       "return a.length ? a[a.length - 1].innerText : '';")

    def wait_answer_done(self) -> WebElement:
        wait_until(lambda: self.answer_state() in ("done", "stopped", "dropped", "error"), "the answer to end")
        return self.last_answer()

    def key_dialog_open(self) -> bool:
        return self.js("return document.getElementById('key-dialog').open;")

    def errors(self) -> list[str]:
        return self.js("return [...document.querySelectorAll('#messages .msg.error')].map(e => e.textContent);")

    def console_errors(self) -> list[str]:
        return [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]


@dataclass
class PageServer:
    server: RunningServer
    gate: DecodeGate

    def finished(self, status: str) -> float:
        return self.server.metrics()[f'ortserve_requests_total{{status="{status}"}}']


@pytest.fixture(scope="session")
def page_server(default_model: Path) -> Iterator[PageServer]:
    """The default model, one KV slot and no queue (a second request gets 429), decode runs held by a gate."""
    gate = DecodeGate()
    settings = api_settings(default_model, served_model_name="smollm2", max_batch=1, max_queue=0)
    with serve_app(create_app(settings, loader=fault_loader(gate))) as running:
        yield PageServer(running, gate)


@pytest.fixture
def page(browser: WebDriver, page_server: PageServer) -> Iterator[ChatPage]:
    page_server.gate.open()
    page_server.gate.num_held = 0  # each test counts its own held runs
    yield ChatPage(browser, page_server.server.base).open()
    page_server.gate.open()  # never leave a test's held decode behind
    page_server.server.wait_idle(timeout_s=30)
