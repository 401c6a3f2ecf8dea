"""``consumer-kit parked`` (and its old name ``dead-letters``) on SQLite and PostgreSQL, through the
command's entry function: list, groups, show, replay (in process, for a source without a queue) and
discard, with their filters and formats, naming a parked delivery by its id or its first digits, and
the app of a replay by its file with ``--app-dir``; the traceback of the handler's exception that
parked one; and the app's own table made by ``consumer-kit db upgrade`` from ``APP_MIGRATIONS`` before
any delivery arrives."""

from __future__ import annotations

import asyncio
import importlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import pytest
from sqlalchemy import select, text

from consumer_kit.delivery import Outcome
from tests.acceptance.cli_run import Ran, cli
from tests.conftest import TEST_HMAC_KEY

APP = "tests.acceptance.parked_app"
APP_FILE = "tests/acceptance/parked_app.py:app"  # the same module, named by its file (from the repository's root)
ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS = Path(__file__).with_name("parked_migrations")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def db(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """DATABASE_URL (and the app's settings) in the environment, as an operator's shell has them."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/parked.db"
    else:
        from tests.conftest import truncate_all

        url = request.getfixturevalue("pg_url")
        await truncate_all(url)
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("IDEMPOTENCY_HMAC_KEY", TEST_HMAC_KEY)
    monkeypatch.setenv("APP_MIGRATIONS", str(MIGRATIONS))
    monkeypatch.setenv("PARKED_TEST_FIXED_FILE", str(tmp_path / "fixed"))
    monkeypatch.delenv("PARKED_TEST_QUEUE", raising=False)
    monkeypatch.setenv("RETRY_BACKOFF_SECONDS", "0.001")
    yield url


async def run(*argv: str) -> Ran:
    return await asyncio.to_thread(cli, *argv, fresh=(APP,) if "replay" in argv else ())


def fresh_app() -> ModuleType:
    import sys

    sys.modules.pop(APP, None)
    return importlib.import_module(APP)


async def test_parked_commands_list_group_show_replay_and_discard(db: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    upgraded = await run("db", "upgrade")
    assert upgraded.code == 0, upgraded.err
    assert "app schema revision a1b2c3d4e5f6 (head a1b2c3d4e5f6, APP_MIGRATIONS)" in upgraded.out
    checked = await run("db", "check")
    assert checked.code == 0 and "app schema revision a1b2c3d4e5f6" in checked.out

    module = fresh_app()
    async with module.app.running():
        async with module.app.engine.begin() as conn:
            await conn.execute(text("DELETE FROM parked_test_effects"))  # the app's table exists already
        parked = await module.source.deliver(id="order-1", body=b'{"park": true}')
        assert parked.reason == "not_ready"
        assert (await module.source.deliver(id="order-2", body=b'{"n": 1}')).outcome is Outcome.PROCESSED
        conflict = await module.source.deliver(id="order-2", body=b'{"n": 2}')
        assert conflict.outcome is Outcome.CONFLICT
        assert (await module.source.deliver(id=None, body=b'{"n": 3}')).reason == "missing_stable_id"
        assert (await module.other.deliver(id="elsewhere-1", body=b'{"park": true}')).reason == "not_ready"

    listed = await run("parked", "list")
    assert listed.code == 0, listed.err
    letters = {row["reason"] + ":" + row["namespace"]: row for row in listed.json()}
    assert set(letters) == {"not_ready:parked-test", "conflict:parked-test", "missing_stable_id:parked-test",
                            "not_ready:parked-other"}
    assert all(row["body"] is None and row["replays"] == 0 for row in letters.values())
    assert "order-1" not in listed.out and "elsewhere-1" not in listed.out  # delivery ids are keys: never shown
    not_ready = letters["not_ready:parked-test"]
    assert len(not_ready["key_digest"]) == 16

    assert [r["reason"] for r in (await run("parked", "list", "--reason", "conflict")).json()] == ["conflict"]
    assert len((await run("parked", "list", "--namespace", "parked-other")).json()) == 1
    assert len((await run("parked", "list", "--source", "memory:parked-test")).json()) == 3
    assert len((await run("parked", "list", "--consumer", "parked_other")).json()) == 1
    assert len((await run("parked", "list", "--since", "1h")).json()) == 4
    assert (await run("parked", "list", "--since", "2999-01-01T00:00:00Z")).json() == []
    assert len((await run("dead-letters", "list", "--limit", "2")).json()) == 2  # the old name
    bodies = (await run("parked", "list", "--show-body", "--reason", "missing_stable_id")).json()
    assert bodies[0]["body"] == '{"n": 3}'
    table = await run("parked", "list", "--format", "table")
    assert table.out.splitlines()[0].split()[:4] == ["ID", "CREATED_AT", "SOURCE", "REASON"]
    assert len(table.out.splitlines()) == 5

    groups = (await run("parked", "groups")).json()
    assert {(g["reason"], g["source"], g["parked"]) for g in groups} == {
        ("not_ready", "memory:parked-test", 1), ("conflict", "memory:parked-test", 1),
        ("missing_stable_id", "memory:parked-test", 1), ("not_ready", "memory:parked-other", 1)}
    assert "REASON" in (await run("parked", "groups", "--format", "table")).out

    shown = (await run("parked", "show", not_ready["id"])).json()[0]
    assert shown["reason"] == "not_ready" and "body" not in shown and shown["history"] == []
    assert (await run("parked", "show", not_ready["id"], "--show-body")).json()[0]["body"] == '{"park": true}'
    parked_by = shown["traceback"]  # the handler's TerminalError, where it was raised
    assert parked_by.startswith("Traceback (most recent call last):") and 'parked_app.py", line' in parked_by
    assert parked_by.rstrip().endswith("consumer_kit.errors.TerminalError: the app is not ready for it yet")
    assert (await run("parked", "show", not_ready["id"][:8].upper())).json()[0] == shown  # its first digits do
    conflict_id = letters["conflict:parked-test"]["id"]
    assert (await run("parked", "show", conflict_id[:8])).json()[0]["traceback"] is None  # no exception parked it
    table = await run("parked", "show", not_ready["id"], "--format", "table")
    assert "key_digest: " in table.out and "\nreason: not_ready\ndetail: " in table.out
    assert "\ntraceback:\n  Traceback (most recent call last):\n" in table.out
    missing = await run("parked", "show", "nope")
    assert missing.code == 2 and missing.err_lines == ["consumer-kit: no parked delivery 'nope' (ids come from "
                                                       "`consumer-kit parked list`)"]

    # A dry run changes nothing and says what would happen; conflicts and unkeyed ones are not sent.
    dry = await run("parked", "replay", f"{APP}:app", "--dry-run", "--consumer", "parked_main")
    assert dry.code == 1  # some would be skipped
    actions = {row["reason"]: row for row in dry.json()}
    assert actions["not_ready"]["action"] == "would_run"
    assert actions["conflict"]["action"] == "skipped" and "--accept-new-body" in actions["conflict"]["detail"]
    assert actions["missing_stable_id"]["action"] == "skipped"
    assert "still cannot be keyed" in actions["missing_stable_id"]["detail"]
    assert (await run("parked", "show", not_ready["id"])).json()[0]["replays"] == 0

    # Replayed before the fix: parked again (a new parked row), under the same key. The app is named by its
    # file from another directory, which --app-dir says where to look in.
    with monkeypatch.context() as elsewhere:
        elsewhere.chdir(tmp_path)
        lost = await run("parked", "replay", APP_FILE, "--id", not_ready["id"][:8])
        assert lost.code == 2 and lost.err_lines == [
            f"consumer-kit: there is no file {APP_FILE.removesuffix(':app')} (from {APP_FILE})"]
        again = await run("parked", "replay", APP_FILE, "--app-dir", str(ROOT), "--id", not_ready["id"][:8],
                          "--actor", "ops@test")
    assert again.json()[0]["action"] == "parked" and again.json()[0]["key_digest"] == not_ready["key_digest"]
    assert again.code == 0
    (tmp_path / "fixed").touch()  # the operator deploys the fix, then replays what is not replayed yet
    replayed = await run("parked", "replay", f"{APP}:app", "--reason", "not_ready", "--namespace", "parked-test",
                         "--rate", "50", "--actor", "ops@test")
    assert [row["action"] for row in replayed.json()] == ["processed"], replayed.out
    assert replayed.code == 0 and "1 processed" in replayed.err
    # The same parked delivery once more: its key is done, so it is a duplicate and runs nothing.
    duplicate = await run("parked", "replay", f"{APP}:app", "--id", not_ready["id"], "--actor", "ops@test")
    assert duplicate.json()[0]["action"] == "duplicate"
    history = (await run("parked", "show", not_ready["id"])).json()[0]["history"]
    assert [(h["action"], h["actor"], h["outcome"]) for h in history] == [
        ("replay", "ops@test", "parked"), ("replay", "ops@test", "duplicate")]

    # A conflict runs only when the operator accepts its body under the key.
    refused = await run("parked", "replay", f"{APP}:app", "--id", conflict_id)
    assert refused.json()[0]["action"] == "skipped" and refused.code == 1
    accepted = await run("parked", "replay", f"{APP}:app", "--id", conflict_id, "--accept-new-body")
    assert accepted.json()[0]["action"] == "processed"
    async with module.app.running(sources=()):
        async with module.app.engine.connect() as conn:
            recorded = (await conn.execute(select(module.effects.c.body).order_by(module.effects.c.id))).scalars()
            assert list(recorded) == ['{"n": 1}', '{"park": true}', '{"n": 2}']  # each ran once

    # Discard needs a choice and --yes; it is recorded too.
    assert (await run("parked", "discard", "--yes")).code == 2
    unconfirmed = await run("parked", "discard", "--reason", "missing_stable_id")
    assert unconfirmed.code == 2 and "add --yes" in unconfirmed.err and len(unconfirmed.err_lines) == 1
    assert len((await run("parked", "list", "--reason", "missing_stable_id")).json()) == 1
    gone = await run("parked", "discard", "--reason", "missing_stable_id", "--yes", "--actor", "ops@test")
    assert gone.code == 0 and "discarded 1" in gone.err
    assert (await run("parked", "list", "--reason", "missing_stable_id")).json() == []
    left = (await run("parked", "list", "--limit", "50")).json()
    assert len(left) == 4  # the two not_ready of parked-test (the first and its re-park), the conflict, the other

    # The first digits of an id name it to discard too; digits that begin two ids or more name none.
    gone = await run("parked", "discard", "--id", letters["not_ready:parked-other"]["id"][:8], "--yes")
    assert gone.code == 0 and "discarded 1" in gone.err
    module = fresh_app()
    async with module.app.running(sources=()):
        for _ in range(16):  # 17 ids, 16 hex digits: at least two begin with the same one
            await module.app.dead_letters.park(consumer="parked_main", source="memory:parked-test",
                                               namespace="parked-test", version=1, key_digest=None,
                                               reason="missing_stable_id", body=b"{}", headers={}, attempts=1)
    ids = [row["id"] for row in (await run("parked", "list", "--limit", "50")).json()]
    digit, many = Counter(i[0] for i in ids).most_common(1)[0]
    for argv in (["discard", "--id", digit, "--yes"], ["replay", f"{APP}:app", "--id", ids[0], "--id", digit]):
        refused = await run("parked", *argv)
        assert refused.code == 2 and refused.err_lines == [
            f"consumer-kit: {many} parked deliveries have an id starting with '{digit}': give more of its digits "
            "(ids come from `consumer-kit parked list`)"]
    assert len((await run("parked", "list", "--limit", "50")).json()) == len(ids) == 19  # nothing went
