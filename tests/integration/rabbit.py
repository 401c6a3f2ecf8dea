"""Helpers for the RabbitMQ tests: unique queues, publishing, queue depth, closing a connection from
the broker's side, and a TCP proxy that stands in for a broker that goes away and comes back."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable

import aio_pika
import httpx

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
MANAGEMENT_API = "http://127.0.0.1:15672/api"


async def publish(queue: str, messages: Iterable[tuple[str | None, bytes]], *, url: str = AMQP_URL,
                  headers: dict[str, str] | None = None) -> None:
    """Publish ``(message_id, body)`` pairs to ``queue`` with confirms, many at a time."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        pending: list[Awaitable[object]] = []
        for message_id, body in messages:
            pending.append(channel.default_exchange.publish(
                aio_pika.Message(body, message_id=message_id, headers=headers or {},
                                 delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=queue))
            if len(pending) >= 500:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)


async def publish_without_id(queue: str, bodies: Iterable[bytes], port: int = 5672) -> None:
    """Publish messages that carry no ``message_id`` at all.

    Every aio-pika/aiormq publish gets a random ``message_id`` when it has none, so this speaks
    AMQP 0-9-1 directly (pamqp frames over a socket), as a foreign producer would.
    """
    from pamqp import commands, frame, header
    from pamqp.body import ContentBody

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    buffer = b""

    async def expect(kind: type) -> object:
        nonlocal buffer
        while True:
            with contextlib.suppress(Exception):
                consumed, _channel, value = frame.unmarshal(buffer)
                buffer = buffer[consumed:]
                if isinstance(value, kind):
                    return value
                continue
            data = await asyncio.wait_for(reader.read(65536), 10)
            if not data:
                raise ConnectionError("the broker closed the connection")
            buffer += data

    def send(value: object, channel: int = 0) -> None:
        writer.write(frame.marshal(value, channel))  # type: ignore[arg-type]

    writer.write(header.ProtocolHeader().marshal())
    await expect(commands.Connection.Start)
    send(commands.Connection.StartOk(client_properties={}, response="\0guest\0guest"))
    tune = await expect(commands.Connection.Tune)
    send(commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))  # type: ignore[attr-defined]
    send(commands.Connection.Open())
    await expect(commands.Connection.OpenOk)
    send(commands.Channel.Open(), 1)
    await expect(commands.Channel.OpenOk)
    send(commands.Confirm.Select(), 1)
    await expect(commands.Confirm.SelectOk)
    count = 0
    for body in bodies:
        send(commands.Basic.Publish(exchange="", routing_key=queue), 1)
        send(header.ContentHeader(0, len(body), commands.Basic.Properties(delivery_mode=2)), 1)
        send(ContentBody(body), 1)
        count += 1
    confirmed: set[int] = set()
    while len(confirmed) < count:
        ack = await expect(commands.Basic.Ack)
        tag = int(ack.delivery_tag)  # type: ignore[attr-defined]
        confirmed.update(range(1, tag + 1) if ack.multiple else (tag,))  # type: ignore[attr-defined]
    send(commands.Connection.Close(200, "bye", 0, 0), 0)
    await expect(commands.Connection.CloseOk)
    writer.close()


async def declare(queue: str, **arguments: object) -> None:
    """Declare a durable queue."""
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True, arguments=arguments or None)


async def depth(queue: str) -> int:
    """Messages ready in ``queue`` (unacknowledged ones are not counted)."""
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


async def drain(queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Take every ready message off ``queue`` (acked) and return them."""
    taken = []
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        while (message := await declared.get(fail=False)) is not None:
            await message.ack()
            taken.append(message)
    return taken


_LEFT: set[str] = set()
"""Prefixes whose other queues (a source's retry queues, named by their delays) are deleted at the end
of the test session (:func:`delete_left_queues`)."""


async def delete_queues(prefix: str) -> None:
    """Delete ``prefix`` and its ``.dlq`` and ``.out`` queues now, and every other ``prefix.*`` queue at
    the end of the test session: finding those takes a listing, and each ``rabbitmqctl`` run costs a
    second or more of CPU (an Erlang VM's start), which a teardown per test added up to minutes of the
    suite. (RabbitMQ deletes a queue that is not there without an error.)"""
    _LEFT.add(prefix)
    await _delete([prefix, f"{prefix}.dlq", f"{prefix}.out"])


def delete_left_queues() -> None:
    """Delete every queue named ``<prefix>.*`` left by :func:`delete_queues` (one listing for all)."""
    if not _LEFT:
        return
    prefixes = tuple(p + "." for p in _LEFT)
    names = [name for name in queue_names() if name.startswith(prefixes)]
    _LEFT.clear()
    if names:
        asyncio.run(_delete(names))


async def _delete(names: Iterable[str]) -> None:
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        for name in names:
            channel = await connection.channel()
            with contextlib.suppress(Exception):
                await channel.queue_delete(name, if_unused=False, if_empty=False)


def queue_names() -> list[str]:
    """Every queue's name: from the management plugin's HTTP API when it answers (.ci/run enables it),
    else from ``rabbitmqctl`` (an Erlang VM's start: a second or more of CPU)."""
    try:
        listed = httpx.get(f"{MANAGEMENT_API}/queues", params={"columns": "name"}, auth=("guest", "guest"),
                           timeout=30)
        listed.raise_for_status()
        return [queue["name"] for queue in listed.json()]
    except httpx.ConnectError:  # no management plugin on this broker: its command line below
        return _queue_names_from_rabbitmqctl()


def _queue_names_from_rabbitmqctl() -> list[str]:
    out = subprocess.run(["rabbitmqctl", "list_queues", "name", "-q"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return [line.strip() for line in out.splitlines()[1:] if line.strip()]


def close_connections_named(name: str) -> int:
    """Have the broker close every connection whose client named itself ``name``; returns how many."""
    out = subprocess.run(["rabbitmqctl", "list_connections", "pid", "client_properties", "-q"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    closed = 0
    for line in out.splitlines():
        pid, _, properties = line.partition("\t")
        if f'{{"connection_name","{name}"}}' in properties:
            subprocess.run(["rabbitmqctl", "close_connection", pid, "test: broker-side close"],
                           capture_output=True, timeout=30, check=True)
            closed += 1
    return closed


async def wait_until(predicate: Callable[[], Awaitable[bool]], seconds: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail with ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


class TcpProxy:
    """Forwards a local port to the broker; ``stop()`` drops every connection and refuses new ones,
    like a broker that became unreachable, without touching the shared broker."""

    def __init__(self, port: int = 0, target: tuple[str, int] = ("127.0.0.1", 5672)) -> None:
        self.port = port
        self.target = target
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    @property
    def connections(self) -> int:
        """The client connections it forwards now."""
        return len(self._writers) // 2

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))
