"""``consumer-kit demo``: seed 000's validation recipe, end to end, on the embedded defaults.

The same work delivered twice, a changed request under the same key, and a malformed delivery, on a
SQLite file in a temporary directory; it prints what each step produced and the destination effect
count, and exits non-zero if any step did not behave as the seeds say.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from sqlalchemy import Column, Integer, MetaData, String, Table, func, select

from consumer_kit.app import ConsumerApp
from consumer_kit.context import Context
from consumer_kit.delivery import Outcome
from consumer_kit.settings import Settings
from consumer_kit.testing import InMemorySource

_metadata = MetaData()
reports = Table(
    "demo_reports", _metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ticket", String(50), nullable=False),
)


async def run_demo() -> int:
    """Run the recipe; return the process exit code."""
    with tempfile.TemporaryDirectory(prefix="consumer-kit-demo-") as folder:
        settings = Settings(database_url=f"sqlite+aiosqlite:///{Path(folder) / 'demo.db'}")
        app = ConsumerApp(settings)
        source = InMemorySource(namespace="ticket-queue", version=1)

        @app.handler(source)
        async def prepare_report(ctx: Context) -> None:
            await ctx.db.execute(reports.insert().values(ticket=ctx.delivery.json()["key"]))

        rows: list[tuple[str, str, str, bool]] = []
        async with app.running():
            async with app.engine.begin() as conn:
                await conn.run_sync(_metadata.create_all)
            steps = [
                ("first delivery", "m-1", b'{"key": "T-1"}', Outcome.PROCESSED),
                ("same work again", "m-1", b'{"key": "T-1"}', Outcome.DUPLICATE),
                ("changed body, same key", "m-1", b'{"key": "T-2"}', Outcome.CONFLICT),
                ("no stable id", None, b'{"key": "T-3"}', Outcome.INVALID),
            ]
            for label, message_id, body, expected in steps:
                result = await source.deliver(id=message_id, body=body)
                rows.append((label, result.outcome.value, result.settlement.value, result.outcome is expected))
            async with app.engine.connect() as conn:
                effects = (await conn.execute(select(func.count()).select_from(reports))).scalar_one()
            parked = await app.dead_letters.count()
        ok = all(row[3] for row in rows) and effects == 1 and parked == 2
        width = max(len(row[0]) for row in rows)
        print(f"{'step':<{width}}  {'outcome':<13} {'settlement':<12} as expected")
        for label, outcome, settlement, good in rows:
            print(f"{label:<{width}}  {outcome:<13} {settlement:<12} {'yes' if good else 'NO'}")
        print(f"destination effect count: {effects} (expected 1); parked deliveries: {parked} (expected 2)")
        print("OK: retries are harmless" if ok else "FAILED")
        return 0 if ok else 1
