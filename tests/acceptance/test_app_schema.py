"""The app's own tables: a handler that meets a table nobody created is a deployment error, reported
once; ``consumer-kit run`` stops with one line and exit 2, and the delivery is neither parked nor
counted against it. On PostgreSQL an app whose own migrations (``APP_MIGRATIONS``) are behind refuses
to start, as it does when consumer-kit's are."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.acceptance.cli_run import cli
from tests.conftest import TEST_HMAC_KEY, run_in_thread, truncate_all

APP = "tests.acceptance.missing_table_app"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "sqlite":
        return environment(f"sqlite:///{tmp_path}/app.db", monkeypatch)
    url = request.getfixturevalue("pg_url")
    run_in_thread(truncate_all(url))
    return environment(url, monkeypatch)


def environment(url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for name in [n for n in os.environ if n.startswith(("APP_MIGRATIONS", "LOG_LEVEL"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("IDEMPOTENCY_HMAC_KEY", TEST_HMAC_KEY)
    monkeypatch.setenv("SCHEDULE_POLL_SECONDS", "0.2")
    return url


def test_a_missing_table_stops_the_worker_with_one_line(database: str) -> None:
    ran = cli("run", APP + ":app", fresh=(APP,))
    assert ran.code == 2, ran.err
    assert len(ran.err_lines) == 1 and "Traceback" not in ran.err
    assert "table 'ck_never_created' does not exist" in ran.err and "APP_MIGRATIONS" in ran.err
    # Nothing was parked: once the table exists, the tick runs (it is still pending).
    assert cli("parked", "list").json() == []
    [schedule] = cli("schedule", "list", APP + ":app", fresh=(APP,)).json()
    assert schedule["last_state"] == "pending" and schedule["pending"]


@pytest.mark.postgres
def test_an_app_whose_own_migrations_are_behind_refuses_to_start(
        pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    environment(pg_url, monkeypatch)  # SQLite applies them at start instead
    versions = tmp_path / "versions"
    versions.mkdir()
    monkeypatch.setenv("APP_MIGRATIONS", str(versions))
    made = cli("db", "revision", "-m", "create the probe table")
    assert made.code == 0 and made.out.strip().endswith("_create_the_probe_table.py")
    ran = cli("run", APP + ":app", fresh=(APP,))
    assert ran.code == 2 and len(ran.err_lines) == 1
    assert "the app's tables are at revision" in ran.err and "run `consumer-kit db upgrade`" in ran.err
