"""server.api_servers without a model: the combinations --api-server-count refuses, the listening sockets, the
header that names the answering process, and the CLI's start-up error."""

from __future__ import annotations

import socket

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from server.__main__ import main
from server.api_servers import API_SERVER_HEADER, ApiServerHeader, bind_sockets, refusal
from server.settings import Settings


@pytest.mark.parametrize(("overrides", "words"), [
    ({"models": ["a", "b"]}, "several models"),
    ({"models_dir": "/tmp"}, "several models"),
    ({"engine_process": False}, "--no-engine-process"),
    ({"embedding_model": "all-minilm-l6-v2"}, "embeddings"),
    ({"embeddings": True}, "embeddings"),
])
def test_combinations_that_cannot_share_one_engine_process_are_refused(overrides: dict, words: str) -> None:
    assert refusal(Settings(**overrides)) is None  # one API process serves them all
    reason = refusal(Settings(api_server_count=2, **overrides))
    assert reason is not None and words in reason and "--api-server-count 2" in reason


def test_one_chat_model_with_an_engine_process_is_accepted() -> None:
    assert refusal(Settings(api_server_count=4)) is None
    assert refusal(Settings(api_server_count=4, engine_process=True)) is None


def test_the_cli_refuses_a_bad_combination_before_loading_anything(capsys: pytest.CaptureFixture) -> None:
    code = main(["serve", "--model", "/nonexistent/model", "--api-server-count", "2", "--no-engine-process"])
    assert code == 2
    assert "--no-engine-process" in capsys.readouterr().err


def test_one_socket_per_process_on_one_port() -> None:
    sockets = bind_sockets("127.0.0.1", 0, 3)
    try:
        assert len(sockets) == 3 and len({s.getsockname()[1] for s in sockets}) == 1
        if hasattr(socket, "SO_REUSEPORT"):  # Linux: each process listens on a socket of its own
            assert len({id(s) for s in sockets}) == 3
        with pytest.raises(OSError):  # the port is taken by a socket that did not ask to share it
            plain = socket.socket()
            try:
                plain.bind(("127.0.0.1", sockets[0].getsockname()[1]))
            finally:
                plain.close()
    finally:
        for s in set(sockets):
            s.close()


def test_every_response_names_the_api_process() -> None:
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict:
        return {"ok": True}

    app.add_middleware(ApiServerHeader, index=3)
    answer = TestClient(app).get("/ping")
    assert answer.status_code == 200 and answer.json() == {"ok": True}
    assert answer.headers[API_SERVER_HEADER] == "3"
