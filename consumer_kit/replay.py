"""Replaying parked deliveries (``consumer-kit parked replay``): back through their handler, under the
SAME operation key.

How a parked delivery goes back depends on its source:

- a queue source (RabbitMQ, SQS: :class:`Requeues`) puts it back on its queue, for the workers to run.
  The message carries the delivery as the pipeline saw it (its delivery id, headers, attributes and
  fingerprint) in the ``x-consumer-kit-replay`` header, signed with ``IDEMPOTENCY_HMAC_KEY``; the
  worker hands over that very delivery (:class:`Replayed`), keyed the same. This is needed because a
  queue cannot always be told the original id (SQS mints a ``MessageId`` per send) and an envelope's
  inner message (SNS, S3, a CloudEvent) is not wrapped again. A header that does not verify (forged,
  or signed with a key the worker does not have) parks the message ``invalid_replay``.
- any other source (HTTP, schedules) runs it in the replaying process, through the app's pipeline, as
  if it had arrived again; a source with a :meth:`ReplaysInProcess.replay` of its own (a schedule,
  which records how its tick settled) does that itself.

Before a delivery is sent, :class:`Replayer` checks that the source keys it now exactly as when it was
parked (else it is skipped: a replay never runs work under another key), and takes the key out of the
inbox's "dead" state so that the handler runs; a key already completed stays completed, so a second
replay of the same delivery is acknowledged as a duplicate without running. A delivery parked as a
``conflict`` (its key was first used with another body) is refused unless the operator accepts its
body as the key's request (``accept_new_body``). A delivery that could not be keyed when it was parked
(no stable id) is sent only if the source can key it now (a key mapping added since); otherwise it is
skipped and stays parked for an operator to discard.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from consumer_kit.delivery import Dispatch, Outcome, RefusedReplay, Replayed, Result, Settlement
from consumer_kit.errors import InvalidKey, MissingStableId
from consumer_kit.keys import KeyDigester, short
from consumer_kit.redaction import redact
from consumer_kit.untrusted import loads_json

if TYPE_CHECKING:
    from consumer_kit.app import ConsumerApp
    from consumer_kit.pipeline import HandlerSpec
    from consumer_kit.settings import Settings
    from consumer_kit.store.dead_letters import DeadLetter

REPLAY_HEADER = "x-consumer-kit-replay"
"""The header (AMQP) or message attribute (SQS) that carries a requeued parked delivery."""

_SEAL_VERSION = 1


def seal(delivery: Replayed, digester: KeyDigester) -> str:
    """The replay header's value for ``delivery``: what the worker needs to hand the same delivery over
    (nothing a listing would print: the id rides inside, signed, and reaches only the handler again)."""
    fields: dict[str, Any] = {
        "v": _SEAL_VERSION, "parked": delivery.parked_id, "id": delivery.id, "headers": dict(delivery.headers),
        "attributes": dict(delivery.attributes), "fingerprint": delivery.fingerprint(),
        "body": hashlib.sha256(delivery.body).hexdigest(),
    }
    fields["sig"] = digester.digest(_canonical(fields))
    return json.dumps(fields, separators=(",", ":"), sort_keys=True)


def unseal(value: str | bytes, body: bytes, digester: KeyDigester, *, attempt: int = 1,
           sent_at: datetime | None = None) -> Replayed | RefusedReplay:
    """The delivery a replay header describes, if it verifies for ``body`` under the current or the
    previous HMAC key; else a :class:`RefusedReplay` of the raw message (parked, never run)."""
    try:
        fields = loads_json(value, strict=False)  # a header built to break the parser is a ValueError too
        if not isinstance(fields, dict) or fields.get("v") != _SEAL_VERSION:
            raise _Unverified("not a replay header this consumer-kit makes")
        signature = fields.pop("sig", None)
        if not isinstance(signature, str) or not any(
                hmac.compare_digest(signature, candidate) for candidate in digester.candidates(_canonical(fields))):
            raise _Unverified("its signature does not verify with IDEMPOTENCY_HMAC_KEY")
        if not hmac.compare_digest(str(fields.get("body")), hashlib.sha256(body).hexdigest()):
            raise _Unverified("the body is not the one it was sealed with")
        headers, attributes, delivery_id = fields.get("headers"), fields.get("attributes"), fields.get("id")
        if not isinstance(headers, dict) or not isinstance(attributes, dict) or not _strings(headers) \
                or not _strings(attributes) or not isinstance(delivery_id, str | None):
            raise _Unverified("malformed")
        return Replayed(id=delivery_id, body=body, headers=headers, attributes=attributes, attempt=attempt,
                        sent_at=sent_at, parked_id=str(fields.get("parked")),
                        parked_fingerprint=str(fields.get("fingerprint") or ""))
    except _Unverified as exc:
        why = str(exc)
    except ValueError:  # not JSON
        why = "malformed"
    return RefusedReplay(id=None, body=body, attempt=attempt, sent_at=sent_at,
                         why=f"the replay header does not verify: {why}")


class _Unverified(ValueError):
    """The replay header did not verify; the message says which part."""


def _canonical(fields: Mapping[str, Any]) -> str:
    return "consumer-kit-replay:" + json.dumps(fields, separators=(",", ":"), sort_keys=True)


def _strings(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


Send = Callable[[Replayed, str], Awaitable[None]]
"""Puts one replayed delivery (and its sealed header) back on a queue; returns once the broker has it."""


@runtime_checkable
class Requeues(Protocol):
    """A source whose parked deliveries go back through its queue (it need not be started)."""

    def requeuer(self, settings: Settings) -> contextlib.AbstractAsyncContextManager[Send]:
        """A connection to the source's queue, as a :data:`Send`; closed on exit."""
        ...


