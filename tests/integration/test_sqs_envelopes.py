"""Every envelope keyed as documented, with the fan-outs set up for real in moto (SNS -> SQS,
EventBridge -> SQS, S3 -> SQS); messages that do not fit are parked with their reason, none dropped."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from prometheus_client import REGISTRY

from consumer_kit import ConsumerApp, Context, Outcome, Result
from consumer_kit.delivery import Delivery, Dispatch
from consumer_kit.settings import Settings
from consumer_kit.sources.sqs import REASON_ATTRIBUTE, SQSSource
from tests.integration.rabbit import wait_until
from tests.integration.sqs_env import Moto

pytestmark = pytest.mark.sqs


class _RecordingSource(SQSSource):
    """An SQSSource that keeps every pipeline result, through the public ``start(dispatch, settings)``."""

    def __init__(self, recorder: Recorder, **options: Any) -> None:
        super().__init__(**options)
        self.recorder = recorder

    async def start(self, dispatch: Dispatch, settings: Settings) -> None:
        async def recording(delivery: Delivery) -> Result:
            result = await dispatch(delivery)
            self.recorder.results.append(result)
            return result

        await super().start(recording, settings)


class Recorder:
    """A worker on one queue that records what its handler saw and every pipeline result."""

    def __init__(self, moto: Moto, database_url: str, url: str, dlq: str, envelope: str, **options: Any) -> None:
        self.app = ConsumerApp(moto.settings(database_url, retry_attempts=1, retry_later_seconds=0))
        self.source = _RecordingSource(self, queue_url=url, namespace="orders", version=1, envelope=envelope,
                                dead_letter_queue_url=dlq, retry_delays=(0.2,), **options)
        self.seen: list[tuple[str, bytes, dict[str, str]]] = []
        self.results: list[Result] = []
        self.fail_once: set[bytes] = set()

        @self.app.handler(self.source, name=f"envelope-{envelope}")
        async def handle(ctx: Context) -> None:
            if ctx.delivery.body in self.fail_once:
                self.fail_once.discard(ctx.delivery.body)
                raise ConnectionError("once")
            self.seen.append((ctx.key.id, ctx.delivery.body, dict(ctx.delivery.headers)))

    async def __aenter__(self) -> Recorder:
        await self.app.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.app.stop()

    def outcomes(self) -> list[str]:
        return sorted(r.outcome.value for r in self.results)


async def test_sns_fan_out_keyed_by_topic_and_sns_message_id(moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue()
    tap, _ = await moto.queue(dead_letter=False)
    raw_url, raw_dlq = await moto.queue()
    topic = (await asyncio.to_thread(moto.sns.create_topic, Name=f"orders-{url[-8:]}"))["TopicArn"]
    for queue, raw in ((url, False), (tap, False), (raw_url, True)):
        await asyncio.to_thread(moto.sns.subscribe, TopicArn=topic, Protocol="sqs", Endpoint=await moto.arn(queue),
                                Attributes={"RawMessageDelivery": "true" if raw else "false"})
    async with Recorder(moto, sqlite_url, url, dlq, "sns") as sns, \
            Recorder(moto, sqlite_url, raw_url, raw_dlq, "sqs", key="order-id") as raw:
        published = await asyncio.to_thread(
            moto.sns.publish, TopicArn=topic, Message='{"order": "O-1"}', Subject="created",
            MessageAttributes={"order-id": {"DataType": "String", "StringValue": "O-1"}})

        async def delivered() -> bool:
            return len(sns.seen) == 1 and len(raw.seen) == 1

        await wait_until(delivered, 20, "the notification on both queues")
        # SNS retries a delivery with the same MessageId: the copy the tap queue got stands in for it.
        [notification] = await moto.drain(tap)
        await moto.send(url, [{"MessageBody": notification["Body"]}])
        await moto.send(url, [{"MessageBody": json.dumps({"Type": "SubscriptionConfirmation", "TopicArn": topic})},
                              {"MessageBody": "plain text"}])

        async def settled() -> bool:
            return len(sns.results) == 4 and await moto.depth(url) == 0

        await wait_until(settled, 20, "the repeat and the two strangers")
    [(key_id, body, headers)] = sns.seen
    assert key_id == f"{topic}#{published['MessageId']}"
    assert body == b'{"order": "O-1"}'
    assert headers["order-id"] == "O-1" and headers["sns-subject"] == "created"
    assert sns.outcomes() == ["duplicate", "invalid", "invalid", "processed"]
    parked = await moto.drain(dlq)
    assert sorted(m["MessageAttributes"][REASON_ATTRIBUTE]["StringValue"] for m in parked) == \
        ["envelope_mismatch", "envelope_mismatch"]
    assert "plain text" in {m["Body"] for m in parked}  # parked as it came, never dropped
    # Raw delivery has no envelope: the SQS message id is minted per send, so key= picks the id.
    assert raw.seen[0][0] == "O-1" and raw.seen[0][1] == b'{"order": "O-1"}'


async def test_eventbridge_fan_out_keyed_by_source_and_id(moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue()
    rule = f"orders-{url[-8:]}"
    await asyncio.to_thread(moto.events.put_rule, Name=rule,
                            EventPattern=json.dumps({"source": ["com.example.orders"]}))
    await asyncio.to_thread(moto.events.put_targets, Rule=rule, Targets=[{"Id": "queue", "Arn": await moto.arn(url)}])
    async with Recorder(moto, sqlite_url, url, dlq, "eventbridge") as bridge:
        await asyncio.to_thread(moto.events.put_events, Entries=[
            {"Source": "com.example.orders", "DetailType": "Order Created", "Detail": json.dumps({"order": "O-2"})}])
        await wait_until(lambda: _true(len(bridge.seen) == 1), 20, "the event")
        [(key_id, body, headers)] = bridge.seen
        # A redriven or re-sent copy of the event gets a new SQS MessageId and the same key.
        event = {"version": "0", "id": headers["eventbridge-id"], "detail-type": "Order Created",
                 "source": "com.example.orders", "account": "123456789012", "time": headers["eventbridge-time"],
                 "region": "us-east-1", "resources": [], "detail": {"order": "O-2"}}
        await moto.send(url, [{"MessageBody": json.dumps(event)},
                              {"MessageBody": json.dumps({"order": "no envelope"})}])

        async def settled() -> bool:
            return len(bridge.results) == 3 and await moto.depth(url) == 0

        await wait_until(settled, 20, "the copy and the stranger")
    assert key_id == f"com.example.orders#{headers['eventbridge-id']}"
    assert json.loads(body) == {"order": "O-2"} and headers["eventbridge-detail-type"] == "Order Created"
    assert bridge.outcomes() == ["duplicate", "invalid", "processed"]
    [stranger] = await moto.drain(dlq)
    assert stranger["MessageAttributes"][REASON_ATTRIBUTE]["StringValue"] == "envelope_mismatch"


def s3_record(key: str, sequencer: str | None) -> dict[str, Any]:
    obj: dict[str, Any] = {"key": key, "size": 3, "eTag": "0cc175b9c0f1b6a831c399e269772661", "versionId": "v1"}
    if sequencer:
        obj["sequencer"] = sequencer
    return {"eventVersion": "2.1", "eventSource": "aws:s3", "awsRegion": "us-east-1",
            "eventTime": "2024-05-01T12:00:00.000Z", "eventName": "ObjectCreated:Put",
            "s3": {"s3SchemaVersion": "1.0", "bucket": {"name": "uploads", "arn": "arn:aws:s3:::uploads"},
                   "object": obj}}


async def test_s3_one_delivery_per_record_deleted_only_when_all_are_settled(moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue()
    bucket = f"uploads-{url[-8:]}"
    async with Recorder(moto, sqlite_url, url, dlq, "s3") as s3:
        tests_before = REGISTRY.get_sample_value("consumer_kit_sqs_s3_test_events_total",
                                                 {"source": s3.source.name}) or 0.0
        # moto's S3 sends s3:TestEvent when the notification is configured, and records without a
        # sequencer for each upload (real S3 always sends one): acknowledged and counted; parked.
        await asyncio.to_thread(moto.s3.create_bucket, Bucket=bucket)
        await asyncio.to_thread(moto.s3.put_bucket_notification_configuration, Bucket=bucket,
                                NotificationConfiguration={"QueueConfigurations": [
                                    {"QueueArn": await moto.arn(url), "Events": ["s3:ObjectCreated:*"]}]})
        await asyncio.to_thread(moto.s3.put_object, Bucket=bucket, Key="in/moto.csv", Body=b"abc")
        # Two records in one message as S3 sends them; the second fails once, so the message comes
        # back and its first record is a duplicate then.
        two = json.dumps({"Records": [s3_record("in/a.csv", "0055AED6DCD90281E5"),
                                      s3_record("in/b.csv", "0055AED6DCD90281E6")]})
        s3.fail_once.add(json.dumps(s3_record("in/b.csv", "0055AED6DCD90281E6"), separators=(",", ":")).encode())
        await moto.send(url, [{"MessageBody": two}])

        async def settled() -> bool:
            return len(s3.seen) == 2 and await moto.depth(url) == 0 and await moto.depth(dlq) == 1

        await wait_until(settled, 30, "both records and the parked upload")
        tests_after = REGISTRY.get_sample_value("consumer_kit_sqs_s3_test_events_total", {"source": s3.source.name})
        letters = await s3.app.dead_letters.list()
    assert sorted(key_id for key_id, _, _ in s3.seen) == [
        "uploads#in/a.csv#v1#0055AED6DCD90281E5", "uploads#in/b.csv#v1#0055AED6DCD90281E6"]
    assert s3.outcomes() == ["duplicate", "invalid", "processed", "processed", "retry"]
    assert tests_after == tests_before + 1
    assert [letter.reason for letter in letters] == ["missing_stable_id"]
    assert json.loads(letters[0].body)["s3"]["object"]["key"] == "in%2Fmoto.csv"  # S3 URL-encodes keys
    [parked] = await moto.drain(dlq)
    assert parked["MessageAttributes"][REASON_ATTRIBUTE]["StringValue"] == "missing_stable_id"


async def test_cloudevents_in_the_body_keyed_by_source_and_id(moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue()
    event = {"specversion": "1.0", "id": "ev-9", "source": "/orders", "type": "order.created",
             "datacontenttype": "application/json", "data": {"order": "O-9"}}
    async with Recorder(moto, sqlite_url, url, dlq, "cloudevents") as ce:
        await moto.send(url, [{"MessageBody": json.dumps(event)}, {"MessageBody": json.dumps(event)},
                              {"MessageBody": json.dumps({**event, "specversion": "0.3"})}])

        async def settled() -> bool:
            return len(ce.results) >= 3 and await moto.depth(url) == 0

        await wait_until(settled, 20, "the event, its copy and the old one")
    [(key_id, body, headers)] = ce.seen
    assert key_id == "/orders#ev-9" and json.loads(body) == {"order": "O-9"} and headers["ce-type"] == "order.created"
    assert sorted(r.outcome for r in ce.results if r.outcome is not Outcome.IN_PROGRESS) == \
        sorted([Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.INVALID])
    [old] = await moto.drain(dlq)
    assert old["MessageAttributes"][REASON_ATTRIBUTE]["StringValue"] == "envelope_mismatch"


async def _true(value: bool) -> bool:
    return value
