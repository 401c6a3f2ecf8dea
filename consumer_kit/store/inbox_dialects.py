"""The inbox's operations whose statements differ by database and by layout: one strategy each
(:class:`Postgres`, :class:`Sqlite`, :class:`Partitioned`), chosen once by :class:`~consumer_kit.store.inbox.Inbox`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from consumer_kit.errors import ConfigurationError
from consumer_kit.store import partitions, sql
from consumer_kit.store.claims import BatchKey, Claim, ClaimStatus, claimable, verdict
from consumer_kit.store.executor import Executor, Row, rerun_on_conflict
from consumer_kit.store.receipts import Creation, Ending


@dataclass(frozen=True, slots=True)
class Statements:
    """The statements :class:`~consumer_kit.store.inbox.Inbox` runs itself whose text depends on the layout
    (each takes ``now`` and ``tombstones`` besides its own parameters, whether it uses them or not): the
    partitioned inbox's look past tombstone rows, and change a key's row only while it is not past its time."""

    lookup: sql.Statement
    lookup_many: sql.Statement
    tombstone: sql.Statement
    renew: sql.Statement
    forget_tombstone: sql.Statement
    lock_and_look: sql.Statement
    complete: sql.Statement
    complete_with_result: sql.Statement
    complete_ending: sql.Statement
    release: sql.Statement
    withdraw: sql.Statement
    mark_dead: sql.Statement
    mark_dead_unleased: sql.Statement
    finish_started: sql.Statement
    finish_started_with_result: sql.Statement
    reopen_parked: sql.Statement
    reopen_with_fingerprint: sql.Statement


PLAIN = Statements(
    sql.LOOKUP, sql.LOOKUP_MANY, sql.TOMBSTONE, sql.RENEW, sql.FORGET_TOMBSTONE, sql.LOCK_AND_LOOK, sql.COMPLETE,
    sql.COMPLETE_WITH_RESULT, sql.COMPLETE_ENDING_SESSION, sql.RELEASE, sql.WITHDRAW, sql.MARK_DEAD,
    sql.MARK_DEAD_UNLEASED, sql.FINISH_STARTED, sql.FINISH_STARTED_WITH_RESULT, sql.REOPEN_PARKED,
    sql.REOPEN_WITH_FINGERPRINT)
PARTITIONED = Statements(
    partitions.LOOKUP, partitions.LOOKUP_MANY, partitions.TOMBSTONE, partitions.RENEW, partitions.FORGET_TOMBSTONE,
    partitions.LOCK_AND_LOOK, partitions.COMPLETE, partitions.COMPLETE_WITH_RESULT, partitions.COMPLETE_ENDING_SESSION,
    partitions.RELEASE, partitions.WITHDRAW, partitions.MARK_DEAD, partitions.MARK_DEAD_UNLEASED,
    partitions.FINISH_STARTED, partitions.FINISH_STARTED_WITH_RESULT, partitions.REOPEN_PARKED,
    partitions.REOPEN_WITH_FINGERPRINT)
STALE_TRIES = 50
"""How many times a partitioned statement runs while the inbox rotates under it (once is the rule: see
:mod:`~consumer_kit.store.partitions`)."""


def _acquired(digest: str, attempts: int, params: Mapping[str, Any], carried: Row | None, *,
              took_over: bool) -> Claim:
    return Claim(ClaimStatus.ACQUIRED, digest, int(attempts), params["lease_token"], params["locked_until"],
                 carried=carried, took_over=took_over)


def _claimed(row: Row, digest: str, fingerprint: str, params: Mapping[str, Any], carried: Row | None) -> Claim | None:
    """What a one-statement claim's row says: the lease taken, a tombstone, or what holds the key; ``None``
    when another claim got there after the statement's snapshot."""
    if row["claimed"] is not None:
        return _acquired(digest, row["claimed"], params, carried, took_over=row["inbox_locked_until"] is not None)
    if row["tombstoned"]:
        return Claim(ClaimStatus.SWEPT, digest, 0)
    if row["inbox_state"] is not None:
        seen = {name: row[f"inbox_{name}"] for name in ("state", "fingerprint", "locked_until", "attempts", "result")}
        if not claimable(seen, fingerprint, params["now"]):
            return verdict({**seen, "key_digest": digest}, fingerprint)
    return None


