"""The embedded coordinator: governed resources, idempotency receipts and per-scope receipt counts (striped).

Revision ID: 0002_receipts
Revises: 0001_core
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from consumer_kit.store.tables import UTCDateTime

revision = "0002_receipts"
down_revision = "0001_core"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "coordinator_resources",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("application", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.Column("ended_at", UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_coordinator_resources"),
    )
    op.create_index("ix_coordinator_resources_expires_at", "coordinator_resources", ["expires_at"])
    op.create_table(
        "idempotency_receipts",
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("application", sa.String(200), nullable=False),
        sa.Column("operation", sa.String(16), nullable=False),
        sa.Column("key_digest", sa.String(64), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("resource_id", sa.String(32), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("generated", sa.Boolean(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "application", "operation", "key_digest",
                                name="pk_idempotency_receipts"),
    )
    op.create_index("ix_idempotency_receipts_expires_at", "idempotency_receipts", ["expires_at"])
    op.create_table(
        "idempotency_scopes",
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("application", sa.String(200), nullable=False),
        sa.Column("operation", sa.String(16), nullable=False),
        sa.Column("stripe", sa.Integer(), nullable=False),
        sa.Column("live", sa.Integer(), nullable=False),
        sa.Column("closed", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "application", "operation", "stripe", name="pk_idempotency_scopes"),
    )


def downgrade() -> None:
    op.drop_table("idempotency_scopes")
    op.drop_table("idempotency_receipts")
    op.drop_table("coordinator_resources")
