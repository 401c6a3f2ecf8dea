"""The single-transaction path (``single_transaction=True``): claim, effect and completion in one commit.

::

    [lookup (a plain read)]        done, parked, held or another request -> Fate.not_acquired
    BEGIN; insert the row completed (or finish one a failed attempt left); handler; outbox rows; COMMIT
    ACK

    staged=True (a handler that only stages its writes): the handler first, with nothing held; then
    one statement staged, PostgreSQL on asyncpg, the plain inbox, one HMAC key in use:
        WITH <the key's tombstone>, <the key's row, completed> <the staged statement>   (autocommit)
          written -> ACK;  key taken -> its row decides, as a lookup's would;  swept -> the late policy
          a row a failed attempt left -> as below
    otherwise: BEGIN; insert the row completed; the staged writes; COMMIT (a handler that raised first
    runs again there, with the retries and parking every delivery has)

Only for handlers whose every effect is in the database: a handler that calls out would repeat its
call after a rollback. No lease is taken: a concurrent delivery of the same key waits on the row and
then finds it completed.

The plain read first is what a duplicate should cost: one read, and on PostgreSQL not even a
connection of its own (reads of deliveries under way at once are shared: :meth:`Inbox.look`). For a
new key it is one round trip more than the transaction needs (its insert finds a
duplicate too, at the price of a transaction begun and rolled back). So on PostgreSQL each handler
keeps a running estimate of how many of its deliveries are duplicates, and reads first only while
that is above :data:`READ_FIRST_ABOVE` (expected round trips: ``1 + 4(1 - d)`` reading first, ``4``
not). A database with one writer (SQLite) always reads first: there a transaction that writes takes its
one write lock.
"""

from __future__ import annotations

import logging

from consumer_kit.delivery import Outcome, Result, Settlement
from consumer_kit.keys import short
from consumer_kit.pipeline.duplicates import DuplicateShare
from consumer_kit.pipeline.fate import Failed, Fate, NotAcquired
from consumer_kit.pipeline.running import HandlerRunner, Stores, commit_span, span, usable
from consumer_kit.pipeline.work import PROCESSED, TAKEN, Work
from consumer_kit.redaction import describe
from consumer_kit.store import Claim, ClaimStatus, Executor, StagedWrites, claimable, verdict
from consumer_kit.store.at_once import AtOnce, can_guard

READ_FIRST_ABOVE = 0.25
"""The share of duplicates above which a delivery is looked up before its transaction."""


