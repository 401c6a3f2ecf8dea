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

# One row per scope counting its live receipts: the cap is one row update instead of a COUNT over
# up to IDEMPOTENCY_MAX_RECEIPTS_PER_SCOPE index entries on every creation.
idempotency_scopes = Table(
    "idempotency_scopes",
    metadata,
    Column("tenant", String(200), primary_key=True),
    Column("application", String(200), primary_key=True),
    Column("operation", String(16), primary_key=True),
    Column("live", Integer, nullable=False),
)
