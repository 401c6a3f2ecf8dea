"""Verified webhook receivers: ``WebhookSource`` and the Standard Webhooks, Stripe, GitHub and generic
HMAC verifiers. Needs the ``webhooks`` extra: ``pip install 'consumer-kit[webhooks]'``."""

try:
    import standardwebhooks  # noqa: F401
    import starlette  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
    from consumer_kit.extras import missing_extra

    raise missing_extra("webhooks", "consumer_kit.sources.webhooks", exc) from exc

from consumer_kit.sources.webhooks.receiver import WebhookSource
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