class SinglePath:
    """Runs deliveries of handlers registered with ``single_transaction=True``."""

    def __init__(self, stores: Stores, fate: Fate, runner: HandlerRunner) -> None:
        self.stores = stores
        self.fate = fate
        self.runner = runner
        self._duplicates = DuplicateShare(READ_FIRST_ABOVE, always=stores.database.can.one_writer)

    async def run(self, work: Work) -> Result:
        """Look (while duplicates are common), then claim and run in one transaction; settle."""
        stores, spec, inbox = self.stores, work.spec, self.stores.inbox
        read_first = self._duplicates.read_first(spec.consumer)
        if read_first and stores.database.can.shared_reads:  # a duplicate then takes no connection of its own
            settled, _ = await self.fate.looked_up(work, self._duplicates)
            if settled is not None:
                return settled
            read_first = False
        prepared: list[StagedWrites] = []  # a staged handler's writes, when it ran already
        if spec.staged and not read_first and stores.database.asyncpg and not spec.uses_db \
                and len(work.digests) == 1 and not stores.inbox.partitioned:
            result = await self._at_once(work, prepared)
            if result is not None:
                self._duplicates.count(spec.consumer, taken=result.outcome in TAKEN)
                return result
        # One connection: one that serves ctx.db when the handler may use it (SQLAlchemy's, on
        # asyncpg), else the store pool's.
        async with stores.database.connect(session=spec.uses_db) as ex:
            if read_first:
                with span(work, "claim"):
                    existing = await inbox.lookup(ex, spec.consumer, work.digests)
                if existing is not None and not claimable(existing, work.fingerprint, inbox.clock()):
                    self._duplicates.count(spec.consumer, taken=True)
                    return await self.fate.not_acquired(work, verdict(existing, work.fingerprint), ex)
            result = await self._handle(ex, work, prepared)
        self._duplicates.count(spec.consumer, taken=result.outcome in TAKEN)
        return result

    async def _at_once(self, work: Work, prepared: list[StagedWrites]) -> Result | None:
        """A staged handler run with nothing held, then its one staged statement written with the key
        in a single statement: the settlement, or ``None`` for the transaction path (the handler raised,
        staged another shape of writes, which are left in ``prepared``, or an earlier attempt's row is
        there to finish)."""
        stores, spec, inbox = self.stores, work.spec, self.stores.inbox
        try:
            writes = await self.runner.stage(work)
        except Exception:  # the transaction path runs it again, with the retries and parking it has
            return None
        alone = writes.alone()
        if alone is None or not can_guard(alone[0]):
            prepared.append(writes)
            return None
        statement, args = alone
        try:
            with commit_span(work) as committing:
                committing()
                # With the other deliveries' writes of this statement under way (a group commit).
                done = await inbox.write_with_key(spec.consumer, work.digests[0], work.fingerprint,
                                                  namespace=work.key.namespace, version=work.key.version,
                                                  outcome=PROCESSED, result=None, statement=statement, args=args)
        except Exception:  # nothing was written: the transaction path meets it again, and retries or parks
            prepared.append(writes)
            return None
        if done is AtOnce.WRITTEN:
            work.claim = Claim(ClaimStatus.ACQUIRED, work.digests[0], 1)
            work.log(logging.DEBUG, "delivery processed")
            return Result(Outcome.PROCESSED, Settlement.ACK, key_digest=short(work.digests[0]))
        async with stores.database.connect() as ex:
            if done is AtOnce.SWEPT:
                return await self.fate.not_acquired(work, Claim(ClaimStatus.SWEPT, work.digests[0], 0), ex)
            existing = await inbox.lookup(ex, spec.consumer, work.digests)
            if existing is None or claimable(existing, work.fingerprint, inbox.clock()):
                prepared.append(writes)  # swept since, or left by a failed attempt: the transaction decides
                return None
            return await self.fate.not_acquired(work, verdict(existing, work.fingerprint), ex)

    async def _handle(self, ex: Executor, work: Work, prepared: list[StagedWrites]) -> Result:
        stores, spec = self.stores, work.spec
        outcome = await self.fate.attempts(work, ex, lambda: self._attempt(ex, work, prepared))
        if not isinstance(outcome, Failed):
            work.log(logging.DEBUG, "delivery processed")
            return Result(Outcome.PROCESSED, Settlement.ACK, key_digest=work.digest)
        error = outcome.error
        if isinstance(error, NotAcquired):
            return await self.fate.not_acquired(work, error.claim, ex)
        # Remember the failed attempt (unleased), so that the count survives redeliveries.
        async with usable(stores.database, ex) as on:
            attempts = await stores.inbox.record_failure(
                on, spec.consumer, work.digests, work.fingerprint, namespace=work.key.namespace,
                version=work.key.version, error=describe(error, work.key))
        work.claim = Claim(ClaimStatus.ACQUIRED, work.digests[0], attempts)
        return await self.fate.failed(work, error, ex)

    async def _attempt(self, ex: Executor, work: Work, prepared: list[StagedWrites]) -> None:
        stores, spec = self.stores, work.spec
        with commit_span(work) as committing:
            async with ex.begin(deferred=True):
                with span(work, "claim"):
                    claim = await stores.inbox.claim_completed(
                        ex, spec.consumer, work.digests, work.fingerprint, namespace=work.key.namespace,
                        version=work.key.version, outcome=PROCESSED)
                if not claim.acquired:
                    raise NotAcquired(claim)
                work.claim = claim
                if spec.staged:  # what it staged before, or staged now (again, on a retry)
                    writes = prepared.pop() if prepared else await self.runner.stage(work)
                    await writes.write(ex)
                else:
                    await self.runner.run(ex, work)
                committing()
