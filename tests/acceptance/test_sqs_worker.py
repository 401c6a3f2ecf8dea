"""The SQS example worker as a user runs it (``consumer-kit run examples.sqs_worker:app``) against
moto's SNS and SQS and PostgreSQL: killed with SIGKILL mid-stream and started again, it records every
order once and announces each once (by outbox id); SIGTERM drains it and it exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import distinct, func, select

from consumer_kit import ConsumerApp
from consumer_kit.sources.sqs import MESSAGE_ID_ATTRIBUTE
from tests.conftest import TEST_HMAC_KEY, make_settings
from tests.integration.rabbit import wait_until
from tests.integration.sqs_env import REGION, Moto

pytestmark = [pytest.mark.sqs, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[2]
ORDERS = 300


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    command = [str(Path(sys.executable).with_name("consumer-kit")), "--log-level", "WARNING",
               "run", "examples.sqs_worker:app"]
    with log.open("ab") as output:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output)


async def test_sigkill_mid_stream_then_restart_records_each_order_once(
        pg_database: str, moto_endpoint: str, tmp_path: Path) -> None:
    moto = Moto(moto_endpoint)
    name = f"ck-orders-{secrets.token_hex(4)}"
    log = tmp_path / "worker.log"
    env = dict(os.environ, DATABASE_URL=pg_database, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY,
               SQS_ENDPOINT_URL=moto_endpoint, SQS_REGION=REGION, SQS_WAIT_TIME_SECONDS="1",
               ORDERS_TOPIC=name, ORDERS_QUEUE=name, EVENTS_QUEUE=f"{name}-events",
               ORDERS_VISIBILITY_SECONDS="3", INBOX_LEASE_SECONDS="2", DB_POOL_SIZE="5",
               OUTBOX_POLL_SECONDS="0.2", SHUTDOWN_GRACE_SECONDS="10")
    init = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "examples.sqs_worker", "init"], cwd=ROOT, env=env,
        capture_output=True, timeout=60)
    assert init.returncode == 0, init.stderr.decode()
    queue = (await asyncio.to_thread(moto.sqs.get_queue_url, QueueName=name))["QueueUrl"]
    events = (await asyncio.to_thread(moto.sqs.get_queue_url, QueueName=f"{name}-events"))["QueueUrl"]
    moto.created += [queue, events, queue + "-dlq"]
    topic = next(t["TopicArn"] for t in (await asyncio.to_thread(moto.sns.list_topics))["Topics"]
                 if t["TopicArn"].endswith(f":{name}"))
    # The example's module reads its settings at import: look at its table through an app of our own.
    from examples import sqs_worker as example

    observer = ConsumerApp(make_settings(pg_database, db_pool_size=2))
    try:
        async with observer.running():
            async with observer.engine.begin() as conn:
                await conn.execute(example.orders.delete())

            async def recorded() -> tuple[int, int]:
                query = select(func.count(), func.count(distinct(example.orders.c.order_ref)))
                async with observer.engine.connect() as conn:
                    total, unique = (await conn.execute(query)).one()
                return int(total), int(unique)

            def publish_all() -> None:
                for start in range(0, ORDERS, 10):
                    moto.sns.publish_batch(TopicArn=topic, PublishBatchRequestEntries=[
                        {"Id": str(i), "Message": json.dumps({"order": f"O-{i}", "amount": i})}
                        for i in range(start, start + 10)])

            first = start_worker(env, log)
            try:
                publishing = asyncio.create_task(asyncio.to_thread(publish_all))

                async def some() -> bool:
                    return (await recorded())[0] >= 60

                await wait_until(some, 60, "the first worker to record some orders")
            finally:
                first.send_signal(signal.SIGKILL)
                first.wait(10)
            killed_at = (await recorded())[0]
            await publishing
            assert killed_at < ORDERS, "the worker finished before it could be killed mid-stream"

            second = start_worker(env, log)
            try:
                async def all_recorded() -> bool:
                    return (await recorded())[1] == ORDERS and await moto.depth(queue) == 0

                await wait_until(all_recorded, 120, "the restarted worker to record every order")

                async def all_announced() -> bool:
                    return (await observer.outbox.stats()).pending == 0

                await wait_until(all_announced, 30, "every announcement to be relayed")
            finally:
                second.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(second.wait, 30)
            assert code == 0, log.read_text()
            assert await recorded() == (ORDERS, ORDERS)  # exactly once, across the kill
        assert await moto.depth(queue) == 0  # the drained worker left nothing held
        announcements = await moto.drain(events)
    finally:
        await moto.cleanup()
    assert {json.loads(m["Body"])["order"] for m in announcements} == {f"O-{i}" for i in range(ORDERS)}
    # A repeat can only be a row the killed relay had sent but not recorded: same outbox id, same body.
    by_id: dict[str, set[str]] = {}
    for message in announcements:
        by_id.setdefault(message["MessageAttributes"][MESSAGE_ID_ATTRIBUTE]["StringValue"], set()).add(message["Body"])
    assert len(by_id) == ORDERS and all(len(bodies) == 1 for bodies in by_id.values())
