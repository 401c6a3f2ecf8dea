"""Every SQL statement of the store, in one place.

Statements take named parameters (``:name``); :mod:`consumer_kit.store.executor` runs them on either driver
(asyncpg receives them as ``$n``). ``sql`` is PostgreSQL's text; ``sqlite`` is given where SQLite needs other
words (no ``FOR UPDATE``, no data-modifying ``WITH``). Statements marked PostgreSQL-only are used on PostgreSQL
alone; the store takes another path on SQLite.

Parameters and result columns are typed by name (:data:`TYPES`): every column of that name, in every table, has
that type, so a statement needs no type list of its own.

The two compound statements at the end (:data:`CLAIM_CREATING_SESSION`, :data:`COMPLETE_ENDING_SESSION`) are the
private contract between the inbox and the coordinator's receipt store: the embedded coordinator's session is
created in the statement that claims the delivery (only when the claim takes the lease) and ended in the
statement that completes it, one round trip and one commit fewer each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import JSON, Boolean, LargeBinary
from sqlalchemy.types import TypeEngine

from consumer_kit.store.tables import UTCDateTime

Kind = Literal["datetime", "json", "bool", "bytes"]

TYPES: dict[str, Kind] = {
    **dict.fromkeys(("now", "locked_until", "expires_at", "created_at", "updated_at", "available_at",
                     "published_at", "ended_at", "keep_from", "since", "oldest", "receipt_expires_at",
                     "resource_expires_at", "inbox_locked_until", "swept_at", "tombstone_expires_at", "tick",
                     "decided_until", "decided_from", "not_before", "before", "newest", "replayed_at", "acted_at"),
                    "datetime"),
    **dict.fromkeys(("result", "headers", "response", "inbox_result", "attributes"), "json"),
    **dict.fromkeys(("closed", "generated", "tombstones", "tombstoned", "locked"), "bool"),
    **dict.fromkeys(("body",), "bytes"),
}
"""The type of every parameter and result column by name; anything else is text or an integer."""

SQLALCHEMY_TYPES: dict[Kind, TypeEngine[object]] = {
    "datetime": UTCDateTime(), "json": JSON(), "bool": Boolean(), "bytes": LargeBinary(),  # type: ignore[dict-item]
}


@dataclass(frozen=True, slots=True)
class Statement:
    """One SQL statement: PostgreSQL's text, and SQLite's where it differs."""

    sql: str
    sqlite: str | None = None

    def text(self, dialect: str) -> str:
        """The statement's text for ``dialect`` (``postgresql`` or ``sqlite``)."""
        return self.sqlite if dialect == "sqlite" and self.sqlite is not None else self.sql


def _skip_locked(select: str) -> Statement:
    """``select`` locking its rows on PostgreSQL (other workers skip them), plain on SQLite (one writer)."""
    return Statement(f"{select} FOR UPDATE SKIP LOCKED", select)


# --- inbox ------------------------------------------------------------------------------------------

INBOX_COLUMNS = (
    "consumer, key_digest, namespace, version, fingerprint, state, locked_until, lease_token, attempts,"
    " outcome, result, last_error, created_at, updated_at, expires_at"
)
# Equality on the whole key, never IN (...): PostgreSQL plans a prepared statement once (generically, after five runs),
# and on a table still empty then it plans key_digest IN ($2, $3) as a filter over every row of the consumer, which
# stays the plan of that connection as the table grows (a lookup in milliseconds at tens of thousands of rows). A row
# under the previous HMAC key is a second lookup.
LOOKUP = Statement(f"SELECT {INBOX_COLUMNS} FROM inbox WHERE consumer = :consumer AND key_digest = :key_digest")

