"""Idempotent HTTP endpoints for your own API: the ``Idempotency-Key`` request header
(``draft-ietf-httpapi-idempotency-key-header``), on the same inbox as the queue consumers.

A client sends the same key with every attempt of a request; the route runs once, its database writes
and its stored response commit together, and every repeat gets that response back, marked
``Idempotency-Replayed: true``. The rules are :class:`IdempotencyKey`'s; :class:`IdempotencyMiddleware`
holds a response back until it is stored. Needs Starlette (the ``http`` extra); FastAPI for the
dependency style.

::

    from fastapi import Depends, FastAPI
    from consumer_kit import ConsumerApp
    from consumer_kit.http.asgi import lifespan
    from consumer_kit.http.idempotency import IdempotencyKey, IdempotencyMiddleware, IdempotentContext

    app = ConsumerApp()
    api = FastAPI(lifespan=lifespan(app))
    api.add_middleware(IdempotencyMiddleware)
    labels = IdempotencyKey(app, namespace="labels", version=1)

    @api.post("/labels", status_code=201)
    async def create_label(ctx: IdempotentContext = Depends(labels)) -> dict[str, str]: ...
"""

from consumer_kit.http.idempotency.asgi import IdempotencyKey, IdempotencyMiddleware, context_of, idempotency_context
from consumer_kit.http.idempotency.keys import fingerprint, header_key
from consumer_kit.http.idempotency.operation import IdempotentContext, KeyRules, Operation
from consumer_kit.http.idempotency.replies import Reply, RequestFacts

__all__ = ["IdempotencyKey", "IdempotencyMiddleware", "IdempotentContext", "KeyRules", "Operation", "Reply",
           "RequestFacts", "context_of", "fingerprint", "header_key", "idempotency_context"]
