"""The NATS connection of the source and the publisher: one :func:`connect` with the options both use
(reconnect for ever, the connection named, errors logged in one line), and the one-line error
(:func:`unreachable`) for a server that cannot be reached or refuses the login; the URL in it never
shows a password or token."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import nats
import nats.errors
from nats.aio.client import Client

from consumer_kit.errors import ConfigurationError

log = logging.getLogger("consumer_kit.sources.nats")

CONNECT_TIMEOUT_SECONDS = 5
RECONNECT_WAIT_SECONDS = 0.5  # between two reconnect attempts (nats-py's default is 2 s)


async def connect(url: str, name: str, *, on_disconnected: Callable[[], Awaitable[None]] | None = None,
                  on_reconnected: Callable[[], Awaitable[None]] | None = None) -> Client:
    """A connection to ``url`` (several servers comma-separated) that reconnects for ever once it has
    connected; a first connect that fails is :func:`unreachable`'s one-line error, at once.

    nats-py's client with ``max_reconnect_attempts=-1`` also retries its first connect for ever (its
    connect loop makes no difference between the two), so a probe without reconnects goes first: it
    fails fast with the reason, and the connection that stays is made only once a server answered."""
    servers = [server.strip() for server in url.split(",")]
    connected = False
    errors: list[Exception] = []

    async def error(exc: Exception) -> None:
        # nats-py's default logs each error with its traceback; a reconnect loop would fill the log.
        if connected:
            log.warning("%s: NATS connection error (%s)", name, type(exc).__name__)
        else:
            errors.append(exc)

    async def nothing() -> None:
        return None

    # Each client made here (not through nats.connect, which keeps none when it raises) is closed when
    # its connect fails: nats-py leaves the socket of a refused login open otherwise.
    probe, client = Client(), Client()
    try:
        # Two tries of each server, a tenth of a second apart (nats-py counts 0 attempts as "for ever").
        await probe.connect(servers=servers, name=f"{name}-probe", connect_timeout=CONNECT_TIMEOUT_SECONDS,
                            allow_reconnect=False, max_reconnect_attempts=1, error_cb=error,
                            reconnect_time_wait=0.1)  # type: ignore[arg-type]  # annotated int; it sleeps for it
        await probe.close()
        async with asyncio.timeout(4 * CONNECT_TIMEOUT_SECONDS):
            await client.connect(
                servers=servers, name=name, connect_timeout=CONNECT_TIMEOUT_SECONDS,
                reconnect_time_wait=RECONNECT_WAIT_SECONDS,  # type: ignore[arg-type]  # as above
                max_reconnect_attempts=-1, allow_reconnect=True, error_cb=error,
                disconnected_cb=on_disconnected or nothing, reconnected_cb=on_reconnected or nothing)
    except Exception as exc:
        for each in (probe, client):
            with contextlib.suppress(Exception):
                await each.close()
        # A refused login may be followed by the reset of its connection: the refusal says more.
        refusal = next((e for e in errors if isinstance(e, nats.errors.AuthorizationError)), None)
        raise unreachable(refusal or (errors[-1] if errors else exc), url, name) from exc
    connected = True
    return client


def unreachable(exc: BaseException, url: str, what: str) -> ConfigurationError:
    """The one-line error for a failed first connect: where (the URL without credentials), for what, why."""
    where = ",".join(_without_credentials(server.strip()) for server in url.split(","))
    causes = [exc, exc.__cause__, exc.__context__]
    if any(isinstance(c, nats.errors.AuthorizationError) for c in causes) or "authorization" in str(exc).lower():
        why = "the server refused the login (wrong user, password or token)"
    elif any(isinstance(c, ConnectionResetError) for c in causes):
        # nats-server closes the connection after its -ERR for a bad login, and nats-py sometimes
        # reads the close first.
        why = ("the server closed the connection during the handshake: it refused the login (wrong user, password "
               "or token), or it wants TLS")
    elif any(isinstance(c, ConnectionRefusedError) for c in causes):
        why = "connection refused (nothing listens there: is nats-server running, and is the port right?)"
    elif isinstance(exc, nats.errors.NoServersError | TimeoutError):
        why = f"no server answered within {CONNECT_TIMEOUT_SECONDS} s (is nats-server running there?)"
    else:
        why = type(exc).__name__
    return ConfigurationError(f"cannot connect to NATS at {where} for {what}: {why}")


def _without_credentials(server: str) -> str:
    try:
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        host = parts.hostname or "?"
        netloc = f"***@{host}" if parts.username or parts.password else host
        if parts.port:
            netloc += f":{parts.port}"
        return urlunsplit((parts.scheme, netloc, "", "", ""))
    except ValueError:
        return "NATS_URL (unparseable)"
