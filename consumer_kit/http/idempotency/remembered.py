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
caller's scope and the client's key, under the HMAC key in use). A sweeper whose clock runs ahead of
this process's may delete a row a little before this process forgets it; a repeat in between gets the
stored answer again rather than ``idempotency_key_expired`` (or a second run), which is the answer it
would have had a moment earlier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

ENTRY_BYTES = 256
"""What an entry costs besides its answer's body (the row's dict, the digest, the order)."""


class Finished:
    """Completed keys' rows, by digest, until each one's expiry, within ``budget`` bytes (0: none kept)."""

    __slots__ = ("_budget", "_rows", "_used")

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._rows: OrderedDict[str, tuple[Mapping[str, Any], datetime, int]] = OrderedDict()
        self._used = 0

    def row(self, digests: Sequence[str], now: datetime) -> Mapping[str, Any] | None:
        """The completed row of one of ``digests``, if remembered and not yet expired."""
        for digest in digests:
            found = self._rows.get(digest)
            if found is None:
                continue
            row, until, _size = found
            if until <= now:
                self._forget(digest)
                continue
            self._rows.move_to_end(digest)
            return row
        return None

    def keep(self, row: Mapping[str, Any], until: datetime | None = None) -> None:
        """Remember ``row`` (read from the inbox, or as written) until ``until`` (default its
        ``expires_at``), if it is completed with an answer and fits the budget."""
        result = row.get("result")
        if row.get("state") != "completed" or not isinstance(result, dict) or self._budget <= 0:
            return
        size = ENTRY_BYTES + len(result.get("body", ""))
        if size > self._budget // 16:  # a few large answers must not push out every other
            return
        digest = row["key_digest"]
        if digest in self._rows:
            self._forget(digest)
        self._rows[digest] = (row, until or row["expires_at"], size)
        self._used += size
        while self._used > self._budget:
            self._forget(next(iter(self._rows)))

    def _forget(self, digest: str) -> None:
        _row, _until, size = self._rows.pop(digest)
        self._used -= size

    def __len__(self) -> int:
        return len(self._rows)
