"""Every SQL statement of the embedded coordinator: receipts, governed resources, scope counts.

A creation is one transaction: insert the receipt (``ON CONFLICT DO NOTHING`` on its primary key),
insert the resource, then take a slot in the scope's counter. Two concurrent creations with one key
meet on the receipt's primary key: PostgreSQL makes the second insert wait for the first to commit
and then do nothing, so the second caller reads the committed receipt and replays it. The counter is
updated last so that its row lock is held only until the commit.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import JSON, Boolean, bindparam, delete, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from consumer_kit.coordinator.tables import coordinator_resources as resources
from consumer_kit.coordinator.tables import idempotency_receipts as receipts
from consumer_kit.coordinator.tables import idempotency_scopes as scopes
from consumer_kit.store.inbox import Clock, utcnow
from consumer_kit.store.pglane import PgLane, Rider
from consumer_kit.store.tables import UTCDateTime

# The two ON CONFLICT inserts are text: SQLAlchemy recompiles its dialect-specific insert().on_conflict_*
# constructs on every execution (they are not in its compiled cache), which doubled the cost of a
# creation. The SQL is the same on SQLite and PostgreSQL; the bind types keep JSON and UTC handling.
_INSERT_RECEIPT = text(
    "INSERT INTO idempotency_receipts (tenant, application, operation, key_digest, fingerprint, resource_id, "
    "response, generated, created_at, expires_at) VALUES (:tenant, :application, :operation, :key_digest, "
    ":fingerprint, :resource_id, :response, :generated, :created_at, :expires_at) ON CONFLICT DO NOTHING"
).bindparams(bindparam("response", type_=JSON()), bindparam("generated", type_=Boolean()),
             bindparam("created_at", type_=UTCDateTime()), bindparam("expires_at", type_=UTCDateTime()))
# PostgreSQL fast path (see ReceiptStore._create_pg), spoken to asyncpg directly: SQLAlchemy's
# async execution costs several times asyncpg's CPU per statement, and creation is the hot path.
# One statement in autocommit: the slot, the receipt and the resource commit together or not at all.
# Its parts also ride on the inbox's claim (store.pglane.Rider), gated on the claim's lease.
def _creation_ctes(gate: str) -> str:
    return (
        "existing AS (SELECT r.fingerprint, r.resource_id, r.response::text AS response, r.expires_at,"
        "  s.status AS resource_status, s.expires_at AS resource_expires_at"
        "  FROM idempotency_receipts r LEFT JOIN coordinator_resources s ON s.id = r.resource_id"
        "  WHERE r.tenant = $1 AND r.application = $2 AND r.operation = $3 AND r.key_digest = $4),"
        " slot AS (UPDATE idempotency_scopes SET live = live + 1"
        "  WHERE tenant = $1 AND application = $2 AND operation = $3 AND stripe = $13 AND live < $14"
        f"  AND NOT closed AND NOT EXISTS (SELECT 1 FROM existing){gate} RETURNING 1),"
        " receipt AS (INSERT INTO idempotency_receipts (tenant, application, operation, key_digest, fingerprint,"
        "  resource_id, response, generated, created_at, expires_at)"
        "  SELECT $1, $2, $3, $4, $5, $6, $7::json, $8, $9, $10 FROM slot ON CONFLICT DO NOTHING"
        "  RETURNING resource_id),"
        " resource AS (INSERT INTO coordinator_resources (id, tenant, application, kind, status, created_at,"
        "  expires_at) SELECT resource_id, $1, $2, $11, 'active', $9, $12 FROM receipt RETURNING 1)"
    )


_CREATION_COLUMNS = "e.*, (SELECT count(*) FROM slot) AS slot, (SELECT count(*) FROM resource) AS created"
_CREATION_SOURCE = "(SELECT 1) AS one LEFT JOIN existing e ON true"
_PG_CREATE = f"WITH {_creation_ctes('')} SELECT {_CREATION_COLUMNS} FROM {_CREATION_SOURCE}"
_CREATION_RIDING = _creation_ctes(" AND EXISTS (SELECT 1 FROM anchor)")
# Ending a session with the inbox's completion (a rider on it); $1 = now.
_ENDING_RIDING = (
    "ended AS (UPDATE coordinator_resources SET status = 'ended', ended_at = $1"
    " WHERE id = $2 AND tenant = $3 AND application = $4 AND status = 'active' RETURNING 1)"
)
# Ending or revoking on the asyncpg lane: one statement for the common case (an active resource).
_PG_SET_STATUS = (
    "UPDATE coordinator_resources SET status = $4, ended_at = $5"
    " WHERE id = $1 AND tenant = $2 AND application = $3 AND status = 'active' RETURNING 1"
)
_PG_IN_SCOPE = "SELECT 1 FROM coordinator_resources WHERE id = $1 AND tenant = $2 AND application = $3"
_PG_GIVE_BACK = (
    "UPDATE idempotency_scopes SET live = live - 1"
    " WHERE tenant = $1 AND application = $2 AND operation = $3 AND stripe = $4 AND live > 0"
)
_INSERT_STRIPES = text(
    "INSERT INTO idempotency_scopes (tenant, application, operation, stripe, live, closed) "
    "VALUES (:tenant, :application, :operation, :stripe, 0, false) ON CONFLICT DO NOTHING"
)

STRIPES = 16
"""Rows the live-receipt count of one scope is spread over (see ReceiptStore._take_slot)."""


def stripe_of(digest: str) -> int:
    """The count stripe a receipt belongs to, from its stored key digest."""
    return int(digest[:8], 16) % STRIPES


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose receipts these are: the authenticated tenant and application, and the operation."""

    tenant: str
    application: str
    operation: str


