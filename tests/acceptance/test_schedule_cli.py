"""``consumer-kit schedule run`` and ``schedule list`` as an external cron runs them: two invocations
at once run a tick once, and the exit code says what happened; ``schedule list`` prints JSON lines or a
table of the same fields. The nightly-report example, exercised."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from consumer_kit.cli.output import cell
from consumer_kit.keys import KeyDigester, OperationKey
from consumer_kit.sources.schedules.timing import is_tick, key_id
from consumer_kit.store import create_engine, inbox, upgrade
from tests.acceptance import schedule_app
from tests.conftest import TEST_HMAC_KEY, truncate_all

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).with_name("consumer-kit"))


def environment(database: str, **extra: str) -> dict[str, str]:
    values = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "IDEMPOTENCY_", "REPORT_"))}
    values.update(PYTHONPATH=str(ROOT), DATABASE_URL=database, IDEMPOTENCY_HMAC_KEY=TEST_HMAC_KEY, **extra)
    return values


async def run(*args: str, env: dict[str, str], cwd: Path = ROOT) -> tuple[int, dict[str, object] | None, str]:
    """Run ``consumer-kit <args>`` in ``cwd``; its exit code, its JSON answer (if any) and its error output."""
    process = await asyncio.create_subprocess_exec(CLI, "--log-level", "WARNING", *args, cwd=cwd, env=env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    lines = out.decode().strip().splitlines()
    return process.returncode, json.loads(lines[-1]) if lines else None, err.decode()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/cli.db"
    else:
        url = request.getfixturevalue("pg_url")
        await truncate_all(url)
        yield url


async def init(module: str, env: dict[str, str]) -> None:
    """The schema at head (what `consumer-kit db upgrade` does) and the module's own tables, emptied
    (what its ``init`` command does, done here without starting another Python)."""
    tables = importlib.import_module(module).metadata
    engine = create_engine(env["DATABASE_URL"])
    try:
        await upgrade(engine)
        async with engine.begin() as conn:
            await conn.run_sync(tables.create_all)
            for table in tables.sorted_tables:
                await conn.execute(table.delete())
    finally:
        await engine.dispose()


async def rows(database: str, query: object) -> list[tuple[object, ...]]:
    engine: AsyncEngine = create_engine(database)
    try:
        async with engine.connect() as conn:
            return [tuple(row) for row in await conn.execute(query)]  # type: ignore[call-overload]
    finally:
        await engine.dispose()


def an_hour_ago() -> str:
    return key_id(datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1))


async def test_schedule_run_started_twice_at_once_runs_the_tick_once(database: str) -> None:
    env = environment(database, REPORT_SECONDS="2")
    await init("tests.acceptance.schedule_app", env)
    tick = an_hour_ago()
    first, second = await asyncio.gather(*(run("schedule", "run", "tests.acceptance.schedule_app:app", "report",
                                                "--at", tick, env=env) for _ in range(2)))
    assert sorted([first[0], second[0]]) == [0, 3], (first, second)
    assert sorted(str(answer["status"]) for _, answer, _ in (first, second) if answer) == ["duplicate", "processed"]
    assert {answer["scheduled_for"] for _, answer, _ in (first, second) if answer} == {tick}
    effects = schedule_app.effects
    assert await rows(database, select(effects.c.tick).where(effects.c.schedule == "report")) == [(tick,)]


async def until(check: Callable[[], Awaitable[bool]], what: str, seconds: float = 60) -> None:
    """Wait for ``check()`` to hold; fail the test after ``seconds``."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def held(database: str, name: str, tick: str) -> bool:
    """Whether a process has claimed the tick (its inbox row is started)."""
    digest = KeyDigester(TEST_HMAC_KEY.encode()).digest(OperationKey(name, 1, tick))
    return await rows(database, select(inbox.c.state).where(inbox.c.key_digest == digest)) == [("started",)]


