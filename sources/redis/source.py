"""The Redis Streams source: :class:`RedisStreamSource` reads a stream through a consumer group and
settles each entry only after the pipeline decided (see the package docstring; the claims and the
retry delay are :mod:`.settlement`, the entry reader :mod:`.message`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio
import redis.exceptions
from prometheus_client import Counter

from consumer_kit.delivery import Delivery, KeyMapper, RefusedReplay, Replayed, Result, Settlement
from consumer_kit.errors import ConfigurationError
from consumer_kit.replay import Send
from consumer_kit.settings import Settings
from consumer_kit.sources.envelopes import KeyFunction, header_cloudevent, require_cloudevents
from consumer_kit.sources.pulling import PullingSource, retry_delay
from consumer_kit.sources.redis.connection import LOST, client, unreachable
from consumer_kit.sources.redis.message import Entry, Fields, dead_letter_copy, entry_order, replay_copy, to_delivery
from consumer_kit.sources.redis.settlement import Claims
from consumer_kit.tracing import SpanShape

log = logging.getLogger("consumer_kit.sources.redis")

DEFAULT_RETRY_DELAYS = (1.0, 5.0, 30.0, 120.0)
BLOCK_MS = 1000  # the longest a read waits for new entries: a stop is seen within it
CLOUDEVENT_PREFIXES = ("ce_",)

CLAIMED = Counter(
    "consumer_kit_redis_claimed_total",
    "Pending entries this consumer took over with XAUTOCLAIM after they sat idle for claim_idle_seconds (the "
    "consumer holding them crashed or was cut off, or their settlement was lost).", ["source"])
TRIMMED = Counter(
    "consumer_kit_redis_trimmed_total",
    "Pending entries found trimmed or deleted from the stream before they were settled (MAXLEN, XTRIM, XDEL): "
    "acknowledged, as they can never be delivered.", ["source"])
LOST_TO_OTHERS = Counter(
    "consumer_kit_redis_lost_total",
    "Held entries the heartbeat found claimed by another consumer (this one went quiet past claim_idle_seconds); "
    "the inbox's lease fences the second run.", ["source"])


class _Acks:
    """The XACKs of the entries settled in one turn of the event loop, sent as one command: each caller
    waits for the reply to its own. A failed XACK fails every caller of it; the group hands those
    entries out again, and the inbox acknowledges each as a duplicate."""

    def __init__(self, client: redis.asyncio.Redis, stream: str, group: str) -> None:
        self._client, self._stream, self._group = client, stream, group
        self._ids: list[str] = []
        self._sent: asyncio.Future[None] | None = None
        self._flushes: set[asyncio.Task[None]] = set()

    async def ack(self, entry_id: str) -> None:
        if self._sent is None:
            loop = asyncio.get_running_loop()
            self._sent = loop.create_future()
            self._sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, even with no waiter left
            flush = loop.create_task(self._flush())  # runs after this turn's other settlements appended theirs
            self._flushes.add(flush)
            flush.add_done_callback(self._flushes.discard)
        self._ids.append(entry_id)
        await asyncio.shield(self._sent)  # a cancelled caller leaves the others' XACK alone

    async def _flush(self) -> None:
        ids, sent = self._ids, self._sent
        self._ids, self._sent = [], None
        assert sent is not None
        try:
            await self._client.xack(self._stream, self._group, *ids)
        except asyncio.CancelledError:
            sent.cancel()
            raise
        except BaseException as exc:
            sent.set_exception(exc)
        else:
            sent.set_result(None)


@dataclass(slots=True)
class _Waiting:
    """A RETRY_LATER entry left pending in this consumer's list until ``due`` (monotonic)."""

    due: float
    refreshed: float


