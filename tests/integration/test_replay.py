"""Replaying parked deliveries (:mod:`consumer_kit.replay`) of the sources other than RabbitMQ (whose
replay the acceptance tests run through ``consumer-kit parked replay``): an SQS message goes back on
its queue as a new message (SQS mints a new MessageId) and still keys as before; a forged replay is
parked, never run; a schedule's parked tick runs in process and its row settles; and the seal itself."""

from __future__ import annotations

import asyncio
import functools
import json
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from consumer_kit import ConsumerApp, Context, Settings, TerminalError
from consumer_kit.delivery import RefusedReplay, Replayed
from consumer_kit.keys import KeyDigester
from consumer_kit.replay import REPLAY_HEADER, Replayer, seal, unseal
from consumer_kit.sources.schedules import ManualClock, Schedule, ScheduleDelivery
from consumer_kit.sources.sqs import SQSSource
from tests.conftest import TEST_HMAC_KEY, make_settings
from tests.integration.rabbit import wait_until
from tests.integration.sqs_env import Moto, attribute

MINUTE = timedelta(minutes=1)


def test_a_seal_opens_only_with_its_key_and_its_body() -> None:
    digester = KeyDigester(TEST_HMAC_KEY.encode())
    parked = Replayed(id="m-1", body=b'{"a": 1}', headers={"trace": "t-1"}, attributes={"type": "order"},
                      parked_id="p1", parked_fingerprint="f" * 64)
    sealed = seal(parked, digester)
    assert "m-1" in sealed  # it reaches the worker, never a listing
    opened = unseal(sealed, b'{"a": 1}', digester, attempt=2)
    assert isinstance(opened, Replayed)
    assert (opened.id, dict(opened.headers), dict(opened.attributes), opened.attempt) == \
        ("m-1", {"trace": "t-1"}, {"type": "order"}, 2)
    assert opened.fingerprint() == "f" * 64 and opened.parked_id == "p1"
    # After a rotation the previous key still opens it.
    rotated = KeyDigester(b"another-hmac-key-0123456789", TEST_HMAC_KEY.encode())
    assert isinstance(unseal(sealed, b'{"a": 1}', rotated), Replayed)
    refusals = {
        "another body": unseal(sealed, b'{"a": 2}', digester),
        "another key": unseal(sealed, b'{"a": 1}', KeyDigester(b"another-hmac-key-0123456789")),
        "edited": unseal(sealed.replace('"m-1"', '"m-2"'), b'{"a": 1}', digester),
        "not json": unseal("{", b'{"a": 1}', digester),
        "unsigned": unseal(json.dumps({"v": 1, "id": "m-1"}), b'{"a": 1}', digester),
    }
    for why, refused in refusals.items():
        assert isinstance(refused, RefusedReplay), why
        assert refused.id is None and refused.body in (b'{"a": 1}', b'{"a": 2}'), why


@pytest.mark.sqs
async def test_an_sqs_message_replays_under_its_key_and_a_forged_replay_is_parked(
        moto: Moto, sqlite_url: str) -> None:
    url, dlq = await moto.queue()
    ran: list[str] = []
    fixed = False

    app = ConsumerApp(moto.settings(sqlite_url))
    source = SQSSource(queue_url=url, namespace="invoices", version=1, dead_letter_queue_url=dlq)

    @app.handler(source, name="invoices")
    async def handle(ctx: Context) -> None:
        if not fixed:
            raise TerminalError("the ledger is closed", reason="ledger_closed")
        ran.append(ctx.delivery.text())

    async with app.running():
        await moto.send(url, [{"MessageBody": "invoice 9", "MessageAttributes": {"trace": attribute("t-9")}}])

        async def parked() -> bool:
            return await app.dead_letters.count() == 1

        await wait_until(parked, 30, "the message to be parked")
        [letter] = await app.dead_letters.list()
        assert letter.reason == "ledger_closed" and letter.delivery_id is not None  # keyed by its MessageId
        fixed = True
        async with Replayer(app, actor="ops") as replayer:
            first = await replayer.replay(letter)

            async def done() -> bool:
                return ran == ["invoice 9"] and await moto.depth(url) == 0

            assert first.action == "requeued"
            await wait_until(done, 30, "the replayed message to run")
            second = await replayer.replay(letter)
            assert second.action == "requeued"

            async def acknowledged() -> bool:
                return await moto.depth(url) == 0

            await asyncio.sleep(0.5)
            await wait_until(acknowledged, 30, "the second replay to be acknowledged")
        assert ran == ["invoice 9"]  # a new MessageId each time, the same key: once
        assert await app.dead_letters.count() == 1

        # Someone who can send to the queue, without the HMAC key, cannot make a replay.
        await moto.send(url, [{"MessageBody": "invoice 10", "MessageAttributes": {
            REPLAY_HEADER: attribute(json.dumps({"v": 1, "id": "forged", "sig": "0" * 64}))}}])

        async def refused() -> bool:
            return await app.dead_letters.count(reason="invalid_replay") == 1

        await wait_until(refused, 30, "the forged replay to be parked")
        assert ran == ["invoice 9"]


