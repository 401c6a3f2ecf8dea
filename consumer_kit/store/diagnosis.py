"""What a database driver's error means, in words a person can act on.

Driver errors are translated where they enter (the first connection of a command or an app, and a
statement that met a missing table), into :class:`~consumer_kit.errors.DatabaseUnavailable` and
:class:`~consumer_kit.errors.SchemaMissing`, whose messages say what is wrong and what to do, in one
line, with the URL's password hidden. The drivers are told apart by what they expose publicly: an
SQLSTATE (asyncpg, psycopg), the standard library's exception types (``OSError`` for the network,
``sqlite3.OperationalError``), and SQLite's fixed message texts.
"""

from __future__ import annotations

import re
import socket
import sqlite3
from collections.abc import Iterator

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from consumer_kit.errors import DatabaseUnavailable, SchemaMissing

# SQLSTATEs (PostgreSQL appendix A): a login refused, an unknown database, a missing table, column or schema.
_LOGIN_REFUSED = {"28000", "28P01"}
_NO_DATABASE = "3D000"
_MISSING_OBJECT = {"42P01": "table", "42703": "column", "3F000": "schema"}
# A connection the server ended or could not serve yet: class 08 (connection exception), an
# administrator's or a crash's shutdown, a server still starting up.
_DROPPED = {"57P01", "57P02", "57P03"}
_SQLITE_MISSING = re.compile(r"^no such (table|column): (\S+)|has no column named (\S+)")
_PG_OBJECT = re.compile(r'(?:relation|column|schema) "([^"]+)"')


def safe_url(url: str | URL) -> str:
    """The URL as it may be printed: its password replaced by ``***``."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError, TypeError):
        return "DATABASE_URL (not shown: it does not parse, and may hold a password)"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps: SQLAlchemy's ``orig``, causes and contexts (each once)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        error = todo.pop(0)
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        orig = getattr(error, "orig", None)
        todo += [orig if isinstance(orig, BaseException) else None, error.__cause__, error.__context__]


def unavailable(exc: BaseException, url: str | URL) -> DatabaseUnavailable | None:
    """The one-line error for a failed connection to ``url``, or ``None`` when ``exc`` is not one."""
    why = unavailable_because(exc, url)
    return None if why is None else DatabaseUnavailable(f"cannot use the database at {safe_url(url)}: {why}")


def unavailable_because(exc: BaseException, url: str | URL | None = None) -> str | None:
    """Why a connection (to ``url``) failed, in words; ``None`` when ``exc`` is not a failed connection."""
    try:
        parsed: URL | None = make_url(url) if url is not None else None
    except (ArgumentError, ValueError, TypeError):
        parsed = None
    user = parsed.username if parsed is not None and parsed.username else "(default)"
    database = parsed.database if parsed is not None and parsed.database else "(default)"
    why = None
    for error in _chain(exc):
        state = getattr(error, "sqlstate", None)
        if state in _LOGIN_REFUSED:
            why = f"the server refused the login of user {user!r} (wrong user name or password, or no such role)"
        elif state == _NO_DATABASE:
            why = f"database {database!r} does not exist on that server (create it, or fix DATABASE_URL)"
        elif isinstance(error, ConnectionRefusedError):
            why = "connection refused (nothing listens there: is the database running, and is the port right?)"
        elif isinstance(error, socket.gaierror):
            why = "the host name does not resolve"
        elif isinstance(error, TimeoutError):
            why = "no answer in time (a firewall, or the wrong host?)"
        elif isinstance(error, sqlite3.OperationalError) and "unable to open database file" in str(error):
            why = "the SQLite file cannot be opened (does its directory exist, and may this user write there?)"
        elif isinstance(error, OSError):
            # asyncpg tries every address of a host and raises one OSError naming each failure.
            text = str(error)
            why = "connection refused (nothing listens there: is the database running, and is the port right?)" \
                if "Connect call failed" in text or "refused" in text else f"the connection failed: {text[:200]}"
        elif type(error).__name__ == "OperationalError" and type(error).__module__.startswith("psycopg"):
            # psycopg says why only in its message, which quotes no password: its first line.
            why = str(error).strip().splitlines()[0][:200] if str(error).strip() else "the connection failed"
        if why is not None:
            break
    return why or dropped_because(exc)


def dropped_because(exc: BaseException) -> str | None:
    """Why the server ended a connection in use, or could not serve one yet, in words; ``None`` when
    ``exc`` is not that (a refused login, a missing database and a closed port are not: they stay so)."""
    lost = False
    for error in _chain(exc):
        state = str(getattr(error, "sqlstate", None) or "")
        if state.startswith("08") or state in _DROPPED:
            said = str(error).strip().splitlines()
            return f"the server ended the connection (SQLSTATE {state}{': ' + said[0][:200] if said else ''})"
        lost = lost or (isinstance(error, DBAPIError) and error.connection_invalidated)
    return "the connection was lost" if lost else None


def missing_schema(exc: BaseException) -> SchemaMissing | None:
    """The error for a statement that met a table, column or schema that does not exist, or ``None``."""
    for error in _chain(exc):
        kind = _MISSING_OBJECT.get(str(getattr(error, "sqlstate", None) or ""))
        name = None
        if kind is not None:
            found = _PG_OBJECT.search(str(error))
            name = found.group(1) if found else "?"
        elif isinstance(error, sqlite3.OperationalError):
            found = _SQLITE_MISSING.search(str(error))
            if found:
                kind = found.group(1) or "column"
                name = found.group(2) or found.group(3)
        if kind is not None:
            return SchemaMissing(f"{kind} {name!r} does not exist in the database: create your tables before the "
                                 "deliveries arrive (APP_MIGRATIONS with `consumer-kit db upgrade`), or run "
                                 "`consumer-kit db upgrade` if it is one of consumer-kit's")
    return None
