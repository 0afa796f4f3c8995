"""Security: the API key on every route but the open ones, the body size limit, the Jinja sandbox, model
names that are paths, and no Python internals in any response."""

from __future__ import annotations

import json
import os
import shutil
from urllib.parse import quote
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.app import create_app
from tests.integration.server.conftest import RunningServer, serve_app
from tests.reliability.conftest import (PROMPT, AbusedServer, assert_api_error, assert_no_internals, assert_openai_error,
                                        rel_settings)

KEY = "s3cret-key-for-tests"
# What may be reached without the key: liveness and /metrics (unless configured); the docs need the key.
OPEN_PATHS = {"/health", "/metrics", "/health/", "/metrics/"}
CHAT = {"model": "tiny", "messages": PROMPT, "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed(tiny_model: Path) -> Iterator[RunningServer]:
    with serve_app(create_app(rel_settings(tiny_model, api_key=KEY, max_body_bytes=64 * 1024))) as running:
        yield running


def _route_requests(app) -> list[tuple[str, str]]:
    """(method, concrete path) of every operation in the app's OpenAPI schema, plus the docs pages."""
    out = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc")]
    for path, operations in app.openapi()["paths"].items():
        concrete = path.replace("{model}", "tiny")
        out += [(method.upper(), concrete) for method in operations]
    return out


def test_every_route_but_the_open_ones_needs_the_key(keyed: RunningServer) -> None:
    requests = _route_requests(keyed.app)
    assert {p for _, p in requests} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/tiny",
                                        "/version", "/health", "/metrics", "/openapi.json"}
    requests += [("GET", "/no/such/route"), ("POST", "/v1/embeddings"), ("DELETE", "/v1/models/tiny"),
                 ("GET", "/health/"), ("GET", "/metrics/"), ("GET", "/v1/models/")]
    # OPTIONS and HEAD on every path too: without the key neither may tell a real route from an unknown one.
    requests += [(method, path) for path in sorted({p for _, p in requests}) for method in ("OPTIONS", "HEAD")]
    bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                   {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}, {"X-Api-Key": f"{KEY}x"},
                   {"X-Api-Key": f"Bearer {KEY}"}]
    with httpx.Client(base_url=keyed.base, timeout=30) as http:
        for method, path in requests:
            for headers in bad_headers:
                r = http.request(method, path, headers=headers, json=CHAT if method == "POST" else None)
                if path in OPEN_PATHS:
                    assert r.status_code != 401, (method, path, headers)
                    continue
                if method == "HEAD":  # no body to read
                    assert r.status_code == 401 and r.content == b"", (method, path)
                    continue
                assert r.status_code == 401, (method, path, headers, r.status_code)
                error = assert_api_error(path, r.status_code, r.content)
                if path.startswith("/api/"):  # Ollama's shape has a message only
                    assert "API key" in error["message"], (method, path, error)
                else:
                    assert error["type"] == "authentication_error", (method, path)
                assert KEY not in r.text
            if path not in OPEN_PATHS:  # with the key the route is reached (whatever it then answers)
                for good in ({"Authorization": f"Bearer {KEY}"}, {"X-Api-Key": KEY}):  # OpenAI's, Anthropic's
                    r = http.request(method, path, headers=good, json=CHAT if method == "POST" else None)
                    assert r.status_code != 401 and r.status_code < 500, (method, path, r.status_code)


