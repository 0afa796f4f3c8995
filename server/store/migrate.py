"""The state store's migrations (Alembic, scripts in server/store/migrations): bring a database to the newest
schema, once, however many processes start at the same time.

Run synchronously (in a worker thread at start-up). No onnxruntime, no engine import.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

logger = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# NOTE(store): any constant works; it only has to be the same in every process that migrates this database
_PG_LOCK_KEY = 0x6F72_7473  # "orts"


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head() or ""


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def upgrade(url: str) -> str:
    """Migrate the database at ``url`` (a synchronous SQLAlchemy URL) to the newest revision; returns it.

    SQLite: under a lock file beside the database. PostgreSQL: under a session advisory lock.
    """
    parsed = sa.make_url(url)
    sqlite = parsed.get_backend_name() == "sqlite"
    lock = (_file_lock(Path(parsed.database).with_name(Path(parsed.database).name + ".migrate-lock"))
            if sqlite and parsed.database else contextlib.nullcontext())
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with lock, engine.connect() as conn:
            if parsed.get_backend_name() == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_lock(:key)"), {"key": _PG_LOCK_KEY})
                conn.commit()
            try:
                before = MigrationContext.configure(conn).get_current_revision()
                head = head_revision()
                if before != head:
                    config = alembic_config()
                    config.attributes["connection"] = conn
                    command.upgrade(config, "head")
                    conn.commit()
                    logger.info("state store migrated from %s to %s", before or "nothing", head)
            finally:
                if parsed.get_backend_name() == "postgresql":
                    conn.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": _PG_LOCK_KEY})
                    conn.commit()
    finally:
        engine.dispose()
    return head
