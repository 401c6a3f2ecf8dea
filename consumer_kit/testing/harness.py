"""Prove that *your* handler is safe to retry, from your own test suite.

The proofs are the validation recipe of the coordinator's idempotency guide (the text this project
follows): deliver the same work twice, then with one changed field, then after its coordinator
session ended, and check that the destination's effect happens once::

    harness = RecipeHarness(app, source, effects=count_rows)   # inside `async with app.running()`
    report = await harness.run(body=b'{"key": "T-1"}', changed_body=b'{"key": "T-2"}')
    report.assert_ok()                                         # or look at report.proofs

Each proof delivers through the app's real pipeline, store and coordinator. A "crash" is injected
after your handler returned and before its transaction committed, which is the moment retries are
about: the effect rolls back, the coordinator session (if the handler has one) stays active, and the
delivery is handed back for a retry.

A handler without a coordinator session (no ``labels=`` or ``task=``) gets the proofs that apply to it:
replay, a changed body, effect once. Give ``body`` (and ``changed_body``) as a function of the
delivery's id when each proof needs a body of its own: a handler that writes a business id from the
body under a unique constraint, or a source keyed by a body field.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from consumer_kit.app import ConsumerApp
from consumer_kit.context import Context
from consumer_kit.coordinator.protocol import SessionReceipt
from consumer_kit.delivery import Delivery, Outcome, Result, Settlement, Source
from consumer_kit.errors import IdempotencyKeyConflict, RetryableError
from consumer_kit.pipeline import HandlerSpec, session_request

EffectCounter = Callable[[], Awaitable[int]]
"""Counts the destination effects your handler made (rows written, requests a fake destination saw)."""

Body = bytes | Callable[[str], bytes]
"""A delivery's body, or a function that makes one from the delivery's id (fresh for every proof), so
that each proof's work is new work: ``lambda id: json.dumps({"order": id}).encode()``."""


def _made(body: Body, id: str) -> bytes:
    return body(id) if callable(body) else body


class InjectedCrash(RetryableError):
    """Raised by the harness after the handler returned, so that its transaction rolls back."""

    def __init__(self) -> None:
        super().__init__("injected crash before completion", delay=0)


@dataclass(frozen=True, slots=True)
class Delivered:
    """One delivery the harness made: the pipeline's result and the session the handler saw, if it ran."""

    result: Result
    ran: bool
    session: SessionReceipt | None


@dataclass(frozen=True, slots=True)
class Proof:
    """One step of the recipe: what was expected, what was observed."""

    step: str
    expected: str
    observed: str

    @property
    def ok(self) -> bool:
        """Whether the observation matches."""
        return self.expected == self.observed


