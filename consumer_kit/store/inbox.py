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

from sqlalchemy import delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from consumer_kit.store.tables import inbox

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
    ) -> None:
        self.engine = engine
        self.lease = timedelta(seconds=lease_seconds)
        self.retention = timedelta(seconds=retention_seconds)
        self.clock = clock
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert

    async def lookup(self, consumer: str, digests: Sequence[str]) -> dict[str, Any] | None:
        """The row stored under any of ``digests`` (current HMAC key first), without a lock."""
        async with self.engine.connect() as conn:
            return await self._find(conn, consumer, digests, lock=False)

    async def _find(
        self, conn: AsyncConnection, consumer: str, digests: Sequence[str], *, lock: bool
    ) -> dict[str, Any] | None:
        query = select(inbox).where(inbox.c.consumer == consumer, inbox.c.key_digest.in_(digests))
        if lock:
            query = query.with_for_update()
        rows = {row.key_digest: row._asdict() for row in await conn.execute(query)}
        for digest in digests:
            if digest in rows:
                return rows[digest]
        return None

    async def claim(
        self, consumer: str, digests: Sequence[str], fingerprint: str, *, namespace: str, version: int
    ) -> Claim:
        """Txn 1 of seed 003: take the lease on a new or abandoned key, or report what holds it.

        ``digests[0]`` is the digest under the current HMAC key; later ones are looked up so that a
        row written before a key rotation is still honoured.
        """
        # A read first: a redelivery of completed work (the common repeat) then costs one indexed
        # SELECT and no write at all.
        existing = await self.lookup(consumer, digests)
        if existing is not None and existing["state"] != "started":
            return _verdict(existing, fingerprint)
        now = self.clock()
        token = secrets.token_hex(16)
        async with self.engine.begin() as conn:
            if existing is None:
                inserted = await conn.execute(
                    self._insert(inbox)
                    .values(
                        consumer=consumer,
                        key_digest=digests[0],
                        namespace=namespace,
                        version=version,
                        fingerprint=fingerprint,
                        state="started",
                        locked_until=now + self.lease,
                        lease_token=token,
                        attempts=1,
                        created_at=now,
                        updated_at=now,
                        expires_at=now + self.retention,
                    )
                    .on_conflict_do_nothing()
                )
                if inserted.rowcount == 1:
                    return Claim(ClaimStatus.ACQUIRED, digests[0], 1, token, now + self.lease)
            row = await self._find(conn, consumer, digests, lock=True)
            if row is None:  # swept between our statements: a brand-new key after all
                return await self.claim(consumer, digests, fingerprint, namespace=namespace, version=version)
            if row["fingerprint"] != fingerprint or row["state"] != "started":
                return _verdict(row, fingerprint)
            if row["locked_until"] is not None and row["locked_until"] > now:
                return Claim(ClaimStatus.IN_PROGRESS, row["key_digest"], row["attempts"],
                             locked_until=row["locked_until"])
            # The lease expired or was released: take over with a fresh token. The WHERE on the old
            # token keeps this safe where FOR UPDATE is a no-op (SQLite serialises writers anyway).
            attempts = row["attempts"] + 1
            taken = await conn.execute(
                update(inbox)
                .where(
                    inbox.c.consumer == consumer,
                    inbox.c.key_digest == row["key_digest"],
                    inbox.c.state == "started",
                    _same_token(row["lease_token"]),
                )
                .values(locked_until=now + self.lease, lease_token=token, attempts=attempts, updated_at=now)
            )
            if taken.rowcount != 1:
                return Claim(ClaimStatus.IN_PROGRESS, row["key_digest"], row["attempts"])
            return Claim(ClaimStatus.ACQUIRED, row["key_digest"], attempts, token, now + self.lease)

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
            inserted = await conn.execute(self._insert(inbox).values(**values).on_conflict_do_nothing())
            if inserted.rowcount == 1:
                return Claim(ClaimStatus.ACQUIRED, digests[0], 1)
        row = await self._find(conn, consumer, digests, lock=True)
        if row is None:
            inserted = await conn.execute(self._insert(inbox).values(**values).on_conflict_do_nothing())
            if inserted.rowcount == 1:
                return Claim(ClaimStatus.ACQUIRED, digests[0], 1)
            row = await self._find(conn, consumer, digests, lock=True)
            assert row is not None
        if row["fingerprint"] != fingerprint or row["state"] != "started":
            return _verdict(row, fingerprint)
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
        result: Any = None,
    ) -> bool:
        """Txn 2 of seed 003, inside the handler's transaction: mark the row completed if the lease is
        still ours. ``False`` means another attempt took over: the caller must roll back."""
        now = self.clock()
        done = await conn.execute(
            update(inbox)
            .where(inbox.c.consumer == consumer, inbox.c.key_digest == digest,
                   inbox.c.state == "started", inbox.c.lease_token == token)
            .values(state="completed", locked_until=None, lease_token=None, outcome=outcome,
                    result=result, last_error=None, updated_at=now, expires_at=now + self.retention)
        )
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


def _same_token(token: str | None) -> Any:
    return inbox.c.lease_token.is_(None) if token is None else inbox.c.lease_token == token


def _verdict(row: dict[str, Any], fingerprint: str) -> Claim:
    """What a committed row says to a new attempt that did not get the lease."""
    if row["fingerprint"] != fingerprint:
        status = ClaimStatus.CONFLICT
    else:
        status = _STATE_STATUS.get(row["state"], ClaimStatus.IN_PROGRESS)
    return Claim(status, row["key_digest"], row["attempts"], result=row["result"],
                 locked_until=row["locked_until"])
