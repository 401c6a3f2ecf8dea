"""The app of tests/acceptance/test_prometheus.py, as a user's module (``consumer-kit run
tests.acceptance.prometheus_app:app``) on the embedded defaults.

Two signed webhooks (``X-Signature: sha256=<HMAC of the body>`` with ``PROMETHEUS_TEST_SECRET``, keyed
by the body's ``id``) whose handlers park every delivery: ``/park`` with ``TerminalError``'s own reason
(``terminal``), ``/park-own-reason`` with a reason only the handler names (``not_ready``). And an
hourly schedule that does nothing, for its skipped-tick series.
"""

from __future__ import annotations

import os
from datetime import timedelta

from consumer_kit import ConsumerApp, Context, Settings, TerminalError
from consumer_kit.sources.schedules import Schedule
from consumer_kit.sources.webhooks import HmacVerifier, WebhookSource

SECRET = os.environ["PROMETHEUS_TEST_SECRET"]

app = ConsumerApp(Settings())


def _webhook(path: str, namespace: str) -> WebhookSource:
    return WebhookSource(path=path, namespace=namespace, version=1,
                         verifier=HmacVerifier(SECRET, header="X-Signature", prefix="sha256=", id_field="id"))


parks = _webhook("/park", "prometheus-park")
parks_own = _webhook("/park-own-reason", "prometheus-park-own")
hourly = Schedule("prometheus-hourly", every=timedelta(hours=1))


@app.handler(parks)
async def park(ctx: Context) -> None:
    """Park the delivery with TerminalError's own reason."""
    raise TerminalError("this test's deliveries are all parked")


@app.handler(parks_own)
async def park_own_reason(ctx: Context) -> None:
    """Park the delivery with a reason of the handler's own."""
    raise TerminalError("this test's deliveries are all parked", reason="not_ready")


@app.handler(hourly)
async def tick(ctx: Context) -> None:
    """Nothing: the schedule is here for its series."""
