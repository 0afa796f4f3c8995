"""Alembic's environment for the state store: always run from server.store.migrate with an open connection
(config.attributes["connection"]); never from the alembic command line against a URL of its own."""

from __future__ import annotations

from alembic import context

from server.store.tables import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
