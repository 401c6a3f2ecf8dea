"""The source contract: what every source must do, written once and run against every source whose
adapter claims the case's capability (``conftest.py``; the adapters are in ``adapters/``).

Each case drives the transport from the outside, as a producer, a broker or a clock would, and checks
what the transport shows (acknowledged, dead-lettered, nothing left on the queue), what the handler saw
(its runs and ``ctx.key``), what committed (the handler's effect rows) and what the app recorded
(its dead letters, spans and metrics)."""

from __future__ import annotations

import secrets

from prometheus_client import REGISTRY

from consumer_kit.replay import Replayer
from tests.conftest import Spans
from tests.contract.base import REFUSED, Act, Capability, Contract, needs
from tests.integration.test_tracing_e2e import producer


def unique(case: str) -> str:
    return f"{case}-{secrets.token_hex(4)}"


def counted(metric: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, labels) or 0.0


@needs(Capability.NEW_ID)
async def test_a_new_stable_id_is_processed_once(contract: Contract) -> None:
    adapter, script = contract.adapter, contract.script
    app = contract.app()
    async with contract.serving(app):
        sent = await adapter.send(unique("a"))
        await contract.wait_acked(sent, "the new delivery to be processed and acknowledged")
        assert await contract.effects() == [sent.key_id]
        assert await app.dead_letters.count() == 0
    assert [(run.key_id, run.namespace, run.returned) for run in script.runs] == \
        [(sent.key_id, contract.adapter.current.namespace, True)]
    assert await contract.effects() == [sent.key_id]
    assert await adapter.left_over() == 0


@needs(Capability.REDELIVERY)
async def test_a_redelivery_is_acknowledged_without_running_the_handler(contract: Contract) -> None:
    adapter, script = contract.adapter, contract.script
    app = contract.app()
    async with contract.serving(app):
        first = await adapter.send(unique("b"))
        await contract.wait_acked(first)
        again = await adapter.send_again(first)
        await contract.wait_acked(again, "the redelivery to be acknowledged")
        assert await app.dead_letters.count() == 0
    assert [run.key_id for run in script.runs] == [first.key_id]
    assert await contract.effects() == [first.key_id]
    assert await adapter.left_over() == 0


@needs(Capability.UNKEYABLE)
async def test_a_delivery_without_a_stable_id_is_parked_never_dropped(contract: Contract) -> None:
    adapter = contract.adapter
    app = contract.app()
    async with contract.serving(app):
        sent = await adapter.send_unkeyed()
        await contract.wait_dead_lettered(sent, adapter.unkeyable_reason)
        letters = await app.dead_letters.list()
        assert [(letter.reason, letter.key_digest) for letter in letters] == [(adapter.unkeyable_reason, None)], \
            "the unkeyable delivery is not in the dead-letter store"
    assert contract.script.runs == []
    assert await adapter.left_over() == 0, "the unkeyable delivery was left on the queue (retried forever)"


@needs(Capability.RETRY)
async def test_a_retryable_error_comes_back_under_the_same_key(contract: Contract) -> None:
    adapter, script = contract.adapter, contract.script
    script.first_run(Act.RETRY)
    app = contract.app()
    async with contract.serving(app):
        sent = await adapter.send(unique("d"))
        await contract.wait(script.started, "the first attempt")
        await adapter.retry_as_told(sent)
        await contract.wait_acked(sent, "the second attempt to succeed and be acknowledged")
        assert await app.dead_letters.count() == 0
    assert [(run.key_id, run.act, run.returned) for run in script.runs] == \
        [(sent.key_id, Act.RETRY, False), (sent.key_id, Act.COMMIT, True)]
    assert len({run.namespace for run in script.runs}) == 1
    assert await contract.effects() == [sent.key_id]
    assert await adapter.left_over() == 0