# The two-transaction claim (the first transaction), in autocommit: insert the row, or take over a started row for the
# same request whose lease ran out or was released; concurrent claimers serialise on the row and one gets it. RETURNING
# gives the attempts when this claim took the lease.
_UPSERT_STARTED = (
    "INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, locked_until,"
    " lease_token, attempts, created_at, updated_at, expires_at)"
    " VALUES (:consumer, :key_digest, :namespace, :version, :fingerprint, 'started', :locked_until,"
    " :lease_token, 1, :now, :now, :expires_at)"
    " ON CONFLICT (consumer, key_digest) DO UPDATE SET locked_until = :locked_until,"
    " lease_token = :lease_token, attempts = inbox.attempts + 1, updated_at = :now"
    " WHERE inbox.state = 'started' AND inbox.fingerprint = :fingerprint"
    " AND (inbox.locked_until IS NULL OR inbox.locked_until <= :now)"
    " RETURNING attempts"
)
CLAIM_SQLITE = Statement(_UPSERT_STARTED)  # SQLite: after a plain lookup, so a repeat writes nothing
# PostgreSQL: the claim and the look at the row in one statement. The insert is skipped outright when the row is
# completed, dead, leased or for another request, so a redelivery of finished work writes, locks and flushes nothing;
# ``inbox_*`` is the row as this statement's snapshot saw it, for the verdict when the claim did not take the lease.
_CLAIM_CTES = (
    "inbox_row AS (SELECT state, fingerprint, locked_until, attempts, result FROM inbox"
    " WHERE consumer = :consumer AND key_digest = :key_digest),"
    " tomb AS (SELECT 1 FROM inbox_tombstones WHERE consumer = :consumer AND key_digest = :key_digest"
    " AND CAST(:tombstones AS boolean)),"
    " anchor AS (INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, locked_until,"
    " lease_token, attempts, created_at, updated_at, expires_at)"
    " SELECT CAST(:consumer AS varchar), CAST(:key_digest AS varchar), CAST(:namespace AS varchar),"
    " CAST(:version AS integer), CAST(:fingerprint AS varchar), 'started', CAST(:locked_until AS timestamptz),"
    " CAST(:lease_token AS varchar), 1, CAST(:now AS timestamptz), CAST(:now AS timestamptz),"
    " CAST(:expires_at AS timestamptz)"
    " WHERE NOT EXISTS (SELECT 1 FROM inbox_row WHERE state <> 'started' OR fingerprint <> :fingerprint"
    " OR locked_until > :now) AND NOT EXISTS (SELECT 1 FROM tomb)"
    " ON CONFLICT (consumer, key_digest) DO UPDATE SET locked_until = :locked_until,"
    " lease_token = :lease_token, attempts = inbox.attempts + 1, updated_at = :now"
    " WHERE inbox.state = 'started' AND inbox.fingerprint = :fingerprint"
    " AND (inbox.locked_until IS NULL OR inbox.locked_until <= :now)"
    " RETURNING attempts)"
)
_CLAIM_COLUMNS = (
    "(SELECT attempts FROM anchor) AS claimed, r.state AS inbox_state, r.fingerprint AS inbox_fingerprint,"
    " r.locked_until AS inbox_locked_until, r.attempts AS inbox_attempts, r.result AS inbox_result,"
    " EXISTS (SELECT 1 FROM tomb) AS tombstoned"
)
_CLAIM_FROM = "{one} AS inbox_one LEFT JOIN inbox_row r ON true"
# A lease alone commits without waiting for its WAL to reach the disk: ``synchronous_commit`` is off for the claim's own
# transaction (``set_config(..., true)`` ends with it; PostgreSQL keeps a volatile column of a subquery, so the setting
# is made even though no column reads it). The claim is visible to every other claimer at once, as before; only a crash
# of the database server can lose it (the last fraction of a second of such commits). That is a lease ended early, which
# the design survives anyway: the connection the delivery holds dies with the server, so its completion cannot commit;
# were the lease lost while it lived, the completion's ``WHERE lease_token = ours`` would match nothing and roll the
# effect back. And a completion that commits flushes the WAL up to itself, the claim's record included. On a host whose
# disk flushes are slow this takes one of the two-transaction path's two flushes away. A claim carrying a session's
# creation stays durable (the session may be used outside the database before the completion commits).
_LEASE_ONLY = "(SELECT set_config('synchronous_commit', 'off', true))"
CLAIM = Statement(  # PostgreSQL only
    f"WITH {_CLAIM_CTES} SELECT {_CLAIM_COLUMNS} FROM {_CLAIM_FROM.format(one=_LEASE_ONLY)}")

