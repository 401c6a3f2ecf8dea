"""The partitioned inbox (PostgreSQL, ``INBOX_PARTITION_SECONDS`` > 0): the inbox as a table partitioned
by *generation*, each generation one partition that takes the new keys for ``INBOX_PARTITION_SECONDS``,
and retention as whole partitions leaving (``DETACH ... CONCURRENTLY``, then ``DROP``) instead of rows
deleted one by one, each leaving a dead tuple for vacuum and a tombstone row.

::

    inbox (partitioned BY LIST (generation); key (consumer, key_digest, generation))
      inbox_p0  generation 0: the plain table this layout was made from, until it leaves
      inbox_p7  generation 7  \\
      inbox_p8  generation 8   >  a key's row is in the partition that was current when it was first claimed
      inbox_p9  generation 9  /   (9: the one new keys go to now)
      inbox_p10 generation 10    made ahead, so that a rotation never waits for DDL
    inbox_rotation: the current generation (one row); inbox_generations: when each began and ended

**One key, one row, across partitions.** PostgreSQL keeps a unique index per partition, so it cannot
say that a key is in no other one. Every statement that inserts a key therefore (1) looks for the key in
every partition, under its own snapshot, and inserts only where it found none, and (2) takes the
generation it inserts into from :data:`GENERATION` (the SQL function ``consumer_kit_inbox_generation``),
which holds a shared advisory lock until the transaction ends and checks that the generation the
statement's snapshot saw is still the current one (else NULL: the statement writes nothing, says
``stale``, and runs again; in a transaction too, which then holds the lock, so that its next
statement's snapshot has the rotation).
A rotation takes that lock exclusively, so it waits for every insert in flight to commit. Two inserts of
one key into the same generation meet on that partition's unique index, as in the plain table; an
insert into a later generation saw the rotation committed, hence every insert into the earlier one
committed, hence the key's row: it inserts nothing. (The check reads the rotation row again on a
fresh snapshot, which only READ COMMITTED takes per statement: other isolation levels are refused.)

**Retention.** A row is remembered (a repeat is a duplicate) until ``expires_at``; after it, with
tombstones on, the row is the key's tombstone (a repeat is late, ``SWEPT``) until its partition leaves.
A partition leaves once every row it can hold has been a tombstone for ``INBOX_TOMBSTONE_SECONDS``: its
generation ended ``retention + tombstone`` seconds ago. Rows completed (or leased) late enough to still
matter are moved into the current generation first. So a key is recognised for at least
``INBOX_RETENTION_SECONDS`` after its completion, and caught as late for at least
``INBOX_TOMBSTONE_SECONDS`` after that, and at most one ``INBOX_PARTITION_SECONDS`` longer.

Rows of the old one-row-per-tombstone table (``inbox_tombstones``, from the plain layout) are still
honoured and swept as before, until it is empty.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from consumer_kit.errors import ConfigurationError
from consumer_kit.store import sql
from consumer_kit.store.sql import Statement

if TYPE_CHECKING:
    import asyncpg

    from consumer_kit.store.connections import Database

log = logging.getLogger("consumer_kit.store.partitions")

ROTATION_LOCK = 0x636B5F726F74  # the advisory lock a rotation takes exclusively ("ck_rot")
MAINTENANCE_LOCK = 0x636B5F6D6E74  # held by the one sweeper (of many workers) that maintains the layout
GENERATION = "consumer_kit_inbox_generation((SELECT current FROM inbox_rotation))"
"""The generation a key's row goes to, as SQL: the current one, checked and locked (see the docstring)."""
DDL_LOCK_TIMEOUT = "100ms"
"""How long a statement that changes the layout waits for a lock before it gives up for this round
(the claims queued behind it wait as long)."""
AHEAD = 2
"""Partitions made ahead of the current one."""

