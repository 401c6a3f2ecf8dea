"""RedisStreamSource on real Redis servers (the machine's 127.0.0.1:6379, or a RedisServer of the
test's own): what is its transport's beyond the contract. A crashed replica's entries taken over by
another after claim_idle_seconds, a retry that waits out its delay (longer than claim_idle) in this
consumer's pending list and comes back as delivery 2, MAX_DELIVERIES parking with a dead-letter copy,
a server killed and started again (AOF fsynced at every write: entries, acks and the pending list
survive), the outbox publisher with the inbox absorbing a re-published row, a batched handler, the
default key, CloudEvents and the configuration errors. Every test that leaves nothing pending checks
XPENDING's count is 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from prometheus_client import REGISTRY

from consumer_kit import Batch, ConfigurationError, ConsumerApp, Context, RetryableError, TerminalError
from consumer_kit.keys import short
from consumer_kit.outbox import OutboxMessage
from consumer_kit.sources.redis import (
    ENTRY_ID_FIELD,
    KEY_DIGEST_FIELD,
    MESSAGE_ID_FIELD,
    REASON_FIELD,
    SOURCE_STREAM_FIELD,
    RedisStreamPublisher,
    RedisStreamSource,
)
from tests.conftest import make_settings
from tests.integration.effects import EffectTable
from tests.integration.rabbit import wait_until
from tests.integration.redis_env import (
    GROUP,
    REDIS_URL,
    RedisServer,
    add,
    dead_letters,
    pending,
    pending_count,
    unique_stream,
    unread,
)

pytestmark = pytest.mark.redis

Handler = Callable[[Context], Awaitable[None]]
ROOT = Path(__file__).resolve().parents[2]


def worker(database_url: str, stream: str, handler: Handler, *, url: str = REDIS_URL, batch: Batch | None = None,
           settings: dict[str, Any] | None = None, **options: Any) -> tuple[ConsumerApp, RedisStreamSource]:
    app = ConsumerApp(make_settings(database_url, **{"retry_attempts": 1, "retry_later_seconds": 0.1,
                                                     **(settings or {})}))
    options.setdefault("namespace", "orders")
    options.setdefault("version", 1)
    source = RedisStreamSource(stream=stream, group=GROUP, url=url, **options)
    app.handler(source, name="redis-test", batch=batch, single_transaction=batch is not None)(handler)
    return app, source


EFFECTS = EffectTable("redis_effects")
prepare, effect, effects = EFFECTS.prepare, EFFECTS.write, EFFECTS.counts


def counted(metric: str, source: RedisStreamSource) -> float:
    return REGISTRY.get_sample_value(metric, {"source": source.name}) or 0.0


async def settled(stream: str) -> bool:
    return await pending_count(stream) == 0 and await unread(stream) == 0


CRASHING_WORKER = """
import asyncio, sys
from consumer_kit import ConsumerApp
from consumer_kit.sources.redis import RedisStreamSource
from tests.conftest import make_settings

async def main() -> None:
    app = ConsumerApp(make_settings(sys.argv[1], inbox_lease_seconds=2))
    source = RedisStreamSource(stream=sys.argv[2], group="workers", namespace="takeover", version=1,
                               url=sys.argv[3], consumer="crashing", claim_idle_seconds=1.0)

    @app.handler(source, name="redis-test")
    async def handle(ctx) -> None:
        print("started", flush=True)
        await asyncio.Event().wait()  # holds the entry until the process is killed

    async with app.running():
        await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_crashed_replicas_entries_are_taken_over_and_run_once(sqlite_url: str) -> None:
    async with unique_stream() as stream:
        ids = [await add(stream, {"body": f"order-{i}"}) for i in range(3)]
        crashing = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CRASHING_WORKER, sqlite_url, stream, REDIS_URL, cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert crashing.stdout is not None
            started, output = 0, []
            while started < 3:
                line = (await asyncio.wait_for(crashing.stdout.readline(), 60)).decode()
                output.append(line)
                assert line, f"the crashing worker ended before its handlers started: {''.join(output)}"
                started += line.strip() == "started"
            assert {p["id"]: p["consumer"] for p in await pending(stream)} == dict.fromkeys(ids, "crashing")
        finally:
            crashing.send_signal(signal.SIGKILL)
            await asyncio.wait_for(crashing.wait(), 10)

        runs: list[tuple[str, int]] = []

        async def handle(ctx: Context) -> None:
            runs.append((ctx.delivery.text(), ctx.delivery.attempt))
            await effect(ctx, ctx.delivery.text())

        app, source = worker(sqlite_url, stream, handle, namespace="takeover", consumer="replica-b",
                             claim_idle_seconds=1.0, retry_delays=(0.3,))
        await prepare(sqlite_url)
        claimed = counted("consumer_kit_redis_claimed_total", source)
        async with app.running():
            async def done() -> bool:
                return len(await effects(sqlite_url)) == 3 and await settled(stream)

            await wait_until(done, 30, "replica b to take the crashed worker's entries over and run them")
        assert await effects(sqlite_url) == {f"order-{i}": 1 for i in range(3)}
        assert sorted(body for body, _ in runs) == [f"order-{i}" for i in range(3)], "a handler ran twice"
        assert all(attempt >= 2 for _, attempt in runs), runs  # delivered to the crashed one first
        assert counted("consumer_kit_redis_claimed_total", source) - claimed == 3
        assert await pending_count(stream) == 0


