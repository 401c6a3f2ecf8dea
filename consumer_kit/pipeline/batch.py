"""The batched path (``single_transaction=True, batch=Batch(...)``): many deliveries, one transaction.

::

    gather deliveries that arrive together (up to max_size, waiting at most max_wait_ms)
    BEGIN; claim every key in one statement (written completed); each handler in turn; COMMIT
      a key done, parked, held or another request's -> settled without running (Fate.not_acquired)
      a handler raises       -> ROLLBACK; that delivery leaves the batch for the single-delivery path;
                                the rest of the batch runs again
      the commit fails whole -> ROLLBACK; the batch is halved and each half runs on its own, down to
                                one delivery, which takes the single-delivery path
    ACK each delivery (the source may settle many at once)

A handler that failed once is known: its key takes the single-delivery path from then on (in process),
where it is retried, counted and parked as any delivery is. So a poison message costs its neighbours
one rollback and a second run, never a redelivery. A delivery's key that appears twice in one batch
is run once; its twin waits for the batch and is then a duplicate.

Why roll back and run again rather than a savepoint per delivery: a savepoint costs two round trips a
delivery (SAVEPOINT, RELEASE), which with one statement per handler is most of what batching saves,
and PostgreSQL slows down past 64 subtransactions in one transaction; a rollback costs only the
batches that met a failure. Batches are at most 64 deliveries (:class:`Batch`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from consumer_kit import metrics
from consumer_kit.delivery import Outcome, Result, Settlement
from consumer_kit.pipeline.fate import Fate
from consumer_kit.pipeline.running import NO_COMMIT, NO_SPAN, HandlerRunner, Stores
from consumer_kit.pipeline.spec import Batch
from consumer_kit.pipeline.work import PROCESSED, Work, log
from consumer_kit.redaction import describe, format_exception
from consumer_kit.store import BatchKey, Claim, ClaimStatus, Executor, StagedWrites
from consumer_kit.store.dead_letters import bounded

if TYPE_CHECKING:
    from consumer_kit.pipeline.single import SinglePath
    from consumer_kit.tracing.spans import BatchTrace, DeliveryTracer


Told = Callable[[Result | BaseException], None]
"""Told a batched delivery's result, or the exception that failed its batch (a cancellation included)."""


def _tell(future: asyncio.Future[Result], outcome: Result | BaseException) -> None:
    if future.done():  # its caller was cancelled: the result is dropped, the delivery comes again
        return
    if isinstance(outcome, Result):
        future.set_result(outcome)
    else:
        future.set_exception(outcome if isinstance(outcome, Exception) else asyncio.CancelledError())


_Tell = Callable[[Work, Result], None]


class _HandlerFailed(Exception):
    def __init__(self, work: Work) -> None:
        self.work = work


