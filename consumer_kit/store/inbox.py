"""The inbox: seed 003's key store, one method per database operation.

A claim is its own transaction, committed at once, so that other attempts see it (an uncommitted
claim is invisible, and a crash would roll it back with nothing to take over). Completion happens
inside the handler's transaction and only ``WHERE lease_token = ours``, so an attempt that lost its
lease rolls back instead of overwriting the attempt that took over.

Times come from the application clock; leases are tens of seconds, so the clocks of the hosts that
share a database must agree to within a small fraction of a lease (NTP does that).
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, delete, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from consumer_kit.store.pglane import PgLane, Rider
from consumer_kit.store.tables import UTCDateTime, inbox

Clock = Callable[[], datetime]


def utcnow() -> datetime:
    """The default clock."""
    return datetime.now(UTC)


class ClaimStatus(enum.StrEnum):
    """What a claim found."""

    ACQUIRED = "acquired"  # new key, or an expired/released lease taken over: we hold the lease
    COMPLETED = "completed"  # done before: replay, do not run
    IN_PROGRESS = "in_progress"  # a live lease is held by another attempt
    CONFLICT = "conflict"  # same key, different fingerprint
    DEAD = "dead"  # parked before


@dataclass(frozen=True, slots=True)
class Claim:
    """The result of :meth:`Inbox.claim`. ``digest`` is the row's key digest (it may be the one
    written under the previous HMAC key); ``lease_token`` is set only when ``ACQUIRED``."""

    status: ClaimStatus
    digest: str
    attempts: int
    lease_token: str | None = None
    locked_until: datetime | None = None
    result: Any = None

    @property
    def acquired(self) -> bool:
        """Whether this attempt holds the lease."""
        return self.status is ClaimStatus.ACQUIRED


_STATE_STATUS = {"completed": ClaimStatus.COMPLETED, "dead": ClaimStatus.DEAD}


class Inbox:
    """Claim, renew, complete, release and sweep inbox rows for one database."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        lease_seconds: float,
        retention_seconds: float,
        clock: Clock = utcnow,
        lane: PgLane | None = None,
    ) -> None:
        self.engine = engine
        self.lane = lane
        self.lease = timedelta(seconds=lease_seconds)
        self.retention = timedelta(seconds=retention_seconds)
        self.clock = clock
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        # Single statements and reads need no BEGIN/COMMIT round trips of their own.
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._statements = _Statements()

    async def lookup(self, consumer: str, digests: Sequence[str], *, conn: Any = None) -> dict[str, Any] | None:
        """The row stored under any of ``digests`` (current HMAC key first), without a lock; on
        ``conn`` (a lane connection the caller holds) when given."""
        if self.lane is not None and (len(digests) == 1 or conn is not None):
            for digest in digests:
                row = await self.lane.lookup(consumer, digest, conn=conn)
                if row is not None:
                    return row
            return None
        async with self._autocommit.connect() as conn:
            return await self._find(conn, consumer, digests, lock=False)

    async def _find(
        self, conn: AsyncConnection, consumer: str, digests: Sequence[str], *, lock: bool
    ) -> dict[str, Any] | None:
        if len(digests) == 1 and not lock:  # the hot path: one prepared statement, no compilation
            found = await conn.execute(self._statements.lookup, {"p_consumer": consumer, "p_digest": digests[0]})
            row = found.first()
            return None if row is None else row._asdict()
        query = select(inbox).where(inbox.c.consumer == consumer, inbox.c.key_digest.in_(digests))
        if lock:
            query = query.with_for_update()
        rows = {row.key_digest: row._asdict() for row in await conn.execute(query)}
        for digest in digests:
            if digest in rows:
                return rows[digest]
        return None

    async def claim(
        self, consumer: str, digests: Sequence[str], fingerprint: str, *, namespace: str, version: int,
        rider: Rider | None = None, conn: Any = None,
    ) -> Claim:
        """Txn 1 of seed 003: take the lease on a new or abandoned key, or report what holds it.

        ``digests[0]`` is the digest under the current HMAC key; later ones are looked up so that a
        row written before a key rotation is still honoured. ``rider`` (see :class:`Rider`) commits
        with the claim when the lease is ours; it is carried on PostgreSQL's lane only. ``conn``: a
        lane connection the caller holds (outside any transaction), used for every statement.
        """
        existing = None
        if self.lane is None or len(digests) > 1:
            # A plain read first: a redelivery of completed work then costs one indexed SELECT and no
            # write. (PostgreSQL's lane makes the same test inside its one claim statement.)
            existing = await self.lookup(consumer, digests, conn=conn)
            if existing is not None and (existing["state"] != "started" or existing["fingerprint"] != fingerprint):
                return verdict(existing, fingerprint)
        digest = existing["key_digest"] if existing is not None else digests[0]
        now = self.clock()
        token = secrets.token_hex(16)
        # Claim and takeover are one atomic statement, committed at once: insert the row, or, when it
        # exists, take it over only if it is started, for the same request, and its lease has run out
        # (or was released). Concurrent claimers serialise on the row; exactly one gets it back.
        if self.lane is not None:
            attempts, row = await self.lane.claim(consumer, digest, namespace, version, fingerprint,
                                                  locked_until=now + self.lease, token=token, now=now,
                                                  expires_at=now + self.retention, rider=rider, conn=conn)
            if attempts is not None:
                return Claim(ClaimStatus.ACQUIRED, digest, attempts, token, now + self.lease)
            if row is not None and not _claimable(row, fingerprint, now):
                return verdict(row, fingerprint)
        else:
            params = {
                "p_consumer": consumer, "p_key_digest": digest, "p_namespace": namespace, "p_version": version,
                "p_fingerprint": fingerprint, "p_locked_until": now + self.lease, "p_lease_token": token,
                "p_now": now, "p_expires_at": now + self.retention,
            }
            async with self._autocommit.connect() as conn:
                attempts = (await conn.execute(self._statements.claim, params)).scalar_one_or_none()
            if attempts is not None:
                return Claim(ClaimStatus.ACQUIRED, digest, attempts, token, now + self.lease)
        # Another claim got there after our statement's snapshot: its committed row decides.
        row = await self.lookup(consumer, [digest], conn=conn)
        if row is None:  # swept between our statements: a brand-new key after all
            return await self.claim(consumer, digests, fingerprint, namespace=namespace, version=version,
                                    rider=rider, conn=conn)
        return verdict(row, fingerprint)

    async def claim_in(
        self,
        conn: AsyncConnection,
        consumer: str,
        digests: Sequence[str],
        fingerprint: str,
        *,
        namespace: str,
        version: int,
        outcome: str,
    ) -> Claim:
        """The single-transaction claim: insert the row already completed inside ``conn``'s transaction.

        The effect commits with it or not at all, so no lease is needed; a concurrent claim of the same
        key on PostgreSQL waits for this transaction and then sees the completed row.
        """
        now = self.clock()
        values = dict(
            consumer=consumer,
            key_digest=digests[0],
            namespace=namespace,
            version=version,
            fingerprint=fingerprint,
            state="completed",
            attempts=1,
            outcome=outcome,
            created_at=now,
            updated_at=now,
            expires_at=now + self.retention,
        )
        if len(digests) == 1:
            if self.lane is not None:
                inserted = await self.lane.insert_completed(
                    conn, consumer, digests[0], namespace, version, fingerprint, outcome=outcome, now=now,
                    expires_at=now + self.retention)
            else:
                inserted = (await conn.execute(self._statements.insert_completed, {
                    "p_consumer": consumer, "p_key_digest": digests[0], "p_namespace": namespace,
                    "p_version": version, "p_fingerprint": fingerprint, "p_outcome": outcome, "p_now": now,
                    "p_expires_at": now + self.retention})).rowcount == 1
            if inserted:
                return Claim(ClaimStatus.ACQUIRED, digests[0], 1)
        row = await self._find(conn, consumer, digests, lock=True)
        if row is None:
            fresh = await conn.execute(self._insert(inbox).values(**values).on_conflict_do_nothing())
            if fresh.rowcount == 1:
                return Claim(ClaimStatus.ACQUIRED, digests[0], 1)
            row = await self._find(conn, consumer, digests, lock=True)
            assert row is not None
        if row["fingerprint"] != fingerprint or row["state"] != "started":
            return verdict(row, fingerprint)
        if row["locked_until"] is not None and row["locked_until"] > now:
            return Claim(ClaimStatus.IN_PROGRESS, row["key_digest"], row["attempts"],
                         locked_until=row["locked_until"])
        # A row left "started" by an earlier failed attempt: finish it in this transaction.
        attempts = row["attempts"] + 1
        await conn.execute(
            update(inbox)
            .where(inbox.c.consumer == consumer, inbox.c.key_digest == row["key_digest"])
            .values(state="completed", locked_until=None, lease_token=None, attempts=attempts,
                    outcome=outcome, last_error=None, updated_at=now, expires_at=now + self.retention)
        )
        return Claim(ClaimStatus.ACQUIRED, row["key_digest"], attempts)

    async def claim_on(
        self, conn: Any, consumer: str, digest: str, fingerprint: str, *, namespace: str, version: int,
        outcome: str,
    ) -> Claim:
        """:meth:`claim_in` on a lane connection (a handler registered with ``driver="asyncpg"``), in
        one round trip for a new key and for a repeat alike."""
        assert self.lane is not None
        now = self.clock()
        if await self.lane.insert_completed_on(conn, consumer, digest, namespace, version, fingerprint,
                                               outcome=outcome, now=now, expires_at=now + self.retention):
            return Claim(ClaimStatus.ACQUIRED, digest, 1)
        attempts, row = await self.lane.claim_done_or_inspect_on(
            conn, consumer, digest, namespace, version, fingerprint, outcome=outcome, now=now,
            expires_at=now + self.retention)
        if attempts is not None:
            return Claim(ClaimStatus.ACQUIRED, digest, attempts)
        if row is None:  # committed by a concurrent claim after our statement's snapshot: look again
            row = await self.lane.lookup(consumer, digest, conn=conn)
            if row is None:  # and swept since: a new key after all
                return await self.claim_on(conn, consumer, digest, fingerprint, namespace=namespace,
                                           version=version, outcome=outcome)
        return verdict(row, fingerprint)

    async def complete_on(self, conn: Any, consumer: str, digest: str, token: str, *, outcome: str,
                          rider: Rider | None = None) -> bool:
        """:meth:`complete` on a lane connection (a handler registered with ``driver="asyncpg"``)."""
        assert self.lane is not None
        now = self.clock()
        return await self.lane.complete_on(conn, consumer, digest, token, outcome=outcome, now=now,
                                           expires_at=now + self.retention,
                                           keep_from=now + self.retention - self.lease, rider=rider)

    async def record_failure(
        self, consumer: str, digests: Sequence[str], fingerprint: str, *, namespace: str, version: int,
        error: str,
    ) -> int:
        """After a failed single-transaction attempt: remember the attempt (unleased) and count it."""
        now = self.clock()
        async with self.engine.begin() as conn:
            row = await self._find(conn, consumer, digests, lock=True)
            if row is None:
                await conn.execute(
                    self._insert(inbox).values(
                        consumer=consumer, key_digest=digests[0], namespace=namespace, version=version,
                        fingerprint=fingerprint, state="started", attempts=1, last_error=error[:500],
                        created_at=now, updated_at=now, expires_at=now + self.retention,
                    ).on_conflict_do_nothing()
                )
                return 1
            if row["state"] != "started":
                return int(row["attempts"])
            await conn.execute(
                update(inbox)
                .where(inbox.c.consumer == consumer, inbox.c.key_digest == row["key_digest"])
                .values(attempts=row["attempts"] + 1, last_error=error[:500], updated_at=now)
            )
            return int(row["attempts"]) + 1

    async def renew(self, consumer: str, digest: str, token: str) -> bool:
        """Extend our lease by one lease length; ``False`` when it is no longer ours."""
        now = self.clock()
        async with self.engine.begin() as conn:
            renewed = await conn.execute(
                update(inbox)
                .where(inbox.c.consumer == consumer, inbox.c.key_digest == digest,
                       inbox.c.state == "started", inbox.c.lease_token == token)
                .values(locked_until=now + self.lease, updated_at=now)
            )
            return renewed.rowcount == 1

    async def complete(
        self, conn: AsyncConnection, consumer: str, digest: str, token: str, *, outcome: str,
        result: Any = None, rider: Rider | None = None,
    ) -> bool:
        """Txn 2 of seed 003, inside the handler's transaction: mark the row completed if the lease is
        still ours. ``False`` means another attempt took over: the caller must roll back. ``rider``
        (see :class:`Rider`) is carried in the same statement on PostgreSQL's lane."""
        now = self.clock()
        if self.lane is not None and result is None:
            return await self.lane.complete(conn, consumer, digest, token, outcome=outcome, now=now,
                                            expires_at=now + self.retention,
                                            keep_from=now + self.retention - self.lease, rider=rider)
        done = await conn.execute(self._statements.complete, {
            "p_consumer": consumer, "p_key_digest": digest, "p_token": token, "p_outcome": outcome,
            "p_result": result, "p_now": now, "p_expires_at": now + self.retention,
        })
        return done.rowcount == 1

    async def release(self, consumer: str, digest: str, token: str, *, error: str | None = None) -> bool:
        """Give a lease back after a failed or abandoned attempt, so the next delivery takes over at once."""
        now = self.clock()
        async with self.engine.begin() as conn:
            released = await conn.execute(
                update(inbox)
                .where(inbox.c.consumer == consumer, inbox.c.key_digest == digest,
                       inbox.c.state == "started", inbox.c.lease_token == token)
                .values(locked_until=None, lease_token=None, updated_at=now,
                        last_error=error[:500] if error else None)
            )
            return released.rowcount == 1

    async def mark_dead(
        self, consumer: str, digest: str, token: str | None, *, reason: str, conn: AsyncConnection | None = None
    ) -> bool:
        """Park the key: later deliveries of it are acknowledged without running the handler."""
        now = self.clock()
        statement = (
            update(inbox)
            .where(inbox.c.consumer == consumer, inbox.c.key_digest == digest, inbox.c.state == "started",
                   _same_token(token))
            .values(state="dead", locked_until=None, lease_token=None, outcome=reason, updated_at=now,
                    expires_at=now + self.retention)
        )
        if conn is not None:
            return (await conn.execute(statement)).rowcount == 1
        async with self.engine.begin() as own:
            return (await own.execute(statement)).rowcount == 1

    async def sweep(self, *, batch_size: int = 500, max_batches: int | None = None) -> int:
        """Delete expired rows in batches of ``batch_size``, each its own short transaction.

        Rows still ``started`` with a live lease are never deleted, whatever their expiry.
        """
        total = 0
        batches = 0
        while max_batches is None or batches < max_batches:
            now = self.clock()
            async with self.engine.begin() as conn:
                expired = (
                    select(inbox.c.consumer, inbox.c.key_digest)
                    .where(inbox.c.expires_at <= now)
                    .where((inbox.c.locked_until.is_(None)) | (inbox.c.locked_until <= now))
                    .order_by(inbox.c.expires_at)
                    .limit(batch_size)
                )
                if conn.dialect.name == "postgresql":
                    expired = expired.with_for_update(skip_locked=True)
                keys = (await conn.execute(expired)).all()
                if not keys:
                    break
                for consumer in {k.consumer for k in keys}:
                    await conn.execute(
                        delete(inbox).where(
                            inbox.c.consumer == consumer,
                            inbox.c.key_digest.in_([k.key_digest for k in keys if k.consumer == consumer]),
                        )
                    )
            total += len(keys)
            batches += 1
            if len(keys) < batch_size:
                break
        return total


