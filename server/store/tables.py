"""The state store's schema as SQLAlchemy Core tables (the migrations in migrations/versions build it).

One schema for both backends (SQLite, PostgreSQL). Times are Unix seconds (float); JSON columns hold the wire
objects as the protocol packages made them. No onnxruntime, no server import.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

# A stored Response (POST /v1/responses with store=true, or background=true). ``body`` is the Response object as
# the API returns it; ``conversation`` the chat messages of the whole thread up to and including its output (what
# previous_response_id continues); ``request`` the request body of a background response (run again by whoever
# takes it over after its owner died); ``owner`` the worker that runs a background response and ``lease_until``
# until when its claim holds.
responses = sa.Table(
    "responses", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("background", sa.Boolean, nullable=False, default=False),
    sa.Column("body", sa.JSON, nullable=False),
    sa.Column("conversation", sa.JSON, nullable=False),
    sa.Column("input_items", sa.JSON, nullable=False),
    sa.Column("request", sa.JSON, nullable=True),
    sa.Column("num_bytes", sa.Integer, nullable=False, default=0),
    sa.Column("owner", sa.String(128), nullable=True),
    sa.Column("lease_until", sa.Float, nullable=True),
    sa.Column("cancel_requested", sa.Boolean, nullable=False, default=False),
)

# The streamed events of a background response, in order (resumed with starting_after).
response_events = sa.Table(
    "response_events", metadata,
    sa.Column("response_id", sa.String(64), sa.ForeignKey("responses.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("event", sa.JSON, nullable=False),
)

conversations = sa.Table(
    "conversations", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("metadata", sa.JSON, nullable=False),
)

# A conversation's items in order (``position`` grows; a deleted item leaves a gap).
conversation_items = sa.Table(
    "conversation_items", metadata,
    sa.Column("conversation_id", sa.String(64), sa.ForeignKey("conversations.id", ondelete="CASCADE"),
              primary_key=True),
    sa.Column("position", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("id", sa.String(64), nullable=False, unique=True),
    sa.Column("item", sa.JSON, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

files = sa.Table(
    "files", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("filename", sa.String(512), nullable=False),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=True),
)

# A file's bytes in chunks (the database holds them, so every replica reads the same file).
file_chunks = sa.Table(
    "file_chunks", metadata,
    sa.Column("file_id", sa.String(64), sa.ForeignKey("files.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
)

# A batch: ``body`` is the Batch object as the API returns it (status, counts and times live there too);
# ``owner``/``lease_until`` say which worker runs it.
batches = sa.Table(
    "batches", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("body", sa.JSON, nullable=False),
    sa.Column("owner", sa.String(128), nullable=True),
    sa.Column("lease_until", sa.Float, nullable=True),
)

# One line of a batch's input file: its request (``request``: the parsed line) and, once run, the line of the
# output or error file (``result``). A line's result is written once, in the transaction that marks it done.
batch_lines = sa.Table(
    "batch_lines", metadata,
    sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("line_no", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("status", sa.String(16), nullable=False),  # pending | completed | failed
    sa.Column("request", sa.JSON, nullable=True),
    sa.Column("result", sa.JSON, nullable=True),
)
sa.Index("batch_lines_pending", batch_lines.c.batch_id, batch_lines.c.status)
