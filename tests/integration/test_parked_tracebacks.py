"""A handler's exception stays with the delivery it parks, on every path that parks one (the leased
path, the single-transaction path, a batch, a ``TerminalError``, too many deliveries after a failure):
its traceback, raw key redacted, in the parked row; and each failed attempt logs it once, at WARNING
while the delivery is retried and at ERROR when it is parked. On SQLite and PostgreSQL (asyncpg and
psycopg). A traceback is kept to its last :data:`TRACEBACK_LIMIT_BYTES`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from consumer_kit import Batch, ConsumerApp, Context, Outcome, TerminalError
from consumer_kit.store.dead_letters import TRACEBACK_LIMIT_BYTES, DeadLetter, bounded
from consumer_kit.testing import InMemorySource
from tests.conftest import make_settings

KEY_ID = "order-5c1e7a9b"
RAW_KEY = f"orders:v1:{KEY_ID}"
HERE = Path(__file__).resolve()


def frame(marker: str) -> str:
    """How a traceback names the line of this file that ends with ``# <marker>``."""
    number = next(n for n, line in enumerate(HERE.read_text().splitlines(), 1) if line.endswith(f"# {marker}"))
    return f'File "{HERE}", line {number}, in handle'


FRAME = frame("FAILS" + " HERE")

PATHS: dict[str, dict[str, Any]] = {
    "leased": {},
    "single": {"single_transaction": True},
    "batch": {"single_transaction": True, "batch": Batch(max_size=8, max_wait_ms=20)},
}


def failing_app(database_url: str, path: str, **overrides: Any) -> tuple[ConsumerApp, InMemorySource]:
    """An app whose handler (on ``path``) fails with ``KeyError`` on a body ``{"bad": ...}``, the key in
    a local and in the message; ``{"terminal": ...}`` parks itself with ``TerminalError``."""
    app = ConsumerApp(make_settings(database_url, **{"retry_attempts": 2, "max_deliveries": 2, **overrides}))
    source = InMemorySource(namespace="orders", version=1)

    @app.handler(source, name=f"orders_{path}", **PATHS[path])
    async def handle(ctx: Context) -> None:
        order, body = str(ctx.key), ctx.delivery.json()
        if "terminal" in body:
            raise TerminalError(f"order {order} can never be charged", reason="uncharged")  # PARKS HERE
        if "bad" in body:
            raise KeyError(f"amount (order {order})") if body["bad"] is True else ValueError(body["bad"])  # FAILS HERE

    return app, source


def assert_redacted_traceback(text: str | None, last_line: str, line: str = FRAME) -> None:
    assert text is not None and text.startswith("Traceback (most recent call last):")
    assert line in text and "await spec.func(ctx)" in text  # the handler's line, and the stack that called it
    assert text.rstrip().endswith(last_line)
    assert RAW_KEY not in text and KEY_ID not in text


