"""The chaos run at a size that keeps the suite short (the full size: ``python -m tests.chaos.run``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.run import run

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


@pytest.mark.parametrize("path", ["default", "single", "batch", "outbox"])
async def test_kills_and_cuts_lose_and_double_nothing(path: str, tmp_path: Path) -> None:
    report = await run(path, messages=1500, kills=3, settle_seconds=240, log_dir=tmp_path)
    print(report.line())
    assert (report.lost, report.doubled) == (0, 0), report.line()
    assert (report.left_in_queue, report.unacked, report.parked) == (0, 0, 0), report.line()
    if path == "outbox":
        assert report.downstream_distinct == report.messages, report.line()
