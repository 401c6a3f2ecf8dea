"""An app whose outbox relay publishes to SQS, for ``consumer-kit outbox relay --app`` in the tracing
tests (the endpoint comes from ``SQS_ENDPOINT_URL``)."""

from __future__ import annotations

from consumer_kit import ConsumerApp, Settings
from consumer_kit.sources.sqs import SqsPublisher

settings = Settings()
app = ConsumerApp(settings)
app.relay_outbox(SqsPublisher(settings=settings))
