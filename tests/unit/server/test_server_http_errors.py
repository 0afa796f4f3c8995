"""HTTP edge without a model: OpenAI-shaped errors for bad input, auth, body size, routes, loading state.

The app runs in-process (Starlette's TestClient); no engine is loaded, so every answer here comes from
validation, middleware or the loading state, never from generation.
"""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings

CHAT = "/v1/chat/completions"
GOOD = {"messages": [{"role": "user", "content": "hi"}]}


def _client(loader=None, **settings) -> TestClient:
    return TestClient(create_app(Settings(**settings), loader=loader))


@pytest.fixture
def client():
    with _client() as c:
        yield c


def _assert_error(response, status: int, param: str | None = "<any>") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and isinstance(err["type"], str)
    assert "Traceback" not in err["message"]
    if param != "<any>":
        assert err["param"] == param
    return err


@pytest.mark.parametrize("content,headers", [
    (b"{not json", {"content-type": "application/json"}),
    (b'{"messages": [', {"content-type": "application/json"}),
    (b"{bad", {}),  # no content type
    (b"{bad", {"content-type": "application/x-www-form-urlencoded"}),  # what `curl -d` sends
])
def test_bad_json_is_400_not_422_or_500(client: TestClient, content: bytes, headers: dict) -> None:
    err = _assert_error(client.post(CHAT, content=content, headers=headers), 400)
    assert err["code"] == "invalid_json"


