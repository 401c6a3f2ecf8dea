"""Dead letters ("parked deliveries"): deliveries parked with their reason, raw body and headers, for an
operator to inspect, replay (``consumer-kit parked replay``) or discard; and the audit of who did which.

A parked row keeps what its source handed to the pipeline: the body, the headers, the security-relevant
``attributes``, the source's delivery id and the delivery's fingerprint, so that a replay hands the same
delivery over again, keyed the same and counted as the same request. The delivery id is the raw stable
id the operation key was made of: it is kept for the replay and never printed; listings show the key's
digest. A delivery parked by its handler's exception also keeps that attempt's traceback (redacted by
the pipeline; its end, at most :data:`TRACEBACK_LIMIT_BYTES`).

An operator names a parked delivery by its id or by the start of it (:meth:`DeadLetters.matching`).
"""

from __future__ import annotations

import builtins
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from consumer_kit.store import sql
from consumer_kit.store.connections import Database
from consumer_kit.store.executor import Executor, Row
from consumer_kit.store.inbox import Clock, utcnow

TRACEBACK_LIMIT_BYTES = 16 * 1024
"""How much of a traceback a parked delivery keeps (and the pipeline logs): at most 16 KiB (UTF-8), its
end, where the exception and the frame that raised it are; a longer one loses its start, cut at a line
and replaced by a note that says how much was cut."""

_NOTE_BYTES = 64  # room left for that note

_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One parked delivery. ``key_digest`` is ``None`` when the delivery could not be keyed;
    ``delivery_id``, ``attributes`` and ``fingerprint`` are ``None`` on rows parked before they were kept;
    ``traceback`` is the last attempt's when a handler's exception parked it, else ``None``."""

    id: str
    consumer: str
    source: str
    namespace: str
    version: int
    key_digest: str | None
    reason: str
    detail: str | None
    body: bytes
    headers: Mapping[str, Any]
    attempts: int
    created_at: datetime
    delivery_id: str | None = None
    attributes: Mapping[str, str] | None = None
    fingerprint: str | None = None
    replays: int = 0
    replayed_at: datetime | None = None
    traceback: str | None = None


@dataclass(frozen=True, slots=True)
class ParkedFilter:
    """Which parked deliveries: each field narrows the selection when set. ``replayed``: ``True`` only
    those replayed before, ``False`` only those never replayed."""

    consumer: str | None = None
    reason: str | None = None
    namespace: str | None = None
    source: str | None = None
    since: datetime | None = None
    replayed: bool | None = None

    @property
    def params(self) -> dict[str, Any]:
        """The statements' parameters."""
        return {"consumer": self.consumer, "reason": self.reason, "namespace": self.namespace,
                "source": self.source, "since": self.since,
                "replayed": None if self.replayed is None else int(self.replayed)}


