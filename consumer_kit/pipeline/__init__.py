"""The per-delivery algorithm (DESIGN.md), source-agnostic.

::

    key   = source.key(delivery)            no stable id / invalid key -> park, INVALID
    claim = inbox.claim(consumer, key, fp)  txn 1, committed at once (a lease on the key)
      completed   -> ACK, DUPLICATE         live lease -> RETRY_LATER, IN_PROGRESS
      conflict    -> park, CONFLICT         new / expired lease -> we hold the lease
    handler(ctx)  in txn 2, which also completes the inbox row WHERE lease_token = ours
      lease lost  -> roll back, LEASE_LOST  raised -> see fate
    ACK, PROCESSED

Who calls whom::

    Pipeline.process ──> LeasedPath (leased.py) ──┐
         │          └──> SinglePath (single.py) ──┼──> Fate (fate.py): every failure -> its settlement,
         │                                        │    the one retry loop, parking
         └── park INVALID                         └──> HandlerRunner (running.py) -> the handler, in
                                                       the delivery's transaction
    all of them ──> store: Inbox, DeadLetters, Outbox (on one Executor per delivery)

A delivery that cannot be keyed is parked here; everything else is one path's business. When tracing
is on (:mod:`consumer_kit.tracing`), ``process`` makes the delivery's span and each path its children
(``span``, ``commit_span`` and ``HandlerRunner`` in running.py); when it is off they are ``None`` checks.
What a handler is registered with is :mod:`.spec`; one delivery in flight, :class:`~.work.Work`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from consumer_kit import metrics
from consumer_kit.coordinator.protocol import Coordinator, SessionsInTransaction
from consumer_kit.delivery import Decided, Delivery, Outcome, RefusedReplay, Result, Settlement
from consumer_kit.errors import ConfigurationError, InvalidKey, InvalidReplay, MissingStableId
from consumer_kit.keys import KeyDigester, short
from consumer_kit.pipeline.batch import BatchedPath
from consumer_kit.pipeline.fate import Fate
from consumer_kit.pipeline.leased import LeasedPath
from consumer_kit.pipeline.running import HandlerRunner, Stores
from consumer_kit.pipeline.single import SinglePath
from consumer_kit.pipeline.spec import Batch, Handler, HandlerSpec, session_request
from consumer_kit.pipeline.work import Work, log
from consumer_kit.redaction import describe
from consumer_kit.settings import Settings
from consumer_kit.store import Database, DeadLetters, Inbox
from consumer_kit.store.diagnosis import missing_schema

if TYPE_CHECKING:
    from consumer_kit.tracing.spans import DeliveryTrace, DeliveryTracer

__all__ = ["Batch", "Handler", "HandlerSpec", "Pipeline", "session_request"]


class Pipeline:
    """Runs deliveries through claim, handler and completion; returns the settlement to carry out."""

    def __init__(
        self,
        *,
        settings: Settings,
        database: Database,
        inbox: Inbox,
        dead_letters: DeadLetters,
        digester: KeyDigester,
        http: httpx.AsyncClient | None = None,
        coordinator: Coordinator | None = None,
        tracer: DeliveryTracer | None = None,
        on_fatal: Callable[[ConfigurationError], None] | None = None,
    ) -> None:
        self.settings = settings
        self.database = database
        self.inbox = inbox
        self.dead_letters = dead_letters
        self.digester = digester
        self.coordinator = coordinator
        self.tracer = tracer  # None: tracing is off, and no delivery pays for it
        self.stores = Stores(database, inbox, dead_letters)
        self.fate = Fate(self.stores, settings, on_fatal)
        runner = HandlerRunner(digester, inbox.clock, http)
        # Asked once: can the coordinator keep a delivery's session inside the delivery's transaction?
        step = coordinator.session_step(database) if isinstance(coordinator, SessionsInTransaction) else None
        self.leased = LeasedPath(self.stores, self.fate, runner, settings, coordinator, step)
        self.single = SinglePath(self.stores, self.fate, runner)
        self.batched = BatchedPath(self.stores, self.fate, runner, self.single, tracer)
        self._metrics: dict[str, metrics.SourceMetrics] = {}

    async def close(self) -> None:
        """Finish the batches gathered or under way (the app calls this as it stops)."""
        await self.batched.close()

    async def process(self, spec: HandlerSpec, delivery: Delivery) -> Result:
        """Decide one delivery's fate; never raises except on cancellation."""
        counters = self._counters(spec)
        counters.in_flight += 1
        started = asyncio.get_running_loop().time()
        trace = self.tracer.delivery(spec, delivery) if self.tracer is not None else None
        try:
            result = await self._process(spec, delivery, trace)
        except asyncio.CancelledError as exc:
            counters.delivered("cancelled")
            if trace is not None:
                trace.end(None, exc)
            raise
        except Exception as exc:  # the store failed: nothing was decided, so try the delivery again
            result = self._store_failed(spec, exc)
            if trace is not None:
                trace.end(result, exc)
                trace = None
        finally:
            counters.in_flight -= 1
        if trace is not None:
            trace.end(result)
        self._count(counters, started, result)
        return result

    def soon(self, spec: HandlerSpec, delivery: Delivery, then: Decided) -> bool:
        """Hand a batched handler's delivery to its batch without a coroutine of its own; ``then`` is
        told its result from the batch's task (see :class:`~consumer_kit.delivery.DispatchSoon`).
        False, having done nothing, for every delivery that needs :meth:`process`: not batched, a key
        that failed in a batch before, traced, unkeyable, refused, or possibly late."""
        if spec.batch is None or self.tracer is not None or isinstance(delivery, RefusedReplay):
            return False
        age = None if delivery.sent_at is None else (delivery.received_at - delivery.sent_at).total_seconds()
        if age is not None and age > self.settings.inbox_retention_seconds:
            return False  # late: process() decides what to do with it
        try:
            key = spec.source.key(delivery)
        except (MissingStableId, InvalidKey):
            return False  # parked by process(), which keys it again
        work = Work(spec, delivery, key, self.digester.candidates(key), delivery.fingerprint())
        if not self.batched.takes(work):
            return False
        counters = self._counters(spec)
        if age is not None:
            counters.age.observe(max(0.0, age))
        counters.in_flight += 1
        started = asyncio.get_running_loop().time()

        def decided(outcome: Result | BaseException) -> None:
            counters.in_flight -= 1
            if isinstance(outcome, Result):
                result: Result | None = outcome
            elif isinstance(outcome, Exception):
                result = self._store_failed(spec, outcome)
            else:  # the batch was cancelled (the loop is closing): nothing was decided
                counters.delivered("cancelled")
                result = None
            if result is not None:
                self._count(counters, started, result)
            try:
                then(result)
            except Exception as exc:  # the source's own failure must not stop the batch telling the others
                log.error("settling a delivery failed (%s)", describe(exc, key), extra={"source": spec.source.name})

        self.batched.add(work, decided)
        return True

    def _counters(self, spec: HandlerSpec) -> metrics.SourceMetrics:
        source = spec.source.name
        counters = self._metrics.get(source)
        if counters is None:
            counters = self._metrics[source] = metrics.for_source(source)
        return counters

    def _count(self, counters: metrics.SourceMetrics, started: float, result: Result) -> None:
        if result.outcome is Outcome.PROCESSED:
            counters.handler_seconds.observe(asyncio.get_running_loop().time() - started)
        counters.delivered(result.outcome)

    def _store_failed(self, spec: HandlerSpec, exc: Exception) -> Result:
        """The result of a delivery the store failed under: nothing was decided, so try it again."""
        schema = missing_schema(exc)
        if schema is not None:  # consumer-kit's own tables are gone: no delivery can get past that
            self.fate.fatal(schema)
        else:
            log.error("delivery failed before settlement (%s); retrying later", describe(exc, None),
                      extra={"source": spec.source.name})
        return Result(Outcome.RETRY, Settlement.RETRY_LATER, "store_error" if schema is None else
                      "schema_missing", delay=self.settings.retry_later_seconds)

    async def _process(self, spec: HandlerSpec, delivery: Delivery, trace: DeliveryTrace | None) -> Result:
        try:
            if isinstance(delivery, RefusedReplay):
                raise InvalidReplay(delivery.why)
            key = spec.source.key(delivery)
        except (MissingStableId, InvalidKey) as exc:
            await self.fate.park(spec, delivery, None, exc.reason, str(exc), attempts=delivery.attempt, ex=None)
            return Result(Outcome.INVALID, Settlement.DEAD_LETTER, exc.reason)
        work = Work(spec, delivery, key, self.digester.candidates(key), delivery.fingerprint(), trace=trace)
        if trace is not None:
            trace.keyed(delivery, key, short(work.digests[0]))  # not work.digest: that is the claim's, once made
        if delivery.sent_at is not None:
            age = (delivery.received_at - delivery.sent_at).total_seconds()
            self._metrics[spec.source.name].age.observe(max(0.0, age))
            if age > self.settings.inbox_retention_seconds:
                late = await self.fate.late(work, f"sent {age:.0f} s ago, longer than INBOX_RETENTION_SECONDS")
                if late is not None:
                    return late
        if spec.batch is not None:
            return await self.batched.run(work)
        if spec.single_transaction:
            return await self.single.run(work)
        return await self.leased.run(work)