@pytest.mark.parametrize("content,needle", [
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "not UTF-8"),
    (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 5000 + b"}", "digits"),
])
def test_bodies_json_cannot_parse_are_invalid_json_too(client: TestClient, content: bytes, needle: str) -> None:
    """Invalid UTF-8, very deep nesting and integers past Python's digit limit fail inside the JSON parser, as a
    syntax error does, and get the same code."""
    err = _assert_error(client.post(CHAT, content=content, headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json" and needle in err["message"]


def test_json_with_form_content_type_is_parsed(client: TestClient) -> None:
    # Valid JSON under a form content type reaches the engine check (503 loading), not a 400.
    import json

    r = client.post(CHAT, content=json.dumps(GOOD), headers={"content-type": "application/x-www-form-urlencoded"})
    _assert_error(r, 503)


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({**GOOD, "temperature": "hot"}, "temperature"),
    ({**GOOD, "max_tokens": 1.5}, "max_tokens"),
    ({**GOOD, "stream": "yes"}, "stream"),
    ({**GOOD, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({**GOOD, "response_format": {"type": "json_object", "schema": 5}}, "response_format.schema"),
    ({**GOOD, "structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ({**GOOD, "n": 0}, "n"),
    ({**GOOD, "best_of": 2}, "best_of"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
])
def test_invalid_requests_are_400_naming_the_param(client: TestClient, body: dict, param: str) -> None:
    _assert_error(client.post(CHAT, json=body), 400, param)


def test_body_that_is_not_an_object(client: TestClient) -> None:
    _assert_error(client.post(CHAT, json=[1, 2]), 400)
    err = _assert_error(client.post(CHAT, content=b""), 400)
    assert err["code"] == "missing_body"


def test_completions_validation(client: TestClient) -> None:
    _assert_error(client.post("/v1/completions", json={}), 400, "prompt")
    _assert_error(client.post("/v1/completions", json={"prompt": "x", "echo": True}), 400, "echo")
    _assert_error(client.post("/v1/completions", json={"prompt": ["a", "b"]}), 400, "prompt")


def test_unknown_route_and_method_in_openai_shape(client: TestClient) -> None:
    err = _assert_error(client.post("/v1/nothing", json={}), 404)
    assert "/v1/nothing" in err["message"]
    _assert_error(client.get(CHAT), 405)


def test_body_size_limit_is_413() -> None:
    with _client(max_body_bytes=2048) as c:
        big = {"messages": [{"role": "user", "content": "x" * 4096}]}
        err = _assert_error(c.post(CHAT, json=big), 413)
        assert err["code"] == "request_too_large"

        def chunked():  # no Content-Length: the limit is enforced while reading
            for _ in range(8):
                yield b" " * 1024

        _assert_error(c.post(CHAT, content=chunked()), 413)


def test_loading_state_is_503_everywhere_but_metrics(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "loading"
    err = _assert_error(client.post(CHAT, json=GOOD), 503)
    assert err["code"] == "model_loading"
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "smollm2-135m-instruct"


def test_failed_load_reports_on_health() -> None:
    def failing_loader(settings: Settings):
        raise FileNotFoundError("no model at /nowhere")

    with _client(loader=failing_loader) as c:
        deadline = time.monotonic() + 5
        while c.get("/health").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.02)
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert "no model at /nowhere" in r.json()["error"]
        err = _assert_error(c.post(CHAT, json=GOOD), 503)
        assert err["code"] == "model_load_failed"


def test_api_key_required_everywhere_except_health_and_metrics() -> None:
    with _client(api_key="s3cret") as c:
        for method, path in [("post", CHAT), ("post", "/v1/completions"), ("get", "/v1/models"),
                             ("get", "/version"), ("post", "/v1/unknown")]:
            err = _assert_error(getattr(c, method)(path), 401)
            assert err["code"] == "invalid_api_key"
            _assert_error(getattr(c, method)(path, headers={"Authorization": "Bearer wrong"}), 401)
            _assert_error(getattr(c, method)(path, headers={"Authorization": "Basic s3cret"}), 401)
        ok = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.get("/version", headers=ok).status_code == 200
        assert c.get("/health").status_code == 503  # open, and honest: still loading
        assert c.get("/metrics").status_code == 200
    with _client(api_key="s3cret", metrics_require_key=True) as c:
        _assert_error(c.get("/metrics"), 401)
        assert c.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_options_needs_the_key_so_it_reveals_no_route() -> None:
    """Without a key, OPTIONS on a real route and on an unknown one get the same 401 (not 405 against 404); with
    CORS on, preflights still pass without a key, other OPTIONS requests do not."""
    preflight = {"Origin": "http://ui.test", "Access-Control-Request-Method": "POST"}
    for cors in ([], ["http://ui.test"]):
        with _client(api_key="s3cret", cors_origins=cors) as c:
            answers = {path: c.options(path) for path in (CHAT, "/v1/models", "/no/such/route")}
            for path, r in answers.items():
                assert _assert_error(r, 401)["code"] == "invalid_api_key", path
            assert len({r.content for r in answers.values()}) == 1
            ok = {"Authorization": "Bearer s3cret"}
            assert c.options(CHAT, headers=ok).status_code == 405  # with the key the route is reached
            assert c.options("/no/such/route", headers=ok).status_code == 404
            r = c.options(CHAT, headers=preflight)
            if cors:
                assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.test"
            else:
                _assert_error(r, 401)


def test_head_and_trailing_slash_on_the_service_routes() -> None:
    """Load balancers check health with HEAD; `/health/` is /health (open, answered, not redirected)."""
    with _client(api_key="s3cret") as c:
        ok = {"Authorization": "Bearer s3cret"}
        for path in ("/health", "/health/"):
            for method in ("GET", "HEAD"):
                r = c.request(method, path, follow_redirects=False)
                assert r.status_code == 503, (method, path)  # open, and still loading
                assert (r.content == b"") == (method == "HEAD")
        for path in ("/v1/models", "/v1/models/smollm2-135m-instruct", "/version", "/metrics"):
            get, head = c.get(path, headers=ok), c.head(path, headers=ok)
            assert get.status_code == head.status_code == 200, path
            assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
        assert c.head("/v1/models").status_code == 401


def test_cors_off_by_default_and_configurable() -> None:
    preflight = {"Origin": "http://ui.test", "Access-Control-Request-Method": "POST"}
    with _client() as c:
        r = c.options(CHAT, headers=preflight)
        assert "access-control-allow-origin" not in r.headers
    with _client(cors_origins=["http://ui.test"], api_key="k") as c:
        r = c.options(CHAT, headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://ui.test"
        r = c.get("/v1/models", headers={"Origin": "http://evil.test", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in r.headers


def test_rejections_are_counted(client: TestClient) -> None:
    client.post(CHAT, json={})
    client.post(CHAT, content=b"{bad")
    text = client.get("/metrics").text
    # refused before they were routed: counted under the default model (the only one here)
    assert 'ortserve_requests_total{model_name="smollm2-135m-instruct",status="rejected"} 2.0' in text


def test_openapi_docs_served(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"] and "/v1/completions" in spec["paths"]
    assert client.get("/docs").status_code == 200


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/responses", {"input": "x"}),
    ("/v1/embeddings", {"input": "x"}),
])
def test_lm_studios_ttl_is_seconds_at_least_zero(client: TestClient, path: str, body: dict) -> None:
    """LM Studio's per-request ttl on the OpenAI routes: a bad one is a 400 naming it, before any model runs."""
    for ttl, why in ((-5, ">= 0"), ("soon", "number")):
        r = client.post(path, json={**body, "ttl": ttl})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ttl", r.text
        assert why in r.json()["error"]["message"]
