"""Parked deliveries are listed a page at a time by group (the operator's console): one index on
(reason, source, created_at, id) serves each group's keyset pages and its count, newest first, without
reading the rest of the table. It starts with ``reason``, so it replaces the index on ``reason`` alone.

Revision ID: 0008_parked_pages
Revises: 0007_parked_tracebacks
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0008_parked_pages"
down_revision = "0007_parked_tracebacks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_dead_letters_reason_source_created_at_id", "dead_letters",
                    ["reason", "source", "created_at", "id"])
    op.drop_index("ix_dead_letters_reason", table_name="dead_letters")


def downgrade() -> None:
    op.create_index("ix_dead_letters_reason", "dead_letters", ["reason"])
    op.drop_index("ix_dead_letters_reason_source_created_at_id", table_name="dead_letters")
