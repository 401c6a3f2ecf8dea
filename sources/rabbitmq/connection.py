"""The connection text of the RabbitMQ source and publisher: how long a connect may take, and the
one-line error (:func:`unreachable`) for a broker that cannot be reached or refuses the user or the
virtual host; the URL in it never shows the password, and no log line before it says otherwise (the
drivers' own lines about the failed first connect are filtered out)."""

from __future__ import annotations

import logging
import socket

import aio_pika
import aiormq.exceptions
import yarl

from consumer_kit.errors import ConfigurationError

CONNECT_TIMEOUT_SECONDS = 5.0


class _SameAsOurError(logging.Filter):
    """aiormq logs a failed connection attempt ("error when creating transport") before it raises;
    the error we raise from it (see :func:`unreachable`) says the same in one line, so the log record
    would only repeat it, with the URL's password in it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("error when creating transport")


logging.getLogger("aiormq.connection").addFilter(_SameAsOurError())


class _NeverConnected(logging.Filter):
    """aio-pika's robust connection logs "Connection to ... closed. Reconnecting after 5 seconds." when
    its very first connect fails, though it does not reconnect then: ``connect_robust`` raises at once
    (its ``fail_fast``), and the source raises its one-line refusal (:func:`unreachable`). A connection
    that has connected before (``connection_attempt`` counts the connects that got through) does
    reconnect, and its line stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        connection = args[0] if args else None
        return not (isinstance(connection, aio_pika.RobustConnection) and connection.connection_attempt == 0
                    and "Reconnecting" in str(record.msg))


logging.getLogger("aio_pika.robust_connection").addFilter(_NeverConnected())


def unreachable(exc: BaseException, url: str, what: str) -> ConfigurationError:
    """The one-line error for a broker connection that failed: where (the URL without its password),
    for what, and why in words (refused, unknown host, bad login, unknown virtual host)."""
    try:
        parsed = yarl.URL(url)
        where = str(parsed.with_password("***")) if parsed.password else str(parsed)
        vhost, user = parsed.path.lstrip("/") or "/", parsed.user or "guest"
    except (ValueError, TypeError):
        where, vhost, user = "RABBITMQ_URL (unparseable)", "?", "?"
    causes = [exc, exc.__cause__, exc.__context__]
    if isinstance(exc, aiormq.exceptions.ProbableAuthenticationError | aiormq.exceptions.AuthenticationError):
        why = f"the broker refused the login of user {user!r} (wrong user name or password)"
    elif isinstance(exc, aiormq.exceptions.InvalidFrameError) and "Connection.Close" in str(exc):
        # The broker answers an unknown (or forbidden) virtual host by closing the connection it was
        # opening; aiormq reports that as an unexpected frame.
        why = f"the broker closed the connection as it opened: virtual host {vhost!r} does not exist, or user " \
              f"{user!r} may not use it"
    elif any(isinstance(c, ConnectionRefusedError) for c in causes):
        why = "connection refused (nothing listens there: is the broker running, and is the port right?)"
    elif any(isinstance(c, socket.gaierror) for c in causes):
        why = "the host name does not resolve"
    elif any(isinstance(c, TimeoutError) for c in causes):
        why = f"no answer within {CONNECT_TIMEOUT_SECONDS:.0f} s"
    elif isinstance(exc, ValueError | TypeError):
        why = "RABBITMQ_URL is not a valid AMQP URL"
    else:
        why = f"{type(exc).__name__}"
    return ConfigurationError(f"cannot connect to RabbitMQ at {where} for {what}: {why}")