@dataclass(frozen=True, slots=True)
class Found:
    """A committed receipt (or, for ``created``, the one just written) and what it means now."""

    verdict: str  # created | replayed | conflict | inactive | limit
    resource_id: str = ""
    status: str = ""
    expires_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Creation:
    """A creation prepared for PostgreSQL's one statement: its parameters and what it would write.
    Run on its own (:meth:`ReceiptStore.create`) or carried by the inbox's claim (:attr:`rider`)."""

    digest: str
    fingerprint: str
    resource_id: str
    expires_at: datetime
    stripe: int
    scope: Scope
    args: tuple[Any, ...]
    rider: Rider


class _AtCap(Exception):
    """The scope holds its cap of live receipts: nothing may be created."""


class ReceiptStore:
    """Create, look up, end and sweep; one method per operation."""

    def __init__(self, engine: AsyncEngine, *, clock: Clock = utcnow, lane: PgLane | None = None) -> None:
        self.engine = engine
        self.clock = clock
        self.lane = lane  # PostgreSQL: the hot statements go to asyncpg directly (see store.pglane)
        self._pg = engine.dialect.name == "postgresql"

    async def create(
        self, scope: Scope, digests: Sequence[str], fingerprint: str, *, kind: str, ttl: timedelta,
        retention: timedelta | None, generated: bool, cap: int, carried: Creation | None = None,
        driver: Any = None,
    ) -> Found:
        """Create a resource under the key whose candidate digests are ``digests`` (current HMAC key
        first), or report the committed receipt. ``retention=None`` creates without a receipt.
        ``carried``: this creation was prepared (:meth:`prepare`) and its rider has run; ``driver``, a
        lane connection the caller holds (outside a transaction), for what is left to do on the lane."""
        fast: Found | str | None = None
        if carried is not None and carried.rider.row is not None and self.lane is not None:
            fast = await self._settle(driver or self.lane.pool, carried, carried.rider.row)
            if isinstance(fast, Found):
                return fast
        elif self._pg and retention is not None and len(digests) == 1 and self.lane is not None:
            fast = await self._create_pg(self.lane.pool, scope, digests[0], fingerprint, kind=kind, ttl=ttl,
                                         retention=retention, generated=generated, cap=cap)
            if isinstance(fast, Found):
                return fast
        # One connection for the rest of the call: a replay costs no second pool checkout.
        async with self.engine.connect() as conn:
            if fast is None and self._pg and retention is not None and len(digests) == 1:
                driver = (await conn.get_raw_connection()).driver_connection
                fast = await self._create_pg(driver, scope, digests[0], fingerprint, kind=kind, ttl=ttl,
                                             retention=retention, generated=generated, cap=cap)
                if isinstance(fast, Found):
                    return fast
            if fast == "existing":
                async with conn.begin():
                    found = await self._find(conn, scope, digests)
                    if found is not None and found["expires_at"] > self.clock():
                        return _verdict(found, fingerprint, self.clock())
            for _ in range(3):  # a stale expired receipt is dropped and the insert tried again
                now = self.clock()
                resource_id = secrets.token_hex(16)
                expires_at = now + ttl
                response = {"id": resource_id, "status": "active", "expires_at": expires_at.isoformat()}
                try:
                    async with conn.begin():
                        if retention is not None:
                            if len(digests) > 1:  # key rotation: a receipt under the previous key counts
                                found = await self._find(conn, scope, digests[1:])
                                if found is not None:
                                    return _verdict(found, fingerprint, now)
                            inserted = await conn.execute(_INSERT_RECEIPT, dict(
                                tenant=scope.tenant, application=scope.application, operation=scope.operation,
                                key_digest=digests[0], fingerprint=fingerprint, resource_id=resource_id,
                                response=response, generated=generated, created_at=now,
                                expires_at=now + retention,
                            ))
                            if inserted.rowcount != 1:
                                raise _Existing()
                        await conn.execute(resources.insert().values(
                            id=resource_id, tenant=scope.tenant, application=scope.application, kind=kind,
                            status="active", created_at=now, expires_at=expires_at,
                        ))
                        if retention is not None:
                            await self._take_slot(conn, scope, stripe_of(digests[0]), cap, now)
                    return Found("created", resource_id, "active", expires_at)
                except _AtCap:
                    return Found("limit")
                except _Existing:
                    pass
                # The insert found a committed receipt (or waited for a concurrent one to commit).
                async with conn.begin():
                    found = await self._find(conn, scope, digests)
                    if found is None:  # swept between the two statements: create after all
                        continue
                    now = self.clock()
                    if found["expires_at"] > now:
                        return _verdict(found, fingerprint, now)
                    await self._drop_expired(conn, scope, found["key_digest"], now)
        raise RuntimeError("receipt kept reappearing while expired")  # pragma: no cover

    async def _create_pg(
        self, driver: Any, scope: Scope, digest: str, fingerprint: str, *, kind: str, ttl: timedelta,
        retention: timedelta, generated: bool, cap: int,
    ) -> Found | str:
        """PostgreSQL's common case, one autocommitted statement on ``driver`` (an asyncpg pool or
        connection): a new key whose stripe has room takes the slot, writes the receipt and the resource.
        Returns "existing" when the key already had a receipt, "slow" for everything else (first
        creation of the scope, a full stripe, a closed scope): the portable path handles those."""
        creation = self.prepare(scope, digest, fingerprint, kind=kind, ttl=ttl, retention=retention,
                                generated=generated, cap=cap)
        return await self._settle(driver, creation, await driver.fetchrow(_PG_CREATE, *creation.args))

    def prepare(
        self, scope: Scope, digest: str, fingerprint: str, *, kind: str, ttl: timedelta, retention: timedelta,
        generated: bool, cap: int,
    ) -> Creation:
        """The parameters of PostgreSQL's one-statement creation, and the rider that carries it."""
        now = self.clock()
        resource_id = secrets.token_hex(16)
        expires_at = now + ttl
        response = json.dumps({"id": resource_id, "status": "active", "expires_at": expires_at.isoformat()})
        stripe = stripe_of(digest)
        args = (scope.tenant, scope.application, scope.operation, digest, fingerprint, resource_id, response,
                generated, now, now + retention, kind, expires_at, stripe, cap // STRIPES)
        return Creation(digest, fingerprint, resource_id, expires_at, stripe, scope, args,
                        Rider(_CREATION_RIDING, _CREATION_COLUMNS, _CREATION_SOURCE, args))

    async def _settle(self, driver: Any, creation: Creation, row: Any) -> Found | str:
        """What the one-statement creation did (see :meth:`_create_pg`)."""
        scope = creation.scope
        if row["created"]:
            return Found("created", creation.resource_id, "active", creation.expires_at)
        if row["slot"]:  # a concurrent creation with this key committed first: give the slot back
            await driver.execute(_PG_GIVE_BACK, scope.tenant, scope.application, scope.operation, creation.stripe)
            return "existing"
        if row["fingerprint"] is None:
            return "slow"
        now = self.clock()
        if row["expires_at"] <= now:
            return "existing"  # an expired receipt not swept yet: the portable path drops it
        # A replay, answered from the same statement.
        return _verdict({**dict(row), "response": json.loads(row["response"])}, creation.fingerprint, now)

    @staticmethod
    def ending(tenant: str, application: str, resource_id: str, now: datetime) -> Rider:
        """A rider that ends an active resource with the inbox's completion (``row["ended"]``: 1 when
        it did; 0 when the resource was not active or not in scope, see :meth:`set_status`)."""
        return Rider(_ENDING_RIDING, "(SELECT count(*) FROM ended) AS ended", "(SELECT 1) AS one",
                     (now, resource_id, tenant, application))

    async def _find(self, conn: AsyncConnection, scope: Scope, digests: Sequence[str]) -> dict[str, Any] | None:
        query = (
            select(receipts.c.key_digest, receipts.c.fingerprint, receipts.c.resource_id, receipts.c.response,
                   receipts.c.expires_at, resources.c.status.label("resource_status"),
                   resources.c.expires_at.label("resource_expires_at"))
            .select_from(receipts.outerjoin(resources, resources.c.id == receipts.c.resource_id))
            .where(receipts.c.tenant == scope.tenant, receipts.c.application == scope.application,
                   receipts.c.operation == scope.operation, receipts.c.key_digest.in_(digests))
        )
        rows = {row.key_digest: row._asdict() for row in await conn.execute(query)}
        return next((rows[d] for d in digests if d in rows), None)

    async def _take_slot(self, conn: AsyncConnection, scope: Scope, stripe: int, cap: int, now: datetime) -> None:
        """Count one more live receipt in ``scope`` or raise ``_AtCap``.

        The count is striped over ``STRIPES`` rows so that concurrent creations do not all wait for
        one row lock held through each commit. While every stripe stays within its share
        (``cap // STRIPES``) the sum cannot pass the cap, so a creation only bumps its own stripe.
        A full stripe takes the exact path: lock every stripe of the scope, sum, reclaim expired
        receipts if needed, and once a stripe goes past its share mark the scope ``closed`` so
        that every creation is counted exactly until the sweeper finds all stripes within share.
        """
        where = (scopes.c.tenant == scope.tenant, scopes.c.application == scope.application,
                 scopes.c.operation == scope.operation)
        share = cap // STRIPES
        if share and (await conn.execute(update(scopes).where(
                *where, scopes.c.stripe == stripe, scopes.c.live < share, scopes.c.closed.is_(False),
        ).values(live=scopes.c.live + 1))).rowcount == 1:
            return
        await conn.execute(_INSERT_STRIPES, [dict(tenant=scope.tenant, application=scope.application,
                                                  operation=scope.operation, stripe=k) for k in range(STRIPES)])
        locked = select(scopes.c.live).where(*where).order_by(scopes.c.stripe).with_for_update()
        total = sum(row.live for row in await conn.execute(locked))
        if total >= cap:  # expired receipts no longer count: reclaim this scope's before refusing
            total -= await self._delete_expired(conn, now, scope=scope, limit=None)
            if total >= cap:
                raise _AtCap()
        await conn.execute(update(scopes).where(*where, scopes.c.stripe == stripe).values(live=scopes.c.live + 1))
        highest = (await conn.execute(select(func.max(scopes.c.live)).where(*where))).scalar_one()
        await conn.execute(update(scopes).where(*where).values(closed=bool(highest > share)))

    async def open_scope(self, scope: Scope) -> None:
        """Write a scope's count stripes ahead of its first creation, so that the first creations take
        the one-statement path (``_PG_CREATE``) instead of all queueing on the exact one."""
        async with self.engine.begin() as conn:
            await conn.execute(_INSERT_STRIPES, [dict(tenant=scope.tenant, application=scope.application,
                                                      operation=scope.operation, stripe=k) for k in range(STRIPES)])

    async def reopen(self, cap: int) -> None:
        """Let closed scopes whose stripes are all back within their share use the striped path again."""
        share = cap // STRIPES
        async with self.engine.begin() as conn:
            closed = (await conn.execute(select(scopes.c.tenant, scopes.c.application, scopes.c.operation)
                                         .where(scopes.c.closed.is_(True)).distinct())).all()
        for row in closed:
            where = (scopes.c.tenant == row.tenant, scopes.c.application == row.application,
                     scopes.c.operation == row.operation)
            async with self.engine.begin() as conn:
                lives = [r.live for r in await conn.execute(
                    select(scopes.c.live).where(*where).order_by(scopes.c.stripe).with_for_update())]
                if lives and max(lives) <= share:
                    await conn.execute(update(scopes).where(*where).values(closed=False))

    async def _delete_expired(self, conn: AsyncConnection, now: datetime, *, scope: Scope | None,
                              limit: int | None) -> int:
        """Delete expired receipts (of one scope, or any) and give their slots back; returns how many."""
        query = select(receipts.c.tenant, receipts.c.application, receipts.c.operation,
                       receipts.c.key_digest).where(receipts.c.expires_at <= now)
        if scope is not None:
            query = query.where(receipts.c.tenant == scope.tenant, receipts.c.application == scope.application,
                                receipts.c.operation == scope.operation)
        if limit is not None:
            query = query.order_by(receipts.c.expires_at).limit(limit)
        if self._pg:  # the sweeper and a reclaiming creator never wait on each other's rows
            query = query.with_for_update(skip_locked=True)
        rows = (await conn.execute(query)).all()
        by_stripe: dict[tuple[str, str, str, int], list[str]] = {}
        for row in rows:
            owner = (row.tenant, row.application, row.operation, stripe_of(row.key_digest))
            by_stripe.setdefault(owner, []).append(row.key_digest)
        for (tenant, application, operation, stripe), digests in sorted(by_stripe.items()):
            await conn.execute(delete(receipts).where(
                receipts.c.tenant == tenant, receipts.c.application == application,
                receipts.c.operation == operation, receipts.c.key_digest.in_(digests)))
            await conn.execute(update(scopes).where(
                scopes.c.tenant == tenant, scopes.c.application == application,
                scopes.c.operation == operation, scopes.c.stripe == stripe,
            ).values(live=func.max(scopes.c.live - len(digests), 0) if not self._pg
                     else func.greatest(scopes.c.live - len(digests), 0)))
        return len(rows)

    async def _drop_expired(self, conn: AsyncConnection, scope: Scope, digest: str, now: datetime) -> None:
        gone = await conn.execute(delete(receipts).where(
            receipts.c.tenant == scope.tenant, receipts.c.application == scope.application,
            receipts.c.operation == scope.operation, receipts.c.key_digest == digest,
            receipts.c.expires_at <= now))
        if gone.rowcount:
            await conn.execute(update(scopes).where(
                scopes.c.tenant == scope.tenant, scopes.c.application == scope.application,
                scopes.c.operation == scope.operation, scopes.c.stripe == stripe_of(digest),
                scopes.c.live > 0).values(live=scopes.c.live - 1))

    async def set_status(self, tenant: str, application: str, resource_id: str, status: str, *,
                         conn: AsyncConnection | None = None, driver: Any = None) -> bool:
        """Move an active resource to ``ended`` or ``revoked``; ``False`` if no such resource is in scope.
        Ending or revoking one that is no longer active changes nothing and is not an error.

        By default in a transaction of its own; inside the caller's with ``conn`` (SQLAlchemy) or
        ``driver`` (an asyncpg connection of the lane)."""
        now = self.clock()
        if driver is None and conn is None and self.lane is not None:
            driver = self.lane.pool
        if driver is not None:
            if await driver.fetchval(_PG_SET_STATUS, resource_id, tenant, application, status, now):
                return True
            return await driver.fetchval(_PG_IN_SCOPE, resource_id, tenant, application) is not None
        if conn is None:
            async with self.engine.begin() as own:
                return await self._set_status(own, tenant, application, resource_id, status, now)
        return await self._set_status(conn, tenant, application, resource_id, status, now)

    @staticmethod
    async def _set_status(conn: AsyncConnection, tenant: str, application: str, resource_id: str, status: str,
                          now: datetime) -> bool:
        in_scope = (resources.c.id == resource_id, resources.c.tenant == tenant,
                    resources.c.application == application)
        changed = await conn.execute(update(resources).where(*in_scope, resources.c.status == "active")
                                     .values(status=status, ended_at=now))
        if changed.rowcount == 1:
            return True
        return (await conn.execute(select(resources.c.id).where(*in_scope))).first() is not None

    async def sweep(self, *, batch_size: int, cap: int, max_batches: int | None = None) -> int:
        """Delete expired receipts and resources in batches, each batch its own short transaction."""
        total = 0
        batches = 0
        while max_batches is None or batches < max_batches:
            now = self.clock()
            async with self.engine.begin() as conn:
                swept = await self._delete_expired(conn, now, scope=None, limit=batch_size)
                stale = select(resources.c.id).where(resources.c.expires_at <= now).limit(batch_size)
                ids = [row.id for row in await conn.execute(stale)]
                if ids:
                    await conn.execute(delete(resources).where(resources.c.id.in_(ids)))
            total += swept
            batches += 1
            if swept < batch_size and len(ids) < batch_size:
                break
        return total

    async def delegation_source(self, tenant: str, application: str, session_id: str,
                                digests: Sequence[str]) -> tuple[str | None, str | None]:
        """What a delegation from ``session_id`` needs to know before it is created: whether that session
        is in the scope (``"active"``, ``"inactive"`` once ended, revoked or expired, ``None`` when there
        is no such session of this tenant and application), and the fingerprint of the live delegation
        receipt under one of ``digests`` (current HMAC key first; ``None`` when there is none)."""
        now = self.clock()
        async with self.engine.connect() as conn:
            session = (await conn.execute(select(resources.c.status, resources.c.expires_at).where(
                resources.c.id == session_id, resources.c.tenant == tenant,
                resources.c.application == application, resources.c.kind == "session"))).first()
            fingerprints: dict[str, str] = {}
            if digests:
                fingerprints = {row.key_digest: row.fingerprint for row in await conn.execute(
                    select(receipts.c.key_digest, receipts.c.fingerprint).where(
                        receipts.c.tenant == tenant, receipts.c.application == application,
                        receipts.c.operation == "delegation", receipts.c.key_digest.in_(digests),
                        receipts.c.expires_at > now))}
        state = None if session is None else (
            "active" if session.status == "active" and session.expires_at > now else "inactive")
        return state, next((fingerprints[d] for d in digests if d in fingerprints), None)

    async def stats(self) -> tuple[int, datetime | None]:
        """``(receipts, oldest created_at)`` over every scope, for the gauges."""
        async with self.engine.connect() as conn:
            query = select(func.count(), func.min(receipts.c.created_at)).select_from(receipts)
            row = (await conn.execute(query)).one()
        oldest: datetime | None = row[1]
        return int(row[0]), oldest


class _Existing(Exception):
    """The insert met a committed receipt under the same digest."""


def _verdict(found: dict[str, Any], fingerprint: str, now: datetime) -> Found:
    if found["fingerprint"] != fingerprint:
        return Found("conflict", found["resource_id"])
    expires = found["resource_expires_at"]
    if found["resource_status"] != "active" or expires is None or expires <= now:
        return Found("inactive", found["resource_id"])
    response = found["response"]
    return Found("replayed", response["id"], response["status"], datetime.fromisoformat(response["expires_at"]))