# The single-transaction claim, inside the handler's transaction: a new key's row is inserted already
# completed, so the effect and the record commit together or not at all.
_INSERT_COMPLETED = (
    "INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, attempts, outcome,"
    " created_at, updated_at, expires_at) SELECT {values}"
    " WHERE NOT ({tombstones} AND EXISTS (SELECT 1 FROM inbox_tombstones"
    " WHERE consumer = :consumer AND key_digest = :key_digest))"
    " ON CONFLICT (consumer, key_digest) DO NOTHING"
)
# PostgreSQL types a parameter once for the statement: where the select list and the WHERE both use
# it, the CASTs say which type (SQLite, which has no such types, would store a CAST's NUMERIC instead).
INSERT_COMPLETED = Statement(
    _INSERT_COMPLETED.format(
        values="CAST(:consumer AS varchar), CAST(:key_digest AS varchar), :namespace, :version, :fingerprint,"
               " 'completed', 1, :outcome, :now, :now, :expires_at",
        tombstones="CAST(:tombstones AS boolean)"),
    _INSERT_COMPLETED.format(
        values=":consumer, :key_digest, :namespace, :version, :fingerprint, 'completed', 1, :outcome, :now, :now,"
               " :expires_at",
        tombstones=":tombstones"),
)
# A batch's claim (PostgreSQL): every key written completed in one statement, inside the batch's transaction; the keys
# it did not write are looked up after. Each key is probed through the primary key by a LATERAL ... LIMIT 1 (which
# PostgreSQL does not flatten into a join: a join over an array is planned, on an empty table, as a scan of the
# consumer's rows).
CLAIM_BATCH = Statement(
    "INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, attempts, outcome,"
    " created_at, updated_at, expires_at)"
    " SELECT CAST(:consumer AS varchar), k.key_digest, k.namespace, k.version, k.fingerprint, 'completed', 1,"
    " CAST(:outcome AS varchar), CAST(:now AS timestamptz), CAST(:now AS timestamptz),"
    " CAST(:expires_at AS timestamptz)"
    " FROM unnest(CAST(:key_digests AS varchar[]), CAST(:namespaces AS varchar[]), CAST(:versions AS integer[]),"
    " CAST(:fingerprints AS varchar[])) AS k(key_digest, namespace, version, fingerprint)"
    " LEFT JOIN LATERAL (SELECT 1 AS found FROM inbox_tombstones t WHERE t.consumer = CAST(:consumer AS varchar)"
    " AND t.key_digest = k.key_digest AND CAST(:tombstones AS boolean) LIMIT 1) tomb ON true"
    " WHERE tomb.found IS NULL"
    " ON CONFLICT (consumer, key_digest) DO NOTHING RETURNING key_digest"
)
LOOKUP_MANY = Statement(
    f"SELECT i.* FROM unnest(CAST(:key_digests AS varchar[])) AS k(key_digest) CROSS JOIN LATERAL"
    f" (SELECT {INBOX_COLUMNS} FROM inbox WHERE consumer = :consumer AND key_digest = k.key_digest LIMIT 1) i"
)
TOMBSTONE = Statement(
    "SELECT swept_at FROM inbox_tombstones WHERE consumer = :consumer AND key_digest = :key_digest")
# ... and a row an earlier failed attempt left started and unleased is finished in it.
FINISH_STARTED = Statement(
    "UPDATE inbox SET state = 'completed', locked_until = NULL, lease_token = NULL, attempts = attempts + 1,"
    " outcome = :outcome, last_error = NULL, updated_at = :now, expires_at = :expires_at"
    " WHERE consumer = :consumer AND key_digest = :key_digest AND state = 'started'"
    " AND fingerprint = :fingerprint AND (locked_until IS NULL OR locked_until <= :now)"
    " RETURNING attempts"
)
# An idempotent endpoint's single transaction (PostgreSQL): first the key's advisory lock, not waited for (not granted:
# a request with the key is in flight), and the row and tombstone as the snapshot sees them; last the row, completed
# with the response, where the key's uniqueness stops a request that looked before another's commit was visible to it.
LOCK_AND_LOOK = Statement(
    "SELECT pg_try_advisory_xact_lock(hashtextextended(CAST(:consumer AS text) || ' ' || CAST(:key_digest AS text),"
    " 0)) AS locked, EXISTS (SELECT 1 FROM inbox_tombstones WHERE consumer = :consumer AND key_digest = :key_digest"
    " AND CAST(:tombstones AS boolean)) AS tombstoned, r.* FROM (SELECT 1) AS one LEFT JOIN (SELECT"
    f" {INBOX_COLUMNS} FROM inbox WHERE consumer = :consumer AND key_digest = :key_digest) AS r ON true")
INSERT_COMPLETED_WITH_RESULT = Statement(*(s.replace("outcome, created_at", "outcome, result, created_at").replace(
    ":outcome,", ":outcome, :result,") for s in (INSERT_COMPLETED.sql, INSERT_COMPLETED.sqlite or "")))
_SET_RESULT = ("outcome = :outcome,", "outcome = :outcome, result = :result,")
FINISH_STARTED_WITH_RESULT = Statement(FINISH_STARTED.sql.replace(*_SET_RESULT))

# The completion (the second transaction), inside the handler's transaction, only while the lease is ours. The expiry
# the claim wrote is kept when it is at least ``keep_from`` (the completion's own, less a lease): an update that changes
# no indexed column can be a heap-only tuple update on PostgreSQL, which writes no index entries (ix_inbox_expires_at is
# the only index besides the key). Retention then counts from at most one lease before the completion.
_OURS = " WHERE consumer = :consumer AND key_digest = :key_digest AND state = 'started' AND lease_token = :lease_token"
"""The row of a key whose lease this attempt holds."""
_COMPLETE = ("UPDATE inbox SET state = 'completed', locked_until = NULL, lease_token = NULL, outcome = :outcome,"
             " last_error = NULL, updated_at = :now,"
             " expires_at = CASE WHEN expires_at >= :keep_from THEN expires_at ELSE :expires_at END" + _OURS)
