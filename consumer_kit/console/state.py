"""What the console's pages show, gathered from the store and from this process's own counters.

The console runs either inside a worker (``consumer-kit run --port`` with ``CONSOLE_PATH``), where it
reads the app's database and the per-delivery counts the pipeline keeps in memory
(:mod:`consumer_kit.metrics`), or on its own (``consumer-kit console``), where only the database is
there: outcomes per minute then come from the worker's own console or from Prometheus, and the
console says so.

:class:`History` turns those in-memory counts, which only grow, into outcomes per minute: it samples
them every :data:`SAMPLE_SECONDS` and keeps the last sample of each of the last :data:`MINUTES`
minutes; a minute's count is its last sample less the one before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from prometheus_client import REGISTRY

from consumer_kit import metrics

if TYPE_CHECKING:
    from consumer_kit.app import ConsumerApp

MINUTES = 30
SAMPLE_SECONDS = 10.0
CATEGORIES = ("processed", "duplicate", "parked", "retried", "late")
"""The outcome series of the chart, each a sum of the pipeline's outcomes (:data:`_OUTCOMES`) or, for
``late``, of the late-delivery counter."""

_OUTCOMES = {"processed": ("processed",), "duplicate": ("duplicate",),
             "parked": ("dead_lettered", "conflict", "inactive", "invalid"), "retried": ("retry",)}

Counts = dict[str, int]


def counted(source: str) -> Counts:
    """The outcomes of ``source``'s deliveries this process has counted since it started, by category."""
    per = metrics.PER_DELIVERY.sources.get(source)
    outcomes = dict(per.outcomes) if per is not None else {}
    found = {name: sum(outcomes.get(o, 0) for o in names) for name, names in _OUTCOMES.items()}
    found["late"] = int(sum(REGISTRY.get_sample_value("consumer_kit_late_deliveries_total",
                                                      {"source": source, "action": action}) or 0
                            for action in metrics.LATE_ACTIONS))
    return found


def takeovers(source: str) -> int:
    """Leases this process took over from a holder that died or froze (since it started)."""
    return int(REGISTRY.get_sample_value("consumer_kit_inbox_takeovers_total", {"source": source}) or 0)


@dataclass
class History:
    """Outcomes per minute of each source, from samples of this process's counts (see the module)."""

    sources: Callable[[], Sequence[str]]
    clock: Callable[[], float] = time.time
    samples: deque[tuple[int, dict[str, Counts]]] = field(default_factory=lambda: deque(maxlen=MINUTES + 1))
    task: asyncio.Task[None] | None = None
    from_zero: bool = False

    def __post_init__(self) -> None:
        if self.from_zero:  # made as the process starts: every count was 0 the minute before
            self.samples.append((int(self.clock() // 60) - 1, {}))

    def sample(self) -> None:
        """Take a sample now (it replaces an earlier one of the same minute)."""
        minute = int(self.clock() // 60)
        taken = {source: counted(source) for source in self.sources()}
        if self.samples and self.samples[-1][0] == minute:
            self.samples[-1] = (minute, taken)
        else:
            self.samples.append((minute, taken))

    def per_minute(self) -> tuple[int, dict[str, list[int | None]]]:
        """The first minute (epoch minutes) of the window and, per category, each minute's count summed
        over the sources; ``None`` where no sample tells (before the first, or a minute not sampled)."""
        self.sample()
        last = self.samples[-1][0]
        first = last - MINUTES + 1
        by_minute = dict(self.samples)
        series: dict[str, list[int | None]] = {name: [] for name in CATEGORIES}
        for minute in range(first, last + 1):
            now, before = by_minute.get(minute), by_minute.get(minute - 1)
            for name in CATEGORIES:
                if now is None or before is None:
                    series[name].append(None)
                    continue
                series[name].append(sum(max(0, counts.get(name, 0) - before.get(source, {}).get(name, 0))
                                        for source, counts in now.items()))
        return first, series

    def start(self) -> None:
        """Sample every :data:`SAMPLE_SECONDS` from now on, in the background (once; it needs a running
        loop)."""
        if self.task is None:
            self.sample()
            self.task = asyncio.get_running_loop().create_task(self._run(), name="consumer-kit-console-history")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_SECONDS)
            self.sample()

    async def stop(self) -> None:
        """Stop sampling."""
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@runtime_checkable
class Reports(Protocol):
    """A source that reports its state to an operator (a schedule: last and next tick, skipped ticks)."""

    async def status(self, *, recent: int = 20) -> Any:
        """Its state now."""
        ...


@dataclass(frozen=True, slots=True)
class Handler:
    """One handler of the app, as the overview lists it."""

    consumer: str
    source: str
    kind: str
    totals: Counts
    takeovers: int


def handlers(app: ConsumerApp | None) -> list[Handler]:
    """The app's handlers, each with its source and what this process counted of it."""
    if app is None:
        return []
    return [Handler(consumer=spec.consumer, source=spec.source.name, kind=type(spec.source).__name__,
                    totals=counted(spec.source.name), takeovers=takeovers(spec.source.name))
            for spec in app.specs]


@dataclass(frozen=True, slots=True)
class ScheduleRow:
    """A schedule's last and next tick and its skipped ticks, by reason."""

    name: str
    consumer: str
    timing: str
    last_tick: Any
    last_state: str | None
    next_tick: Any
    pending: int
    skipped: dict[str, int]


async def schedules(app: ConsumerApp | None, *, limit: int) -> list[ScheduleRow]:
    """The state of the app's schedules (at most ``limit``)."""
    rows: list[ScheduleRow] = []
    for spec in (app.specs if app is not None else [])[:limit]:
        if not isinstance(spec.source, Reports):
            continue
        status = await spec.source.status(recent=5)
        last = status.last_fired
        rows.append(ScheduleRow(name=status.name, consumer=spec.consumer, timing=status.timing,
                                last_tick=last.tick if last else None, last_state=last.state if last else None,
                                next_tick=status.next_fire, pending=len(status.pending),
                                skipped=dict(status.skipped)))
    return rows
