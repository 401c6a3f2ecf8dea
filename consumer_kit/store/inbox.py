"""The inbox: the store of delivery keys (each with its lease, state and fingerprint), one method per
database operation, each on the connection (and in the transaction) the caller hands it.

A claim is its own statement, committed at once, so that other attempts see it (an uncommitted claim
is invisible, and a crash would roll it back with nothing to take over). Completion happens inside the
handler's transaction and only ``WHERE lease_token = ours``, so an attempt that lost its lease rolls
back instead of overwriting the attempt that took over.

Times come from the application clock; leases are tens of seconds, so the clocks of the hosts that
share a database must agree to within a small fraction of a lease (NTP does that).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from consumer_kit.store import partitions
from consumer_kit.store.at_once import AtOnce, SharedWrites
from consumer_kit.store.claims import BatchKey, Claim, ClaimStatus, Clock, claimable, utcnow, verdict
from consumer_kit.store.connections import Database
from consumer_kit.store.executor import Executor, Row
from consumer_kit.store.inbox_dialects import Dialect, Partitioned, Postgres, Sqlite, Statements
from consumer_kit.store.pace import Pace
from consumer_kit.store.receipts import Creation, Ending

__all__ = ["BatchKey", "Claim", "ClaimStatus", "Clock", "Inbox", "claimable", "utcnow", "verdict"]

class _SharedReads:
    """Look-ups of inbox rows, read together: the first starts a read at once, and those that arrive
    while it runs wait for the next, which reads them all in one statement (per consumer). A waiting
    caller that is cancelled gives up only its own answer; the read goes on in its own task."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox
        self._waiting: dict[str, list[tuple[Sequence[str], asyncio.Future[Row | None]]]] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}

    async def look(self, consumer: str, digests: Sequence[str]) -> Row | None:
        future: asyncio.Future[Row | None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(consumer, []).append((digests, future))
        if consumer not in self._readers:
            self._readers[consumer] = asyncio.ensure_future(self._read(consumer))
        return await future

    async def _read(self, consumer: str) -> None:
        batch: list[tuple[Sequence[str], asyncio.Future[Row | None]]] = []
        try:
            while batch := self._waiting.pop(consumer, []):
                wanted = list(dict.fromkeys(d for digests, _ in batch for d in digests))
                try:
                    inbox = self.inbox
                    async with inbox.database.connect() as ex:
                        rows = await ex.fetch_all(inbox.statements.lookup_many, {
                            "consumer": consumer, "key_digests": wanted, "now": inbox.clock(),
                            "tombstones": inbox.tombstones})
                except Exception as exc:  # each caller decides what a failed read means for it
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                found = {row["key_digest"]: row for row in rows}
                for digests, future in batch:
                    if not future.done():
                        future.set_result(next((found[d] for d in digests if d in found), None))
        except BaseException as exc:  # cancelled (the loop is closing): nobody waits in vain
            for _, future in (*batch, *self._waiting.pop(consumer, [])):
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            raise
        finally:
            del self._readers[consumer]


class Inbox:
    """Claim, renew, complete, release, park and sweep inbox rows."""

    def __init__(self, database: Database, *, lease_seconds: float, retention_seconds: float,
                 clock: Clock = utcnow, tombstone_seconds: float = 0, partitioned: bool = False) -> None:
        """``tombstone_seconds``: how long the sweeper keeps the digest of a row it deletes, during which
        a claim of that key finds it ``SWEPT`` (0: no tombstones; the key is then new again).
        ``partitioned``: the database's inbox is the partitioned one (PostgreSQL on asyncpg, see
        :mod:`consumer_kit.store.partitions`)."""
        self.database = database
        self.lease = timedelta(seconds=lease_seconds)
        self.retention = timedelta(seconds=retention_seconds)
        self.tombstone = timedelta(seconds=tombstone_seconds)
        self.tombstones = tombstone_seconds > 0
        self.clock = clock
        # The operations whose statements differ by database, chosen once (see _Postgres, _Sqlite).
        self.partitioned = partitioned
        if partitioned and not database.asyncpg:
            raise ValueError("the partitioned inbox is PostgreSQL's, on asyncpg (postgresql+asyncpg://)")
        self._dialect: Dialect = (Partitioned() if partitioned else Postgres() if database.can.writes_in_claim
                                  else Sqlite())
        self.statements: Statements = self._dialect.sql
        self._reads = _SharedReads(self)
        self._writes = SharedWrites(self)

    @property
    def shares_reads(self) -> bool:
        """Whether :meth:`look` reads on a connection of its own (``Database.can.shared_reads``), so
        that a caller can look before it takes one."""
        return self.database.can.shared_reads

    async def lookup(self, ex: Executor, consumer: str, digests: Sequence[str]) -> Row | None:
        """The row stored under any of ``digests`` (current HMAC key first), without a lock."""
        for digest in digests:
            row = await ex.fetch_one(self.statements.lookup, {"consumer": consumer, "key_digest": digest,
                                                              "now": self.clock(), "tombstones": self.tombstones})
            if row is not None:
                return row
        return None

    async def look(self, consumer: str, digests: Sequence[str]) -> Row | None:
        """:meth:`lookup` without a connection of the caller's (PostgreSQL only: see ``shares_reads``):
        the look-ups of many deliveries under way at once are read together, in one statement on one
        store connection, so that a duplicate costs a share of one read and holds no connection."""
        assert self.shares_reads, "shared reads are for PostgreSQL"
        return await self._reads.look(consumer, digests)

    async def write_with_key(self, consumer: str, digest: str, fingerprint: str, *, namespace: str, version: int,
                             outcome: str, result: Any, statement: str, args: tuple[Any, ...]) -> AtOnce:
        """The key's row written completed with ``result``, and one staged ``statement`` with its
        ``args``, in a single statement (PostgreSQL on asyncpg; :func:`~consumer_kit.store.at_once.write_at_once`)
        on a connection of the store's own, together with the same statement's other writes under way
        (a group commit: :class:`~consumer_kit.store.at_once.SharedWrites`)."""
        return await self._writes.write(consumer, digest, fingerprint, namespace=namespace, version=version,
                                        outcome=outcome, result=result, statement=statement, args=args)

    async def claim(self, ex: Executor, consumer: str, digests: Sequence[str], fingerprint: str, *,
                    namespace: str, version: int, creation: Creation | None = None,
                    read_first: bool = False) -> Claim:
        """The first of a delivery's two transactions, in autocommit (never inside a transaction: on
        PostgreSQL a lease alone commits without waiting for its flush, see ``sql.CLAIM``): take the lease
        on a new or abandoned key, or report what holds it. ``digests[0]`` is the digest under the current
        HMAC key; a row written under the previous one is still honoured. ``creation`` (PostgreSQL)
        commits in the claim's statement when, and only when, the claim takes the lease; its row is
        ``Claim.carried``. ``read_first``: look the key up before claiming it on PostgreSQL too (cheaper
        when duplicates are common)."""
        digest = digests[0]
        expired = False  # the row's lease ran out rather than being given back
        if self._dialect.reads_first or len(digests) > 1 or read_first:
            # A plain read first: a redelivery of finished work then costs one indexed SELECT and no
            # write. (On PostgreSQL the claim statement makes the same test itself.)
            existing = await self.lookup(ex, consumer, digests)
            if existing is not None:
                if not claimable(existing, fingerprint, self.clock()):
                    return verdict(existing, fingerprint)
                digest, expired = existing["key_digest"], existing["locked_until"] is not None
            elif self._dialect.reads_first and await self._swept(ex, consumer, digests):
                return Claim(ClaimStatus.SWEPT, digest, 0)
        now = self.clock()
        params = {"consumer": consumer, "key_digest": digest, "namespace": namespace, "version": version,
                  "fingerprint": fingerprint, "locked_until": now + self.lease,
                  "lease_token": secrets.token_hex(16), "now": now, "expires_at": now + self.retention,
                  "tombstones": self.tombstones}
        taken = await self._dialect.claim(ex, digest, fingerprint, params, creation, expired=expired)
        if taken is not None:
            return taken
        # Another claim got there after our statement's snapshot: its committed row decides.
        found = await self.lookup(ex, consumer, [digest])
        if found is None or (claimable(found, fingerprint, now) and await self._dialect.drop_lapsed(ex, params)):
            # swept in between (or, partitioned, its row lapsed): a brand-new key after all
            return await self.claim(ex, consumer, digests, fingerprint, namespace=namespace, version=version,
                                    creation=creation)
        return verdict(found, fingerprint)

    async def claim_completed(self, ex: Executor, consumer: str, digests: Sequence[str], fingerprint: str, *,
                              namespace: str, version: int, outcome: str) -> Claim:
        """The single-transaction claim, inside ``ex``'s transaction: the row is written completed (or
        a row an earlier failed attempt left started and unleased is finished), so the effect commits
        with it or not at all; no lease is needed. A concurrent claim of the same key waits for this
        transaction and then sees the completed row."""
        now = self.clock()
        params = {"consumer": consumer, "key_digest": digests[0], "namespace": namespace, "version": version,
                  "fingerprint": fingerprint, "outcome": outcome, "now": now, "expires_at": now + self.retention,
                  "tombstones": self.tombstones}
        if len(digests) == 1 and await self._dialect.insert_one(ex, params):
            return Claim(ClaimStatus.ACQUIRED, digests[0], 1)
        existing = await self.lookup(ex, consumer, digests)
        if existing is None:
            if await self._swept(ex, consumer, digests):
                return Claim(ClaimStatus.SWEPT, digests[0], 0)
            if await self._dialect.insert_one(ex, params):  # a new key after all
                return Claim(ClaimStatus.ACQUIRED, digests[0], 1)
            existing = await self.lookup(ex, consumer, digests)
            assert existing is not None
        if not claimable(existing, fingerprint, now):
            return verdict(existing, fingerprint)
        found = {**params, "key_digest": existing["key_digest"]}
        finished = await ex.fetch_one(self.statements.finish_started, found)
        if finished is not None:
            return Claim(ClaimStatus.ACQUIRED, existing["key_digest"], int(finished["attempts"]))
        if await self._dialect.drop_lapsed(ex, found) and await self._dialect.insert_one(ex, params):
            return Claim(ClaimStatus.ACQUIRED, digests[0], 1)
        # Completed, dead, leased or another request: the row as committed now decides.
        row = await self.lookup(ex, consumer, [existing["key_digest"]])
        assert row is not None
        return verdict(row, fingerprint)

    async def hold(self, ex: Executor, consumer: str, digests: Sequence[str], fingerprint: str) -> Claim:
        """An idempotent endpoint's single-transaction claim, first in ``ex``'s transaction; it writes nothing
        (:meth:`finish_held` writes the row at the end). ``ACQUIRED`` for a new key (attempts 1) or one an
        earlier attempt left started and free (``carried``: that row); else what holds the key, ``SWEPT``
        for a tombstone, and ``IN_PROGRESS`` while another transaction holds it (PostgreSQL: the key's
        advisory lock, not waited for; on SQLite the one writer made the others wait at ``BEGIN``)."""
        existing: Row | None = None
        swept = False
        rest = digests
        if self.database.can.writes_in_claim:
            row = await ex.fetch_one(self.statements.lock_and_look, {
                "consumer": consumer, "key_digest": digests[0], "tombstones": self.tombstones, "now": self.clock()})
            assert row is not None
            existing, swept = (row if row["state"] is not None else None), bool(row["tombstoned"])
            if not row["locked"]:
                if existing is not None and existing["state"] != "started":
                    return verdict(existing, fingerprint)
                return Claim(ClaimStatus.IN_PROGRESS, digests[0], 0)
            rest = digests[1:]
        if existing is None and rest:
            existing = await self.lookup(ex, consumer, rest)
            swept = swept or (existing is None and await self._swept(ex, consumer, rest))
        if existing is not None:
            now = self.clock()
            if not claimable(existing, fingerprint, now):
                return verdict(existing, fingerprint)
            if not await self._dialect.drop_lapsed(ex, {"consumer": consumer, "key_digest": existing["key_digest"],
                                                        "now": now, "tombstones": self.tombstones}):
                return Claim(ClaimStatus.ACQUIRED, existing["key_digest"], int(existing["attempts"]) + 1,
                             carried=existing)
        return Claim(ClaimStatus.SWEPT if swept else ClaimStatus.ACQUIRED, digests[0], 0 if swept else 1)

    async def finish_held(self, ex: Executor, consumer: str, claim: Claim, fingerprint: str, *, namespace: str,
                          version: int, outcome: str, result: Any) -> bool:
        """The end of :meth:`hold`'s transaction: the key's row written completed with ``result``, or the
        row it carried finished. ``False``: another request's row is there after all (its commit was not
        yet visible when this one looked): the caller must roll back."""
        now = self.clock()
        params = {"consumer": consumer, "key_digest": claim.digest, "namespace": namespace, "version": version,
                  "fingerprint": fingerprint, "outcome": outcome, "result": result, "now": now,
                  "expires_at": now + self.retention, "tombstones": self.tombstones}
        if claim.carried is not None:
            return await ex.fetch_one(self.statements.finish_started_with_result, params) is not None
        return await self._dialect.insert_one(ex, params)

    async def claim_batch(self, ex: Executor, consumer: str, keys: Sequence[BatchKey], *,
                          outcome: str) -> list[Claim]:
        """The single-transaction claim of many keys at once, inside ``ex``'s transaction: each new key
        is written completed (PostgreSQL: in one statement); for the others, what holds them. The
        keys' digests must be distinct. A key with a row an earlier failed attempt left started comes
        back ``ACQUIRED`` with ``attempts`` 0: the caller takes it out of the batch (it has failed
        before) rather than finishing it here."""
        now = self.clock()
        inserted = await self._dialect.insert_completed(ex, consumer, keys, {
            "outcome": outcome, "now": now, "expires_at": now + self.retention, "tombstones": self.tombstones})
        others = [k.digest for k in keys if k.digest not in inserted]
        found = await self._dialect.rows(ex, {"consumer": consumer, "key_digests": others, "now": now,
                                               "tombstones": self.tombstones}) if others else {}
        claims = []
        for k in keys:
            row = found.get(k.digest)
            if k.digest in inserted:
                claims.append(Claim(ClaimStatus.ACQUIRED, k.digest, 1))
            elif row is None:  # not written and not there: its tombstone stopped it
                claims.append(Claim(ClaimStatus.SWEPT, k.digest, 0))
            elif claimable(row, k.fingerprint, now):
                claims.append(Claim(ClaimStatus.ACQUIRED, k.digest, 0))
            else:
                claims.append(verdict(row, k.fingerprint))
        return claims

    async def complete(self, ex: Executor, consumer: str, digest: str, token: str, *, outcome: str,
                       ending: Ending | None = None, result: Any = None) -> bool:
        """The second transaction, the handler's own: mark the row completed if the lease is
        still ours. ``False`` means another attempt took over: the caller must roll back. ``ending``
        (PostgreSQL) ends the coordinator's session in the same statement (``Ending.ended``).
        ``result`` (JSON) is stored with the row, for a repeat to be answered with (``Claim.result``)."""
        now = self.clock()
        params = {"consumer": consumer, "key_digest": digest, "lease_token": token, "outcome": outcome,
                  "now": now, "expires_at": now + self.retention, "keep_from": now + self.retention - self.lease}
        if result is not None:
            assert ending is None, "a stored result and a coordinator ending are not written together"
            return await ex.execute(self.statements.complete_with_result, {**params, "result": result}) == 1
        if ending is None:
            return await ex.execute(self.statements.complete, params) == 1
        return await self._dialect.complete_ending(ex, params, ending)

    async def renew(self, ex: Executor, consumer: str, digest: str, token: str) -> bool:
        """Extend our lease by one lease length; ``False`` when it is no longer ours."""
        now = self.clock()
        return await ex.execute(self.statements.renew, {
            "consumer": consumer, "key_digest": digest, "lease_token": token, "locked_until": now + self.lease,
            "now": now}) == 1

    async def release(self, ex: Executor, consumer: str, digest: str, token: str, *,
                      error: str | None = None) -> bool:
        """Give a lease back after a failed or abandoned attempt, so the next delivery takes over at once."""
        return await ex.execute(self.statements.release, {
            "consumer": consumer, "key_digest": digest, "lease_token": token, "now": self.clock(),
            "last_error": error[:500] if error else None}) == 1

    async def withdraw(self, ex: Executor, consumer: str, digest: str, token: str) -> bool:
        """Delete the row of a claim we hold whose request turned out invalid before anything ran, so
        that the key is new again (a claim given back with :meth:`release` keeps its fingerprint)."""
        return await ex.execute(self.statements.withdraw, {"consumer": consumer, "key_digest": digest,
                                                           "lease_token": token, "now": self.clock()}) == 1

    async def mark_dead(self, ex: Executor, consumer: str, digest: str, token: str | None, *,
                        reason: str) -> bool:
        """Park the key: later deliveries of it are acknowledged without running the handler."""
        now = self.clock()
        params = {"consumer": consumer, "key_digest": digest, "outcome": reason, "now": now,
                  "expires_at": now + self.retention}
        if token is None:
            return await ex.execute(self.statements.mark_dead_unleased, params) == 1
        return await ex.execute(self.statements.mark_dead, {**params, "lease_token": token}) == 1

    async def record_failure(self, ex: Executor, consumer: str, digests: Sequence[str], fingerprint: str, *,
                             namespace: str, version: int, error: str) -> int:
        """After a failed single-transaction attempt: remember the attempt (unleased) and count it;
        returns the attempts so far."""
        digest = digests[0]
        if len(digests) > 1:
            existing = await self.lookup(ex, consumer, digests)
            digest = existing["key_digest"] if existing is not None else digest
        now = self.clock()
        attempts = await self._dialect.record_failure(ex, {
            "consumer": consumer, "key_digest": digest, "namespace": namespace, "version": version,
            "fingerprint": fingerprint, "last_error": error[:500], "now": now, "expires_at": now + self.retention})
        if attempts is not None:
            return attempts
        found = await self.lookup(ex, consumer, [digest])  # finished or parked meanwhile
        return int(found["attempts"]) if found is not None else 1

    async def swept(self, ex: Executor, consumer: str, digests: Sequence[str]) -> bool:
        """Whether a tombstone says the key was done (or parked) and its record swept."""
        return await self._swept(ex, consumer, digests)

    async def _swept(self, ex: Executor, consumer: str, digests: Sequence[str]) -> bool:
        if not self.tombstones:
            return False
        for digest in digests:
            if await ex.fetch_one(self.statements.tombstone, {"consumer": consumer, "key_digest": digest,
                                                              "now": self.clock()}) is not None:
                return True
        return False

    async def reopen(self, ex: Executor, consumer: str, digests: Sequence[str], *,
                     fingerprint: str | None = None) -> bool:
        """For the replay of a parked delivery: take its key out of the "dead" state (a fresh count of
        attempts, no lease), so that the replayed delivery runs the handler; and drop the key's
        tombstone, so that a key whose record was swept is a key like any other again. With
        ``fingerprint`` (a new body accepted for the key) a key in any state but a live lease is
        reopened for that fingerprint. Whether a row was reopened; a completed key stays completed
        otherwise (its replay is a duplicate)."""
        now = self.clock()
        reopened = False
        for digest in digests:
            params = {"consumer": consumer, "key_digest": digest, "now": now, "expires_at": now + self.retention}
            if fingerprint is None:
                count = await ex.execute(self.statements.reopen_parked, params)
            else:
                count = await ex.execute(self.statements.reopen_with_fingerprint,
                                         {**params, "fingerprint": fingerprint})
            reopened = reopened or count == 1
        await self.forget(ex, consumer, digests)
        return reopened

    async def forget(self, ex: Executor, consumer: str, digests: Sequence[str]) -> None:
        """Drop a key's tombstone (a late delivery processed anyway makes it a key like any other)."""
        now = self.clock()
        await ex.execute_many(self.statements.forget_tombstone,
                              [{"consumer": consumer, "key_digest": d, "now": now} for d in digests])

    async def sweep(self, *, batch_size: int = 500, max_batches: int | None = None, pace: Pace | None = None) -> int:
        """Delete expired rows in batches of ``batch_size``, each its own short transaction (on PostgreSQL
        skipping rows a claim has locked), leaving a tombstone (its digest) for ``tombstone_seconds``; then
        expired tombstones. ``pace``: pauses between batches. A started row with a live lease stays.
        The partitioned inbox deletes no rows: its generations leave whole (``partitions.maintain``); the
        count is then of the rows that left with them."""
        total = batches = 0
        pace = pace or Pace()
        if self.partitioned:
            async with (await self.database.pool()).acquire() as conn:
                done = await partitions.maintain(conn, self.clock(), retention=self.retention,
                                                 tombstone=self.tombstone)
            total, max_batches = done.rows, 0
        since = datetime.min.replace(tzinfo=UTC)  # each batch goes on from the newest expiry the one before deleted
        while max_batches is None or batches < max_batches:
            now = self.clock()
            params = {"now": now, "since": since, "limit": batch_size, "tombstones": self.tombstones,
                      "tombstone_expires_at": now + self.tombstone}
            async with self.database.transaction() as ex:
                deleted, newest = await self._dialect.sweep(ex, params)
            total, batches, since = total + deleted, batches + 1, newest or since
            if deleted < batch_size:
                break
            await pace.step()
        since = datetime.min.replace(tzinfo=UTC)
        while True:
            async with self.database.connect() as ex:
                gone, newest = await self._dialect.sweep_tombstones(
                    ex, {"now": self.clock(), "since": since, "limit": batch_size})
            since = newest or since
            if gone < batch_size:
                return total
            await pace.step()
