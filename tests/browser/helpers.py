"""What the browser tests share: the worker under test (its console, its queue, its database, the
handler's runs) and the two steps every test takes, signing in and saving a screenshot."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
from playwright.async_api import Page
from sqlalchemy import func, select

from consumer_kit.store import Database, DeadLetter, DeadLetters, create_engine
from tests.browser.console_app import effects
from tests.integration.rabbit import publish, wait_until

CHROMIUM = os.environ.get("CK_TEST_CHROMIUM", "/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS_ENV = "CK_DOCS_SCREENSHOTS"
"""Set (to anything), the screenshots replace the docs' (``CK_DOCS_SCREENSHOTS=1 make test``); unset, they
are taken all the same, into a scratch directory, so that a test run leaves the checkout as it was."""
OPERATOR_TOKEN = f"operator-{secrets.token_urlsafe(18)}"
VIEWER_TOKEN = f"viewer-{secrets.token_urlsafe(18)}"


@dataclass
class Worker:
    """The worker under test: its console's URL, its queue, the folder of fixes, its database."""

    url: str
    queue: str
    fixed: Path
    database_url: str
    log: Path

    @property
    def console(self) -> str:
        return f"{self.url}/console"

    def fix(self, order: str) -> None:
        """Deploy the fix for ``order``: its next run gets through."""
        (self.fixed / order).touch()

    async def park(self, order: str, **fields: object) -> DeadLetter:
        """Publish an order that waits for its fix, and return it once it is parked."""
        body = json.dumps({"order": order, "wait_for_fix": True, **fields}).encode()
        await publish(self.queue, [(f"order-{order}", body)])
        found: list[DeadLetter] = []

        async def parked() -> bool:
            found[:] = [letter for letter in await self.dead_letters(reason="not_ready")
                        if json.loads(letter.body)["order"] == order]
            return bool(found)

        await wait_until(parked, 30, f"order {order} to be parked")
        return found[0]

    async def dead_letters(self, **where: str) -> list[DeadLetter]:
        engine = create_engine(self.database_url)
        database = Database(engine)
        try:
            return await DeadLetters(database).list(limit=1000, **where)  # type: ignore[arg-type]
        finally:
            await database.close()
            await engine.dispose()

    async def history(self, letter_id: str) -> list[tuple[str, str, str]]:
        """(action, actor, outcome) of each replay and discard of one parked delivery."""
        engine = create_engine(self.database_url)
        database = Database(engine)
        try:
            return [(h.action, h.actor, h.outcome) for h in await DeadLetters(database).history(letter_id)]
        finally:
            await database.close()
            await engine.dispose()

    async def runs(self, order: str) -> int:
        """How often the handler ran (and committed) for ``order``."""
        engine = create_engine(self.database_url)
        try:
            async with engine.connect() as conn:
                return int((await conn.execute(
                    select(func.count()).select_from(effects).where(effects.c.order_id == order))).scalar_one())
        finally:
            await engine.dispose()

    async def counted(self, outcome: str) -> float:
        """The worker's count of deliveries with ``outcome`` (its /metrics)."""
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"{self.url}/metrics")).text
        series = f'consumer_kit_deliveries_total{{outcome="{outcome}",source="rabbitmq:{self.queue}"}}'
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series))


async def sign_in(page: Page, worker: Worker, token: str) -> None:
    """Sign in to the console as the owner of ``token``, through its sign-in form."""
    await page.goto(f"{worker.console}/")
    assert page.url.endswith("/console/signin")
    await page.fill("#token", token)
    await page.click("button[type=submit]")
    await page.wait_for_url(f"{worker.console}/")


async def screenshot(page: Page, name: str) -> None:
    """Save the page as console-<name>.png: in docs/img with ``CK_DOCS_SCREENSHOTS`` set (the docs'
    screenshots come from here), else in a scratch directory."""
    docs = bool(os.environ.get(SCREENSHOTS_ENV))
    folder = ROOT / "docs" / "img" if docs else Path(tempfile.gettempdir()) / "ck-screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    taken = folder / f"console-{name}.png"
    await page.screenshot(path=str(taken), full_page=False)
    assert taken.stat().st_size > 1000, f"an empty screenshot of {name}"