async def test_exit_codes_say_failed_parked_and_in_progress(tmp_path: Path) -> None:
    database = f"sqlite+aiosqlite:///{tmp_path}/cli.db"
    env = environment(database, REPORT_FAIL="1", MAX_DELIVERIES="2", RETRY_ATTEMPTS="1")
    await init("tests.acceptance.schedule_app", env)
    tick = an_hour_ago()
    fire = ("schedule", "run", "tests.acceptance.schedule_app:app", "report", "--at", tick)
    code, answer, _ = await run(*fire, env=env)
    assert (code, answer and answer["status"]) == (4, "failed")  # retried later: run it again
    code, answer, _ = await run(*fire, env=env)
    assert (code, answer and answer["status"], answer and answer["reason"]) == (5, "parked", "retries_exhausted")
    code, answer, _ = await run(*fire, env=env)
    assert (code, answer and answer["status"]) == (5, "parked")  # parked before: nothing runs

    release = tmp_path / "release"  # the slow run holds the tick until the test creates this file
    env = environment(database, REPORT_UNTIL=str(release))
    other = key_id(datetime.fromisoformat(tick.replace("Z", "+00:00")) - timedelta(hours=1))
    fire = ("schedule", "run", "tests.acceptance.schedule_app:app", "report", "--at", other)
    slow = asyncio.ensure_future(run(*fire, env=env))
    await until(lambda: held(database, "report", other), "the slow run to hold the tick")
    code, answer, _ = await run(*fire, "--wait", "0.2", env=env)
    release.touch()
    assert (code, answer and answer["status"]) == (6, "in_progress")
    assert (await slow)[0] == 0

    code, _, error = await run("schedule", "run", "tests.acceptance.schedule_app:app", "nightly", env=env)
    assert code == 2 and "no schedule 'nightly' (it has: report, ticker)" in error


async def test_the_nightly_report_example(tmp_path: Path) -> None:
    database = f"sqlite+aiosqlite:///{tmp_path}/example.db"
    env = environment(database)
    await init("examples.nightly_report", env)
    from examples import nightly_report as example

    engine = create_engine(database)
    try:
        async with engine.begin() as conn:
            berlin = example.BERLIN
            await conn.execute(example.sales.insert(), [
                {"sold_at": datetime(2026, 3, 28, 23, 30, tzinfo=berlin), "amount_cents": 500},  # Saturday
                {"sold_at": datetime(2026, 3, 29, 1, 30, tzinfo=berlin), "amount_cents": 1200},  # Sunday: 23 hours
                {"sold_at": datetime(2026, 3, 29, 23, 59, tzinfo=berlin), "amount_cents": 300},
                {"sold_at": datetime(2026, 3, 30, 0, 1, tzinfo=berlin), "amount_cents": 7000},  # Monday
            ])
    finally:
        await engine.dispose()
    app = "examples.nightly_report:app"
    # 02:00 on Monday 2026-03-30 in Berlin (CEST) is 00:00Z; it reports on Sunday, the 23-hour day.
    code, answer, error = await run("schedule", "run", app, "nightly-report", "--at", "2026-03-30T00:00:00Z", env=env)
    assert (code, answer and answer["status"]) == (0, "processed"), error
    # 02:00 on Sunday did not exist: that night's tick is 03:00 CEST (01:00Z), reporting on Saturday.
    code, answer, _ = await run("schedule", "run", app, "nightly-report", "--at", "2026-03-29T01:00:00Z", env=env)
    assert code == 0
    code, answer, _ = await run("schedule", "run", app, "nightly-report", env=env)  # the night due now
    assert code == 0 and answer is not None
    latest = datetime.fromisoformat(str(answer["scheduled_for"]).replace("Z", "+00:00"))
    assert is_tick(example.nightly.timing, latest) and datetime.now(UTC) - timedelta(days=1) < latest

    reports = example.reports
    made = await rows(database, select(reports.c.day, reports.c.sales, reports.c.total_cents,
                                       reports.c.scheduled_for).order_by(reports.c.day))
    assert made[:2] == [(datetime(2026, 3, 28).date(), 1, 500, "2026-03-29T01:00:00Z"),
                        (datetime(2026, 3, 29).date(), 2, 1500, "2026-03-30T00:00:00Z")]
    assert len(made) == 3

    code, answer, _ = await run("schedule", "list", app, env=env)
    assert code == 0 and answer is not None
    assert answer["schedule"] == "nightly-report" and answer["timing"] == "cron 0 2 * * * Europe/Berlin"
    assert answer["last_fired"] == key_id(latest) and answer["last_state"] == "done"
    assert answer["pending"] == [] and answer["skipped"] == {}


