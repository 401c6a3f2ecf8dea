"""What a claim of an inbox key found (:class:`Claim`), and how a committed row is read as one."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from consumer_kit.store.executor import Row

Clock = Callable[[], datetime]


def utcnow() -> datetime:
    """The default clock."""
    return datetime.now(UTC)


class ClaimStatus(enum.StrEnum):
    """What a claim found."""

    ACQUIRED = "acquired"  # new key, or an expired/released lease taken over: we hold the lease
    COMPLETED = "completed"  # done before: replay, do not run
    IN_PROGRESS = "in_progress"  # a live lease is held by another attempt
    CONFLICT = "conflict"  # same key, different fingerprint
    DEAD = "dead"  # parked before
    SWEPT = "swept"  # done or parked before, and its record swept since: only its tombstone is left


@dataclass(frozen=True, slots=True)
class Claim:
    """What :meth:`Inbox.claim` found. ``digest`` is the row's key digest (it may be the one written
    under the previous HMAC key); ``lease_token`` is set only when ``ACQUIRED`` on the leased path.
    ``carried`` is the row of a coordinator creation that rode on the claim (see :mod:`.receipts`)."""

    status: ClaimStatus
    digest: str
    attempts: int
    lease_token: str | None = None
    locked_until: datetime | None = None
    result: Any = None
    carried: Row | None = None
    took_over: bool = False  # the lease taken ran out without being given back (its holder died)

    @property
    def acquired(self) -> bool:
        """Whether this attempt holds the key."""
        return self.status is ClaimStatus.ACQUIRED


@dataclass(frozen=True, slots=True)
class BatchKey:
    """One key of a batch's claim."""

    digest: str
    namespace: str
    version: int
    fingerprint: str


_STATE_STATUS = {"completed": ClaimStatus.COMPLETED, "dead": ClaimStatus.DEAD}


def claimable(row: Mapping[str, Any], fingerprint: str, now: datetime) -> bool:
    """Whether a claim may take ``row``: started, for the same request, its lease run out or released."""
    return row["state"] == "started" and row["fingerprint"] == fingerprint and \
        (row["locked_until"] is None or row["locked_until"] <= now)


def verdict(row: Mapping[str, Any], fingerprint: str) -> Claim:
    """What a committed row says to an attempt that did not get (or did not try for) the key."""
    if row["fingerprint"] != fingerprint:
        status = ClaimStatus.CONFLICT
    else:  # a started row we could not take over holds a live lease
        status = _STATE_STATUS.get(row["state"], ClaimStatus.IN_PROGRESS)
    return Claim(status, row["key_digest"], int(row["attempts"]), result=row["result"],
                 locked_until=row["locked_until"])
