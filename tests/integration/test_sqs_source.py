"""SQSSource against moto's server over HTTP (the inbox on a SQLite file: these tests are about the
source): settlement after the commit, dead letters and the redrive policy, the visibility heartbeat,
retries and SQS's 12-hour limit, FIFO order, shutdown and cancellation, and a lost endpoint."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY

from consumer_kit import ConfigurationError, ConsumerApp, Context, RetryableError, Settings, TerminalError
from consumer_kit.keys import short
from consumer_kit.sources.sqs import KEY_DIGEST_ATTRIBUTE, REASON_ATTRIBUTE, SOURCE_QUEUE_ATTRIBUTE, SQSSource
from consumer_kit.sources.sqs.client import BatchAction, SqsClient
from tests.integration.rabbit import TcpProxy, wait_until
from tests.integration.sqs_env import REGION, Moto, attribute

pytestmark = pytest.mark.sqs

Handler = Callable[[Context], Awaitable[None]]


def worker(settings: Settings, url: str, handler: Handler, **options: Any) -> tuple[ConsumerApp, SQSSource]:
    app = ConsumerApp(settings)
    options.setdefault("namespace", "orders")
    options.setdefault("version", 1)
    source = SQSSource(queue_url=url, **options)
    app.handler(source, name="sqs-test")(handler)
    return app, source


def counted(metric: str, source: SQSSource) -> float:
    return REGISTRY.get_sample_value(metric, {"source": source.name}) or 0.0


async def visible(moto: Moto, url: str) -> int:
    attributes = (await asyncio.to_thread(moto.sqs.get_queue_attributes, QueueUrl=url,
                                          AttributeNames=["ApproximateNumberOfMessages"]))["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"])


async def test_deletes_after_the_commit_and_parks_what_cannot_be_keyed(moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue()
    seen: list[str] = []

    async def handle(ctx: Context) -> None:
        if ctx.delivery.text() == "poison":
            raise TerminalError("cannot ship to the moon", reason="bad_address")
        seen.append(ctx.delivery.text())

    app, source = worker(moto.settings(sqlite_url), url, handle, key="order-id", dead_letter_queue_url=dlq)
    async with app.running():
        await moto.send(url, [{"MessageBody": f"o-{i}", "MessageAttributes": {"order-id": attribute(f"O-{i}")}}
                              for i in range(30)])
        await moto.send(url, [{"MessageBody": "no key 1"}, {"MessageBody": "no key 2"},
                              {"MessageBody": "poison", "MessageAttributes": {"order-id": attribute("O-poison"),
                                                                              "trace": attribute("t-1")}}])

        def settled(action: str) -> float:
            return REGISTRY.get_sample_value("consumer_kit_sqs_settlements_total",
                                             {"source": source.name, "action": action}) or 0.0

        async def done() -> bool:  # (the deletes counted as their answers reach the source)
            return (len(seen) == 30 and settled("delete") >= 33 and await moto.depth(url) == 0
                    and await moto.depth(dlq) == 3)

        await wait_until(done, 30, "30 effects and 3 dead letters")
        copies_sent, sent_back = settled("dead_letter_copy"), settled("visibility")
        parked = {letter.reason: letter for letter in await app.dead_letters.list()}
        letters = await app.dead_letters.list(reason="missing_stable_id")
        digest = short(app.pipeline.digester.digest("orders:v1:O-poison"))
    assert sorted(seen) == sorted(f"o-{i}" for i in range(30))
    # Every message deleted (the parked ones after their copy: waited for above), none sent back.
    assert copies_sent == 3 and sent_back == 0
    assert sorted(letter.body for letter in letters) == [b"no key 1", b"no key 2"]
    copies = {m["Body"]: m for m in await moto.drain(dlq)}
    assert set(copies) == {"no key 1", "no key 2", "poison"}
    assert copies["no key 1"]["MessageAttributes"][REASON_ATTRIBUTE]["StringValue"] == "missing_stable_id"
    assert KEY_DIGEST_ATTRIBUTE not in copies["no key 1"]["MessageAttributes"]
    poison = copies["poison"]["MessageAttributes"]
    assert poison[REASON_ATTRIBUTE]["StringValue"] == "bad_address" == parked["bad_address"].reason
    assert poison[KEY_DIGEST_ATTRIBUTE]["StringValue"] == digest  # the keyed digest, never the key
    assert poison[SOURCE_QUEUE_ATTRIBUTE]["StringValue"] == url
    assert poison["order-id"]["StringValue"] == "O-poison" and poison["trace"]["StringValue"] == "t-1"


async def test_retry_later_takes_the_attempt_from_the_receive_count(moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue()
    attempts: list[int] = []

    async def flaky(ctx: Context) -> None:
        attempts.append(ctx.delivery.attempt)
        if len(attempts) < 3:
            raise ConnectionError("downstream down")

    settings = moto.settings(sqlite_url, retry_attempts=1, retry_later_seconds=0)
    app, _ = worker(settings, url, flaky, dead_letter_queue_url=dlq, retry_delays=(0.2,))
    async with app.running():
        await moto.send(url, [{"MessageBody": "retry me"}])

        async def done() -> bool:
            return len(attempts) == 3 and await moto.depth(url) == 0

        await wait_until(done, 20, "the third attempt to succeed")
    assert attempts == [1, 2, 3]


async def test_a_retry_delay_beyond_twelve_hours_is_clamped(moto: Moto, sqlite_url: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    url, dlq = await moto.queue()
    ran = asyncio.Event()

    async def later(ctx: Context) -> None:
        ran.set()
        raise RetryableError("come back tomorrow", delay=2 * 86_400)

    app, source = worker(moto.settings(sqlite_url), url, later, dead_letter_queue_url=dlq)
    with caplog.at_level(logging.WARNING, logger="consumer_kit.sources.sqs"):
        async with app.running():
            await moto.send(url, [{"MessageBody": "tomorrow"}])
            await asyncio.wait_for(ran.wait(), 10)

            async def settled() -> bool:
                return source.held == 0

            await wait_until(settled, 10, "the visibility change")
            # Without the clamp SQS refuses the change (> 43,200 s) and the message would show again
            # after its 30 s timeout; clamped, it stays hidden and in the queue.
            assert await visible(moto, url) == 0 and await moto.depth(url) == 1
    assert not [r for r in caplog.records if r.name == "consumer_kit.sources.sqs" and "failed" in r.getMessage()]


async def test_the_heartbeat_keeps_a_slow_message_hidden(moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue()
    runs: list[int] = []

    async def slow(ctx: Context) -> None:
        runs.append(ctx.delivery.attempt)
        await asyncio.sleep(7)

    app, source = worker(moto.settings(sqlite_url), url, slow, dead_letter_queue_url=dlq, visibility_timeout=3)
    async with app.running():
        await moto.send(url, [{"MessageBody": "slow"}])
        await wait_until(lambda: _true(bool(runs)), 10, "the handler to start")
        # Another consumer polls throughout: had the 3 s visibility lapsed, it would get the message.
        stolen = await asyncio.to_thread(_poll_for, moto, url, seconds=6)

        async def done() -> bool:
            return await moto.depth(url) == 0

        await wait_until(done, 10, "the delete")
    # Neither the other consumer nor the source's own pollers ever saw it again.
    assert stolen == [] and runs == [1] and counted("consumer_kit_sqs_received_while_held_total", source) == 0


def _poll_for(moto: Moto, url: str, *, seconds: float) -> list[str]:
    taken: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = moto.sqs.receive_message(QueueUrl=url, WaitTimeSeconds=1, VisibilityTimeout=0).get("Messages", [])
        taken.extend(m["Body"] for m in got)
    return taken


async def _true(value: bool) -> bool:
    return value


async def test_a_heartbeat_no_shorter_than_the_timeout_is_refused(moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue(visibility=3)

    async def handle(ctx: Context) -> None:
        pass

    app, _ = worker(moto.settings(sqlite_url), url, handle, dead_letter_queue_url=dlq, heartbeat_interval=3)
    with pytest.raises(ConfigurationError, match="heartbeat"):
        await app.start()


async def test_without_a_dead_letter_queue_the_redrive_policy_moves_parked_messages(
        moto: Moto, sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    url, dlq = await moto.queue(max_receives=3)
    seen: list[str] = []

    async def handle(ctx: Context) -> None:
        seen.append(ctx.delivery.text())

    app, _ = worker(moto.settings(sqlite_url), url, handle, key="order-id")
    with caplog.at_level(logging.INFO, logger="consumer_kit.sources.sqs"):
        async with app.running():
            await moto.send(url, [{"MessageBody": "keyed", "MessageAttributes": {"order-id": attribute("O-1")}},
                                  {"MessageBody": "unkeyed"}])

            async def moved() -> bool:
                return await moto.depth(dlq) == 1 and await moto.depth(url) == 0

            await wait_until(moved, 30, "the redrive policy to move the parked message")
            letters = await app.dead_letters.list()
    messages = [r.getMessage() for r in caplog.records]
    assert any("moves a message to its dead-letter queue after 3 receives" in m for m in messages)
    assert any("left to the queue's redrive policy" in m for m in messages)
    assert seen == ["keyed"]
    assert [(letter.reason, letter.body) for letter in letters] == [("missing_stable_id", b"unkeyed")]  # once
    assert [m["Body"] for m in await moto.drain(dlq)] == ["unkeyed"]


async def test_no_dead_letter_queue_and_no_redrive_policy_is_refused(moto: Moto, sqlite_url: str) -> None:
    url, _ = await moto.queue(dead_letter=False)

    async def handle(ctx: Context) -> None:
        pass

    app, _ = worker(moto.settings(sqlite_url), url, handle)
    with pytest.raises(ConfigurationError, match="no redrive policy and no dead_letter_queue_url"):
        await app.start()


async def test_an_unreachable_endpoint_is_a_clear_error_at_start(sqlite_url: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Credentials of its own: without the moto server's fixture (set up or not by an earlier test of this
    # worker) boto3 would stop at "no AWS credentials" before it tried the endpoint.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with socket.socket() as probe:  # a port that was just free: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = Moto(f"http://127.0.0.1:{port}").settings(sqlite_url)

    async def handle(ctx: Context) -> None:
        pass

    app, _ = worker(settings, f"http://127.0.0.1:{port}/123456789012/orders", handle)
    with pytest.raises(ConfigurationError, match="cannot reach the SQS endpoint"):
        await app.start()


async def test_the_endpoint_lost_mid_run_is_retried_with_backoff_and_nothing_is_lost(
        moto: Moto, sqlite_url: str) -> None:
    port = int(moto.endpoint.rsplit(":", 1)[1])
    proxy = TcpProxy(target=("127.0.0.1", port))
    await proxy.start()
    url, dlq = await moto.queue(visibility=5)
    seen: list[str] = []

    async def handle(ctx: Context) -> None:
        seen.append(ctx.delivery.text())

    settings = moto.settings(sqlite_url, sqs_endpoint_url=f"http://127.0.0.1:{proxy.port}")
    app, source = worker(settings, url, handle, dead_letter_queue_url=dlq, max_in_flight=8)
    failures = counted("consumer_kit_sqs_receive_failures_total", source)
    try:
        async with app.running():
            await moto.send(url, [{"MessageBody": f"a-{i}"} for i in range(100)])
            await wait_until(lambda: _true(len(seen) >= 20), 60, "the first effects")
            await proxy.stop()
            await moto.send(url, [{"MessageBody": f"b-{i}"} for i in range(100)])

            async def failing() -> bool:
                return counted("consumer_kit_sqs_receive_failures_total", source) > failures

            await wait_until(failing, 30, "receiving to fail")
            await asyncio.sleep(1)
            await proxy.start()  # the same port: the endpoint is back

            async def done() -> bool:
                return len(set(seen)) == 200 and await moto.depth(url) == 0

            await wait_until(done, 120, "all 200 effects after the endpoint came back")
    finally:
        await proxy.stop()
    assert sorted(set(seen)) == sorted([f"a-{i}" for i in range(100)] + [f"b-{i}" for i in range(100)])
    assert await moto.depth(dlq) == 0


async def test_fifo_keeps_each_groups_order_under_concurrency(moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue(fifo=True)
    done_in_order: dict[str, list[int]] = {}
    failed_once: set[str] = set()
    running: set[str] = set()
    overlaps: list[str] = []
    most_at_once = 0

    async def handle(ctx: Context) -> None:
        nonlocal most_at_once
        group, number = ctx.delivery.text().split(":")
        if group in running:
            overlaps.append(group)  # two messages of one group at once (asserted below)
        running.add(group)
        most_at_once = max(most_at_once, len(running))
        try:
            await asyncio.sleep(random.uniform(0, 0.02))
            if number == "5" and group not in failed_once:
                failed_once.add(group)  # the group's sixth message goes back to the queue once
                raise ConnectionError("try again")
            done_in_order.setdefault(group, []).append(int(number))
        finally:
            running.discard(group)

    settings = moto.settings(sqlite_url, retry_attempts=1, retry_later_seconds=0)
    # One poller: moto's ReceiveMessage is not atomic, so two at once can each take messages of one
    # group (SQS locks a group to the receive that got it). The groups still run concurrently here.
    app, _ = worker(settings, url, handle, dead_letter_queue_url=dlq, max_in_flight=16, retry_delays=(0.3,),
                    pollers=1)
    groups = [f"g{n}" for n in range(4)]
    async with app.running():
        await moto.send(url, [{"MessageBody": f"{g}:{i}", "MessageGroupId": g, "MessageDeduplicationId": f"{g}-{i}"}
                              for i in range(15) for g in groups])

        async def done() -> bool:
            return sum(map(len, done_in_order.values())) == 60 and await moto.depth(url) == 0

        await wait_until(done, 60, "every group")
    assert done_in_order == {g: list(range(15)) for g in groups}
    assert failed_once == set(groups)
    assert overlaps == [] and most_at_once > 1  # the groups ran side by side, each one at a time


async def test_shutdown_shows_held_messages_again_at_once_and_deletes_none(moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue(fifo=True, visibility=120)
    started = asyncio.Event()

    async def stuck(ctx: Context) -> None:
        started.set()
        await asyncio.sleep(3600)  # outlasts the grace period: cancelled at shutdown

    app, _ = worker(moto.settings(sqlite_url, shutdown_grace_seconds=0.5), url, stuck, dead_letter_queue_url=dlq,
                    pollers=1)  # see test_fifo_keeps_each_groups_order_under_concurrency
    await moto.send(url, [{"MessageBody": f"g:{i}", "MessageGroupId": "g", "MessageDeduplicationId": str(i)}
                          for i in range(4)])
    async with app.running():
        await asyncio.wait_for(started.wait(), 10)
    # The cancelled one and the three not started are visible again now, not after 120 s.
    assert await visible(moto, url) == 4

    order: list[str] = []

    async def record(ctx: Context) -> None:
        order.append(ctx.delivery.text())

    second, _ = worker(moto.settings(sqlite_url), url, record, dead_letter_queue_url=dlq, pollers=1)
    async with second.running():
        await wait_until(lambda: _true(len(order) == 4), 20, "the four messages")
        assert await second.dead_letters.count() == 0
    assert order == [f"g:{i}" for i in range(4)]


async def test_a_delete_batch_takes_one_message_twice(moto: Moto) -> None:
    url, _ = await moto.queue()
    await moto.send(url, [{"MessageBody": "twice"}])
    first = await asyncio.to_thread(moto.sqs.receive_message, QueueUrl=url, VisibilityTimeout=0)
    second = await asyncio.to_thread(moto.sqs.receive_message, QueueUrl=url, VisibilityTimeout=0)
    [m1], [m2] = first["Messages"], second["Messages"]
    assert m1["MessageId"] == m2["MessageId"] and m1["ReceiptHandle"] != m2["ReceiptHandle"]
    sqs = SqsClient(endpoint_url=moto.endpoint, region=REGION, threads=2, read_timeout=10, name="test")
    await sqs.open()
    sent: list[list[str]] = []
    sqs.client.meta.events.register("provide-client-params.sqs.DeleteMessageBatch",
                                    lambda params, **_: sent.append([e["Id"] for e in params["Entries"]]))
    try:
        deletes = BatchAction(sqs, "delete_message_batch", url, linger=0.05)
        answers = await asyncio.gather(*(deletes.put(lambda m=m: {"ReceiptHandle": m["ReceiptHandle"]})
                                         for m in (m1, m2)))
    finally:
        await sqs.close()
    assert sent == [["0", "1"]]  # one call, positional ids: never the message id twice
    assert [a["Id"] for a in answers] == ["0", "1"]
    assert await moto.depth(url) == 0