@dataclass(slots=True)
class RecipeReport:
    """Every proof of one recipe run."""

    proofs: list[Proof] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every proof held."""
        return all(proof.ok for proof in self.proofs)

    def assert_ok(self) -> None:
        """Raise AssertionError listing the proofs that did not hold."""
        failed = [f"{p.step}: expected {p.expected}, observed {p.observed}" for p in self.proofs if not p.ok]
        assert not failed, "retry-safety recipe failed:\n" + "\n".join(failed)

    def table(self) -> str:
        """The proofs as a small text table."""
        width = max(len(p.step) for p in self.proofs)
        lines = [f"{'step':<{width}}  {'expected':<32} {'observed':<32} ok"]
        lines += [f"{p.step:<{width}}  {p.expected:<32} {p.observed:<32} {'yes' if p.ok else 'NO'}"
                  for p in self.proofs]
        return "\n".join(lines)


class RecipeHarness:
    """Runs the retry-safety recipe against the handler ``app`` registered for ``source``.

    Every proof uses fresh delivery ids (``prefix`` + random), so it can run against a shared database.
    The coordinator proofs (a changed session field, a redelivery after the session ended) need a
    handler that has a session (``labels=`` or ``task=``); :meth:`run` leaves them out for one that has
    none.
    """

    def __init__(self, app: ConsumerApp, source: Source, *, effects: EffectCounter | None = None,
                 prefix: str = "recipe") -> None:
        self.app = app
        self.spec: HandlerSpec = next(s for s in app.specs if s.source is source)
        self.effects = effects
        self.prefix = prefix

    @property
    def has_session(self) -> bool:
        """Whether the handler's deliveries get a coordinator session (``labels=`` or ``task=``)."""
        return self.spec.wants_session

    def new_id(self, step: str) -> str:
        """A fresh delivery id for one proof."""
        return f"{self.prefix}-{step}-{secrets.token_hex(6)}"

    async def deliver(self, id: str, body: bytes, *, crash: bool = False, attempt: int = 1,
                      attributes: Mapping[str, str] | None = None) -> Delivered:
        """Run one delivery through the real pipeline; ``crash`` rolls the handler's effect back."""
        seen: list[SessionReceipt | None] = []
        func = self.spec.func

        async def observed(ctx: Context) -> Any:
            seen.append(ctx.session)
            value = await func(ctx)
            if crash:
                raise InjectedCrash()
            return value

        delivery = Delivery(id=id, body=body, attributes=dict(attributes or {}), attempt=attempt)
        result = await self.app.pipeline.process(replace(self.spec, func=observed), delivery)
        return Delivered(result, bool(seen), seen[-1] if seen else None)

    async def prove_replay(self, body: Body) -> list[Proof]:
        """Same work twice: a retry after a crash runs the handler again (replaying the active session,
        when it has one), and the same work after completion is a duplicate."""
        id = self.new_id("replay")
        made = _made(body, id)
        first = await self.deliver(id, made, crash=True)
        again = await self.deliver(id, made, attempt=2)
        third = await self.deliver(id, made, attempt=3)
        if self.has_session:
            replayed = again.session is not None and first.session is not None and again.session.replayed \
                and again.session.session_id == first.session.session_id
            retried = Proof("same work again", "session replayed, processed",
                            f"session {'replayed' if replayed else 'not replayed'}, {again.result.outcome.value}")
        else:
            retried = Proof("same work again", "processed", again.result.outcome.value)
        return [
            Proof("crash before completion", "retry", first.result.outcome.value),
            retried,
            Proof("same work after completion", "duplicate", third.result.outcome.value),
        ]

    async def prove_conflict(self, body: Body, changed_body: Body) -> list[Proof]:
        """One changed field under the same key: the inbox parks a changed body; with a session, the
        coordinator answers 409 idempotency_key_conflict to a changed session field."""
        id = self.new_id("conflict")
        made = _made(body, id)
        await self.deliver(id, made, crash=True)  # leaves the key unfinished (and the session active)
        changed = await self.deliver(id, _made(changed_body, id), attempt=2)
        proofs = [Proof("changed body, same key", "conflict, dead_letter",
                        f"{changed.result.outcome.value}, {changed.result.settlement.value}")]
        if self.has_session:
            delivery = Delivery(id=id, body=made)
            key = self.spec.source.key(delivery)
            request = session_request(self.spec, delivery, self.app.settings)
            changed_request = request.model_copy(update={"labels": (*request.labels, "changed-label")})
            try:
                await self.app.coordinator.create_session(changed_request, idempotency_key=key.derive("session"))
                code = "created"
            except IdempotencyKeyConflict as exc:
                code = f"409 {exc.code}"
            proofs.append(Proof("changed session field", "409 idempotency_key_conflict", code))
        return proofs

    async def prove_inactive(self, body: Body) -> list[Proof]:
        """After the work's coordinator session ended, a delayed redelivery is parked "inactive", not
        run. Needs a handler with a session (``labels=`` or ``task=``)."""
        if not self.has_session:
            raise ValueError(f"prove_inactive needs a handler with a coordinator session (labels= or task=); "
                             f"{self.spec.consumer!r} has none")
        id = self.new_id("inactive")
        made = _made(body, id)
        first = await self.deliver(id, made, crash=True)
        if first.session is None:
            return [Proof("redelivery after the session ended", "inactive, dead_letter", "no session")]
        await self.app.coordinator.end_session(first.session.session_id)
        late = await self.deliver(id, made, attempt=2)
        return [Proof("redelivery after the session ended", "inactive, dead_letter, not run",
                      f"{late.result.outcome.value}, {late.result.settlement.value}, "
                      f"{'run' if late.ran else 'not run'}")]

    async def prove_effect_once(self, body: Body, *, deliveries: int = 4) -> list[Proof]:
        """A crash and several redeliveries leave exactly one destination effect."""
        if self.effects is None:
            raise ValueError("prove_effect_once needs effects=<async callable counting the effects>")
        before = await self.effects()
        id = self.new_id("effect")
        made = _made(body, id)
        await self.deliver(id, made, crash=True)
        outcomes = [await self.deliver(id, made, attempt=n) for n in range(2, deliveries + 1)]
        count = await self.effects() - before
        settled = all(d.result.settlement is Settlement.ACK for d in outcomes)
        processed = sum(d.result.outcome is Outcome.PROCESSED for d in outcomes)
        return [Proof(f"destination effects after {deliveries} deliveries", "1 effect, all acked",
                      f"{count} effect{'s' if count != 1 else ''}, {'all acked' if settled else 'not acked'}"
                      + ("" if processed == 1 else f", processed {processed}x"))]

    async def run(self, *, body: Body, changed_body: Body) -> RecipeReport:
        """Every proof that applies: replay, conflict, inactive (with a session), and effect-once when
        ``effects`` was given."""
        report = RecipeReport()
        report.proofs += await self.prove_replay(body)
        report.proofs += await self.prove_conflict(body, changed_body)
        if self.has_session:
            report.proofs += await self.prove_inactive(body)
        if self.effects is not None:
            report.proofs += await self.prove_effect_once(body)
        return report
