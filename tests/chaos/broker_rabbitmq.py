"""The chaos run's RabbitMQ side: the shared broker on 127.0.0.1:5672, a queue ``ck-chaos-<token>`` (and
its ``.out`` queue for the outbox path). The worker reaches the broker through a TCP proxy of the run's
own, and the fault is a cut there: every connection through it dropped at once and new ones refused
for a second, as when the network to the broker fails. (Having the broker close the connection with
rabbitmqctl took seconds on a busy host, and the worker could finish its work before the cut came.)"""

from __future__ import annotations

import asyncio
import subprocess

import aio_pika

from tests.chaos.transport import Transport
from tests.integration.rabbit import TcpProxy, queue_names

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
DOWN_SECONDS = 1.0  # how long the cut broker refuses new connections


def _queue_counts(prefix: str) -> tuple[int, int]:
    """(ready, unacked) over ``prefix`` and every ``prefix.*`` queue (retry queues, the DLQ)."""
    out = subprocess.run(["rabbitmqctl", "list_queues", "name", "messages_ready", "messages_unacknowledged",
                          "-q", "--no-table-headers"], capture_output=True, text=True, timeout=60, check=True).stdout
    ready = unacked = 0
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and (parts[0] == prefix or parts[0].startswith(prefix + ".")) \
                and not parts[0].endswith(".out"):
            ready += int(parts[1])
            unacked += int(parts[2])
    return ready, unacked


class RabbitTransport(Transport):
    name = "rabbitmq"
    fault_name = "broker cut"
    paths = ("default", "single", "batch", "staged", "outbox")

    def __init__(self, token: str) -> None:
        super().__init__(token)
        self.queue = f"ck-chaos-{token}"
        self.proxy = TcpProxy()

    async def start(self) -> None:
        await self.proxy.start()

    def env(self) -> dict[str, str]:
        return {"CHAOS_TRANSPORT": self.name, "RABBITMQ_URL": self.proxy.url, "CHAOS_QUEUE": self.queue}

    async def publish(self, messages: list[str]) -> None:
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            await channel.declare_queue(self.queue, durable=True)
            await channel.declare_queue(f"{self.queue}.out", durable=True)
            for start in range(0, len(messages), 500):
                await asyncio.gather(*(channel.default_exchange.publish(
                    aio_pika.Message(message_id.encode(), message_id=message_id,
                                     delivery_mode=aio_pika.DeliveryMode.PERSISTENT), routing_key=self.queue)
                    for message_id in messages[start:start + 500]))

    async def counts(self) -> tuple[int, int]:
        return await asyncio.to_thread(_queue_counts, self.queue)

    async def fault(self) -> None:
        """Cut the worker off the broker: its connections dropped, new ones refused for a second."""
        assert self.proxy.connections > 0, "no worker connection through the proxy to cut"
        await self.proxy.stop()
        await asyncio.sleep(DOWN_SECONDS)
        await self.proxy.start()  # the same port: the worker's reconnects find the broker again

    async def downstream_ids(self) -> set[str]:
        ids: set[str] = set()
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel()
            declared = await channel.declare_queue(f"{self.queue}.out", durable=True)
            while (message := await declared.get(fail=False, timeout=5)) is not None:
                await message.ack()
                ids.add(message.body.decode())
        return ids

    async def remove(self) -> None:
        await self.proxy.stop()
        names = [n for n in await asyncio.to_thread(queue_names) if n == self.queue or n.startswith(self.queue + ".")]
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            for name in names:
                channel = await connection.channel()
                try:
                    await channel.queue_delete(name)
                except Exception:
                    pass
