"""Schemathesis against our own OpenAPI schema, every operation, on real servers (with and without an API key).

Positive and negative examples from the schema: never a 5xx, never a hang, every error in the OpenAI shape,
and with a key configured every operation but the open ones answers 401 without it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from server.app import create_app
from server.settings import Settings
from tests.integration.server.conftest import RunningServer, serve_app
from tests.reliability.conftest import AbusedServer, assert_api_error, assert_no_internals, rel_settings

KEY = "schema-fuzz-key"
KEYED_HEADERS = {"Authorization": f"Bearer {KEY}"}  # harmless where no key is set
OPEN_PATHS = {"/health", "/metrics"}
TIMEOUT_S = 30  # slower than this on the tiny model is a hang
EXAMPLES = settings(max_examples=150, deadline=None, derandomize=bool(os.environ.get("CI")),
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def keyed_server(tiny_model: Path) -> Iterator[RunningServer]:
    with serve_app(create_app(rel_settings(tiny_model, api_key=KEY))) as running:
        yield running


def check(response, path: str) -> None:
    """No 5xx; an error has its API's shape (OpenAI's, Anthropic's on /v1/messages, Ollama's on /api/); nothing leaks
    Python internals."""
    text = response.text
    assert response.status_code < 500, (path, response.status_code, text[:500])
    assert_no_internals(text)
    if response.status_code >= 400:
        assert_api_error(path, response.status_code, text)
    elif response.headers.get("content-type", [""])[0].startswith("application/json"):
        json.loads(text)


# NOTE: the schema comes from the app itself (the same document every server serves at /openapi.json,
# checked below), so the operations are known when tests are collected.
SCHEMA_DOC = create_app(Settings(model="schema-only"), loader=None).openapi()
SCHEMA = schemathesis.openapi.from_dict(SCHEMA_DOC)


def test_the_servers_serve_this_schema(rel_server: AbusedServer, keyed_server: RunningServer) -> None:
    for base in (rel_server.base, keyed_server.base):
        served = httpx.get(f"{base}/openapi.json", timeout=10, headers=KEYED_HEADERS).json()
        assert served["paths"] == SCHEMA_DOC["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(SCHEMA_DOC["paths"])


@SCHEMA.parametrize()
@EXAMPLES
def test_every_operation_without_a_key_configured(case, rel_server: AbusedServer) -> None:
    check(case.call(base_url=rel_server.base, timeout=TIMEOUT_S), case.path)


@SCHEMA.parametrize()
@EXAMPLES
def test_every_operation_with_a_key_configured(case, keyed_server: RunningServer) -> None:
    base = keyed_server.base
    authorized = case.call(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S)
    check(authorized, case.path)
    assert authorized.status_code != 401, case.path
    anonymous = case.call(base_url=base, headers={"Authorization": "Bearer not-the-key"}, timeout=TIMEOUT_S)
    check(anonymous, case.path)
    if case.path not in OPEN_PATHS:
        assert anonymous.status_code == 401, (case.method, case.path, anonymous.status_code)
        error = assert_api_error(case.path, anonymous.status_code, anonymous.text)
        if case.path.startswith("/api/"):  # Ollama's shape has a message only
            assert "API key" in error["message"], error
        else:
            assert error["type"] == "authentication_error"
