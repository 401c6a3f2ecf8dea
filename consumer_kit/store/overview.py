"""Bounded, read-only queries for an operator's view (the console, :mod:`consumer_kit.console`): parked
deliveries a page at a time, the groups they fall in, how many were parked each minute, live leases.

Every statement here has a ``LIMIT``: a page costs the same with a hundred parked deliveries or a
million. A group's pages are keyset pages (newest first, the next page starting after the last row
shown, on the index of migration 0008), never ``OFFSET``, which reads every row it skips. List rows
carry no body (a page of large bodies is a page of megabytes); one delivery's body is read by
:meth:`~consumer_kit.store.DeadLetters.get`. Keys appear as their digests only, as everywhere.

These statements are kept beside their only caller's store rather than in :mod:`.sql`, which holds the
statements of the delivery path.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from consumer_kit.store.connections import Database
from consumer_kit.store.dead_letters import ParkedGroup
from consumer_kit.store.executor import Row
from consumer_kit.store.sql import Statement

_ROW = ("id, consumer, source, namespace, version, key_digest, reason, detail, attempts, created_at, replays,"
        " replayed_at, length(body) AS body_bytes")
_GROUP = "reason = :reason AND source = :source"
_NEWEST = " ORDER BY created_at DESC, id DESC LIMIT :limit"

FIRST_PAGE = Statement(f"SELECT {_ROW} FROM dead_letters WHERE {_GROUP}{_NEWEST}")
# The rows after the last one shown (``before``, ``before_id``): a row value comparison, which both
# PostgreSQL and SQLite (3.15+) read as a range of the (reason, source, created_at, id) index.
NEXT_PAGE = Statement(
    f"SELECT {_ROW} FROM dead_letters WHERE {_GROUP} AND (created_at, id) < (:before, :before_id){_NEWEST}")
COUNT_GROUP = Statement(f"SELECT count(*) AS parked FROM dead_letters WHERE {_GROUP}")
GROUPS = Statement(
    "SELECT reason, source, count(*) AS parked, sum(CASE WHEN replays > 0 THEN 1 ELSE 0 END) AS replayed,"
    " min(created_at) AS oldest, max(created_at) AS newest FROM dead_letters"
    " GROUP BY reason, source ORDER BY count(*) DESC, reason, source LIMIT :limit")
# Parked deliveries per minute since ``since`` (minute 0 is the one starting at ``since``).
PARKED_PER_MINUTE = Statement(
    "SELECT CAST(floor(extract(epoch FROM (created_at - CAST(:since AS timestamptz))) / 60) AS integer) AS minute,"
    " count(*) AS parked FROM dead_letters WHERE created_at >= :since GROUP BY 1 ORDER BY 1 LIMIT :limit",
    "SELECT CAST((julianday(created_at) - julianday(:since)) * 1440 AS INTEGER) AS minute, count(*) AS parked"
    " FROM dead_letters WHERE created_at >= :since GROUP BY 1 ORDER BY 1 LIMIT :limit")
# Keys whose lease is live now: an attempt is running them (or its process died and the lease has not run
# out yet). The inbox has no index on state (it would slow every claim); the LIMIT bounds what is sent.
LIVE_LEASES = Statement(
    "SELECT consumer, key_digest, namespace, version, attempts, locked_until, updated_at FROM inbox"
    " WHERE state = 'started' AND locked_until > :now ORDER BY locked_until DESC LIMIT :limit")


@dataclass(frozen=True, slots=True)
class ParkedRow:
    """A parked delivery as a list shows it: no body, its size only."""

    id: str
    consumer: str
    source: str
    namespace: str
    version: int
    key_digest: str | None
    reason: str
    detail: str | None
    attempts: int
    created_at: datetime
    replays: int
    replayed_at: datetime | None
    body_bytes: int


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a group, newest first; ``after`` is the cursor of the next page (``None``: last page)."""

    rows: list[ParkedRow]
    after: tuple[datetime, str] | None


@dataclass(frozen=True, slots=True)
class Lease:
    """A key being run now: its digest, who holds it until when, and how many attempts it has had."""

    consumer: str
    key_digest: str
    namespace: str
    version: int
    attempts: int
    locked_until: datetime
    updated_at: datetime


class Overview:
    """The operator's read-only queries, each bounded by ``limit``."""

    def __init__(self, database: Database) -> None:
        self.database = database

    async def page(self, reason: str, source: str, *, limit: int,
                   after: tuple[datetime, str] | None = None) -> Page:
        """Up to ``limit`` parked deliveries of the group, newest first, after the cursor ``after``."""
        params: dict[str, object] = {"reason": reason, "source": source, "limit": limit + 1}
        statement = FIRST_PAGE
        if after is not None:
            statement = NEXT_PAGE
            params.update(before=after[0], before_id=after[1])
        async with self.database.connect() as ex:
            rows = [_parked(row) for row in await ex.fetch_all(statement, params)]
        more = len(rows) > limit  # one row more than shown says whether there is a next page
        rows = rows[:limit]
        return Page(rows, (rows[-1].created_at, rows[-1].id) if more else None)

    async def count(self, reason: str, source: str) -> int:
        """How many deliveries the group holds."""
        async with self.database.connect() as ex:
            row = await ex.fetch_one(COUNT_GROUP, {"reason": reason, "source": source})
        return 0 if row is None else int(row["parked"])

    async def groups(self, *, limit: int) -> list[ParkedGroup]:
        """The ``limit`` largest groups, by reason and source."""
        async with self.database.connect() as ex:
            rows = await ex.fetch_all(GROUPS, {"limit": limit})
        return [ParkedGroup.from_row(row) for row in rows]

    async def parked_per_minute(self, since: datetime, minutes: int) -> list[int]:
        """How many deliveries were parked in each of the ``minutes`` minutes from ``since``."""
        async with self.database.connect() as ex:
            rows = await ex.fetch_all(PARKED_PER_MINUTE, {"since": since, "limit": minutes + 1})
        counts = [0] * minutes
        for row in rows:
            minute = int(row["minute"])
            if 0 <= minute < minutes:
                counts[minute] += int(row["parked"])
        return counts

    async def leases(self, now: datetime, *, limit: int) -> list[Lease]:
        """Up to ``limit`` keys whose lease is live at ``now``, the longest-held last."""
        async with self.database.connect() as ex:
            rows = await ex.fetch_all(LIVE_LEASES, {"now": now, "limit": limit})
        return [Lease(**dict(row)) for row in rows]


def minute_floor(instant: datetime) -> datetime:
    """``instant`` at the start of its minute."""
    return instant.replace(second=0, microsecond=0)


def window(now: datetime, minutes: int) -> datetime:
    """The start of the ``minutes`` whole minutes that end with the current one."""
    return minute_floor(now) - timedelta(minutes=minutes - 1)


def _parked(row: Row) -> ParkedRow:
    return ParkedRow(**{**dict(row), "replays": int(row["replays"] or 0), "body_bytes": int(row["body_bytes"] or 0)})
