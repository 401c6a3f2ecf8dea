"""NatsSource on real JetStream servers (the machine's 127.0.0.1:4222, or a NatsServer of the test's own):
what is its transport's beyond the contract. The heartbeat (``in_progress``) that keeps a long handler's
message from being redelivered, a retry nak'd with its delay and back as delivery 2, MAX_DELIVERIES
parking with a dead-letter copy then ``term``, the consumer set-ups refused at start, keys by stream
sequence, a SIGKILLed replica's messages taken over after ack_wait, a server killed and started again
under a running source, the outbox publisher (PubAck duplicates, a subject no stream captures, trace
context), CloudEvents, connection errors, ``double_ack`` and a batched handler. Every test that leaves
nothing pending checks the durable consumer has nothing pending and nothing unacknowledged."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NoStreamResponseError
from opentelemetry.trace import SpanKind
from prometheus_client import REGISTRY

from consumer_kit import Batch, ConfigurationError, ConsumerApp, Context, RetryableError, TerminalError
from consumer_kit.delivery import Replayed
from consumer_kit.keys import short
from consumer_kit.outbox import OutboxMessage
from consumer_kit.sources.nats import (
    KEY_DIGEST_HEADER,
    MSG_ID_HEADER,
    ORIGINAL_MSG_ID_HEADER,
    REASON_HEADER,
    SOURCE_SEQUENCE_HEADER,
    SOURCE_STREAM_HEADER,
    SOURCE_SUBJECT_HEADER,
    NatsPublisher,
    NatsSource,
)
from tests.conftest import TEST_HMAC_KEY, Spans, make_settings
from tests.integration.effects import EffectTable
from tests.integration.nats_env import (
    NATS_URL,
    NatsServer,
    Stream,
    connected,
    consumer_state,
    free_port,
    own_stream,
    publish,
    stream_messages,
)
from tests.integration.rabbit import wait_until
from tests.integration.test_tracing_e2e import producer

pytestmark = pytest.mark.nats

Handler = Callable[[Context], Awaitable[None]]
ROOT = Path(__file__).resolve().parents[2]


def worker(database_url: str, stream: Stream, handler: Handler, *, batch: Batch | None = None,
           settings: dict[str, Any] | None = None, **options: Any) -> tuple[ConsumerApp, NatsSource]:
    app = ConsumerApp(make_settings(database_url, **{"retry_attempts": 1, "retry_later_seconds": 0.1,
                                                     **(settings or {})}))
    return app, attach(app, stream, handler, batch=batch, **options)


def attach(app: ConsumerApp, stream: Stream, handler: Handler, *, batch: Batch | None = None,
           name: str = "nats-test", **options: Any) -> NatsSource:
    options.setdefault("namespace", "orders")
    options.setdefault("version", 1)
    options.setdefault("retry_delays", (0.2,))
    options.setdefault("ack_wait_seconds", 5.0)
    source = NatsSource(stream=stream.name, subject=stream.subject, url=stream.url, **options)
    app.handler(source, name=name, batch=batch, single_transaction=batch is not None)(handler)
    return source


EFFECTS = EffectTable("nats_effects")
prepare, effect, effects = EFFECTS.prepare, EFFECTS.write, EFFECTS.counts


def settlements(source: NatsSource, action: str) -> float:
    return REGISTRY.get_sample_value("consumer_kit_nats_settlements_total",
                                     {"source": source.name, "action": action}) or 0.0


def deliveries(source: NatsSource, outcome: str) -> float:
    return REGISTRY.get_sample_value("consumer_kit_deliveries_total", {"source": source.name, "outcome": outcome}) \
        or 0.0


async def settled(stream: Stream, source: NatsSource) -> bool:
    """Nothing waits to be delivered and nothing delivered waits for its ack."""
    try:
        return await consumer_state(stream, source.durable) == (0, 0)
    except Exception:  # the server is away, or the consumer not there yet
        return False


async def redelivered(stream: Stream, source: NatsSource) -> int:
    async with connected(stream.url) as client:
        info = await client.jetstream().consumer_info(stream.name, source.durable)
        return info.num_redelivered or 0


async def copies(stream_name: str, url: str = NATS_URL) -> list[tuple[bytes, dict[str, str]]]:
    """The (body, headers) of every message in ``stream_name`` (a dead-letter stream), oldest first."""
    async with connected(url) as client:
        js = client.jetstream()
        try:
            info = await js.stream_info(stream_name)
        except Exception:
            return []
        if not info.state.messages:
            return []
        found = []
        for sequence in range(info.state.first_seq, info.state.last_seq + 1):
            message = await js.get_msg(stream_name, sequence)
            found.append((message.data or b"", {str(k): str(v) for k, v in (message.headers or {}).items()}))
        return found


async def _true(value: bool) -> bool:
    return value


# ---------------------------------------------------------------------------------------------------
# heartbeat, retries, parking


async def test_a_handler_longer_than_ack_wait_is_kept_by_in_progress_and_runs_once(sqlite_url: str) -> None:
    async with own_stream() as stream:
        runs: list[int] = []

        async def handle(ctx: Context) -> None:
            runs.append(ctx.delivery.attempt)
            await asyncio.sleep(3.5)  # three and a half ack_waits
            await effect(ctx, ctx.delivery.text())

        app, source = worker(sqlite_url, stream, handle, ack_wait_seconds=1.0)
        await prepare(sqlite_url)
        beats = settlements(source, "in_progress")
        async with app.running():
            await publish(stream, [("order-1", b"slow")])

            async def done() -> bool:
                return await effects(sqlite_url) == {"slow": 1} and await settled(stream, source)

            await wait_until(done, 20, "the slow handler to finish and be acked")
        assert runs == [1], "JetStream redelivered the message while its handler ran"
        assert await redelivered(stream, source) == 0
        assert settlements(source, "in_progress") - beats >= 3  # about two a second for 3.5 s
        assert settlements(source, "ack") == 1


async def test_a_retry_is_nakd_with_its_delay_and_comes_back_as_delivery_two(sqlite_url: str) -> None:
    async with own_stream() as stream:
        runs: list[tuple[int, float]] = []

        async def handle(ctx: Context) -> None:
            runs.append((ctx.delivery.attempt, time.monotonic()))
            if len(runs) == 1:
                raise RetryableError("the warehouse is busy")
            await effect(ctx, ctx.delivery.text())

        app, source = worker(sqlite_url, stream, handle, retry_delays=(1.0,))
        await prepare(sqlite_url)
        async with app.running():
            await publish(stream, [("order-1", b"order-1")])

            async def done() -> bool:
                return await effects(sqlite_url) == {"order-1": 1} and await settled(stream, source)

            await wait_until(done, 20, "the retry to come back and succeed")
        assert [attempt for attempt, _ in runs] == [1, 2]
        assert runs[1][1] - runs[0][1] >= 0.95, "the retry came back before its delay"
        assert (settlements(source, "nak"), settlements(source, "ack")) == (1, 1)
        assert deliveries(source, "processed") == 1


async def test_a_message_retried_past_max_deliveries_is_parked_copied_and_terminated(sqlite_url: str) -> None:
    async with own_stream() as stream:
        attempts: list[int] = []

        async def handle(ctx: Context) -> None:
            attempts.append(ctx.delivery.attempt)
            raise RetryableError("never works")

        app, source = worker(sqlite_url, stream, handle, retry_delays=(0.1,), settings={"max_deliveries": 3})
        async with app.running():
            await publish(stream, [("order-9", b'{"order": 9}')], headers={"origin": "test"})

            async def parked() -> bool:
                return await app.dead_letters.count() == 1 and len(await copies(source.dead_letter_stream)) == 1 \
                    and await settled(stream, source)

            await wait_until(parked, 20, "the message to be parked after three deliveries")
            [letter] = await app.dead_letters.list()
        assert attempts == [1, 2, 3]
        assert letter.reason == "retries_exhausted" and letter.key_digest is not None
        [(body, headers)] = await copies(source.dead_letter_stream)
        assert body == b'{"order": 9}'
        assert headers == {"origin": "test", REASON_HEADER: "retries_exhausted", ORIGINAL_MSG_ID_HEADER: "order-9",
                           SOURCE_STREAM_HEADER: stream.name, SOURCE_SEQUENCE_HEADER: "1",
                           SOURCE_SUBJECT_HEADER: f"{stream.prefix}.work", MSG_ID_HEADER: f"{stream.name}:1",
                           KEY_DIGEST_HEADER: short(letter.key_digest)}
        assert not any("orders:v1:" in value for value in headers.values()), "the raw key is on the copy"
        assert (settlements(source, "dead_letter_copy"), settlements(source, "term")) == (1, 1)
        assert await consumer_state(stream, source.durable) == (0, 0)


async def test_an_idle_source_stays_ready_and_says_nothing(sqlite_url: str,
                                                          no_raw_keys_in_logs_or_metrics: Any) -> None:
    """An empty pull is not a failure: nats-py's fetch ends some of them in asyncio's own TimeoutError
    (not nats.errors.TimeoutError), which once made an idle source unready half of the time."""
    async with own_stream() as stream:
        app, source = worker(sqlite_url, stream, _record)
        await prepare(sqlite_url)
        unready: list[str] = []
        async with app.running():
            for step in range(60):
                await asyncio.sleep(0.1)
                if (reason := source.unready_reason()) is not None:
                    unready.append(reason)
                if step % 10 == 0:
                    await publish(stream, [(f"order-{step}", f"order-{step}".encode())])
            await wait_until(lambda: settled(stream, source), 20, "the six messages")
        assert unready == [], f"an idle source reported itself unready {len(unready)} times out of 60"
        said = no_raw_keys_in_logs_or_metrics.texts
        assert not [line for line in said if "pulling failed" in line], "an empty pull was logged as a failure"
        assert len(await effects(sqlite_url)) == 6


# ---------------------------------------------------------------------------------------------------
# set-ups refused at start


async def _refused(app: ConsumerApp) -> str:
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as caught:
        async with app.running():
            pass
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert "\n" not in message, message
    return message


async def test_a_consumer_whose_max_deliver_is_below_max_deliveries_is_refused(sqlite_url: str) -> None:
    async with own_stream() as stream, connected() as client:
        await client.jetstream().add_consumer(stream.name, ConsumerConfig(
            durable_name="operators", ack_policy=AckPolicy.EXPLICIT, max_deliver=2, filter_subject=stream.subject))
        app, _ = worker(sqlite_url, stream, _never, declare=False, durable="operators", dead_letter_subject=None)
        message = await _refused(app)
        assert "consumer operators has max_deliver 2, below MAX_DELIVERIES 10" in message, message

        app, _ = worker(sqlite_url, stream, _never, max_deliver=2, namespace="declared")
        message = await _refused(app)
        assert "has max_deliver 2, below MAX_DELIVERIES 10" in message, message

        # The same consumer is fine once MAX_DELIVERIES leaves it room.
        app, source = worker(sqlite_url, stream, _record, declare=False, durable="operators",
                             dead_letter_subject=None, settings={"max_deliveries": 2})
        async with app.running():
            await publish(stream, [("ok-1", b"fine")])
            await wait_until(lambda: settled(stream, source), 20, "the message on the operator's consumer")


async def test_a_consumer_without_explicit_acks_is_refused(sqlite_url: str) -> None:
    async with own_stream() as stream, connected() as client:
        # JetStream lets a push consumer go without acks (a pull consumer must ack explicitly).
        await client.jetstream().add_consumer(stream.name, ConsumerConfig(
            durable_name="no-acks", ack_policy=AckPolicy.NONE, deliver_subject=f"{stream.prefix}-push"))
        app, _ = worker(sqlite_url, stream, _never, declare=False, durable="no-acks", dead_letter_subject=None)
        message = await _refused(app)
        assert "consumer no-acks acks" in message and "needs explicit acks" in message, message


async def test_declare_false_refuses_a_missing_stream_consumer_or_dead_letter_stream(sqlite_url: str) -> None:
    missing = Stream(name="CK_TEST_NOT_THERE", subject="ck-test.not-there.>")
    app, _ = worker(sqlite_url, missing, _never, declare=False, dead_letter_subject=None)
    message = await _refused(app)
    assert "a stream or consumer it needs is missing" in message, message
    async with own_stream() as stream:
        app, _ = worker(sqlite_url, stream, _never, declare=False, dead_letter_subject=None)
        message = await _refused(app)
        assert "a stream or consumer it needs is missing" in message and "consumer" in message, message
        async with connected() as client:
            await client.jetstream().add_consumer(stream.name, ConsumerConfig(
                durable_name="present", ack_policy=AckPolicy.EXPLICIT, filter_subject=stream.subject))
        app, _ = worker(sqlite_url, stream, _never, declare=False, durable="present")  # the dead-letter stream?
        message = await _refused(app)
        assert "missing" in message, message


async def _never(ctx: Context) -> None:
    raise AssertionError("no message should reach this handler")


async def _record(ctx: Context) -> None:
    await effect(ctx, ctx.delivery.text())


# ---------------------------------------------------------------------------------------------------
# keys


async def test_stable_id_sequence_keys_by_stream_and_sequence(sqlite_url: str) -> None:
    async with own_stream() as stream:
        seen: list[tuple[str, int, str]] = []

        async def handle(ctx: Context) -> None:
            seen.append((ctx.key.id, ctx.delivery.attempt, ctx.delivery.text()))
            if ctx.delivery.text() == "flaky" and ctx.delivery.attempt == 1:
                raise RetryableError("once")
            await effect(ctx, ctx.key.id)

        app, source = worker(sqlite_url, stream, handle, stable_id="sequence", retry_delays=(0.1,))
        await prepare(sqlite_url)
        async with app.running():
            await publish(stream, [(None, b"same"), (None, b"same"), (None, b"flaky")])

            async def done() -> bool:
                return len(await effects(sqlite_url)) == 3 and await settled(stream, source)

            await wait_until(done, 20, "three messages, one of them retried")
        # The same body published twice is two messages, two effects; the nak'd one keeps its key.
        assert await effects(sqlite_url) == {f"{stream.name}:1": 1, f"{stream.name}:2": 1, f"{stream.name}:3": 1}
        assert sorted(seen) == [(f"{stream.name}:1", 1, "same"), (f"{stream.name}:2", 1, "same"),
                                (f"{stream.name}:3", 1, "flaky"), (f"{stream.name}:3", 2, "flaky")]


# ---------------------------------------------------------------------------------------------------
# takeover, server restart


TAKEOVER_APP = """
import asyncio, os
from consumer_kit import ConsumerApp
from consumer_kit.sources.nats import NatsSource

