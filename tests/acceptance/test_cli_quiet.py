"""The command's stderr holds what the command says, not what a library says as it is imported.

Alembic announces each of its plugins at INFO as it is imported ("setup plugin
alembic.autogenerate.schemas", seven lines). The command sets its logging up first and each sub-command
imports the store (and so Alembic) when it runs, so every command that opens the database printed
those lines until consumer_kit.cli.main quieted that logger. Each case is a process of its own, as a
user runs the command: in the test's own process Alembic is imported already, and says nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "consumer_kit.cli"]
CASES = {
    "db check": ["db", "check"],
    "db check at DEBUG": ["--log-level", "DEBUG", "db", "check"],
    "db check in JSON": ["--log-format", "json", "db", "check"],
    "parked list": ["parked", "list"],
    "demo": ["demo"],
}


def run(args: list[str], database: Path) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("DATABASE_URL", "IDEMPOTENCY_", "LOG_"))}
    env.update(PYTHONPATH=str(ROOT), DATABASE_URL=f"sqlite:///{database}")
    return subprocess.run([*CLI, *args], cwd=database.parent, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", CASES.values(), ids=CASES.keys())
def test_no_alembic_line_on_stderr(args: list[str], tmp_path: Path) -> None:
    database = tmp_path / "consumer-kit.db"
    made = run(["db", "upgrade"], database)  # its own lines name each migration it ran: that is its work
    assert made.returncode == 0, made.stderr
    assert "Running upgrade" in made.stderr and "setup plugin" not in made.stderr, made.stderr
    done = run(args, database)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line for line in done.stderr.splitlines() if "alembic" in line] == [], done.stderr
