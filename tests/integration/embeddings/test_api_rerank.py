"""Rerank and score on an embedding model (all-MiniLM-L6-v2 beside the tiny chat model): Jina's, Cohere's and TEI's
shapes, vLLM's /v1/score against /v1/embeddings' cosines, errors naming the field, and llama.cpp's own server test
test_rerank.py (from the llama.cpp sources vendored in llama-cpp-python's sdist) run unchanged against ortserve.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.integration.embeddings.conftest import MINILM
from tests.integration.server.conftest import RunningServer

DOCS = [
    "A machine is a physical system that uses power to apply forces and control movement.",
    "Machine learning is a field of study in artificial intelligence that learns from data.",
    "Paris, capitale de la France, est une grande ville européenne.",
]

# llama.cpp's server test, as llama-cpp-python 0.3.36's sdist vendors it (pinned: the sdist and the file).
LLAMACPP_SDIST = "llama-cpp-python==0.3.36"
LLAMACPP_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TEST_RERANK = "vendor/llama.cpp/tools/server/tests/unit/test_rerank.py"
TEST_RERANK_SHA256 = "7ca8da4aa5e7d974727b92aa0834b88cde34d728b8aae1fb99c331610a1ff883"
SHIM = Path(__file__).resolve().parent / "llamacpp_shim" / "utils.py"


def test_rerank_jina_and_cohere_shapes(embedding_server: RunningServer) -> None:
    for path, body, documents_back in [
        ("/v1/rerank", {"query": "What is machine learning?", "documents": DOCS, "top_n": 2}, True),  # Jina
        ("/v2/rerank", {"query": "What is machine learning?", "documents": [{"text": d} for d in DOCS],
                        "model": MINILM}, False),  # Cohere v2: documents only when asked
        ("/rerank", {"query": "What is machine learning?", "documents": DOCS, "return_documents": False}, False),
    ]:
        r = httpx.post(embedding_server.base + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        results = out["results"]
        assert len(results) == body.get("top_n", len(DOCS))
        assert results[0]["index"] == 1  # the document about machine learning
        scores = [x["relevance_score"] for x in results]
        assert scores == sorted(scores, reverse=True)
        assert ("document" in results[0]) == documents_back
        if documents_back:
            assert results[0]["document"]["text"] == DOCS[1]
        assert out["model"] == MINILM and out["usage"]["prompt_tokens"] > 0


def test_score_agrees_with_embedding_cosines(embedding_server: RunningServer) -> None:
    """vLLM's /v1/score, one to many and many to many, equals the cosine of /v1/embeddings' vectors to 1e-6."""
    query = "What is machine learning?"
    r = httpx.post(embedding_server.url + "/embeddings", json={"model": MINILM, "input": [query, *DOCS]}, timeout=60)
    vectors = [np.asarray(d["embedding"], dtype=np.float64) for d in r.json()["data"]]
    unit = [v / np.linalg.norm(v) for v in vectors]
    expected = [float(unit[0] @ u) for u in unit[1:]]
    one_to_many = httpx.post(embedding_server.url + "/score", json={"model": MINILM, "text_1": query, "text_2": DOCS},
                             timeout=60).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], expected, atol=1e-6, rtol=0)
    pairwise = httpx.post(embedding_server.url + "/score",
                          json={"text_1": [query, DOCS[0]], "text_2": [DOCS[1], DOCS[2]]}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               [float(unit[0] @ unit[2]), float(unit[1] @ unit[3])], atol=1e-6, rtol=0)
    one = httpx.post(embedding_server.url + "/score", json={"text_1": query, "text_2": DOCS[1]}, timeout=60).json()
    assert len(one["data"]) == 1 and abs(one["data"][0]["score"] - expected[1]) < 1e-6


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": [1, 2]}, "documents[0]"),
    ("/v1/rerank", {"query": "q"}, "documents"),
    ("/v1/rerank", {"query": 3, "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "model": "nope"}, "model"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
])
def test_rerank_errors_name_the_field(embedding_server: RunningServer, path: str, body: dict, param: str) -> None:
    r = httpx.post(embedding_server.base + path, json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def _test_rerank_file(cache: Path) -> Path:
    """llama.cpp's test_rerank.py out of llama-cpp-python's sdist (downloaded once into the cache, sha256-checked)."""
    target = cache / "llamacpp-server-tests" / "test_rerank.py"
    if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == TEST_RERANK_SHA256:
        return target
    download = cache / "llamacpp-sdist"
    download.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d",
                    str(download), LLAMACPP_SDIST], check=True, timeout=900)
    sdist = next(download.glob("llama_cpp_python-0.3.36.tar.gz"))
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == LLAMACPP_SDIST_SHA256
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(TEST_RERANK))
        data = tar.extractfile(member).read()  # type: ignore[union-attr]
    assert hashlib.sha256(data).hexdigest() == TEST_RERANK_SHA256
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return target


def test_llamacpp_server_test_rerank(embedding_server: RunningServer, tmp_path: Path) -> None:
    """llama.cpp's tools/server/tests/unit/test_rerank.py, unchanged, against this server's /rerank (the embedding
    model ranks by cosine; llama.cpp ran it on jina-reranker-v1-tiny-en).

    NOTE(tests): test_rerank_usage asserts jina-reranker-v1-tiny-en's own token counts (19 and 26 for its two pairs:
    its tokenizer and llama.cpp's rerank prompt format); MiniLM's WordPiece tokenizer counts other numbers for the same
    texts, so those two cases are expected to fail here, and only they.
    """
    from engine.builder import model_cache_dir

    source = _test_rerank_file(model_cache_dir())
    shutil.copy(source, tmp_path / "test_rerank.py")
    shutil.copy(SHIM, tmp_path / "utils.py")
    env = {**os.environ, "ORTSERVE_LLAMACPP_BASE": embedding_server.base, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-rf", str(tmp_path / "test_rerank.py")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    failed = sorted(line.split(" ")[1] for line in out.splitlines() if line.startswith("FAILED "))
    assert failed == ["test_rerank.py::test_rerank_usage[Machine", "test_rerank.py::test_rerank_usage[Which"], out
    assert "14 passed" in out, out