async def test_a_retry_waits_its_delay_in_the_pending_list_and_comes_back_as_delivery_two(sqlite_url: str) -> None:
    async with unique_stream() as stream:
        runs: list[tuple[int, float]] = []

        async def handle(ctx: Context) -> None:
            runs.append((ctx.delivery.attempt, time.monotonic()))
            if len(runs) == 1:
                raise RetryableError("the warehouse is busy")
            await effect(ctx, ctx.delivery.text())

        # The delay (1.5 s) is three idle times (0.5 s): the entry must stay ours, not be taken over early.
        app, source = worker(sqlite_url, stream, handle, claim_idle_seconds=0.5, retry_delays=(1.5,))
        await prepare(sqlite_url)
        async with app.running():
            await add(stream, {"body": "order-1"})
            await wait_until(lambda: _true(len(runs) == 1), 20, "the first attempt")
            await asyncio.sleep(0.8)
            [waiting] = await pending(stream)
            assert (waiting["consumer"], waiting["count"]) == (source.consumer, 1)
            assert waiting["idle"] < 500, "the waiting retry was not kept fresh"

            async def done() -> bool:
                return await effects(sqlite_url) == {"order-1": 1} and await settled(stream)

            await wait_until(done, 20, "the retry to come back and succeed")
        assert [attempt for attempt, _ in runs] == [1, 2]
        assert runs[1][1] - runs[0][1] >= 1.4, "the retry came back before its delay"
        assert await pending_count(stream) == 0
        assert counted("consumer_kit_redis_claimed_total", source) == 0


async def _true(value: bool) -> bool:
    return value


async def test_an_entry_retried_past_max_deliveries_is_parked_copied_and_acked(sqlite_url: str) -> None:
    async with unique_stream() as stream:
        attempts: list[int] = []

        async def handle(ctx: Context) -> None:
            attempts.append(ctx.delivery.attempt)
            raise RetryableError("never works")

        app, _ = worker(sqlite_url, stream, handle, retry_delays=(0.1,), settings={"max_deliveries": 3})
        await prepare(sqlite_url)
        async with app.running():
            entry_id = await add(stream, {"body": "order-9", "origin": "test"})

            async def parked() -> bool:
                return await app.dead_letters.count() == 1 and len(await dead_letters(stream)) == 1

            await wait_until(parked, 20, "the entry to be parked after three deliveries")
            await wait_until(lambda: settled(stream), 10, "nothing to be left pending")
            [letter] = await app.dead_letters.list()
        assert attempts == [1, 2, 3]
        assert letter.reason == "retries_exhausted" and letter.key_digest is not None
        [copy] = await dead_letters(stream)
        assert copy == {"body": "order-9", "origin": "test", REASON_FIELD: "retries_exhausted",
                        SOURCE_STREAM_FIELD: stream, ENTRY_ID_FIELD: entry_id,
                        KEY_DIGEST_FIELD: short(letter.key_digest)}
        assert await pending_count(stream) == 0


