"""What the app hands a source that keeps state of its own in the store
(:class:`~consumer_kit.delivery.StoreSource`, a schedule): :class:`SourceStore`, ready objects on the
app's database, and the store's values such a source reads and writes, under public names.

Sources depend on the core's public names only, never on a ``consumer_kit.store`` module (which may
change freely): the names they need of the store are re-exported here, as :mod:`consumer_kit.outbox`
gives publishers :class:`~consumer_kit.outbox.OutboxMessage`.
"""

from __future__ import annotations

from dataclasses import dataclass

from consumer_kit.settings import Settings
from consumer_kit.store.inbox import Inbox
from consumer_kit.store.schedules import PendingTick, ScheduleId, ScheduleStore, TickRecord

__all__ = ["Inbox", "PendingTick", "ScheduleId", "ScheduleStore", "SourceStore", "TickRecord"]


@dataclass(frozen=True, slots=True)
class SourceStore:
    """The store, as the app hands it to a :class:`~consumer_kit.delivery.StoreSource` when it starts
    (before any source starts): ``consumer`` is the inbox scope of the source's handler, ``schedules``
    the schedules' state on the app's database, ``inbox`` the app's own inbox (its lease, retention and
    clock), ``settings`` the app's. A source builds no store object and opens no database of its own."""

    consumer: str
    schedules: ScheduleStore
    inbox: Inbox
    settings: Settings
