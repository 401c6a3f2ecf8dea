"""The coordinator an app uses when it is given none: the HTTP client of ``COORDINATOR_URL``'s server
when that is set, else the embedded coordinator on the app's own database."""

from __future__ import annotations

from consumer_kit.coordinator.protocol import Coordinator
from consumer_kit.errors import ConfigurationError
from consumer_kit.retry import RetryPolicy
from consumer_kit.settings import Settings
from consumer_kit.store import Clock, Database, utcnow


def default_coordinator(settings: Settings, database: Database, *, clock: Clock = utcnow) -> Coordinator:
    """``HttpCoordinator(COORDINATOR_URL, token=COORDINATOR_TOKEN)`` (its retry budget from the
    settings), or ``EmbeddedCoordinator`` on ``database``."""
    if settings.coordinator_url:
        if settings.coordinator_token is None:
            raise ConfigurationError("COORDINATOR_URL is set but COORDINATOR_TOKEN is not")
        from consumer_kit.coordinator.http import HttpCoordinator  # httpx's client only when it is used

        return HttpCoordinator(
            settings.coordinator_url, token=settings.coordinator_token.get_secret_value(),
            policy=RetryPolicy(attempts=settings.coordinator_retry_attempts,
                               total_seconds=settings.coordinator_retry_seconds),
        )
    from consumer_kit.coordinator.embedded import EmbeddedCoordinator

    return EmbeddedCoordinator(database, settings, clock=clock)