app = ConsumerApp()
source = NatsSource(stream=os.environ["TAKEOVER_STREAM"], subject=os.environ["TAKEOVER_SUBJECT"],
                    namespace="takeover", version=1, durable="replicas", ack_wait_seconds=1.5)

@app.handler(source, name="nats-test")
async def handle(ctx) -> None:
    print("started", flush=True)
    await asyncio.Event().wait()  # holds the message until the process is killed
"""


@pytest.mark.postgres
async def test_a_sigkilled_replicas_messages_are_taken_over_after_ack_wait_and_run_once(
        pg_database: str, tmp_path: Path) -> None:
    await prepare(pg_database)
    async with own_stream() as stream:
        (tmp_path / "app.py").write_text(TAKEOVER_APP)
        env = {**os.environ, "DATABASE_URL": pg_database, "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY, "NATS_URL": NATS_URL,
               "INBOX_LEASE_SECONDS": "2", "DB_POOL_SIZE": "3", "TAKEOVER_STREAM": stream.name,
               "TAKEOVER_SUBJECT": stream.subject, "PYTHONPATH": str(ROOT)}
        with (tmp_path / "worker.log").open("wb") as log:
            crashing = await asyncio.create_subprocess_exec(
                str(Path(sys.executable).with_name("consumer-kit")), "run", f"{tmp_path / 'app.py'}:app",
                cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=log)
        try:
            await publish(stream, [(f"order-{i}", f"order-{i}".encode()) for i in range(3)])
            assert crashing.stdout is not None
            started = 0
            while started < 3:
                line = (await asyncio.wait_for(crashing.stdout.readline(), 60)).decode()
                assert line, f"the worker ended before its handlers started: {(tmp_path / 'worker.log').read_text()}"
                started += line.strip() == "started"
            assert await consumer_state(stream, "replicas") == (0, 3)
        finally:
            crashing.send_signal(signal.SIGKILL)
            await asyncio.wait_for(crashing.wait(), 10)

        runs: list[tuple[str, int]] = []

        async def handle(ctx: Context) -> None:
            runs.append((ctx.delivery.text(), ctx.delivery.attempt))
            await effect(ctx, ctx.delivery.text())

        app, source = worker(pg_database, stream, handle, namespace="takeover", durable="replicas",
                             ack_wait_seconds=1.5, settings={"inbox_lease_seconds": 2})
        async with app.running():
            async def done() -> bool:
                return len(await effects(pg_database)) == 3 and await settled(stream, source)

            await wait_until(done, 30, "the second replica to take the killed one's messages and run them")
        assert await effects(pg_database) == {f"order-{i}": 1 for i in range(3)}
        assert sorted(body for body, _ in runs) == [f"order-{i}" for i in range(3)], "a handler ran twice"
        assert all(attempt >= 2 for _, attempt in runs), runs  # delivered to the killed replica first
        assert await consumer_state(stream, "replicas") == (0, 0)


async def test_a_server_killed_and_started_again_under_the_source(sqlite_url: str) -> None:
    server = NatsServer()
    server.start()
    try:
        async with own_stream(server.url) as stream:
            release = asyncio.Event()
            runs: list[str] = []

            async def handle(ctx: Context) -> None:
                runs.append(ctx.delivery.text())
                if ctx.delivery.text().startswith("held"):
                    await release.wait()
                await effect(ctx, ctx.delivery.text())

            app, source = worker(sqlite_url, stream, handle, max_in_flight=2, ack_wait_seconds=2.0)
            await prepare(sqlite_url)
            async with app.running():
                await publish(stream, [("done-0", b"done-0")])
                await wait_until(lambda: settled(stream, source), 20, "the first message to be acked")
                held = [(f"held-{i}", f"held-{i}".encode()) for i in range(2)]
                waiting = [(f"waiting-{i}", f"waiting-{i}".encode()) for i in range(3)]
                await publish(stream, held + waiting)
                await wait_until(lambda: _true(source.held == 2), 20, "the two held messages to be in flight")
                assert await consumer_state(stream, source.durable) == (3, 2)
                await asyncio.to_thread(server.kill)
                await wait_until(lambda: _true(source.unready_reason() == "broker_disconnected"), 20,
                                 "the source to see the server gone")
                await asyncio.to_thread(server.start)
                await wait_until(lambda: _true(source.unready_reason() is None), 20, "the source to be ready again")
                release.set()

                async def done() -> bool:
                    return len(await effects(sqlite_url)) == 6 and await settled(stream, source)

                await wait_until(done, 40, "every message after the restart")
            assert await effects(sqlite_url) == {"done-0": 1, "held-0": 1, "held-1": 1, "waiting-0": 1,
                                                 "waiting-1": 1, "waiting-2": 1}
            assert await consumer_state(stream, source.durable) == (0, 0)
    finally:
        server.stop()


async def test_a_message_whose_handler_is_cancelled_at_stop_is_nakd_for_another_replica_at_once(
        sqlite_url: str) -> None:
    async with own_stream() as stream:
        runs: list[int] = []

        async def handle(ctx: Context) -> None:
            runs.append(ctx.delivery.attempt)
            if len(runs) == 1:
                await asyncio.Event().wait()  # never returns: cancelled when the stop's grace runs out
            await effect(ctx, ctx.delivery.text())

        first, source = worker(sqlite_url, stream, handle, durable="replicas", ack_wait_seconds=60.0,
                               settings={"shutdown_grace_seconds": 0.2})
        given: list[int] = []
        give_back = source._give_back

        async def counting(message: Any) -> None:
            given.append(message.metadata.num_delivered)
            await give_back(message)

        source._give_back = counting  # type: ignore[method-assign]
        await prepare(sqlite_url)
        async with first.running():
            await publish(stream, [("order-1", b"order-1")])
            await wait_until(lambda: _true(len(runs) == 1), 20, "the first replica to start the message")
        second, source = worker(sqlite_url, stream, handle, durable="replicas", ack_wait_seconds=60.0)
        started = time.monotonic()
        async with second.running():
            async def done() -> bool:
                return await effects(sqlite_url) == {"order-1": 1} and await settled(stream, source)

            await wait_until(done, 20, "the second replica to get the message given back")
        assert time.monotonic() - started < 10, "redelivered only after ack_wait"
        assert runs == [1, 2] and given == [1], f"given back at deliveries {given}"


# ---------------------------------------------------------------------------------------------------
# the outbox publisher


async def test_an_outbox_row_goes_out_with_its_id_and_its_trace(sqlite_url: str, spans: Spans) -> None:
    async with own_stream() as inbound, own_stream(prefix="ck-onward", duplicate_window=None) as onward:
        settings = make_settings(sqlite_url, retry_attempts=1, outbox_poll_seconds=0.1)
        app = ConsumerApp(settings, tracer_provider=spans.provider)
        app.relay_outbox(NatsPublisher(NATS_URL, settings=settings))
        subject = f"{onward.prefix}.shipments"
        ids: list[str] = []

        async def handle(ctx: Context) -> None:
            ids.append(ctx.outbox.publish(subject, b'{"shipment": 1}'))

        got: list[tuple[str | None, str]] = []
        done = asyncio.Event()

        async def ship(ctx: Context) -> None:
            got.append((ctx.delivery.id, ctx.delivery.headers.get("nats-subject", "")))
            await effect(ctx, ctx.delivery.text())
            done.set()

        first = attach(app, inbound, handle)
        second = attach(app, onward, ship, namespace="shipments", name="onward")
        await prepare(sqlite_url)
        async with app.running():
            origin, headers = producer(spans, f"send {inbound.subject}")
            await publish(inbound, [("order-1", b"{}")], headers=headers)
            await asyncio.wait_for(done.wait(), 20)
            await wait_until(lambda: settled(onward, second), 20, "the onward message to be acked")
        assert got == [(ids[0], subject)], "the row did not go out with Nats-Msg-Id = its id"
        assert await effects(sqlite_url) == {'{"shipment": 1}': 1}
        delivery = spans.one(f"process {first.name}")
        assert delivery.parent is not None and delivery.parent.span_id == origin.context.span_id
        (handler,) = [s for s in spans.named("handler") if s.parent and s.parent.span_id == delivery.context.span_id]
        send = spans.one(f"send {subject}")
        assert send.kind is SpanKind.PRODUCER and send.parent is not None
        assert send.parent.span_id == handler.context.span_id
        assert dict(send.attributes or {})["messaging.system"] == "nats"
        joined = spans.one(f"process {second.name}")
        assert joined.context.trace_id == origin.context.trace_id
        assert joined.parent is not None and joined.parent.span_id == send.context.span_id


async def test_a_row_published_twice_is_one_stream_message_and_one_effect(sqlite_url: str) -> None:
    async with own_stream(duplicate_window=None) as stream, own_stream(prefix="ck-short") as short_window:
        publisher = NatsPublisher(NATS_URL)
        await publisher.check()
        rows = [OutboxMessage(id="row-1", destination=f"{stream.prefix}.work", body=b'{"order": 7}',
                              headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}),
                OutboxMessage(id="row-2", destination=f"{short_window.prefix}.work", body=b'{"order": 8}',
                              headers={})]
        try:
            await publisher.publish(rows[0])
            await publisher.publish(rows[0])  # the relay again, its mark as published lost: a PubAck duplicate
            assert await stream_messages(stream.name) == 1
            await publisher.publish(rows[1])
            await asyncio.sleep(0.3)  # past the short window: the stream stores the repeat
            await publisher.publish(rows[1])
            assert await stream_messages(short_window.name) == 2
        finally:
            await publisher.close()
        seen: list[tuple[str | None, str | None]] = []

        async def handle(ctx: Context) -> None:
            seen.append((ctx.delivery.id, ctx.delivery.headers.get("traceparent")))
            await effect(ctx, ctx.delivery.text())

        app = ConsumerApp(make_settings(sqlite_url, retry_attempts=1))
        long_source = attach(app, stream, handle)
        short_source = attach(app, short_window, handle, namespace="short", name="short")
        await prepare(sqlite_url)
        async with app.running():
            async def done() -> bool:
                return len(await effects(sqlite_url)) == 2 and await settled(stream, long_source) \
                    and await settled(short_window, short_source) and deliveries(short_source, "duplicate") == 1

            await wait_until(done, 20, "both rows consumed, the stored repeat as a duplicate")
        assert await effects(sqlite_url) == {'{"order": 7}': 1, '{"order": 8}': 1}
        assert sorted(seen, key=str) == [("row-1", rows[0].headers["traceparent"]), ("row-2", None)]


async def test_a_row_for_a_subject_no_stream_captures_stays_pending(sqlite_url: str) -> None:
    publisher = NatsPublisher(NATS_URL)
    try:
        started = time.monotonic()
        with pytest.raises(NoStreamResponseError):  # no stream answered with its PubAck
            await publisher.publish(OutboxMessage(id="row-x", destination="ck-test.nobody-captures-this",
                                                  body=b"{}", headers={}))
        assert time.monotonic() - started < 2, "the failure waited for the publish timeout"
    finally:
        await publisher.close()
    async with own_stream() as stream:
        settings = make_settings(sqlite_url, retry_attempts=1, outbox_poll_seconds=0.1)
        app = ConsumerApp(settings)
        app.relay_outbox(NatsPublisher(NATS_URL, settings=settings))
        ids: list[str] = []

        async def handle(ctx: Context) -> None:
            ids.append(ctx.outbox.publish("ck-test.nobody-captures-this", b"{}"))

        source = attach(app, stream, handle)
        async with app.running():
            await publish(stream, [("order-1", b"{}")])
            await wait_until(lambda: settled(stream, source), 20, "the inbound message")

            async def tried() -> bool:
                row = await app.outbox.get(ids[0]) if ids else None
                return row is not None and row["attempts"] >= 1

            await wait_until(tried, 20, "the relay to try the row")
            row = await app.outbox.get(ids[0])
        assert row is not None and row["published_at"] is None, row
        assert str(row["last_error"]).startswith("NoStreamResponseError"), row


# ---------------------------------------------------------------------------------------------------
# CloudEvents


async def test_cloudevents_binary_and_structured_key_by_source_and_id(sqlite_url: str) -> None:
    async with own_stream() as stream:
        seen: list[tuple[str, bytes, str | None]] = []

        async def handle(ctx: Context) -> None:
            seen.append((ctx.key.id, ctx.delivery.body, ctx.delivery.headers.get("ce-type")))
            await effect(ctx, ctx.key.id)

        app, source = worker(sqlite_url, stream, handle, envelope="cloudevents")
        await prepare(sqlite_url)
        shipped = {"specversion": "1.0", "id": "e-2", "source": "/shop", "type": "order.shipped", "data": {"n": 2}}
        refunded = {"specversion": "1.0", "id": "e-3", "source": "/shop", "type": "order.refunded", "data": {"n": 3}}
        async with app.running():
            await publish(stream, [(None, b'{"n": 1}')],
                          headers={"ce-specversion": "1.0", "ce-id": "e-1", "ce-source": "/shop",
                                   "ce-type": "order.paid", "content-type": "application/json"})
            await publish(stream, [(None, json.dumps(shipped).encode())])
            await publish(stream, [(None, json.dumps(refunded).encode())],
                          headers={"content-type": "application/cloudevents+json"})
            # The same event (source and id) again, on another message: one effect.
            await publish(stream, [("another-msg-id", json.dumps(shipped).encode())])
            await publish(stream, [(None, b"not an event")])

            async def done() -> bool:
                return len(seen) == 3 and len(await copies(source.dead_letter_stream)) == 1 \
                    and await settled(stream, source) and deliveries(source, "duplicate") == 1

            await wait_until(done, 20, "three events run, a repeat acked, and the fifth parked")
            [letter] = await app.dead_letters.list()
        assert sorted((body, kind) for _, body, kind in seen) == [
            (b'{"n": 1}', "order.paid"), (b'{"n":2}', "order.shipped"), (b'{"n":3}', "order.refunded")]
        assert len({key for key, _, _ in seen}) == 3
        assert len(await effects(sqlite_url)) == 3 and set((await effects(sqlite_url)).values()) == {1}
        assert letter.reason == "envelope_mismatch"
        assert [headers[REASON_HEADER] for _, headers in await copies(source.dead_letter_stream)] == \
            ["envelope_mismatch"]


# ---------------------------------------------------------------------------------------------------
# connections, double_ack, batches


async def test_an_unreachable_server_is_one_line_at_once_without_the_password(sqlite_url: str) -> None:
    port = free_port()
    for url, shown in ((f"nats://127.0.0.1:{port}", f"nats://127.0.0.1:{port}"),
                       (f"nats://alice:s3cret-pass@127.0.0.1:{port}", f"nats://***@127.0.0.1:{port}")):
        app = ConsumerApp(make_settings(sqlite_url))
        source = NatsSource(stream="CK_TEST_NOWHERE", subject="ck-test.nowhere.>", namespace="orders", version=1,
                            url=url)
        app.handler(source, name="nats-test")(_never)
        started = time.monotonic()
        message = await _refused(app)
        assert time.monotonic() - started < 2, "the first connect hung"
        assert "s3cret-pass" not in message
        assert message.startswith(f"cannot connect to NATS at {shown} for {source.name}:"), message
        assert "connection refused" in message, message
    publisher = NatsPublisher(f"nats://alice:s3cret-pass@127.0.0.1:{port}")
    with pytest.raises(ConfigurationError) as caught:
        await publisher.check()
    assert "s3cret-pass" not in str(caught.value) and "\n" not in str(caught.value)


@pytest.fixture
async def password_server(tmp_path: Path) -> AsyncIterator[int]:
    """A nats-server of the test's own that wants user alice, password right-one."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        "nats-server", "-a", "127.0.0.1", "-p", str(port), "--user", "alice", "--pass", "right-one",
        "-l", str(tmp_path / "auth.log"), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        async def listening() -> bool:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            writer.close()
            return True

        await wait_until(listening, 20, "the password server to listen")
        yield port
    finally:
        process.send_signal(signal.SIGKILL)
        await asyncio.wait_for(process.wait(), 10)


