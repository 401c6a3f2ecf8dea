"""A CloudEvents sink for the tests: an app with one ``CloudEventsSource`` on ``/events`` whose handler
records every delivery it runs for, served by ``app.asgi()`` to an httpx client."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from consumer_kit import ConsumerApp, Context, Delivery
from consumer_kit.sources.cloudevents import CloudEventsSource
from tests.conftest import make_settings

TOKEN = "ce-bearer-token-for-tests"
DATA = Path(__file__).resolve().parents[1] / "data" / "cloudevents"
STRUCTURED = {"content-type": "application/cloudevents+json"}
BATCH = {"content-type": "application/cloudevents-batch+json"}


def data_file(name: str) -> Any:
    """One of the test data files under tests/data/cloudevents (their sources are cited inside)."""
    return json.loads((DATA / name).read_text("utf-8"))


class Sink:
    """The app, its source and what its handler saw."""

    def __init__(self, database_url: str, **settings: object) -> None:
        self.app = ConsumerApp(make_settings(database_url, **settings))
        self.source = CloudEventsSource(
            path="/events",
            namespace="orders",
            version=1,
            batch=True,
            bearer_tokens=[TOKEN],
            allowed_origins=["https://sender.example"],
            allowed_rate=120,
        )
        self.seen: list[Delivery] = []

        @self.app.handler(self.source)
        async def on_event(ctx: Context) -> None:
            self.seen.append(ctx.delivery)

    @property
    def events(self) -> list[tuple[str, object]]:
        """(type, JSON data) of every event handled, in order."""
        return [(d.headers["ce-type"], d.json()) for d in self.seen]


@contextlib.asynccontextmanager
async def serving(database_url: str, **settings: object) -> AsyncIterator[tuple[Sink, httpx.AsyncClient]]:
    """A running sink and a client that sends the bearer token."""
    sink = Sink(database_url, **settings)
    async with sink.app.running():
        transport = httpx.ASGITransport(app=sink.app.asgi())
        async with httpx.AsyncClient(
            transport=transport, base_url="http://testserver", headers={"authorization": f"Bearer {TOKEN}"}
        ) as client:
            yield sink, client