COMPLETE = Statement(_COMPLETE)
# The same, storing what a repeat is answered with (an idempotent HTTP endpoint's response).
COMPLETE_WITH_RESULT = Statement(_COMPLETE.replace(*_SET_RESULT))
# An attempt whose request failed validation before its route ran takes its claim back (the seed's "fails
# validation: delete"): the corrected request, which has another fingerprint, is then a new one.
WITHDRAW = Statement("DELETE FROM inbox" + _OURS)
RENEW = Statement("UPDATE inbox SET locked_until = :locked_until, updated_at = :now" + _OURS)
RELEASE = Statement(
    "UPDATE inbox SET locked_until = NULL, lease_token = NULL, updated_at = :now, last_error = :last_error" + _OURS)
_MARK_DEAD = ("UPDATE inbox SET state = 'dead', locked_until = NULL, lease_token = NULL, outcome = :outcome,"
              " updated_at = :now, expires_at = :expires_at"
              " WHERE consumer = :consumer AND key_digest = :key_digest AND state = 'started'")
MARK_DEAD = Statement(f"{_MARK_DEAD} AND lease_token = :lease_token")
MARK_DEAD_UNLEASED = Statement(f"{_MARK_DEAD} AND lease_token IS NULL")
# After a failed single-transaction attempt: remember it (unleased) and count it.
RECORD_FAILURE = Statement(
    "INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, attempts, last_error,"
    " created_at, updated_at, expires_at)"
    " VALUES (:consumer, :key_digest, :namespace, :version, :fingerprint, 'started', 1, :last_error, :now, :now,"
    " :expires_at)"
    " ON CONFLICT (consumer, key_digest) DO UPDATE SET attempts = inbox.attempts + 1,"
    " last_error = :last_error, updated_at = :now WHERE inbox.state = 'started'"
    " RETURNING attempts"
)
# Expired rows, oldest first, in short batches (never a started row with a live lease), each from the newest expiry the
# last deleted (``since``): dead index entries await vacuum, and walking them again made a sweep quadratic.
_EXPIRED_INBOX = ("FROM inbox WHERE expires_at <= :now AND expires_at >= :since"
                  " AND (locked_until IS NULL OR locked_until <= :now) ORDER BY expires_at LIMIT :limit")
# PostgreSQL deletes a batch and writes its tombstones in one statement; SQLite reads, keeps tombstones, deletes.
SWEEP_INBOX = Statement(
    f"WITH gone AS (DELETE FROM inbox WHERE ctid IN (SELECT ctid {_EXPIRED_INBOX} FOR UPDATE SKIP LOCKED)"
    " RETURNING consumer, key_digest, expires_at), kept AS (INSERT INTO inbox_tombstones (consumer, key_digest,"
    " swept_at, expires_at) SELECT consumer, key_digest, :now, :tombstone_expires_at FROM gone"
    " WHERE CAST(:tombstones AS boolean) ON CONFLICT DO NOTHING)"
    " SELECT count(*) AS swept, max(expires_at) AS newest FROM gone",
    f"SELECT consumer, key_digest, expires_at {_EXPIRED_INBOX}",
)
TOMBSTONE_SQLITE = Statement(
    "INSERT INTO inbox_tombstones (consumer, key_digest, swept_at, expires_at)"
    " VALUES (:consumer, :key_digest, :now, :tombstone_expires_at) ON CONFLICT DO NOTHING")
DELETE_SWEPT_SQLITE = Statement("DELETE FROM inbox WHERE consumer = :consumer AND key_digest = :key_digest")
FORGET_TOMBSTONE = Statement(
    "DELETE FROM inbox_tombstones WHERE consumer = :consumer AND key_digest = :key_digest")
_EXPIRED_TOMBSTONES = "FROM inbox_tombstones WHERE expires_at <= :now AND expires_at >= :since ORDER BY expires_at"
SWEEP_TOMBSTONES = Statement(  # PostgreSQL; batches go on as the inbox's do
    f"WITH gone AS (DELETE FROM inbox_tombstones WHERE ctid IN (SELECT ctid {_EXPIRED_TOMBSTONES} LIMIT :limit"
    " FOR UPDATE SKIP LOCKED) RETURNING expires_at) SELECT count(*) AS swept, max(expires_at) AS newest FROM gone")
SWEEP_TOMBSTONES_SQLITE = Statement(  # SQLite frees a row at once
    f"DELETE FROM inbox_tombstones WHERE rowid IN (SELECT rowid {_EXPIRED_TOMBSTONES} LIMIT :limit)")

# --- outbox -----------------------------------------------------------------------------------------

