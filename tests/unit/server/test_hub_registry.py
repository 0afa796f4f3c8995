"""The hub's registry (server.hub.registry) without sessions: routing by name and alias, the least recently used
idle model evicted for room, the 503 naming sizes when every loaded model is busy, the idle deadline from
--idle-unload-s, a model's ttl_s, a request's keep_alive/ttl and pinned.

The engines are stand-ins that only record their shutdown (the registry never looks inside one; the real engines
are the integration tests' in tests/integration/hub); the model folders are real, so the estimates are exact.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from server.errors import ModelCannotError, ModelNotFoundError
from server.hub.catalog import PROCESS_OVERHEAD_BYTES, build_catalog, estimate_bytes
from server.hub.registry import LOADING, READY, UNLOADED, MemoryBudgetError, ModelRegistry
from server.settings import ModelSpec, Settings

MIB = 1024**2


class StandInEngine:
    """What the registry asks of a loaded engine: its name, its length, whether it runs, shutdown()."""

    def __init__(self, settings: Settings) -> None:
        self.model_name = settings.served_model_name
        self.max_model_len = settings.max_model_len or 2048
        self.is_running = True
        self.num_shutdowns = 0

    def shutdown(self) -> None:
        self.num_shutdowns += 1
        self.is_running = False


def _folder(root: Path, name: str, weights_mib: int, kind: str = "chat") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    if kind == "chat":
        (folder / "genai_config.json").write_text(json.dumps({"model": {"decoder": {
            "num_hidden_layers": 1, "num_attention_heads": 1, "hidden_size": 8}}, "search": {"max_length": 64}}))
    else:
        (folder / "embedding_config.json").write_text("{}")
    with open(folder / "model.onnx", "wb") as f:
        f.truncate(weights_mib * MIB)  # sparse: the size is what the estimate reads
    return folder


def _registry(tmp_path: Path, budget: str | None = None, **settings: Any) -> ModelRegistry:
    """Three chat models a, b, c (100, 200, 300 MiB of weights) and an embedding model e, beside --model."""
    specs = [ModelSpec(model=str(_folder(tmp_path, n, mib)), aliases=[f"{n}-alias"])
             for n, mib in (("a", 100), ("b", 200), ("c", 300))]
    specs.append(ModelSpec(model=str(_folder(tmp_path, "e", 50, "embedding"))))
    specs.append(ModelSpec(model=str(_folder(tmp_path, "p", 10)), pinned=True))
    s = Settings(model=str(_folder(tmp_path, "main", 10)), models=specs, memory_budget=budget, max_batch=1,
                 **settings)
    return ModelRegistry(s, build_catalog(s, one_model=False), one_model=False, chat_loader=StandInEngine,
                         embedder_loader=lambda settings, model: StandInEngine(settings))


def _request() -> Any:
    return SimpleNamespace(state=SimpleNamespace(ortserve_leases=[]))


def _size(registry: ModelRegistry, name: str) -> int:
    entry = registry.find(name)
    return estimate_bytes(entry.model.folder, entry.model.settings_for(registry.settings))


async def _use(registry: ModelRegistry, name: str, kind: str = "chat", **kwargs: Any) -> Any:
    """One request to ``name``, its response already sent (its lease released)."""
    entry = await registry.acquire(_request(), name, kind, **kwargs)
    registry.release(entry)
    return entry


# --- names ---------------------------------------------------------------------------------------------------


def test_names_aliases_and_folders_route_to_their_model(tmp_path: Path) -> None:
    registry = _registry(tmp_path)
    assert registry.find(None) is registry.default and registry.default.name == "main"
    assert registry.find("a-alias") is registry.find("a") is registry.find(str(tmp_path / "a"))
    assert registry.lookup("b-alias", "chat").name == "b"
    assert registry.lookup("e", "embedding").name == "e"
    assert registry.lookup(None, "embedding").name == "e"  # the first embedding model
    with pytest.raises(ModelNotFoundError):
        registry.lookup("nope", "chat")
    with pytest.raises(ModelCannotError, match="embedding model"):
        registry.lookup("e", "chat")
    with pytest.raises(ModelCannotError, match="does not serve embeddings"):
        registry.lookup("a", "embedding")


# --- the memory budget -----------------------------------------------------------------------------------------


def test_the_estimates_are_the_folders(tmp_path: Path) -> None:
    registry = _registry(tmp_path)
    assert _size(registry, "a") - _size(registry, "b") == -100 * MIB
    assert _size(registry, "e") == 50 * MIB + PROCESS_OVERHEAD_BYTES


def test_the_least_recently_used_idle_model_is_evicted_for_room(tmp_path: Path) -> None:
    async def main() -> None:
        # room for b and c, or a and c, not all three (p, the pinned one, is not loaded: nothing loads it here)
        probe = _registry(tmp_path / "probe")
        budget = _size(probe, "b") + _size(probe, "c") + 50 * MIB
        registry = _registry(tmp_path / "hub", budget=str(budget))
        a, b = await _use(registry, "a"), await _use(registry, "b")
        await _use(registry, "a")  # a is used again: b is now the least recently used
        engine_b = b.engine
        c = await _use(registry, "c")
        assert (a.status, b.status, c.status) == (READY, UNLOADED, READY)
        assert engine_b.num_shutdowns == 1 and b.engine is None  # its engine (process) was shut down
        assert registry.budget_bytes == budget and registry.budget_source == "--memory-budget"
        # b again: a (used before c) is now the least recently used; without it, b fits beside c
        await _use(registry, "b")
        assert (a.status, b.status, c.status) == (UNLOADED, READY, READY)
        assert sum(e.estimate_bytes for e in registry.entries if e.status == READY) <= budget
        await registry.stop()

    asyncio.run(main())


def test_with_every_loaded_model_busy_the_load_is_a_503_naming_the_sizes(tmp_path: Path) -> None:
    async def main() -> None:
        probe = _registry(tmp_path / "probe")
        budget = _size(probe, "b") + _size(probe, "c") + 50 * MIB  # any two fit (main beside a and b), not three
        registry = _registry(tmp_path / "hub", budget=str(budget))
        held = [await registry.acquire(_request(), name, "chat") for name in ("a", "b")]  # streams running
        with pytest.raises(MemoryBudgetError) as info:
            await registry.acquire(_request(), "c", "chat")
        message = str(info.value)
        assert info.value.status_code == 503 and info.value.headers["Retry-After"]
        assert "'c'" in message and f"{_size(probe, 'c') / MIB:.0f} MiB" in message
        assert f"{(_size(probe, 'a') + _size(probe, 'b')) / MIB:.0f} MiB" in message and "'a'" in message
        assert all(e.status == READY and e.engine.num_shutdowns == 0 for e in held)  # never ended for room
        await _use(registry, "main")  # an idle model does not make room enough: it is not unloaded for nothing
        with pytest.raises(MemoryBudgetError):
            await registry.acquire(_request(), "c", "chat")
        assert registry.default.status == READY
        assert registry.find("c").status == UNLOADED
        registry.release(held[0])  # a's stream ends: a can go for c
        assert (await _use(registry, "c")).status == READY
        assert held[0].status == UNLOADED and held[1].status == READY
        await registry.stop()

    asyncio.run(main())


def test_a_pinned_model_is_never_evicted(tmp_path: Path) -> None:
    async def main() -> None:
        probe = _registry(tmp_path / "probe")
        budget = _size(probe, "p") + _size(probe, "a") + 10 * MIB
        registry = _registry(tmp_path / "hub", budget=str(budget))
        await registry.load(registry.find("p"))
        await _use(registry, "a")
        with pytest.raises(MemoryBudgetError):  # p is idle but pinned: without a, b would still not fit
            await registry.acquire(_request(), "b", "chat")
        assert registry.find("p").status == READY and registry.find("a").status == READY  # a: not for nothing
        await _use(registry, "e", "embedding")  # fits once a, the idle unpinned one, is gone
        assert registry.find("p").status == READY and registry.find("a").status == UNLOADED
        await registry.stop()

    asyncio.run(main())


def test_without_a_budget_start_finds_the_default(tmp_path: Path) -> None:
    async def main() -> None:
        registry = _registry(tmp_path, provider="cpu")
        assert registry.budget_bytes is None
        await registry.start()
        assert registry.budget_bytes is not None and registry.budget_bytes > 0 and registry.budget_source == "RAM"
        await registry.stop()

    asyncio.run(main())


# --- the idle deadline -----------------------------------------------------------------------------------------


def test_the_idle_deadline_is_keep_alive_then_the_models_ttl_then_the_servers(tmp_path: Path) -> None:
    async def main() -> None:
        registry = _registry(tmp_path, idle_unload_s=300)
        registry.find("b").model.spec.ttl_s = 30
        settings = registry.settings
        a = await _use(registry, "a")
        b = await _use(registry, "b")
        assert (a.ttl_s(settings), b.ttl_s(settings)) == (300, 30)
        a = await _use(registry, "a", keep_alive_s=5)  # a request's keep_alive / ttl
        assert a.ttl_s(settings) == 5
        await _use(registry, "a")  # a later request without one keeps it
        assert a.ttl_s(settings) == 5
        await _use(registry, "a", keep_alive_s=-1)  # Ollama's "forever"
        assert a.ttl_s(settings) == math.inf and a.expires_at(settings) is None
        p = registry.find("p")
        await registry.load(p)
        assert p.ttl_s(settings) == math.inf
        await _use(registry, "p", keep_alive_s=0)
        assert p.ttl_s(settings) == math.inf  # pinned: never unloaded, whatever a request asks
        await registry.stop()

    asyncio.run(main())


def test_the_reaper_unloads_what_idled_past_its_deadline(tmp_path: Path) -> None:
    async def main() -> None:
        registry = _registry(tmp_path, idle_unload_s=300)
        a = await _use(registry, "a", keep_alive_s=10)
        b = await _use(registry, "b")
        c = await registry.acquire(_request(), "c", "chat", keep_alive_s=0)  # still streaming
        p = registry.find("p")
        await registry.load(p)
        now = time.monotonic()
        a.last_used_s = b.last_used_s = c.last_used_s = p.last_used_s = now - 60
        assert registry.to_reap(now) == [a]  # a: 60 s idle > its 10; b: < 300; c: held; p: pinned
        assert registry.to_reap(now + 240) == [a, b]
        registry.release(c)
        assert c in registry.to_reap(time.monotonic())  # keep_alive 0: right after its response
        b.engine.is_running = False  # its engine process died
        assert b in registry.to_reap(time.monotonic())
        # what /api/ps and /models show: the wall-clock deadline (an overdue one is now)
        assert a.expires_at(registry.settings) == pytest.approx(time.time(), abs=5)
        assert c.expires_at(registry.settings) == pytest.approx(time.time(), abs=5)
        b.last_used_s = time.monotonic() - 60
        assert b.expires_at(registry.settings) == pytest.approx(time.time() + 240, abs=5)
        await registry.stop()

    asyncio.run(main())


def test_a_load_in_progress_counts_against_the_budget(tmp_path: Path) -> None:
    """Two loads at once: the second sees the first's estimate (LOADING) and evicts for it or fails."""
    async def main() -> None:
        probe = _registry(tmp_path / "probe")
        budget = _size(probe, "c") + 10 * MIB  # one model at a time
        registry = _registry(tmp_path / "hub", budget=str(budget))
        c = registry.find("c")
        c.status, c.estimate_bytes = LOADING, _size(probe, "c")
        with pytest.raises(MemoryBudgetError, match="'c'"):
            await registry.acquire(_request(), "a", "chat")

    asyncio.run(main())
