"""Verified webhook receivers: ``WebhookSource`` and the Standard Webhooks, Stripe, GitHub and generic
HMAC verifiers. Needs the ``webhooks`` extra: ``pip install 'consumer-kit[webhooks]'``.

The parts, as every source has them where an HTTP receiver has one: the source (:mod:`.source`), the
message reader (the verifiers, :mod:`.verifiers`, and the request-to-delivery step, :mod:`.message`).
Its settlement is the HTTP answer, the core's (:func:`consumer_kit.http.answer_for`); nothing is
published to a webhook provider, so there is no publisher."""

try:
    import standardwebhooks  # noqa: F401
    import starlette  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
    from consumer_kit.extras import missing_extra

    raise missing_extra("webhooks", "consumer_kit.sources.webhooks", exc) from exc

from consumer_kit.sources.webhooks.source import WebhookSource
from consumer_kit.sources.webhooks.verifiers import (
    GitHubVerifier,
    HmacVerifier,
    Secrets,
    StandardWebhooksVerifier,
    StripeVerifier,
    Verifier,
)

__all__ = [
    "GitHubVerifier",
    "HmacVerifier",
    "Secrets",
    "StandardWebhooksVerifier",
    "StripeVerifier",
    "Verifier",
    "WebhookSource",
]