INSERT_OUTBOX = Statement(
    "INSERT INTO outbox (id, destination, headers, body, created_at, available_at, attempts)"
    " VALUES (:id, :destination, :headers, :body, :created_at, :available_at, 0) ON CONFLICT (id) DO NOTHING"
)
NOTIFY = Statement("SELECT pg_notify(:channel, '')")  # PostgreSQL only; delivered at commit
CLAIM_OUTBOX = _skip_locked(
    "SELECT id, destination, body, headers, attempts FROM outbox"
    " WHERE published_at IS NULL AND available_at <= :now ORDER BY available_at LIMIT :limit"
)
MARK_PUBLISHED = Statement(
    "UPDATE outbox SET published_at = :now, attempts = attempts + 1, last_error = NULL WHERE id = :id")
MARK_FAILED = Statement(
    "UPDATE outbox SET attempts = attempts + 1, last_error = :last_error, available_at = :available_at"
    " WHERE id = :id")
OUTBOX_STATS = Statement(
    "SELECT count(*) AS pending, min(created_at) AS oldest FROM outbox WHERE published_at IS NULL")
GET_OUTBOX = Statement(
    "SELECT id, destination, headers, body, created_at, available_at, attempts, published_at, last_error"
    " FROM outbox WHERE id = :id")
_PUBLISHED_OUTBOX = "FROM outbox WHERE published_at <= :before LIMIT :limit"
SWEEP_OUTBOX = Statement(
    f"DELETE FROM outbox WHERE id IN (SELECT id {_PUBLISHED_OUTBOX} FOR UPDATE SKIP LOCKED)",
    f"DELETE FROM outbox WHERE id IN (SELECT id {_PUBLISHED_OUTBOX})",
)

# --- dead letters -----------------------------------------------------------------------------------

INSERT_DEAD_LETTER = Statement(
    "INSERT INTO dead_letters (id, consumer, source, namespace, version, key_digest, reason, detail, body,"
    " headers, attempts, created_at, delivery_id, attributes, fingerprint, replays, traceback)"
    " VALUES (:id, :consumer, :source, :namespace, :version, :key_digest, :reason, :detail, :body, :headers,"
    " :attempts, :created_at, :delivery_id, :attributes, :fingerprint, 0, :traceback)"
)
# An unset filter is NULL; the CASTs give PostgreSQL the parameter's type where it is first seen (on
# SQLite they only take part in the IS NULL test). ``replayed``: 1 only replayed ones, 0 only others.
_DEAD_LETTER_FILTERS = (
    "(CAST(:consumer AS varchar) IS NULL OR consumer = :consumer)"
    " AND (CAST(:reason AS varchar) IS NULL OR reason = :reason)"
    " AND (CAST(:namespace AS varchar) IS NULL OR namespace = :namespace)"
    " AND (CAST(:source AS varchar) IS NULL OR source = :source)"
    " AND (CAST(:since AS timestamptz) IS NULL OR created_at >= :since)"
    " AND (CAST(:replayed AS integer) IS NULL OR (CAST(:replayed AS integer) = 1 AND replays > 0)"
    " OR (CAST(:replayed AS integer) = 0 AND replays = 0))"
)
_DEAD_LETTER_COLUMNS = ("id, consumer, source, namespace, version, key_digest, reason, detail, body, headers,"
                        " attempts, created_at, delivery_id, attributes, fingerprint, replays, replayed_at, traceback")
LIST_DEAD_LETTERS = Statement(
    f"SELECT {_DEAD_LETTER_COLUMNS} FROM dead_letters WHERE {_DEAD_LETTER_FILTERS}"
    " ORDER BY created_at DESC, id LIMIT :limit")
# Oldest first: a replay sends parked work back in the order it was parked.
OLDEST_DEAD_LETTERS = Statement(
    f"SELECT {_DEAD_LETTER_COLUMNS} FROM dead_letters WHERE {_DEAD_LETTER_FILTERS}"
    " ORDER BY created_at, id LIMIT :limit")
COUNT_DEAD_LETTERS = Statement(f"SELECT count(*) AS parked FROM dead_letters WHERE {_DEAD_LETTER_FILTERS}")
GROUP_DEAD_LETTERS = Statement(
    "SELECT reason, source, count(*) AS parked, min(created_at) AS oldest, max(created_at) AS newest,"
    f" sum(CASE WHEN replays > 0 THEN 1 ELSE 0 END) AS replayed FROM dead_letters WHERE {_DEAD_LETTER_FILTERS}"
    " GROUP BY reason, source ORDER BY count(*) DESC, reason, source")
GET_DEAD_LETTER = Statement(f"SELECT {_DEAD_LETTER_COLUMNS} FROM dead_letters WHERE id = :id")
# How many ids start with a prefix (of hex digits only: no LIKE wildcard), and the one when it is one.
MATCH_DEAD_LETTERS = Statement("SELECT count(*) AS matching, min(id) AS id FROM dead_letters WHERE id LIKE :pattern")
DELETE_DEAD_LETTER = Statement("DELETE FROM dead_letters WHERE id = :id")
MARK_REPLAYED = Statement("UPDATE dead_letters SET replays = replays + 1, replayed_at = :now WHERE id = :id")
INSERT_PARKED_AUDIT = Statement(
    "INSERT INTO parked_audit (id, dead_letter_id, action, actor, acted_at, consumer, source, reason, key_digest,"
    " outcome, detail) VALUES (:id, :dead_letter_id, :action, :actor, :acted_at, :consumer, :source, :reason,"
    " :key_digest, :outcome, :detail)")
