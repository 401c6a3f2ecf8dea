"""Two replicas of a schedule as a user runs them (``consumer-kit run``), on PostgreSQL: one is
SIGKILLed in the middle of its ticks; the other takes each of them over once its lease has run out,
and every tick's effect commits exactly once."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path

import pytest
from sqlalchemy import select

from consumer_kit.keys import KeyDigester, OperationKey
from consumer_kit.store import inbox
from tests.acceptance import schedule_app
from tests.acceptance.test_schedule_cli import ROOT, environment, init, rows, until
from tests.conftest import TEST_HMAC_KEY

pytestmark = pytest.mark.postgres


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    command = [str(Path(sys.executable).with_name("consumer-kit")), "--log-level", "WARNING",
               "run", "tests.acceptance.schedule_app:app"]
    with log.open("ab") as output:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output)


async def test_a_replica_killed_mid_tick_is_taken_over_after_its_lease(pg_database: str, tmp_path: Path) -> None:
    log = tmp_path / "workers.log"
    env = environment(pg_database, INBOX_LEASE_SECONDS="2", SCHEDULE_POLL_SECONDS="0.5", DB_POOL_SIZE="4",
                      SHUTDOWN_GRACE_SECONDS="5")
    await init("tests.acceptance.schedule_app", env)
    effects, started = schedule_app.effects, schedule_app.started

    async def effect_rows() -> list[tuple[object, ...]]:
        return await rows(pg_database, select(effects.c.tick, effects.c.pid).where(effects.c.schedule == "ticker"))

    doomed = start_worker(dict(env, TICKER_BLOCK="1"), log)
    survivor: subprocess.Popen[bytes] | None = None
    try:
        async def mid_tick() -> bool:
            return bool(await rows(pg_database, select(started.c.tick)))

        await until(mid_tick, "the first replica to start a tick")
        survivor = start_worker(env, log)
        await asyncio.sleep(1.5)  # the survivor is up, finding the doomed one's ticks held
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
        held = {str(tick) for tick, in await rows(pg_database, select(started.c.tick))}

        async def all_taken_over() -> bool:
            done = {str(tick) for tick, _ in await effect_rows()}
            return held <= done and len(done) >= len(held) + 3

        await until(all_taken_over, "the survivor to take over every tick the killed replica held")
    finally:
        if doomed.poll() is None:
            doomed.kill()
        if survivor is not None:
            survivor.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(survivor.wait, 30)
            assert code == 0, log.read_text()

    found = await effect_rows()
    ticks = sorted(datetime.fromisoformat(str(tick).replace("Z", "+00:00")) for tick, _ in found)
    assert len(ticks) == len(set(ticks))  # no tick's effect twice
    assert all(b - a == timedelta(seconds=1) for a, b in pairwise(ticks))  # and none lost
    assert {str(tick) for tick, pid in found if str(tick) in held} == held
    assert {pid for tick, pid in found if str(tick) in held} == {survivor.pid}
    digester = KeyDigester(TEST_HMAC_KEY.encode())
    for tick in held:  # claimed by the killed replica, then taken over: two claims
        digest = digester.digest(OperationKey("ticker", 1, tick))
        assert await rows(pg_database, select(inbox.c.state, inbox.c.attempts).where(
            inbox.c.key_digest == digest)) == [("completed", 2)]
