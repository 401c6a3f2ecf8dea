"""Which due ticks run and which are skipped, and why: the catch-up policy as one pure function.

The window is every tick in ``(decided_until, now]``. One tick in it is simply due. More than one is
a backlog (the schedule's replicas were all down, or stalled): ``catch_up`` decides.

==========  =====================================================================================
"latest"    the newest tick runs; the older ones are recorded ``coalesced``
"all"       the newest ``max_catch_up`` ticks run, oldest first; older ones are recorded ``too_many``
"none"      none runs; every tick of the backlog is recorded ``misfire``
==========  =====================================================================================

A tick that would run but is later than ``misfire_grace_seconds`` is recorded ``misfire`` instead.
(``overlap`` is decided where the ticks are recorded: it needs to know what is still running.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

CatchUp = Literal["latest", "all", "none"]
Overlap = Literal["allow", "forbid"]
SkipReason = Literal["coalesced", "misfire", "too_many", "overlap"]

CHUNK = 500
"""At most this many ticks of a long backlog are decided (and recorded) in one transaction."""

_BACKLOG_REASON: dict[CatchUp, SkipReason] = {"latest": "coalesced", "all": "too_many", "none": "misfire"}


@dataclass(frozen=True, slots=True)
class Decision:
    """One tick's fate: it runs (``reason`` ``None``), or it is skipped for ``reason``."""

    tick: datetime
    reason: SkipReason | None = None

    @property
    def runs(self) -> bool:
        """Whether the tick is to run."""
        return self.reason is None


def look_ahead(catch_up: CatchUp, max_catch_up: int) -> int:
    """How many ticks to read beyond a chunk to know whether a chunk's ticks may run."""
    return max_catch_up if catch_up == "all" else 1


def decide(window: Sequence[datetime], *, now: datetime, complete: bool, catch_up: CatchUp, max_catch_up: int,
           misfire_grace_seconds: float | None) -> list[Decision]:
    """The fate of the ticks of ``window`` (ascending). ``complete``: it holds every due tick; else it
    holds ``CHUNK + look_ahead`` ticks and only its first ``CHUNK`` are decided (all skipped: more ticks
    follow them, so none of them is among those that may run)."""
    reason = _BACKLOG_REASON[catch_up]
    if not complete:
        return [Decision(tick, reason) for tick in window[:CHUNK]]
    if len(window) == 1:
        runs = 1
    else:
        runs = {"latest": 1, "all": max_catch_up, "none": 0}[catch_up]
    first_run = max(len(window) - runs, 0)
    grace = None if misfire_grace_seconds is None else timedelta(seconds=misfire_grace_seconds)
    decisions = []
    for index, tick in enumerate(window):
        if index < first_run:
            decisions.append(Decision(tick, reason))
        elif grace is not None and now - tick > grace:
            decisions.append(Decision(tick, "misfire"))
        else:
            decisions.append(Decision(tick))
    return decisions
