"""Persistence: the tables, every SQL statement (:mod:`.sql`), the one seam to the database driver
(:mod:`.executor`), and the stores on it: the inbox, the outbox, dead letters and the embedded
coordinator's receipts; plus schema management.

The store owns every SQL statement; the pipeline, the coordinator and the sources call its methods.
"""

from consumer_kit.store.connections import Capabilities, Database
from consumer_kit.store.database import (
    AppMigrations,
    app_revisions,
    check_schema,
    create_engine,
    ensure_schema,
    schema_revisions,
    upgrade,
)
from consumer_kit.store.dead_letters import DeadLetter, DeadLetters, ParkedFilter
from consumer_kit.store.executor import Executor
from consumer_kit.store.inbox import BatchKey, Claim, ClaimStatus, Clock, Inbox, claimable, utcnow, verdict
from consumer_kit.store.outbox import Outbox, OutboxBatch, OutboxMessage, OutboxStats, OutboxWriter
from consumer_kit.store.staged import StagedWrites
from consumer_kit.store.tables import dead_letters, inbox, metadata, outbox

__all__ = [
    "AppMigrations",
    "BatchKey",
    "Capabilities",
    "Claim",
    "ClaimStatus",
    "Clock",
    "Database",
    "DeadLetter",
    "DeadLetters",
    "Executor",
    "Inbox",
    "Outbox",
    "OutboxBatch",
    "OutboxMessage",
    "OutboxStats",
    "OutboxWriter",
    "ParkedFilter",
    "StagedWrites",
    "app_revisions",
    "check_schema",
    "claimable",
    "create_engine",
    "dead_letters",
    "ensure_schema",
    "inbox",
    "metadata",
    "outbox",
    "schema_revisions",
    "upgrade",
    "utcnow",
    "verdict",
]
