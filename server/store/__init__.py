"""The state store: everything that outlives a request (stored and background responses, conversations, files,
batches), behind one interface (server.store.base.Store) with two backends, SQLite embedded (the default, a file
in the cache folder) and PostgreSQL (``--state-url postgresql://...``) for several processes or replicas.
"""

from __future__ import annotations

from pathlib import Path

from server.store.base import (BatchLine, BatchRecord, ConversationRecord, FileRecord, Page, ResponseRecord, Store,
                               StoreFullError, owner_alive, worker_id)

__all__ = ["BatchLine", "BatchRecord", "ConversationRecord", "FileRecord", "Page", "ResponseRecord", "Store",
           "StoreFullError", "default_state_path", "open_store", "owner_alive", "store_url", "worker_id"]


def default_state_path() -> Path:
    """The embedded database's file: ``state/ortserve.db`` in the cache folder (ORTSERVE_CACHE_DIR)."""
    from engine.builder.pull import model_cache_dir  # noqa: PLC0415 - no onnxruntime there

    return model_cache_dir() / "state" / "ortserve.db"


def store_url(url: str | None) -> str:
    """The SQLAlchemy async URL of ``--state-url`` (None: the embedded SQLite file).

    ``sqlite:///PATH`` or a plain path is SQLite; ``postgresql://`` and ``postgres://`` are PostgreSQL (psycopg).
    """
    if not url:
        path = default_state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite+aiosqlite:///{path}"
    scheme, sep, rest = url.partition("://")
    if not sep:
        Path(url).expanduser().parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite+aiosqlite:///{Path(url).expanduser()}"
    base = scheme.split("+")[0]
    if base == "sqlite":
        return f"sqlite+aiosqlite://{rest}"
    if base in ("postgresql", "postgres"):
        return f"postgresql+psycopg://{rest}"
    raise ValueError(f"--state-url must be sqlite:///PATH, a file path or postgresql://..., got {scheme}://")


def open_store(url: str | None) -> Store:
    """The store for ``--state-url`` (not yet started: ``await store.start()``)."""
    from server.store.sql import PostgresStore, SQLiteStore  # noqa: PLC0415 - SQLAlchemy loads with the store

    resolved = store_url(url)
    return SQLiteStore(resolved) if resolved.startswith("sqlite") else PostgresStore(resolved)
