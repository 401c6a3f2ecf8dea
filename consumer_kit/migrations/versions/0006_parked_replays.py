"""Parked deliveries that can be replayed: what the source handed over besides the body and headers
(its delivery id, its security-relevant attributes, its fingerprint), how often each was replayed, and an audit of who
replayed or discarded which, and when.

Revision ID: 0006_parked_replays
Revises: 0005_schedules
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from consumer_kit.store.tables import UTCDateTime

revision = "0006_parked_replays"
down_revision = "0005_schedules"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("dead_letters") as batch:
        batch.add_column(sa.Column("delivery_id", sa.String(1024), nullable=True))
        batch.add_column(sa.Column("attributes", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("fingerprint", sa.String(64), nullable=True))
        batch.add_column(sa.Column("replays", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("replayed_at", UTCDateTime(), nullable=True))
    op.create_index("ix_dead_letters_reason", "dead_letters", ["reason"])
    op.create_table(
        "parked_audit",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("dead_letter_id", sa.String(32), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("acted_at", UTCDateTime(), nullable=False),
        sa.Column("consumer", sa.String(200), nullable=False),
        sa.Column("source", sa.String(255), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("key_digest", sa.String(64), nullable=True),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_parked_audit"),
    )
    op.create_index("ix_parked_audit_dead_letter_id", "parked_audit", ["dead_letter_id"])
    op.create_index("ix_parked_audit_acted_at", "parked_audit", ["acted_at"])


def downgrade() -> None:
    op.drop_table("parked_audit")
    op.drop_index("ix_dead_letters_reason", "dead_letters")
    with op.batch_alter_table("dead_letters") as batch:
        batch.drop_column("replayed_at")
        batch.drop_column("replays")
        batch.drop_column("fingerprint")
        batch.drop_column("attributes")
        batch.drop_column("delivery_id")