async def test_a_parked_schedule_tick_replays_in_process_and_settles(sqlite_url: str) -> None:
    settings = Settings(database_url=sqlite_url, idempotency_hmac_key=TEST_HMAC_KEY,  # type: ignore[arg-type]
                        retry_backoff_seconds=0.001)
    clock = ManualClock(datetime(2026, 3, 2, 12, 0, 30, tzinfo=UTC))
    schedule = Schedule("ledger-close", every=MINUTE, clock=clock)
    app = ConsumerApp(settings)
    ran: list[datetime] = []
    fixed = False

    @app.handler(schedule, name="ledger-close")
    async def close(ctx: Context) -> None:
        assert isinstance(ctx.delivery, ScheduleDelivery)
        if not fixed:
            raise TerminalError("the ledger service is down for good", reason="ledger_gone")
        ran.append(ctx.delivery.scheduled_for)

    tick = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
    async with app.running(sources=()):
        fired = await schedule.fire(tick, dispatch=functools.partial(app.pipeline.process, app.specs[0]))
        assert fired.result.reason == "ledger_gone"
        assert (await schedule.status()).last_fired.state == "parked"  # type: ignore[union-attr]
        [letter] = await app.dead_letters.list()
        fixed = True
        async with Replayer(app, actor="ops") as replayer:
            assert (await replayer.replay(letter)).action == "processed"
            assert (await replayer.replay(letter)).action == "duplicate"
        assert ran == [tick]
        status = await schedule.status()
        assert status.last_fired is not None and (status.last_fired.tick, status.last_fired.state) == (tick, "done")
        [shown] = await app.dead_letters.list()
        assert shown.replays == 2
        assert [entry.outcome for entry in await app.dead_letters.history(letter.id)] == ["processed", "duplicate"]


async def test_a_parked_cloudevent_replays_in_process_as_the_same_request(sqlite_url: str) -> None:
    """A structured-mode event is fingerprinted by its canonical form, not by the body as sent: its
    replay keeps that fingerprint, so it is the same request to the inbox (not a conflict)."""
    from consumer_kit.sources.cloudevents import CloudEventsSource

    app = ConsumerApp(make_settings(sqlite_url))
    source = CloudEventsSource(path="/events", namespace="shop-events", version=1, bearer_tokens=["t" * 24])
    seen: list[tuple[str, object]] = []
    fixed = False

    @app.handler(source, name="shop-events")
    async def on_event(ctx: Context) -> None:
        if not fixed:
            raise TerminalError("the catalogue is offline", reason="catalogue_offline")
        seen.append((ctx.delivery.headers["ce-type"], ctx.delivery.json()))

    event = b'{ "specversion": "1.0", "type": "shop.order", "source": "/shop", "id": "e-1",\n  "data": {"n": 1} }'
    async with app.running():
        transport = httpx.ASGITransport(app=app.asgi())
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver",
                                     headers={"authorization": "Bearer " + "t" * 24}) as client:
            answer = await client.post("/events", content=event,
                                       headers={"content-type": "application/cloudevents+json"})
            assert answer.status_code == 202
        [letter] = await app.dead_letters.list()
        fixed = True
        async with Replayer(app, actor="ops") as replayer:
            assert (await replayer.replay(letter)).action == "processed"
            assert (await replayer.replay(letter)).action == "duplicate"
    assert seen == [("shop.order", {"n": 1})]
