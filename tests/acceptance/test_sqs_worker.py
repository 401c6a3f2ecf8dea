"""The SQS example worker as a user runs it (``consumer-kit run examples.sqs_worker:app``) against
moto's SNS and SQS and PostgreSQL: killed with SIGKILL mid-stream and started again, it records every
order once and announces each once (by outbox id); SIGTERM drains it and it exits 0 (the run itself:
:mod:`tests.acceptance.example_workers`)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path

import pytest

from consumer_kit.sources.sqs import MESSAGE_ID_ATTRIBUTE
from tests.acceptance.example_workers import Worker, kill_and_restart
from tests.conftest import TEST_HMAC_KEY
from tests.integration.sqs_env import REGION, Moto

pytestmark = [pytest.mark.sqs, pytest.mark.postgres]

ORDERS = 300


async def test_sigkill_mid_stream_then_restart_records_each_order_once(
        pg_database: str, moto_endpoint: str, tmp_path: Path) -> None:
    moto = Moto(moto_endpoint)
    name = f"ck-orders-{secrets.token_hex(4)}"
    env = dict(os.environ, DATABASE_URL=pg_database, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY,
               SQS_ENDPOINT_URL=moto_endpoint, SQS_REGION=REGION, SQS_WAIT_TIME_SECONDS="1",
               ORDERS_TOPIC=name, ORDERS_QUEUE=name, EVENTS_QUEUE=f"{name}-events",
               ORDERS_VISIBILITY_SECONDS="3", INBOX_LEASE_SECONDS="2", DB_POOL_SIZE="5",
               OUTBOX_POLL_SECONDS="0.2", SHUTDOWN_GRACE_SECONDS="10")
    worker = Worker("sqs_worker", env, tmp_path / "worker.log")
    await worker.init()
    queue = (await asyncio.to_thread(moto.sqs.get_queue_url, QueueName=name))["QueueUrl"]
    events = (await asyncio.to_thread(moto.sqs.get_queue_url, QueueName=f"{name}-events"))["QueueUrl"]
    moto.created += [queue, events, queue + "-dlq"]
    topic = next(t["TopicArn"] for t in (await asyncio.to_thread(moto.sns.list_topics))["Topics"]
                 if t["TopicArn"].endswith(f":{name}"))

    def publish_all() -> None:
        for start in range(0, ORDERS, 10):
            moto.sns.publish_batch(TopicArn=topic, PublishBatchRequestEntries=[
                {"Id": str(i), "Message": json.dumps({"order": f"O-{i}", "amount": i})}
                for i in range(start, start + 10)])

    async def held() -> int:
        return await moto.depth(queue)

    try:
        await kill_and_restart(worker, pg_database, orders=ORDERS, publish=lambda: asyncio.to_thread(publish_all),
                               depth=held, kill_after=60, finish_seconds=120)
        announcements = await moto.drain(events)
    finally:
        await moto.cleanup()
    assert {json.loads(m["Body"])["order"] for m in announcements} == {f"O-{i}" for i in range(ORDERS)}
    # A repeat can only be a row the killed relay had sent but not recorded: same outbox id, same body.
    by_id: dict[str, set[str]] = {}
    for message in announcements:
        by_id.setdefault(message["MessageAttributes"][MESSAGE_ID_ATTRIBUTE]["StringValue"], set()).add(message["Body"])
    assert len(by_id) == ORDERS and all(len(bodies) == 1 for bodies in by_id.values())
