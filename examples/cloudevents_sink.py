"""A CloudEvents sink: binary, structured and batched events, keyed by ``source`` + ``id``.

    CLOUDEVENTS_TOKEN=... consumer-kit run examples.cloudevents_sink:app --port 8000

Senders POST to ``/events`` with ``Authorization: Bearer $CLOUDEVENTS_TOKEN`` (when set); the
abuse-protection handshake (``OPTIONS`` with ``WebHook-Request-Origin``) is granted to the origins in
``CLOUDEVENTS_ALLOWED_ORIGINS`` (comma-separated).
"""

from __future__ import annotations

import logging
import os

from prometheus_client import Counter

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.cloudevents import CloudEventsSource

log = logging.getLogger("examples.cloudevents_sink")
EVENTS = Counter("cloudevents_example_events_total", "CloudEvents handled by the example, by type.", ["type"])

app = ConsumerApp(Settings())
events = CloudEventsSource(
    path="/events",
    namespace="order-events",
    version=1,
    batch=True,
    bearer_tokens=os.environ.get("CLOUDEVENTS_TOKEN", ""),
    allowed_origins=[o for o in os.environ.get("CLOUDEVENTS_ALLOWED_ORIGINS", "").split(",") if o],
    allowed_rate=600,
)


@app.handler(events)
async def on_event(ctx: Context) -> None:
    """Handle one event: the attributes are ``ce-*`` headers, the data is the body."""
    EVENTS.labels(ctx.delivery.headers["ce-type"]).inc()
    log.info("cloudevent %s handled [%s]", ctx.delivery.headers["ce-type"], ctx.key_digest)
