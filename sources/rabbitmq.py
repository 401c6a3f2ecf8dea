"""RabbitMQ: a consuming source and the outbox publisher, on aio-pika.

``RabbitMQSource(queue=..., namespace=..., version=...)`` consumes a queue over a robust connection
(it reconnects and consumes again after a broker restart or a dropped connection) and settles each
delivery only after the pipeline decided, that is after the inbox and the effect committed:

============  ==========================================================================================
ACK           ``basic.ack``
RETRY_LATER   a copy to the retry queue whose TTL is the smallest configured delay that covers both the
              pipeline's ``Result.delay`` and this attempt's backoff step (it dead-letters back into the
              queue when the TTL runs out), then ack; ``retry_delays=()`` requeues instead
DEAD_LETTER   a copy to ``<queue>.dlq`` with the reason in ``x-consumer-kit-reason``, then ack;
              ``dead_letter=False`` rejects without requeue (the queue's own dead-letter exchange)
============  ==========================================================================================

The copy is confirmed by the broker before the original is acked, so a crash in between delivers the
message twice, never zero times; the inbox absorbs the repeat. The key is the AMQP ``message_id``
property, or ``key=``: a header name or a callable that picks an immutable business id (aio-pika and
aiormq give every message published without a ``message_id`` a random one, so a publisher that
re-sends after a lost confirm makes a new ``message_id``; key by the business id then). A message
without its id is parked "missing_stable_id" and dead-lettered, never keyed by delivery tag or body.
``envelope="cloudevents"`` keys by the CloudEvent's ``source`` + ``id`` (AMQP binding: structured
mode, or binary mode with ``cloudEvents_*`` / ``cloudEvents:*`` application properties) and hands the
handler the event's data. The attempt number comes from the copy's ``x-consumer-kit-attempt`` header
plus ``x-delivery-count`` (quorum queues) or the redelivered flag.

A parked message goes back on its queue with ``consumer-kit parked replay`` (:meth:`RabbitMQSource.requeuer`):
the copy carries the delivery as the pipeline saw it in a signed ``x-consumer-kit-replay`` header (see
:mod:`consumer_kit.replay`), its ``message_id`` and headers as they were, so it keys the same.

``AmqpPublisher`` implements :class:`consumer_kit.outbox.Publisher`: it publishes outbox rows with
publisher confirms, ``message_id`` = the row id, persistent, and mandatory (an unroutable destination
is a failure, so the row stays pending).

A broker that cannot be reached, or refuses the user or the virtual host, is a
:class:`~consumer_kit.errors.ConfigurationError` whose one line says which (:func:`unreachable`); the
URL in it never shows the password.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

try:
    import aio_pika
    import aiormq.exceptions
    import yarl
    from aio_pika.abc import (
        AbstractChannel,
        AbstractConnection,
        AbstractExchange,
        AbstractQueue,
    )
    from aiormq.abc import DeliveredMessage
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
    from consumer_kit.extras import missing_extra

    raise missing_extra("rabbitmq", "consumer_kit.sources.rabbitmq", exc) from exc

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
from consumer_kit.outbox import OutboxMessage
from consumer_kit.replay import REPLAY_HEADER, Send, unseal
from consumer_kit.retry import START_UP
from consumer_kit.settings import Settings
from consumer_kit.sources.envelopes import EnvelopedSource, KeyFunction, amqp_cloudevent, require_cloudevents
from consumer_kit.tracing import SpanShape

log = logging.getLogger("consumer_kit.sources.rabbitmq")

REASON_HEADER = "x-consumer-kit-reason"
ATTEMPT_HEADER = "x-consumer-kit-attempt"
SOURCE_QUEUE_HEADER = "x-consumer-kit-queue"
NO_ID_HEADER = "x-consumer-kit-no-message-id"
"""Set on a copy of a message that had no ``message_id``: aiormq gives every message it publishes a
random id, and a copy must never be keyed by that."""
UNREADABLE = "unreadable"
"""The reason on the dead-letter copy of a message the source could not turn into a delivery."""
DEFAULT_RETRY_DELAYS = (1.0, 5.0, 30.0, 120.0)
SETTLE_TIMEOUT_SECONDS = 10.0  # how long close() waits for acks and copies already under way
CONNECT_TIMEOUT_SECONDS = 5.0
FAILED_CONNECT_REUSE_SECONDS = 1.0  # AmqpPublisher: how long a failed connect answers later publishes
_BOOKKEEPING = (ATTEMPT_HEADER, REASON_HEADER, SOURCE_QUEUE_HEADER, NO_ID_HEADER, REPLAY_HEADER)


class _SameAsOurError(logging.Filter):
    """aiormq logs a failed connection attempt ("error when creating transport") before it raises;
    the error we raise from it (see :func:`unreachable`) says the same in one line, so the log record
    would only repeat it, with the URL's password in it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("error when creating transport")


