"""``consumer-kit demo``: the retry-safety recipe (replay, conflict, inactive, effect once), end to end,
on the embedded defaults.

On a SQLite file in a temporary directory, with the embedded coordinator:

1. the coordinator itself: the same creation twice (replayed), one changed security field
   (409 idempotency_key_conflict), the same creation after the session ended
   (409 idempotency_result_inactive);
2. the pipeline, through :class:`~consumer_kit.testing.RecipeHarness`: a crash before completion and
   the redelivery that replays the session, a changed body under a known key, a delayed redelivery
   after the session ended, and the destination effect count after several deliveries (1);
3. a delivery with no stable id (parked, never guessed).

It prints a table and exits non-zero if any step did not behave as the coordinator's contract says.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
from pathlib import Path

from sqlalchemy import Column, Integer, MetaData, String, Table, func, select

from consumer_kit.app import ConsumerApp
from consumer_kit.context import Context
from consumer_kit.coordinator.protocol import SessionRequest
from consumer_kit.errors import CoordinatorRejected
from consumer_kit.settings import Settings
from consumer_kit.testing import InMemorySource, Proof, RecipeHarness, RecipeReport

_metadata = MetaData()
reports = Table(
    "demo_reports", _metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ticket", String(50), nullable=False),
)


async def _coordinator_steps(app: ConsumerApp) -> list[Proof]:
    coordinator = app.coordinator
    key = "session:ticket-queue:v1:demo-1"
    request = SessionRequest(labels=("research-agent",), task="Prepare T-1")
    proofs: list[Proof] = []

    async def attempt(step: str, expected: str, req: SessionRequest) -> str:
        try:
            receipt = await coordinator.create_session(req, idempotency_key=key)
            observed = "replayed" if receipt.replayed else "created"
        except CoordinatorRejected as exc:
            observed = f"409 {exc.code}"
        proofs.append(Proof(step, expected, observed))
        return observed

    first = await coordinator.create_session(request, idempotency_key=key)
    proofs.append(Proof("coordinator: create", "created", "replayed" if first.replayed else "created"))
    await attempt("coordinator: same work twice", "replayed", request)
    await attempt("coordinator: one changed label", "409 idempotency_key_conflict",
                  request.model_copy(update={"labels": ("research-agent", "admin")}))
    await coordinator.end_session(first.session_id)
    await attempt("coordinator: after the session ended", "409 idempotency_result_inactive", request)
    return proofs


async def run_demo() -> int:
    """Run the recipe; return the process exit code."""
    with tempfile.TemporaryDirectory(prefix="consumer-kit-demo-") as folder:
        settings = Settings(database_url=f"sqlite+aiosqlite:///{Path(folder) / 'demo.db'}")
        app = ConsumerApp(settings)
        source = InMemorySource(namespace="ticket-queue", version=1)

        @app.handler(source, labels=["research-agent"], task=lambda d: f"Prepare {d.json()['key']}")
        async def prepare_report(ctx: Context) -> None:
            await ctx.db.execute(reports.insert().values(ticket=ctx.delivery.json()["key"]))

        async def effect_count() -> int:
            async with app.engine.connect() as conn:
                return int((await conn.execute(select(func.count()).select_from(reports))).scalar_one())

        report = RecipeReport()
        async with app.running():
            async with app.engine.begin() as conn:
                await conn.run_sync(_metadata.create_all)
            report.proofs += await _coordinator_steps(app)
            harness = RecipeHarness(app, source, effects=effect_count, prefix="m")
            body, changed = b'{"key": "T-1"}', b'{"key": "T-2"}'
            pipeline = await harness.prove_replay(body) + await harness.prove_conflict(body, changed)
            pipeline += await harness.prove_inactive(body)
            before = await effect_count()
            pipeline += await harness.prove_effect_once(body)
            effects = await effect_count() - before
            report.proofs += [Proof(f"pipeline: {p.step}", p.expected, p.observed) for p in pipeline]
            unkeyed = await source.deliver(id=None, body=b'{"key": "T-3"}')
            report.proofs.append(Proof("pipeline: no stable id", "invalid, dead_letter",
                                       f"{unkeyed.outcome.value}, {unkeyed.settlement.value}"))
        print(report.table())
        print(f"destination effect count: {effects} (expected 1: one crash and three redeliveries of one work item)")
        print("OK: retries are harmless" if report.ok and effects == 1 else "FAILED")
        return 0 if report.ok and effects == 1 else 1


def command(args: argparse.Namespace) -> int:
    """``consumer-kit demo [--verbose]``: the recipe's table; exit 1 when a step misbehaved."""
    if not args.verbose:  # the table is the output; the steps' expected warnings are noise here
        for name in ("consumer_kit", "alembic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    return asyncio.run(run_demo())
