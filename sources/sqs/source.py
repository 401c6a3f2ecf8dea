"""SQSSource: receives an SQS queue on its own threads and settles each message after the commit (the
message reader is :mod:`.message`, the settlement policy :mod:`.settlement`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from prometheus_client import Counter

from consumer_kit.delivery import Delivery, Dispatch, KeyMapper, Replayed, Result
from consumer_kit.errors import ConfigurationError
from consumer_kit.keys import KeyDigester
from consumer_kit.replay import Send
from consumer_kit.settings import Settings
from consumer_kit.sources.envelopes import (
    ENVELOPES,
    EnvelopedSource,
    KeyFunction,
    is_s3_test_event,
    require_cloudevents,
)
from consumer_kit.sources.pulling import OneAtATime
from consumer_kit.sources.sqs.client import (
    BATCH_MAX,
    MAX_VISIBILITY_SECONDS,
    BatchAction,
    SqsClient,
    error_code,
    explain,
    log,
)
from consumer_kit.sources.sqs.held import HeldMessage, Slots
from consumer_kit.sources.sqs.message import replay_message, to_deliveries
from consumer_kit.sources.sqs.queue import inspect_queue
from consumer_kit.sources.sqs.settlement import Act, SettlementPolicy, dead_letter_copy
from consumer_kit.tracing import SpanShape

DEFAULT_RETRY_DELAYS = (1.0, 5.0, 30.0, 120.0)
SETTLE_THREADS = 4  # pool threads besides the pollers': deletes, visibility changes, dead-letter copies
SETTLE_TIMEOUT_SECONDS = 10.0  # how long close() waits for settlements already under way
_SYSTEM_ATTRIBUTES = ["ApproximateReceiveCount", "SentTimestamp", "MessageGroupId", "AWSTraceHeader"]

S3_TEST_EVENTS = Counter("consumer_kit_sqs_s3_test_events_total",
                         "s3:TestEvent messages acknowledged without a delivery.", ["source"])
RECEIVED_WHILE_HELD = Counter(
    "consumer_kit_sqs_received_while_held_total",
    "Messages SQS delivered again while the source still held them (a lapsed visibility timeout, or SQS's "
    "at-least-once delivery); run once, settled with the newest receipt handle.", ["source"])
SETTLEMENTS = Counter(
    "consumer_kit_sqs_settlements_total",
    "Settlements of received messages that SQS confirmed: delete (done, duplicate or parked), visibility "
    "(back to the queue later: retry, or left for the redrive policy), dead_letter_copy.", ["source", "action"])
RECEIVE_FAILURES = Counter("consumer_kit_sqs_receive_failures_total",
                           "ReceiveMessage calls that failed (the source backs off and goes on).", ["source"])


def _check(*, queue_url: str | None, queue_name: str | None, envelope: str, max_in_flight: int, pollers: int,
           visibility_timeout: int | None, retry_delays: Sequence[float]) -> None:
    """SQSSource's arguments, checked at construction: a mistake is a ConfigurationError there."""
    if (queue_url is None) == (queue_name is None):
        raise ConfigurationError("pass exactly one of queue_url= and queue_name=")
    if envelope not in ENVELOPES:
        raise ConfigurationError(f"unknown envelope {envelope!r}; choose from {', '.join(ENVELOPES)}")
    if envelope == "cloudevents":
        require_cloudevents()
    if max_in_flight < 1 or pollers < 1:
        raise ConfigurationError("max_in_flight and pollers must be at least 1")
    if visibility_timeout is not None and not 1 <= visibility_timeout <= MAX_VISIBILITY_SECONDS:
        raise ConfigurationError(f"visibility_timeout must be 1..{MAX_VISIBILITY_SECONDS} seconds")
    if not retry_delays or min(retry_delays) < 0:
        raise ConfigurationError("retry_delays must be non-negative seconds, at least one")