async def test_a_killed_server_started_again_keeps_entries_acks_and_the_pending_list(sqlite_url: str) -> None:
    server = RedisServer()
    await server.start()
    try:
        stream = "ck-restart"
        release = asyncio.Event()

        async def handle(ctx: Context) -> None:
            if ctx.delivery.text().startswith("held"):
                await release.wait()
            await effect(ctx, ctx.delivery.text())

        app, source = worker(sqlite_url, stream, handle, url=server.url, claim_idle_seconds=2.0)
        await prepare(sqlite_url)
        async with app.running():
            for i in range(3):
                await add(stream, {"body": f"done-{i}"}, url=server.url)
            await wait_until(lambda: _settled_on(server, stream), 20, "the first three to be acked")
            held = [await add(stream, {"body": f"held-{i}"}, url=server.url) for i in range(2)]
            await wait_until(lambda: _pending_on(server, stream, 2), 20, "the two held entries to be pending")
            await server.kill()  # SIGKILL: only what the append-only file has fsynced survives
            await wait_until(lambda: _true(source.unready_reason() is not None), 20, "the source to see it gone")
            await server.start()
            assert [p["id"] for p in await pending(stream, url=server.url)] == held, "the pending list was lost"
            assert await unread(stream, url=server.url) == 0, "the acks of the first three were lost"
            release.set()
            await add(stream, {"body": "after"}, url=server.url)

            async def done() -> bool:
                return len(await effects(sqlite_url)) == 6 and await _settled_on(server, stream)

            await wait_until(done, 40, "the held entries and the new one after the restart")
            await wait_until(lambda: _true(source.unready_reason() is None), 20, "the source to be ready again")
        assert await effects(sqlite_url) == {**{f"done-{i}": 1 for i in range(3)}, "held-0": 1, "held-1": 1, "after": 1}
        assert await pending_count(stream, url=server.url) == 0
    finally:
        await server.stop()


async def _settled_on(server: RedisServer, stream: str) -> bool:
    try:
        return await pending_count(stream, url=server.url) == 0 and await unread(stream, url=server.url) == 0
    except Exception:
        return False


async def _pending_on(server: RedisServer, stream: str, count: int) -> bool:
    return await pending_count(stream, url=server.url) == count


async def test_the_publishers_entry_is_consumed_once_even_when_published_twice(sqlite_url: str) -> None:
    async with unique_stream() as stream:
        publisher = RedisStreamPublisher(REDIS_URL, maxlen=1000)
        await publisher.check()
        row = OutboxMessage(id="row-1", destination=stream, body=b'{"order": 7}',
                            headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "body": "not this"})
        seen: list[dict[str, str]] = []

        async def handle(ctx: Context) -> None:
            seen.append(dict(ctx.delivery.headers))
            await effect(ctx, ctx.delivery.text())

        app, source = worker(sqlite_url, stream, handle, key=MESSAGE_ID_FIELD)
        await prepare(sqlite_url)
        duplicates = REGISTRY.get_sample_value("consumer_kit_deliveries_total",
                                               {"source": source.name, "outcome": "duplicate"}) or 0.0
        try:
            async with app.running():
                await publisher.publish(row)
                await wait_until(lambda: settled(stream), 20, "the row's entry to be consumed")
                await publisher.publish(row)  # the relay's retry after a lost reply: a second entry

                async def absorbed() -> bool:
                    return await settled(stream) and (REGISTRY.get_sample_value(
                        "consumer_kit_deliveries_total", {"source": source.name, "outcome": "duplicate"}) or 0) \
                        == duplicates + 1

                await wait_until(absorbed, 20, "the second entry to be acknowledged as a duplicate")
        finally:
            await publisher.close()
        assert await effects(sqlite_url) == {'{"order": 7}': 1}
        assert seen == [{MESSAGE_ID_FIELD: "row-1", "traceparent": row.headers["traceparent"]}]
        assert await pending_count(stream) == 0


async def test_the_publisher_says_in_one_line_that_the_server_cannot_be_reached() -> None:
    publisher = RedisStreamPublisher("redis://:s3cret-pass@127.0.0.1:1/0")
    with pytest.raises(ConfigurationError) as caught:
        await publisher.check()
    message = str(caught.value)
    assert "s3cret-pass" not in message and "\n" not in message
    assert message.startswith("cannot connect to Redis at redis://:***@127.0.0.1:1/0 for the outbox relay:"), message
    assert "connection refused" in message