@dataclass(frozen=True, slots=True)
class ParkedGroup:
    """Parked deliveries of one reason from one source."""

    reason: str
    source: str
    parked: int
    replayed: int
    oldest: datetime
    newest: datetime

    @classmethod
    def from_row(cls, row: Row) -> ParkedGroup:
        """A group as a grouping statement reads it (``reason, source, parked, replayed, oldest, newest``)."""
        return cls(reason=row["reason"], source=row["source"], parked=int(row["parked"]),
                   replayed=int(row["replayed"] or 0), oldest=row["oldest"], newest=row["newest"])


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One replay or discard of a parked delivery: who, when, and what came of it."""

    id: str
    dead_letter_id: str
    action: str  # replay | discard
    actor: str
    acted_at: datetime
    outcome: str
    detail: str | None


class DeadLetters:
    """Park deliveries; list, group, fetch, discard them; record who replayed or discarded which."""

    def __init__(self, database: Database, *, clock: Clock = utcnow) -> None:
        self.database = database
        self.clock = clock

    async def park(
        self,
        ex: Executor | None = None,
        *,
        consumer: str,
        source: str,
        namespace: str,
        version: int,
        key_digest: str | None,
        reason: str,
        body: bytes,
        headers: Mapping[str, str],
        attempts: int,
        detail: str | None = None,
        delivery_id: str | None = None,
        attributes: Mapping[str, str] | None = None,
        fingerprint: str | None = None,
        traceback: str | None = None,
    ) -> str:
        """Store a parked delivery (in ``ex``'s transaction when given, else on its own) and return its id.
        ``traceback`` (already redacted) is kept to its last :data:`TRACEBACK_LIMIT_BYTES`."""
        letter_id = secrets.token_hex(16)
        params = {"id": letter_id, "consumer": consumer, "source": source, "namespace": namespace,
                  "version": version, "key_digest": key_digest, "reason": reason, "detail": detail,
                  "body": body, "headers": dict(headers), "attempts": attempts, "created_at": self.clock(),
                  "delivery_id": delivery_id, "attributes": dict(attributes) if attributes else None,
                  "fingerprint": fingerprint, "traceback": None if traceback is None else bounded(traceback)}
        if ex is not None:
            await ex.execute(sql.INSERT_DEAD_LETTER, params)
        else:
            async with self.database.connect() as own:
                await own.execute(sql.INSERT_DEAD_LETTER, params)
        return letter_id

    async def list(
        self, *, consumer: str | None = None, reason: str | None = None, limit: int = 100,
        where: ParkedFilter | None = None, oldest_first: bool = False,
    ) -> list[DeadLetter]:
        """Parked deliveries, newest first (``oldest_first``: the other way), narrowed by ``where`` (or
        by ``consumer`` and ``reason``)."""
        where = where or ParkedFilter(consumer=consumer, reason=reason)
        statement = sql.OLDEST_DEAD_LETTERS if oldest_first else sql.LIST_DEAD_LETTERS
        async with self.database.connect() as ex:
            rows = await ex.fetch_all(statement, {**where.params, "limit": limit})
        return [_letter(row) for row in rows]

    async def get(self, letter_id: str) -> DeadLetter | None:
        """One parked delivery by its id."""
        async with self.database.connect() as ex:
            row = await ex.fetch_one(sql.GET_DEAD_LETTER, {"id": letter_id})
        return None if row is None else _letter(row)

    async def matching(self, prefix: str) -> tuple[int, DeadLetter | None]:
        """How many parked deliveries have an id starting with ``prefix`` (a whole id, or its first
        digits), and that delivery when exactly one has."""
        prefix = prefix.strip().lower()
        if not _HEX.fullmatch(prefix):  # ids are hex: anything else names none (and holds no wildcard)
            return 0, None
        async with self.database.connect() as ex:
            row = await ex.fetch_one(sql.MATCH_DEAD_LETTERS, {"pattern": prefix + "%"})
        assert row is not None
        found = int(row["matching"])
        if found != 1:
            return found, None
        letter = await self.get(row["id"])
        return (0, None) if letter is None else (1, letter)  # None: discarded since

    async def count(self, *, reason: str | None = None, where: ParkedFilter | None = None) -> int:
        """How many deliveries are parked (for one reason, or those ``where`` selects)."""
        where = where or ParkedFilter(reason=reason)
        async with self.database.connect() as ex:
            row = await ex.fetch_one(sql.COUNT_DEAD_LETTERS, where.params)
        assert row is not None
        return int(row["parked"])

    async def groups(self, where: ParkedFilter | None = None) -> builtins.list[ParkedGroup]:
        """Counts by reason and source, largest first."""
        async with self.database.connect() as ex:
            rows = await ex.fetch_all(sql.GROUP_DEAD_LETTERS, (where or ParkedFilter()).params)
        return [ParkedGroup.from_row(row) for row in rows]

    async def history(self, letter_id: str) -> builtins.list[AuditEntry]:
        """Every replay (and the discard) of one parked delivery, oldest first."""
        async with self.database.connect() as ex:
            rows = await ex.fetch_all(sql.LIST_PARKED_AUDIT, {"dead_letter_id": letter_id})
        return [AuditEntry(**dict(row)) for row in rows]

    async def replayed(self, letter: DeadLetter, *, actor: str, outcome: str, detail: str | None = None,
                       counted: bool = True) -> None:
        """Record that ``actor`` replayed ``letter`` now, and what came of it (one transaction).
        ``counted``: it went somewhere (its replay count grows); a replay that failed to is only recorded."""
        async with self.database.transaction() as ex:
            if counted:
                await ex.execute(sql.MARK_REPLAYED, {"id": letter.id, "now": self.clock()})
            await self._audit(ex, letter, action="replay", actor=actor, outcome=outcome, detail=detail)

    async def discard(self, letters: Sequence[DeadLetter], *, actor: str) -> int:
        """Delete ``letters``, recording who did it; returns how many were still there to delete."""
        gone = 0
        async with self.database.transaction() as ex:
            for letter in letters:
                if await ex.execute(sql.DELETE_DEAD_LETTER, {"id": letter.id}) == 1:
                    gone += 1
                    await self._audit(ex, letter, action="discard", actor=actor, outcome="discarded")
        return gone

    async def _audit(self, ex: Executor, letter: DeadLetter, *, action: str, actor: str, outcome: str,
                     detail: str | None = None) -> None:
        await ex.execute(sql.INSERT_PARKED_AUDIT, {
            "id": secrets.token_hex(16), "dead_letter_id": letter.id, "action": action, "actor": actor[:255],
            "acted_at": self.clock(), "consumer": letter.consumer, "source": letter.source,
            "reason": letter.reason, "key_digest": letter.key_digest, "outcome": outcome,
            "detail": detail[:2000] if detail else None})


def bounded(traceback: str) -> str:
    """``traceback`` in at most :data:`TRACEBACK_LIMIT_BYTES`: its end, from the start of a line, after a
    note of how much was cut (bounding it again changes nothing)."""
    encoded = traceback.encode()
    if len(encoded) <= TRACEBACK_LIMIT_BYTES:
        return traceback
    tail = encoded[-(TRACEBACK_LIMIT_BYTES - _NOTE_BYTES):].decode(errors="ignore")  # a character cut in two: left out
    tail = tail[tail.find("\n") + 1:]
    return f"[the traceback's first {len(encoded) - len(tail.encode())} bytes were cut]\n{tail}"


def _letter(row: Row) -> DeadLetter:
    return DeadLetter(**{**dict(row), "body": bytes(row["body"]), "replays": int(row["replays"] or 0)})
