"""An idempotent endpoint's memory of finished keys (``consumer_kit.http.idempotency.remembered``): only
completed rows with an answer, each until its expiry, within a budget of bytes."""

from __future__ import annotations

import gc
from datetime import UTC, datetime, timedelta
from typing import Any

from consumer_kit.http.idempotency.keys import sent_form
from consumer_kit.http.idempotency.remembered import ENTRY_BYTES, SENT_KEPT, Finished

NOW = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)


def row(digest: str, *, state: str = "completed", body: str = "e30=", expires: float = 60) -> dict[str, Any]:
    return {"key_digest": digest, "state": state, "fingerprint": "f", "attempts": 1, "locked_until": None,
            "result": {"status": 201, "headers": [], "body": body}, "expires_at": NOW + timedelta(seconds=expires)}


def test_a_completed_row_is_remembered_until_its_expiry() -> None:
    finished = Finished(1 << 20)
    finished.keep(row("a"))
    kept = row("a")
    del kept["expires_at"]
    assert finished.row(["x", "a"], NOW) == kept  # under either HMAC key's digest: the row, as read
    assert finished.row(["a"], NOW + timedelta(seconds=59)) is not None
    assert finished.row(["a"], NOW + timedelta(seconds=60)) is None  # expired: forgotten
    assert len(finished) == 0
    finished.keep(row("b"), until=NOW + timedelta(seconds=5))  # a row as written: the earliest expiry it can have
    assert finished.row(["b"], NOW + timedelta(seconds=5)) is None


def test_only_final_answers_are_remembered() -> None:
    finished = Finished(1 << 20)
    for state in ("started", "dead"):
        finished.keep(row(state, state=state))
    no_answer = row("c")
    no_answer["result"] = None
    finished.keep(no_answer)
    assert len(finished) == 0
    off = Finished(0)  # a budget of 0 keeps nothing
    off.keep(row("d"))
    assert off.row(["d"], NOW) is None


def test_the_budget_keeps_the_most_recently_used() -> None:
    entry = ENTRY_BYTES + 4
    finished = Finished(entry * 20)
    for name in "abcdefghijklmnopqrst":
        finished.keep(row(name))
    assert len(finished) == 20
    assert finished.row(["a"], NOW) is not None  # used: now the newest
    finished.keep(row("u"))
    assert finished.row(["b"], NOW) is None and finished.row(["a"], NOW) is not None and len(finished) == 20
    finished.keep(row("big", body="x" * (entry * 20 // 16)))  # over a sixteenth of the budget: not kept
    assert finished.row(["big"], NOW) is None


def test_the_forms_a_request_was_sent_in_are_kept_within_the_budget() -> None:
    finished = Finished(1 << 20)
    first = sent_form("POST", "/p", b"", b'{"a": 1}', b"application/json")
    finished.keep(row("a"), sent=first)
    kept = finished.recall(["a"], NOW)
    assert kept is not None and kept.same(first)
    assert not kept.same(sent_form("POST", "/p", b"", b'{"a":1}', b"application/json"))  # other bytes: not known
    assert not kept.same(sent_form("POST", "/p", b"", b'{"a": 1}', b"text/plain"))  # nor another content type
    forms = [sent_form("POST", "/p", b"", b'{"a":  1}' + b" " * n, b"application/json") for n in range(SENT_KEPT + 2)]
    for form in forms:
        finished.learn(kept, form)
    assert sum(kept.same(form) for form in forms) == SENT_KEPT - 1  # at most SENT_KEPT forms, the first among them
    assert kept.replay() is kept.replay()  # built once
    assert kept.replay().headers[-1] == (b"idempotency-replayed", b"true")

    small = Finished(ENTRY_BYTES * 16 + 64)  # an entry may take a sixteenth of the budget: its body and forms
    small.keep(row("b"))
    entry = small.recall(["b"], NOW)
    assert entry is not None
    small.learn(entry, sent_form("POST", "/p", b"", b"x" * 1024, None))  # too large for its share: not kept
    assert entry.sent == ()


def test_an_entry_is_not_walked_by_the_garbage_collector() -> None:
    """What an entry keeps is immutable: strings, numbers and tuples of them, untracked after one
    collection a level of nesting, so that a full memory does not make every full collection longer."""
    finished = Finished(1 << 20)
    finished.keep(row("a", body="eyJpZCI6IDF9"), sent=sent_form("POST", "/p", b"", b'{"id": 1}', b"application/json",
                                                                 [(b"x-tenant", b"t1")]))
    kept = finished.recall(["a"], NOW)
    assert kept is not None
    for _ in range(3):  # a tuple is untracked once what it holds is: one level a collection
        gc.collect()
    parts = [getattr(kept, name) for name in type(kept).__slots__ if name != "_reply"]
    assert [part for part in parts if gc.is_tracked(part)] == []