def _claimable(row: dict[str, Any], fingerprint: str, now: datetime) -> bool:
    """Whether the claim statement should have taken ``row`` over (when it did not, the row changed
    after the statement's snapshot)."""
    return row["state"] == "started" and row["fingerprint"] == fingerprint and \
        (row["locked_until"] is None or row["locked_until"] <= now)


def _same_token(token: str | None) -> Any:
    return inbox.c.lease_token.is_(None) if token is None else inbox.c.lease_token == token


def verdict(row: dict[str, Any], fingerprint: str) -> Claim:
    """What a committed row says to an attempt that did not get (or did not try for) the lease."""
    if row["fingerprint"] != fingerprint:
        status = ClaimStatus.CONFLICT
    else:  # a started row we could not take over holds a live lease
        status = _STATE_STATUS.get(row["state"], ClaimStatus.IN_PROGRESS)
    return Claim(status, row["key_digest"], row["attempts"], result=row["result"],
                 locked_until=row["locked_until"])


class _Statements:
    """The hot-path statements, built once with named parameters so that SQLAlchemy compiles each
    once per engine and asyncpg prepares each once per connection."""

    def __init__(self) -> None:
        now = bindparam("p_now", type_=UTCDateTime())
        self.lookup = select(inbox).where(inbox.c.consumer == bindparam("p_consumer"),
                                          inbox.c.key_digest == bindparam("p_digest"))
        # Written out because SQLAlchemy does not cache the compiled form of ON CONFLICT DO UPDATE
        # (it recompiled on every delivery); PostgreSQL and SQLite share this syntax.
        self.claim = text(
            "INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, locked_until,"
            " lease_token, attempts, created_at, updated_at, expires_at)"
            " VALUES (:p_consumer, :p_key_digest, :p_namespace, :p_version, :p_fingerprint, 'started',"
            " :p_locked_until, :p_lease_token, 1, :p_now, :p_now, :p_expires_at)"
            " ON CONFLICT (consumer, key_digest) DO UPDATE SET locked_until = :p_locked_until,"
            " lease_token = :p_lease_token, attempts = inbox.attempts + 1, updated_at = :p_now"
            " WHERE inbox.state = 'started' AND inbox.fingerprint = :p_fingerprint"
            " AND (inbox.locked_until IS NULL OR inbox.locked_until <= :p_now)"
            " RETURNING attempts"
        ).bindparams(
            bindparam("p_now", type_=UTCDateTime()), bindparam("p_locked_until", type_=UTCDateTime()),
            bindparam("p_expires_at", type_=UTCDateTime()),
        )
        self.insert_completed = text(
            "INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, attempts,"
            " outcome, created_at, updated_at, expires_at)"
            " VALUES (:p_consumer, :p_key_digest, :p_namespace, :p_version, :p_fingerprint, 'completed',"
            " 1, :p_outcome, :p_now, :p_now, :p_expires_at)"
            " ON CONFLICT (consumer, key_digest) DO NOTHING"
        ).bindparams(bindparam("p_now", type_=UTCDateTime()), bindparam("p_expires_at", type_=UTCDateTime()))
        self.complete = (
            update(inbox)
            .where(inbox.c.consumer == bindparam("p_consumer"), inbox.c.key_digest == bindparam("p_key_digest"),
                   inbox.c.state == "started", inbox.c.lease_token == bindparam("p_token"))
            .values(state="completed", locked_until=None, lease_token=None, outcome=bindparam("p_outcome"),
                    result=bindparam("p_result"), last_error=None, updated_at=now,
                    expires_at=bindparam("p_expires_at"))
        )
