"""The per-delivery algorithm (DESIGN.md), source-agnostic.

::

    key   = source.key(delivery)            no stable id / invalid key -> park, INVALID
    claim = inbox.claim(consumer, key, fp)  txn 1, committed at once (seed 003)
      completed   -> ACK, DUPLICATE         live lease -> RETRY_LATER, IN_PROGRESS
      conflict    -> park, CONFLICT         new / expired lease -> we hold the lease
    handler(ctx)  in txn 2, which also completes the inbox row WHERE lease_token = ours
      lease lost  -> roll back, LEASE_LOST  raised -> see _failed()
    ACK, PROCESSED

Between claim and handler, handlers that describe a session (``labels`` or ``task``) get one from
the coordinator under ``key.derive("session")`` (see ``_open_session``). It ends with the handler's
transaction: inside it when the coordinator is embedded on the inbox's database (so it ends if and
only if the effect commits), after the commit otherwise.

Fate is mapped to settlement in this module only: ``TerminalError`` parks at once, anything else is
retried in process within a budget, then handed back to the source (RETRY_LATER) until
``max_deliveries`` is reached, when the delivery is parked "retries_exhausted".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from consumer_kit import metrics
from consumer_kit.context import Context
from consumer_kit.coordinator.embedded import EmbeddedCoordinator, PreparedSession
from consumer_kit.coordinator.protocol import Coordinator, SessionReceipt, SessionRequest
from consumer_kit.coordinator.protocol import fingerprint as request_digest
from consumer_kit.delivery import Delivery, Outcome, Result, Settlement, Source
from consumer_kit.errors import (
    IdempotencyKeyConflict,
    IdempotencyResultInactive,
    InvalidKey,
    LeaseLost,
    MissingStableId,
    RetryableError,
    TerminalError,
)
from consumer_kit.keys import KeyDigester, OperationKey, short
from consumer_kit.settings import Settings
from consumer_kit.store import Claim, ClaimStatus, DeadLetters, Inbox, OutboxWriter
from consumer_kit.store.database import DEFERRED
from consumer_kit.store.inbox import verdict
from consumer_kit.store.pglane import PgLane, Rider

log = logging.getLogger("consumer_kit.pipeline")

Handler = Callable[[Context], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """A handler bound to its source, as ``@app.handler`` registered it."""

    func: Handler
    source: Source
    consumer: str  # the inbox scope; keep it stable across deploys
    single_transaction: bool = False
    max_deliveries: int | None = None
    labels: tuple[str, ...] = ()
    task: Callable[[Delivery], str] | str | None = None
    driver: str = "sqlalchemy"  # or "asyncpg": ctx.connection instead of ctx.db (PostgreSQL only)


class Pipeline:
    """Runs deliveries through claim, handler and completion; returns the settlement to carry out."""

    def __init__(
        self,
        *,
        settings: Settings,
        inbox: Inbox,
        dead_letters: DeadLetters,
        digester: KeyDigester,
        http: httpx.AsyncClient | None = None,
        coordinator: Coordinator | None = None,
    ) -> None:
        self.settings = settings
        self.inbox = inbox
        self.dead_letters = dead_letters
        self.digester = digester
        self.http = http
        self._sqlite = inbox.engine.dialect.name == "sqlite"
        self.coordinator = coordinator
        # An embedded coordinator on the inbox's database ends the session inside the handler's
        # transaction: it ends if and only if the delivery's effect commits. Any other is told after.
        self._ends_in_transaction = isinstance(coordinator, EmbeddedCoordinator) and \
            coordinator.shares_database(inbox.engine)
        self._metrics: dict[str, metrics.SourceMetrics] = {}
        self._requests: dict[str, tuple[HandlerSpec, SessionRequest, str]] = {}

    async def process(self, spec: HandlerSpec, delivery: Delivery) -> Result:
        """Decide one delivery's fate; never raises except on cancellation."""
        source = spec.source.name
        counters = self._metrics.get(source)
        if counters is None:
            counters = self._metrics[source] = metrics.SourceMetrics(source)
        counters.in_flight += 1
        try:
            result = await self._process(spec, delivery)
        except asyncio.CancelledError:
            counters.delivered("cancelled")
            raise
        except Exception as exc:  # the store failed: nothing was decided, so try the delivery again
            log.error("delivery failed before settlement (%s); retrying later", _describe(exc, None),
                      extra={"source": source})
            result = Result(Outcome.RETRY, Settlement.RETRY_LATER, "store_error",
                            delay=self.settings.retry_later_seconds)
        finally:
            counters.in_flight -= 1
        counters.delivered(result.outcome.value)
        return result

    async def _process(self, spec: HandlerSpec, delivery: Delivery) -> Result:
        try:
            key = spec.source.key(delivery)
        except (MissingStableId, InvalidKey) as exc:
            await self._park(spec, delivery, None, exc.reason, str(exc), attempts=delivery.attempt)
            return Result(Outcome.INVALID, Settlement.DEAD_LETTER, exc.reason)
        digests = self.digester.candidates(key)
        fingerprint = delivery.fingerprint()
        if spec.single_transaction:
            return await self._single_transaction(spec, delivery, key, digests, fingerprint)

        if spec.driver == "asyncpg":
            # The claim and the handler's transaction on one lane connection: one pool checkout per
            # delivery. Nothing between them takes a second lane connection (the coordinator step is
            # handed this one; the rest of the store uses SQLAlchemy's pool), so a full lane cannot
            # leave every holder waiting for another. It is held through the in-process retry backoff
            # too (RETRY_BACKOFF_MAX_SECONDS at most per attempt), as the transaction holds it through
            # the handler.
            assert self.inbox.lane is not None, "driver='asyncpg' is checked against the database at start"
            async with self.inbox.lane.connection() as raw:
                return await self._two_transactions(spec, delivery, key, digests, fingerprint, raw)
        return await self._two_transactions(spec, delivery, key, digests, fingerprint, None)

    async def _two_transactions(self, spec: HandlerSpec, delivery: Delivery, key: OperationKey,
                                digests: Sequence[str], fingerprint: str, raw: Any) -> Result:
        prepared = self._prepare_session(spec, delivery, key) if self._ends_in_transaction else None
        claim = await self.inbox.claim(spec.consumer, digests, fingerprint, namespace=key.namespace,
                                       version=key.version, rider=None if prepared is None else prepared.rider,
                                       conn=raw)
        if not claim.acquired:
            return await self._not_acquired(spec, delivery, key, claim)
        if claim.attempts > 1:
            metrics.LEASE_TAKEOVERS.labels(spec.source.name).inc()
        return await self._run_leased(spec, delivery, key, claim, prepared, raw)

    async def _not_acquired(self, spec: HandlerSpec, delivery: Delivery, key: OperationKey,
                            claim: Claim) -> Result:
        digest = short(claim.digest)
        if claim.status is ClaimStatus.COMPLETED:
            _log(logging.DEBUG, "duplicate delivery acknowledged", key, digest)
            return Result(Outcome.DUPLICATE, Settlement.ACK, key_digest=digest)
        if claim.status is ClaimStatus.DEAD:
            _log(logging.INFO, "delivery of a parked key acknowledged", key, digest)
            return Result(Outcome.DUPLICATE, Settlement.ACK, "already_dead_lettered", key_digest=digest)
        if claim.status is ClaimStatus.CONFLICT:
            _log(logging.WARNING, "same key, different request: parked as conflict", key, digest)
            await self._park(spec, delivery, claim.digest, "conflict",
                             "the key was first used with a different request", attempts=delivery.attempt)
            return Result(Outcome.CONFLICT, Settlement.DEAD_LETTER, "conflict", key_digest=digest)
        _log(logging.DEBUG, "delivery in progress elsewhere", key, digest)
        delay = self.settings.retry_later_seconds
        if claim.locked_until is not None:
            delay = max(0.0, (claim.locked_until - self.inbox.clock()).total_seconds())
        return Result(Outcome.IN_PROGRESS, Settlement.RETRY_LATER, "in_progress", delay=delay, key_digest=digest)

    async def _run_leased(self, spec: HandlerSpec, delivery: Delivery, key: OperationKey,
                          claim: Claim, prepared: PreparedSession | None, raw: Any) -> Result:
        assert claim.lease_token is not None
        token = claim.lease_token
        digest = short(claim.digest)
        heartbeat = _Heartbeat(self.settings.heartbeat_seconds,
                               lambda: self._heartbeat(spec.consumer, claim.digest, token))
        started = time.perf_counter()
        try:
            receipt = await self._open_session(spec, delivery, key, claim, prepared, raw)
            if isinstance(receipt, Result):
                return receipt
            for attempt in range(1, self.settings.retry_attempts + 1):
                try:
                    await self._run_handler(spec, key, delivery, claim, receipt=receipt, held=raw)
                    if not self._ends_in_transaction:
                        await self._end_session(receipt, key, digest)
                    _log(logging.DEBUG, "delivery processed", key, digest)
                    return Result(Outcome.PROCESSED, Settlement.ACK, key_digest=digest)
                except LeaseLost:
                    _log(logging.WARNING, "lease lost to another attempt; writes rolled back", key, digest)
                    return Result(Outcome.LEASE_LOST, Settlement.RETRY_LATER, "lease_lost",
                                  delay=self.settings.retry_later_seconds, key_digest=digest)
                except TerminalError as exc:
                    return await self._dead(spec, delivery, key, claim, exc.reason, _describe(exc, key))
                except Exception as exc:
                    if isinstance(exc, RetryableError) and exc.delay is not None:
                        return await self._retry_later(spec, delivery, key, claim, exc, exc.delay)
                    if attempt == self.settings.retry_attempts:
                        return await self._retry_later(spec, delivery, key, claim, exc, None)
                    _log(logging.INFO, f"handler failed, attempt {attempt}; retrying in process "
                         f"({_describe(exc, key)})", key, digest)
                    await asyncio.sleep(self._backoff(attempt))
            raise AssertionError("unreachable")
        except asyncio.CancelledError:
            # Shutdown ran out of grace: give the lease back so a redelivery need not wait it out.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.inbox.release(spec.consumer, claim.digest, token,
                                                        error="cancelled"))
            raise
        finally:
            heartbeat.cancel()
            self._metrics[spec.source.name].handler_seconds.observe(time.perf_counter() - started)

    def _prepare_session(self, spec: HandlerSpec, delivery: Delivery,
                         key: OperationKey) -> PreparedSession | None:
        """The session creation, prepared to ride on the claim (embedded coordinator on the inbox's
        database): it then commits with the claim, one round trip and one commit fewer. ``None`` when
        the handler wants no session or the creation cannot ride; :meth:`_open_session` then creates
        it on its own, and reports any error (a failing ``task`` callable, say) there."""
        if not (spec.labels or spec.task):
            return None
        assert isinstance(self.coordinator, EmbeddedCoordinator)
        try:
            if callable(spec.task):
                request, request_fingerprint = session_request(spec, delivery, self.settings), None
            else:
                request, request_fingerprint = self._static_request(spec, delivery)
            return self.coordinator.prepare_session(request, idempotency_key=key.derive("session"),
                                                    request_fingerprint=request_fingerprint)
        except Exception:
            return None

    def _session_request(self, spec: HandlerSpec, delivery: Delivery) -> SessionRequest:
        if callable(spec.task):
            return session_request(spec, delivery, self.settings)
        return self._static_request(spec, delivery)[0]

    def _static_request(self, spec: HandlerSpec, delivery: Delivery) -> tuple[SessionRequest, str]:
        """Labels and a fixed task: the same request (and fingerprint) for every delivery, built once."""
        cached = self._requests.get(spec.consumer)
        if cached is None or cached[0] is not spec:
            request = session_request(spec, delivery, self.settings)
            cached = self._requests[spec.consumer] = (spec, request, request_digest("session", request))
        return cached[1], cached[2]

    async def _open_session(self, spec: HandlerSpec, delivery: Delivery, key: OperationKey,
                            claim: Claim, prepared: PreparedSession | None,
                            raw: Any) -> SessionReceipt | Result | None:
        """The coordinator step: create (or replay) the handler's session under ``key.derive("session")``.

        Created or replayed -> the receipt (a replay of an active session still runs the handler, seed
        000). Conflict or inactive -> parked with that reason. Unavailable past the coordinator's own
        retry budget, or at the receipt cap -> RETRY_LATER with the lease released. ``None`` when no
        coordinator is configured or the handler describes no session (no labels, no task).
        ``prepared``: the creation rode on the claim (see :meth:`_prepare_session`); ``raw``: the lane
        connection the delivery holds, if any.
        """
        if self.coordinator is None or not (spec.labels or spec.task):
            return None
        try:
            if prepared is not None:
                assert isinstance(self.coordinator, EmbeddedCoordinator)
                return await self.coordinator.create_prepared(prepared, driver=raw)
            try:
                request = self._session_request(spec, delivery)
            except ValidationError as exc:  # the task this delivery gave is not one (too long, not text)
                detail = redact(f"the session request is invalid: {exc.errors(include_input=False)}", key)[:500]
                return await self._dead(spec, delivery, key, claim, "invalid_session_request", detail)
            return await self.coordinator.create_session(request, idempotency_key=key.derive("session"))
        except (IdempotencyKeyConflict, IdempotencyResultInactive) as exc:
            result = await self._dead(spec, delivery, key, claim, exc.reason, _describe(exc, key))
            conflict = isinstance(exc, IdempotencyKeyConflict)
            return replace(result, outcome=Outcome.CONFLICT if conflict else Outcome.INACTIVE)
        except TerminalError as exc:
            return await self._dead(spec, delivery, key, claim, exc.reason, _describe(exc, key))
        except Exception as exc:
            delay = exc.delay if isinstance(exc, RetryableError) else None
            return await self._retry_later(spec, delivery, key, claim, exc, delay)

    async def _end_session(self, receipt: SessionReceipt | None, key: OperationKey, digest: str) -> None:
        """End the session after the handler's transaction committed; a failure only logs (the session
        then ends at its TTL, and the delivery is done either way)."""
        if receipt is None or self.coordinator is None:
            return
        try:
            await self.coordinator.end_session(receipt.session_id)
        except Exception as exc:
            _log(logging.WARNING, f"ending the coordinator session failed ({type(exc).__name__})", key, digest)

    def _ending(self, receipt: SessionReceipt | None) -> Rider | None:
        """The session's ending, to ride on the inbox's completion when it ends in the transaction."""
        if receipt is None or not self._ends_in_transaction:
            return None
        assert isinstance(self.coordinator, EmbeddedCoordinator)
        return self.coordinator.ending(receipt.session_id)

    async def _end_in_transaction(self, receipt: SessionReceipt, ending: Rider, key: OperationKey, claim: Claim,
                                  *, conn: AsyncConnection | None = None, raw: Any = None) -> None:
        """Make sure the session ended in this transaction: the completion carried ``ending``, or (no
        lane, the single-transaction path) it is ended here."""
        assert isinstance(self.coordinator, EmbeddedCoordinator)
        if ending.row is None and raw is None and conn is not None and self.inbox.lane is not None:
            raw = await PgLane.driver(conn)  # one asyncpg statement instead of SQLAlchemy's two
        if not await self.coordinator.ended_in(ending, receipt.session_id, conn=None if raw is not None else conn,
                                               driver=raw):
            _log(logging.WARNING, "the coordinator session to end was not found", key, short(claim.digest))

    async def _single_transaction(self, spec: HandlerSpec, delivery: Delivery, key: OperationKey,
                                  digests: list[str] | Any, fingerprint: str) -> Result:
        """Claim, effect and completion in one commit; only for handlers that touch nothing but the
        database, since a handler that calls out would repeat its call after a rollback."""
        started = time.perf_counter()
        # A replay is answered by one plain read: without it, a duplicate would open a transaction,
        # lose the insert race and lock the row only to learn that it is done.
        # (On the asyncpg driver the in-transaction claim costs a replay no lock either, so new
        # deliveries are spared the read.)
        if spec.driver != "asyncpg" or len(digests) > 1:
            existing = await self.inbox.lookup(spec.consumer, digests)
            if existing is not None and (existing["state"] != "started" or existing["fingerprint"] != fingerprint):
                return await self._not_acquired(spec, delivery, key, verdict(existing, fingerprint))
        error: BaseException | None = None
        for attempt in range(1, self.settings.retry_attempts + 1):
            try:
                claim = await self._run_handler(spec, key, delivery, None, single=(digests, fingerprint))
                self._metrics[spec.source.name].handler_seconds.observe(time.perf_counter() - started)
                return Result(Outcome.PROCESSED, Settlement.ACK, key_digest=short(claim.digest))
            except _NotAcquired as not_acquired:
                return await self._not_acquired(spec, delivery, key, not_acquired.claim)
            except TerminalError as exc:
                error = exc
                break
            except Exception as exc:
                error = exc
                if (isinstance(exc, RetryableError) and exc.delay is not None) or \
                        attempt == self.settings.retry_attempts:
                    break
                await asyncio.sleep(self._backoff(attempt))
        assert error is not None
        detail = _describe(error, key)
        attempts = await self.inbox.record_failure(spec.consumer, digests, fingerprint, namespace=key.namespace,
                                                   version=key.version, error=detail)
        claim = Claim(ClaimStatus.ACQUIRED, digests[0], max(attempts, delivery.attempt))
        if isinstance(error, TerminalError):
            return await self._dead(spec, delivery, key, claim, error.reason, detail)
        delay = error.delay if isinstance(error, RetryableError) else None
        return await self._retry_later(spec, delivery, key, claim, error, delay, released=True)

    async def _retry_later(self, spec: HandlerSpec, delivery: Delivery, key: OperationKey, claim: Claim,
                           exc: BaseException, delay: float | None, *, released: bool = False) -> Result:
        detail = _describe(exc, key)
        limit = spec.max_deliveries or self.settings.max_deliveries
        if max(claim.attempts, delivery.attempt) >= limit:
            return await self._dead(spec, delivery, key, claim, "retries_exhausted", detail)
        if not released:
            assert claim.lease_token is not None
            await self.inbox.release(spec.consumer, claim.digest, claim.lease_token, error=detail)
        _log(logging.WARNING, f"handler failed; delivery {claim.attempts} of {limit} will be retried "
             f"({detail})", key, short(claim.digest))
        return Result(Outcome.RETRY, Settlement.RETRY_LATER, "handler_failed",
                      delay=self.settings.retry_later_seconds if delay is None else delay,
                      key_digest=short(claim.digest))

    async def _dead(self, spec: HandlerSpec, delivery: Delivery, key: OperationKey, claim: Claim,
                    reason: str, detail: str) -> Result:
        async with self.inbox.engine.begin() as conn:
            await self.inbox.mark_dead(spec.consumer, claim.digest, claim.lease_token, reason=reason, conn=conn)
            await self._park(spec, delivery, claim.digest, reason, detail, attempts=claim.attempts, conn=conn)
        _log(logging.WARNING, f"delivery parked: {reason} ({detail})", key, short(claim.digest))
        return Result(Outcome.DEAD_LETTERED, Settlement.DEAD_LETTER, reason, key_digest=short(claim.digest))

    async def _park(self, spec: HandlerSpec, delivery: Delivery, digest: str | None, reason: str,
                    detail: str, *, attempts: int, conn: AsyncConnection | None = None) -> None:
        await self.dead_letters.park(
            consumer=spec.consumer, source=spec.source.name, namespace=spec.source.namespace,
            version=spec.source.version, key_digest=digest, reason=reason, detail=detail,
            body=delivery.body, headers=delivery.headers, attempts=attempts, conn=conn,
        )
        metrics.DEAD_LETTERS.labels(spec.source.name, reason).inc()
        if digest is None:
            log.warning("delivery parked: %s (%s)", reason, detail,
                        extra={"namespace": spec.source.namespace, "source": spec.source.name})

    async def _run_handler(
        self, spec: HandlerSpec, key: OperationKey, delivery: Delivery, claim: Claim | None, *,
        receipt: SessionReceipt | None = None, single: tuple[Sequence[str], str] | None = None,
        held: Any = None,
    ) -> Claim:
        """Run the handler in one transaction that also completes the inbox row, and commit it.

        Two-transaction path: ``claim`` holds the lease; completion is ``WHERE lease_token = ours``
        (LeaseLost otherwise). Single-transaction path (``single`` = digests, fingerprint): the claim is
        made inside the same transaction (_NotAcquired when it is not ours). A handler's exception
        rolls everything back and propagates. ``held``: the lane connection the delivery already
        holds (``driver="asyncpg"``); otherwise one is checked out for the transaction.
        """
        processed = Outcome.PROCESSED.value
        if spec.driver == "asyncpg":
            lane = self.inbox.lane
            assert lane is not None, "driver='asyncpg' is checked against the database at start"
            async with (contextlib.nullcontext(held) if held is not None else lane.connection()) as raw, \
                    raw.transaction():
                if single is not None:
                    claim = await self.inbox.claim_on(raw, spec.consumer, single[0][0], single[1],
                                                      namespace=key.namespace, version=key.version,
                                                      outcome=processed)
                    if not claim.acquired:
                        raise _NotAcquired(claim)
                assert claim is not None
                ctx = self._context(spec, key, delivery, _ASYNCPG_ONLY, claim, connection=raw)
                ctx.session = receipt
                await spec.func(ctx)
                await ctx.outbox.flush(raw)
                await self._finish(spec, key, claim, receipt, leased=single is None, raw=raw)
            return claim
        async with self._transaction() as (conn, session):
            if single is not None:
                claim = await self.inbox.claim_in(conn, spec.consumer, single[0], single[1],
                                                  namespace=key.namespace, version=key.version, outcome=processed)
                if not claim.acquired:
                    raise _NotAcquired(claim)
            assert claim is not None
            ctx = self._context(spec, key, delivery, session, claim)
            ctx.session = receipt
            await spec.func(ctx)
            await ctx.outbox.flush()
            if session.new or session.dirty or session.deleted:  # ORM objects to write
                await session.flush()
            await self._finish(spec, key, claim, receipt, leased=single is None, conn=conn)
        return claim

    async def _finish(self, spec: HandlerSpec, key: OperationKey, claim: Claim, receipt: SessionReceipt | None,
                      *, leased: bool, conn: AsyncConnection | None = None, raw: Any = None) -> None:
        """The end of the handler's transaction: complete the inbox row if this attempt holds its
        lease (``leased``; LeaseLost otherwise) and end the session with it, on ``raw`` (a lane
        connection) or ``conn``."""
        ending = self._ending(receipt)
        if leased:
            assert claim.lease_token is not None
            processed = Outcome.PROCESSED.value
            if raw is not None:
                done = await self.inbox.complete_on(raw, spec.consumer, claim.digest, claim.lease_token,
                                                    outcome=processed, rider=ending)
            else:
                assert conn is not None
                done = await self.inbox.complete(conn, spec.consumer, claim.digest, claim.lease_token,
                                                 outcome=processed, rider=ending)
            if not done:
                raise LeaseLost()
        if ending is not None and receipt is not None:
            await self._end_in_transaction(receipt, ending, key, claim, conn=conn, raw=raw)

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[tuple[AsyncConnection, AsyncSession]]:
        async with self.inbox.engine.connect() as conn:
            if self._sqlite:
                await conn.execution_options(**{DEFERRED: True})
            async with conn.begin():
                # The session joins the connection's transaction: a handler's commit() cannot end it.
                session = AsyncSession(bind=conn, expire_on_commit=False)
                try:
                    yield conn, session
                finally:
                    await session.close()

    def _context(self, spec: HandlerSpec, key: OperationKey, delivery: Delivery, session: AsyncSession,
                 claim: Claim, *, connection: Any = None) -> Context:
        outbox = OutboxWriter(None if connection is not None else session, self.digester, spec.consumer, key,
                              clock=self.inbox.clock)
        return Context(key=key, delivery=delivery, db=session, attempt=max(claim.attempts, delivery.attempt),
                       key_digest=short(claim.digest), outbox=outbox, http=self.http, connection=connection)

    async def _heartbeat(self, consumer: str, digest: str, token: str) -> None:
        interval = self.settings.heartbeat_seconds
        while True:
            try:
                if not await self.inbox.renew(consumer, digest, token):
                    return  # taken over; completion will fail and roll back
            except Exception as exc:  # the next beat may get through before the lease runs out
                log.warning("lease renewal failed: %s", type(exc).__name__)
            await asyncio.sleep(interval)

    def _backoff(self, attempt: int) -> float:
        base = self.settings.retry_backoff_seconds * 2 ** (attempt - 1)
        # Full jitter (AWS architecture blog): spreads retries of many consumers apart.
        return random.uniform(0, min(self.settings.retry_backoff_max_seconds, base))