class Dialect(Protocol):
    """The inbox operations whose statements differ by database: one strategy each, chosen once."""

    reads_first: bool
    """Whether a claim reads the row (and its tombstone) before its statement, which does not."""
    sql: Statements
    """The statements the inbox runs itself that differ by layout."""

    async def claim(self, ex: Executor, digest: str, fingerprint: str, params: Mapping[str, Any],
                    creation: Creation | None, *, expired: bool) -> Claim | None:
        """The claim's statement: the lease taken, or what holds the key; ``None`` when another claim
        got there after the statement's snapshot (the caller reads the committed row)."""

    async def insert_completed(self, ex: Executor, consumer: str, keys: Sequence[BatchKey],
                               params: Mapping[str, Any]) -> set[str]:
        """A batch's new keys written completed; the digests written."""

    async def insert_one(self, ex: Executor, params: Mapping[str, Any]) -> bool:
        """One new key's row written completed (with ``result`` when ``params`` has one: an endpoint's
        response), in ``ex``'s transaction; ``False``: the key has a row (or a tombstone)."""

    async def drop_lapsed(self, ex: Executor, params: Mapping[str, Any]) -> bool:
        """Delete the key's started row if it is past its time, without a live lease, and tombstones are
        off: what the plain table's sweeper deletes, and what nothing takes over on the partitioned inbox;
        whether it did (the key is then a new one)."""

    async def record_failure(self, ex: Executor, params: Mapping[str, Any]) -> int | None:
        """A failed single-transaction attempt counted on the key's started row, or that row made; the
        attempts so far, ``None`` when the key's row is not started (finished or parked meanwhile)."""

    async def rows(self, ex: Executor, params: Mapping[str, Any]) -> dict[str, Row]:
        """The rows of ``params["key_digests"]``, by digest."""

    async def complete_ending(self, ex: Executor, params: Mapping[str, Any], ending: Ending) -> bool:
        """The completion that also ends the coordinator's session (``Ending.ended``)."""

    async def sweep(self, ex: Executor, params: Mapping[str, Any]) -> tuple[int, datetime | None]:
        """A batch swept in ``ex``'s transaction: rows gone, their newest expiry (``None``: start as before)."""

    async def sweep_tombstones(self, ex: Executor, params: Mapping[str, Any]) -> tuple[int, datetime | None]:
        """One batch of expired tombstones deleted, as :meth:`sweep`."""


class _PlainKeys:
    """A key's row on the plain table, which keeps it unique by itself (its primary key)."""

    async def insert_one(self, ex: Executor, params: Mapping[str, Any]) -> bool:
        statement = sql.INSERT_COMPLETED_WITH_RESULT if "result" in params else sql.INSERT_COMPLETED
        return await ex.execute(statement, params) == 1

    async def drop_lapsed(self, ex: Executor, params: Mapping[str, Any]) -> bool:
        return False  # the sweeper deletes such a row, or a claim takes it over

    async def record_failure(self, ex: Executor, params: Mapping[str, Any]) -> int | None:
        row = await ex.fetch_one(sql.RECORD_FAILURE, params)
        return None if row is None else int(row["attempts"])


