"""The embedded coordinator's tables, on the store's shared metadata (coordinator -> store, never the
reverse). Keys appear only as HMAC-SHA-256 digests; receipts hold bounded operational fields only
(seed 000: no metadata, invocation parameters, credentials or bearer tokens)."""

from __future__ import annotations

from sqlalchemy import JSON, Boolean, Column, Index, Integer, String, Table

from consumer_kit.store.tables import UTCDateTime, metadata

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
# creations do not queue on one row lock (see consumer_kit.coordinator.store).
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
