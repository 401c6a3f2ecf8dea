"""aio-pika's robust connection says "Reconnecting after 5 seconds" when its very first connect fails,
though it raises instead (the source's one-line refusal follows): the RabbitMQ source drops that line.
A connection that did connect, and is closed by the broker, still says it reconnects, and does."""

from __future__ import annotations

import asyncio
import logging
import secrets

import aio_pika
import pytest

import consumer_kit.sources.rabbitmq  # noqa: F401  (installs the log filters)
from tests.integration.rabbit import AMQP_URL, close_connections_named, wait_until

pytestmark = pytest.mark.rabbitmq


@pytest.mark.parametrize("url", ["amqp://ck-nobody:wrong@127.0.0.1:5672/",
                                 "amqp://guest:guest@127.0.0.1:5672/ck-no-such-vhost"],
                         ids=["bad login", "unknown vhost"])
async def test_a_first_connect_that_fails_says_nothing_of_reconnecting(
        url: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="aio_pika"), pytest.raises(Exception) as failed:
        await aio_pika.connect_robust(url, timeout=5)
    assert not isinstance(failed.value, TimeoutError)  # refused, not unanswered
    await asyncio.sleep(0.2)  # what the failed connection's callbacks log comes after the raise
    assert "Reconnecting" not in caplog.text


async def test_a_connection_the_broker_closes_says_it_reconnects_and_does(caplog: pytest.LogCaptureFixture) -> None:
    name = f"ck-reconnect-{secrets.token_hex(4)}"
    connection = await aio_pika.connect_robust(AMQP_URL, timeout=5, reconnect_interval=0.2,
                                               client_properties={"connection_name": name})
    try:
        assert isinstance(connection, aio_pika.RobustConnection) and connection.connection_attempt == 1
        with caplog.at_level(logging.INFO, logger="aio_pika"):
            assert await asyncio.to_thread(close_connections_named, name) == 1

            async def reconnected() -> bool:
                return connection.connection_attempt == 2 and connection.connected.is_set()

            await wait_until(reconnected, 20, "the robust connection to connect again")
        assert "Reconnecting after 0.2 seconds" in caplog.text
    finally:
        await connection.close()
