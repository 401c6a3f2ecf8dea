"""A key and the one write it guards, in a single statement (PostgreSQL on asyncpg): what an idempotent
endpoint with ``staged=True`` sends once its route returned, when the route staged exactly one statement.

::

    WITH consumer_kit_tombstone AS (INSERT INTO inbox_tombstones SELECT .. FROM inbox_tombstones WHERE <the key>),
         consumer_kit_key AS (INSERT INTO inbox (..) VALUES (<the key>, 'completed', <the response>))
    <the route's statement>

In autocommit: the key's row, its response and the route's write commit together or not at all, in one
round trip. The route's statement keeps its own ``$1 .. $n``; the key's parameters follow them. A key
that is already in the inbox fails the statement on the inbox's primary key, and nothing is written.
So does a tombstone, on the tombstones' primary key: the first CTE writes a tombstone again where one
exists, which is how a statement that must write nothing says "this key was swept". (A tombstone only
comes from sweeping a row; the key's own row is checked by its insert.)

**Written together** (:class:`SharedWrites`): the writes of requests under way at once go to PostgreSQL
together, a group commit. The first write starts at once, alone; those that come while a write of the
same statement is under way wait for it and then go together, as one ``executemany`` in one transaction
(one round trip, one commit: a write alone costs a round trip of its own and a commit of its own, most
of what it costs the process and the database). If a write of the group fails (a key taken, a tombstone,
the route's own statement refused, a connection lost), the group's transaction writes nothing, and each
of its writes is sent again alone, where what it meets is its own. A request cancelled while its write
waits is taken out; one cancelled while its group's write runs cancels that write (nothing of the group
is written), and the others are sent again alone.

The plain inbox only: on the partitioned one (:mod:`~consumer_kit.store.partitions`) a unique index holds
within one partition, so a key written in an earlier generation would not fail the statement, and the
route's write would be made twice. Staged handlers and endpoints take the transaction path there, whose
insert looks in every generation.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from consumer_kit.store.executor import Executor
    from consumer_kit.store.inbox import Inbox


class AtOnce(enum.Enum):
    """What :func:`write_at_once` did."""

    WRITTEN = "written"  # the key, its response and the route's write committed
    TAKEN = "taken"  # the key has a row already: look it up for the answer; nothing was written
    SWEPT = "swept"  # the key's tombstone is there: its record was swept; nothing was written


# The statements a key may guard this way: one that writes (a WITH ahead of one is merged with ours).
_WRITE = re.compile(r"\s*(?:(with)(\s+recursive)?\s|insert\s|update\s|delete\s)", re.IGNORECASE)

_OURS = (
    "consumer_kit_tombstone AS (INSERT INTO inbox_tombstones (consumer, key_digest, swept_at, expires_at)"
    " SELECT consumer, key_digest, swept_at, expires_at FROM inbox_tombstones"
    " WHERE consumer = CAST(${0} AS varchar) AND key_digest = CAST(${1} AS varchar) AND CAST(${9} AS boolean)),"
    " consumer_kit_key AS (INSERT INTO inbox (consumer, key_digest, namespace, version, fingerprint, state, attempts,"
    " outcome, result, created_at, updated_at, expires_at) VALUES (CAST(${0} AS varchar), CAST(${1} AS varchar),"
    " CAST(${2} AS varchar), CAST(${3} AS integer), CAST(${4} AS varchar), 'completed', 1, CAST(${5} AS varchar),"
    " CAST(${6} AS json), CAST(${7} AS timestamptz), CAST(${7} AS timestamptz), CAST(${8} AS timestamptz)))"
)


def can_guard(statement: str) -> bool:
    """Whether ``statement`` is one :func:`write_at_once` can join: an INSERT, UPDATE or DELETE (with or
    without a WITH of its own)."""
    return _WRITE.match(statement) is not None


@lru_cache(maxsize=256)
def _joined(statement: str, count: int) -> str:
    """``statement`` (with ``count`` parameters) behind the key's CTEs, whose parameters come after."""
    ours = _OURS.format(*range(count + 1, count + 11))
    lead = _WRITE.match(statement)
    assert lead is not None, "can_guard() first"
    if lead.group(1):  # its own WITH: ours go first in the same list
        return f"WITH{lead.group(2) or ''} {ours}, {statement[lead.end():]}"
    return f"WITH {ours} {statement}"


def _sent(inbox: Inbox, consumer: str, digest: str, fingerprint: str, namespace: str, version: int, outcome: str,
          result: Any, statement: str, args: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]]:
    """The statement to send (``statement`` behind the key's CTEs) and all its arguments."""
    if inbox.partitioned:
        raise ValueError("the partitioned inbox takes no key in a staged statement: use the transaction path")
    now = inbox.clock()
    return _joined(statement, len(args)), (*args, consumer, digest, namespace, version, fingerprint, outcome,
                                           None if result is None else json.dumps(result), now,
                                           now + inbox.retention, inbox.tombstones)


async def _send(ex: Executor, joined: str, args: tuple[Any, ...]) -> AtOnce:
    import asyncpg

    driver = ex.driver
    assert driver is not None, "PostgreSQL on asyncpg only"
    try:
        await driver.execute(joined, *args)
    except asyncpg.UniqueViolationError as exc:
        if exc.constraint_name == "pk_inbox":
            return AtOnce.TAKEN
        if exc.constraint_name == "pk_inbox_tombstones":
            return AtOnce.SWEPT
        raise
    return AtOnce.WRITTEN