class Postgres(_PlainKeys):
    """One statement an operation: the claim tests the row and its tombstone itself, a batch is
    written and read in one statement each, a session's creation and ending ride on the claim and the
    completion (data-modifying CTEs)."""

    reads_first = False
    sql = PLAIN

    async def claim(self, ex: Executor, digest: str, fingerprint: str, params: Mapping[str, Any],
                    creation: Creation | None, *, expired: bool) -> Claim | None:
        if creation is not None:
            row = await rerun_on_conflict(ex.fetch_one, sql.CLAIM_CREATING_SESSION, {**params, **creation.params})
        else:
            row = await ex.fetch_one(sql.CLAIM, params)
        assert row is not None
        return _claimed(row, digest, fingerprint, params, row if creation is not None else None)

    async def insert_completed(self, ex: Executor, consumer: str, keys: Sequence[BatchKey],
                               params: Mapping[str, Any]) -> set[str]:
        return {row["key_digest"] for row in await ex.fetch_all(sql.CLAIM_BATCH, {
            **params, "consumer": consumer, "key_digests": [k.digest for k in keys],
            "namespaces": [k.namespace for k in keys], "versions": [k.version for k in keys],
            "fingerprints": [k.fingerprint for k in keys]})}

    async def rows(self, ex: Executor, params: Mapping[str, Any]) -> dict[str, Row]:
        return {row["key_digest"]: row for row in await ex.fetch_all(self.sql.lookup_many, params)}

    async def complete_ending(self, ex: Executor, params: Mapping[str, Any], ending: Ending) -> bool:
        row = await ex.fetch_one(self.sql.complete_ending, {**params, **ending.params})
        assert row is not None
        ending.ended = bool(row["ended"])
        return bool(row["completed"] == 1)

    async def sweep(self, ex: Executor, params: Mapping[str, Any]) -> tuple[int, datetime | None]:
        (row,) = await ex.fetch_all(sql.SWEEP_INBOX, params)  # an aggregate: always one row
        return int(row["swept"]), row["newest"]

    async def sweep_tombstones(self, ex: Executor, params: Mapping[str, Any]) -> tuple[int, datetime | None]:
        (row,) = await ex.fetch_all(sql.SWEEP_TOMBSTONES, params)
        return int(row["swept"]), row["newest"]


class Sqlite(_PlainKeys):
    """One writer, no data-modifying CTEs: the claim reads first and then takes the row; a batch is
    a statement a key in one transaction; a sweep selects, keeps tombstones and deletes."""

    reads_first = True
    sql = PLAIN

    async def claim(self, ex: Executor, digest: str, fingerprint: str, params: Mapping[str, Any],
                    creation: Creation | None, *, expired: bool) -> Claim | None:
        row = await ex.fetch_one(sql.CLAIM_SQLITE, params)
        return None if row is None else _acquired(digest, row["attempts"], params, None, took_over=expired)

    async def insert_completed(self, ex: Executor, consumer: str, keys: Sequence[BatchKey],
                               params: Mapping[str, Any]) -> set[str]:
        inserted = set()
        for k in keys:
            if await ex.execute(sql.INSERT_COMPLETED, {
                    **params, "consumer": consumer, "key_digest": k.digest, "namespace": k.namespace,
                    "version": k.version, "fingerprint": k.fingerprint}) == 1:
                inserted.add(k.digest)
        return inserted

    async def rows(self, ex: Executor, params: Mapping[str, Any]) -> dict[str, Row]:
        found = {}
        for digest in params["key_digests"]:
            row = await ex.fetch_one(sql.LOOKUP, {"consumer": params["consumer"], "key_digest": digest})
            if row is not None:
                found[digest] = row
        return found

    async def complete_ending(self, ex: Executor, params: Mapping[str, Any], ending: Ending) -> bool:
        return await ex.execute(sql.COMPLETE, params) == 1  # the session is ended after the commit

    async def sweep(self, ex: Executor, params: Mapping[str, Any]) -> tuple[int, datetime | None]:
        rows = await ex.fetch_all(sql.SWEEP_INBOX, params)
        keys = [{"consumer": row["consumer"], "key_digest": row["key_digest"]} for row in rows]
        if params["tombstones"]:
            await ex.execute_many(sql.TOMBSTONE_SQLITE, [{**k, **params} for k in keys])
        await ex.execute_many(sql.DELETE_SWEPT_SQLITE, keys)
        return len(keys), None  # SQLite frees deleted rows at once: the next batch may start over

    async def sweep_tombstones(self, ex: Executor, params: Mapping[str, Any]) -> tuple[int, datetime | None]:
        return await ex.execute(sql.SWEEP_TOMBSTONES_SQLITE, params), None