class SQSSource(EnvelopedSource):
    """Receives ``queue_url`` (or ``queue_name``, looked up at start) and hands each message to the
    pipeline; see the package docstring for settlement, heartbeat, dead letters and FIFO queues.

    ``max_in_flight`` bounds the messages held at once (receives never ask for more than the free
    slots); ``pollers`` long polls run at once. ``visibility_timeout`` (default: the queue's) is
    extended every ``heartbeat_interval`` (default: a third of it) while a message is held.
    ``dead_letter_queue_url``: where parked messages are copied; without it the queue's redrive
    policy moves them. ``endpoint_url`` and ``region`` override ``SQS_ENDPOINT_URL`` / ``SQS_REGION``.
    ``settle_linger``: how long a delete or visibility change waits for others to share its call
    while messages are still in the pipeline (fewer calls: SQS bills per request).
    """

    def __init__(
        self,
        *,
        queue_url: str | None = None,
        queue_name: str | None = None,
        namespace: str,
        version: int,
        envelope: str = "sqs",
        key: str | KeyFunction | None = None,
        key_mapper: KeyMapper | None = None,
        max_in_flight: int = 32,
        visibility_timeout: int | None = None,
        heartbeat_interval: float | None = None,
        dead_letter_queue_url: str | None = None,
        pollers: int = 2,
        retry_delays: Sequence[float] = DEFAULT_RETRY_DELAYS,
        endpoint_url: str | None = None,
        region: str | None = None,
        name: str | None = None,
        settle_linger: float = 0.02,
    ) -> None:
        super().__init__(namespace=namespace, version=version, key=key, key_mapper=key_mapper)
        _check(queue_url=queue_url, queue_name=queue_name, envelope=envelope, max_in_flight=max_in_flight,
               pollers=pollers, visibility_timeout=visibility_timeout, retry_delays=retry_delays)
        self.queue_url, self.queue_name = queue_url, queue_name
        self.name = name or f"sqs:{queue_name or (queue_url or '').rstrip('/').rsplit('/', 1)[-1]}"
        self.envelope = envelope
        self.max_in_flight = max_in_flight
        self.visibility_timeout = visibility_timeout
        self.heartbeat_interval = heartbeat_interval
        self.dead_letter_queue_url = dead_letter_queue_url
        self.pollers = pollers
        self.retry_delays = tuple(sorted(retry_delays))
        self._policy = SettlementPolicy(self.retry_delays, dead_letter_queue_url)
        self.endpoint_url, self.region = endpoint_url, region
        self.settle_linger = settle_linger
        self.span_shape = SpanShape("consumer", system="aws_sqs", destination=self.name.split(":", 1)[-1])
        self.fifo = False
        self._sqs: SqsClient | None = None
        self._dispatch: Dispatch | None = None
        self._url = ""
        self._timeout = 0  # the visibility timeout in force
        self._beat_every = 0.0
        self._wait = 20
        self._messages: dict[str, HeldMessage] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._groups: dict[str, HeldMessage] = {}  # FIFO: the newest held message of each group
        self._keys = OneAtATime()  # keys being dispatched now
        self._unsettled = 0  # held messages not yet settling (running, or about to)
        self._pollers: set[asyncio.Task[None]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._slots = Slots(max_in_flight)
        self._stopping = False
        self._halt = threading.Event()  # the stop flag as the polling threads see it
        # Redrive mode: ids of messages parked here and left for the redrive policy to move, so a
        # message going round to maxReceiveCount is not parked again each time.
        self._left_for_redrive: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._deletes: BatchAction | None = None
        self._visibility: BatchAction | None = None
        self._replays: KeyDigester | None = None  # verifies the replay attribute of a requeued parked message

    @property
    def held(self) -> int:
        """Messages received and not settled yet (their visibility is extended while they are held)."""
        return len(self._messages)

    # ---------------------------------------------------------------------------------------------
    # start and stop

    def declare_metrics(self) -> None:
        """This source's series, at zero until counted (see consumer_kit.metrics)."""
        for counter in (S3_TEST_EVENTS, RECEIVED_WHILE_HELD, RECEIVE_FAILURES):
            counter.labels(self.name)
        for action in ("delete", "visibility", "dead_letter_copy"):
            SETTLEMENTS.labels(self.name, action)

    async def start(self, dispatch: Dispatch, settings: Settings) -> None:
        """Open the client, check the queue (and the dead-letter queue or the redrive policy), then
        begin polling."""
        endpoint = self.endpoint_url or settings.sqs_endpoint_url
        self._wait = settings.sqs_wait_time_seconds
        self._replays = settings.digester()
        self._sqs = SqsClient(endpoint_url=endpoint, region=self.region or settings.sqs_region,
                              threads=self.pollers + SETTLE_THREADS, read_timeout=self._wait + 10,
                              name=self.name.replace(":", "-"))
        try:
            facts = await inspect_queue(
                self._sqs, source=self.name, queue_url=self.queue_url, queue_name=self.queue_name,
                visibility_timeout=self.visibility_timeout, heartbeat_interval=self.heartbeat_interval,
                dead_letter_queue_url=self.dead_letter_queue_url, max_deliveries=settings.max_deliveries)
        except BaseException:
            await self._sqs.close()
            self._sqs = None
            raise
        self._url, self.fifo = facts.url, facts.fifo
        self._timeout, self._beat_every = facts.visibility_timeout, facts.heartbeat
        self._dispatch = dispatch
        self._stopping = False
        self._halt.clear()
        self._slots = Slots(self.max_in_flight)
        self._deletes = BatchAction(self._sqs, "delete_message_batch", self._url, linger=self.settle_linger)
        self._visibility = BatchAction(self._sqs, "change_message_visibility_batch", self._url,
                                       linger=self.settle_linger)
        self._heartbeat = asyncio.create_task(self._beat(), name=f"{self.name}-heartbeat")
        for number in range(self.pollers):
            task = asyncio.create_task(self._poll(), name=f"{self.name}-poller-{number}")
            self._pollers.add(task)
        log.info("%s: receiving %s (%d pollers, %d in flight at most, visibility %ds extended every %.1fs)",
                 self.name, self._url, self.pollers, self.max_in_flight, self._timeout, self._beat_every)

    async def stop(self) -> None:
        """Stop polling: a long poll under way returns its messages to the queue (visibility 0), and
        held messages that have not started do too; those already dispatched go on."""
        self._stopping = True
        self._halt.set()
        self._slots.close()

    async def close(self) -> None:
        """Wait (bounded) for settlements under way and for the pollers' last long polls, send the
        last batched settlements, close the client."""
        await self.stop()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=SETTLE_TIMEOUT_SECONDS)
        polling = False
        if self._pollers:
            _, pending = await asyncio.wait(set(self._pollers), timeout=self._wait + 5)
            polling = bool(pending)
            for task in pending:
                task.cancel()  # its thread releases what the poll returns (see _receive)
            self._pollers.clear()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
            self._heartbeat = None
        for action in (self._deletes, self._visibility):
            if action is not None:
                await action.drain(SETTLE_TIMEOUT_SECONDS)
        if self._sqs is not None:
            sqs, self._sqs = self._sqs, None
            await sqs.close(wait=not polling)
        self._dispatch = None

    # ---------------------------------------------------------------------------------------------
    # receiving

    async def _poll(self) -> None:
        failures = 0
        while not self._stopping:
            wanted = await self._slots.take(BATCH_MAX)
            if not wanted:
                return
            try:
                assert self._sqs is not None
                messages: list[dict[str, Any]] = await self._sqs.run(self._receive, wanted)
            except Exception as exc:
                self._slots.give(wanted)
                failures += 1
                RECEIVE_FAILURES.labels(self.name).inc()
                delay = random.uniform(0.5, 1.0) * min(30.0, 0.5 * 2 ** min(failures, 8))
                if failures == 1 or failures % 10 == 0:
                    log.warning("%s: receiving failed %d time(s) in a row (%s); trying again in %.1fs",
                                self.name, failures, explain(exc, self._sqs.endpoint_url if self._sqs else None),
                                delay)
                await asyncio.sleep(delay)
                continue
            if failures:
                log.info("%s: receiving again after %d failure(s)", self.name, failures)
                failures = 0
            self._slots.give(wanted - len(messages))
            for raw in messages:
                self._accept(raw)

    def _receive(self, count: int) -> list[dict[str, Any]]:
        """One long poll, on a pool thread. If the source stopped while it waited, the messages go
        straight back to the queue from this thread (the loop may no longer be listening)."""
        assert self._sqs is not None
        client = self._sqs.client
        params: dict[str, Any] = dict(
            QueueUrl=self._url, MaxNumberOfMessages=count, WaitTimeSeconds=self._wait,
            MessageAttributeNames=["All"], MessageSystemAttributeNames=_SYSTEM_ATTRIBUTES)
        if self.visibility_timeout is not None:
            params["VisibilityTimeout"] = self.visibility_timeout
        messages: list[dict[str, Any]] = client.receive_message(**params).get("Messages", [])
        if messages and self._halt.is_set():
            with contextlib.suppress(Exception):
                client.change_message_visibility_batch(QueueUrl=self._url, Entries=[
                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"], "VisibilityTimeout": 0}
                    for i, m in enumerate(messages)])
            return []
        return messages

    def _accept(self, raw: dict[str, Any]) -> None:
        message_id = raw["MessageId"]
        held = self._messages.get(message_id)
        if held is not None:
            # Received again while held (its visibility lapsed, or SQS's at-least-once delivery):
            # one run is enough, and the settlement must use the newest receipt handle.
            held.receipt = raw["ReceiptHandle"]
            held.extended = time.monotonic()
            RECEIVED_WHILE_HELD.labels(self.name).inc()
            self._slots.give(1)
            return
        message = HeldMessage.received(raw)
        self._messages[message_id] = message
        self._unsettled += 1
        if self._stopping or message_id in self._left_for_redrive:
            self._release(message)
            self._forget(message)
            return
        previous = None
        if self.fifo and message.group is not None:
            previous = self._groups.get(message.group)
            self._groups[message.group] = message
        message.task = task = asyncio.create_task(self._run(message, previous))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---------------------------------------------------------------------------------------------
    # one message

    async def _run(self, message: HeldMessage, previous: HeldMessage | None) -> None:
        decided = False
        try:
            if previous is not None and previous.task is not None:
                # FIFO: never two of one group at once, and never one before an earlier one of its
                # group that went back to the queue.
                await asyncio.wait([previous.task])
            if self._stopping or (previous is not None and previous.went_back):
                self._release(message)
                decided = True
                return
            assert self._dispatch is not None
            deliveries = to_deliveries(message, self.envelope, self._replays)
            results = [await self._one_at_a_time(delivery) for delivery in deliveries]
            decided = True
            await self._settle(message, deliveries, results)
        except asyncio.CancelledError:
            if not decided:
                # Shutdown ran out of grace mid-delivery: the pipeline rolled back and released the
                # lease; show the message again now rather than after its visibility timeout.
                self._release(message)
            raise
        except Exception as exc:
            message.went_back = True
            log.warning("%s: settling a message failed (%s); SQS delivers it again after its visibility "
                        "timeout", self.name, error_code(exc))
        finally:
            self._forget(message)

    async def _one_at_a_time(self, delivery: Delivery) -> Result:
        """Dispatch ``delivery`` after any delivery of the same key this source is running now (see
        :class:`~consumer_kit.sources.pulling.OneAtATime`)."""
        assert self._dispatch is not None
        try:
            key: str | None = str(self.key(delivery))
        except Exception:
            key = None  # it cannot be keyed: the pipeline parks it
        return await self._keys.run(key, functools.partial(self._dispatch, delivery))

    @contextlib.asynccontextmanager
    async def requeuer(self, settings: Settings) -> AsyncIterator[Send]:
        """A client for putting parked deliveries back on the queue (``consumer-kit parked replay``).
        Each goes back as a new message (SQS mints its ``MessageId``): the replay attribute carries
        the delivery as the pipeline saw it, so it keys as before; the original message attributes go
        along as far as SQS allows (ten in all). On a FIFO queue it joins its original message group."""
        sqs = SqsClient(endpoint_url=self.endpoint_url or settings.sqs_endpoint_url,
                        region=self.region or settings.sqs_region, threads=1, read_timeout=30,
                        name=f"{self.name.replace(':', '-')}-replay")
        try:
            facts = await inspect_queue(
                sqs, source=self.name, queue_url=self.queue_url, queue_name=self.queue_name,
                visibility_timeout=self.visibility_timeout, heartbeat_interval=self.heartbeat_interval,
                dead_letter_queue_url=self.dead_letter_queue_url, max_deliveries=settings.max_deliveries)

            async def send(delivery: Replayed, sealed: str) -> None:
                await sqs.call("send_message", **replay_message(delivery, sealed, queue_url=facts.url, fifo=facts.fifo))

            yield send
        finally:
            await sqs.close()

    async def _settle(self, message: HeldMessage, deliveries: list[Delivery], results: list[Result]) -> None:
        """One settlement per SQS message: every record of an S3 message must be settled before the
        message is deleted."""
        self._settling(message)
        if message.beat is not None:  # an extension under way must not land after our change
            await asyncio.wait([message.beat])
        if not results and is_s3_test_event(message.raw["Body"].encode("utf-8")):
            S3_TEST_EVENTS.labels(self.name).inc()
        action = self._policy.action(deliveries, results)
        if action.act is Act.RETRY:
            message.went_back = True
            await self._change_visibility(message, action.delay)
        elif action.act is Act.REDRIVE:
            # Redrive mode: leave it visible at once, so that SQS reaches maxReceiveCount and moves it.
            self._left_for_redrive[message.id] = None
            if len(self._left_for_redrive) > 10_000:
                self._left_for_redrive.popitem(last=False)
            await self._change_visibility(message, 0)
        else:
            if action.dead_letter is not None:
                await self._copy_to_dead_letters(message, action.dead_letter)
            await self._delete(message)

    async def _delete(self, message: HeldMessage) -> None:
        assert self._deletes is not None
        await self._settled(message, self._deletes, message.deletion, "delete")

    async def _change_visibility(self, message: HeldMessage, seconds: float) -> None:
        assert self._visibility is not None
        await self._settled(message, self._visibility, message.visibility(seconds), "visibility")

    async def _settled(self, message: HeldMessage, action: BatchAction, entry: Callable[[], dict[str, Any]],
                       label: str) -> None:
        done = action.put(entry)
        self._free_slot(message)
        if not self._unsettled:
            action.flush()  # nothing else is about to settle: no point waiting for company
        await done
        SETTLEMENTS.labels(self.name, label).inc()

    def _release(self, message: HeldMessage) -> None:
        """Back to the queue at once (visibility 0), not processed; nobody waits for the answer."""
        assert self._visibility is not None
        message.went_back = True
        self._settling(message)
        self._visibility.put(message.visibility(0))

    async def _copy_to_dead_letters(self, message: HeldMessage, result: Result) -> None:
        assert self._sqs is not None and self.dead_letter_queue_url is not None
        await self._sqs.call("send_message", **dead_letter_copy(
            message, result, queue_url=self._url, dead_letter_queue_url=self.dead_letter_queue_url, fifo=self.fifo,
            source=self.name))
        SETTLEMENTS.labels(self.name, "dead_letter_copy").inc()

    def _settling(self, message: HeldMessage) -> None:
        """Decided: the heartbeat leaves it alone, and it no longer counts as about to settle."""
        if not message.settling:
            message.settling = True
            self._unsettled -= 1

    def _forget(self, message: HeldMessage) -> None:
        self._settling(message)
        self._free_slot(message)
        if self._messages.get(message.id) is message:
            del self._messages[message.id]
        if message.group is not None and self._groups.get(message.group) is message:
            del self._groups[message.group]

    def _free_slot(self, message: HeldMessage) -> None:
        """Its in-flight slot back to the pollers, once: when its settlement has been handed over (a
        delete waiting for its batch holds no handler), or when it is forgotten."""
        if not message.slot_freed:
            message.slot_freed = True
            self._slots.give(1)

    # ---------------------------------------------------------------------------------------------
    # visibility heartbeat

    async def _beat(self) -> None:
        """Every half interval, extend the messages whose last extension is an interval old: a held
        message never reaches its visibility timeout while its handler (or the backoff) runs."""
        assert self._visibility is not None
        while True:
            await asyncio.sleep(self._beat_every / 2)
            now = time.monotonic()
            for message in list(self._messages.values()):
                if message.settling or message.beat is not None or now - message.extended < self._beat_every:
                    continue
                entry = message.visibility(self._timeout)
                if entry()["VisibilityTimeout"] <= 0:
                    continue  # at SQS's 12-hour limit: it cannot be held longer
                message.beat = self._visibility.put(entry)
                message.beat.add_done_callback(functools.partial(message.beaten, now))
