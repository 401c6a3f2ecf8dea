"""What a staged handler's or route's context has for a connection: none (:class:`Unopened`). It runs
before anything is held; what it stages (``ctx.stage``) is written with its key afterwards, so
``ctx.stage`` only needs to know which driver a statement is for, and ``ctx.connection`` and ``ctx.db``
are the code's mistake: they raise :class:`~consumer_kit.errors.TerminalError` (parked, or answered 500)
with ``why``."""

from __future__ import annotations

from typing import Any, NoReturn

from consumer_kit.errors import TerminalError
from consumer_kit.store.executor import SessionUnavailable


class _Refused:
    """``ctx.connection`` (and ``ctx.db`` on the SQLAlchemy driver) of staged code: any use of it raises."""

    __slots__ = ("_why",)

    def __init__(self, why: str) -> None:
        self._why = why

    def __getattr__(self, name: str) -> NoReturn:
        raise TerminalError(self._why, reason="handler_misconfigured")


class Unopened:
    """An :class:`~consumer_kit.store.Executor` stand-in for staged code: ``uses_db`` (the SQLAlchemy
    driver) or not (asyncpg), and ``why`` its connection may not be used."""

    __slots__ = ("_uses_db", "_why")
    discarded = False

    def __init__(self, uses_db: bool, why: str) -> None:
        self._uses_db = uses_db
        self._why = why

    @property
    def driver(self) -> Any:
        return None if self._uses_db else _Refused(self._why)

    @property
    def session(self) -> Any:
        if not self._uses_db:
            raise SessionUnavailable("staged code on driver='asyncpg' has no SQLAlchemy session")
        return _Refused(self._why)

    def session_made(self) -> None:
        return None
