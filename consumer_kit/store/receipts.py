"""The embedded coordinator's receipt store: receipts, the sessions and delegations they made, scope counts.

One method per operation, each on the connection the caller hands it. A receipt holds only the HMAC
digest of its key, the fingerprint of the request and the small response (id, status, expiry).

A creation is one transaction: the receipt (``ON CONFLICT DO NOTHING`` on its primary key), the
resource, then a slot in the scope's count. Two concurrent creations with one key meet on the
receipt's primary key: PostgreSQL makes the second wait for the first to commit and then insert
nothing, so the second caller reads the committed receipt and replays it. On PostgreSQL the common
case is one statement (:data:`~consumer_kit.store.sql.CREATE_RESOURCE`).

:class:`Creation` and :class:`Ending` are the private contract with the inbox: a prepared creation can
be carried by the inbox's claim and an ending by its completion (see :mod:`consumer_kit.store.sql`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from consumer_kit.store import sql
from consumer_kit.store.connections import Database
from consumer_kit.store.executor import CONFLICT_TRIES, Executor, Row, lost_to_a_conflict, rerun_on_conflict

STRIPES = 16
"""Rows the live-receipt count of one scope is spread over (see :meth:`ReceiptStore._take_slot`)."""

_NO_LIMIT = 2**31 - 1


def stripe_of(digest: str) -> int:
    """The count stripe a receipt belongs to, from its stored key digest."""
    return int(digest[:8], 16) % STRIPES


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose receipts these are: the authenticated tenant and application, and the operation."""

    tenant: str
    application: str
    operation: str

    def params(self) -> dict[str, str]:
        """As statement parameters."""
        return {"tenant": self.tenant, "application": self.application, "operation": self.operation}


@dataclass(frozen=True, slots=True)
class Found:
    """A committed receipt (or, for ``created``, the one just written) and what it means now."""

    verdict: str  # created | replayed | conflict | inactive | limit
    resource_id: str = ""
    status: str = ""
    expires_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Creation:
    """A creation prepared for PostgreSQL's one statement: run on its own (:meth:`ReceiptStore.create`)
    or carried by the inbox's claim (``Inbox.claim(creation=...)``)."""

    scope: Scope
    digest: str
    fingerprint: str
    resource_id: str
    expires_at: datetime  # the resource's
    stripe: int
    params: Mapping[str, Any]


@dataclass(slots=True)
class Ending:
    """A session's ending carried by the inbox's completion (``Inbox.complete(ending=...)``); ``ended``
    is what it did (``None`` while it was not carried)."""

    params: Mapping[str, Any]
    ended: bool | None = field(default=None)


class _AtCap(Exception):
    """The scope holds its cap of live receipts: nothing may be created."""


class _Existing(Exception):
    """The insert met a committed receipt under the same digest."""


Clock = Callable[[], datetime]


