"""Persistence: the tables, the inbox engine, the outbox, dead letters and schema management.

The store owns every SQL statement; the pipeline and the sources call its methods.
"""

from consumer_kit.store.database import create_engine, ensure_schema, schema_revisions, upgrade
from consumer_kit.store.dead_letters import DeadLetter, DeadLetters
from consumer_kit.store.inbox import Claim, ClaimStatus, Inbox, utcnow
from consumer_kit.store.outbox import Outbox, OutboxBatch, OutboxMessage, OutboxStats, OutboxWriter
from consumer_kit.store.tables import dead_letters, inbox, metadata, outbox

__all__ = [
    "Claim",
    "ClaimStatus",
    "DeadLetter",
    "DeadLetters",
    "Inbox",
    "Outbox",
    "OutboxBatch",
    "OutboxMessage",
    "OutboxStats",
    "OutboxWriter",
    "create_engine",
    "dead_letters",
    "ensure_schema",
    "inbox",
    "metadata",
    "outbox",
    "schema_revisions",
    "upgrade",
    "utcnow",
]
