"""Writes a handler stages with ``ctx.stage(statement, ...)``: run after the handler, in the delivery's
transaction, each statement once for all its rows (asyncpg's ``executemany``, SQLAlchemy's
executemany), so that a batch of 64 deliveries that each insert a row sends one statement, not 64.
On the batched path the deliveries' outbox rows are written the same way, after the statements.

Statements are grouped by their text (or, for an SQLAlchemy statement object, by the object: build it
once, at import) and written in the order each was first staged; rows of one statement keep the order
they were staged in. A write that fails fails the transaction it runs in, as a failing statement in
the handler would: on the batched path the batch is halved until the delivery whose row failed stands
alone, and that delivery is retried and parked as any failing delivery is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from consumer_kit.store.outbox import write as write_outbox

if TYPE_CHECKING:
    from consumer_kit.store.executor import Executor

_DRIVER, _SESSION = 0, 1


class StagedWrites:
    """The statements staged by the handlers of one transaction (one delivery's, or a batch's)."""

    __slots__ = ("_groups", "_outbox")

    def __init__(self) -> None:
        self._groups: dict[tuple[int, Any], list[Any]] = {}
        self._outbox: list[dict[str, Any]] = []

    def driver(self, statement: str, args: tuple[Any, ...]) -> None:
        """Stage SQL text with asyncpg's positional ``$1`` arguments (``ctx.connection``)."""
        self._groups.setdefault((_DRIVER, statement), []).append(args)

    def session(self, statement: Any, params: Mapping[str, Any]) -> None:
        """Stage an SQLAlchemy statement (or SQL text) with named ``:name`` parameters (``ctx.db``)."""
        self._groups.setdefault((_SESSION, statement), []).append(params)

    def outbox(self, rows: list[dict[str, Any]]) -> None:
        """Stage outbox rows (``ctx.outbox.publish``), written after the statements, all in one go."""
        self._outbox.extend(rows)

    def alone(self) -> tuple[str, tuple[Any, ...]] | None:
        """The one write staged, when there is exactly one: an asyncpg statement staged once, and no
        outbox rows (what :func:`~consumer_kit.store.at_once.write_at_once` can send with its key)."""
        if self._outbox or len(self._groups) != 1:
            return None
        ((kind, statement), rows), = self._groups.items()
        if kind != _DRIVER or len(rows) != 1 or not isinstance(statement, str):
            return None
        return statement, rows[0]

    def __bool__(self) -> bool:
        return bool(self._groups or self._outbox)

    async def write(self, ex: Executor) -> None:
        """Run every staged statement on ``ex``, inside its transaction; nothing is staged after."""
        groups, self._groups = self._groups, {}
        rows_out, self._outbox = self._outbox, []
        for (kind, statement), rows in groups.items():
            if kind == _DRIVER:
                await ex.driver.executemany(statement, rows)  # type: ignore[union-attr]
            else:
                clause = text(statement) if isinstance(statement, str) else statement
                if len(rows) > 1 and rows[0]:
                    await ex.session.execute(clause, rows)  # SQLAlchemy's executemany
                else:
                    for params in rows:
                        await ex.session.execute(clause, params or None)
        if rows_out:
            await write_outbox(ex, rows_out)
