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

The plain inbox only: on the partitioned one (:mod:`~consumer_kit.store.partitions`) a unique index holds
within one partition, so a key written in an earlier generation would not fail the statement, and the
route's write would be made twice. Staged handlers and endpoints take the transaction path there, whose
insert looks in every generation.
"""

from __future__ import annotations

import enum
import json
import re
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


async def write_at_once(ex: Executor, inbox: Inbox, consumer: str, digest: str, fingerprint: str, *,
                        namespace: str, version: int, outcome: str, result: Any, statement: str,
                        args: tuple[Any, ...]) -> AtOnce:
    """Write ``statement`` with ``args``, and the key's row completed with ``result`` (JSON; ``None``
    leaves it NULL, as a delivery's completion does), in one statement in autocommit on ``ex`` (a
    connection of the store's asyncpg pool, outside a transaction)."""
    import asyncpg

    if inbox.partitioned:
        raise ValueError("the partitioned inbox takes no key in a staged statement: use the transaction path")
    driver = ex.driver
    assert driver is not None, "PostgreSQL on asyncpg only"
    now = inbox.clock()
    try:
        await driver.execute(_joined(statement, len(args)), *args, consumer, digest, namespace, version, fingerprint,
                             outcome, None if result is None else json.dumps(result), now, now + inbox.retention,
                             inbox.tombstones)
    except asyncpg.UniqueViolationError as exc:
        if exc.constraint_name == "pk_inbox":
            return AtOnce.TAKEN
        if exc.constraint_name == "pk_inbox_tombstones":
            return AtOnce.SWEPT
        raise
    return AtOnce.WRITTEN
