"""The chaos run at a size that keeps the suite short (the full size: ``python -m tests.chaos.run
[--transport nats|redis]``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.run import run

pytestmark = [pytest.mark.postgres]


# Enough messages that every fault lands while work remains (each is placed at a share of the messages,
# and asserted to have come before the last): the batch path consumes several times faster than the
# others. The full size is the command's.
MESSAGES = {"batch": 7500}
SMALL = 1500


@pytest.mark.rabbitmq
@pytest.mark.parametrize("path", ["default", "single", "batch", "staged", "outbox"])
async def test_kills_and_cuts_lose_and_double_nothing(path: str, tmp_path: Path) -> None:
    report = await run(path, messages=MESSAGES.get(path, SMALL), kills=3, settle_seconds=240, log_dir=tmp_path)
    print(report.line())
    # the faults hit work under way
    assert report.done_at_cut < report.messages and report.done_at_fault < report.messages, report.line()
    assert (report.lost, report.doubled) == (0, 0), report.line()
    assert (report.left_in_queue, report.unacked, report.parked) == (0, 0, 0), report.line()
    if path == "outbox":
        assert report.downstream_distinct == report.messages, report.line()
    if path == "staged":  # the one-statement write is what ran (a delivery cut during it may fall back)
        assert report.one_statement is not None and report.one_statement >= report.messages * 0.9, report.line()


@pytest.mark.rabbitmq
@pytest.mark.parametrize("path", ["default"])
async def test_a_database_server_crash_loses_and_doubles_nothing(path: str, tmp_path: Path) -> None:
    """The database server itself crashes (on a server of the run's own) while the worker consumes: a
    lease the crash lost (it commits without waiting for its flush) is a lease ended early. The default
    path here, whose claims commit without waiting for their flush; every path with
    ``python -m tests.chaos.run --crash``."""
    report = await run(path, messages=SMALL, kills=3, settle_seconds=240, log_dir=tmp_path, crash=True)
    print(report.line())
    assert report.recovered, "the server did not go through crash recovery"
    # the faults hit work under way
    assert report.done_at_cut < report.messages and report.done_at_fault < report.messages, report.line()
    assert (report.lost, report.doubled) == (0, 0), report.line()
    assert (report.left_in_queue, report.unacked, report.parked) == (0, 0, 0), report.line()


@pytest.mark.rabbitmq
async def test_through_pgbouncer_kills_and_cuts_lose_and_double_nothing(pgbouncer_port: int, tmp_path: Path) -> None:
    """The default path with the worker behind PgBouncer in transaction mode (DATABASE_POOLER=transaction):
    the database fault terminates the bouncer's server connections under the worker's open ones."""
    report = await run("default", messages=SMALL, kills=3, settle_seconds=240, log_dir=tmp_path,
                       pgbouncer_port=pgbouncer_port)
    print(report.line())
    assert report.done_at_cut < report.messages and report.done_at_fault < report.messages, report.line()
    assert (report.lost, report.doubled) == (0, 0), report.line()
    assert (report.left_in_queue, report.unacked, report.parked) == (0, 0, 0), report.line()


# NATS and Redis: the default path only, at a size that keeps each well under a minute; the broker
# fault is their own server killed with SIGKILL and started again while the worker consumes.
@pytest.mark.parametrize("transport_name", [
    pytest.param("nats", marks=pytest.mark.nats), pytest.param("redis", marks=pytest.mark.redis)])
async def test_kills_a_server_restart_and_a_database_cut_lose_and_double_nothing(
        transport_name: str, tmp_path: Path) -> None:
    report = await run("default", messages=SMALL, kills=3, settle_seconds=120, log_dir=tmp_path,
                       transport_name=transport_name)
    print(report.line())
    assert report.broker_fault == "server restart", report.line()
    # the faults hit work under way
    assert report.done_at_cut < report.messages and report.done_at_fault < report.messages, report.line()
    assert (report.lost, report.doubled) == (0, 0), report.line()
    assert (report.left_in_queue, report.unacked, report.parked) == (0, 0, 0), report.line()
