"""Fate: the one place where what happened to a delivery becomes what its source must do.

- a claim that did not take the key: done before -> ACK (duplicate); parked before -> ACK; another
  request under the key -> park "conflict"; held elsewhere -> RETRY_LATER when the lease runs out;
- the handler's attempts, in ONE retry loop: ``TerminalError`` parks at once; ``RetryableError(delay=)``
  hands the delivery back to the source after ``delay``; anything else is tried again in process
  (jittered exponential backoff, ``RETRY_ATTEMPTS`` in all), then handed back; once a key has been
  delivered ``MAX_DELIVERIES`` times it is parked "retries_exhausted";
- every failed attempt logs its traceback, raw key redacted (as a span records it) and bounded as a
  parked row keeps it, in the record that says what comes next: WARNING when it is retried, ERROR
  when it parks; a delivery parked by the exception keeps that traceback (``consumer-kit parked show``);
- a lost lease (another attempt took over) -> RETRY_LATER, this attempt's writes rolled back;
- a table or column that does not exist (SchemaMissing) -> RETRY_LATER without another attempt, its
  lease given back and its count of deliveries untouched, and the runner told (the worker stops): a
  deployment error, not the delivery's, so it is neither parked nor retried as a passing failure.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from consumer_kit import metrics
from consumer_kit.delivery import Delivery, Outcome, Result, Settlement
from consumer_kit.errors import ConfigurationError, LeaseLost, RetryableError, SchemaMissing, TerminalError
from consumer_kit.pipeline.duplicates import DuplicateShare
from consumer_kit.pipeline.running import Stores, span, usable
from consumer_kit.pipeline.spec import HandlerSpec
from consumer_kit.pipeline.work import Work, log
from consumer_kit.redaction import describe, format_exception
from consumer_kit.settings import Settings
from consumer_kit.store import Claim, ClaimStatus, Executor, claimable, verdict
from consumer_kit.store.dead_letters import bounded
from consumer_kit.store.diagnosis import missing_schema

T = TypeVar("T")


class NotAcquired(Exception):
    """The single-transaction claim found the key taken (done, parked, held or another request)."""

    def __init__(self, claim: Claim) -> None:
        self.claim = claim


@dataclass(frozen=True, slots=True)
class Failed:
    """The retry loop's answer when every attempt it may make has failed."""

    error: Exception


