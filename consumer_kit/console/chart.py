"""The overview's chart of outcomes per minute, drawn as inline SVG on the server: no chart library,
no script, nothing fetched from elsewhere. Hand-written because a line chart of five series over thirty
minutes is a few lines of arithmetic, smaller than any library's set-up."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

WIDTH, HEIGHT = 600, 160
LEFT, RIGHT, TOP, BOTTOM = 36, 8, 8, 20


@dataclass(frozen=True, slots=True)
class Line:
    """One series: its name and its polyline's segments (a gap in the data starts a new segment)."""

    name: str
    segments: list[str]
    total: int
    dots: list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Chart:
    """What the template draws: the lines, the y axis' top value, the x axis' first and last minute."""

    lines: list[Line]
    top: int
    first: str
    last: str
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    bottom: int = HEIGHT - BOTTOM
    right: int = WIDTH - RIGHT
    upper: int = TOP


def chart(first_minute: int, series: dict[str, list[int | None]]) -> Chart:
    """The chart of ``series`` (counts per minute from ``first_minute``, epoch minutes; ``None``: unknown)."""
    minutes = max((len(values) for values in series.values()), default=0)
    top = max([1, *(v for values in series.values() for v in values if v is not None)])
    span_x = (WIDTH - LEFT - RIGHT) / max(1, minutes - 1)
    span_y = (HEIGHT - TOP - BOTTOM) / top
    lines = []
    for name, values in series.items():
        segments: list[str] = []
        points: list[str] = []
        dots: list[tuple[str, str]] = []
        for i, value in enumerate(values):
            if value is None:
                if points:
                    segments.append(" ".join(points))
                points = []
                continue
            x, y = f"{LEFT + i * span_x:.1f}", f"{HEIGHT - BOTTOM - value * span_y:.1f}"
            points.append(f"{x},{y}")
            if value:
                dots.append((x, y))
        if points:
            segments.append(" ".join(points))
        lines.append(Line(name, segments, sum(v for v in values if v is not None), dots))
    return Chart(lines, top, _clock(first_minute), _clock(first_minute + minutes - 1))


def _clock(minute: int) -> str:
    return datetime.fromtimestamp(minute * 60, UTC).strftime("%H:%M")