class _Heartbeat:
    """Starts the lease-renewal task only once a handler has run for one renewal interval, so that
    the common short handler pays for a timer, not for a task."""

    def __init__(self, interval: float, beat: Callable[[], Awaitable[None]]) -> None:
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(interval, self._start, beat)

    def _start(self, beat: Callable[[], Awaitable[None]]) -> None:
        self._task = asyncio.ensure_future(beat())

    def cancel(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


def session_request(spec: HandlerSpec, delivery: Delivery, settings: Settings) -> SessionRequest:
    """The coordinator session a handler's delivery asks for: its labels, its task, the session TTL."""
    task = spec.task(delivery) if callable(spec.task) else spec.task
    return SessionRequest(labels=spec.labels, task=task, ttl_seconds=settings.coordinator_session_ttl_seconds)


class _AsyncpgOnly:
    """``ctx.db`` of a handler registered with ``driver="asyncpg"``: its transaction is on
    ``ctx.connection``, and a session would write outside it."""

    def __getattr__(self, name: str) -> Any:
        # A programming error no retry can fix: park the delivery with the reason.
        raise TerminalError("this handler was registered with driver='asyncpg': write through "
                            "ctx.connection, which is inside the delivery's transaction, not ctx.db",
                            reason="handler_misconfigured")


_ASYNCPG_ONLY: Any = _AsyncpgOnly()


class _NotAcquired(Exception):
    def __init__(self, claim: Claim) -> None:
        self.claim = claim


def _describe(exc: BaseException, key: OperationKey | None) -> str:
    """``Type: message`` of an exception, with the raw key redacted (user code may put it there)."""
    text = f"{type(exc).__name__}: {exc}"
    return redact(text, key)[:500]


def redact(text: str, key: OperationKey | None) -> str:
    """``text`` with the raw key and its id replaced by ``<key>``."""
    if key is None:
        return text
    text = text.replace(str(key), "<key>")
    # A short id (say "42") is no secret and would garble the text; longer ones are redacted too.
    return text.replace(key.id, "<key>") if len(key.id) >= 6 else text


def _log(level: int, message: str, key: OperationKey, digest: str) -> None:
    log.log(level, "%s [%s:v%d %s]", message, key.namespace, key.version, digest,
            extra={"namespace": key.namespace, "key_digest": digest})


def format_exception(exc: BaseException, key: OperationKey | None) -> str:
    """A traceback with the raw key redacted."""
    return redact("".join(traceback.format_exception(exc)), key)