class Fate:
    """Maps outcomes to settlements (see the module docstring)."""

    def __init__(self, stores: Stores, settings: Settings,
                 on_fatal: Callable[[ConfigurationError], None] | None = None) -> None:
        """``on_fatal`` is told of a deployment error no delivery can get past (a missing table)."""
        self.stores = stores
        self.settings = settings
        self.on_fatal = on_fatal

    def fatal(self, error: ConfigurationError) -> None:
        """Report ``error`` to whoever runs the pipeline (the app stops), or log it when nobody listens."""
        if self.on_fatal is not None:
            self.on_fatal(error)
        else:
            log.error("%s", error)

    async def attempts(self, work: Work, ex: Executor, attempt: Callable[[], Awaitable[T]]) -> T | Failed:
        """The retry loop: ``attempt()`` on ``ex`` until it succeeds, or the failure that ends the loop
        (a connection lost on the way ends it too: the delivery goes back to its source)."""
        settings = self.settings
        for number in range(1, settings.retry_attempts + 1):
            try:
                return await attempt()
            except (LeaseLost, NotAcquired, TerminalError) as exc:
                return Failed(exc)
            except Exception as exc:
                schema = missing_schema(exc)
                if schema is not None:
                    return Failed(schema)
                if (isinstance(exc, RetryableError) and exc.delay is not None) or number == settings.retry_attempts \
                        or ex.discarded:
                    return Failed(exc)
                work.log(logging.WARNING, f"handler failed, attempt {number}; retrying in process "
                         f"({describe(exc, work.key)})", bounded(format_exception(exc, work.key)))
                await asyncio.sleep(self._backoff(number))
        raise AssertionError("unreachable")

    async def failed(self, work: Work, exc: Exception, ex: Executor | None,
                     give_back: Callable[[str], Awaitable[object]] | None = None) -> Result:
        """The settlement of a delivery whose attempts ended in ``exc``, written on ``ex`` (the
        delivery's connection, see :func:`usable`). ``give_back`` releases what the attempt held (the
        lease) before the delivery is handed back to its source."""
        if isinstance(exc, NotAcquired):
            return await self.not_acquired(work, exc.claim, ex)
        if isinstance(exc, LeaseLost):
            work.log(logging.WARNING, "lease lost to another attempt; writes rolled back")
            return Result(Outcome.LEASE_LOST, Settlement.RETRY_LATER, "lease_lost",
                          delay=self.settings.retry_later_seconds, key_digest=work.digest)
        detail = describe(exc, work.key)
        if isinstance(exc, SchemaMissing):
            if give_back is not None:
                await give_back(detail)
            self.fatal(exc)
            return Result(Outcome.RETRY, Settlement.RETRY_LATER, "schema_missing",
                          delay=self.settings.retry_later_seconds, key_digest=work.digest)
        traceback = bounded(format_exception(exc, work.key))
        if isinstance(exc, TerminalError):
            return await self.dead(work, exc.reason, detail, ex, traceback=traceback)
        limit = work.spec.max_deliveries or self.settings.max_deliveries
        if work.attempts >= limit:
            return await self.dead(work, "retries_exhausted", detail, ex, traceback=traceback)
        if give_back is not None:
            await give_back(detail)
        work.log(logging.WARNING, f"handler failed; delivery {work.attempts} of {limit} will be retried ({detail})",
                 traceback)
        delay = exc.delay if isinstance(exc, RetryableError) and exc.delay is not None else None
        return Result(Outcome.RETRY, Settlement.RETRY_LATER, "handler_failed",
                      delay=self.settings.retry_later_seconds if delay is None else delay, key_digest=work.digest)

    async def looked_up(self, work: Work, duplicates: DuplicateShare) -> tuple[Result | None, bool]:
        """Look the delivery's key up before it takes a connection (PostgreSQL's shared reads: see
        ``Inbox.look``): its settlement when the key is taken (done, parked, held, another request),
        else ``None`` and whether a row was found (a lease to take over, which the claim reads again)."""
        inbox, consumer = self.stores.inbox, work.spec.consumer
        with span(work, "claim"):
            existing = await inbox.look(consumer, work.digests)
        if existing is None or claimable(existing, work.fingerprint, inbox.clock()):
            return None, existing is not None
        duplicates.count(consumer, taken=True)
        return await self.not_acquired(work, verdict(existing, work.fingerprint), None), True

    async def not_acquired(self, work: Work, claim: Claim, ex: Executor | None) -> Result:
        """The settlement of a delivery whose claim found the key taken (a conflict is parked on ``ex``)."""
        work.claim = claim
        if claim.status is ClaimStatus.COMPLETED:
            work.log(logging.DEBUG, "duplicate delivery acknowledged")
            return Result(Outcome.DUPLICATE, Settlement.ACK, key_digest=work.digest)
        if claim.status is ClaimStatus.DEAD:
            work.log(logging.INFO, "delivery of a parked key acknowledged")
            return Result(Outcome.DUPLICATE, Settlement.ACK, "already_dead_lettered", key_digest=work.digest)
        if claim.status is ClaimStatus.SWEPT:  # only parked when the policy is park: else no tombstones
            late = await self.late(work, "its key was done before and its record swept since", ex)
            assert late is not None
            return late
        if claim.status is ClaimStatus.CONFLICT:
            work.log(logging.WARNING, "same key, different request: parked as conflict")
            await self.park(work.spec, work.delivery, claim.digest, "conflict",
                            "the key was first used with a different request", attempts=work.delivery.attempt, ex=ex)
            return Result(Outcome.CONFLICT, Settlement.DEAD_LETTER, "conflict", key_digest=work.digest)
        work.log(logging.DEBUG, "delivery in progress elsewhere")
        delay = self.settings.retry_later_seconds
        if claim.locked_until is not None:
            delay = max(0.0, (claim.locked_until - self.stores.inbox.clock()).total_seconds())
        return Result(Outcome.IN_PROGRESS, Settlement.RETRY_LATER, "in_progress", delay=delay,
                      key_digest=work.digest)

    async def late(self, work: Work, why: str, ex: Executor | None = None) -> Result | None:
        """A delivery that may repeat work whose record is gone: parked ``arrived_after_retention``
        (LATE_DELIVERY_POLICY=park), or ``None`` to process it (=process); counted either way."""
        source = work.spec.source.name
        if self.settings.late_delivery_policy == "process":
            metrics.LATE_DELIVERIES.labels(source, "processed").inc()
            work.log(logging.WARNING, f"late delivery processed: {why}")
            return None
        metrics.LATE_DELIVERIES.labels(source, "parked").inc()
        await self.park(work.spec, work.delivery, work.digests[0], "arrived_after_retention", why,
                        attempts=work.delivery.attempt, ex=ex)
        work.log(logging.WARNING, f"late delivery parked: {why}")
        return Result(Outcome.DEAD_LETTERED, Settlement.DEAD_LETTER, "arrived_after_retention",
                      key_digest=work.digest)

    async def dead(self, work: Work, reason: str, detail: str, ex: Executor | None,
                   outcome: Outcome = Outcome.DEAD_LETTERED, *, traceback: str | None = None) -> Result:
        """Park the delivery and its key, in one transaction on ``ex`` (see :func:`usable`); with the
        ``traceback`` (redacted) of the exception that parked it, logged at ERROR and kept with it."""
        claim = work.claim
        assert claim is not None
        stores = self.stores
        async with usable(stores.database, ex) as on, on.begin():
            await stores.inbox.mark_dead(on, work.spec.consumer, claim.digest, claim.lease_token, reason=reason)
            await self.park(work.spec, work.delivery, claim.digest, reason, detail, attempts=work.attempts, ex=on,
                            traceback=traceback)
        work.log(logging.WARNING if traceback is None else logging.ERROR, f"delivery parked: {reason} ({detail})",
                 traceback)
        return Result(outcome, Settlement.DEAD_LETTER, reason, key_digest=work.digest)

    async def park(self, spec: HandlerSpec, delivery: Delivery, digest: str | None, reason: str, detail: str,
                   *, attempts: int, ex: Executor | None, traceback: str | None = None) -> None:
        """Keep the delivery (raw body, headers, reason, the redacted ``traceback`` of what parked it)
        for an operator, on ``ex`` (see :func:`usable`); never drop it."""
        async with usable(self.stores.database, ex) as on:
            await self.stores.dead_letters.park(
                on, consumer=spec.consumer, source=spec.source.name, namespace=spec.source.namespace,
                version=spec.source.version, key_digest=digest, reason=reason, detail=detail,
                body=delivery.body, headers=delivery.headers, attempts=attempts,
                # The id only of a keyed delivery: its key was valid, so the id fits the column (an
                # invalid one may be longer, or hold a NUL PostgreSQL cannot store) and serves a replay.
                delivery_id=delivery.id if digest is not None else None, attributes=delivery.attributes,
                fingerprint=delivery.fingerprint(), traceback=traceback,
            )
        metrics.DEAD_LETTERS.labels(spec.source.name, reason).inc()
        if digest is None:
            log.warning("delivery parked: %s (%s)", reason, detail,
                        extra={"namespace": spec.source.namespace, "source": spec.source.name})

    def _backoff(self, attempt: int) -> float:
        base = self.settings.retry_backoff_seconds * 2 ** (attempt - 1)
        # Full jitter (AWS architecture blog): spreads retries of many consumers apart.
        return random.uniform(0, min(self.settings.retry_backoff_max_seconds, base))
