"""Helpers for the SQS tests, all against the moto server over HTTP (the ``moto_endpoint`` session
fixture): unique queues, sending, queue depth, draining, and settings that point at the server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

import boto3

from consumer_kit import Settings
from tests.conftest import make_settings

REGION = "us-east-1"


class Moto:
    """boto3 clients for moto's SQS, SNS, EventBridge and S3; blocking calls run in threads."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.sqs: Any = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)
        self.sns: Any = boto3.client("sns", endpoint_url=endpoint, region_name=REGION)
        self.events: Any = boto3.client("events", endpoint_url=endpoint, region_name=REGION)
        self.s3: Any = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
        self.created: list[str] = []

    def settings(self, database_url: str, **overrides: object) -> Settings:
        """Test settings that point the SQS sources at this server, with short long polls."""
        values: dict[str, object] = {"sqs_endpoint_url": self.endpoint, "sqs_region": REGION,
                                     "sqs_wait_time_seconds": 1}
        values.update(overrides)
        return make_settings(database_url, **values)

    async def queue(self, *, fifo: bool = False, visibility: int = 30, max_receives: int | None = None,
                    dead_letter: bool = True, prefix: str = "ck-test") -> tuple[str, str]:
        """A new queue and its dead-letter queue: ``(url, dlq_url)``. ``max_receives`` adds a redrive
        policy to the dead-letter queue (``dead_letter=False``: a queue with neither, dlq_url "")."""
        name = f"{prefix}-{secrets.token_hex(4)}"
        suffix = ".fifo" if fifo else ""
        fifo_attributes = {"FifoQueue": "true"} if fifo else {}
        dlq_url = ""
        if dead_letter:
            dlq_url = await self._create(f"{name}-dlq{suffix}", fifo_attributes)
        attributes: dict[str, str] = {"VisibilityTimeout": str(visibility), **fifo_attributes}
        if max_receives is not None:
            arn = (await asyncio.to_thread(self.sqs.get_queue_attributes, QueueUrl=dlq_url,
                                           AttributeNames=["QueueArn"]))["Attributes"]["QueueArn"]
            attributes["RedrivePolicy"] = json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": max_receives})
        return await self._create(f"{name}{suffix}", attributes), dlq_url

    async def _create(self, name: str, attributes: Mapping[str, str]) -> str:
        url: str = (await asyncio.to_thread(self.sqs.create_queue, QueueName=name,
                                            Attributes=dict(attributes)))["QueueUrl"]
        self.created.append(url)
        return url

    async def arn(self, url: str) -> str:
        return str((await asyncio.to_thread(self.sqs.get_queue_attributes, QueueUrl=url,
                                            AttributeNames=["QueueArn"]))["Attributes"]["QueueArn"])

    async def send(self, url: str, messages: Iterable[Mapping[str, Any]]) -> None:
        """SendMessageBatch, ten at a time; each message is a SendMessageBatch entry without ``Id``."""
        entries = list(messages)

        def send_all() -> None:
            for start in range(0, len(entries), 10):
                chunk = [dict(entry, Id=str(i)) for i, entry in enumerate(entries[start:start + 10])]
                answer = self.sqs.send_message_batch(QueueUrl=url, Entries=chunk)
                assert not answer.get("Failed"), answer["Failed"]

        await asyncio.to_thread(send_all)

    async def depth(self, url: str) -> int:
        """Messages in the queue, visible or held by a consumer."""
        attributes = (await asyncio.to_thread(
            self.sqs.get_queue_attributes, QueueUrl=url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]))["Attributes"]
        return int(attributes["ApproximateNumberOfMessages"]) + int(attributes["ApproximateNumberOfMessagesNotVisible"])

    async def drain(self, url: str) -> list[dict[str, Any]]:
        """Receive and delete every visible message of ``url``."""

        def take() -> list[dict[str, Any]]:
            taken: list[dict[str, Any]] = []
            while True:
                got = self.sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=0,
                                               MessageAttributeNames=["All"],
                                               MessageSystemAttributeNames=["All"]).get("Messages", [])
                if not got:
                    return taken
                taken.extend(got)
                self.sqs.delete_message_batch(QueueUrl=url, Entries=[
                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(got)])

        return await asyncio.to_thread(take)

    async def cleanup(self) -> None:
        for url in self.created:
            with contextlib.suppress(Exception):  # already gone
                await asyncio.to_thread(self.sqs.delete_queue, QueueUrl=url)


def attribute(value: str) -> dict[str, str]:
    """A string message attribute."""
    return {"DataType": "String", "StringValue": value}
