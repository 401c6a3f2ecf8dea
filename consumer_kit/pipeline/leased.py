"""The two-transaction path, the default: safe for handlers that call out (a lease on the key, committed
first; then the handler's effect and the record that the delivery is done, committed together).

::

    claim  (its own statement, committed at once)    -> not ours: see Fate.not_acquired
    session = coordinator step, under key.derive("session")    (handlers with labels or task)
    BEGIN; handler; outbox rows; complete WHERE lease_token = ours; COMMIT
                                                      -> 0 rows: LeaseLost, everything rolls back
    ACK

The delivery holds one connection from its claim to its commit (one pool checkout), and a lease in
the inbox row that a heartbeat renews while the handler runs. A delivery cancelled halfway (a broker
reconnect, the shutdown grace, a client that hung up) rolls its transaction back and gives its lease
back on a fresh connection, so that the redelivery need not wait the lease out.

A coordinator whose sessions live in the inbox's database (:class:`SessionStep`) creates the session in
the claim's statement and ends it in the completion's: the session ends if and only if the effect
commits. Any other coordinator is called after the claim, and told after the commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from consumer_kit import metrics
from consumer_kit.coordinator.protocol import (
    Coordinator,
    SessionReceipt,
    SessionRequest,
    SessionStep,
)
from consumer_kit.coordinator.protocol import fingerprint as request_digest
from consumer_kit.delivery import Outcome, Result, Settlement
from consumer_kit.errors import IdempotencyKeyConflict, IdempotencyResultInactive, LeaseLost, TerminalError
from consumer_kit.pipeline.duplicates import DuplicateShare
from consumer_kit.pipeline.fate import Failed, Fate
from consumer_kit.pipeline.running import HandlerRunner, Stores, commit_span, span, usable
from consumer_kit.pipeline.spec import HandlerSpec, session_request
from consumer_kit.pipeline.work import PROCESSED, Work
from consumer_kit.redaction import describe, redact
from consumer_kit.settings import Settings
from consumer_kit.store import Executor
from consumer_kit.store.receipts import Creation


class LeasedPath:
    """Runs deliveries of handlers without ``single_transaction``."""

    def __init__(self, stores: Stores, fate: Fate, runner: HandlerRunner, settings: Settings,
                 coordinator: Coordinator | None, step: SessionStep | None) -> None:
        self.stores = stores
        self.fate = fate
        self.runner = runner
        self.settings = settings
        self.coordinator = coordinator
        self.step = step
        self._requests: dict[str, tuple[HandlerSpec, SessionRequest, str]] = {}
        # On PostgreSQL the claim statement answers a duplicate by itself, but a plain read does it at
        # a quarter of the server's time: read first while duplicates are common (see DuplicateShare).
        self._duplicates = DuplicateShare(0.25)
        self._heartbeats = Heartbeats(settings.heartbeat_seconds, self._renew)

    async def run(self, work: Work) -> Result:
        """Claim, open the session, run the handler's attempts and settle."""
        self._heartbeats.add(work)
        try:
            return await self._run(work)
        except asyncio.CancelledError:
            claim = work.claim
            if claim is not None and claim.lease_token is not None:
                # Shielded: a second cancellation must not keep the lease from being given back.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._release(work, "cancelled", work.connection, aside=True))
            raise
        finally:
            self._heartbeats.remove(work)

    async def _run(self, work: Work) -> Result:
        spec = work.spec
        read_first = self._duplicates.read_first(spec.consumer)
        if read_first and self.stores.database.can.shared_reads:  # a duplicate then takes no connection of its own
            settled, read_first = await self.fate.looked_up(work, self._duplicates)
            if settled is not None:
                return settled
        # One connection from the claim to the commit; one that serves ctx.db when the handler may
        # use it (SQLAlchemy's, on asyncpg), else the store pool's.
        async with self.stores.database.connect(session=spec.uses_db) as ex:
            work.connection = ex
            settled = await self._claim(ex, work, read_first)
            if settled is not None:
                return settled
            return await self._handle(ex, work)

    async def _claim(self, ex: Executor, work: Work, read_first: bool) -> Result | None:
        """Claim the key and open the session; the settlement when the delivery ends here."""
        spec, stores = work.spec, self.stores
        creation, invalid = self._prepare_session(work)
        with span(work, "claim"):
            claim = await stores.inbox.claim(ex, spec.consumer, work.digests, work.fingerprint,
                                             namespace=work.key.namespace, version=work.key.version,
                                             creation=creation, read_first=read_first)
        self._duplicates.count(spec.consumer, taken=not claim.acquired)
        if not claim.acquired:
            return await self.fate.not_acquired(work, claim, ex)
        work.claim = claim
        if claim.took_over:
            metrics.LEASE_TAKEOVERS.labels(spec.source.name).inc()
        if invalid is not None:
            return await self.fate.dead(work, "invalid_session_request", invalid, ex)
        if spec.wants_session and self.coordinator is not None:
            return await self._open_session(ex, work, creation)
        return None

    async def _handle(self, ex: Executor, work: Work) -> Result:
        """The handler's attempts on ``ex``, and their settlement."""
        outcome = await self.fate.attempts(work, ex, lambda: self._attempt(ex, work))
        if isinstance(outcome, Failed):
            return await self.fate.failed(work, outcome.error, ex,
                                          give_back=lambda detail: self._release(work, detail, ex))
        if work.receipt is not None and self.step is None:
            await self._end_session(work)
        work.log(logging.DEBUG, "delivery processed")
        return Result(Outcome.PROCESSED, Settlement.ACK, key_digest=work.digest)

    async def _attempt(self, ex: Executor, work: Work) -> None:
        stores, claim, step, receipt = self.stores, work.claim, self.step, work.receipt
        assert claim is not None and claim.lease_token is not None
        with commit_span(work) as committing:
            async with ex.begin(deferred=True):
                await self.runner.run(ex, work)
                committing()
                ending = step.ending(receipt.session_id) if step is not None and receipt is not None else None
                if not await stores.inbox.complete(ex, work.spec.consumer, claim.digest, claim.lease_token,
                                                   outcome=PROCESSED, ending=ending):
                    raise LeaseLost()
                if step is not None and receipt is not None and ending is not None:
                    if not await step.end(ex, ending, receipt.session_id):
                        work.log(logging.WARNING, "the coordinator session to end was not found")

    def _prepare_session(self, work: Work) -> tuple[Creation | None, str | None]:
        """The handler's session request (and, with a step, its creation to be carried by the claim); or
        why the request is invalid (a ``task`` callable that returned what no session can carry)."""
        spec = work.spec
        if not spec.wants_session or self.coordinator is None:
            return None, None
        try:
            if callable(spec.task):
                work.request, request_fingerprint = session_request(spec, work.delivery, self.settings), None
            else:
                work.request, request_fingerprint = self._static_request(spec, work)
        except ValidationError as exc:  # the task this delivery gave is not one (too long, not text)
            return None, redact(f"the session request is invalid: {exc.errors(include_input=False)}",
                                work.key)[:500]
        if self.step is None:
            return None, None
        return self.step.prepare(work.request, idempotency_key=work.key.derive("session"),
                                 request_fingerprint=request_fingerprint), None

    def _static_request(self, spec: HandlerSpec, work: Work) -> tuple[SessionRequest, str]:
        """Labels and a fixed task: the same request (and fingerprint) for every delivery, built once."""
        cached = self._requests.get(spec.consumer)
        if cached is None or cached[0] is not spec:
            request = session_request(spec, work.delivery, self.settings)
            cached = self._requests[spec.consumer] = (spec, request, request_digest("session", request))
        return cached[1], cached[2]

    async def _open_session(self, ex: Executor, work: Work, creation: Creation | None) -> Result | None:
        """The coordinator step, after the claim: the session is created (or replayed: a replay of an
        active session still runs the handler) into ``work.receipt``; or the delivery's
        settlement: parked on a conflict or an inactive result, handed back (lease released) when the
        coordinator is unavailable past its own retry budget or at the receipt cap."""
        assert self.coordinator is not None and work.request is not None
        key = work.key.derive("session")
        try:
            with span(work, "coordinator.session"):
                if self.step is not None:
                    carried = (creation, work.claim.carried) if creation is not None and work.claim is not None \
                        and work.claim.carried is not None else None
                    work.receipt = await self.step.open(ex, work.request, idempotency_key=key, carried=carried)
                else:
                    work.receipt = await self.coordinator.create_session(work.request, idempotency_key=key)
            return None
        except IdempotencyKeyConflict as exc:
            return await self.fate.dead(work, exc.reason, describe(exc, work.key), ex, Outcome.CONFLICT)
        except IdempotencyResultInactive as exc:
            return await self.fate.dead(work, exc.reason, describe(exc, work.key), ex, Outcome.INACTIVE)
        except TerminalError as exc:
            return await self.fate.dead(work, exc.reason, describe(exc, work.key), ex)
        except Exception as exc:
            return await self.fate.failed(work, exc, ex, give_back=lambda detail: self._release(work, detail, ex))

    async def _end_session(self, work: Work) -> None:
        """End the session after the handler's transaction committed (a coordinator elsewhere); a
        failure only logs: the session then ends at its TTL, and the delivery is done either way."""
        assert self.coordinator is not None and work.receipt is not None
        receipt: SessionReceipt = work.receipt
        try:
            with span(work, "coordinator.end_session"):
                await self.coordinator.end_session(receipt.session_id)
        except Exception as exc:
            work.log(logging.WARNING, f"ending the coordinator session failed ({type(exc).__name__})")

    async def _release(self, work: Work, error: str, ex: Executor | None, *, aside: bool = False) -> None:
        """Give the lease back, on ``ex`` (the delivery's connection), or on a connection aside when
        told so or when ``ex`` was lost."""
        claim = work.claim
        assert claim is not None and claim.lease_token is not None
        async with (self.stores.database.aside(ex) if aside else usable(self.stores.database, ex)) as on:
            await self.stores.inbox.release(on, work.spec.consumer, claim.digest, claim.lease_token, error=error)

    async def _renew(self, work: Work) -> None:
        """The heartbeat: renew the lease every interval while the delivery holds it (on a connection
        of its own: the delivery's is busy in its transaction)."""
        stores, claim = self.stores, work.claim
        if claim is None or claim.lease_token is None:
            return  # not (yet) ours
        token = claim.lease_token
        interval = self.settings.heartbeat_seconds
        while True:
            try:
                async with stores.database.aside(work.connection) as ex:
                    if not await stores.inbox.renew(ex, work.spec.consumer, claim.digest, token):
                        return  # taken over; the completion will fail and roll back
            except Exception as exc:  # the next beat may get through before the lease runs out
                work.log(logging.WARNING, f"lease renewal failed: {type(exc).__name__}")
            await asyncio.sleep(interval)