async def test_a_run_stopped_by_sigterm_gives_its_lease_back(tmp_path: Path) -> None:
    database = f"sqlite+aiosqlite:///{tmp_path}/cli.db"
    await init("tests.acceptance.schedule_app", environment(database))
    tick = an_hour_ago()
    fire = (CLI, "--log-level", "WARNING", "schedule", "run", "tests.acceptance.schedule_app:app", "report",
            "--at", tick)
    process = await asyncio.create_subprocess_exec(*fire, cwd=ROOT, env=environment(database, REPORT_SECONDS="60"),
                                                   stdout=asyncio.subprocess.PIPE)
    await until(lambda: held(database, "report", tick), "the run to hold the tick")
    process.send_signal(signal.SIGTERM)  # a CronJob's deadline: the pod is stopped mid-run
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 4 and json.loads(out)["reason"] == "interrupted"
    # The lease (30 s) was given back: the next invocation runs the tick at once instead of waiting.
    code, answer, _ = await run(*fire[1:], "--wait", "0", env=environment(database))
    assert (code, answer and answer["status"]) == (0, "processed")
    assert await rows(database, select(schedule_app.effects.c.tick)) == [(tick,)]


async def printed(*args: str, env: dict[str, str], cwd: Path = ROOT) -> str:
    """What ``consumer-kit <args>`` printed on stdout in ``cwd`` (it must exit 0)."""
    process = await asyncio.create_subprocess_exec(CLI, "--log-level", "WARNING", *args, cwd=cwd, env=env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return out.decode()


async def test_schedule_list_prints_json_lines_or_a_table_of_the_same_fields(database: str, tmp_path: Path) -> None:
    env = environment(database, REPORT_FAIL="1", MAX_DELIVERIES="1", RETRY_ATTEMPTS="1")
    await init("tests.acceptance.schedule_app", env)
    app = "tests.acceptance.schedule_app:app"
    tick = an_hour_ago()
    # The app named by its file, from another directory: --app-dir says where to look, for run and list.
    by_file = ("tests/acceptance/schedule_app.py:app", "--app-dir", str(ROOT))
    code, _, error = await run("schedule", "run", *by_file[:1], "report", "--at", tick, env=env, cwd=tmp_path)
    assert code == 2 and error.splitlines() == [
        "consumer-kit: there is no file tests/acceptance/schedule_app.py (from tests/acceptance/schedule_app.py:app)"]
    assert (await run("schedule", "run", *by_file, "report", "--at", tick, env=env, cwd=tmp_path))[0] == 5  # parked

    def steady(output: str) -> dict[str, dict[str, object]]:  # by schedule; the ticker's next fire moves on
        return {row["schedule"]: {**row, "next_fire": None} for row in map(json.loads, output.splitlines())}

    listed = steady(await printed("schedule", "list", app, "--format", "json", env=env))
    assert steady(await printed("schedule", "list", app, env=env)) == listed  # JSON lines stay the default
    assert steady(await printed("schedule", "list", *by_file, env=env, cwd=tmp_path)) == listed
    assert set(listed) == {"report", "ticker"}
    report = listed["report"]
    assert (report["last_fired"], report["last_state"], report["last_reason"]) == (tick, "parked", "retries_exhausted")
    assert report["timing"] == "cron 0 * * * * UTC" and listed["ticker"]["last_fired"] is None

    before = datetime.now(UTC).replace(microsecond=0)
    table = (await printed("schedule", "list", app, "--format", "table", env=env)).splitlines()
    columns = [name.lower() for name in table[0].split()]
    assert columns[:4] == ["schedule", "version", "consumer", "timing"] and "next_fire" in columns
    assert len(table) == 1 + len(listed)
    for line in table[1:]:
        cells = re.split(r"\s{2,}", line)  # cells are two spaces apart; none holds two spaces itself
        row = listed[cells[0]]
        assert set(columns) <= set(row)  # every field the table shows is in the JSON line
        assert [text for text, column in zip(cells, columns, strict=True) if column != "next_fire"] == [
            cell(row[column]) for column in columns if column != "next_fire"]
        assert datetime.fromisoformat(cells[columns.index("next_fire")].replace("Z", "+00:00")) >= before
