"""Parked deliveries keep the traceback of the handler's exception that parked them (raw key redacted,
its last 16 KiB), for ``consumer-kit parked show``.

Revision ID: 0007_parked_tracebacks
Revises: 0006_parked_replays
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_parked_tracebacks"
down_revision = "0006_parked_replays"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: PostgreSQL adds it without rewriting the table, and rows
    # parked before keep NULL (no traceback was kept for them).
    with op.batch_alter_table("dead_letters") as batch:
        batch.add_column(sa.Column("traceback", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("dead_letters") as batch:
        batch.drop_column("traceback")
