"""Retry classification and budgets for calls that cross the network: network errors, 5xx, 408, 425 and
429 are retried within a budget; other answers are final.

Network errors, 5xx, 408, 425 and 429 may pass and are retried; every other 4xx is an authorization
or validation failure that no retry can fix. A :class:`RetryBudget` bounds one logical call by a
number of attempts *and* a total time, waits with exponential backoff and full jitter, and honours a
server's ``Retry-After`` when the budget allows it.

Written here rather than taken from tenacity: what the wait should be depends on the response
(``Retry-After``), the stop rule mixes attempts with a deadline that a long ``Retry-After`` must not
overrun, and the caller needs the decision as data (retry in N seconds / give up) to keep one
idempotency key across attempts and to refresh a bearer between them. Expressed with tenacity that
is a custom ``wait``, ``stop`` and ``retry`` callable each, plus a dependency, for ~60 lines.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

RETRYABLE_STATUSES = frozenset({408, 425, 429})


def is_retryable_status(status: int) -> bool:
    """Whether an HTTP status may pass on retry: 408, 425, 429 and every 5xx."""
    return status in RETRYABLE_STATUSES or 500 <= status <= 599


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date); ``None`` if absent
    or unreadable. Negative waits count as zero."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How hard one logical call tries: ``attempts`` in all, within ``total_seconds``, waiting
    ``uniform(0, min(max_backoff, base * 2**(n-1)))`` after the n-th failure (full jitter)."""

    attempts: int = 5
    total_seconds: float = 10.0
    base_backoff: float = 0.1
    max_backoff: float = 2.0

    def budget(self) -> RetryBudget:
        """A fresh budget for one call."""
        return RetryBudget(self)


@dataclass(slots=True)
class RetryBudget:
    """The attempts and time left to one call. Call :meth:`next_delay` after each failed attempt."""

    policy: RetryPolicy
    clock: Callable[[], float] = time.monotonic
    rand: Callable[[float, float], float] = random.uniform
    attempt: int = 1
    started: float = field(default=-1.0)

    def __post_init__(self) -> None:
        if self.started < 0:
            self.started = self.clock()

    @property
    def remaining(self) -> float:
        """Seconds left of the total budget."""
        return self.policy.total_seconds - (self.clock() - self.started)

    def next_delay(self, retry_after: float | None = None) -> float | None:
        """How long to wait before the next attempt, or ``None`` when the budget is spent.

        A ``Retry-After`` longer than the jittered backoff wins; one that would overrun the total
        budget ends the call now instead of sleeping past the deadline.
        """
        if self.attempt >= self.policy.attempts:
            return None
        backoff = self.rand(0.0, min(self.policy.max_backoff, self.policy.base_backoff * 2 ** (self.attempt - 1)))
        delay = max(backoff, retry_after) if retry_after is not None else backoff
        if delay >= self.remaining:
            return None
        self.attempt += 1
        return delay


START_UP = RetryPolicy(attempts=5, total_seconds=10.0, base_backoff=0.4, max_backoff=3.2)
"""How a worker's start-up opens again a connection the other side ended while it was being set up
(the database's schema check, a RabbitMQ source's queues): five attempts within ten seconds."""
