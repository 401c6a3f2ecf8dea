"""The NATS source: :class:`NatsSource` pulls from a durable JetStream consumer and settles each message
only after the pipeline decided (see the package docstring; the settlement policy is
:mod:`.settlement`, the message reader :mod:`.message`)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import replace

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from consumer_kit.delivery import Delivery, KeyMapper, RefusedReplay, Replayed, Result
from consumer_kit.errors import ConfigurationError
from consumer_kit.replay import Send
from consumer_kit.settings import Settings
from consumer_kit.sources.envelopes import KeyFunction, header_cloudevent, require_cloudevents
from consumer_kit.sources.nats.connection import connect
from consumer_kit.sources.nats.message import STABLE_IDS, StableId, replay_headers, to_delivery
from consumer_kit.sources.nats.settlement import ACTIONS, SETTLEMENTS, SettlementPolicy
from consumer_kit.sources.pulling import PullingSource
from consumer_kit.tracing import SpanShape

log = logging.getLogger("consumer_kit.sources.nats")

DEFAULT_RETRY_DELAYS = (1.0, 5.0, 30.0, 120.0)
DEFAULT_DEAD_LETTER_SUBJECT = "consumer-kit.dead-letter.{stream}"
PULL_WAIT_SECONDS = 1.0  # a pull that finds nothing waits this long (and stop() at most this long for it)
JETSTREAM_TIMEOUT_SECONDS = 10.0  # a JetStream API call or a copy's PubAck
_NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9_-]")


class NatsSource(PullingSource[Msg]):
    """Pulls the durable consumer ``durable`` (default ``consumer-kit-<namespace>``) of ``stream``,
    filtered to ``subject``; ``max_in_flight`` bounds the messages held at once.

    ``stable_id`` chooses the key: ``"msg-id"`` (the ``Nats-Msg-Id`` header) or ``"sequence"`` (the
    stream and its sequence); ``key`` (a header name, or a callable ``(Delivery) -> str``) keys by a
    business id instead; ``envelope="cloudevents"`` by the CloudEvent inside.

    ``url`` defaults to the ``NATS_URL`` setting. With ``declare=True`` (the default) the stream is
    created if missing (file storage, capturing ``subject``), the dead-letter stream likewise, and the
    durable consumer is created with explicit acks, ``ack_wait_seconds`` and ``max_deliver``; with
    ``declare=False`` they are only looked up, and a missing one stops the start with a ConfigurationError.
    Either way the consumer must ack explicitly, and its ``max_deliver`` must leave room for
    ``MAX_DELIVERIES`` (else JetStream would stop delivering a message before consumer-kit parks it).
    """

    def __init__(
        self,
        *,
        stream: str,
        subject: str,
        namespace: str,
        version: int,
        durable: str | None = None,
        url: str | None = None,
        stable_id: StableId = "msg-id",
        key: str | KeyFunction | None = None,
        key_mapper: KeyMapper | None = None,
        envelope: str = "nats",
        max_in_flight: int = 32,
        ack_wait_seconds: float = 30.0,
        max_deliver: int | None = None,
        retry_delays: Sequence[float] = DEFAULT_RETRY_DELAYS,
        dead_letter_subject: str | None = DEFAULT_DEAD_LETTER_SUBJECT,
        double_ack: bool = False,
        declare: bool = True,
        name: str | None = None,
    ) -> None:
        super().__init__(namespace=namespace, version=version, key=key, key_mapper=key_mapper,
                         max_in_flight=max_in_flight)
        if stable_id not in STABLE_IDS:
            raise ConfigurationError(f"unknown stable_id {stable_id!r}; choose 'msg-id' or 'sequence'")
        if envelope not in ("nats", "cloudevents"):
            raise ConfigurationError(f"unknown envelope {envelope!r} for NATS; choose 'nats' or 'cloudevents'")
        if envelope == "cloudevents":
            require_cloudevents()
        if ack_wait_seconds <= 0 or not retry_delays or min(retry_delays) < 0:
            raise ConfigurationError("ack_wait_seconds must be positive, retry_delays non-negative (at least one)")
        self.stream, self.subject, self.stable_id, self.envelope = stream, subject, stable_id, envelope
        self.durable = durable or _NOT_IN_A_NAME.sub("-", f"consumer-kit-{namespace}")
        self.name = name or f"nats:{stream}/{self.durable}"
        self.url = url
        self.ack_wait_seconds = ack_wait_seconds
        self.max_deliver = max_deliver
        self.retry_delays = tuple(sorted(retry_delays))
        self.dead_letter_subject = dead_letter_subject.format(stream=stream) if dead_letter_subject else None
        self.dead_letter_stream = f"{stream}_DEAD_LETTER"
        self.declare = declare
        self.span_shape = SpanShape("consumer", system="nats", destination=subject)
        self._policy = SettlementPolicy(self.name, self.retry_delays, self.dead_letter_subject, double_ack)
        self._client: Client | None = None
        self._js: JetStreamContext | None = None
        self._subscription: JetStreamContext.PullSubscription | None = None
        self._ack_wait = ack_wait_seconds  # the consumer's, once started

    def declare_metrics(self) -> None:
        """This source's series, at zero until counted (see consumer_kit.metrics)."""
        for action in ACTIONS:
            SETTLEMENTS.labels(self.name, action)

    # ---------------------------------------------------------------------------------------------
    # the transport's part of PullingSource

    async def _open(self, settings: Settings) -> None:
        url = settings.require_nats_url(self.url)
        self._client = client = await connect(url, self.name, on_disconnected=self._disconnected,
                                              on_reconnected=self._reconnected)
        try:
            self._js = client.jetstream(timeout=JETSTREAM_TIMEOUT_SECONDS)
            await self._prepare(self._js, settings)
            self._subscription = await self._js.pull_subscribe_bind(durable=self.durable, stream=self.stream)
        except BaseException:
            await self._shut()
            raise
        log.info("%s: pulling %s (stream %s, %d in flight at most, ack_wait %.1f s)", self.name, self.subject,
                 self.stream, self.max_in_flight, self._ack_wait)

    async def _prepare(self, js: JetStreamContext, settings: Settings) -> None:
        try:
            if self.declare:
                await _ensure_stream(js, self.stream, self.subject)
                if self.dead_letter_subject is not None:
                    await _ensure_stream(js, self.dead_letter_stream, self.dead_letter_subject)
                await self._ensure_consumer(js)
            elif self.dead_letter_subject is not None:
                await js.find_stream_name_by_subject(self.dead_letter_subject)
            info = await js.consumer_info(self.stream, self.durable)
        except NotFoundError as exc:
            raise ConfigurationError(f"{self.name}: a stream or consumer it needs is missing (declare=False only "
                                     f"looks them up): {exc.description or exc}") from exc
        except APIError as exc:
            raise ConfigurationError(f"{self.name}: JetStream refused the set-up: {exc.description or exc}") from exc
        config = info.config
        if config.ack_policy not in (None, AckPolicy.EXPLICIT):
            raise ConfigurationError(f"{self.name}: consumer {self.durable} acks {config.ack_policy}; consumer-kit "
                                     f"needs explicit acks (it acknowledges each message after its commit)")
        limit = config.max_deliver
        if limit is not None and limit > 0 and limit < settings.max_deliveries:
            raise ConfigurationError(
                f"{self.name}: consumer {self.durable} has max_deliver {limit}, below MAX_DELIVERIES "
                f"{settings.max_deliveries}: JetStream would stop delivering a failing message before consumer-kit "
                f"parks it; raise max_deliver (or -1) or lower MAX_DELIVERIES")
        self._ack_wait = config.ack_wait or self.ack_wait_seconds

    async def _ensure_consumer(self, js: JetStreamContext) -> None:
        config = ConsumerConfig(durable_name=self.durable, ack_policy=AckPolicy.EXPLICIT,
                                ack_wait=self.ack_wait_seconds, max_deliver=self.max_deliver or -1,
                                filter_subject=self.subject,
                                max_ack_pending=max(1000, 4 * self.max_in_flight))
        try:
            await js.add_consumer(self.stream, config)
        except APIError as exc:
            if not await _exists(js.consumer_info(self.stream, self.durable)):
                raise
            # It exists with another configuration (an operator's, or this source's before a change):
            # kept as it is, and checked by _prepare.
            log.info("%s: consumer %s exists with its own configuration, used as it is (%s)", self.name,
                     self.durable, exc.description or type(exc).__name__)

    async def _pull(self, count: int) -> Sequence[Msg]:
        assert self._subscription is not None
        try:
            return await self._subscription.fetch(count, timeout=PULL_WAIT_SECONDS)
        except TimeoutError:
            # Nothing to do (or the connection is being re-established: unready_reason says so). Not
            # only nats.errors.TimeoutError: when the no-wait probe's answer takes up the whole wait,
            # nats-py's fetch raises asyncio's own TimeoutError, which an idle consumer meets often.
            return []

    def _read(self, message: Msg) -> Delivery:
        delivery = to_delivery(message, self.stable_id, self._replays)
        if self.envelope == "cloudevents" and not isinstance(delivery, Replayed | RefusedReplay):
            content_type = next((v for k, v in delivery.headers.items() if k.lower() == "content-type"), None)
            delivery = replace(header_cloudevent(delivery, content_type, ("ce-",), structured_by_default=True),
                               sent_at=delivery.sent_at)
        return delivery

    async def _settle(self, message: Msg, delivery: Delivery, result: Result) -> None:
        await self._policy.settle(message, delivery.attempt, result, self._copy)

    async def _copy(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        assert self._js is not None
        await self._js.publish(subject, body, headers=headers, timeout=JETSTREAM_TIMEOUT_SECONDS)

    def _heartbeat_seconds(self) -> float:
        return self._ack_wait / 2

    async def _extend(self, messages: list[Msg]) -> None:
        for message in messages:
            await message.in_progress()
            SETTLEMENTS.labels(self.name, "in_progress").inc()

    async def _give_back(self, message: Msg) -> None:
        # Given back as the source stops: its last pull may still wait (PULL_WAIT_SECONDS) and would
        # take the message straight back, only to give it back again, a delivery spent for nothing.
        # Held back that long, it goes to whichever consumer pulls next.
        await message.nak(delay=PULL_WAIT_SECONDS)

    async def _shut(self) -> None:
        client, self._client, self._js, self._subscription = self._client, None, None, None
        if client is not None and not client.is_closed:
            with contextlib.suppress(Exception):
                await client.flush(timeout=2)  # the acks written into the buffer go out first
            with contextlib.suppress(Exception):
                await client.close()

    # ---------------------------------------------------------------------------------------------
    # connection state, replay

    async def _disconnected(self) -> None:
        if self._client is not None:
            log.warning("%s: disconnected from NATS; reconnecting (/readyz reports it meanwhile)", self.name)

    async def _reconnected(self) -> None:
        log.info("%s: reconnected to NATS", self.name)

    def unready_reason(self) -> str | None:
        """``broker_disconnected`` while the connection is being re-established (``/readyz``)."""
        if self._client is None or not self._client.is_connected:
            return "broker_disconnected"
        return super().unready_reason()

    @contextlib.asynccontextmanager
    async def requeuer(self, settings: Settings) -> AsyncIterator[Send]:
        """A connection for putting parked deliveries back on their subject (``consumer-kit parked
        replay``): each copy is acknowledged by the stream (its ``PubAck``); its headers are the
        original's, and the replay header holds the delivery."""
        client = await connect(settings.require_nats_url(self.url), f"{self.name}-replay")
        try:
            js = client.jetstream(timeout=JETSTREAM_TIMEOUT_SECONDS)

            async def send(delivery: Replayed, sealed: str) -> None:
                subject = delivery.attributes.get("subject") or delivery.headers.get("nats-subject") or self.subject
                if any(token in ("*", ">") for token in subject.split(".")):
                    raise ConfigurationError(f"{self.name}: the parked delivery has no subject to go back to")
                await js.publish(subject, delivery.body, headers=replay_headers(delivery, sealed))

            yield send
        finally:
            with contextlib.suppress(Exception):
                await client.close()


async def _ensure_stream(js: JetStreamContext, name: str, subject: str) -> None:
    """Create stream ``name`` capturing ``subject`` (file storage) unless it exists (then it is kept)."""
    if await _exists(js.stream_info(name)):
        return
    await js.add_stream(StreamConfig(name=name, subjects=[subject], storage=StorageType.FILE))
    log.info("created JetStream stream %s for %s", name, subject)


async def _exists(lookup: Awaitable[object]) -> bool:
    try:
        await lookup
    except NotFoundError:
        return False
    return True