async def test_a_wrong_password_is_one_line_without_the_password(sqlite_url: str, password_server: int) -> None:
    app = ConsumerApp(make_settings(sqlite_url))
    source = NatsSource(stream="CK_TEST_AUTH", subject="ck-test.auth.>", namespace="orders", version=1,
                        url=f"nats://alice:wrong-one@127.0.0.1:{password_server}")
    app.handler(source, name="nats-test")(_never)
    started = time.monotonic()
    message = await _refused(app)
    assert time.monotonic() - started < 3, "the first connect hung"
    assert "wrong-one" not in message
    assert "refused the login" in message, message


async def test_double_ack_waits_for_the_servers_confirmation(sqlite_url: str) -> None:
    async with own_stream() as stream:
        app, source = worker(sqlite_url, stream, _record, double_ack=True)
        await prepare(sqlite_url)
        async with app.running():
            await publish(stream, [(f"order-{i}", f"order-{i}".encode()) for i in range(5)])

            async def done() -> bool:
                return len(await effects(sqlite_url)) == 5 and await settled(stream, source)

            await wait_until(done, 20, "five messages acked with ack_sync")
        assert await effects(sqlite_url) == {f"order-{i}": 1 for i in range(5)}
        assert settlements(source, "ack") == 5
        assert await redelivered(stream, source) == 0


