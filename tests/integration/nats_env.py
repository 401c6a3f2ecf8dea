"""Helpers for the NATS tests: a unique stream per test on the shared server, publishing with and
without ``Nats-Msg-Id``, what a durable consumer still holds, and :class:`NatsServer`, a ``nats-server``
of the test's own (JetStream, its store on disk) that can be killed and started again."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

NATS_URL = "nats://127.0.0.1:4222"
DUPLICATE_WINDOW = 0.1  # seconds: JetStream drops a repeated Nats-Msg-Id inside it


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Stream:
    """A stream of the test's own: ``name`` captures ``subject`` (``<prefix>.>``)."""

    name: str
    subject: str
    url: str = NATS_URL

    @property
    def prefix(self) -> str:
        return self.subject.removesuffix(".>")


@contextlib.asynccontextmanager
async def connected(url: str = NATS_URL) -> AsyncIterator[nats.aio.client.Client]:
    client = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def own_stream(url: str = NATS_URL, *, prefix: str = "ck-test",
                     duplicate_window: float | None = DUPLICATE_WINDOW) -> AsyncIterator[Stream]:
    """A new stream (file storage) for one test, deleted after it with its dead-letter stream. Its
    ``duplicate_window`` is short (``None``: JetStream's two minutes), so that the same ``Nats-Msg-Id``
    published again after it reaches the consumer, as a redelivery from outside the window would."""
    token = secrets.token_hex(4)
    stream = Stream(name=f"{prefix.upper().replace('-', '_')}_{token}", subject=f"{prefix}.{token}.>", url=url)
    async with connected(url) as client:
        await client.jetstream().add_stream(StreamConfig(name=stream.name, subjects=[stream.subject],
                                                         duplicate_window=duplicate_window))
    try:
        yield stream
    finally:
        with contextlib.suppress(Exception):
            async with connected(url) as client:
                js = client.jetstream()
                for name in (stream.name, f"{stream.name}_DEAD_LETTER"):
                    with contextlib.suppress(NotFoundError):
                        await js.delete_stream(name)


async def publish(stream: Stream, messages: Iterable[tuple[str | None, bytes]], *, subject: str | None = None,
                  headers: dict[str, str] | None = None) -> None:
    """Publish ``(Nats-Msg-Id, body)`` pairs (``None``: no id) to the stream, each acknowledged by JetStream."""
    async with connected(stream.url) as client:
        js = client.jetstream()
        pending = []
        for msg_id, body in messages:
            sent = dict(headers or {})
            if msg_id is not None:
                sent["Nats-Msg-Id"] = msg_id
            pending.append(js.publish(subject or f"{stream.prefix}.work", body, headers=sent or None))
            if len(pending) >= 500:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)


async def consumer_state(stream: Stream, durable: str) -> tuple[int, int]:
    """(messages not yet delivered, delivered and not acknowledged) of a durable consumer."""
    async with connected(stream.url) as client:
        info = await client.jetstream().consumer_info(stream.name, durable)
        return info.num_pending or 0, info.num_ack_pending or 0


async def stream_messages(stream_name: str, url: str = NATS_URL) -> int:
    async with connected(url) as client:
        try:
            info = await client.jetstream().stream_info(stream_name)
        except NotFoundError:
            return 0
        return info.state.messages


class NatsServer:
    """A ``nats-server -js`` of the test's own on a free port, its JetStream store in a temporary
    directory (kept across :meth:`kill` / :meth:`start`, so streams and consumers survive a restart)."""

    def __init__(self) -> None:
        binary = shutil.which("nats-server")
        if binary is None:
            raise RuntimeError("nats-server is not installed (Debian's package nats-server)")
        self.binary = binary
        self.directory = Path(tempfile.mkdtemp(prefix="ck-own-nats-"))
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "nats-server.log"

    def start(self) -> None:
        self._process = subprocess.Popen(
            [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.directory / "store"),
             "-l", str(self.log_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"nats-server exited ({self._process.returncode}): {self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                if "Server is ready" in self.log():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"nats-server did not get ready: {self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: the server stops as a crash stops it (JetStream recovers its store at the next start)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(timeout=20)
            self._process = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        """Stop it and remove its store."""
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:])
