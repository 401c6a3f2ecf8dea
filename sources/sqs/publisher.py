"""SqsPublisher: the outbox relay's publisher for SQS queues."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from consumer_kit.outbox import OutboxMessage
from consumer_kit.settings import Settings
from consumer_kit.sources.sqs.client import BatchAction, SqsClient

MESSAGE_ID_ATTRIBUTE = "x-consumer-kit-message-id"
"""The message attribute holding the outbox row id: a consumer keys by it (``key=MESSAGE_ID_ATTRIBUTE``),
since SQS mints a new ``MessageId`` for every send, a relay's re-send included."""
GROUP_HEADER = "message-group-id"
_ATTRIBUTE_NAME = re.compile(r"^(?!(?i:aws\.|amazon\.))[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


_TRACE_ORDER = ("traceparent", "tracestate", "baggage")


class SqsPublisher:
    """Publishes outbox rows to SQS with ``SendMessageBatch``: the relay's concurrent publishes are
    gathered ten to a call (or after ``linger`` seconds).

    ``destination`` is a queue URL, or a queue name looked up once. Each message carries the row id
    in the :data:`MESSAGE_ID_ATTRIBUTE` attribute and its headers as string attributes (SQS allows
    ten attributes in all). On a FIFO queue (``.fifo``) the row id is also the
    ``MessageDeduplicationId``, so SQS drops a re-send within its 5-minute window, and the
    ``message-group-id`` header (``group_header=``) is the ``MessageGroupId``; a FIFO message without
    it fails with a clear error rather than guessing a group; messages reach a FIFO queue in the order
    the relay hands them over while sends succeed (a failed one is sent again later, after others).
    A row's trace context (``traceparent``, ``tracestate``, ``baggage``) goes as attributes too, as
    far as the ten allow: it is left out (``baggage`` first) rather than fail a message with many
    headers of its own.
    Endpoint and region come from
    ``SQS_ENDPOINT_URL`` / ``SQS_REGION`` unless given.
    """

    messaging_system = "aws_sqs"

    def __init__(self, *, settings: Settings | None = None, endpoint_url: str | None = None,
                 region: str | None = None, group_header: str = GROUP_HEADER, linger: float = 0.005,
                 threads: int = 4) -> None:
        self.settings = settings
        self.endpoint_url = endpoint_url
        self.region = region
        self.group_header = group_header
        self.linger = linger
        self.threads = threads
        self._sqs: SqsClient | None = None
        self._urls: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._batches: dict[str, BatchAction] = {}
        self._lock = asyncio.Lock()

    async def _client(self) -> SqsClient:
        async with self._lock:
            if self._sqs is None:
                settings = self.settings or Settings()
                sqs = SqsClient(endpoint_url=self.endpoint_url or settings.sqs_endpoint_url,
                                region=self.region or settings.sqs_region, threads=self.threads,
                                read_timeout=30, name="relay")
                try:
                    await sqs.open()
                except BaseException:  # failed or cancelled: its pool must not outlive it
                    await asyncio.shield(sqs.close())
                    raise
                self._sqs = sqs
            return self._sqs

    async def _queue_url(self, sqs: SqsClient, destination: str) -> str:
        if destination.startswith(("https://", "http://")):
            return destination
        lookup = self._urls.get(destination)
        if lookup is None or (lookup.done() and (lookup.cancelled() or lookup.exception() is not None)):
            # One lookup per name however many publishes wait for it; a failed one is tried again.
            lookup = self._urls[destination] = asyncio.ensure_future(sqs.call("get_queue_url", QueueName=destination))
        response = await asyncio.shield(lookup)
        return str(response["QueueUrl"])

    async def publish(self, message: OutboxMessage) -> None:
        """Send ``message`` and return once SQS accepted it; raise on any failure (the relay retries
        the row later, with the same id)."""
        sqs = await self._client()
        url = await self._queue_url(sqs, message.destination)
        entry = self._entry(message, fifo=url.endswith(".fifo"))
        batch = self._batches.get(url)
        if batch is None:
            batch = self._batches[url] = BatchAction(sqs, "send_message_batch", url, linger=self.linger,
                                                     size=_entry_bytes, ordered=url.endswith(".fifo"))
        await batch.put(lambda: entry)

    def _entry(self, message: OutboxMessage, *, fifo: bool) -> dict[str, Any]:
        attributes = {MESSAGE_ID_ATTRIBUTE: message.id, **message.headers}
        for name in reversed(_TRACE_ORDER):  # trace context is what gives way to the message's own
            if len(attributes) > 10:
                attributes.pop(name, None)
        if len(attributes) > 10:
            raise ValueError(f"SQS allows 10 message attributes; this message has {len(message.headers)} headers "
                             "besides its id")
        for name, value in attributes.items():
            if not _ATTRIBUTE_NAME.match(name) or len(name) > 256:
                raise ValueError(f"{name!r} is not a valid SQS message attribute name")
            if not value:
                raise ValueError(f"SQS refuses the empty value of header {name!r}")
        try:
            body = message.body.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("SQS message bodies are text: this body is not UTF-8 (base64 it)") from None
        entry: dict[str, Any] = {
            "MessageBody": body,
            "MessageAttributes": {n: {"DataType": "String", "StringValue": v} for n, v in attributes.items()},
        }
        if fifo:
            group = message.headers.get(self.group_header)
            if not group:
                raise ValueError(f"a message for the FIFO queue {message.destination} needs a "
                                 f"{self.group_header!r} header (its MessageGroupId)")
            entry["MessageGroupId"] = group
            entry["MessageDeduplicationId"] = message.id
        return entry

    async def close(self) -> None:
        """Send what is queued, then close the client."""
        for batch in self._batches.values():
            await batch.drain(10.0)
        self._batches.clear()
        self._urls.clear()
        if self._sqs is not None:
            sqs, self._sqs = self._sqs, None
            await sqs.close()


def _entry_bytes(entry: dict[str, Any]) -> int:
    size = len(entry["MessageBody"].encode("utf-8"))
    for name, value in entry["MessageAttributes"].items():
        size += len(name) + len(value["DataType"]) + len(value["StringValue"].encode("utf-8"))
    return size