async def test_a_batched_handler_runs_every_message_once(sqlite_url: str) -> None:
    async with own_stream() as stream:
        app, source = worker(sqlite_url, stream, _record, batch=Batch(max_size=16, max_wait_ms=20),
                             max_in_flight=32)
        await prepare(sqlite_url)
        sizes = (REGISTRY.get_sample_value("consumer_kit_batch_size_count") or 0.0,
                 REGISTRY.get_sample_value("consumer_kit_batch_size_sum") or 0.0)
        async with app.running():
            await publish(stream, [(f"b-{i}", f"b-{i}".encode()) for i in range(40)])

            async def done() -> bool:
                return len(await effects(sqlite_url)) == 40 and await settled(stream, source)

            await wait_until(done, 30, "every batched message")
        assert await effects(sqlite_url) == {f"b-{i}": 1 for i in range(40)}
        batches = (REGISTRY.get_sample_value("consumer_kit_batch_size_count") or 0.0) - sizes[0]
        batched = (REGISTRY.get_sample_value("consumer_kit_batch_size_sum") or 0.0) - sizes[1]
        assert batched >= 40 and batches < batched / 2, f"{batched} messages in {batches} batches"
        assert await redelivered(stream, source) == 0




# ---------------------------------------------------------------------------------------------------
# consumer-kit parked replay