async def test_a_wrong_password_is_one_line_without_the_password(sqlite_url: str) -> None:
    server = RedisServer()
    await server.start()
    try:
        async with redis.asyncio.Redis.from_url(server.url) as admin:
            await admin.config_set("requirepass", "right-one")
        app, _ = worker(sqlite_url, "ck-auth", _never, url=f"redis://:wrong-one@127.0.0.1:{server.port}/0")
        with pytest.raises(ConfigurationError) as caught:
            async with app.running():
                pass
        message = str(caught.value)
        assert "wrong-one" not in message and "\n" not in message
        assert "refused the login" in message, message
    finally:
        await server.stop()


async def _never(ctx: Context) -> None:
    raise AssertionError("no entry should reach this handler")


async def test_a_batched_handler_settles_every_entry(sqlite_url: str) -> None:
    async with unique_stream() as stream:
        async def handle(ctx: Context) -> None:
            if ctx.delivery.text() == "poison":
                raise TerminalError("never", reason="poison")
            await effect(ctx, ctx.delivery.text())

        app, _ = worker(sqlite_url, stream, handle, batch=Batch(max_size=8, max_wait_ms=20))
        await prepare(sqlite_url)
        sizes = (REGISTRY.get_sample_value("consumer_kit_batch_size_count") or 0.0,
                 REGISTRY.get_sample_value("consumer_kit_batch_size_sum") or 0.0)
        async with app.running():
            for i in range(20):
                await add(stream, {"body": f"b-{i}"})
            await add(stream, {"body": "poison"})

            async def done() -> bool:
                return len(await effects(sqlite_url)) == 20 and len(await dead_letters(stream)) == 1 \
                    and await settled(stream)

            await wait_until(done, 30, "every batched entry to be settled")
        assert await effects(sqlite_url) == {f"b-{i}": 1 for i in range(20)}
        assert [c[REASON_FIELD] for c in await dead_letters(stream)] == ["poison"]
        assert await pending_count(stream) == 0
        batches = (REGISTRY.get_sample_value("consumer_kit_batch_size_count") or 0.0) - sizes[0]
        batched = (REGISTRY.get_sample_value("consumer_kit_batch_size_sum") or 0.0) - sizes[1]
        assert batched >= 21 and batches < batched, "the entries did not run in batches"


async def test_the_default_key_is_the_entry_id_and_a_body_less_entry_is_its_fields_as_json(sqlite_url: str) -> None:
    async with unique_stream() as stream:
        seen: list[tuple[str, str | None, bytes, dict[str, str]]] = []

        async def handle(ctx: Context) -> None:
            seen.append((ctx.key.id, ctx.delivery.id, ctx.delivery.body, dict(ctx.delivery.headers)))
            await effect(ctx, ctx.key.id)

        app, _ = worker(sqlite_url, stream, handle)
        await prepare(sqlite_url)
        async with app.running():
            with_body = await add(stream, {"body": b"\x00raw", "origin": "caf\xe9".encode("latin-1")})
            without = await add(stream, {"order": "7", "kind": "paid"})
            await wait_until(lambda: _true(len(seen) == 2), 20, "both entries")
            await wait_until(lambda: settled(stream), 20, "both acked")
        assert sorted(seen) == sorted([
            (f"{stream}:{with_body}", f"{stream}:{with_body}", b"\x00raw", {"origin": "caf\ufffd"}),
            (f"{stream}:{without}", f"{stream}:{without}", json.dumps({"order": "7", "kind": "paid"},
                                                                      separators=(",", ":")).encode(),
             {"order": "7", "kind": "paid"}),
        ])
        assert await pending_count(stream) == 0