def test_metrics_can_require_the_key(tiny_model: Path) -> None:
    settings = rel_settings(tiny_model, api_key=KEY, metrics_require_key=True)
    with serve_app(create_app(settings)) as running:
        r = httpx.get(f"{running.base}/metrics")
        assert_openai_error(r.status_code, r.content, expect_status=401)
        assert httpx.get(f"{running.base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(f"{running.base}/health").status_code == 200


def test_bodies_over_the_limit_get_413_however_they_are_sent(keyed: RunningServer) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}).encode()
    url = f"{keyed.url}/chat/completions"
    r = httpx.post(url, content=big, headers=auth)  # with Content-Length
    assert assert_openai_error(r.status_code, r.content, expect_status=413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # chunked transfer: no Content-Length to check up front
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    r = httpx.post(url, content=chunks(), headers=auth)
    assert assert_openai_error(r.status_code, r.content, expect_status=413)["code"] == "request_too_large"
    # Just under the limit is served.
    ok = json.dumps({**CHAT, "messages": [{"role": "user", "content": "hello " * 1000}]}).encode()
    r = httpx.post(url, content=ok, headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # read and parsed


ESCAPES = {
    "str_mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "cycler_globals": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "lipsum_globals": "{{ lipsum.__globals__['os'].environ }}",
    "self_context": "{{ self.__init__.__globals__.__builtins__ }}",
    "message_mutation": "{% for m in messages %}{{ m.update({'role': 'system'}) }}{% endfor %}",
    "format_string": "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
}


@pytest.fixture(scope="module")
def template_folder(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("evil") / "model"
    shutil.copytree(tiny_model, folder)
    return folder


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_a_template_reaching_for_python_internals_fails_cleanly(template_folder: Path, name: str) -> None:
    config_path = template_folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = ESCAPES[name] + "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    config_path.write_text(json.dumps(config))
    with serve_app(create_app(rel_settings(template_folder))) as running:
        r = httpx.post(f"{running.url}/chat/completions", json=CHAT, timeout=30)
        error = assert_openai_error(r.status_code, r.content, expect_status=400)
        assert error["param"] == "messages" and "template" in error["message"]
        for leak in ("<class", "<built-in", "<module", "os.environ", "uid=", "__builtins__", "environ("):
            assert leak not in r.text, (name, r.text)
        assert httpx.get(f"{running.base}/health").status_code == 200


def test_a_model_name_that_is_a_path_is_never_opened(rel_server: AbusedServer, tiny_model: Path,
                                                     tmp_path: Path) -> None:
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model, other)
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)  # NOTE: opening it for reading would block: a hang here means the server opened it
    names = [str(other), str(other / "model.onnx"), str(fifo), "/etc/passwd", "../../../../etc/hostname",
             "file:///etc/passwd", "~/.ssh/id_rsa", "tiny/../tiny", "TINY", "tiny\x00", "\\\\host\\share"]
    with httpx.Client(base_url=rel_server.base, timeout=10) as http:
        for name in names:
            r = http.post("/v1/chat/completions", json={**CHAT, "model": name})
            error = assert_openai_error(r.status_code, r.content, expect_status=404)
            assert error["code"] == "model_not_found" and error["param"] == "model"
            r = http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
            assert assert_openai_error(r.status_code, r.content, expect_status=404)["code"] == "model_not_found"
            r = http.get(f"/v1/models/{quote(name, safe='')}")  # quoted: the client must not resolve '..'

            assert r.status_code in (404, 400), (name, r.status_code)
            assert_openai_error(r.status_code, r.content)
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]


def test_errors_never_carry_a_traceback(rel_server: AbusedServer) -> None:
    bodies = [b"{", b"\xff\xfe", b"[]", b"null", b'{"messages": 5}', b'{"model": {"$ne": 1}, "messages": []}',
              json.dumps({**CHAT, "max_tokens": -10**30}).encode(), json.dumps({**CHAT, "logit_bias": {"x": 1}}).encode()]
    with httpx.Client(base_url=rel_server.base, timeout=30) as http:
        for body in bodies:
            for path in ("/v1/chat/completions", "/v1/completions"):
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
                assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
                assert_openai_error(r.status_code, r.content)
        rel_server.faults.arm("prefill")  # an engine failure: a 500 whose body names the failure, no trace
        r = http.post("/v1/chat/completions", json=CHAT)
        assert "InjectedFault" in assert_openai_error(r.status_code, r.content, expect_status=500)["message"]
        assert_no_internals(r.text)
