"""The state store's first schema: stored and background responses with their events, conversations and their
items, files in chunks, batches and their lines.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("background", sa.Boolean, nullable=False),
        sa.Column("body", sa.JSON, nullable=False),
        sa.Column("conversation", sa.JSON, nullable=False),
        sa.Column("input_items", sa.JSON, nullable=False),
        sa.Column("request", sa.JSON, nullable=True),
        sa.Column("num_bytes", sa.Integer, nullable=False),
        sa.Column("owner", sa.String(128), nullable=True),
        sa.Column("lease_until", sa.Float, nullable=True),
        sa.Column("cancel_requested", sa.Boolean, nullable=False),
    )
    op.create_index("ix_responses_created_at", "responses", ["created_at"])
    op.create_table(
        "response_events",
        sa.Column("response_id", sa.String(64), sa.ForeignKey("responses.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("event", sa.JSON, nullable=False),
    )
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("metadata", sa.JSON, nullable=False),
    )
    op.create_index("ix_conversations_created_at", "conversations", ["created_at"])
    op.create_table(
        "conversation_items",
        sa.Column("conversation_id", sa.String(64), sa.ForeignKey("conversations.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("item", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=True),
    )
    op.create_index("ix_files_created_at", "files", ["created_at"])
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.String(64), sa.ForeignKey("files.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("body", sa.JSON, nullable=False),
        sa.Column("owner", sa.String(128), nullable=True),
        sa.Column("lease_until", sa.Float, nullable=True),
    )
    op.create_index("ix_batches_created_at", "batches", ["created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("line_no", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("request", sa.JSON, nullable=True),
        sa.Column("result", sa.JSON, nullable=True),
    )
    op.create_index("batch_lines_pending", "batch_lines", ["batch_id", "status"])


def downgrade() -> None:
    for table in ("batch_lines", "batches", "file_chunks", "files", "conversation_items", "conversations",
                  "response_events", "responses"):
        op.drop_table(table)
