"""HeldTokenizers (a model hub's tokenizers, parsed once and kept) and local_model_folder (the folder a load would
use, found without downloading, converting or hashing)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from engine.builder.pull import BUILDER_VERSION, local_model_folder
from engine.builder.tokenizer import synthetic_tokenizer
from engine.tokenizer import HeldTokenizers, Tokenizer


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    synthetic_tokenizer(1024)[0].save(str(path))
    return path


def test_a_held_tokenizer_is_parsed_once_and_loads_return_it(tokenizer_file: Path) -> None:
    held = HeldTokenizers()
    assert not held.held(tokenizer_file)
    first = held.load(tokenizer_file)  # not held: parsed, not kept
    assert held.load(tokenizer_file) is not first
    kept = held.hold(tokenizer_file)
    assert held.held(tokenizer_file)
    assert held.load(tokenizer_file) is kept and held.hold(tokenizer_file) is kept
    assert held.load(str(tokenizer_file.parent / "." / "tokenizer.json")) is kept  # by resolved path
    assert kept.encode("the information") == first.encode("the information")


def test_a_changed_file_is_parsed_again_and_a_parsed_one_can_be_adopted(tokenizer_file: Path) -> None:
    held = HeldTokenizers()
    kept = held.hold(tokenizer_file)
    stat = tokenizer_file.stat()
    os.utime(tokenizer_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert not held.held(tokenizer_file)
    assert held.load(tokenizer_file) is not kept
    parsed = Tokenizer.from_file(tokenizer_file)
    assert held.hold(tokenizer_file, parsed) is parsed and held.load(tokenizer_file) is parsed
    held.release(tokenizer_file)
    assert not held.held(tokenizer_file)


def test_a_load_waits_for_the_hold_in_progress_instead_of_parsing_again(tokenizer_file: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    held, parses, started, release = HeldTokenizers(), [], threading.Event(), threading.Event()
    real = Tokenizer.from_file.__func__  # type: ignore[attr-defined]

    def slow_parse(cls: type[Tokenizer], path: str | Path) -> Tokenizer:
        parses.append(path)
        started.set()
        release.wait(10)
        return real(cls, path)

    monkeypatch.setattr(Tokenizer, "from_file", classmethod(slow_parse))
    holder = threading.Thread(target=held.hold, args=(tokenizer_file,))
    holder.start()
    assert started.wait(10)
    result: list[Tokenizer] = []
    loader = threading.Thread(target=lambda: result.append(held.load(tokenizer_file)))
    loader.start()
    loader.join(0.2)
    assert loader.is_alive()  # waiting on the hold, not parsing
    release.set()
    holder.join(10), loader.join(10)
    assert len(parses) == 1 and held.held(tokenizer_file) and result[0] is held.load(tokenizer_file)


def test_local_model_folder_finds_folders_and_converted_ggufs_without_work(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    assert local_model_folder(folder, cache_dir=tmp_path) is None  # no model config: not a model folder
    (folder / "genai_config.json").write_text("{}")
    assert local_model_folder(folder, cache_dir=tmp_path) == folder.resolve()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert local_model_folder(gguf, cache_dir=tmp_path) is None  # not converted yet
    converted = tmp_path / "gguf" / "m-0123456789ab"
    converted.mkdir(parents=True)
    marker = {"source": str(gguf.resolve()), "sha256": "0" * 64, "builder_version": BUILDER_VERSION, "files": {}}
    (converted / ".ortserve-model.json").write_text(json.dumps(marker))
    assert local_model_folder(gguf, cache_dir=tmp_path) == converted
    (converted / ".ortserve-model.json").write_text(json.dumps({**marker, "builder_version": BUILDER_VERSION - 1}))
    assert local_model_folder(gguf, cache_dir=tmp_path) is None  # an older builder's folder is converted again
    assert local_model_folder("smollm2-135m-instruct", cache_dir=tmp_path / "empty") is None  # not pulled
    assert local_model_folder("no-such-model", cache_dir=tmp_path) is None


def test_local_model_folder_finds_a_pulled_known_name_by_its_marker(tmp_path: Path) -> None:
    from engine.builder.pull import KNOWN_MODELS

    source = KNOWN_MODELS["smollm2-135m-instruct"]
    folder = tmp_path / "smollm2-135m-instruct"
    folder.mkdir()
    (folder / "genai_config.json").write_text("{}")
    marker = {"source": source.requirement, "sha256": source.sha256, "dtype": "float32", "accuracy_level": 4,
              "builder_version": BUILDER_VERSION, "files": {"genai_config.json": 2}}
    (folder / ".ortserve-model.json").write_text(json.dumps(marker))
    assert local_model_folder("smollm2-135m-instruct", cache_dir=tmp_path) == folder.resolve()
    (folder / "genai_config.json").write_text("{} ")  # a file whose size changed: not a finished folder
    assert local_model_folder("smollm2-135m-instruct", cache_dir=tmp_path) is None


def test_ollama_tags_size_of_a_known_name_on_disk_before_its_first_load(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from server.hub.catalog import CatalogModel
    from server.hub.registry import ModelEntry
    from server.ollama import route
    from server.settings import ModelSpec

    cache = tmp_path / "cache"
    monkeypatch.setenv("ORTSERVE_CACHE_DIR", str(cache))
    entry = ModelEntry(CatalogModel(spec=ModelSpec(model="gemma3-270m"), name="gemma3-270m", names=["gemma3-270m"],
                                    kind="chat"))
    assert route._facts(entry) == (0, "")  # not pulled: nothing to count
    from engine.builder.pull import KNOWN_MODELS

    source, folder = KNOWN_MODELS["gemma3-270m"], cache / "gemma3-270m"
    folder.mkdir(parents=True)
    (folder / "genai_config.json").write_text(json.dumps({"model": {"type": "gemma3_text"}}))
    marker = {"source": source.requirement, "sha256": source.sha256, "dtype": "float32", "accuracy_level": 4,
              "builder_version": BUILDER_VERSION, "files": {}}
    (folder / ".ortserve-model.json").write_text(json.dumps(marker))
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert entry.model.folder is None and route._facts(entry) == (size, "gemma3_text")