async def test_cloudevents_in_binary_and_structured_mode_key_by_source_and_id(sqlite_url: str) -> None:
    async with unique_stream() as stream:
        seen: list[tuple[str, bytes, str | None]] = []

        async def handle(ctx: Context) -> None:
            seen.append((ctx.key.id, ctx.delivery.body, ctx.delivery.headers.get("ce-type")))
            await effect(ctx, ctx.key.id)

        app, _ = worker(sqlite_url, stream, handle, envelope="cloudevents")
        await prepare(sqlite_url)
        async with app.running():
            await add(stream, {"body": '{"n": 1}', "ce_specversion": "1.0", "ce_id": "e-1", "ce_source": "/shop",
                               "ce_type": "order.paid", "content-type": "application/json"})
            event = {"specversion": "1.0", "id": "e-2", "source": "/shop", "type": "order.shipped", "data": {"n": 2}}
            await add(stream, {"body": json.dumps(event)})
            await add(stream, {"body": "not an event"})

            async def done() -> bool:
                return len(seen) == 2 and len(await dead_letters(stream)) == 1 and await settled(stream)

            await wait_until(done, 20, "two events run and the third parked")
        # Binary mode hands the body field over as it is; structured mode the event's data as compact JSON.
        assert sorted((body, kind) for _, body, kind in seen) == [(b'{"n": 1}', "order.paid"),
                                                                   (b'{"n":2}', "order.shipped")]
        assert len({key for key, _, _ in seen}) == 2
        assert [c[REASON_FIELD] for c in await dead_letters(stream)] == ["envelope_mismatch"]
        assert await pending_count(stream) == 0


async def test_declare_false_refuses_a_missing_group_in_one_line(sqlite_url: str) -> None:
    async with unique_stream() as stream:
        app, _ = worker(sqlite_url, stream, _never, declare=False)
        with pytest.raises(ConfigurationError, match="does not exist"):
            async with app.running():
                pass
        await add(stream, {"body": "x"})
        app, _ = worker(sqlite_url, stream, _never, declare=False)
        with pytest.raises(ConfigurationError, match=f"has no consumer group '{GROUP}'"):
            async with app.running():
                pass


async def test_an_entry_given_back_at_stop_is_taken_by_another_replica_at_once(sqlite_url: str) -> None:
    async with unique_stream() as stream:
        runs: list[str] = []

        async def handle(ctx: Context) -> None:
            runs.append(ctx.delivery.headers.get("replica", ""))
            if len(runs) == 1:
                await asyncio.Event().wait()  # never returns: cancelled when the stop's grace runs out
            await effect(ctx, ctx.delivery.text())

        first, _ = worker(sqlite_url, stream, handle, consumer="replica-a", claim_idle_seconds=60,
                          settings={"shutdown_grace_seconds": 0.2})
        await prepare(sqlite_url)
        async with first.running():
            await add(stream, {"body": "order-1"})
            await wait_until(lambda: _true(len(runs) == 1), 20, "replica a to start the entry")
        [given] = await pending(stream)
        assert given["consumer"] == "replica-a" and given["idle"] >= 60_000, given
        second, source = worker(sqlite_url, stream, handle, consumer="replica-b", claim_idle_seconds=60)
        started = time.monotonic()
        async with second.running():
            async def done() -> bool:
                return await effects(sqlite_url) == {"order-1": 1} and await settled(stream)

            await wait_until(done, 20, "replica b to take the given-back entry")
        assert time.monotonic() - started < 10, "taken only after claim_idle_seconds"
        assert counted("consumer_kit_redis_claimed_total", source) == 1
        assert await pending_count(stream) == 0


async def test_a_group_deleted_under_the_source_is_declared_again(sqlite_url: str) -> None:
    async with unique_stream() as stream:
        async def handle(ctx: Context) -> None:
            await effect(ctx, ctx.delivery.text())

        app, _ = worker(sqlite_url, stream, handle)
        await prepare(sqlite_url)
        async with app.running():
            await add(stream, {"body": "before"})
            await wait_until(lambda: settled(stream), 20, "the first entry")
            async with redis.asyncio.Redis.from_url(REDIS_URL) as admin:
                await admin.delete(stream)  # the stream and its group, as a server without persistence restarts
            await asyncio.sleep(1.5)
            await add(stream, {"body": "after"})

            async def done() -> bool:
                return await effects(sqlite_url) == {"before": 1, "after": 1} and await settled(stream)

            await wait_until(done, 30, "the group to be declared again and the new entry read")
        assert await pending_count(stream) == 0
