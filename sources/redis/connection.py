"""The connection text of the Redis Streams source and publisher: the client both use (named, with
short timeouts and a short retry, so that a dropped connection is opened again at once and a server
that is gone fails a call within about a second), and the one-line error (:func:`unreachable`) for a
server that cannot be reached or refuses the login; the URL in it never shows the password."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from consumer_kit.errors import ConfigurationError

CONNECT_TIMEOUT_SECONDS = 5.0
READ_TIMEOUT_SECONDS = 10.0  # longer than any blocking read the source makes (BLOCK 1000 ms)
LOST = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
"""What a call raises when the connection to the server is gone (redis-py's own retry gave up)."""


def client(url: str, name: str) -> redis.asyncio.Redis:
    """A client on ``url`` whose connections are named ``name`` on the server (``CLIENT LIST``), and
    that retries a call twice within half a second on a new connection when the old one dropped; a
    server still gone after that is the caller's to back off from."""
    return redis.asyncio.Redis.from_url(
        url, client_name=client_name(name), socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        socket_timeout=READ_TIMEOUT_SECONDS, retry=Retry(ExponentialWithJitterBackoff(cap=0.5, base=0.05), 2),
        health_check_interval=0, decode_responses=False)


def client_name(name: str) -> str:
    """``name`` as a Redis client name (no spaces or control characters)."""
    return re.sub(r"[^!-~]", "-", f"consumer-kit:{name}")[:120]


def safe_url(url: str) -> str:
    """``url`` without its password."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.hostname or ""
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    except ValueError:
        return "REDIS_URL (unparseable)"


def unreachable(exc: BaseException, url: str, what: str) -> ConfigurationError:
    """The one-line error for a connection that failed: where (the URL without its password), for
    what, and why in words (refused, unknown host, no answer, bad login, not a Redis URL)."""
    causes = [exc, exc.__cause__, exc.__context__]
    text = str(exc)
    if isinstance(exc, redis.exceptions.AuthenticationError) or "WRONGPASS" in text or "NOAUTH" in text \
            or "invalid password" in text or "invalid username-password" in text:
        why = "the server refused the login (wrong user name or password, or a password is needed)"
    elif isinstance(exc, redis.exceptions.TimeoutError) or any(isinstance(c, TimeoutError) for c in causes):
        why = f"no answer within {CONNECT_TIMEOUT_SECONDS:.0f} s"
    elif "Connection refused" in text or any(isinstance(c, ConnectionRefusedError) for c in causes):
        why = "connection refused (nothing listens there: is the server running, and is the port right?)"
    elif "Name or service not known" in text or "nodename nor servname" in text \
            or "Temporary failure in name resolution" in text:
        why = "the host name does not resolve"
    elif isinstance(exc, ValueError | TypeError):
        why = "REDIS_URL is not a valid redis:// URL"
    else:
        why = type(exc).__name__
    return ConfigurationError(f"cannot connect to Redis at {safe_url(url)} for {what}: {why}")
