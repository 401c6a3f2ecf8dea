"""Helpers for the Redis Streams tests: a unique stream per test (deleted after), what the group holds
(pending entries, their delivery counts, what is left unread), the dead-letter copies, closing the
source's connections from the server's side, and :class:`RedisServer`, a ``redis-server`` of the
test's own (append-only file fsynced at every write) that can be restarted or killed."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import redis.asyncio

from consumer_kit.sources.redis import connection as redis_connection

REDIS_URL = "redis://127.0.0.1:6379/0"
GROUP = "workers"


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@contextlib.asynccontextmanager
async def unique_stream(url: str = REDIS_URL, prefix: str = "ck-test") -> AsyncIterator[str]:
    """A stream name no other test uses; it and its dead-letter stream are deleted after."""
    name = f"{prefix}-{secrets.token_hex(4)}"
    try:
        yield name
    finally:
        with contextlib.suppress(Exception):
            async with redis.asyncio.Redis.from_url(url) as client:
                await client.delete(name, f"{name}:dead-letter")


async def add(stream: str, fields: dict[str, str | bytes], url: str = REDIS_URL) -> str:
    """``XADD`` one entry; its id."""
    async with redis.asyncio.Redis.from_url(url) as client:
        return text(await client.xadd(stream, fields))  # type: ignore[arg-type]


async def pending(stream: str, group: str = GROUP, url: str = REDIS_URL) -> list[dict[str, Any]]:
    """The group's pending entries: id, consumer, idle ms, delivery count."""
    async with redis.asyncio.Redis.from_url(url) as client:
        try:
            rows = await client.xpending_range(stream, group, "-", "+", 10_000)
        except redis.exceptions.ResponseError:  # no stream or no group yet
            return []
    return [{"id": text(r["message_id"]), "consumer": text(r["consumer"]), "idle": r["time_since_delivered"],
             "count": r["times_delivered"]} for r in rows]


async def pending_count(stream: str, group: str = GROUP, url: str = REDIS_URL) -> int:
    """``XPENDING``'s count for the group (0 when the stream or the group does not exist)."""
    async with redis.asyncio.Redis.from_url(url) as client:
        try:
            return int((await client.xpending(stream, group))["pending"])
        except redis.exceptions.ResponseError:
            return 0


async def unread(stream: str, group: str = GROUP, url: str = REDIS_URL) -> int:
    """Entries the group has not read yet (after its last-delivered id)."""
    async with redis.asyncio.Redis.from_url(url) as client:
        try:
            groups = await client.xinfo_groups(stream)
        except redis.exceptions.ResponseError:
            return 0
        last = next((text(g["last-delivered-id"]) for g in groups if text(g["name"]) == group), None)
        if last is None:
            return int(await client.xlen(stream))
        return len(await client.xrange(stream, f"({last}", "+"))


async def delivered(stream: str, entry_id: str, group: str = GROUP, url: str = REDIS_URL) -> bool:
    """Whether the group has read ``entry_id`` (its last-delivered id is at or past it)."""
    async with redis.asyncio.Redis.from_url(url) as client:
        groups = await client.xinfo_groups(stream)
    last = next((text(g["last-delivered-id"]) for g in groups if text(g["name"]) == group), "0-0")
    return _order(last) >= _order(entry_id)


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def dead_letters(stream: str, url: str = REDIS_URL) -> list[dict[str, str]]:
    """The copies in ``<stream>:dead-letter``, each as its fields (decoded)."""
    async with redis.asyncio.Redis.from_url(url) as client:
        rows = await client.xrange(f"{stream}:dead-letter")
    return [{text(k): text(v) for k, v in fields.items()} for _, fields in rows]


async def kill_connections_named(name: str, url: str = REDIS_URL) -> int:
    """Close, from the server's side, every connection the client named ``name`` opened
    (``CLIENT KILL ID`` of each that ``CLIENT LIST`` shows under that name); how many."""
    wanted = redis_connection.client_name(name)
    async with redis.asyncio.Redis.from_url(url) as client:
        clients = await client.client_list()
        ids = [c["id"] for c in clients if c.get("name") == wanted]
        for client_id in ids:
            await client.execute_command("CLIENT", "KILL", "ID", client_id)
    return len(ids)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisServer:
    """A ``redis-server`` of the test's own on a free port of 127.0.0.1, its data in a directory of its
    own, with the append-only file fsynced at every write: what it acknowledged survives
    :meth:`restart` and :meth:`kill` (SIGKILL, then :meth:`start` again on the same port and data)."""

    def __init__(self, port: int | None = None, directory: Path | None = None) -> None:
        self.port = port or free_port()
        self._own_directory = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="ck-redis-"))
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        """Start it (again, on the same port and data) and wait until it answers PING."""
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is not installed"
        self.process = await asyncio.create_subprocess_exec(
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
            "--appendfsync", "always", "--dir", str(self.directory), "--protected-mode", "no",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                async with redis.asyncio.Redis.from_url(self.url, socket_connect_timeout=1) as client:
                    if await client.ping():
                        return
            except (redis.exceptions.RedisError, OSError):
                pass
            if self.process.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            await asyncio.sleep(0.05)

    async def kill(self) -> None:
        """SIGKILL it (no shutdown, no final save) and wait for it to be gone."""
        await self._end(signal.SIGKILL)

    async def stop(self) -> None:
        """Stop it (SIGTERM; SIGKILL if it lingers) and remove its data directory if it made it."""
        await self._end(signal.SIGTERM)
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    async def restart(self) -> None:
        """Stop it cleanly (SIGTERM) and start it again on the same port and data."""
        await self._end(signal.SIGTERM)
        await self.start()

    async def _end(self, how: signal.Signals) -> None:
        process, self.process = self.process, None
        if process is None or process.returncode is not None:
            return
        process.send_signal(how)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()
