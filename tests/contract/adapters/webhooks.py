"""The contract's adapter for :class:`~consumer_kit.sources.webhooks.WebhookSource`, with Stripe's
signature: the stable id is the event's ``id`` in the signed body (a body without one is verified,
then parked ``missing_stable_id``); the provider's retry is the same body signed anew."""

from __future__ import annotations

import json
import secrets
import time

from consumer_kit import Settings, Source
from consumer_kit.sources.webhooks import StripeVerifier, WebhookSource
from tests.conftest import make_settings
from tests.contract.adapters.http import HttpAdapter, Request
from tests.signing import stripe_signature

SECRET = "whsec_contract_test_secret_value"


class WebhookAdapter(HttpAdapter):
    id = "webhooks"

    def __init__(self) -> None:
        super().__init__()
        self.namespace = f"contract-hooks-{secrets.token_hex(4)}"
        self.resent = 0

    def settings(self, database_url: str, **overrides: object) -> Settings:
        values: dict[str, object] = {"retry_attempts": 1, "retry_later_seconds": 0.1}
        values.update(overrides)
        return make_settings(database_url, **values)

    def make_source(self) -> Source:
        return WebhookSource(path=self.path, verifier=StripeVerifier(SECRET), namespace=self.namespace, version=1)

    def request(self, stable_id: str | None, *, again: bool = False) -> Request:
        event: dict[str, object] = {"object": "event", "type": "contract.delivered"}
        if stable_id is not None:
            event["id"] = stable_id
        body = json.dumps(event).encode()
        self.resent += again
        signed_at = int(time.time()) + self.resent  # a retry is signed again, at a later time
        return body, {"stripe-signature": stripe_signature(SECRET, body, signed_at),
                      "content-type": "application/json"}