LIST_PARKED_AUDIT = Statement(
    "SELECT id, dead_letter_id, action, actor, acted_at, outcome, detail FROM parked_audit"
    " WHERE dead_letter_id = :dead_letter_id ORDER BY acted_at, id")
# A replay takes a parked key back out of the inbox's "dead" state (so that the redelivery runs the handler, with a
# fresh count of attempts); with a new body accepted, a key in any state but a live lease takes the parked delivery's
# fingerprint too. Completed keys are left alone otherwise: the replay of finished work is a duplicate.
_REOPEN = ("UPDATE inbox SET state = 'started', locked_until = NULL, lease_token = NULL, attempts = 0,"
           " outcome = NULL, result = NULL, last_error = NULL, updated_at = :now, expires_at = :expires_at")
REOPEN_PARKED = Statement(
    f"{_REOPEN} WHERE consumer = :consumer AND key_digest = :key_digest AND state = 'dead'")
REOPEN_WITH_FINGERPRINT = Statement(
    f"{_REOPEN}, fingerprint = :fingerprint WHERE consumer = :consumer AND key_digest = :key_digest"
    " AND NOT (state = 'started' AND locked_until IS NOT NULL AND locked_until > :now)")

# --- schedules (consumer_kit.sources.schedules) -------------------------------------------------------------------

_SCHEDULE = "consumer = :consumer AND schedule = :schedule AND version = :version"
# The database's clock, which every replica reads to judge what is due (their own clocks may disagree).
DATABASE_NOW = Statement("SELECT clock_timestamp() AS now", "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now') AS now")
GET_SCHEDULE = Statement(f"SELECT decided_until FROM schedules WHERE {_SCHEDULE}")
INSERT_SCHEDULE = Statement(
    "INSERT INTO schedules (consumer, schedule, version, decided_until, created_at, updated_at)"
    " VALUES (:consumer, :schedule, :version, :decided_until, :now, :now) ON CONFLICT DO NOTHING")
# Compare-and-set: of the replicas that decided the same ticks, exactly one moves the mark and records them.
ADVANCE_SCHEDULE = Statement(
    f"UPDATE schedules SET decided_until = :decided_until, updated_at = :now WHERE {_SCHEDULE}"
    " AND decided_until = :decided_from AND decided_until < :decided_until")
INSERT_TICK = Statement(
    "INSERT INTO schedule_ticks (consumer, schedule, version, tick, state, reason, created_at, updated_at)"
    " VALUES (:consumer, :schedule, :version, :tick, :state, :reason, :now, :now) ON CONFLICT DO NOTHING")
PENDING_TICKS = Statement(
    f"SELECT tick, not_before FROM schedule_ticks WHERE {_SCHEDULE} AND state = 'pending' ORDER BY tick LIMIT :limit")
SETTLE_TICK = Statement(
    "UPDATE schedule_ticks SET state = :state, reason = :reason, not_before = NULL, updated_at = :now"
    f" WHERE {_SCHEDULE} AND tick = :tick AND state = 'pending'")
DEFER_TICK = Statement(
    f"UPDATE schedule_ticks SET not_before = :not_before, updated_at = :now WHERE {_SCHEDULE} AND tick = :tick"
    " AND state = 'pending'")
# An explicit run (``consumer-kit schedule run``) of a tick recorded as skipped.
UNSKIP_TICK = Statement(
    "UPDATE schedule_ticks SET state = 'pending', reason = NULL, updated_at = :now"
    f" WHERE {_SCHEDULE} AND tick = :tick AND state = 'skipped'")
# A parked tick replayed (``consumer-kit parked replay``): pending again, to run and settle anew.
UNPARK_TICK = Statement(
    "UPDATE schedule_ticks SET state = 'pending', reason = NULL, not_before = NULL, updated_at = :now"
    f" WHERE {_SCHEDULE} AND tick = :tick AND state = 'parked'")
GET_TICK = Statement(f"SELECT tick, state, reason FROM schedule_ticks WHERE {_SCHEDULE} AND tick = :tick")
LAST_RUN = Statement(
    f"SELECT tick, state, reason FROM schedule_ticks WHERE {_SCHEDULE} AND state <> 'skipped'"
    " ORDER BY tick DESC LIMIT 1")