class Heartbeats:
    """The lease upkeep of the deliveries in flight: a delivery's renewal task (``beat``) starts once it
    has run for half to one renewal interval, never later than one. One timer serves them all, ticking
    every half interval while any delivery is in flight: the common short handler costs two dict
    operations, not a timer of its own in the event loop's heap (that was ~3% of a delivery's Python).

    A delivery added between two ticks is "young" until the next tick, "old" until the one after it,
    and then its task starts."""

    def __init__(self, interval: float, beat: Callable[[Work], Awaitable[None]]) -> None:
        self._half = interval / 2
        self._beat = beat
        self._young: dict[int, Work] = {}  # by id(): a Work is not hashable
        self._old: dict[int, Work] = {}
        self._beating: dict[int, asyncio.Task[None]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, work: Work) -> None:
        """Count ``work`` in flight from now."""
        self._young[id(work)] = work
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._half, self._tick)

    def remove(self, work: Work) -> None:
        """``work`` is over: forget it, and stop its renewals if they started."""
        key = id(work)
        if self._young.pop(key, None) is None and self._old.pop(key, None) is None:
            task = self._beating.pop(key, None)
            if task is not None:
                task.cancel()

    def _tick(self) -> None:
        old, self._old, self._young = self._old, self._young, {}
        self._timer = asyncio.get_running_loop().call_later(self._half, self._tick) if self._old else None
        for key, work in old.items():
            self._beating[key] = asyncio.ensure_future(self._beat(work))
