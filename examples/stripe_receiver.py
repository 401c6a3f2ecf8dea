"""A Stripe-style webhook receiver: verified, keyed by the event id, processed once.

    STRIPE_WEBHOOK_SECRET=whsec_... consumer-kit run examples.stripe_receiver:app --port 8000

Stripe POSTs events to ``/stripe/webhooks`` signed with ``Stripe-Signature``; a retry of the same
event (same ``evt_...`` id, new timestamp and signature) is answered 200 without running the handler
again. Several secrets (comma-separated) are accepted while one is rolled.
"""

from __future__ import annotations

import logging
import os

from prometheus_client import Counter

from consumer_kit import ConsumerApp, Context, Settings
from consumer_kit.sources.webhooks import StripeVerifier, WebhookSource

log = logging.getLogger("examples.stripe_receiver")
EVENTS = Counter("stripe_example_events_total", "Stripe events handled by the example, by type.", ["type"])

app = ConsumerApp(Settings())
stripe = WebhookSource(
    path="/stripe/webhooks",
    namespace="stripe-events",
    version=1,
    verifier=StripeVerifier(os.environ.get("STRIPE_WEBHOOK_SECRET", "").split(",")),
)


@app.handler(stripe)
async def on_stripe_event(ctx: Context) -> None:
    """Handle one Stripe event: here, count it by type (a real handler writes through ``ctx.db``)."""
    event = ctx.delivery.json()
    EVENTS.labels(event.get("type", "unknown")).inc()
    log.info("stripe event %s handled [%s]", event.get("type"), ctx.key_digest)
