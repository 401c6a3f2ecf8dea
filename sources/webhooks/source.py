"""WebhookSource: a verified webhook endpoint, served by ``app.asgi()``.

For each request: read the raw body under the size cap (413 before any hashing), verify it with the
verifier (400 malformed, 401 unauthenticated; neither is parked nor run, both are counted), then hand
the delivery to the pipeline keyed by the provider's stable id and answer its verdict
(:func:`consumer_kit.http.answer_for`): 200 processed or already processed, 503 with ``Retry-After``
while in progress or to be retried, 400 and parked when verified but unparseable or without an id,
202 and parked on a conflict or another terminal outcome. The verdict is the settlement: HTTP sources
share the core's answers, so a webhook has no settlement module of its own; the request-to-delivery
step is :mod:`.message`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from consumer_kit.delivery import Delivery, Dispatch
from consumer_kit.errors import MissingStableId
from consumer_kit.http import DEFAULT_BODY_LIMIT
from consumer_kit.http.intake import HttpIntake, respond, single_headers
from consumer_kit.keys import OperationKey
from consumer_kit.sources.webhooks.message import to_delivery
from consumer_kit.sources.webhooks.verifiers import Verifier


class WebhookSource(HttpIntake):
    """Deliveries POSTed by a webhook provider to ``path``, authenticated by ``verifier``.

    ``namespace`` and ``version`` form the operation key with the provider's stable id
    (``stripe-events:v1:evt_...``); ``body_limit`` caps the raw body (default 256 KiB).
    """

    def __init__(self, *, path: str, verifier: Verifier, namespace: str, version: int,
                 name: str | None = None, body_limit: int = DEFAULT_BODY_LIMIT) -> None:
        super().__init__(path=path, namespace=namespace, version=version,
                         name=name or f"webhook:{namespace}", body_limit=body_limit)
        self.verifier = verifier

    def key(self, delivery: Delivery) -> OperationKey:
        """``namespace:v<version>:<provider id>``, read by the verifier from the verified delivery."""
        stable_id = self.verifier.stable_id(delivery.headers, delivery.body)
        if not stable_id:
            raise MissingStableId()
        return OperationKey(self.namespace, self.version, stable_id)

    async def receive(self, request: Request, dispatch: Dispatch) -> Response:
        """Verify one request and answer the pipeline's verdict on it."""
        headers = single_headers(request, self.verifier.header_names)
        body = await self.read_body(request)
        return respond(await dispatch(to_delivery(self.verifier, headers, body)))
