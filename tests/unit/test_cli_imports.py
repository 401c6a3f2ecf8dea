"""``import consumer_kit`` and ``consumer-kit --help`` load none of what the commands run: no
SQLAlchemy, store, coordinator, app, uvicorn, Starlette or pydantic-settings; nor does the help of
``parked`` and ``schedule``, whose modules load only themselves. Checked by the modules a fresh
interpreter holds afterwards (deterministic, unlike a timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("sqlalchemy", "alembic", "aiosqlite", "asyncpg", "httpx", "uvicorn", "starlette", "pydantic_settings",
         "prometheus_client", "aio_pika", "consumer_kit.app", "consumer_kit.store", "consumer_kit.coordinator",
         "consumer_kit.pipeline", "consumer_kit.cli.parked", "consumer_kit.cli.schedules")
# What a command's own --help may also load: Settings (pydantic-settings), to list its variables.
SETTINGS = ("pydantic_settings", "pydantic", "consumer_kit.settings")

PROBE = """
import json, sys
{code}
print(json.dumps(sorted(sys.modules)))
"""
RUN_CLI = """
from consumer_kit.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
"""


def loaded(code: str, tmp_path: Path) -> set[str]:
    """The modules a fresh interpreter holds after ``code`` (run in an empty directory)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def heavy(modules: set[str], allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)
                  and not any(m == a or m.startswith(a + ".") for a in allowed))


def test_the_probe_sees_what_is_imported(tmp_path: Path) -> None:
    # The check can fail: a module that imports the app shows it.
    assert "consumer_kit.app" in heavy(loaded("from consumer_kit import ConsumerApp", tmp_path))


def test_import_consumer_kit_loads_none_of_it(tmp_path: Path) -> None:
    modules = loaded("import consumer_kit; consumer_kit.ConfigurationError; consumer_kit.OperationKey", tmp_path)
    assert "consumer_kit" in modules and heavy(modules) == []
    assert "consumer_kit.settings" not in modules


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--version"]])
def test_the_top_level_help_loads_none_of_it(tmp_path: Path, argv: list[str]) -> None:
    modules = loaded(RUN_CLI.format(argv=argv), tmp_path)
    assert "consumer_kit.cli.main" in modules
    assert heavy(modules) == []
    assert "consumer_kit.settings" not in modules and "asyncio" not in modules


@pytest.mark.parametrize("argv", [["run", "--help"], ["db", "upgrade", "--help"], ["coordinator", "serve", "--help"],
                                  ["outbox", "relay", "--help"], ["demo", "--help"]],
                         ids=lambda argv: " ".join(argv[:-1]))
def test_a_command_help_loads_settings_alone(tmp_path: Path, argv: list[str]) -> None:
    modules = loaded(RUN_CLI.format(argv=argv), tmp_path)
    assert "consumer_kit.settings" in modules  # its variables come from Settings' fields
    assert heavy(modules, allowed=SETTINGS) == []


@pytest.mark.parametrize(("argv", "own"), [(["parked", "--help"], "parked"), (["dead-letters", "--help"], "parked"),
                                           (["schedule", "--help"], "schedules")],
                         ids=lambda value: " ".join(value[:-1]) if isinstance(value, list) else None)
def test_the_parked_and_schedule_groups_help_load_their_module_alone(tmp_path: Path, argv: list[str],
                                                                     own: str) -> None:
    modules = loaded(RUN_CLI.format(argv=argv), tmp_path)
    assert f"consumer_kit.cli.{own}" in modules  # the command was registered by its module, not LAZY's line
    assert heavy(modules, allowed=(f"consumer_kit.cli.{own}",)) == []
    assert "consumer_kit.settings" not in modules and "asyncio" not in modules  # a group reads no setting


@pytest.mark.parametrize("argv", [["parked", "list", "--help"], ["parked", "groups", "--help"],
                                  ["parked", "show", "--help"], ["parked", "replay", "--help"],
                                  ["dead-letters", "discard", "--help"], ["schedule", "run", "--help"],
                                  ["schedule", "list", "--help"]],
                         ids=lambda argv: " ".join(argv[:-1]))
def test_a_parked_or_schedule_command_help_loads_settings_alone(tmp_path: Path, argv: list[str]) -> None:
    own = "consumer_kit.cli.parked" if argv[0] in ("parked", "dead-letters") else "consumer_kit.cli.schedules"
    modules = loaded(RUN_CLI.format(argv=argv), tmp_path)
    assert own in modules and "consumer_kit.settings" in modules
    assert heavy(modules, allowed=(*SETTINGS, own)) == []  # no SQLAlchemy, store, app or replayer


@pytest.mark.parametrize("argv", [["parked", "list", "--limit", "0"], ["schedule", "run", "m:app"]],
                         ids=["parked list", "schedule run"])
def test_a_usage_error_of_parked_or_schedule_loads_none_of_it(tmp_path: Path, argv: list[str]) -> None:
    modules = loaded(RUN_CLI.format(argv=argv), tmp_path)
    own = "consumer_kit.cli.parked" if argv[0] == "parked" else "consumer_kit.cli.schedules"
    assert own in modules and heavy(modules, allowed=(own,)) == []
    assert "consumer_kit.settings" not in modules