class Partitioned(Postgres):
    """The partitioned inbox (:mod:`consumer_kit.store.partitions`): every statement that inserts a key
    inserts it only where no partition has it, under the rotation's check (run again when it says ``stale``);
    a tombstone is an expired row until its partition leaves, and no statement changes such a row as if it
    were the key's record; retention is :func:`~consumer_kit.store.partitions.maintain`, not row deletes."""

    sql = PARTITIONED

    async def claim(self, ex: Executor, digest: str, fingerprint: str, params: Mapping[str, Any],
                    creation: Creation | None, *, expired: bool) -> Claim | None:
        if creation is not None:
            raise ConfigurationError(NOT_YET.format(what="a coordinator session carried by the claim"))
        # Run again for a deadlock or a row a leaving partition moved (SQLSTATE 40P01, 40001).
        row = await rerun_on_conflict(_guarded(ex), partitions.CLAIM, params)
        claimed = _claimed(row, digest, fingerprint, params, None)
        if claimed is not None or row["inbox_state"] is None or row["tombstoned"]:
            return claimed
        # A started row of this request, its lease free: taken over where it is (or by another claim first).
        taken = await rerun_on_conflict(ex.fetch_one, partitions.TAKEOVER, params)
        return None if taken is None else _acquired(digest, taken["attempts"], params, None,
                                                    took_over=row["inbox_locked_until"] is not None)

    async def insert_one(self, ex: Executor, params: Mapping[str, Any]) -> bool:
        return int((await _guarded(ex)(partitions.INSERT_COMPLETED, {"result": None, **params}))["inserted"]) == 1

    async def drop_lapsed(self, ex: Executor, params: Mapping[str, Any]) -> bool:
        return not params["tombstones"] and await ex.execute(partitions.DROP_LAPSED, params) == 1

    async def record_failure(self, ex: Executor, params: Mapping[str, Any]) -> int | None:
        attempts = (await _guarded(ex)(partitions.RECORD_FAILURE, params))["attempts"]
        return None if attempts is None else int(attempts)

    async def insert_completed(self, ex: Executor, consumer: str, keys: Sequence[BatchKey],
                               params: Mapping[str, Any]) -> set[str]:
        row = await _guarded(ex)(partitions.CLAIM_BATCH, {
            **params, "consumer": consumer, "key_digests": [k.digest for k in keys],
            "namespaces": [k.namespace for k in keys], "versions": [k.version for k in keys],
            "fingerprints": [k.fingerprint for k in keys]})
        return set(row["inserted"])

    async def sweep(self, ex: Executor, params: Mapping[str, Any]) -> tuple[int, datetime | None]:
        raise AssertionError("the partitioned inbox is swept by partitions.maintain")


def _guarded(ex: Executor) -> Callable[[sql.Statement, Mapping[str, Any]], Awaitable[Row]]:
    """A partitioned statement's run: again while it says ``stale`` (it wrote nothing: the inbox rotated
    after its snapshot)."""

    async def run(statement: sql.Statement, params: Mapping[str, Any]) -> Row:
        for _ in range(STALE_TRIES):
            row = await ex.fetch_one(statement, params)
            assert row is not None  # an aggregate: always one row
            if not row["stale"]:
                return row
        raise RuntimeError(f"the inbox rotated under {STALE_TRIES} runs of one statement in a row")

    return run


NOT_YET = ("the partitioned inbox (INBOX_PARTITION_SECONDS) does not carry {what} yet:"
           " use the plain table (INBOX_PARTITION_SECONDS=0) for it")