class ReceiptStore:
    """Create, look up, end and sweep receipts and resources."""

    def __init__(self, database: Database, *, clock: Clock) -> None:
        self.database = database
        self.clock = clock
        self._one_statement = database.can.writes_in_claim  # a creation in one statement (data-modifying CTEs)

    def prepare(self, scope: Scope, digest: str, fingerprint: str, *, kind: str, ttl: timedelta,
                retention: timedelta, generated: bool, cap: int) -> Creation:
        """The parameters of one creation under ``digest`` (PostgreSQL's one statement)."""
        now = self.clock()
        resource_id = secrets.token_hex(16)
        expires_at = now + ttl
        stripe = stripe_of(digest)
        params = {
            **scope.params(), "receipt_digest": digest, "receipt_fingerprint": fingerprint,
            "resource_id": resource_id, "response": _response(resource_id, expires_at), "generated": generated,
            "created_at": now,
            "receipt_expires_at": now + retention, "kind": kind, "resource_expires_at": expires_at,
            "stripe": stripe, "share": cap // STRIPES,
        }
        return Creation(scope, digest, fingerprint, resource_id, expires_at, stripe, params)

    async def create(
        self, ex: Executor, scope: Scope, digests: Sequence[str], fingerprint: str, *, kind: str,
        ttl: timedelta, retention: timedelta | None, generated: bool, cap: int,
        carried: tuple[Creation, Row] | None = None,
    ) -> Found:
        """Create a resource under the key whose candidate digests are ``digests`` (current HMAC key
        first), or report the committed receipt; ``ex`` must be outside a transaction.
        ``retention=None`` creates without a receipt. ``carried``: a creation that rode on the inbox's
        claim, and the row the claim's statement returned for it."""
        fast: Found | str | None = None
        if carried is not None:
            fast = await self.settle(ex, *carried)
        elif self._one_statement and retention is not None and len(digests) == 1:
            creation = self.prepare(scope, digests[0], fingerprint, kind=kind, ttl=ttl, retention=retention,
                                    generated=generated, cap=cap)
            row = await rerun_on_conflict(ex.fetch_one, sql.CREATE_RESOURCE, creation.params)
            assert row is not None
            fast = await self.settle(ex, creation, row)
        if isinstance(fast, Found):
            return fast
        if fast == "existing":
            found = await self._find(ex, scope, digests)
            if found is not None and found["receipt_expires_at"] > self.clock():
                return _verdict(found, fingerprint, self.clock())
        return await self._create_exactly(ex, scope, digests, fingerprint, kind=kind, ttl=ttl, retention=retention,
                                          generated=generated, cap=cap)

    async def _create_exactly(self, ex: Executor, scope: Scope, digests: Sequence[str], fingerprint: str, *,
                              kind: str, ttl: timedelta, retention: timedelta | None, generated: bool,
                              cap: int) -> Found:
        """The creation in a transaction of its own that counts the scope's receipts exactly (its
        stripes locked in stripe order): SQLite, a rotation of the HMAC key, or what the one-statement
        creation could not judge."""
        # The exact path locks a scope's stripes in stripe order, yet PostgreSQL still reported deadlocks
        # among such lockers under heavy concurrency (waiters queue on a row's tuple lock). A
        # transaction that lost one was rolled back whole and is run again; so is the insert after a
        # stale expired receipt was dropped.
        for attempt in range(1, CONFLICT_TRIES + 1):
            now = self.clock()
            resource_id = secrets.token_hex(16)
            expires_at = now + ttl
            params = {**scope.params(), "receipt_digest": digests[0] if digests else "",
                      "receipt_fingerprint": fingerprint, "resource_id": resource_id,
                      "response": _response(resource_id, expires_at), "generated": generated, "created_at": now,
                      "kind": kind, "resource_expires_at": expires_at,
                      "receipt_expires_at": now + retention if retention is not None else None}
            try:
                async with ex.begin():
                    if retention is not None:
                        if len(digests) > 1:  # key rotation: a receipt under the previous key counts
                            found = await self._find(ex, scope, digests[1:])
                            if found is not None:
                                return _verdict(found, fingerprint, now)
                        if await ex.execute(sql.INSERT_RECEIPT, params) != 1:
                            raise _Existing()
                    await ex.execute(sql.INSERT_RESOURCE, params)
                    if retention is not None:
                        await self._take_slot(ex, scope, stripe_of(digests[0]), cap, now)
                return Found("created", resource_id, "active", expires_at)
            except _AtCap:
                return Found("limit")
            except _Existing:
                pass
            except Exception as exc:
                if attempt == CONFLICT_TRIES or not lost_to_a_conflict(exc):
                    raise
                continue
            # The insert met a committed receipt (or waited for a concurrent one to commit).
            try:
                async with ex.begin():
                    found = await self._find(ex, scope, digests)
                    if found is None:  # swept between the two statements: create after all
                        continue
                    now = self.clock()
                    if found["receipt_expires_at"] > now:
                        return _verdict(found, fingerprint, now)
                    await self._drop_expired(ex, scope, found["key_digest"], now)
            except Exception as exc:
                if attempt == CONFLICT_TRIES or not lost_to_a_conflict(exc):
                    raise
        raise RuntimeError("receipt kept reappearing while expired")  # pragma: no cover

    async def settle(self, ex: Executor, creation: Creation, row: Row) -> Found | str:
        """What PostgreSQL's one-statement creation did: ``Found``, or "existing" (a receipt exists
        that the statement could not judge) or "slow" (first creation of a scope, a full stripe, a
        closed scope) for :meth:`create`'s portable path."""
        if row["created"]:
            return Found("created", creation.resource_id, "active", creation.expires_at)
        if row["slot"]:  # a concurrent creation with this key committed first: give the slot back
            await rerun_on_conflict(ex.execute, sql.ADD_TO_STRIPE,
                                    {**creation.scope.params(), "stripe": creation.stripe, "delta": -1})
            return "existing"
        if row["fingerprint"] is None:
            return "slow"
        now = self.clock()
        if row["receipt_expires_at"] <= now:
            return "existing"  # an expired receipt not swept yet: the portable path drops it
        return _verdict(row, creation.fingerprint, now)  # a replay, answered by the same statement

    @staticmethod
    def ending(tenant: str, application: str, resource_id: str) -> Ending:
        """An ending of an active resource to carry on the inbox's completion."""
        return Ending({"resource_id": resource_id, "tenant": tenant, "application": application})

    async def set_status(self, ex: Executor, tenant: str, application: str, resource_id: str,
                         status: str) -> bool:
        """Move an active resource to ``ended`` or ``revoked`` (in ``ex``'s transaction, if any); ``False``
        if no such resource is in scope. One that is no longer active is left as it is: not an error."""
        params = {"resource_id": resource_id, "tenant": tenant, "application": application,
                  "status": status, "now": self.clock()}
        if await ex.execute(sql.SET_RESOURCE_STATUS, params) == 1:
            return True
        return await self.resource(ex, tenant, application, resource_id) is not None

    async def resource(self, ex: Executor, tenant: str, application: str, resource_id: str) -> Row | None:
        """A resource of this tenant and application (its kind, status and expiry), or ``None``."""
        return await ex.fetch_one(sql.RESOURCE_IN_SCOPE, {"resource_id": resource_id, "tenant": tenant,
                                                          "application": application})

    async def receipt(self, ex: Executor, scope: Scope, digests: Sequence[str]) -> Row | None:
        """The live receipt under any of ``digests`` (current HMAC key first), or ``None``."""
        found = await self._find(ex, scope, digests)
        return found if found is not None and found["receipt_expires_at"] > self.clock() else None

    async def _find(self, ex: Executor, scope: Scope, digests: Sequence[str]) -> Row | None:
        for digest in digests:  # current HMAC key first
            row = await ex.fetch_one(sql.FIND_RECEIPT, {**scope.params(), "receipt_digest": digest})
            if row is not None:
                return row
        return None

    async def _take_slot(self, ex: Executor, scope: Scope, stripe: int, cap: int, now: datetime) -> None:
        """Count one more live receipt in ``scope`` or raise ``_AtCap``.

        The count is striped over ``STRIPES`` rows so that concurrent creations do not all wait for
        one row lock held through each commit. While every stripe stays within its share
        (``cap // STRIPES``) the sum cannot pass the cap, so a creation only bumps its own stripe.
        A full stripe takes the exact path: lock every stripe of the scope, sum, reclaim expired
        receipts if needed, and once a stripe goes past its share mark the scope ``closed`` so that
        every creation is counted exactly until the sweeper finds all stripes within share.
        """
        share = cap // STRIPES
        where = {**scope.params(), "stripe": stripe}
        if share and await ex.execute(sql.TAKE_STRIPE_SLOT, {**where, "share": share}) == 1:
            return
        # Every stripe locked, in stripe order (so that concurrent exact paths queue, never deadlock);
        # the scope's first creations write the stripes first.
        stripes = await ex.fetch_all(sql.LOCK_STRIPES, scope.params())
        if len(stripes) < STRIPES:
            await ex.execute_many(sql.INSERT_STRIPE, [{**scope.params(), "stripe": k} for k in range(STRIPES)])
            stripes = await ex.fetch_all(sql.LOCK_STRIPES, scope.params())
        total = sum(row["live"] for row in stripes)
        if total >= cap:  # expired receipts no longer count: reclaim this scope's before refusing
            total -= await self._delete_expired(ex, now, scope=scope, limit=_NO_LIMIT)
            if total >= cap:
                raise _AtCap()
        await ex.execute(sql.ADD_TO_STRIPE, {**where, "delta": 1})
        highest = max(row["live"] for row in await ex.fetch_all(sql.LOCK_STRIPES, scope.params()))
        await ex.execute(sql.SET_SCOPE_CLOSED, {**scope.params(), "closed": bool(highest > share)})

    async def open_scope(self, scope: Scope) -> None:
        """Write a scope's count stripes ahead of its first creation, so that the first creations take
        the one-statement path instead of all queueing on the exact one."""
        async with self.database.transaction() as ex:
            await ex.execute_many(sql.INSERT_STRIPE, [{**scope.params(), "stripe": k} for k in range(STRIPES)])

    async def reopen(self, cap: int) -> None:
        """Let closed scopes whose stripes are all back within their share use the striped path again."""
        async with self.database.connect() as ex:
            closed = [Scope(r["tenant"], r["application"], r["operation"])
                      for r in await ex.fetch_all(sql.CLOSED_SCOPES, {})]
        for scope in closed:
            async with self.database.transaction() as ex:
                lives = [row["live"] for row in await ex.fetch_all(sql.LOCK_STRIPES, scope.params())]
                if lives and max(lives) <= cap // STRIPES:
                    await ex.execute(sql.SET_SCOPE_CLOSED, {**scope.params(), "closed": False})

    async def _delete_expired(self, ex: Executor, now: datetime, *, scope: Scope | None, limit: int) -> int:
        """Delete expired receipts (of one scope, or any) and give their slots back; returns how many."""
        where = scope.params() if scope is not None else {"tenant": None, "application": None, "operation": None}
        rows = await ex.fetch_all(sql.EXPIRED_RECEIPTS, {**where, "now": now, "limit": limit})
        by_stripe: dict[tuple[str, str, str, int], list[str]] = {}
        for row in rows:
            owner = (row["tenant"], row["application"], row["operation"], stripe_of(row["key_digest"]))
            by_stripe.setdefault(owner, []).append(row["key_digest"])
        for (tenant, application, operation, stripe), digests in sorted(by_stripe.items()):
            owner_scope = Scope(tenant, application, operation).params()
            await ex.execute_many(sql.DELETE_RECEIPT, [{**owner_scope, "receipt_digest": d} for d in digests])
            await ex.execute(sql.ADD_TO_STRIPE, {**owner_scope, "stripe": stripe, "delta": -len(digests)})
        return len(rows)

    async def _drop_expired(self, ex: Executor, scope: Scope, digest: str, now: datetime) -> None:
        if await ex.execute(sql.DELETE_EXPIRED_RECEIPT, {**scope.params(), "receipt_digest": digest, "now": now}):
            await ex.execute(sql.ADD_TO_STRIPE, {**scope.params(), "stripe": stripe_of(digest), "delta": -1})

    async def sweep(self, *, batch_size: int, max_batches: int | None = None) -> int:
        """Delete expired receipts and resources in batches, each batch its own short transaction."""
        total = batches = 0
        while max_batches is None or batches < max_batches:
            now = self.clock()
            async with self.database.transaction() as ex:
                swept = await self._delete_expired(ex, now, scope=None, limit=batch_size)
                resources = await ex.execute(sql.SWEEP_RESOURCES, {"now": now, "limit": batch_size})
            total += swept
            batches += 1
            if swept < batch_size and resources < batch_size:
                break
        return total

    async def stats(self) -> tuple[int, datetime | None]:
        """``(receipts, oldest created_at)`` over every scope, for the gauges."""
        async with self.database.connect() as ex:
            row = await ex.fetch_one(sql.RECEIPT_STATS, {})
        assert row is not None
        return int(row["receipts"]), row["oldest"]


def _response(resource_id: str, expires_at: datetime) -> dict[str, str]:
    """The stored response: the resource's id, status and expiry, nothing else."""
    return {"id": resource_id, "status": "active", "expires_at": expires_at.isoformat()}


def _verdict(found: Row, fingerprint: str, now: datetime) -> Found:
    if found["fingerprint"] != fingerprint:
        return Found("conflict", found["resource_id"])
    expires = found["resource_expires_at"]
    if found["resource_status"] != "active" or expires is None or expires <= now:
        return Found("inactive", found["resource_id"])
    response = found["response"]
    return Found("replayed", response["id"], response["status"], datetime.fromisoformat(response["expires_at"]))
