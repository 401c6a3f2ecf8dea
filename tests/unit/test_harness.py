"""RecipeHarness on handlers unlike the demo's: keyed by a body field with a unique constraint (a body
per proof), with and without a coordinator session; and a handler that is not retry-safe fails it."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select

from consumer_kit import ConsumerApp, Context
from consumer_kit.testing import InMemorySource, RecipeHarness

metadata = MetaData()
orders = Table("harness_orders", metadata, Column("id", Integer, primary_key=True),
               Column("order_ref", String(80), nullable=False, unique=True))


def order(id: str) -> bytes:
    return json.dumps({"order": f"O-{id}", "amount": 1}).encode()


def changed_order(id: str) -> bytes:
    return json.dumps({"order": f"O-{id}", "amount": 2}).encode()


async def count(app: ConsumerApp) -> int:
    async with app.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(orders))).scalar_one())


@pytest.mark.parametrize("session", [True, False], ids=["with-session", "without-session"])
async def test_a_handler_keyed_by_a_body_field_under_a_unique_constraint(consumer_kit_app: ConsumerApp,
                                                                         session: bool) -> None:
    # The key is the order in the body, not the delivery id: each proof needs an order of its own.
    source = InMemorySource(namespace="orders", version=1, key_mapper=lambda d: d.json()["order"])
    session_fields = {"labels": ["orders"], "task": lambda d: f"Record {d.json()['order']}"} if session else {}

    @consumer_kit_app.handler(source, **session_fields)  # type: ignore[arg-type]
    async def record(ctx: Context) -> None:
        await ctx.db.execute(orders.insert().values(order_ref=ctx.delivery.json()["order"]))

    async with consumer_kit_app.running():
        async with consumer_kit_app.engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
        harness = RecipeHarness(consumer_kit_app, source, effects=lambda: count(consumer_kit_app))
        report = await harness.run(body=order, changed_body=changed_order)
        report.assert_ok()
        steps = [proof.step for proof in report.proofs]
        coordinator_steps = ["changed session field", "redelivery after the session ended"]
        assert all((step in steps) is session for step in coordinator_steps), steps
        assert len(steps) == (7 if session else 5)
        # The same body for every proof breaks on the constraint (or is one key throughout): not the same.
        same = await RecipeHarness(consumer_kit_app, source).prove_replay(order("fixed"))
        assert [p.ok for p in same] == [True, True, True]
        again = await RecipeHarness(consumer_kit_app, source).prove_replay(order("fixed"))
        assert not all(p.ok for p in again)  # the order was done by the proof before: not new work
        if not session:
            with pytest.raises(ValueError, match="needs a handler with a coordinator session"):
                await harness.prove_inactive(order)


async def test_a_handler_whose_effect_escapes_its_transaction_fails_the_recipe(
        consumer_kit_app: ConsumerApp, consumer_kit_source: InMemorySource) -> None:
    sent: list[bytes] = []

    @consumer_kit_app.handler(consumer_kit_source)
    async def notify(ctx: Context) -> None:
        sent.append(ctx.delivery.body)  # a call out without the derived key: every retry repeats it

    async def effects() -> int:
        return len(sent)

    async with consumer_kit_app.running():
        report = await RecipeHarness(consumer_kit_app, consumer_kit_source, effects=effects).run(
            body=b"{}", changed_body=b'{"changed": true}')
    failed = [proof for proof in report.proofs if not proof.ok]
    assert [(p.step, p.observed) for p in failed] == [
        ("destination effects after 4 deliveries", "2 effects, all acked")]
    with pytest.raises(AssertionError, match="retry-safety recipe failed"):
        report.assert_ok()


async def test_a_source_that_records_nothing_still_answers_each_delivery(consumer_kit_app: ConsumerApp) -> None:
    """``record=False`` (a load test) keeps no settlement, dead-lettered ones included; each call still
    returns its result, and a source that records keeps every one."""
    quiet = InMemorySource(namespace="quiet", version=1, record=False)
    kept = InMemorySource(namespace="kept", version=1)
    ran: list[str] = []
    for source in (quiet, kept):
        @consumer_kit_app.handler(source)
        async def note(ctx: Context) -> None:
            ran.append(ctx.key.namespace)

    async with consumer_kit_app.running():
        for source in (quiet, kept):
            assert (await source.deliver(id="m-1", body=b"{}")).outcome.value == "processed"
            assert (await source.deliver(id="m-1", body=b"{}")).outcome.value == "duplicate"
            assert (await source.deliver(id=None, body=b"{}")).outcome.value == "invalid"
    assert ran == ["quiet", "kept"]  # each source's new key ran once; the duplicate and the unkeyable did not
    assert quiet.settled == [] and quiet.dead_lettered == []
    assert [r.outcome.value for _, r in kept.settled] == ["processed", "duplicate", "invalid"]
    assert len(kept.dead_lettered) == 1
