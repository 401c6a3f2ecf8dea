"""Core tables: inbox and dead letters.

Revision ID: 0001_core
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from consumer_kit.store.tables import UTCDateTime

revision = "0001_core"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "inbox",
        sa.Column("consumer", sa.String(200), nullable=False),
        sa.Column("key_digest", sa.String(64), nullable=False),
        sa.Column("namespace", sa.String(255), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("locked_until", UTCDateTime(), nullable=True),
        sa.Column("lease_token", sa.String(32), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("last_error", sa.String(500), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("consumer", "key_digest", name="pk_inbox"),
    )
    op.create_index("ix_inbox_expires_at", "inbox", ["expires_at"])
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("consumer", sa.String(200), nullable=False),
        sa.Column("source", sa.String(255), nullable=False),
        sa.Column("namespace", sa.String(255), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("key_digest", sa.String(64), nullable=True),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("headers", sa.JSON(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_dead_letters"),
    )
    op.create_index("ix_dead_letters_created_at", "dead_letters", ["created_at"])
    op.create_index("ix_dead_letters_key_digest", "dead_letters", ["key_digest"])


def downgrade() -> None:
    op.drop_table("dead_letters")
    op.drop_table("inbox")
