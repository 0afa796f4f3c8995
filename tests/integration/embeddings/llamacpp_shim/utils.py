"""A stand-in for llama.cpp's tools/server/tests/utils.py, so that llama.cpp's own server tests (copied unchanged from
the llama.cpp sources vendored in llama-cpp-python's sdist) run against an ortserve that is already running.

``ServerPreset.<any preset>()`` gives a ServerProcess whose ``start()`` checks the ortserve at ORTSERVE_LLAMACPP_BASE
(the outer test started it with the models the suite needs) and whose ``make_request`` is llama.cpp's: requests to
that server, the body parsed as JSON. Nothing here starts or stops a server.
"""

from __future__ import annotations

import os
from typing import Any

import requests

__all__ = ["ServerPreset", "ServerProcess", "ServerResponse", "server_instances"]

server_instances: set[ServerProcess] = set()


class ServerResponse:
    headers: dict
    status_code: int
    body: Any


class ServerProcess:
    def __init__(self) -> None:
        self.base = os.environ["ORTSERVE_LLAMACPP_BASE"].rstrip("/")

    def start(self, timeout_seconds: int = 60) -> None:
        response = requests.get(f"{self.base}/health", timeout=timeout_seconds)
        response.raise_for_status()
        server_instances.add(self)

    def stop(self) -> None:
        server_instances.discard(self)

    def make_request(self, method: str, path: str, data: Any = None, headers: dict | None = None,
                     timeout: float | None = 60) -> ServerResponse:
        response = requests.request(method, f"{self.base}{path}", headers=headers, json=data, timeout=timeout)
        result = ServerResponse()
        result.headers = dict(response.headers)
        result.status_code = response.status_code
        try:
            result.body = response.json()
        except ValueError:
            result.body = response.text
        return result


class ServerPreset:
    """Every llama.cpp preset is the running ortserve (its models are the outer test's choice)."""

    def __getattr__(self, name: str) -> Any:  # pragma: no cover - presets are static methods below
        raise AttributeError(name)

    @staticmethod
    def jina_reranker_tiny() -> ServerProcess:
        return ServerProcess()

    @staticmethod
    def bert_bge_small() -> ServerProcess:
        return ServerProcess()
