"""The chat page's routes without a model: / and /ui/ serve it with a strict CSP, its files are open without
the API key (the page asks for the key itself, the API does not get open with it), and --no-ui removes it."""

from __future__ import annotations

from fastapi.testclient import TestClient

from server.__main__ import build_parser, settings_from_args
from server.app import create_app
from server.settings import Settings


def _client(**settings) -> TestClient:
    return TestClient(create_app(Settings(**settings), loader=None))


def test_the_page_is_served_at_root_and_ui_with_its_files() -> None:
    with _client() as client:
        for path in ("/", "/ui", "/ui/"):
            r = client.get(path, follow_redirects=False)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
            assert "script-src 'self'" in r.headers["content-security-policy"]
            assert '<script type="module" src="/ui/main.js">' in r.text
        for path in ("/ui/main.js", "/ui/chat.js", "/ui/vendor/marked.umd.js", "/ui/vendor/purify.min.js",
                     "/ui/vendor/uPlot.iife.min.js", "/ui/style.css"):
            assert client.get(path).status_code == 200, path
        assert client.head("/").status_code == 200
        assert client.get("/favicon.ico").status_code == 204
        assert client.get("/ui/nope.js").status_code == 404


def test_with_an_api_key_the_page_is_open_and_the_api_is_not() -> None:
    with _client(api_key="k") as client:
        assert client.get("/").status_code == 200
        assert client.get("/ui/main.js").status_code == 200
        assert client.get("/v1/models").status_code == 401
        assert client.get("/docs").status_code == 401
        assert client.get("/ui/../v1/models").status_code == 401


def test_no_ui_removes_the_page_and_leaves_the_api() -> None:
    args = build_parser().parse_args(["serve", "--no-ui"])
    settings = settings_from_args(args)
    assert settings.ui is False
    with TestClient(create_app(settings, loader=None)) as client:
        assert client.get("/").status_code == 404
        assert client.get("/ui/main.js").status_code == 404
        assert client.get("/health").status_code == 503  # still loading: the API is there as before
        assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