@runtime_checkable
class ReplaysInProcess(Protocol):
    """A source that runs a replayed delivery itself (a schedule records how its tick settled)."""

    async def replay(self, delivery: Replayed, dispatch: Dispatch) -> Result:
        """Hand ``delivery`` to ``dispatch`` (the pipeline) and return its verdict."""
        ...


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What a replay did with one parked delivery. ``action``: ``requeued`` (back on its queue),
    ``processed``, ``duplicate``, ``parked`` (parked again: a new parked row), ``retry`` (failed again;
    replay it later), ``in_progress`` (its key is held elsewhere), ``skipped`` (not sent: ``detail``
    says why), or with a dry run ``would_requeue`` / ``would_run``."""

    letter: DeadLetter
    action: str
    detail: str | None = None
    key_digest: str | None = None  # short digest of the key it was (or would be) sent under

    @property
    def sent(self) -> bool:
        """Whether it went back through its handler (or would, on a dry run)."""
        return self.action not in ("skipped", "failed")


_OUTCOME_ACTIONS = {Outcome.PROCESSED: "processed", Outcome.DUPLICATE: "duplicate",
                    Outcome.IN_PROGRESS: "in_progress"}


class Replayer:
    """Replays parked deliveries through ``app``, which must be started with no source running (see the
    module docstring). ``actor`` is recorded with every replay; ``rate`` caps sends per second;
    ``dry_run`` only reports what would happen; ``accept_new_body`` lets ``conflict`` ones through.
    Use it as an async context manager: queue connections opened for requeues close on exit."""

    def __init__(self, app: ConsumerApp, *, actor: str, accept_new_body: bool = False, dry_run: bool = False,
                 rate: float | None = None) -> None:
        self.app = app
        self.actor = actor
        self.accept_new_body = accept_new_body
        self.dry_run = dry_run
        self.rate = rate
        self._queues: dict[int, Send] = {}
        self._stack = contextlib.AsyncExitStack()
        self._next_send = 0.0

    async def __aenter__(self) -> Replayer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def replay(self, letter: DeadLetter) -> ReplayReport:
        """Send one parked delivery back (or say why not); recorded unless skipped or a dry run."""
        spec = next((s for s in self.app.specs if s.consumer == letter.consumer), None)
        if spec is None:
            names = ", ".join(sorted(s.consumer for s in self.app.specs)) or "none"
            return ReplayReport(letter, "skipped", f"the app has no handler named {letter.consumer!r} "
                                f"(it has: {names})")
        delivery = Replayed(id=letter.delivery_id, body=letter.body, headers=dict(letter.headers),
                            attributes=dict(letter.attributes or {}), parked_id=letter.id,
                            parked_fingerprint=letter.fingerprint or "")
        conflict = letter.reason == "conflict"
        if conflict and not self.accept_new_body:
            return ReplayReport(letter, "skipped", "parked as a conflict: its key was first used with another "
                                "body; --accept-new-body runs this body under the key")
        digester = self.app.pipeline.digester
        try:
            key = spec.source.key(delivery)
        except (MissingStableId, InvalidKey) as exc:
            why = "still cannot be keyed" if letter.key_digest is None else \
                "cannot be keyed now (its delivery id was not kept: parked before consumer-kit kept it)"
            return ReplayReport(letter, "skipped", f"{why}: {exc.reason}")
        digests = digester.candidates(key)
        if letter.key_digest is not None and letter.key_digest not in digests:
            return ReplayReport(letter, "skipped", "the source keys it differently now (its namespace, version or "
                                "key mapping changed, or the HMAC key rotated): never replayed under another key")
        digest = short(digests[0])
        requeues = isinstance(spec.source, Requeues)
        if self.dry_run:
            async with self.app.database.connect() as ex:
                row = await self.app.inbox.lookup(ex, spec.consumer, digests)
            state = "completed: it will be a duplicate" if row is not None and row["state"] == "completed" \
                and not conflict else None
            return ReplayReport(letter, "would_requeue" if requeues else "would_run", state, digest)
        send = await self._requeuer(spec) if requeues else None  # a broker that cannot be reached stops here
        await self._pace()
        async with self.app.database.connect() as ex:
            # Before the send: a worker that took the requeued message first would find the key parked.
            await self.app.inbox.reopen(ex, spec.consumer, digests,
                                        fingerprint=delivery.fingerprint() if conflict else None)
        try:
            if send is not None:
                await send(delivery, seal(delivery, digester))
                report = ReplayReport(letter, "requeued", f"back on {spec.source.name}", digest)
            else:
                report = self._reported(letter, await self._run(spec, delivery), digest)
        except Exception as exc:  # this one could not be sent (too large, refused): the others go on
            report = ReplayReport(letter, "failed", redact(f"{type(exc).__name__}: {exc}", key)[:300], digest)
        # A replay that failed (in process, or to be sent) is recorded but not counted: the next replay
        # without --id takes it again.
        await self.app.dead_letters.replayed(letter, actor=self.actor, outcome=report.action, detail=report.detail,
                                             counted=report.action not in ("retry", "failed"))
        return report

    async def _run(self, spec: HandlerSpec, delivery: Replayed) -> Result:
        dispatch = functools.partial(self.app.pipeline.process, spec)
        if isinstance(spec.source, ReplaysInProcess):
            return await spec.source.replay(delivery, dispatch)
        return await dispatch(delivery)

    @staticmethod
    def _reported(letter: DeadLetter, result: Result, digest: str) -> ReplayReport:
        if result.settlement is Settlement.DEAD_LETTER:
            return ReplayReport(letter, "parked", f"parked again: {result.reason}", digest)
        if result.outcome is Outcome.DUPLICATE and result.reason == "already_dead_lettered":
            return ReplayReport(letter, "parked", "its key is parked (a later delivery of it parked it again)",
                                digest)
        action = _OUTCOME_ACTIONS.get(result.outcome, "retry")
        detail = f"failed again ({result.reason}): replay it later" if action == "retry" else None
        return ReplayReport(letter, action, detail, digest)

    async def _requeuer(self, spec: HandlerSpec) -> Send:
        source = spec.source
        assert isinstance(source, Requeues)
        send = self._queues.get(id(source))
        if send is None:
            send = self._queues[id(source)] = await self._stack.enter_async_context(
                source.requeuer(self.app.settings))
        return send

    async def _pace(self) -> None:
        """At most ``rate`` sends a second."""
        if not self.rate:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._next_send > now:
            await asyncio.sleep(self._next_send - now)
        self._next_send = max(now, self._next_send) + 1.0 / self.rate
