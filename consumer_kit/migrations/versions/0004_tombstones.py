"""Tombstones of swept inbox rows: a key seen again after its record was swept is caught.

Revision ID: 0004_tombstones
Revises: 0003_outbox
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from consumer_kit.store.tables import UTCDateTime

revision = "0004_tombstones"
down_revision = "0003_outbox"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "inbox_tombstones",
        sa.Column("consumer", sa.String(200), nullable=False),
        sa.Column("key_digest", sa.String(64), nullable=False),
        sa.Column("swept_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("consumer", "key_digest", name="pk_inbox_tombstones"),
    )
    op.create_index("ix_inbox_tombstones_expires_at", "inbox_tombstones", ["expires_at"])


def downgrade() -> None:
    op.drop_table("inbox_tombstones")