@needs(Capability.TERMINAL)
async def test_a_terminal_error_parks_the_delivery(contract: Contract) -> None:
    adapter, script = contract.adapter, contract.script
    script.first_run(Act.TERMINAL)
    app = contract.app()
    async with contract.serving(app):
        sent = await adapter.send(unique("e"))
        await contract.wait_dead_lettered(sent, REFUSED)
        [letter] = await app.dead_letters.list()
        assert letter.reason == REFUSED and letter.key_digest is not None
        # Parked is final: the same work again is acknowledged, not run.
        again = await adapter.send_again(sent)
        await contract.wait_acked(again, "a redelivery of the parked key to be acknowledged")
        assert await app.dead_letters.count() == 1
    assert [(run.key_id, run.act) for run in script.runs] == [(sent.key_id, Act.TERMINAL)]
    assert await contract.effects() == []
    assert await adapter.left_over() == 0


@needs(Capability.STOP)
async def test_a_delivery_in_flight_at_stop_is_redelivered_once(contract: Contract) -> None:
    adapter, script = contract.adapter, contract.script
    script.first_run(Act.BLOCK)  # never released: the stop's grace runs out and cancels it
    # A lease longer than the case waits: the redelivery runs only if the stop gave the lease back.
    async with contract.serving(contract.app(shutdown_grace_seconds=0.2, inbox_lease_seconds=60)):
        sent = await adapter.send(unique("f"))
        await contract.wait(script.started, "the handler to start")
    assert [(run.act, run.cancelled) for run in script.runs] == [(Act.BLOCK, True)]
    assert await contract.effects() == []

    async with contract.serving(contract.app(inbox_lease_seconds=60)):  # the worker again
        await adapter.resend_unsettled(sent)

        async def done() -> bool:
            return await contract.effect_count(sent.key_id) == 1 and await adapter.acked(sent)

        await contract.wait(done, "the delivery to be redelivered and done after the restart (lost?)", 30)
    assert await contract.effects() == [sent.key_id], "the effect happened more than once"
    assert script.returned(sent.key_id) == 1
    assert await adapter.left_over() == 0


@needs(Capability.CUT)
async def test_a_connection_cut_while_the_handler_runs_loses_nothing(contract: Contract) -> None:
    adapter, script = contract.adapter, contract.script
    script.first_run(Act.BLOCK)
    async with contract.serving(contract.app()):
        sent = await adapter.send(unique("g"))
        await contract.wait(script.started, "the handler to start")
        await adapter.cut()
        script.release.set()  # the handler goes on while the connection is gone
        await adapter.restore()
        await adapter.resend_unsettled(sent)

        async def done() -> bool:
            return await contract.effect_count(sent.key_id) >= 1 and await adapter.acked(sent)

        await contract.wait(done, "the effect and the acknowledgement after the cut", 40)
    assert await contract.effects() == [sent.key_id]
    assert script.returned(sent.key_id) == 1
    assert await adapter.left_over() == 0


@needs(Capability.ORDER)
async def test_settlements_keep_the_order_the_transport_promises(contract: Contract) -> None:
    adapter, script = contract.adapter, contract.script
    script.first_run(Act.RETRY, of_key=3)  # the third goes back once: the ones after it must wait
    async with contract.serving(contract.app()):
        sent = await adapter.send_in_order([unique(f"h{i}") for i in range(6)])

        async def all_done() -> bool:
            return len(await contract.effects()) == len(sent) and await adapter.acked(sent[-1])

        await contract.wait(all_done, "every delivery", 40)
    assert await contract.effects() == [s.key_id for s in sent]
    assert [run.act for run in script.runs_of(sent[2].key_id)] == [Act.RETRY, Act.COMMIT]
    assert await adapter.left_over() == 0


@needs(Capability.REPLAY)
async def test_a_parked_delivery_replays_under_its_key_once(contract: Contract) -> None:
    adapter, script = contract.adapter, contract.script
    script.first_run(Act.TERMINAL)
    app = contract.app()
    async with contract.serving(app):
        name = contract.adapter.current.name
        sent = await adapter.send(unique("i"))
        await contract.wait_dead_lettered(sent, REFUSED)
        [letter] = await app.dead_letters.list()
        async with Replayer(app, actor="contract") as replayer:
            first = await replayer.replay(letter)
            assert first.action in ("requeued", "processed"), first

            async def replayed() -> bool:
                return await contract.effect_count(sent.key_id) == 1

            await contract.wait(replayed, "the replayed delivery's effect")
            duplicates = counted("consumer_kit_deliveries_total", source=name, outcome="duplicate")
            second = await replayer.replay(letter)
            assert second.action in ("requeued", "duplicate"), second

            async def acknowledged() -> bool:
                return counted("consumer_kit_deliveries_total", source=name, outcome="duplicate") == duplicates + 1

            await contract.wait(acknowledged, "the second replay to be acknowledged as a duplicate")
    assert [(run.key_id, run.act, run.returned) for run in script.runs] == \
        [(sent.key_id, Act.TERMINAL, False), (sent.key_id, Act.COMMIT, True)]
    assert len({run.namespace for run in script.runs}) == 1
    assert await contract.effects() == [sent.key_id]
    assert await adapter.left_over() == 0