RECENT_SKIPS = Statement(
    f"SELECT tick, reason FROM schedule_ticks WHERE {_SCHEDULE} AND state = 'skipped' ORDER BY tick DESC"
    " LIMIT :limit")
SKIP_COUNTS = Statement(
    f"SELECT reason, count(*) AS skipped FROM schedule_ticks WHERE {_SCHEDULE} AND state = 'skipped'"
    " GROUP BY reason")
# Decided ticks older than the retention, oldest first, in short batches; a pending tick is never deleted.
_OLD_TICKS = (f"FROM schedule_ticks WHERE {_SCHEDULE} AND state <> 'pending' AND tick < :before"
              " ORDER BY tick LIMIT :limit")
SWEEP_TICKS = Statement(
    f"DELETE FROM schedule_ticks WHERE ctid IN (SELECT ctid {_OLD_TICKS} FOR UPDATE SKIP LOCKED)",
    f"DELETE FROM schedule_ticks WHERE rowid IN (SELECT rowid {_OLD_TICKS})",
)

# --- the embedded coordinator's receipts, resources and scope counts ----------------------------------
# A creation is one transaction: the receipt (ON CONFLICT DO NOTHING on its primary key: a concurrent creation with the
# same key waits for the first to commit, then inserts nothing and replays it), the resource, then a slot in the scope's
# count (last, so that its row lock is held only to the commit).

_RECEIPT_KEY = ("tenant = :tenant AND application = :application AND operation = :operation"
                " AND key_digest = :receipt_digest")
FIND_RECEIPT = Statement(
    "SELECT r.key_digest, r.fingerprint, r.resource_id, r.response, r.expires_at AS receipt_expires_at,"
    " s.status AS resource_status, s.expires_at AS resource_expires_at"
    " FROM idempotency_receipts r LEFT JOIN coordinator_resources s ON s.id = r.resource_id"
    " WHERE r.tenant = :tenant AND r.application = :application AND r.operation = :operation"
    " AND r.key_digest = :receipt_digest"  # equality: see LOOKUP
)
INSERT_RECEIPT = Statement(
    "INSERT INTO idempotency_receipts (tenant, application, operation, key_digest, fingerprint, resource_id,"
    " response, generated, created_at, expires_at) VALUES (:tenant, :application, :operation, :receipt_digest,"
    " :receipt_fingerprint, :resource_id, :response, :generated, :created_at, :receipt_expires_at)"
    " ON CONFLICT DO NOTHING"
)
INSERT_RESOURCE = Statement(
    "INSERT INTO coordinator_resources (id, tenant, application, kind, status, created_at, expires_at)"
    " VALUES (:resource_id, :tenant, :application, :kind, 'active', :created_at, :resource_expires_at)"
)
_SCOPE = "tenant = :tenant AND application = :application AND operation = :operation"
# A slot in the creation's own stripe, if it has room.
_STRIPE_WITH_ROOM = f"{_SCOPE} AND stripe = :stripe AND live < :share AND NOT closed"
TAKE_STRIPE_SLOT = Statement(f"UPDATE idempotency_scopes SET live = live + 1 WHERE {_STRIPE_WITH_ROOM}")
INSERT_STRIPE = Statement(
    "INSERT INTO idempotency_scopes (tenant, application, operation, stripe, live, closed)"
    " VALUES (:tenant, :application, :operation, :stripe, 0, false) ON CONFLICT DO NOTHING")
LOCK_STRIPES = Statement(f"SELECT stripe, live FROM idempotency_scopes WHERE {_SCOPE} ORDER BY stripe FOR UPDATE",
                         f"SELECT stripe, live FROM idempotency_scopes WHERE {_SCOPE} ORDER BY stripe")
ADD_TO_STRIPE = Statement(
    f"UPDATE idempotency_scopes SET live = CASE WHEN live + :delta > 0 THEN live + :delta ELSE 0 END"
    f" WHERE {_SCOPE} AND stripe = :stripe")
SET_SCOPE_CLOSED = Statement(f"UPDATE idempotency_scopes SET closed = :closed WHERE {_SCOPE}")
CLOSED_SCOPES = Statement("SELECT DISTINCT tenant, application, operation FROM idempotency_scopes WHERE closed")
EXPIRED_RECEIPTS = _skip_locked(
    "SELECT tenant, application, operation, key_digest FROM idempotency_receipts"
    " WHERE expires_at <= :now AND (CAST(:tenant AS varchar) IS NULL"
    " OR (tenant = :tenant AND application = :application AND operation = :operation))"
    " ORDER BY expires_at LIMIT :limit"
)
DELETE_RECEIPT = Statement(f"DELETE FROM idempotency_receipts WHERE {_RECEIPT_KEY}")
DELETE_EXPIRED_RECEIPT = Statement(f"DELETE FROM idempotency_receipts WHERE {_RECEIPT_KEY} AND expires_at <= :now")
SET_RESOURCE_STATUS = Statement(
    "UPDATE coordinator_resources SET status = :status, ended_at = :now"
    " WHERE id = :resource_id AND tenant = :tenant AND application = :application AND status = 'active'")