async def write_at_once(ex: Executor, inbox: Inbox, consumer: str, digest: str, fingerprint: str, *,
                        namespace: str, version: int, outcome: str, result: Any, statement: str,
                        args: tuple[Any, ...]) -> AtOnce:
    """Write ``statement`` with ``args``, and the key's row completed with ``result`` (JSON; ``None``
    leaves it NULL, as a delivery's completion does), in one statement in autocommit on ``ex`` (a
    connection of the store's asyncpg pool, outside a transaction)."""
    return await _send(ex, *_sent(inbox, consumer, digest, fingerprint, namespace, version, outcome, result,
                                  statement, args))


GROUP_MOST = 128
"""The most writes one group sends (the rest wait for the next)."""


class _Alone:
    """What a write of a group that wrote nothing is told: send it again alone."""


_ALONE = _Alone()


@dataclass(eq=False, slots=True)
class _Write:
    args: tuple[Any, ...]
    done: asyncio.Future[AtOnce | _Alone]


@dataclass(eq=False, slots=True)
class _Flight:
    """One group's write under way, and whose writes it carries."""

    task: asyncio.Task[None]
    writes: list[_Write] = field(default_factory=list)


class SharedWrites:
    """:func:`write_at_once` for requests under way at once, written together (see the module docstring):
    per statement, the first write goes at once; those that come while it runs go next, together."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox
        self._waiting: dict[str, list[_Write]] = {}
        self._writers: dict[str, asyncio.Task[None]] = {}
        self._flights: dict[str, _Flight] = {}

    async def write(self, consumer: str, digest: str, fingerprint: str, *, namespace: str, version: int,
                    outcome: str, result: Any, statement: str, args: tuple[Any, ...]) -> AtOnce:
        """:func:`write_at_once`, on a connection of the store's pool, with the other writes of the same
        statement under way."""
        joined, sent = _sent(self.inbox, consumer, digest, fingerprint, namespace, version, outcome, result,
                             statement, args)
        write = _Write(sent, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(joined, []).append(write)
        if joined not in self._writers:
            self._writers[joined] = asyncio.ensure_future(self._write_all(joined))
        try:
            done = await write.done
        except asyncio.CancelledError:
            self._withdraw(joined, write)
            raise
        if done is _ALONE:  # its group wrote nothing: alone, it meets what is its own
            async with self.inbox.database.connect() as ex:
                return await _send(ex, joined, sent)
        assert isinstance(done, AtOnce)
        return done

    def _withdraw(self, joined: str, write: _Write) -> None:
        """A cancelled write: out of the queue if it was still waiting, else its group's write cancelled
        (those of the others are sent again alone), so that a cancelled request writes nothing."""
        waiting = self._waiting.get(joined, [])
        if write in waiting:
            waiting.remove(write)
            return
        flight = self._flights.get(joined)
        if flight is not None and write in flight.writes:
            flight.task.cancel()

    async def _write_all(self, joined: str) -> None:
        """Send the writes waiting for ``joined``, a group at a time, until none is left."""
        writes: list[_Write] = []
        flight: _Flight | None = None
        try:
            while writes := self._next(joined):
                flight = self._flights[joined] = _Flight(asyncio.ensure_future(self._flush(joined, writes)), writes)
                try:
                    # wait(), not the task: a flight a cancelled request cancelled is not this loop's end.
                    await asyncio.wait([flight.task])
                finally:
                    del self._flights[joined]
                # A flight a cancelled request cancelled told none of its writes what became of them: they
                # go alone (the others were told, and telling them again does nothing).
                _tell(writes, _ALONE)
        except BaseException as exc:  # this task cancelled (the loop is closing): nobody waits in vain
            if flight is not None:
                flight.task.cancel()
            for write in (*writes, *self._waiting.pop(joined, [])):
                if not write.done.done():
                    write.done.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            raise
        finally:
            del self._writers[joined]

    def _next(self, joined: str) -> list[_Write]:
        waiting = self._waiting.get(joined)
        if not waiting:
            self._waiting.pop(joined, None)
            return []
        group, self._waiting[joined] = waiting[:GROUP_MOST], waiting[GROUP_MOST:]
        return group

    async def _flush(self, joined: str, writes: list[_Write]) -> None:
        database = self.inbox.database
        if len(writes) == 1:  # alone: what it meets is its own
            (write,) = writes
            try:
                async with database.connect() as ex:
                    done = await _send(ex, joined, write.args)
            except Exception as exc:
                if not write.done.done():
                    write.done.set_exception(exc)
                return
            _tell(writes, done)
            return
        try:
            async with database.connect() as ex:
                assert ex.driver is not None, "PostgreSQL on asyncpg only"
                # One transaction for all (asyncpg's executemany is atomic): all are written, or none.
                await ex.driver.executemany(joined, [write.args for write in writes])
        except Exception:
            _tell(writes, _ALONE)
            return
        _tell(writes, AtOnce.WRITTEN)


def _tell(writes: list[_Write], done: AtOnce | _Alone) -> None:
    for write in writes:
        if not write.done.done():
            write.done.set_result(done)