class RedisStreamSource(PullingSource[Entry]):
    """Reads ``stream`` as ``consumer`` of consumer group ``group`` (see the package docstring).

    ``url`` defaults to the ``REDIS_URL`` setting; ``consumer`` to ``<host name>-<process id>``, unique
    per process (two processes must never share a consumer name). ``key`` (a field name, or a
    callable ``(Delivery) -> str``) keys by a business id instead of ``<stream>:<entry id>``;
    ``envelope="cloudevents"`` by the CloudEvent in the entry. An entry idle for ``claim_idle_seconds``
    in another consumer's pending list is taken over. With ``declare=True`` the group is created
    (with the stream, reading it from its first entry) if it does not exist; with ``declare=False`` a
    missing group stops the start with a ConfigurationError.
    """

    def __init__(
        self, *, stream: str, group: str, namespace: str, version: int, url: str | None = None,
        consumer: str | None = None, key: str | KeyFunction | None = None, key_mapper: KeyMapper | None = None,
        body_field: str = "body", envelope: str = "redis", max_in_flight: int = 32,
        claim_idle_seconds: float = 30.0, retry_delays: Sequence[float] = DEFAULT_RETRY_DELAYS,
        dead_letter_stream: str | None = None, declare: bool = True, name: str | None = None,
    ) -> None:
        super().__init__(namespace=namespace, version=version, key=key, key_mapper=key_mapper,
                         max_in_flight=max_in_flight)
        if envelope not in ("redis", "cloudevents"):
            raise ConfigurationError(f"unknown envelope {envelope!r} for Redis; choose 'redis' or 'cloudevents'")
        if envelope == "cloudevents":
            require_cloudevents()
        if claim_idle_seconds <= 0:
            raise ConfigurationError("claim_idle_seconds must be more than 0")
        if not stream or not group or not body_field:
            raise ConfigurationError("stream, group and body_field cannot be empty")
        self.stream, self.group, self.url, self.envelope = stream, group, url, envelope
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.body_field = body_field
        self.claim_idle_seconds = claim_idle_seconds
        self.retry_delays = tuple(retry_delays)
        self.dead_letter_stream = dead_letter_stream or f"{stream}:dead-letter"
        self.declare = declare
        self.name = name or f"redis:{stream}"
        self.span_shape = SpanShape("consumer", system="redis", destination=stream)
        self._body = body_field.encode("utf-8")
        self._client: redis.asyncio.Redis | None = None
        self._claims: Claims | None = None
        self._acks: _Acks | None = None
        self._holding: set[str] = set()  # ids of the entries pulled and not settled yet
        self._waiting: dict[str, _Waiting] = {}  # RETRY_LATER entries, by id
        self._own_cursor: str | None = "0"  # where reading this consumer's own pending list goes on
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._tender: asyncio.Task[None] | None = None
        self._lost = False  # the last call failed because the connection was gone

    def declare_metrics(self) -> None:
        """This source's series, at zero until counted (see consumer_kit.metrics)."""
        for counter in (CLAIMED, TRIMMED, LOST_TO_OTHERS):
            counter.labels(self.name)

    @property
    def _idle_ms(self) -> int:
        return max(1, round(self.claim_idle_seconds * 1000))

    # ---------------------------------------------------------------------------------------------
    # open and close

    async def _open(self, settings: Settings) -> None:
        url = settings.require_redis_url(self.url)
        try:
            self._client = client(url, self.name)
        except (ValueError, TypeError) as exc:
            raise unreachable(exc, url, self.name) from exc
        try:
            await self._client.ping()
            await self._prepare()
        except ConfigurationError:
            await self._shut()
            raise
        except (redis.exceptions.RedisError, OSError) as exc:
            await self._shut()
            raise unreachable(exc, url, self.name) from exc
        self._claims = Claims(self._client, self.stream, self.group, self.consumer)
        self._acks = _Acks(self._client, self.stream, self.group)
        self._own_cursor, self._claim_cursor, self._next_claim = "0", "0-0", 0.0
        self._tender = asyncio.create_task(self._tend(), name=f"{self.name}-retries")
        log.info("reading %s as %s of group %s (max in flight %d)", self.stream, self.consumer, self.group,
                 self.max_in_flight)

    async def _prepare(self) -> None:
        assert self._client is not None
        if self.declare:
            try:
                await self._client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
            except redis.exceptions.ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):
                    raise ConfigurationError(f"{self.name}: cannot create group {self.group!r} on stream "
                                             f"{self.stream!r}: {exc}") from exc
            return
        try:
            groups = await self._client.xinfo_groups(self.stream)
        except redis.exceptions.ResponseError as exc:
            raise ConfigurationError(f"{self.name}: stream {self.stream!r} does not exist (declare=False checks, "
                                     f"and creates nothing)") from exc
        if not any(_text(group.get("name")) == self.group for group in groups):
            raise ConfigurationError(f"{self.name}: stream {self.stream!r} has no consumer group {self.group!r} "
                                     f"(declare=False checks, and creates nothing)")

    async def _shut(self) -> None:
        if self._tender is not None:
            self._tender.cancel()
            await asyncio.gather(self._tender, return_exceptions=True)
            self._tender = None
        connection, self._client = self._client, None
        if connection is None:
            return
        if self._claims is not None:
            with contextlib.suppress(Exception):  # tidiness only: the group lists a consumer until deleted
                await self._claims.forget_consumer_if_idle()
        self._claims = self._acks = None
        with contextlib.suppress(Exception):
            await connection.aclose()

    def unready_reason(self) -> str | None:
        """``broker_disconnected`` while calls fail for want of a connection, else the base's
        ``broker_unreachable`` while pulls keep failing (``/readyz``)."""
        return "broker_disconnected" if self._lost else super().unready_reason()

    def _heartbeat_seconds(self) -> float | None:
        return self.claim_idle_seconds / 2

    @contextlib.contextmanager
    def _watched(self) -> Iterator[None]:
        """Keeps ``_lost`` (``/readyz``): set by a call that found the connection gone, cleared by one that
        got through."""
        try:
            yield
        except LOST:
            self._lost = True
            raise
        self._lost = False

    # ---------------------------------------------------------------------------------------------
    # pulling

    async def _pull(self, count: int) -> Sequence[Entry]:
        """This consumer's own pending entries first (a restart under the same name resumes at once),
        then the retries that are due, then entries idle in other consumers' lists (every half
        ``claim_idle_seconds``), then new ones, waiting up to a second for them."""
        assert self._client is not None
        try:
            entries = await self._pulled(count)
        except redis.exceptions.ResponseError as exc:
            if not (self.declare and str(exc).startswith("NOGROUP")):
                raise
            # The stream or the group went away under us (deleted, or a server restarted without
            # persistence): declared again, from the stream's first entry, and read on.
            log.warning("%s: group %s of %s is gone (NOGROUP); creating it again", self.name, self.group,
                        self.stream)
            await self._prepare()
            raise
        now = time.monotonic()
        for entry in entries:
            entry.refreshed = now
            self._holding.add(entry.id)
        return entries

    async def _pulled(self, count: int) -> list[Entry]:
        with self._watched():
            entries: list[Entry] = []
            if self._own_cursor is not None:
                entries = await self._own_pending(count)
            if not entries:
                entries = await self._due_retries(count)
            if not entries and time.monotonic() >= self._next_claim:
                entries = await self._take_over(count)
            if entries:
                await self._count_deliveries(entries)
            else:
                entries = await self._new(count)
        return entries

    async def _own_pending(self, count: int) -> list[Entry]:
        assert self._client is not None and self._own_cursor is not None
        reply = await self._client.xreadgroup(self.group, self.consumer, {self.stream: self._own_cursor},
                                              count=count)
        found = _read_reply(reply)
        if not found:
            self._own_cursor = None  # read to its end: from now on, only new entries and takeovers
            return []
        self._own_cursor = found[-1][0]
        trimmed = [entry_id for entry_id, fields in found if not fields]  # deleted while pending
        if trimmed:
            await self._client.xack(self.stream, self.group, *trimmed)
            self._trimmed(len(trimmed))
        return self._fresh([(entry_id, fields) for entry_id, fields in found if fields])

    async def _due_retries(self, count: int) -> list[Entry]:
        now = time.monotonic()
        due = sorted((w.due, entry_id) for entry_id, w in self._waiting.items() if w.due <= now)[:count]
        if not due:
            return []
        ids = [entry_id for _, entry_id in due]
        for entry_id in ids:
            del self._waiting[entry_id]
        assert self._claims is not None
        try:
            taken = await self._claims.take(ids)
        except BaseException:
            for entry_id in ids:  # not taken: they wait on, due at once
                self._waiting.setdefault(entry_id, _Waiting(now, now))
            raise
        return self._fresh(taken)

    async def _take_over(self, count: int) -> list[Entry]:
        assert self._client is not None
        reply = await self._client.xautoclaim(self.stream, self.group, self.consumer, self._idle_ms,
                                              self._claim_cursor, count=count)
        cursor, claimed, deleted = _text(reply[0]), list(reply[1]), (list(reply[2]) if len(reply) > 2 else [])
        self._claim_cursor = cursor
        if cursor in ("0-0", "0"):  # the scan went round: the next one in half an idle time
            self._next_claim = time.monotonic() + self.claim_idle_seconds / 2
        if deleted:  # XAUTOCLAIM (Redis 7) took them off the pending list itself
            self._trimmed(len(deleted))
        gone = [_text(entry_id) for entry_id, fields in claimed if not fields]  # Redis 6.2 lists them so
        if gone:
            await self._client.xack(self.stream, self.group, *gone)
            self._trimmed(len(gone))
        taken = [(_text(entry_id), fields) for entry_id, fields in claimed if fields]
        mine = [t for t in taken if t[0] not in self._holding]  # an entry running here already: let it be
        for entry_id, _ in mine:
            self._waiting.pop(entry_id, None)
        if mine:
            CLAIMED.labels(self.name).inc(len(mine))
            log.info("%s: took over %d entr%s idle for %.0f s or more", self.name, len(mine),
                     "y" if len(mine) == 1 else "ies", self.claim_idle_seconds)
        return self._fresh(mine)

    async def _new(self, count: int) -> list[Entry]:
        assert self._client is not None
        now = time.monotonic()
        wake = min([self._next_claim, *(w.due for w in self._waiting.values())])
        block = min(BLOCK_MS, round((wake - now) * 1000))
        reply = await self._client.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count,
                                              block=block if block >= 1 else None)
        return self._fresh(_read_reply(reply))

    @staticmethod
    def _fresh(found: Sequence[tuple[str, Fields]]) -> list[Entry]:
        return [Entry(_text(entry_id), dict(fields)) for entry_id, fields in found]

    async def _count_deliveries(self, entries: list[Entry]) -> None:
        """Each entry's delivery count, from one ``XPENDING`` over their range (the attempt number)."""
        assert self._client is not None
        ordered = sorted(entries, key=lambda e: entry_order(e.id))
        # The range holds these entries and any other of ours between them (held, waiting, or left
        # over from a lost settlement): room for all of them.
        span = 2 * len(entries) + len(self._holding) + len(self._waiting) + 100
        pending = await self._client.xpending_range(self.stream, self.group, ordered[0].id, ordered[-1].id, span,
                                                    consumername=self.consumer)
        counts = {_text(p["message_id"]): int(p["times_delivered"]) for p in pending}
        for entry in entries:
            entry.attempt = max(1, counts.get(entry.id, 1))

    def _trimmed(self, count: int) -> None:
        TRIMMED.labels(self.name).inc(count)
        log.warning("%s: %d pending entr%s had been trimmed or deleted from the stream before being settled; "
                    "acknowledged (they cannot be delivered)", self.name, count, "y" if count == 1 else "ies")

    def _read(self, message: Entry) -> Delivery:
        delivery = to_delivery(message, self.stream, self._body, self._replays)
        if self.envelope == "cloudevents" and not isinstance(delivery, Replayed | RefusedReplay):
            delivery = replace(header_cloudevent(delivery, delivery.headers.get("content-type"), CLOUDEVENT_PREFIXES,
                                                 structured_by_default=True), sent_at=delivery.sent_at)
        return delivery

    # ---------------------------------------------------------------------------------------------
    # settling

    async def _settle(self, message: Entry, delivery: Delivery, result: Result) -> None:
        assert self._client is not None
        try:
            with self._watched():
                if result.settlement is Settlement.ACK:
                    assert self._acks is not None
                    await self._acks.ack(message.id)
                elif result.settlement is Settlement.DEAD_LETTER:
                    await self._dead_letter(message, result)
                else:
                    delay = retry_delay(self.retry_delays, message.attempt, result.delay)
                    now = time.monotonic()
                    # Left pending in this consumer's list; _tend keeps it ours, _pull takes it back when due.
                    self._waiting[message.id] = _Waiting(now + delay, message.refreshed)
        finally:
            self._holding.discard(message.id)

    async def _dead_letter(self, message: Entry, result: Result) -> None:
        """The copy and the ack in one MULTI/EXEC: both happen, or neither (and the entry comes back)."""
        assert self._client is not None
        copy = dead_letter_copy(message, self.stream, result.reason or "dead_letter", result.key_digest)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.xadd(self.dead_letter_stream, copy)  # type: ignore[arg-type]
            pipe.xack(self.stream, self.group, message.id)
            await pipe.execute()

    async def _extend(self, messages: list[Entry]) -> None:
        assert self._claims is not None
        now = time.monotonic()
        with self._watched():
            ours = await self._claims.beat([m.id for m in messages])
        for message in messages:
            if message.id in ours:
                message.refreshed = now
            elif not message.lost:
                message.lost = True
                LOST_TO_OTHERS.labels(self.name).inc()
                log.warning("%s: a held entry was claimed by another consumer while its handler ran here (this one "
                            "went quiet for %.0f s or more); the inbox lease fences the second run", self.name,
                            self.claim_idle_seconds)

    async def _give_back(self, message: Entry) -> None:
        """Marks it idle as if for ``claim_idle_seconds``: another replica's next ``XAUTOCLAIM`` scan takes
        it (a restart under the same consumer name reads it at once)."""
        try:
            if self._claims is not None:
                await self._claims.give_back([message.id], self._idle_ms)
        finally:
            self._holding.discard(message.id)

    async def _tend(self) -> None:
        """Keeps the RETRY_LATER entries waiting here ours: resets their idle time every half
        ``claim_idle_seconds``, so that no other consumer takes one over before its delay is out."""
        every = self.claim_idle_seconds / 2
        while True:
            await asyncio.sleep(max(0.05, every / 2))
            now = time.monotonic()
            due = [entry_id for entry_id, w in self._waiting.items() if now - w.refreshed >= every]
            if not due or self._claims is None:
                continue
            try:
                with self._watched():
                    ours = await self._claims.beat(due)
            except Exception as exc:
                log.warning("%s: could not keep %d waiting retr%s (%s); another consumer may take them over",
                            self.name, len(due), "y" if len(due) == 1 else "ies", type(exc).__name__)
                continue
            for entry_id in due:
                waiting = self._waiting.get(entry_id)
                if waiting is None:
                    continue
                if entry_id in ours:
                    waiting.refreshed = now
                else:  # acknowledged, trimmed, or taken over meanwhile: not ours to run again
                    del self._waiting[entry_id]

    # ---------------------------------------------------------------------------------------------
    # replay

    @contextlib.asynccontextmanager
    async def requeuer(self, settings: Settings) -> AsyncIterator[Send]:
        """A connection for putting parked deliveries back on the stream (``consumer-kit parked replay``):
        each copy is an ``XADD`` of the body, the original fields and the replay field holding the
        delivery (keyed the same, see :mod:`consumer_kit.replay`)."""
        url = settings.require_redis_url(self.url)
        connection = client(url, f"{self.name}-replay")
        try:
            try:
                await connection.ping()
            except (redis.exceptions.RedisError, OSError) as exc:
                raise unreachable(exc, url, f"replaying to {self.stream}") from exc

            async def send(delivery: Replayed, sealed: str) -> None:
                await connection.xadd(self.stream, replay_copy(delivery, sealed, self.body_field))  # type: ignore[arg-type]

            yield send
        finally:
            with contextlib.suppress(Exception):
                await connection.aclose()


def _read_reply(reply: Any) -> list[tuple[str, Fields]]:
    """The entries of an ``XREADGROUP`` reply on one stream (a deleted entry has no fields)."""
    return [(_text(entry_id), dict(fields or {})) for _, batch in reply or [] for entry_id, fields in batch]


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