class BatchedPath:
    """Gathers the deliveries of each batched handler and runs them a batch a transaction."""

    def __init__(self, stores: Stores, fate: Fate, runner: HandlerRunner, single: SinglePath,
                 tracer: DeliveryTracer | None) -> None:
        self.stores = stores
        self.fate = fate
        self.runner = runner
        self.single = single
        self.tracer = tracer
        # Per handler, the deliveries gathering for its next batch, each with whom to tell its result
        # (or the exception that failed the batch): a future's setter, or Pipeline.soon's callback.
        self._waiting: dict[str, list[tuple[Work, Told]]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._active: collections.Counter[str] = collections.Counter()  # batches running, per handler
        self._running: set[asyncio.Task[None]] = set()
        # One writer (SQLite): a second batch would only wait for the write lock, and, measured under
        # load, a batch waiting on one whose write failed could wait out the busy timeout (30 s).
        self._one_writer = stores.database.can.one_writer
        # Keys that failed inside a batch (bounded: the oldest are forgotten first).
        self._failed: collections.OrderedDict[str, None] = collections.OrderedDict()

    def takes(self, work: Work) -> bool:
        """Whether ``work`` joins a batch (a key that failed in one before takes the single path)."""
        return work.digests[0] not in self._failed

    async def run(self, work: Work) -> Result:
        """Wait for this delivery's batch and return its settlement."""
        if not self.takes(work):
            return await self.single.run(work)
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self.add(work, functools.partial(_tell, future))
        # A caller that is cancelled (its channel closed) cancels only this future, never the batch,
        # which runs in a task of its own and finishes (its result for a cancelled future is dropped);
        # the delivery is then redelivered and found done. (No shield: it would cost every delivery a
        # second future and two more callbacks.)
        return await future

    def add(self, work: Work, told: Told) -> None:
        """Put ``work`` in its handler's next batch; ``told`` gets its result, or what failed the batch."""
        spec = work.spec
        batch = spec.batch
        assert batch is not None
        waiting = self._waiting.setdefault(spec.consumer, [])
        waiting.append((work, told))
        if len(waiting) >= batch.max_size:
            self._flush(spec.consumer)
        elif spec.consumer not in self._timers and self._active[spec.consumer] < self._concurrent(batch):
            self._timers[spec.consumer] = asyncio.get_running_loop().call_later(
                batch.max_wait_ms / 1000, self._flush, spec.consumer)

    def _flush(self, consumer: str) -> None:
        """Start a batch of what is waiting, unless as many as allowed are running: then the next one
        starts when one of them ends (:meth:`_ended`)."""
        timer = self._timers.pop(consumer, None)
        if timer is not None:
            timer.cancel()
        waiting = self._waiting.get(consumer)
        if not waiting:
            return
        batch = waiting[0][0].spec.batch
        assert batch is not None
        if self._active[consumer] >= self._concurrent(batch):
            return
        items, rest = waiting[:batch.max_size], waiting[batch.max_size:]
        if rest:
            self._waiting[consumer] = rest
        else:
            del self._waiting[consumer]
        self._active[consumer] += 1
        task = asyncio.ensure_future(self._settle(items))
        self._running.add(task)
        task.add_done_callback(lambda done: self._ended(consumer, done))

    def _concurrent(self, batch: Batch) -> int:
        return 1 if self._one_writer else batch.max_concurrent

    def _ended(self, consumer: str, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._active[consumer] -= 1
        if self._waiting.get(consumer):
            self._flush(consumer)

    async def close(self) -> None:
        """Run what is gathered now, and wait for the batches under way (the app's shutdown)."""
        while self._waiting or self._running:
            for consumer in list(self._waiting):
                self._flush(consumer)
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)
            await asyncio.sleep(0)  # the batches' done callbacks start what waited for them

    async def _settle(self, items: list[tuple[Work, Told]]) -> None:
        told = {id(work): tell for work, tell in items}
        tracer = self.tracer
        # Traced: the batch's span is current in its task (which was started from some delivery's).
        trace = tracer.batch(work for work, _ in items) if tracer is not None else None

        def tell(work: Work, result: Result) -> None:
            told.pop(id(work))(result)

        try:
            with NO_SPAN if trace is None else trace:
                await self._batch([work for work, _ in items], trace, tell)
        except BaseException as exc:
            for each in told.values():
                each(exc)
            if not isinstance(exc, Exception):
                raise

    async def _batch(self, works: list[Work], trace: BatchTrace | None, tell: _Tell) -> None:
        """Tell ``(work, result)`` for every delivery of a batch, as soon as its fate is known."""
        first: dict[str, Work] = {}
        twins: list[Work] = []
        for work in works:  # one run per key; its twins wait for the batch
            if work.digests[0] in first:
                twins.append(work)
            else:
                first[work.digests[0]] = work
        metrics.BATCH_SIZE.observe(len(first))
        after: list[Work] = []
        async with self.stores.database.connect(session=works[0].spec.uses_db) as ex:
            await self._on(ex, list(first.values()), after, trace, tell)
        for work in after + twins:  # out of the batch: the single-delivery path, one by one
            tell(work, await self.single.run(work))

    async def _on(self, ex: Executor, works: list[Work], after: list[Work], trace: BatchTrace | None,
                  tell: _Tell) -> None:
        """The batch's transactions on ``ex``, halves included: one connection a batch, however often
        it is halved (a connection a half, held while the halves ran, could empty the pool)."""
        remaining = works
        while remaining:
            try:
                ran, settled = await self._attempt(ex, remaining, trace)
            except _HandlerFailed as failed:  # rolled back: the rest runs again without it
                self._remember(failed.work)
                after.append(failed.work)
                remaining = [w for w in remaining if w is not failed.work]
                continue
            except Exception as exc:
                if ex.discarded or len(remaining) == 1:
                    log.warning("a batch of %d failed as a whole (%s); its deliveries go one by one",
                                len(remaining), type(exc).__name__)
                    after.extend(remaining)
                    return
                # The commit (or a staged write) failed as a whole (a deadlock, a serialization
                # failure, a deferred constraint, a row a constraint refuses): halve the batch until
                # the culprit stands alone.
                metrics.BATCH_BISECTIONS.inc()
                half = len(remaining) // 2
                for part in (remaining[:half], remaining[half:]):
                    await self._on(ex, part, after, trace, tell)
                return
            for work in ran:
                work.log(logging.DEBUG, "delivery processed in a batch")
                tell(work, Result(Outcome.PROCESSED, Settlement.ACK, key_digest=work.digest))
            for work, claim in settled:
                if claim.status is ClaimStatus.ACQUIRED:  # failed before: not in a batch
                    self._remember(work)
                    after.append(work)
                else:
                    tell(work, await self.fate.not_acquired(work, claim, ex))
            return

    async def _attempt(self, ex: Executor, works: list[Work],
                       trace: BatchTrace | None) -> tuple[list[Work], list[tuple[Work, Claim]]]:
        stores, spec = self.stores, works[0].spec
        ran: list[Work] = []
        settled: list[tuple[Work, Claim]] = []
        links = None if trace is None else trace.link
        staged = StagedWrites()  # the handlers' ctx.stage(...) writes: one statement each for the batch
        with NO_COMMIT if trace is None else trace.commit() as committing:
            async with ex.begin(deferred=True):
                with NO_SPAN if trace is None else trace.child("claim"):
                    claims = await stores.inbox.claim_batch(
                        ex, spec.consumer,
                        [BatchKey(w.digests[0], w.key.namespace, w.key.version, w.fingerprint) for w in works],
                        outcome=PROCESSED)
                for work, claim in zip(works, claims, strict=True):
                    if claim.acquired and claim.attempts > 0:
                        work.claim = claim
                        ran.append(work)
                    else:
                        settled.append((work, claim))
                for work in ran:
                    try:
                        await self.runner.run(ex, work, links, staged)
                    except Exception as exc:  # a failed attempt like any other: it shows its cause
                        work.log(logging.WARNING, f"handler failed in a batch ({describe(exc, work.key)}); it runs "
                                 "alone", bounded(format_exception(exc, work.key)))
                        raise _HandlerFailed(work) from exc
                if staged:  # a failure here fails the batch as a whole: it is halved (_on)
                    await staged.write(ex)
                committing()
        return ran, settled

    def _remember(self, work: Work) -> None:
        self._failed[work.digests[0]] = None
        while len(self._failed) > 10_000:
            self._failed.popitem(last=False)