_FUNCTION = f"""
CREATE OR REPLACE FUNCTION consumer_kit_inbox_generation(seen integer) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    now_current integer;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'consumer-kit: the partitioned inbox writes keys in READ COMMITTED transactions only'
            USING ERRCODE = '0A000';
    END IF;
    PERFORM pg_advisory_xact_lock_shared({ROTATION_LOCK});
    SELECT current INTO now_current FROM inbox_rotation;  -- a snapshot of its own, taken after the lock
    IF now_current IS DISTINCT FROM seen THEN
        RETURN NULL;  -- rotated after the statement's snapshot: it must write nothing, and run again
    END IF;
    RETURN now_current;
END $$
"""

# The layout's parts besides the partitions, made by :func:`partition` once.
_PARTS = (
    "CREATE TABLE IF NOT EXISTS inbox_rotation (one boolean PRIMARY KEY DEFAULT true CHECK (one),"
    " current integer NOT NULL, seconds double precision NOT NULL)",
    "CREATE TABLE IF NOT EXISTS inbox_generations (generation integer PRIMARY KEY,"
    " started_at timestamptz, ended_at timestamptz)",
    _FUNCTION,
)


class LayoutError(RuntimeError):
    """The database's inbox is not in the layout the settings ask for."""


async def layout(conn: asyncpg.Connection) -> str:
    """``partitioned``, ``plain``, or ``missing`` (no inbox table: not migrated)."""
    kind = await conn.fetchval("SELECT c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                               " WHERE c.relname = 'inbox' AND n.nspname = current_schema()")
    return {None: "missing", "p": "partitioned"}.get(kind, "plain")


async def check_layout(database: Database, seconds: float) -> None:
    """Refuse, in one line, a database whose inbox is not in the layout ``INBOX_PARTITION_SECONDS`` asks for
    (``seconds``: 0 for the plain table); on the partitioned one, keep its generations' length."""
    if seconds and not database.asyncpg:
        raise ConfigurationError("INBOX_PARTITION_SECONDS needs PostgreSQL on asyncpg (postgresql+asyncpg://);"
                                 " set it to 0 here")
    if not database.asyncpg:
        return
    async with (await database.pool()).acquire() as conn:
        state = await layout(conn)
        if seconds and state == "plain":
            raise ConfigurationError("INBOX_PARTITION_SECONDS is set but the inbox is the plain table: run"
                                     " `consumer-kit db partition-inbox` first (or set it to 0)")
        if not seconds and state == "partitioned":
            raise ConfigurationError("the inbox is partitioned: set INBOX_PARTITION_SECONDS (the length of its"
                                     " generations, in seconds)")
        if seconds:
            await conn.execute("UPDATE inbox_rotation SET seconds = $1 WHERE seconds <> $1", seconds)


async def partition(conn: asyncpg.Connection, *, seconds: float, now: datetime) -> bool:
    """Turn the plain ``inbox`` (made by the migrations) into the partitioned one, its rows kept as
    generation 0; ``False`` when it already is. Online except for the last step: the column is added
    without a rewrite, the new key index built ``CONCURRENTLY``, the partition's check validated without
    blocking writes; then one short transaction (under :data:`DDL_LOCK_TIMEOUT`, tried again until it gets
    its locks) renames the table, makes the partitioned one and attaches it. Run it again after a failure:
    each step checks whether it was done."""
    state = await layout(conn)
    if state == "missing":
        raise LayoutError("no inbox table: run `consumer-kit migrate` first")
    if state == "partitioned":
        await _ensure_parts(conn, seconds, now)
        return False
    await conn.execute("ALTER TABLE inbox ADD COLUMN IF NOT EXISTS generation integer NOT NULL DEFAULT 0")
    await conn.execute("CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS inbox_p0_key"
                       " ON inbox (consumer, key_digest, generation)")
    if not await conn.fetchval("SELECT indisvalid FROM pg_index WHERE indexrelid = 'inbox_p0_key'::regclass"):
        await conn.execute("DROP INDEX CONCURRENTLY inbox_p0_key")  # an interrupted build: again
        await conn.execute("CREATE UNIQUE INDEX CONCURRENTLY inbox_p0_key ON inbox (consumer, key_digest, generation)")
    if not await conn.fetchval("SELECT count(*) FROM pg_constraint WHERE conname = 'inbox_p0_generation'"):
        await _with_ddl_locks(conn, ["ALTER TABLE inbox ADD CONSTRAINT inbox_p0_generation CHECK (generation = 0)"
                                     " NOT VALID"])
    await conn.execute("ALTER TABLE inbox VALIDATE CONSTRAINT inbox_p0_generation")
    for statement in _PARTS:
        await conn.execute(statement)
    await _with_ddl_locks(conn, [
        "ALTER TABLE inbox RENAME TO inbox_p0",
        # Its key becomes (consumer, key_digest, generation): the same rows, generation being 0 in all.
        "ALTER TABLE inbox_p0 DROP CONSTRAINT pk_inbox",
        "ALTER TABLE inbox_p0 ADD CONSTRAINT inbox_p0_pkey PRIMARY KEY USING INDEX inbox_p0_key",
        "ALTER INDEX ix_inbox_expires_at RENAME TO inbox_p0_expires_at",
        "CREATE TABLE inbox (LIKE inbox_p0 INCLUDING DEFAULTS) PARTITION BY LIST (generation)",
        "ALTER TABLE inbox ADD CONSTRAINT pk_inbox PRIMARY KEY (consumer, key_digest, generation)",
        "CREATE INDEX ix_inbox_expires_at ON inbox (expires_at)",
        "ALTER TABLE inbox ATTACH PARTITION inbox_p0 FOR VALUES IN (0)",
        "INSERT INTO inbox_rotation (current, seconds) VALUES (0, $1)",
        "INSERT INTO inbox_generations (generation, started_at) VALUES (0, NULL)",
    ], seconds)
    await _ensure_parts(conn, seconds, now)
    return True


async def _ensure_parts(conn: asyncpg.Connection, seconds: float, now: datetime) -> None:
    for statement in _PARTS:
        await conn.execute(statement)
    await conn.execute("UPDATE inbox_rotation SET seconds = $1 WHERE seconds <> $1", seconds)
    await make_ahead(conn)
    current = await conn.fetchval("SELECT current FROM inbox_rotation")
    if current == 0:  # generation 0 is the plain table's rows: new keys go to a partition of their own
        await rotate(conn, now)


async def make_ahead(conn: asyncpg.Connection) -> int:
    """Make the :data:`AHEAD` partitions after the current one that are missing; how many were made.
    Each is made empty and alone, with the check that it holds its generation only, then attached: that
    locks the inbox ``SHARE UPDATE EXCLUSIVE``, which claims, completions and reads do not wait for."""
    current = await conn.fetchval("SELECT current FROM inbox_rotation")
    present = set(await attached(conn))
    made = 0
    for generation in range(current + 1, current + AHEAD + 1):
        if generation in present:
            continue
        name = f"inbox_p{generation}"
        await conn.execute(f"CREATE TABLE IF NOT EXISTS {name} (LIKE inbox INCLUDING DEFAULTS,"
                           f" CONSTRAINT {name}_generation CHECK (generation = {generation}))")
        await _with_ddl_locks(conn, [f"ALTER TABLE inbox ATTACH PARTITION {name} FOR VALUES IN ({generation})"])
        made += 1
    return made


async def rotate(conn: asyncpg.Connection, now: datetime, *, due: bool = False) -> int | None:
    """Make the next generation the current one (its partition made ahead); the new generation, or
    ``None`` when the rotation lock was not granted within :data:`DDL_LOCK_TIMEOUT` (inserts in flight:
    the caller tries again later), or, with ``due``, when the current generation has not yet taken keys for
    its ``seconds``. Taken exclusively, the lock waits for every transaction that inserted a key under the
    current generation to end (see the module docstring)."""
    try:
        async with conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
            await conn.execute(f"SELECT pg_advisory_xact_lock({ROTATION_LOCK})")
            current, seconds = await conn.fetchrow("SELECT current, seconds FROM inbox_rotation")
            began = await conn.fetchval("SELECT started_at FROM inbox_generations WHERE generation = $1", current)
            if due and began is not None and now < began + timedelta(seconds=seconds):
                return None
            if current + 1 not in await attached(conn):
                raise LayoutError(f"inbox_p{current + 1} is not attached: make_ahead() first")
            await conn.execute("UPDATE inbox_rotation SET current = $1", current + 1)
            await conn.execute("UPDATE inbox_generations SET ended_at = $2 WHERE generation = $1", current, now)
            await conn.execute("INSERT INTO inbox_generations (generation, started_at) VALUES ($1, $2)"
                               " ON CONFLICT (generation) DO UPDATE SET started_at = $2", current + 1, now)
    except _lock_not_available():
        return None
    return int(current + 1)


@dataclass(frozen=True)
class Maintenance:
    """What one :func:`maintain` did."""

    rotated: int | None = None  # the new current generation
    made: int = 0  # partitions made ahead
    moved: int = 0  # rows moved out of a leaving partition into the current one
    dropped: tuple[int, ...] = ()  # generations that left
    rows: int = 0  # the rows they held


async def maintain(conn: asyncpg.Connection, now: datetime, *, retention: timedelta,
                   tombstone: timedelta) -> Maintenance:
    """One round of the partitioned inbox's upkeep, what the sweeper runs: partitions made ahead, a rotation
    when the current generation has taken keys for ``INBOX_PARTITION_SECONDS``, and every generation whose
    rows all had their time (retention, then tombstone) leaving, its late rows moved first."""
    if not await conn.fetchval(f"SELECT pg_try_advisory_lock({MAINTENANCE_LOCK})"):
        return Maintenance()  # another worker's sweeper is at it
    try:
        return await _maintain(conn, now, retention, tombstone)
    finally:
        await conn.execute(f"SELECT pg_advisory_unlock({MAINTENANCE_LOCK})")


async def _maintain(conn: asyncpg.Connection, now: datetime, retention: timedelta,
                    tombstone: timedelta) -> Maintenance:
    await _finish_detaches(conn)
    made = await make_ahead(conn)
    rotated = await rotate(conn, now, due=True)
    if rotated is not None:
        made += await make_ahead(conn)
    moved, dropped, rows = 0, [], 0
    due = await conn.fetch("SELECT generation FROM inbox_generations WHERE ended_at <= $1 ORDER BY generation",
                           now - retention - tombstone)
    for (generation,) in due:
        left = await _leave(conn, generation, now, tombstone)
        if left is None:
            break  # its late rows could not be moved this round
        moved, rows = moved + left[0], rows + left[1]
        dropped.append(generation)
    return Maintenance(rotated, made, moved, tuple(dropped), rows)


async def _leave(conn: asyncpg.Connection, generation: int, now: datetime,
                 tombstone: timedelta) -> tuple[int, int] | None:
    """Move ``generation``'s rows that still matter (not yet a tombstone for ``tombstone``: completed or
    leased late) into the current generation, then detach and drop its partition; ``(moved, dropped rows)``,
    or ``None`` when the move did not get the rotation lock this round."""
    name = f"inbox_p{generation}"
    if generation in await attached(conn):
        try:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
                await conn.execute(f"SELECT pg_advisory_xact_lock({ROTATION_LOCK})")  # the move inserts keys
                moved = int((await conn.execute(
                    # A live lease's row expires no sooner than the lease (see CLAIM, RENEW): the expiry
                    # index finds every row that still matters.
                    "UPDATE inbox SET generation = (SELECT current FROM inbox_rotation)"
                    " WHERE generation = $1 AND expires_at > $2", generation, now - tombstone)).split()[-1])
        except _lock_not_available():
            return None
        rows = int(await conn.fetchval(f"SELECT count(*) FROM {name}"))
        # CONCURRENTLY: it waits for the transactions that may still read the partition (a long report
        # included) without blocking claims, which stop seeing it at once (its rows are all past their time).
        await conn.execute(f"ALTER TABLE inbox DETACH PARTITION {name} CONCURRENTLY")
    else:
        moved, rows = 0, 0
    await conn.execute(f"DROP TABLE IF EXISTS {name}")
    await conn.execute("DELETE FROM inbox_generations WHERE generation = $1", generation)
    log.info("inbox generation %d left: %d rows dropped, %d moved on", generation, rows, moved)
    return moved, rows


async def _finish_detaches(conn: asyncpg.Connection) -> None:
    """A detach a cancelled sweep left pending is finished first (no other can start while one is)."""
    for (name,) in await conn.fetch(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'inbox'::regclass AND i.inhdetachpending"):
        await conn.execute(f"ALTER TABLE inbox DETACH PARTITION {name} FINALIZE")


async def attached(conn: asyncpg.Connection) -> list[int]:
    """The generations whose partitions are attached (and not being detached)."""
    names = await conn.fetch("SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
                             " WHERE i.inhparent = 'inbox'::regclass AND NOT i.inhdetachpending")
    return sorted(int(m.group(1)) for (name,) in names if (m := re.fullmatch(r"inbox_p(\d+)", name)))


async def _with_ddl_locks(conn: asyncpg.Connection, statements: list[str], *args: Any) -> None:
    """``statements`` in one transaction under :data:`DDL_LOCK_TIMEOUT`, tried again (after a pause
    growing to five seconds) until its locks are granted: a table's ``ACCESS EXCLUSIVE`` lock queued behind a
    long transaction would hold up every claim behind it."""
    pause = 0.05
    while True:
        try:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
                for statement in statements:
                    await (conn.execute(statement, *args) if "$1" in statement else conn.execute(statement))
            return
        except _lock_not_available():
            await asyncio.sleep(pause)
            pause = min(5.0, pause * 2)


def _lock_not_available() -> type[Exception]:
    import asyncpg

    error: type[Exception] = asyncpg.LockNotAvailableError
    return error


# --- the statements that differ from the plain table's (see consumer_kit.store.sql) -------------------

_LIVE = "(NOT CAST(:tombstones AS boolean) OR expires_at > :now OR locked_until > :now)"
"""A row that is the key's record, not its tombstone (with tombstones on, an expired row without a live
lease is the key's tombstone until its partition leaves)."""
_KEPT = "(expires_at > :now OR locked_until > :now)"
"""A row not past its time: remembered, or held by a live lease. A statement that changes a key's row changes
such a row only, for two reasons. With tombstones on, a row past its time is the key's tombstone: a completion,
a release or a parking must not take it for the key's record (on the plain table the sweeper deleted that row:
the statement finds none). And with tombstones on or off, its generation may be leaving: the rows that still
matter were moved on into the current one before the detach (those expiring later than the sweep's now less
INBOX_TOMBSTONE_SECONDS, which every row not past its time now does), and a row made to matter again after the
move (its expiry pushed later) would be dropped with the rest."""
_COLUMNS = ("consumer, key_digest, namespace, version, fingerprint, state, locked_until, lease_token, attempts,"
            " outcome, result, last_error, created_at, updated_at, expires_at")
LOOKUP = Statement(f"SELECT {_COLUMNS} FROM inbox WHERE consumer = :consumer AND key_digest = :key_digest AND {_LIVE}")
LOOKUP_MANY = Statement(
    f"SELECT i.* FROM unnest(CAST(:key_digests AS varchar[])) AS k(key_digest) CROSS JOIN LATERAL"
    f" (SELECT {_COLUMNS} FROM inbox WHERE consumer = :consumer AND key_digest = k.key_digest AND {_LIVE} LIMIT 1) i")
# A tombstone: the old table's row, or an expired row without a live lease.
TOMBSTONE = Statement(
    "SELECT 1 AS swept WHERE EXISTS (SELECT 1 FROM inbox_tombstones WHERE consumer = :consumer"
    " AND key_digest = :key_digest) OR EXISTS (SELECT 1 FROM inbox WHERE consumer = :consumer"
    " AND key_digest = :key_digest AND expires_at <= :now AND (locked_until IS NULL OR locked_until <= :now))")
_ANY_ROW = "SELECT 1 FROM inbox WHERE consumer = :consumer AND key_digest = :key_digest"
_OLD_TOMB = "SELECT 1 FROM inbox_tombstones WHERE consumer = :consumer AND key_digest = :key_digest"

# Every statement that inserts a key starts with the guard (``gen``); ``stale`` says it wrote nothing because
# the inbox rotated after its snapshot was taken (run it again: in the same transaction too, which now
# holds the rotation lock, so its next statement's snapshot has the rotation).
_GEN = f"gen AS (SELECT {GENERATION} AS g)"
_GUARDED = "EXISTS (SELECT 1 FROM gen WHERE g IS NOT NULL)"
_STALE = "(SELECT g FROM gen) IS NULL AS stale"

# The two-transaction claim: a new key's row inserted into the current generation when no partition has the
# key (and the old table no tombstone). ``inbox_*``: the row this statement's snapshot saw, tombstone or not;
# a started row of the same request whose lease ran out or was released is then taken over by TAKEOVER, a
# statement of its own (a statement on the whole inbox locks every partition and its indexes: the claim of a
# new key, the common case, pays for one look, not a look and an update).
CLAIM = Statement(
    f"WITH {_GEN}, inbox_row AS (SELECT state, fingerprint, locked_until, attempts, result, expires_at FROM inbox"
    " WHERE consumer = :consumer AND key_digest = :key_digest),"
    f" tomb AS ({_OLD_TOMB} AND CAST(:tombstones AS boolean)),"
    " anchor AS (INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, locked_until,"
    " lease_token, attempts, created_at, updated_at, expires_at, generation)"
    " SELECT CAST(:consumer AS varchar), CAST(:key_digest AS varchar), CAST(:namespace AS varchar),"
    " CAST(:version AS integer), CAST(:fingerprint AS varchar), 'started', CAST(:locked_until AS timestamptz),"
    " CAST(:lease_token AS varchar), 1, CAST(:now AS timestamptz), CAST(:now AS timestamptz),"
    " CAST(:expires_at AS timestamptz), gen.g FROM gen"
    " WHERE gen.g IS NOT NULL AND NOT EXISTS (SELECT 1 FROM inbox_row) AND NOT EXISTS (SELECT 1 FROM tomb)"
    " ON CONFLICT (consumer, key_digest, generation) DO UPDATE SET locked_until = :locked_until,"
    " lease_token = :lease_token, attempts = inbox.attempts + 1, updated_at = :now"
    " WHERE inbox.state = 'started' AND inbox.fingerprint = :fingerprint"
    " AND (inbox.locked_until IS NULL OR inbox.locked_until <= :now)"
    " RETURNING attempts)"
    " SELECT (SELECT attempts FROM anchor) AS claimed,"
    " r.state AS inbox_state, r.fingerprint AS inbox_fingerprint, r.locked_until AS inbox_locked_until,"
    " r.attempts AS inbox_attempts, r.result AS inbox_result,"
    " (EXISTS (SELECT 1 FROM tomb) OR (CAST(:tombstones AS boolean) AND r.expires_at <= :now"
    f" AND (r.locked_until IS NULL OR r.locked_until <= :now))) AS tombstoned, {_STALE}"
    " FROM (SELECT set_config('synchronous_commit', 'off', true)) AS inbox_one LEFT JOIN inbox_row r ON true"
)
TAKEOVER = Statement(  # its expiry kept at least as late as the lease: a leaving partition moves such rows on
    "UPDATE inbox SET locked_until = :locked_until, lease_token = :lease_token,"
    " attempts = attempts + 1, updated_at = :now, expires_at = GREATEST(expires_at, :locked_until)"
    " WHERE consumer = :consumer AND key_digest = :key_digest AND state = 'started'"
    f" AND fingerprint = :fingerprint AND (locked_until IS NULL OR locked_until <= :now) AND {_KEPT}"
    " RETURNING attempts")
# With tombstones off, a started row past its time without a live lease is one the plain table's sweeper deletes,
# and nothing takes it over here (see _KEPT): a claim that meets one deletes it, then claims the key as a new one.
DROP_LAPSED = Statement(
    "DELETE FROM inbox WHERE consumer = :consumer AND key_digest = :key_digest AND state = 'started'"
    " AND expires_at <= :now AND (locked_until IS NULL OR locked_until <= :now)")
# The single-transaction claim's insert, in the handler's (or an endpoint's) transaction: the row written
# completed, with ``result`` (an endpoint's response; NULL for a delivery), when no partition has the key;
# ``inserted`` 0 otherwise (the caller looks it up, as on the plain table).
INSERT_COMPLETED = Statement(
    f"WITH {_GEN}, ins AS (INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state,"
    " attempts, outcome, result, created_at, updated_at, expires_at, generation)"
    " SELECT CAST(:consumer AS varchar), CAST(:key_digest AS varchar), :namespace, :version, :fingerprint,"
    " 'completed', 1, :outcome, CAST(:result AS json), :now, :now, :expires_at, gen.g FROM gen"
    f" WHERE gen.g IS NOT NULL AND NOT EXISTS ({_ANY_ROW})"
    f" AND NOT (CAST(:tombstones AS boolean) AND EXISTS ({_OLD_TOMB}))"
    " ON CONFLICT (consumer, key_digest, generation) DO NOTHING RETURNING 1)"
    f" SELECT (SELECT count(*) FROM ins) AS inserted, {_STALE}"
)
# A batch's claim, in the batch's transaction: each new key written completed into the current generation
# where no partition has it (and the old table no tombstone), under one guard for the batch; ``inserted``: the
# digests written. Each key is probed through the key index by a LATERAL ... LIMIT 1, as on the plain table
# (a join over the array is planned, on an empty table, as a scan of the consumer's rows).
CLAIM_BATCH = Statement(
    f"WITH {_GEN}, ins AS (INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state,"
    " attempts, outcome, created_at, updated_at, expires_at, generation)"
    " SELECT CAST(:consumer AS varchar), k.key_digest, k.namespace, k.version, k.fingerprint, 'completed', 1,"
    " CAST(:outcome AS varchar), CAST(:now AS timestamptz), CAST(:now AS timestamptz),"
    " CAST(:expires_at AS timestamptz), gen.g"
    " FROM gen CROSS JOIN unnest(CAST(:key_digests AS varchar[]), CAST(:namespaces AS varchar[]),"
    " CAST(:versions AS integer[]), CAST(:fingerprints AS varchar[])) AS k(key_digest, namespace, version,"
    " fingerprint)"
    " LEFT JOIN LATERAL (SELECT 1 AS found FROM inbox i WHERE i.consumer = CAST(:consumer AS varchar)"
    " AND i.key_digest = k.key_digest LIMIT 1) seen ON true"
    " LEFT JOIN LATERAL (SELECT 1 AS found FROM inbox_tombstones t WHERE t.consumer = CAST(:consumer AS varchar)"
    " AND t.key_digest = k.key_digest AND CAST(:tombstones AS boolean) LIMIT 1) tomb ON true"
    " WHERE gen.g IS NOT NULL AND seen.found IS NULL AND tomb.found IS NULL"
    " ON CONFLICT (consumer, key_digest, generation) DO NOTHING RETURNING key_digest)"
    f" SELECT ARRAY(SELECT key_digest FROM ins) AS inserted, {_STALE}"
)
# After a failed single-transaction attempt: the started row counted where it is, or inserted.
RECORD_FAILURE = Statement(
    f"WITH {_GEN}, counted AS (UPDATE inbox SET attempts = attempts + 1, last_error = :last_error,"
    " updated_at = :now WHERE consumer = :consumer AND key_digest = :key_digest AND state = 'started'"
    f" AND {_GUARDED} RETURNING attempts),"
    " inserted AS (INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, attempts,"
    " last_error, created_at, updated_at, expires_at, generation)"
    " SELECT CAST(:consumer AS varchar), CAST(:key_digest AS varchar), :namespace, :version, :fingerprint,"
    " 'started', 1, CAST(:last_error AS varchar), :now, :now, :expires_at, gen.g FROM gen"
    f" WHERE gen.g IS NOT NULL AND NOT EXISTS ({_ANY_ROW})"
    " ON CONFLICT (consumer, key_digest, generation) DO NOTHING RETURNING attempts)"
    " SELECT (SELECT attempts FROM counted UNION ALL SELECT attempts FROM inserted LIMIT 1) AS attempts,"
    f" {_STALE}"
)
# An idempotent endpoint's single transaction (sql.LOCK_AND_LOOK): the key's advisory lock (the plain one's, its
# text up to the tombstone), the key's live row as this statement's snapshot sees it, and whether the key has a
# tombstone; its row is written at the end by INSERT_COMPLETED (guarded), or FINISH_STARTED_WITH_RESULT for a row
# an earlier attempt left started.
LOCK_AND_LOOK = Statement(
    f"{sql.LOCK_AND_LOOK.sql.partition(', EXISTS')[0]}, CAST(:tombstones AS boolean) AND EXISTS ({TOMBSTONE.sql})"
    f" AS tombstoned, r.* FROM (SELECT 1) AS one LEFT JOIN ({LOOKUP.sql}) AS r ON true")
FORGET_TOMBSTONE = Statement(  # the old table's row, or the expired row that is the key's tombstone
    "WITH old AS (DELETE FROM inbox_tombstones WHERE consumer = :consumer AND key_digest = :key_digest)"
    " DELETE FROM inbox WHERE consumer = :consumer AND key_digest = :key_digest AND expires_at <= :now"
    " AND (locked_until IS NULL OR locked_until <= :now)")


def _kept(statement: Statement) -> Statement:
    """``statement``, the plain table's change of one key's row, on a row not past its time (:data:`_KEPT`)."""
    change, returning, rest = statement.sql.partition(" RETURNING ")
    return Statement(f"{change} AND {_KEPT}{returning}{rest}")


# The plain table's changes of a key's row (by its lease, or its state), on a row not past its time.
RENEW = Statement(  # its expiry kept at least as late as the lease, as TAKEOVER's
    "UPDATE inbox SET locked_until = :locked_until, updated_at = :now,"
    " expires_at = GREATEST(expires_at, :locked_until)"
    " WHERE consumer = :consumer AND key_digest = :key_digest AND state = 'started' AND lease_token = :lease_token"
    f" AND {_KEPT}")
COMPLETE = _kept(sql.COMPLETE)
COMPLETE_WITH_RESULT = _kept(sql.COMPLETE_WITH_RESULT)
COMPLETE_ENDING_SESSION = Statement(sql.COMPLETE_ENDING_SESSION.sql.replace(sql.COMPLETE.sql, COMPLETE.sql))
assert COMPLETE.sql in COMPLETE_ENDING_SESSION.sql, "sql.COMPLETE_ENDING_SESSION must hold sql.COMPLETE as is"
RELEASE = _kept(sql.RELEASE)
WITHDRAW = _kept(sql.WITHDRAW)
MARK_DEAD = _kept(sql.MARK_DEAD)
MARK_DEAD_UNLEASED = _kept(sql.MARK_DEAD_UNLEASED)
FINISH_STARTED = _kept(sql.FINISH_STARTED)
FINISH_STARTED_WITH_RESULT = _kept(sql.FINISH_STARTED_WITH_RESULT)
REOPEN_PARKED = _kept(sql.REOPEN_PARKED)
REOPEN_WITH_FINGERPRINT = _kept(sql.REOPEN_WITH_FINGERPRINT)
