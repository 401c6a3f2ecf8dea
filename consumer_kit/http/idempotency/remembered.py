"""Finished keys an endpoint remembers in its process (:class:`Finished`), so that a repeat of one is
answered without a read.

A completed key's record does not change until the sweeper deletes it, and the sweeper deletes none
before its ``expires_at``. So a completed row read from the inbox (or one this process just wrote) may
answer repeats from memory until its expiry: the same answer the inbox would give. A row this process
wrote is remembered until the earliest expiry any path can have given it: its retention counted from
when the request began, less one lease (a completion on the two-transaction path may keep the
claim's expiry, which is at least that). Memory is bounded by a budget of bytes (the stored answers'
bodies, and a little for each entry), oldest first out.

Only what is final is kept: completed rows with a stored answer, each keyed by its digest (the
caller's scope and the client's key, under the HMAC key in use), with the replay built once, and the
raw forms of the requests known to be the one stored (:func:`~.keys.sent_form`: the same bytes as one
already found the same request). A repeat sent as the first was then needs no fingerprint: its JSON
body is not parsed and written again to be compared. A sweeper whose clock runs ahead of
this process's may delete a row a little before this process forgets it; a repeat in between gets the
stored answer again rather than ``idempotency_key_expired`` (or a second run), which is the answer it
would have had a moment earlier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from consumer_kit.http.idempotency.keys import Sent, sent_size
from consumer_kit.http.idempotency.replies import Reply, replay

ENTRY_BYTES = 256
"""What an entry costs besides its answer's body (the row's dict, the digest, the order)."""
SENT_KEPT = 2
"""How many raw forms of the same request an entry keeps (a client that re-serialises its body each
time has a new one each time: past these, its repeats are fingerprinted)."""


class Remembered:
    """One finished key: its completed row's answer, until when it may answer, and what it costs the
    budget. Kept in immutable parts (strings, numbers, tuples of them) that the cyclic garbage collector
    stops tracking: thousands of these entries would otherwise be walked by every full collection,
    which in a busy endpoint's process is a cost on every request. The row is made again when asked."""

    __slots__ = ("_reply", "attempts", "digest", "fingerprint", "result", "sent", "size", "until")

    def __init__(self, digest: str, fingerprint: str, attempts: int, result: Mapping[str, Any], until: datetime,
                 size: int) -> None:
        self.digest = digest
        self.fingerprint = fingerprint
        self.attempts = int(attempts)
        self.result = (int(result["status"]), tuple((str(n), str(v)) for n, v in result.get("headers", ())),
                       str(result.get("body", "")))
        self.until = until
        self.size = size
        self.sent: tuple[Sent, ...] = ()
        self._reply: Reply | None = None

    @property
    def row(self) -> dict[str, Any]:
        """The completed row, as the inbox would give it (what :func:`~consumer_kit.store.verdict` reads)."""
        status, headers, body = self.result
        return {"state": "completed", "key_digest": self.digest, "fingerprint": self.fingerprint,
                "attempts": self.attempts, "locked_until": None,
                "result": {"status": status, "headers": [list(h) for h in headers], "body": body}}

    def same(self, sent: Sent) -> bool:
        """Whether a request sent as ``sent`` is known to be the stored one."""
        return sent in self.sent

    def replay(self) -> Reply:
        """The stored answer, marked as a replay (built once)."""
        if self._reply is None:
            self._reply = replay(self.row["result"])
        return self._reply


class Finished:
    """Completed keys' rows, by digest, until each one's expiry, within ``budget`` bytes (0: none kept)."""

    __slots__ = ("_budget", "_rows", "_used")

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._rows: OrderedDict[str, Remembered] = OrderedDict()
        self._used = 0

    def recall(self, digests: Sequence[str], now: datetime) -> Remembered | None:
        """The remembered key of one of ``digests``, if not yet expired."""
        for digest in digests:
            found = self._rows.get(digest)
            if found is None:
                continue
            if found.until <= now:
                self._forget(digest)
                continue
            self._rows.move_to_end(digest)
            return found
        return None

    def row(self, digests: Sequence[str], now: datetime) -> Mapping[str, Any] | None:
        """The completed row of one of ``digests``, if remembered and not yet expired."""
        found = self.recall(digests, now)
        return found.row if found is not None else None

    def keep(self, row: Mapping[str, Any], until: datetime | None = None, *, sent: Sent | None = None) -> None:
        """Remember ``row`` (read from the inbox) until ``until`` (default its ``expires_at``), if it is
        completed with an answer and fits the budget; ``sent``: the request it is known to answer, as sent
        (:func:`~.keys.sent_form`)."""
        result = row.get("result")
        if row.get("state") != "completed" or not isinstance(result, dict):
            return
        self.written(row["key_digest"], row["fingerprint"], row["attempts"], result,
                     until=until or row["expires_at"], sent=sent)

    def written(self, digest: str, fingerprint: str, attempts: int, result: Mapping[str, Any], *, until: datetime,
                sent: Sent | None = None) -> None:
        """Remember a key this process completed with ``result`` (what a replay answers), as :meth:`keep`."""
        if self._budget <= 0:
            return
        size = ENTRY_BYTES + len(result.get("body", ""))
        if size > self._budget // 16:  # a few large answers must not push out every other
            return
        if digest in self._rows:
            self._forget(digest)
        kept = self._rows[digest] = Remembered(digest, fingerprint, attempts, result, until, size)
        self._used += size
        if sent is not None:
            self.learn(kept, sent)
        self._trim()

    def learn(self, kept: Remembered, sent: Sent) -> None:
        """``sent`` was found (by its fingerprint) to be the request ``kept`` answers."""
        if len(kept.sent) >= SENT_KEPT or sent in kept.sent:
            return
        size = sent_size(sent)
        if kept.size + size > self._budget // 16:
            return
        kept.sent = (*kept.sent, sent)
        kept.size += size
        self._used += size
        self._trim()

    def _trim(self) -> None:
        while self._used > self._budget:
            self._forget(next(iter(self._rows)))

    def _forget(self, digest: str) -> None:
        self._used -= self._rows.pop(digest).size

    def __len__(self) -> int:
        return len(self._rows)
