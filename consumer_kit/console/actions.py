"""The console's actions on parked deliveries, by the rules of ``consumer-kit parked replay`` and
``parked discard``: the same :class:`~consumer_kit.replay.Replayer` (same key or skipped, a ``conflict``
only with the new body accepted, a rate, a dry run first), the same store, and every replay and discard
recorded in the audit under the signed-in principal's name.

What an action takes is bounded: at most ``CONSOLE_REPLAY_MAX`` deliveries, the ones ticked on a page
or, for a whole group, its oldest not replayed before (as ``parked replay`` chooses without ``--id``).
A client that goes away mid-action does not cut a replay in half: the batch runs in a task of its own,
which finishes the delivery it is at and stops.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from consumer_kit.replay import Replayer, ReplayReport
from consumer_kit.store import DeadLetter, DeadLetters, ParkedFilter

if TYPE_CHECKING:
    from consumer_kit.app import ConsumerApp

_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class Selection:
    """Which parked deliveries an action is about: ``ids`` ticked, or a whole group (reason, source)."""

    ids: tuple[str, ...] = ()
    reason: str | None = None
    source: str | None = None

    @property
    def group(self) -> bool:
        """Whether it names a group rather than deliveries."""
        return not self.ids and self.reason is not None and self.source is not None

    @classmethod
    def of(cls, ids: Sequence[str], reason: str | None, source: str | None, *, limit: int) -> Selection:
        """From a form: valid ids only (at most ``limit``, each once), else the group named."""
        chosen = tuple(dict.fromkeys(i for i in ids if _ID.fullmatch(i)))[:limit]
        return cls(ids=chosen) if chosen else cls(reason=reason or None, source=source or None)


async def chosen(store: DeadLetters, selection: Selection, *, limit: int, replayed: bool | None) -> list[DeadLetter]:
    """The parked deliveries ``selection`` names, at most ``limit``; of a group, the oldest first
    (only those never replayed when ``replayed`` is ``False``, as ``parked replay`` does)."""
    if selection.ids:
        found = [await store.get(letter_id) for letter_id in selection.ids[:limit]]
        return [letter for letter in found if letter is not None]
    if not selection.group:
        return []
    where = ParkedFilter(reason=selection.reason, source=selection.source, replayed=replayed)
    return await store.list(where=where, limit=limit, oldest_first=True)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an action did (or, on a dry run, would do): each delivery's report and the counts."""

    reports: list[ReplayReport]
    dry_run: bool

    @property
    def counts(self) -> dict[str, int]:
        """How many of each action."""
        return dict(sorted(Counter(r.action for r in self.reports).items()))

    @property
    def conflicts(self) -> int:
        """How many were parked as a conflict (they need the new body accepted)."""
        return sum(1 for r in self.reports if r.letter.reason == "conflict")

    @property
    def duplicates(self) -> int:
        """How many would be acknowledged as duplicates: their key is completed already."""
        return sum(1 for r in self.reports if r.detail and r.detail.startswith("completed"))


async def replay(app: ConsumerApp, letters: list[DeadLetter], *, actor: str, dry_run: bool,
                 accept_new_body: bool, rate: float) -> Outcome:
    """Replay ``letters`` through ``app`` as ``actor`` (or only say what would happen)."""
    reports: list[ReplayReport] = []
    stop = asyncio.Event()

    async def run() -> None:
        async with Replayer(app, actor=actor, accept_new_body=accept_new_body, dry_run=dry_run,
                            rate=rate) as replayer:
            for letter in letters:
                if stop.is_set():
                    break
                reports.append(await replayer.replay(letter))

    task = asyncio.get_running_loop().create_task(run(), name="consumer-kit-console-replay")
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        stop.set()  # the request went away: finish the delivery at hand (shielded), send no more
        raise
    return Outcome(reports, dry_run)


async def discard(store: DeadLetters, letters: list[DeadLetter], *, actor: str) -> int:
    """Delete ``letters`` for good, recorded as ``actor``'s; how many were still there."""
    return await store.discard(letters, actor=actor)
