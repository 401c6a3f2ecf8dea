"""The tables consumer-kit keeps, as SQLAlchemy Core definitions.

Alembic migrations (``consumer_kit/migrations``) create them; a test proves the two agree. They work
on SQLite (the embedded default) and PostgreSQL. Keys appear only as keyed digests.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    DateTime,
    Dialect,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    }
)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every backend (SQLite stores naive text; PostgreSQL timestamptz)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


inbox = Table(
    "inbox",
    metadata,
    Column("consumer", String(200), primary_key=True),
    Column("key_digest", String(64), primary_key=True),
    Column("namespace", String(255), nullable=False),
    Column("version", Integer, nullable=False),
    Column("fingerprint", String(64), nullable=False),
    Column("state", String(16), nullable=False),  # started | completed | dead
    Column("locked_until", UTCDateTime(), nullable=True),
    Column("lease_token", String(32), nullable=True),
    Column("attempts", Integer, nullable=False),
    Column("outcome", String(32), nullable=True),
    Column("result", JSON, nullable=True),
    Column("last_error", String(500), nullable=True),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
    Column("expires_at", UTCDateTime(), nullable=False),
    Index("ix_inbox_expires_at", "expires_at"),
)

# Digests of swept inbox rows, kept INBOX_TOMBSTONE_SECONDS after the sweep: a delivery of one of
# those keys is a duplicate whose record is gone (see the pipeline's late-delivery policy).
inbox_tombstones = Table(
    "inbox_tombstones",
    metadata,
    Column("consumer", String(200), primary_key=True),
    Column("key_digest", String(64), primary_key=True),
    Column("swept_at", UTCDateTime(), nullable=False),
    Column("expires_at", UTCDateTime(), nullable=False),
    Index("ix_inbox_tombstones_expires_at", "expires_at"),
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("consumer", String(200), nullable=False),
    Column("source", String(255), nullable=False),
    Column("namespace", String(255), nullable=False),
    Column("version", Integer, nullable=False),
    Column("key_digest", String(64), nullable=True),  # None when the delivery could not be keyed
    Column("reason", String(64), nullable=False),
    Column("detail", Text, nullable=True),
    Column("body", LargeBinary, nullable=False),
    Column("headers", JSON, nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    # What a replay needs to hand the delivery over exactly as the source did: the source's delivery id
    # (the stable id the key was made of: kept for the replay only, never printed) and the
    # security-relevant attributes, and its fingerprint (what "the same request" meant for it). NULL on
    # rows parked before 0006.
    Column("delivery_id", String(1024), nullable=True),
    Column("attributes", JSON, nullable=True),
    Column("fingerprint", String(64), nullable=True),
    Column("replays", Integer, nullable=False, server_default="0"),
    Column("replayed_at", UTCDateTime(), nullable=True),
    # The last attempt's traceback (raw key redacted) when a handler's exception parked the delivery:
    # its end, at most TRACEBACK_LIMIT_BYTES (store.dead_letters). NULL otherwise, and before 0007.
    Column("traceback", Text, nullable=True),
    Index("ix_dead_letters_created_at", "created_at"),
    Index("ix_dead_letters_key_digest", "key_digest"),
    # A group's keyset pages, newest first (migration 0008; it serves lookups by reason too).
    Index("ix_dead_letters_reason_source_created_at_id", "reason", "source", "created_at", "id"),
)

# Who replayed or discarded which parked delivery, and when (kept when the parked row is discarded).
parked_audit = Table(
    "parked_audit",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("dead_letter_id", String(32), nullable=False),
    Column("action", String(16), nullable=False),  # replay | discard
    Column("actor", String(255), nullable=False),
    Column("acted_at", UTCDateTime(), nullable=False),
    Column("consumer", String(200), nullable=False),
    Column("source", String(255), nullable=False),
    Column("reason", String(64), nullable=False),  # why it was parked
    Column("key_digest", String(64), nullable=True),
    Column("outcome", String(32), nullable=False),  # requeued | processed | duplicate | parked | ... | discarded
    Column("detail", Text, nullable=True),
    Index("ix_parked_audit_dead_letter_id", "dead_letter_id"),
    Index("ix_parked_audit_acted_at", "acted_at"),
)

outbox = Table(
    "outbox",
    metadata,
    # A keyed digest of (consumer, operation key, position) for handler rows: stable across re-runs,
    # and it reveals nothing of the key. It is also the message id the relay publishes with.
    Column("id", String(64), primary_key=True),
    Column("destination", String(255), nullable=False),
    Column("headers", JSON, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("available_at", UTCDateTime(), nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("published_at", UTCDateTime(), nullable=True),
    Column("last_error", String(500), nullable=True),
    Index("ix_outbox_pending", "published_at", "available_at"),
)

# The embedded coordinator's. Keys appear only as HMAC-SHA-256 digests; receipts hold
# bounded operational fields only (no metadata, invocation parameters, credentials or bearer tokens).

coordinator_resources = Table(
    "coordinator_resources",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("tenant", String(200), nullable=False),
    Column("application", String(200), nullable=False),
    Column("kind", String(16), nullable=False),  # session | delegation
    Column("status", String(16), nullable=False),  # active | ended | revoked
    Column("created_at", UTCDateTime(), nullable=False),
    Column("expires_at", UTCDateTime(), nullable=False),
    Column("ended_at", UTCDateTime(), nullable=True),
    Index("ix_coordinator_resources_expires_at", "expires_at"),
)

idempotency_receipts = Table(
    "idempotency_receipts",
    metadata,
    Column("tenant", String(200), primary_key=True),
    Column("application", String(200), primary_key=True),
    Column("operation", String(16), primary_key=True),  # session | delegation
    Column("key_digest", String(64), primary_key=True),
    Column("fingerprint", String(64), nullable=False),
    Column("resource_id", String(32), nullable=False),
    Column("response", JSON, nullable=False),  # {"id", "status", "expires_at"}: nothing else
    Column("generated", Boolean, nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("expires_at", UTCDateTime(), nullable=False),
    Index("ix_idempotency_receipts_expires_at", "expires_at"),
)

# Live receipts per scope, counted over a few stripe rows: the cap costs one row update per creation
# instead of a COUNT over up to IDEMPOTENCY_MAX_RECEIPTS_PER_SCOPE index entries, and concurrent
# creations do not queue on one row lock (see consumer_kit.store.receipts).
idempotency_scopes = Table(
    "idempotency_scopes",
    metadata,
    Column("tenant", String(200), primary_key=True),
    Column("application", String(200), primary_key=True),
    Column("operation", String(16), primary_key=True),
    Column("stripe", Integer, primary_key=True),
    Column("live", Integer, nullable=False),
    Column("closed", Boolean, nullable=False),  # counted exactly under all stripe locks while set
)

# Schedules (consumer_kit.sources.schedules): per (consumer, schedule, version), how far due ticks have been decided,
# and one row per tick decided: to run (pending until its delivery settles) or skipped, with why.

schedules = Table(
    "schedules",
    metadata,
    Column("consumer", String(200), primary_key=True),
    Column("schedule", String(255), primary_key=True),
    Column("version", Integer, primary_key=True),
    # Every tick at or before this instant has been decided (run or skipped); later ones are not yet.
    Column("decided_until", UTCDateTime(), nullable=False),
    Column("created_at", UTCDateTime(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
)

schedule_ticks = Table(
    "schedule_ticks",
    metadata,
    Column("consumer", String(200), primary_key=True),
    Column("schedule", String(255), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("tick", UTCDateTime(), primary_key=True),  # the intended fire instant
    Column("state", String(16), nullable=False),  # pending | done | parked | skipped
    Column("reason", String(64), nullable=True),  # skipped: coalesced|misfire|too_many|overlap; parked: why
    Column("not_before", UTCDateTime(), nullable=True),  # pending after a failed attempt: retry from then
    Column("created_at", UTCDateTime(), nullable=False),
    Column("updated_at", UTCDateTime(), nullable=False),
    Index("ix_schedule_ticks_state", "consumer", "schedule", "version", "state", "tick"),
)