PARKED_APP = """
import os
from consumer_kit import ConsumerApp
from consumer_kit.sources.nats import NatsSource

app = ConsumerApp()
source = NatsSource(stream=os.environ["PARKED_STREAM"], subject=os.environ["PARKED_SUBJECT"], namespace="orders",
                    version=1, retry_delays=(0.2,), ack_wait_seconds=5.0)

@app.handler(source, name="nats-test")
async def handle(ctx) -> None:
    raise AssertionError("the replay command only puts the delivery back; the worker runs it")
"""


async def test_consumer_kit_parked_replay_puts_a_parked_message_back_once_then_as_a_duplicate(
        sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.acceptance.cli_run import cli

    async with own_stream() as stream:
        fixed = asyncio.Event()
        runs: list[tuple[str, bool]] = []

        async def handle(ctx: Context) -> None:
            runs.append((ctx.key.id, isinstance(ctx.delivery, Replayed)))
            if not fixed.is_set():
                raise TerminalError("the warehouse does not know this order yet", reason="not_ready")
            await effect(ctx, ctx.delivery.text())

        app, source = worker(sqlite_url, stream, handle)
        await prepare(sqlite_url)
        (tmp_path / "nats_parked_app.py").write_text(PARKED_APP)
        for name, value in {"DATABASE_URL": sqlite_url, "IDEMPOTENCY_HMAC_KEY": TEST_HMAC_KEY, "NATS_URL": NATS_URL,
                            "PARKED_STREAM": stream.name, "PARKED_SUBJECT": stream.subject}.items():
            monkeypatch.setenv(name, value)
        target = f"{tmp_path / 'nats_parked_app.py'}:app"
        async with app.running():
            await publish(stream, [("order-7", b'{"order": 7}')])

            async def parked() -> bool:
                return await app.dead_letters.count() == 1 and await settled(stream, source)

            await wait_until(parked, 20, "the message to be parked")
            [letter] = await app.dead_letters.list()
            assert letter.reason == "not_ready" and letter.source == source.name
            fixed.set()  # the fix is deployed; the operator replays
            first = await asyncio.to_thread(cli, "parked", "replay", target, "--id", letter.id,
                                            fresh=("nats_parked_app",))
            assert first.code == 0, first.err
            assert [row["action"] for row in first.json()] == ["requeued"]
            await wait_until(lambda: _effects_are(sqlite_url, {'{"order": 7}': 1}), 20, "the replay to run")
            second = await asyncio.to_thread(cli, "parked", "replay", target, "--id", letter.id,
                                             fresh=("nats_parked_app",))
            assert [row["action"] for row in second.json()] == ["requeued"]
            await wait_until(lambda: _true(deliveries(source, "duplicate") == 1), 20, "the second replay acked")
            await wait_until(lambda: settled(stream, source), 20, "nothing left on the consumer")
            assert await app.dead_letters.count() == 1  # nothing parked again
        assert await effects(sqlite_url) == {'{"order": 7}': 1}
        assert runs == [("order-7", False), ("order-7", True)]
        assert [headers[REASON_HEADER] for _, headers in await copies(source.dead_letter_stream)] == ["not_ready"]


async def _effects_are(database_url: str, expected: dict[str, int]) -> bool:
    return await effects(database_url) == expected
