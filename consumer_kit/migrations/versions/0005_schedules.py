"""Schedules: how far each schedule's ticks are decided, and the ticks run or skipped.

Revision ID: 0005_schedules
Revises: 0004_tombstones
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from consumer_kit.store.tables import UTCDateTime

revision = "0005_schedules"
down_revision = "0004_tombstones"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("consumer", sa.String(200), nullable=False),
        sa.Column("schedule", sa.String(255), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("decided_until", UTCDateTime(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("consumer", "schedule", "version", name="pk_schedules"),
    )
    op.create_table(
        "schedule_ticks",
        sa.Column("consumer", sa.String(200), nullable=False),
        sa.Column("schedule", sa.String(255), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("tick", UTCDateTime(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(64), nullable=True),
        sa.Column("not_before", UTCDateTime(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("consumer", "schedule", "version", "tick", name="pk_schedule_ticks"),
    )
    op.create_index("ix_schedule_ticks_state", "schedule_ticks", ["consumer", "schedule", "version", "state", "tick"])


def downgrade() -> None:
    op.drop_table("schedule_ticks")
    op.drop_table("schedules")
