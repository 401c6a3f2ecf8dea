"""A clock a test sets by hand (``clock.now += ...``), for the store's and the app's ``clock=``."""

from __future__ import annotations

from datetime import UTC, datetime


class Clock:
    def __init__(self, now: datetime | None = None) -> None:
        self.now = now or datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now
