"""The RabbitMQ source: :class:`RabbitMQSource` consumes a queue over a robust connection and settles
each delivery only after the pipeline decided (see the package docstring; the settlement policy is
:mod:`.settlement`, the message reader :mod:`.message`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from typing import Any

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractQueue
from aiormq.abc import DeliveredMessage

from consumer_kit.delivery import (
    Decided,
    Delivery,
    Dispatch,
    DispatchSoon,
    KeyMapper,
    Outcome,
    RefusedReplay,
    Replayed,
    Result,
    Settlement,
)
from consumer_kit.errors import ConfigurationError
from consumer_kit.keys import KeyDigester
from consumer_kit.replay import Send
from consumer_kit.retry import START_UP
from consumer_kit.settings import Settings
from consumer_kit.sources.envelopes import EnvelopedSource, KeyFunction, amqp_cloudevent, require_cloudevents
from consumer_kit.sources.rabbitmq.connection import CONNECT_TIMEOUT_SECONDS, unreachable
from consumer_kit.sources.rabbitmq.message import UNREADABLE, Received, copy_of, replay_copy, to_delivery
from consumer_kit.sources.rabbitmq.settlement import SettlementPolicy, Settlements
from consumer_kit.tracing import SpanShape

log = logging.getLogger("consumer_kit.sources.rabbitmq")

DEFAULT_RETRY_DELAYS = (1.0, 5.0, 30.0, 120.0)
SETTLE_TIMEOUT_SECONDS = 10.0  # how long close() waits for acks and copies already under way


class RabbitMQSource(EnvelopedSource):
    """Consumes ``queue``; ``prefetch`` bounds how many deliveries are processed at once.

    ``key`` (a header name, or a callable ``(Delivery) -> str``) keys by a business id instead of the
    ``message_id``; ``envelope="cloudevents"`` by the CloudEvent inside (see the module docstring).

    ``url`` defaults to the ``RABBITMQ_URL`` setting. With ``declare=True`` (the default) the queue,
    its dead-letter queue and the retry queues are declared durable (``queue_arguments`` for the main
    queue, e.g. ``{"x-queue-type": "quorum"}``); with ``declare=False`` they are only checked
    passively, and a missing one stops the start with a ConfigurationError.
    """

    def __init__(
        self,
        *,
        queue: str,
        namespace: str,
        version: int,
        url: str | None = None,
        prefetch: int = 32,
        name: str | None = None,
        key_mapper: KeyMapper | None = None,
        key: str | KeyFunction | None = None,
        envelope: str = "amqp",
        declare: bool = True,
        queue_arguments: Mapping[str, Any] | None = None,
        dead_letter: bool = True,
        dead_letter_queue: str | None = None,
        retry_delays: Sequence[float] = DEFAULT_RETRY_DELAYS,
    ) -> None:
        super().__init__(namespace=namespace, version=version, key=key, key_mapper=key_mapper)
        if prefetch < 1:
            raise ConfigurationError("prefetch must be at least 1")
        if envelope not in ("amqp", "cloudevents"):
            raise ConfigurationError(f"unknown envelope {envelope!r} for RabbitMQ; choose 'amqp' or 'cloudevents'")
        if envelope == "cloudevents":
            require_cloudevents()
        self.envelope = envelope
        self.queue = queue
        self.name = name or f"rabbitmq:{queue}"
        self.url = url
        self.prefetch = prefetch
        self.declare = declare
        self.queue_arguments = dict(queue_arguments or {})
        self.dead_letter = dead_letter
        self.dead_letter_queue = dead_letter_queue or f"{queue}.dlq"
        self.retry_delays = tuple(sorted(retry_delays))
        self.span_shape = SpanShape("consumer", system="rabbitmq", destination=queue)
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._consumer: tuple[aiormq.abc.AbstractChannel, str] | None = None  # the channel and consumer tag
        self._dispatch: Dispatch | None = None
        self._soon: Callable[[Delivery, Decided], bool] | None = None
        self._in_flight: set[asyncio.Task[Any]] = set()
        self._settlements = Settlements()
        self._policy = SettlementPolicy(queue, self.dead_letter_queue if dead_letter else None, self.retry_delays)
        self._replays: KeyDigester | None = None  # verifies the replay header of a requeued parked message

    def retry_queue(self, delay: float) -> str:
        """The name of the retry queue for ``delay`` seconds."""
        return self._policy.retry_queue(delay)

    async def start(self, dispatch: Dispatch, settings: Settings) -> None:
        """Connect (to ``url``, else the app's ``RABBITMQ_URL``), declare (or check) the queues, and
        begin consuming."""
        url = settings.require_rabbitmq_url(self.url)
        self._dispatch = dispatch
        self._soon = dispatch.soon if isinstance(dispatch, DispatchSoon) else None
        self._replays = settings.digester()
        budget = START_UP.budget()
        while True:
            try:
                self._connection = await aio_pika.connect_robust(
                    url, timeout=CONNECT_TIMEOUT_SECONDS, client_properties={"connection_name": self.name})
            except Exception as exc:
                raise unreachable(exc, url, self.name) from exc
            try:
                self._channel = await self._connection.channel(publisher_confirms=True)
                await self._channel.set_qos(prefetch_count=self.prefetch)
                self._queue = await self._declare(self._channel)
                await self._consume()
                break
            except (asyncio.CancelledError, aiormq.exceptions.AMQPConnectionError,
                    aio_pika.exceptions.ChannelInvalidStateError) as exc:
                # The broker closed the connection while the channel and queues were being set up (a
                # restart, an operator, a failover): start over on a new one, a few times. A queue that
                # is missing or declared otherwise closes the channel, not the connection: not retried.
                # aiormq cancels the calls in flight on a closed connection: a CancelledError is the
                # broker's unless this task is being cancelled itself (a stop during start-up).
                await self._drop_connection()
                task = asyncio.current_task()
                if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
                    raise
                delay = budget.next_delay()
                if delay is None:
                    raise ConfigurationError(f"{self.name}: the broker kept closing the connection while the"
                                             f" queues were being set up ({type(exc).__name__})") from exc
                log.warning("%s: the broker closed the connection during start-up (%s); connecting again in"
                            " %.1f s", self.name, type(exc).__name__, delay)
                await asyncio.sleep(delay)
            except BaseException:  # a queue missing or declared otherwise: nothing of this start is kept
                await self._drop_connection()
                raise
        if isinstance(self._channel, aio_pika.RobustChannel):
            # A robust channel reopens after a broker restart or a dropped connection, and declares
            # its queues again; the consumer is ours to start again (see _consume).
            self._channel.reopen_callbacks.add(self._consume_again)
        log.info("consuming %s (prefetch %d)", self.queue, self.prefetch)

    async def _consume(self) -> None:
        # Consumed through aiormq's channel under aio-pika's (``get_underlay_channel``, public API of
        # both): aiormq hands each delivery to _on_delivered in a task; aio-pika would build an
        # IncomingMessage of every property and start a second task for the callback, which measured
        # about a tenth of a batched consumer's CPU. What the source reads of a delivery is Received.
        assert self._channel is not None
        underlay = await self._channel.get_underlay_channel()
        ok = await underlay.basic_consume(self.queue, self._on_delivered, no_ack=False)
        assert ok.consumer_tag is not None  # the broker names the consumer when we do not
        self._consumer = (underlay, ok.consumer_tag)

    async def _consume_again(self, *_: Any) -> None:
        if self._consumer is None:  # stopped
            return
        try:
            await self._consume()
        except Exception as exc:  # aio-pika gathers reopen callbacks without telling anyone
            log.error("%s: could not consume %s again after the channel reopened (%s); /readyz reports it",
                      self.name, self.queue, type(exc).__name__)

    async def _declare(self, channel: AbstractChannel) -> AbstractQueue:
        retries: dict[str, dict[str, Any]] = {
            self.retry_queue(d): {"x-message-ttl": round(d * 1000), "x-dead-letter-exchange": "",
                                  "x-dead-letter-routing-key": self.queue}
            for d in self.retry_delays
        }
        if not self.declare:
            try:
                for extra in ([self.dead_letter_queue] if self.dead_letter else []) + list(retries):
                    # A channel of its own: a failed passive declare closes the channel it ran on.
                    async with self._scratch_channel() as scratch:
                        await scratch.declare_queue(extra, passive=True)
                return await channel.declare_queue(self.queue, passive=True)
            except aio_pika.exceptions.ChannelClosed as exc:
                raise ConfigurationError(
                    f"{self.name}: a queue it needs is missing (declare=False checks passively): {exc}"
                ) from exc
        queue = await channel.declare_queue(self.queue, durable=True, arguments=self.queue_arguments or None)
        if self.dead_letter:
            await channel.declare_queue(self.dead_letter_queue, durable=True)
        for name, arguments in retries.items():
            await channel.declare_queue(name, durable=True, arguments=arguments)
        return queue

    @contextlib.asynccontextmanager
    async def _scratch_channel(self) -> Any:
        assert self._connection is not None
        channel = await self._connection.channel()
        try:
            yield channel
        finally:
            with contextlib.suppress(Exception):
                await channel.close()

    async def _on_delivered(self, delivered: DeliveredMessage) -> None:
        message = Received(delivered)
        self._settlements.received(message)
        delivery: Delivery | None = None
        if self._soon is not None:
            with contextlib.suppress(Exception):  # the task below meets the same error and says what it was
                delivery = self._delivery(message)
            if delivery is not None and self._soon(delivery, functools.partial(self._decided, message, delivery)):
                return  # a batched handler's: its batch runs in a task of its own, and tells _decided
        # A channel that closes (a broker restart, a connection cut) cancels the callbacks it is
        # running. This one only starts the delivery in a task of its own and returns; nothing awaits
        # that task, so nothing cancels it with the callback: the delivery finishes and commits, its
        # ack is lost with the channel, and the redelivery is acknowledged as a duplicate, which is
        # cheaper and safer than rolling finished work back. stop() still cancels it past the grace.
        self._track(self._deliver(message, delivery))

    def _delivery(self, message: Received) -> Delivery:
        delivery = to_delivery(message, self._replays)
        if self.envelope == "cloudevents" and not isinstance(delivery, Replayed | RefusedReplay):
            delivery = replace(amqp_cloudevent(delivery, message.content_type), sent_at=delivery.sent_at)
        return delivery

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    def _decided(self, message: Received, delivery: Delivery, result: Result | None) -> None:
        if result is None:
            return  # nothing decided (the app is stopping): unsettled, the broker delivers it again
        if result.settlement is Settlement.ACK:
            self._settlements.ack(message)
        else:  # a copy to publish, or a pause before a requeue: not in the batch's task
            self._track(self._settled(message, delivery, result))

    async def _deliver(self, message: Received, delivery: Delivery | None) -> None:
        assert self._dispatch is not None
        if delivery is None:
            try:
                delivery = self._delivery(message)
            except Exception as exc:
                # Reading it failed where it never should (every malformed field we know of becomes a
                # delivery the pipeline parks): held unacked, it would come back and fail for ever.
                log.warning("%s: a message could not be read (%s); dead-lettered as unreadable", self.name,
                            type(exc).__name__)
                unread = Delivery(id=None, body=message.body, attempt=1)
                await self._settled(message, unread, Result(Outcome.INVALID, Settlement.DEAD_LETTER, UNREADABLE))
                return
        result = await self._dispatch(delivery)  # never raises, but for a cancellation
        await self._settled(message, delivery, result)

    async def _settled(self, message: Received, delivery: Delivery, result: Result) -> None:
        try:
            await self._settle(message, delivery, result)
        except asyncio.CancelledError:
            raise  # unsettled: the broker redelivers when the channel closes
        except Exception as exc:
            # The copy to the dead-letter or retry queue was not confirmed (usually the connection
            # dropped): the message was not acked, and the broker redelivers it.
            log.warning("%s: copy not published (%s); the broker will redeliver the message",
                        self.name, type(exc).__name__)

    async def _settle(self, message: Received, delivery: Delivery, result: Result) -> None:
        await self._policy.settle(message, delivery.attempt, result, self._settlements, self._republish)

    async def _republish(self, message: Received, queue: str, extra: Mapping[str, Any]) -> None:
        assert self._channel is not None
        await self._channel.default_exchange.publish(copy_of(message, extra), routing_key=queue)

    @contextlib.asynccontextmanager
    async def requeuer(self, settings: Settings) -> AsyncIterator[Send]:
        """A connection for putting parked deliveries back on the queue (``consumer-kit parked replay``):
        each copy is persistent, mandatory (a missing queue is an error) and confirmed by the broker;
        its headers and ``message_id`` are the original's, and the replay header holds the delivery."""
        url = settings.require_rabbitmq_url(self.url)
        try:
            connection = await aio_pika.connect(url, timeout=CONNECT_TIMEOUT_SECONDS,
                                                client_properties={"connection_name": f"{self.name}-replay"})
        except Exception as exc:
            raise unreachable(exc, url, f"replaying to {self.queue}") from exc
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)

            async def send(delivery: Replayed, sealed: str) -> None:
                await channel.default_exchange.publish(replay_copy(delivery, sealed), routing_key=self.queue,
                                                       mandatory=True)

            yield send
        finally:
            with contextlib.suppress(Exception):
                await connection.close()

    def unready_reason(self) -> str | None:
        """``broker_disconnected`` while the robust connection is being re-established (``/readyz``)."""
        if self._connection is None or not self._connection.connected.is_set():
            return "broker_disconnected"
        if self._consumer is not None and self._consumer[0].is_closed:  # reopened without our consumer
            return "broker_disconnected"
        return None

    async def stop(self) -> None:
        """Cancel the consumer: the broker sends no more; deliveries already received go on."""
        if self._consumer is not None:
            (underlay, tag), self._consumer = self._consumer, None
            with contextlib.suppress(Exception):
                await underlay.basic_cancel(tag)

    async def close(self) -> None:
        """Wait for settlements in progress (bounded), then close the connection; whatever is still
        unacknowledged goes back to the queue."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_SECONDS
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=SETTLE_TIMEOUT_SECONDS)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self._settlements.drained()
        await self._drop_connection()
        self._queue = None
        self._dispatch = self._soon = None

    async def _drop_connection(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()

