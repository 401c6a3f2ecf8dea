"""A repeat of a key the endpoint's own process finished is answered from memory, with no read of the
inbox, until the earliest expiry its record can have; then from the inbox again. Over real HTTP, on
SQLite and PostgreSQL (asyncpg and psycopg), on the three paths."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from consumer_kit.store import Inbox
from consumer_kit.testing.server import served_asgi
from tests.conftest import make_settings
from tests.integration.idempotent_app import build


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call of the inbox methods that read (or claim) a key, in this process."""
    calls: list[str] = []
    for name in ("look", "lookup", "claim", "hold"):
        original = getattr(Inbox, name)

        async def counted(self: Inbox, *args: Any, _original: Any = original, _name: str = name, **kw: Any) -> Any:
            calls.append(_name)
            return await _original(self, *args, **kw)

        monkeypatch.setattr(Inbox, name, counted)
    return calls


async def post(http: httpx.AsyncClient, path: str, key: str, order: dict[str, Any]) -> httpx.Response:
    return await http.post(path, json=order, headers={"Idempotency-Key": f'"{key}"'})


async def test_repeats_are_answered_from_memory_until_the_record_could_expire(database_url: str,
                                                                              reads: list[str]) -> None:
    # A retention of 33 s over a 30 s lease: what this process wrote is remembered until the earliest
    # expiry its record can have, 33 s less a lease after the request began: 3 s.
    api = build(make_settings(database_url, inbox_retention_seconds=33, inbox_lease_seconds=30))
    async with served_asgi(api) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
        for path in ("/labels", "/one", "/staged"):
            key, ticket = uuid.uuid4().hex, uuid.uuid4().hex
            first = await post(http, path, key, {"ticket": ticket})
            assert first.status_code == 201, path
            reads.clear()
            repeats = [await post(http, path, key, {"ticket": ticket}) for _ in range(5)]
            assert all(r.headers.get("idempotency-replayed") == "true" and r.content == first.content for r in repeats)
            other = await post(http, path, key, {"ticket": ticket, "size": 1})
            assert (other.status_code, other.json()["error"]) == (422, "idempotency_key_reused")
            assert reads == [], (path, reads)


async def test_a_repeat_sent_as_before_is_not_fingerprinted_again(database_url: str, reads: list[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A repeat with the very bytes of a request the key is known to answer is replayed without parsing
    # its JSON again; the same object written another way is fingerprinted once, then known too; a
    # different request under the key is still a different request.
    from consumer_kit.http.idempotency import operation

    fingerprinted: list[str] = []

    def counted(*args: Any, **kw: Any) -> str:
        fingerprinted.append(args[1])
        return fingerprint(*args, **kw)

    fingerprint = operation.fingerprint
    monkeypatch.setattr(operation, "fingerprint", counted)
    api = build(make_settings(database_url))
    async with served_asgi(api) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
        for path in ("/labels", "/one", "/staged"):
            key, ticket = uuid.uuid4().hex, uuid.uuid4().hex
            headers = {"Idempotency-Key": f'"{key}"', "Content-Type": "application/json"}
            sent = f'{{"ticket": "{ticket}"}}'.encode()
            first = await http.post(path, content=sent, headers=headers)
            assert first.status_code == 201, path
            fingerprinted.clear()
            reads.clear()
            again = [await http.post(path, content=sent, headers=headers) for _ in range(3)]
            assert all(a.content == first.content and a.headers["idempotency-replayed"] == "true" for a in again)
            assert fingerprinted == [], path
            respaced = f'{{ "ticket" :"{ticket}" }}'.encode()  # the same object, other bytes
            twice = [await http.post(path, content=respaced, headers=headers) for _ in range(2)]
            assert all(t.content == first.content for t in twice)
            assert fingerprinted == [path], path  # the first of them only: then its bytes are known
            other = await http.post(path, content=f'{{"ticket": "{ticket}", "size": 2}}'.encode(), headers=headers)
            assert (other.status_code, other.json()["error"]) == (422, "idempotency_key_reused"), path
            assert reads == [], (path, reads)


async def test_a_key_finished_elsewhere_is_read_once_then_remembered(database_url: str, reads: list[str]) -> None:
    settings = make_settings(database_url)
    async with served_asgi(build(settings)) as one, served_asgi(build(settings)) as two, \
            httpx.AsyncClient(timeout=30) as http:
        key, ticket = uuid.uuid4().hex, uuid.uuid4().hex
        first = await post(http, f"{one}/labels", key, {"ticket": ticket})
        assert first.status_code == 201
        reads.clear()
        answers = [await post(http, f"{two}/labels", key, {"ticket": ticket}) for _ in range(6)]
        assert all(a.status_code == 201 and a.content == first.content for a in answers)
        if database_url.startswith("sqlite"):  # no shared reads on SQLite: each repeat is claimed, and read
            assert reads.count("claim") == 6
        else:  # the other process claimed it (finding it done), then, repeats being most of what it saw,
            # looked it up and remembered it
            assert 1 <= len(reads) <= 3, reads


async def test_past_the_earliest_expiry_the_inbox_answers_again(database_url: str, reads: list[str]) -> None:
    api = build(make_settings(database_url, inbox_retention_seconds=32, inbox_lease_seconds=30))
    async with served_asgi(api) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
        key, ticket = uuid.uuid4().hex, uuid.uuid4().hex
        first = await post(http, "/staged", key, {"ticket": ticket})
        assert first.status_code == 201
        await asyncio.sleep(2.1)  # remembered until 32 s - 30 s after it began
        reads.clear()
        again = await post(http, "/staged", key, {"ticket": ticket})
        assert again.headers.get("idempotency-replayed") == "true" and again.content == first.content
        assert reads, "past its earliest expiry, the key was answered without a read"