logging.getLogger("aiormq.connection").addFilter(_SameAsOurError())


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
        self._settlements = _Settlements()
        self._replays: KeyDigester | None = None  # verifies the replay header of a requeued parked message

    def retry_queue(self, delay: float) -> str:
        """The name of the retry queue for ``delay`` seconds."""
        return f"{self.queue}.retry.{round(delay * 1000)}ms"

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
        # about a tenth of a batched consumer's CPU. What the source reads of a delivery is _Received.
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
        message = _Received(delivered)
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

    def _delivery(self, message: _Received) -> Delivery:
        delivery = to_delivery(message, self._replays)
        if self.envelope == "cloudevents" and not isinstance(delivery, Replayed | RefusedReplay):
            delivery = replace(amqp_cloudevent(delivery, message.content_type), sent_at=delivery.sent_at)
        return delivery

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    def _decided(self, message: _Received, delivery: Delivery, result: Result | None) -> None:
        if result is None:
            return  # nothing decided (the app is stopping): unsettled, the broker delivers it again
        if result.settlement is Settlement.ACK:
            self._settlements.ack(message)
        else:  # a copy to publish, or a pause before a requeue: not in the batch's task
            self._track(self._settled(message, delivery, result))

    async def _deliver(self, message: _Received, delivery: Delivery | None) -> None:
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

    async def _settled(self, message: _Received, delivery: Delivery, result: Result) -> None:
        try:
            await self._settle(message, delivery, result)
        except asyncio.CancelledError:
            raise  # unsettled: the broker redelivers when the channel closes
        except Exception as exc:
            # The copy to the dead-letter or retry queue was not confirmed (usually the connection
            # dropped): the message was not acked, and the broker redelivers it.
            log.warning("%s: copy not published (%s); the broker will redeliver the message",
                        self.name, type(exc).__name__)

    async def _settle(self, message: _Received, delivery: Delivery, result: Result) -> None:
        if result.settlement is Settlement.ACK:
            self._settlements.ack(message)
        elif result.settlement is Settlement.DEAD_LETTER:
            if not self.dead_letter:
                self._settlements.reject(message, requeue=False)
                return
            headers = {REASON_HEADER: result.reason or "dead_letter", SOURCE_QUEUE_HEADER: self.queue}
            await self._republish(message, self.dead_letter_queue, headers)
            self._settlements.ack(message)
        elif not self.retry_delays:
            # No retry queue: give the broker the message back after a short pause, so that a key
            # in progress elsewhere is not spun on at network speed.
            await asyncio.sleep(min(result.delay or 0.0, 1.0))
            self._settlements.nack(message, requeue=True)
        else:
            delay = self._retry_delay(delivery.attempt, result.delay)
            await self._republish(message, self.retry_queue(delay), {ATTEMPT_HEADER: delivery.attempt + 1})
            self._settlements.ack(message)

    def _retry_delay(self, attempt: int, wanted: float | None) -> float:
        """The configured delay for this retry: at least the pipeline's and at least this attempt's step."""
        step = self.retry_delays[min(attempt - 1, len(self.retry_delays) - 1)]
        floor = max(step, wanted or 0.0)
        return next((d for d in self.retry_delays if d >= floor), self.retry_delays[-1])

    async def _republish(self, message: _Received, queue: str,
                         extra: Mapping[str, Any]) -> None:
        assert self._channel is not None
        dropped = ("x-death", "x-delivery-count")  # the broker's per-delivery bookkeeping
        headers = {k: v for k, v in (message.headers or {}).items() if k not in dropped}
        headers.update(extra)
        if not message.message_id:
            headers[NO_ID_HEADER] = 1
        copy = aio_pika.Message(
            body=message.body, headers=headers, message_id=message.message_id,
            content_type=message.content_type, content_encoding=message.content_encoding,
            correlation_id=message.correlation_id, type=message.type, app_id=message.app_id,
            timestamp=message.timestamp, priority=message.priority,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await self._channel.default_exchange.publish(copy, routing_key=queue)

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
                headers: dict[str, Any] = {k: v for k, v in delivery.headers.items() if k not in _BOOKKEEPING}
                headers[REPLAY_HEADER] = sealed
                copy = aio_pika.Message(
                    body=delivery.body, headers=headers, message_id=delivery.id, type=delivery.attributes.get("type"),
                    content_type=delivery.headers.get("content-type"), timestamp=datetime.now(UTC),
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
                await channel.default_exchange.publish(copy, routing_key=self.queue, mandatory=True)

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


class _Settlements:
    """Every settlement of a channel's deliveries (ack, nack, reject), sent in order by one task per
    channel, with acks that are ready together coalesced into one ``basic.ack(multiple=True)``.

    Why one sender: aiormq queues outgoing frames in a bounded queue, and a frame whose ``put`` waits
    for room can be overtaken by a later one. A multiple ack that overtook a single ack, a nack or a
    reject of a lower delivery tag would settle that delivery itself (a nack meant to requeue becomes
    an ack: the message is lost) and the late frame would then close the channel with
    PRECONDITION_FAILED "unknown delivery tag". Sent one at a time, frames cannot overtake each other,
    and what becomes ready while one is on its way is coalesced into the next.

    A multiple ack covers only the longest run of the channel's oldest unsettled deliveries that are
    all ready to be acked; any other settlement is sent on its own, never waiting behind a slow
    neighbour. A delivery that was never settled (cancelled: the broker takes it back when the channel
    closes) stays in the run's way, so a multiple ack never covers it."""

    def __init__(self) -> None:
        # Per channel (aiormq's, by identity): the deliveries not yet settled, in the order the broker
        # sent them (delivery tags ascending); the settlements asked for and not yet sent; the sender.
        self._unsettled: dict[object, dict[int, _Received]] = {}
        self._asked: dict[object, dict[int, _Settlement]] = {}
        self._senders: dict[object, asyncio.Task[None]] = {}

    def received(self, message: _Received) -> None:
        """A delivery arrived: it is unsettled until it is acked, rejected or nacked."""
        tag, channel = message.delivery_tag, _channel(message)
        if tag is None or channel is None:
            return
        if channel not in self._unsettled:  # a new channel (a reconnect): forget the closed ones
            for old in [c for c in self._unsettled if getattr(c, "is_closed", True)]:
                del self._unsettled[old]
                self._asked.pop(old, None)
        self._unsettled.setdefault(channel, {})[tag] = message

    def ack(self, message: _Received) -> None:
        """Ask for ``message`` to be acked; it is sent in order, by the channel's sender."""
        self._ask(message, "ack", requeue=False)

    def nack(self, message: _Received, *, requeue: bool) -> None:
        """Ask for ``message`` to be nacked (``requeue``: given back to the queue)."""
        self._ask(message, "nack", requeue=requeue)

    def reject(self, message: _Received, *, requeue: bool) -> None:
        """Ask for ``message`` to be rejected (``requeue``: given back to the queue)."""
        self._ask(message, "reject", requeue=requeue)

    async def drained(self) -> None:
        """Wait until every settlement asked for has been sent (cancelling the wait stops no sender)."""
        senders = [s for s in self._senders.values() if not s.done()]
        if senders:
            await asyncio.wait(senders)

    def _ask(self, message: _Received, action: str, *, requeue: bool) -> None:
        # Nobody waits for the frame to go out: it is sent in its order by the channel's sender, and
        # one that never reaches the broker (the channel closed) only means a redelivery, which the
        # inbox acknowledges as a duplicate. Waiting would cost every delivery a future and another
        # trip through the event loop, for an error it could do nothing about.
        tag, channel = message.delivery_tag, _channel(message)
        if tag is None or channel is None or tag not in self._unsettled.get(channel, {}):
            # Not one of this channel's unsettled deliveries: its channel closed (the broker takes the
            # delivery back), or it was settled already.
            log.warning("%s of delivery %s not sent: its channel closed or it was settled already; the broker "
                        "redelivers what was not settled", action, tag)
            return
        self._asked.setdefault(channel, {})[tag] = _Settlement(message, action, requeue)
        sender = self._senders.get(channel)
        if sender is None or sender.done():
            self._senders[channel] = asyncio.ensure_future(self._send(channel))

    async def _send(self, channel: object) -> None:
        unsettled = self._unsettled.get(channel, {})
        try:
            while asked := self._asked.pop(channel, {}):
                run: list[int] = []
                for tag in unsettled:  # oldest first
                    if tag not in asked or asked[tag].action != "ack":
                        break
                    run.append(tag)
                if len(run) > 1:
                    last = asked[run[-1]]
                    for tag in run:
                        del asked[tag], unsettled[tag]
                    await last.send(multiple=len(run))
                for tag in sorted(asked):
                    unsettled.pop(tag, None)
                    await asked[tag].send()
        finally:
            self._senders.pop(channel, None)


class _Settlement:
    __slots__ = ("action", "message", "requeue")

    def __init__(self, message: _Received, action: str, requeue: bool) -> None:
        self.message, self.action, self.requeue = message, action, requeue

    async def send(self, *, multiple: int = 0) -> None:
        """Send it (``multiple``: an ack of that many deliveries, this one the newest)."""
        try:
            # aiormq's channel (aio-pika's public ``message.channel``), with ``wait=False``: the frame
            # is queued in order and the next one follows at once, instead of each waiting until the
            # socket drained. Nothing is lost by it: an ack that never reaches the broker redelivers
            # the message, and the inbox acknowledges the repeat.
            channel, tag = self.message.channel, self.message.delivery_tag
            assert tag is not None
            if self.action == "ack":
                await channel.basic_ack(delivery_tag=tag, multiple=multiple > 1, wait=False)
            elif self.action == "nack":
                await channel.basic_nack(delivery_tag=tag, requeue=self.requeue, wait=False)
            else:
                await channel.basic_reject(delivery_tag=tag, requeue=self.requeue, wait=False)
        except Exception as exc:
            # Usually the connection dropped after the commit: the redeliveries are acked as duplicates.
            log.warning("%s of %d deliveries not sent to the broker (%s); it will redeliver them",
                        self.action, max(multiple, 1), type(exc).__name__)


def _channel(message: _Received) -> object | None:
    """The open channel ``message`` came on, or None when it closed (nothing can be settled on it)."""
    try:
        channel = message.channel
    except Exception:  # an aio-pika message (the tests settle those too) raises for a closed channel
        return None
    return None if channel.is_closed else channel


class _Received:
    """A delivery as aiormq hands it over, read the way aio-pika's ``IncomingMessage`` reads it (AMQP's
    ``type`` property is pamqp's ``message_type``), for the fields the source uses, and no more."""

    __slots__ = ("app_id", "body", "channel", "content_encoding", "content_type", "correlation_id",
                 "delivery_tag", "headers", "message_id", "priority", "redelivered", "timestamp", "type")

    def __init__(self, delivered: DeliveredMessage) -> None:
        self.body: bytes = delivered.body
        self.channel: Any = delivered.channel  # aiormq's
        self.delivery_tag: int | None = delivered.delivery_tag
        self.redelivered = bool(delivered.redelivered)
        properties = delivered.header.properties
        self.headers: dict[str, Any] = properties.headers or {}
        self.message_id: str | None = properties.message_id
        self.type: str | None = properties.message_type
        self.timestamp: datetime | None = properties.timestamp
        self.content_type: str | None = properties.content_type
        self.content_encoding: str | None = properties.content_encoding
        self.correlation_id: str | None = properties.correlation_id
        self.app_id: str | None = properties.app_id
        self.priority: int | None = properties.priority


def to_delivery(message: _Received, replays: KeyDigester | None = None) -> Delivery:
    """The :class:`Delivery` of an AMQP message: id from ``message_id`` only, attempt from headers. A
    requeued parked message (its replay header verified with ``replays``) is the delivery it carries."""
    raw = dict(message.headers or {})
    raw.pop("x-death", None)  # the broker's dead-lettering history: bulky, and not the message's
    attempt = _int(raw.get(ATTEMPT_HEADER), 1)
    delivery_count = raw.get("x-delivery-count")
    if delivery_count is not None:
        attempt += _int(delivery_count, 0)
    elif message.redelivered:
        attempt += 1
    attributes = {"type": message.type} if message.type else {}
    message_id = None if raw.get(NO_ID_HEADER) else message.message_id
    sent_at = message.timestamp  # the publisher's own clock, when it set one
    if sent_at is not None and sent_at.tzinfo is None:
        sent_at = sent_at.replace(tzinfo=UTC)  # AMQP timestamps are seconds since the epoch: UTC
    if replays is not None and REPLAY_HEADER in raw:
        return unseal(_text(raw[REPLAY_HEADER]), message.body, replays, attempt=attempt, sent_at=sent_at)
    return Delivery(
        id=message_id, body=message.body,
        headers={k: _text(v) for k, v in raw.items()}, attributes=attributes, attempt=attempt, sent_at=sent_at,
    )


def _int(value: Any, default: int) -> int:
    if value is None:  # the usual case (no such header), and cheaper than a caught TypeError
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


class AmqpPublisher:
    """Publishes outbox rows: ``destination`` is the routing key on ``exchange`` (default: the
    default exchange, so a queue name). Connects lazily and again after any failure. The headers of
    a row are the message's (a traced row's ``traceparent`` among them)."""

    messaging_system = "rabbitmq"

    def __init__(self, url: str | None = None, *, exchange: str = "", settings: Settings | None = None,
                 connection_name: str = "consumer-kit-relay") -> None:
        self.url = url
        self.exchange_name = exchange
        self.settings = settings
        self.connection_name = connection_name
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._lock = asyncio.Lock()
        self._failed: tuple[float, ConfigurationError] | None = None  # the last failed connect, and when

    async def _ready(self) -> AbstractExchange:
        async with self._lock:
            channel, exchange = self._channel, self._exchange
            if exchange is not None and channel is not None and not channel.is_closed:
                return exchange
            await self._drop()
            if self._failed is not None and time.monotonic() - self._failed[0] < FAILED_CONNECT_REUSE_SECONDS:
                # A batch's publishes wait here one behind another: one failed connect answers them all,
                # rather than each waiting out a timeout of its own.
                raise self._failed[1]
            url = (self.settings or Settings()).require_rabbitmq_url(self.url)
            try:
                connection = await aio_pika.connect(
                    url, timeout=CONNECT_TIMEOUT_SECONDS, client_properties={"connection_name": self.connection_name})
            except Exception as exc:
                error = unreachable(exc, url, "the outbox relay")
                self._failed = (time.monotonic(), error)
                raise error from exc
            self._failed = None
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            if self.exchange_name:
                exchange = await channel.get_exchange(self.exchange_name, ensure=True)
            else:
                exchange = channel.default_exchange
            self._connection, self._channel, self._exchange = connection, channel, exchange
            return exchange

    async def check(self) -> None:
        """Connect now (the relay calls it first, to say at once when the broker cannot be reached)."""
        await self._ready()

    async def publish(self, message: OutboxMessage) -> None:
        """Publish and wait for the broker's confirm; raise on nack, return or connection loss."""
        exchange = await self._ready()
        amqp = aio_pika.Message(body=message.body, headers=dict(message.headers), message_id=message.id,
                                delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        try:
            await exchange.publish(amqp, routing_key=message.destination, mandatory=True)
        except (aio_pika.exceptions.DeliveryError, aio_pika.exceptions.PublishError):
            raise  # the broker answered (nack, unroutable): the connection is fine
        except Exception:
            async with self._lock:
                if self._exchange is exchange:  # not one a concurrent publish has just reopened
                    await self._drop()
            raise

    async def _drop(self) -> None:
        connection, self._connection, self._channel, self._exchange = self._connection, None, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()

    async def close(self) -> None:
        """Close the connection."""
        async with self._lock:
            await self._drop()