RESOURCE_IN_SCOPE = Statement(
    "SELECT kind, status, expires_at AS resource_expires_at FROM coordinator_resources"
    " WHERE id = :resource_id AND tenant = :tenant AND application = :application")
_EXPIRED_RESOURCES = "FROM coordinator_resources WHERE expires_at <= :now LIMIT :limit"
SWEEP_RESOURCES = Statement(
    f"DELETE FROM coordinator_resources WHERE id IN (SELECT id {_EXPIRED_RESOURCES} FOR UPDATE SKIP LOCKED)",
    f"DELETE FROM coordinator_resources WHERE id IN (SELECT id {_EXPIRED_RESOURCES})",
)
RECEIPT_STATS = Statement("SELECT count(*) AS receipts, min(created_at) AS oldest FROM idempotency_receipts")

# PostgreSQL's one-statement creation, in autocommit: a new key whose stripe has room takes the slot, writes the receipt
# and the resource, or reports the receipt that exists. ``gate`` lets the creation be carried by the inbox's claim (only
# when the claim took the lease).
def _creation_ctes(gate: str) -> str:
    return (
        "existing AS (SELECT r.fingerprint, r.resource_id, r.response, r.expires_at AS receipt_expires_at,"
        "  s.status AS resource_status, s.expires_at AS resource_expires_at"
        "  FROM idempotency_receipts r LEFT JOIN coordinator_resources s ON s.id = r.resource_id"
        "  WHERE r.tenant = :tenant AND r.application = :application AND r.operation = :operation"
        "  AND r.key_digest = :receipt_digest),"
        " slot AS (UPDATE idempotency_scopes SET live = live + 1"
        f"  WHERE {_STRIPE_WITH_ROOM} AND NOT EXISTS (SELECT 1 FROM existing){gate} RETURNING 1),"
        " receipt AS (INSERT INTO idempotency_receipts (tenant, application, operation, key_digest, fingerprint,"
        "  resource_id, response, generated, created_at, expires_at)"
        "  SELECT :tenant, :application, :operation, :receipt_digest, :receipt_fingerprint, :resource_id,"
        "  CAST(:response AS json), :generated, :created_at, :receipt_expires_at FROM slot ON CONFLICT DO NOTHING"
        "  RETURNING resource_id),"
        " resource AS (INSERT INTO coordinator_resources (id, tenant, application, kind, status, created_at,"
        "  expires_at) SELECT resource_id, :tenant, :application, :kind, 'active', :created_at, :resource_expires_at"
        "  FROM receipt RETURNING 1)"
    )


_CREATION_COLUMNS = ("e.fingerprint, e.resource_id, e.response, e.receipt_expires_at, e.resource_status,"
                     " e.resource_expires_at, (SELECT count(*) FROM slot) AS slot,"
                     " (SELECT count(*) FROM resource) AS created")
_CREATION_FROM = "(SELECT 1) AS one LEFT JOIN existing e ON true"
CREATE_RESOURCE = Statement(  # PostgreSQL only
    f"WITH {_creation_ctes('')} SELECT {_CREATION_COLUMNS} FROM {_CREATION_FROM}")

# --- the inbox's statements carrying the coordinator's (PostgreSQL only; see the module docstring) ----


def _names(sql: str) -> set[str]:
    return set(re.findall(r"(?<![:\w]):([A-Za-z_]\w*)", sql))


# The inbox's and the coordinator's parameters are merged into one mapping: no name may be both's.
assert not _names(_CLAIM_CTES) & _names(_creation_ctes("")), "claim and creation share a parameter name"
assert not _names(_COMPLETE) & {"resource_id", "tenant", "application"}, "completion and ending share a name"

CLAIM_CREATING_SESSION = Statement(
    f"WITH {_CLAIM_CTES}, {_creation_ctes(' AND EXISTS (SELECT 1 FROM anchor)')}"
    f" SELECT {_CLAIM_COLUMNS}, {_CREATION_COLUMNS}"
    f" FROM {_CLAIM_FROM.format(one='(SELECT 1)')}, {_CREATION_FROM}"
)
COMPLETE_ENDING_SESSION = Statement(
    f"WITH anchor AS ({_COMPLETE} RETURNING 1),"
    " ended AS (UPDATE coordinator_resources SET status = 'ended', ended_at = :now"
    " WHERE id = :resource_id AND tenant = :tenant AND application = :application AND status = 'active'"
    " AND EXISTS (SELECT 1 FROM anchor) RETURNING 1)"
    " SELECT (SELECT count(*) FROM anchor) AS completed, (SELECT count(*) FROM ended) AS ended"
)
