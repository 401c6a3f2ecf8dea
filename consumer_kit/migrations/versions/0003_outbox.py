"""The transactional outbox.

Revision ID: 0003_outbox
Revises: 0002_receipts
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from consumer_kit.store.tables import UTCDateTime

revision = "0003_outbox"
down_revision = "0002_receipts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("destination", sa.String(255), nullable=False),
        sa.Column("headers", sa.JSON(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("available_at", UTCDateTime(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("published_at", UTCDateTime(), nullable=True),
        sa.Column("last_error", sa.String(500), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_outbox"),
    )
    op.create_index("ix_outbox_pending", "outbox", ["published_at", "available_at"])


def downgrade() -> None:
    op.drop_table("outbox")