def traced(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """Each pipeline record that carries a traceback: its level and its first line (up to the detail)."""
    return [(r.levelname, r.getMessage().split(" (")[0]) for r in caplog.records
            if r.name == "consumer_kit.pipeline" and "\nTraceback (most recent call last):" in r.getMessage()]


async def parked_letter(app: ConsumerApp) -> DeadLetter:
    [listed] = await app.dead_letters.list()
    letter = await app.dead_letters.get(listed.id)
    assert letter is not None
    return letter


@pytest.mark.parametrize("path", list(PATHS))
async def test_every_path_parks_with_the_last_attempts_traceback(
        database_url: str, path: str, caplog: pytest.LogCaptureFixture) -> None:
    app, source = failing_app(database_url, path)
    caplog.set_level(logging.INFO, logger="consumer_kit.pipeline")
    async with app.running():
        bad = source.deliver(id=KEY_ID, body=b'{"bad": true}')
        if path == "batch":  # fails in a batch with others, which commit; then runs alone
            first, *fine = await asyncio.gather(bad, *(source.deliver(id=f"fine-{n}", body=b"{}") for n in range(3)))
            assert {r.outcome for r in fine} == {Outcome.PROCESSED}
        else:
            first = await bad
        assert (first.outcome, first.reason) == (Outcome.RETRY, "handler_failed")
        second = await source.deliver(id=KEY_ID, body=b'{"bad": true}', attempt=2)
        assert (second.outcome, second.reason) == (Outcome.DEAD_LETTERED, "retries_exhausted")
        letter = await parked_letter(app)
    assert_redacted_traceback(letter.traceback, "KeyError: 'amount (order <key>)'")
    assert letter.detail == "KeyError: 'amount (order <key>)'"
    expected = [("WARNING", "handler failed, attempt 1; retrying in process"),
                ("WARNING", "handler failed; delivery 1 of 2 will be retried"),
                ("WARNING", "handler failed, attempt 1; retrying in process"),
                ("ERROR", "delivery parked: retries_exhausted")]
    if path == "batch":
        expected.insert(0, ("WARNING", "handler failed in a batch"))
    assert traced(caplog) == expected
    for record in caplog.records:
        if "Traceback" in record.getMessage():
            assert_redacted_traceback(record.getMessage().split("\n", 1)[1], "KeyError: 'amount (order <key>)'")


async def test_a_terminal_error_parks_with_its_traceback_and_a_conflict_without_one(
        database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    app, source = failing_app(database_url, "leased")
    caplog.set_level(logging.INFO, logger="consumer_kit.pipeline")
    async with app.running():
        terminal = await source.deliver(id=KEY_ID, body=b'{"terminal": true}')
        assert (terminal.outcome, terminal.reason) == (Outcome.DEAD_LETTERED, "uncharged")
        letter = await parked_letter(app)
        assert_redacted_traceback(letter.traceback, "consumer_kit.errors.TerminalError: order <key> can never be "
                                  "charged", frame("PARKS" + " HERE"))
        assert traced(caplog) == [("ERROR", "delivery parked: uncharged")]  # parked at once: one attempt

        assert (await source.deliver(id="order-2", body=b"{}")).outcome is Outcome.PROCESSED
        conflict = await source.deliver(id="order-2", body=b'{"other": 1}')  # no exception parked it
        assert conflict.outcome is Outcome.CONFLICT
        [parked] = [p for p in await app.dead_letters.list() if p.reason == "conflict"]
        assert (await app.dead_letters.get(parked.id)) == parked and parked.traceback is None


@pytest.mark.parametrize("path", ["leased", "single"])
async def test_a_long_traceback_is_kept_to_its_end(database_url: str, path: str) -> None:
    long = "\n".join(f"line {n:05d} of a very long message" for n in range(5000))  # ~165 KB
    app, source = failing_app(database_url, path, max_deliveries=1)
    async with app.running():
        parked = await source.deliver(id=KEY_ID, body=f'{{"bad": "{long}"}}'.replace("\n", "\\n").encode())
        assert parked.reason == "retries_exhausted"
        letter = await parked_letter(app)
    kept = letter.traceback
    assert kept is not None and kept.endswith("line 04999 of a very long message\n")
    assert len(kept.encode()) <= TRACEBACK_LIMIT_BYTES
    cut, rest = kept.split("\n", 1)
    assert cut.startswith("[the traceback's first ") and cut.endswith(" bytes were cut]")
    assert rest.startswith("line ")  # from the start of a line
    assert int(cut.split()[3]) + len(rest.encode()) > 5000 * 33  # what was cut and what was kept: all of it
    assert FRAME not in kept  # the frames came before the message: cut, as the note says


def test_bounded_keeps_whole_characters_and_lines_and_bounds_once() -> None:
    short = "Traceback (most recent call last):\n  ...\nKeyError: 'x'\n"
    assert bounded(short) == short
    text = "é" * TRACEBACK_LIMIT_BYTES + "\nend\n"  # two bytes a character: the cut falls inside the first line
    kept = bounded(text)
    assert kept == f"[the traceback's first {len(text.encode()) - 4} bytes were cut]\nend\n"
    odd = "é" * TRACEBACK_LIMIT_BYTES + "x"  # one line; the cut falls between a character's two bytes
    note, tail = bounded(odd).split("\n", 1)
    assert tail.endswith("éx") and set(tail) == {"é", "x"} and len(bounded(odd).encode()) <= TRACEBACK_LIMIT_BYTES
    assert note == f"[the traceback's first {len(odd.encode()) - len(tail.encode())} bytes were cut]"
    assert bounded(bounded(odd)) == bounded(odd)