@needs(Capability.TRACE)
async def test_the_transports_trace_context_is_the_delivery_spans_parent(contract: Contract, spans: Spans) -> None:
    adapter = contract.adapter
    origin, headers = producer(spans, "send contract")
    async with contract.serving(contract.app()):
        sent = await adapter.send(unique("j"), traceparent=headers["traceparent"])
        await contract.wait_acked(sent)
        name = adapter.current.name
    delivery = spans.one(f"process {name}")
    assert delivery.kind is adapter.span_kind
    assert delivery.context.trace_id == origin.context.trace_id, "the delivery span is not in the sender's trace"
    assert delivery.parent is not None and delivery.parent.span_id == origin.context.span_id
    assert dict(delivery.attributes or {})["consumer_kit.outcome"] == "processed"


@needs(Capability.METRICS)
async def test_every_outcome_is_counted(contract: Contract) -> None:
    adapter, script = contract.adapter, contract.script
    # The first key commits; the second fails once, then commits; the third is refused for good.
    script.plan = lambda index, number: \
        Act.RETRY if (index, number) == (2, 1) else Act.TERMINAL if index == 3 else Act.COMMIT
    app = contract.app()
    name = adapter.current.name
    unkeyable = Capability.UNKEYABLE in adapter.capabilities
    outcomes = ("processed", "duplicate", "retry", "dead_lettered", "invalid")
    reasons = (REFUSED, adapter.unkeyable_reason)

    def outcome_counts() -> dict[str, float]:
        return {o: counted("consumer_kit_deliveries_total", source=name, outcome=o) for o in outcomes}

    def reason_counts() -> dict[str, float]:
        return {r: counted("consumer_kit_dead_letters_total", source=name, reason=r) for r in reasons}

    outcomes_before, reasons_before = outcome_counts(), reason_counts()
    durations_before = counted("consumer_kit_handler_duration_seconds_count", source=name)
    expected = {"processed": 2, "duplicate": 1, "retry": 1, "dead_lettered": 1, "invalid": int(unkeyable)}
    expected_reasons = {REFUSED: 1, adapter.unkeyable_reason: int(unkeyable)}

    def outcome_deltas() -> dict[str, float]:
        now = outcome_counts()
        return {o: now[o] - outcomes_before[o] for o in outcomes}

    async with contract.serving(app):
        one = await adapter.send(unique("k1"))
        await contract.wait_acked(one)
        await contract.wait_acked(await adapter.send_again(one))
        two = await adapter.send(unique("k2"))
        await contract.wait(lambda: script.started(2), "the second key's first attempt")
        await adapter.retry_as_told(two)
        await contract.wait_acked(two)
        three = await adapter.send(unique("k3"))
        await contract.wait_dead_lettered(three, REFUSED)
        if unkeyable:
            await contract.wait_dead_lettered(await adapter.send_unkeyed(), adapter.unkeyable_reason)

        async def all_counted() -> bool:
            return outcome_deltas() == expected

        await contract.wait(all_counted, f"the outcomes to be counted as {expected}")
        assert counted("consumer_kit_in_flight", source=name) == 0
    assert outcome_deltas() == expected
    assert counted("consumer_kit_handler_duration_seconds_count", source=name) - durations_before == \
        expected["processed"]  # timed: the deliveries whose handler ran and committed
    now = reason_counts()
    assert {r: now[r] - reasons_before[r] for r in reasons} == expected_reasons
