"""asyncpg's errors that say something other than what they read as, each told apart in one function.

asyncpg's protocol and pool have no public attribute for these states, so the only sign is the error
itself: its class and its words, matched as narrowly as they can be (asyncpg gives them no code).
"""

from __future__ import annotations

import re

_SERVER_ENDED = re.compile(r"cannot switch to state \d+; another operation \(2\) is in progress")


def ended_by_the_server(exc: BaseException | None) -> bool:
    """Whether ``exc`` is asyncpg's error for a statement that met the server's end of its connection
    halfway: PostgreSQL sends a connection it ends (terminated, idle too long, shutting down) a FATAL
    error, then closes it; asyncpg reads the two in separate turns of the event loop. When the error
    comes while no statement runs, asyncpg takes it for the error of an operation in progress (its
    protocol state 2) and waits for that operation's end, which never comes; until it reads that the
    connection closed, every public check says the connection is open, and a statement issued then
    fails with ``InternalClientError: cannot switch to state N; another operation (2) is in progress``
    (N: 11 prepare, 12 bind/execute, 15 a simple query such as BEGIN). asyncpg closes the connection as
    it raises, before anything is sent. It is the lost connection asyncpg reports a turn later
    (:func:`connection_ended`), and no public attribute shows it sooner."""
    import asyncpg

    return isinstance(exc, asyncpg.InternalClientError) and _SERVER_ENDED.search(str(exc)) is not None


def connection_ended() -> Exception:
    """asyncpg's error for a connection lost under a statement, for one the server ended (see
    :func:`ended_by_the_server`)."""
    import asyncpg

    lost: Exception = asyncpg.ConnectionDoesNotExistError(
        "connection was closed in the middle of operation: the server ended the connection")
    return lost


def taken_back(exc: Exception) -> bool:
    """Whether a release failed because asyncpg's pool had taken the connection back already: it does so
    the moment a connection is lost, and a release under way then (its shielded part not yet started)
    finds the holder free. Nothing is left to release; raising would replace the error (or the
    cancellation) that ends the block."""
    import asyncpg

    return isinstance(exc, asyncpg.InternalClientError) and "free connection holder" in str(exc)
